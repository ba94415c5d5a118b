#!/usr/bin/env bash
# Installs vLLM 0.33.0 into kvbridge's environment (.venv) for KVBridgeConnector's
# tests (tests/integrations/vllm), without vLLM's CUDA dependency set: vLLM
# itself with --no-deps, then only the packages its scheduler, config and
# connector imports need, pinned, also with --no-deps (no resolution can pull
# torch 2.14 or CUDA wheels; torch stays the CPU 2.13.0 that setup.sh pins).
# Adds no package kvbridge's own tests use and changes none of their versions.
# scripts/setup.sh runs it before its own up-to-date check (so it runs on
# every set-up; it needs neither torch nor kvbridge installed yet); a re-run
# with nothing changed exits in a fraction of a second. pip reports vLLM's
# unmet pins (torch==2.14.0, CUDA kernels): expected, nothing resolves them.
# --no-compile: vLLM has thousands of modules; the few the tests import are
# compiled when first imported (a fresh install: 43 s instead of 2m48s here).
#
# KVBRIDGE_VENV  the environment (default: .venv, made by scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVBRIDGE_VENV:-.venv}
VPY="$VENV/bin/python"

say() { echo "setup-vllm: $*"; }
die() { echo "setup-vllm: error: $*" >&2; exit 1; }

"$VPY" -c '' 2>/dev/null || die "$VENV has no working Python; run scripts/setup.sh first"

# What vLLM 0.33.0's imports ask for on a CPU-only host (found by importing its scheduler, configs,
# connector factory and worker utilities), at versions its own metadata allows.
packages=(
  vllm==0.33.0
  annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.11 cachetools==8.0.2
  cbor2==6.3.0 click==8.5.1 cloudpickle==3.1.3 einops==0.8.2 fastapi==0.136.3 h11==0.16.0 hf-xet==1.8.0
  httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 jiter==0.19.0 llguidance==1.7.6 openai==3.57.0
  oss-harmony==0.0.11 partial-json-parser==0.2.1.1.post7 pillow==13.0.0 psutil==7.2.2 py-cpuinfo==9.0.0
  pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 PyYAML==6.0.4 regex==2026.11.19 safetensors==0.8.0
  shellingham==1.5.4 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.20.2
  truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5 uvloop==0.23.0 xgrammar==0.2.8
)

installed_ok() {
  "$VPY" - "${packages[@]}" <<'PYEOF'
import importlib.metadata as md, sys
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(f"{name} is not installed")
    if have != want:
        sys.exit(f"{name} {have} is installed, expected {want}")
PYEOF
}

stamp="$VENV/.kvbridge-setup-vllm"
inputs=$(cat scripts/setup-vllm.sh "$VENV/pyvenv.cfg" | sha256sum)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] && installed_ok 2>/dev/null; then
  say "vLLM 0.33.0 is up to date in $VENV; nothing to do"
  exit 0
fi
rm -f "$stamp"
say "installing vLLM 0.33.0 and $((${#packages[@]} - 1)) pinned packages (no dependency resolution) into $VENV"
"$VPY" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile "${packages[@]}" \
  2> >(grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory.$" >&2)
installed_ok || die "the installation finished but the check above failed"
echo "$inputs" >"$stamp"
say "done"
