#!/usr/bin/env bash
# Sets up .venv-sglang: SGLang 0.5.23 (the release kvbridge's SGLang integration is
# tested against) for the tests in tests/integrations/sglang. Called by
# scripts/setup.sh after .venv is complete; a re-run with nothing changed exits at once.
#
# Why an environment of its own: SGLang's own dependency set pins torch 2.14.1,
# CUDA kernels and ~80 packages, none of which its PD-transfer code imports on a
# CPU host. So pip never resolves it: SGLang is installed with --no-deps, plus
# exactly the packages its imports ask for (pinned below). The environment adds
# .venv's site-packages after its own (one .pth line), so it shares .venv's torch
# 2.13.0 (CPU), NIXL and the editable kvbridge; nothing is installed into .venv.
#
# torchvision: SGLang's model-config package imports it at import time. The only
# 0.28.0 wheel (the one matching torch 2.13) is a CUDA build whose compiled ops
# cannot load on CPU torch, and its import then fails declaring fake kernels for
# two of them. _kvbridge_torchvision_ops.py (written below) declares those two op
# schemas before torchvision imports; calling a torchvision op still fails (no
# kernel); SGLang's transfer code never calls one.
#
# KVBRIDGE_VENV  .venv to layer on (default .venv); SGLANG_VENV  where this one goes (.venv-sglang)
#
# --prepare: install only, while scripts/setup.sh is still installing .venv (it runs this in the
# background to use the second core, then runs this script again without --prepare, which checks
# the result against the finished .venv and records it; nothing is installed twice).
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN=${KVBRIDGE_VENV:-.venv}
VENV=${SGLANG_VENV:-.venv-sglang}
VPY="$VENV/bin/python"

say() { echo "setup-sglang: $*"; }
die() { echo "setup-sglang: error: $*" >&2; exit 1; }

PREPARE=0
case "${1-}" in
  --prepare) PREPARE=1 ;;
  "") ;;
  *) die "unknown argument '$1'; expected none or --prepare" ;;
esac
if [ "$PREPARE" = 1 ]; then
  "$MAIN/bin/python" -c '' 2>/dev/null || die "$MAIN has no working Python yet; scripts/setup.sh creates it first"
else
  "$MAIN/bin/python" -c 'import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ("kvbridge", "torch", "nixl_cu12")))' 2>/dev/null \
    || die "$MAIN is not a complete kvbridge environment; run scripts/setup.sh first"
fi

# SGLang and the packages its disaggregation, memory-pool and plugin modules import
# (found by importing them; pins from SGLang's own requirements where it has them).
PINS=(
  sglang==0.5.23 transformers==5.19.0 tokenizers==0.23.2 huggingface-hub==2.4.0 safetensors==0.8.0
  compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 openai==2.8.0 triton==3.9.0
  torchvision==0.28.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  starlette==1.10.0 anyio==4.16.0 sniffio==1.3.1 h11==0.16.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 pillow==13.0.0 tqdm==4.70.1 ipython==9.18.1 traitlets==5.16.1
  dill==0.4.1 regex==2026.11.19 pyyaml==6.0.4 loguru==0.7.3 gguf==0.19.0 partial-json-parser==0.2.1.1.post7
  einops==0.8.2 httpx==0.28.1 distro==1.9.0
)

main_site=$("$MAIN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
main_site=$(cd "$main_site" && pwd)

installed_ok() {
  "$VPY" - "${PINS[@]}" <<'EOF'
import importlib.metadata as md, sys
bad = []
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        got = md.version(name)
    except md.PackageNotFoundError:
        got = None
    if got is None or got.split("+")[0] != want:
        bad.append(f"{name} {got} (want {want})")
import importlib.util
missing = [m for m in ("_kvbridge_torchvision_ops", "kvbridge", "torch") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"cannot find {missing} (the torchvision shim, and .venv's kvbridge and torch through the layering .pth)")
if bad:
    sys.exit("not as pinned: " + ", ".join(bad))
EOF
}

stamp="$VENV/.kvbridge-setup-sglang"
inputs=$( (cat scripts/setup-sglang.sh "$MAIN/pyvenv.cfg"; echo "$main_site") | sha256sum)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] && installed_ok 2>/dev/null; then
  say "$VENV is up to date; nothing to do"
  exit 0
fi
# Installed by --prepare with the same inputs: checked now that .venv is complete, then recorded.
if [ "$PREPARE" = 0 ] && [ -f "$stamp.prepared" ] && [ "$(cat "$stamp.prepared")" = "$inputs" ] && installed_ok; then
  mv "$stamp.prepared" "$stamp"
  say "done: $VPY -m pytest tests/integrations/sglang (tests/test_sglang_suite.py runs it from the main suite)"
  exit 0
fi
rm -f "$stamp" "$stamp.prepared"

if ! "$VPY" -c '' 2>/dev/null; then
  rm -rf "$VENV"
  base=$("$MAIN/bin/python" -c 'import sys; print(sys._base_executable)')
  say "creating $VENV (from $base), layered on $MAIN"
  "$base" -m venv "$VENV"
fi
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Its own packages first, then .venv's (with .venv's own .pth files: the editable kvbridge).
echo "import site; site.addsitedir('$main_site')" >"$site/zz-kvbridge-main-venv.pth"
cat >"$site/_kvbridge_torchvision_ops.py" <<'EOF'
"""Written by kvbridge's scripts/setup-sglang.sh: lets the CUDA torchvision 0.28.0 wheel import on CPU torch.

Its compiled ops do not load without CUDA torch, and its import then fails registering
fake kernels for two ops it never loaded; declaring their schemas first lets the
pure-Python parts import. Calling a torchvision op still fails (no kernel).
"""
import importlib.abc
import sys

_libs = []


class _DeclareOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _libs.append(lib)
        return None  # the ordinary finders import torchvision itself


sys.meta_path.insert(0, _DeclareOps())
EOF
echo "import _kvbridge_torchvision_ops" >"$site/_kvbridge_torchvision_ops.pth"

# --no-compile: byte-compiling its ~10,000 modules costs ~35 s of CPU here; the few hundred the
# tests import are compiled when first imported.
say "installing SGLang 0.5.23 (no dependency resolution) and the ${#PINS[@]} pinned packages its imports need into $VENV"
"$VPY" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile "${PINS[@]}" \
  2> >(grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory.$" >&2)
if [ "$PREPARE" = 1 ]; then  # kvbridge and torch, which installed_ok finds through .venv, may not be there yet
  echo "$inputs" >"$stamp.prepared"
  say "installed; scripts/setup.sh checks it once .venv is complete"
  exit 0
fi
installed_ok || die "the installation finished but the check above failed"
echo "$inputs" >"$stamp"
say "done: $VPY -m pytest tests/integrations/sglang (tests/test_sglang_suite.py runs it from the main suite)"
