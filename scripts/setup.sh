#!/usr/bin/env bash
# Sets up kvbridge, its engines and its test tools in a project virtual
# environment (.venv), so the system's Python is never modified: Debian 12
# and Ubuntu 24.04 mark it externally managed and pip refuses to touch it.
# Works as root or as a user with sudo (needed only when a Debian package is
# missing). A re-run with nothing changed checks what is installed and exits
# in about a second; every failure stops the script with a message.
#
#   bash scripts/setup.sh && .venv/bin/kvbridge demo
#
# PYTHON       the interpreter the environment is made from (default: python3, >= 3.10)
# KVBRIDGE_VENV  where the environment goes (default: .venv in the repository)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVBRIDGE_VENV:-.venv}
VPY="$VENV/bin/python"

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

command -v "$PY" >/dev/null || die "no '$PY' on PATH; install Python >= 3.10 (apt-get install python3) or set PYTHON"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "$PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); kvbridge needs >= 3.10 (set PYTHON)"
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# -- Debian packages -----------------------------------------------------------
# Mooncake's engine links against libibverbs, librdmacm and libnuma
# (docs/engines.md). Debian and Ubuntu ship `python3 -m venv`'s ensurepip in a
# separate package. dpkg's own database says what is installed: no pipelines
# whose exit status depends on timing.
packages=(libibverbs1 librdmacm1 libnuma1)
"$PY" -c 'import ensurepip' 2>/dev/null || packages+=("python$pyver-venv")
missing=()
if command -v dpkg-query >/dev/null; then
  for pkg in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null) || status="not known to dpkg"
    [ "$status" = installed ] || missing+=("$pkg")
  done
else
  say "no dpkg-query (not Debian or Ubuntu): make sure your system's equivalents of ${packages[*]} are installed"
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null; then
    as_root=(sudo)
  else
    die "missing Debian packages: ${missing[*]}; as root run: apt-get install ${missing[*]}"
  fi
  say "installing Debian packages: ${missing[*]}"
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# -- the virtual environment ---------------------------------------------------
if ! "$VPY" -c '' 2>/dev/null; then
  if [ -e "$VENV" ]; then
    [ -f "$VENV/pyvenv.cfg" ] || die "$VENV exists and is not a virtual environment; move it away or set KVBRIDGE_VENV"
    say "recreating $VENV: its interpreter no longer runs"
    rm -rf "$VENV"
  fi
  say "creating the virtual environment $VENV (Python $pyver from $(command -v "$PY"))"
  "$PY" -m venv "$VENV"
fi

# What a complete set-up can import; run after installing, and instead of it on a re-run.
installed_ok() {
  "$VPY" - <<'EOF'
import importlib.metadata as md, pathlib, sys
import kvbridge, kvbridge_zmq, mooncake.engine, nixl_cu12, ucxx, xxhash  # noqa: F401  (the engines load)
here = pathlib.Path.cwd().resolve()
if not pathlib.Path(kvbridge.__file__).resolve().is_relative_to(here / "src"):
    sys.exit(f"kvbridge in the environment is {kvbridge.__file__}, not this checkout's")
if md.version("torch").split("+")[0] != "2.13.0":
    sys.exit(f"torch {md.version('torch')} is installed, expected 2.13.0 (CPU)")
EOF
}

bash scripts/setup-vllm.sh  # vLLM 0.33.0 (no CUDA) for tests/integrations/vllm; before the check below so re-runs keep it current
# The inputs of the installation; unchanged inputs and a working environment mean nothing to do.
stamp="$VENV/.kvbridge-setup"
inputs=$(cat scripts/setup.sh pyproject.toml examples/kvbridge-zmq/pyproject.toml "$VENV/pyvenv.cfg" | sha256sum)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] && installed_ok 2>/dev/null; then
  say "$VENV is up to date; nothing to do"
  exit 0
fi
rm -f "$stamp"

# torch==2.13.0 is the CPU wheel pip's configured find-links provide: NIXL's
# wheel depends on torch, and an unpinned torch pulls several GB of CUDA
# packages. One pip call, so one resolution covers everything.
say "installing kvbridge (editable) with every engine, torch 2.13.0 (CPU), the test tools and the example plugin into $VENV"
# pip's exit status is kept; only its notes about configured index folders
# that lack a package (local mirrors) are dropped from stderr.
"$VPY" -m pip install --quiet --disable-pip-version-check \
  torch==2.13.0 -e '.[all,checksum,dev]' -e examples/kvbridge-zmq \
  2> >(grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory.$" >&2)
installed_ok || die "the installation finished but the check above failed"
echo "$inputs" >"$stamp"
say "done: $VENV/bin/kvbridge demo, $VENV/bin/python -m pytest -q"
