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
# PyTorch: the demo's tiny model (and the tests of torch-tensor pools) need the
# CPU build of torch 2.13.0; kvbridge and its engines do not (nixl-cu12 declares
# torch but never imports it, so it is installed without its dependencies). The
# CPU build is taken from pip's configured sources or PyTorch's CPU index and
# never from PyPI, whose Linux torch is the CUDA build (~7 GB of nvidia-*
# wheels). Where neither has it the script stops within seconds and says what
# to do.
#
# PYTHON               the interpreter the environment is made from (default: python3, >= 3.10)
# KVBRIDGE_VENV        where the environment goes (default: .venv in the repository)
# KVBRIDGE_TORCH       cpu (default): install torch 2.13.0+cpu or stop; none: no torch (no demo,
#                      the torch tests skip)
# KVBRIDGE_TORCH_INDEX where else to look for the CPU build (default: PyTorch's CPU wheel index,
#                      https://download.pytorch.org/whl/cpu; empty: pip's configured sources only)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVBRIDGE_VENV:-.venv}
VPY="$VENV/bin/python"
TORCH_MODE=${KVBRIDGE_TORCH:-cpu}
TORCH_INDEX=${KVBRIDGE_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
TORCH_PIN="torch==2.13.0+cpu"   # the local version "+cpu" cannot match the CUDA build
NIXL_PIN="nixl-cu12>=1.5"       # as pyproject's nixl extra; installed with --no-deps (see above)

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

case "$TORCH_MODE" in cpu|none) ;; *) die "KVBRIDGE_TORCH=$TORCH_MODE; expected cpu or none" ;; esac
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

# What a complete set-up can import, and that torch (if any) is the CPU build and
# no CUDA runtime wheel came in; run after installing, and instead of it on a re-run.
installed_ok() {
  KVBRIDGE_TORCH_MODE=$TORCH_MODE "$VPY" - <<'PYEOF'
import importlib.metadata as md, os, pathlib, sys
import kvbridge, kvbridge_zmq, mooncake.engine, nixl_cu12, ucxx, xxhash, xdist  # noqa: F401  (the engines load)
here = pathlib.Path.cwd().resolve()
if not pathlib.Path(kvbridge.__file__).resolve().is_relative_to(here / "src"):
    sys.exit(f"kvbridge in the environment is {kvbridge.__file__}, not this checkout's")
try:
    torch = md.version("torch")
except md.PackageNotFoundError:
    torch = None
if os.environ["KVBRIDGE_TORCH_MODE"] == "cpu" and torch != "2.13.0+cpu":
    sys.exit(f"torch {torch} is installed, expected 2.13.0+cpu (the CPU build)")
# nvidia-ml-py is NVML's Python binding (kilobytes, no CUDA runtime): ucxx needs it.
cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if d.metadata["Name"].lower().startswith("nvidia-") and d.metadata["Name"].lower() != "nvidia-ml-py")
if cuda:
    sys.exit(f"CUDA runtime wheels are installed ({', '.join(cuda)}): a CUDA build of torch came in; "
             f"remove {os.environ.get('VIRTUAL_ENV', '.venv')} and run scripts/setup.sh again")
PYEOF
}

# The inputs of the installation; unchanged inputs and a working environment mean nothing to do.
stamp="$VENV/.kvbridge-setup"
inputs=$( (cat scripts/setup*.sh pyproject.toml examples/kvbridge-zmq/pyproject.toml "$VENV/pyvenv.cfg"; echo "$TORCH_MODE") | sha256sum)
up_to_date=0
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] && installed_ok 2>/dev/null && up_to_date=1

# -- integrations: the frameworks' own code for tests/integrations (each needs torch) ------------
# SGLang's test environment, .venv-sglang (scripts/setup-sglang.sh). When .venv is (re)installed,
# its packages install meanwhile on the other core (--prepare, output in $VENV/.sglang-prepare.log);
# on success (a re-run that has nothing to do included) setup-sglang.sh checks and records it, or
# installs what is missing. A failed set-up stops the background install.
sglang_pid=
if [ "$TORCH_MODE" != none ]; then
  if [ "$up_to_date" = 0 ]; then
    # Its own session, so that a failure here stops pip too (kill the group).
    setsid bash scripts/setup-sglang.sh --prepare >"$VENV/.sglang-prepare.log" 2>&1 &
    sglang_pid=$!
  fi
  trap 'status=$?
    if [ -n "$sglang_pid" ]; then
      [ "$status" = 0 ] || kill -- "-$sglang_pid" 2>/dev/null || true
      if wait "$sglang_pid"; then cat "$VENV/.sglang-prepare.log"
      elif [ "$status" = 0 ]; then
        cat "$VENV/.sglang-prepare.log" >&2; echo "setup: error: installing .venv-sglang failed (its output is above)" >&2; status=1
      fi
    fi
    [ "$status" != 0 ] || bash scripts/setup-sglang.sh || status=$?; exit "$status"' EXIT
fi
# vLLM 0.33.0 (no CUDA) into this environment; before returning on an up-to-date .venv, so re-runs keep it current.
[ "$TORCH_MODE" = none ] || bash scripts/setup-vllm.sh

if [ "$up_to_date" = 1 ]; then
  say "$VENV is up to date; nothing to do"
  exit 0
fi
rm -f "$stamp"

# pip with short network limits for the probes, so an unreachable index fails in
# seconds (pip's default is 5 retries of up to 180 s each); its notes about
# configured index folders that lack a package (local mirrors) are dropped.
pip_() {
  "$VPY" -m pip --disable-pip-version-check "$@" \
    2> >(grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory.$" >&2)
}
probe() { pip_ install --dry-run --ignore-installed --no-deps --quiet --timeout 15 --retries 1 "$@"; }

# -- can pip reach its package sources? (seconds, not minutes) --------------------
if ! probe 'pluggy>=1.3' >/dev/null 2>"$VENV/.probe.log"; then
  die "pip cannot fetch packages from its configured sources ($(tail -n 1 "$VENV/.probe.log")); check the network, a proxy (HTTPS_PROXY) or pip's index settings (pip config list), then run this again"
fi

# -- torch: the CPU build or nothing ----------------------------------------------
# Looked up first in pip's own sources, then in $TORCH_INDEX; that index is
# passed to the one pip call that installs torch, never to the others (an
# unreachable extra index would slow every lookup down).
torch_from=()
if [ "$TORCH_MODE" = cpu ]; then
  have=$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null) || have=none
  if [ "$have" = 2.13.0+cpu ]; then
    :
  elif probe "$TORCH_PIN" >/dev/null 2>"$VENV/.probe.log"; then
    torch_from=("$TORCH_PIN")
  elif [ -n "$TORCH_INDEX" ] && probe --extra-index-url "$TORCH_INDEX" "$TORCH_PIN" >/dev/null 2>"$VENV/.probe.log"; then
    torch_from=(--extra-index-url "$TORCH_INDEX" "$TORCH_PIN")
  else
    why=$(grep -m1 'No matching distribution' "$VENV/.probe.log" || tail -n 1 "$VENV/.probe.log")
    grep -q -E 'NewConnectionError|Name or service not known|timed out' "$VENV/.probe.log" && why="$why (an index could not be reached)"
    die "no CPU build of torch 2.13.0 ($TORCH_PIN) in pip's sources${TORCH_INDEX:+ or $TORCH_INDEX}; pip says: $why
  The demo's model needs it; PyPI's Linux torch is the CUDA build (~7 GB of nvidia-* wheels) and is not installed on purpose. Either:
  - make the CPU build reachable: KVBRIDGE_TORCH_INDEX=<a mirror of https://download.pytorch.org/whl/cpu> bash scripts/setup.sh,
    or put torch-2.13.0+cpu-cp${pyver/./}-*.whl in a folder and: PIP_FIND_LINKS=<folder> bash scripts/setup.sh
  - or go without torch (no kvbridge demo; the torch tests skip): KVBRIDGE_TORCH=none bash scripts/setup.sh"
  fi
fi
rm -f "$VENV/.probe.log"

# -- install ---------------------------------------------------------------------
# pip shows each download with its size (and a progress bar on a terminal).
# --no-compile: pip would byte-compile every module of every package (about 7,000 files,
# ~25 s of CPU here); Python compiles the ones that are imported on first import instead (where it may
# write bytecode; where it may not, see below).
if [ ${#torch_from[@]} -gt 0 ]; then
  say "installing $TORCH_PIN (about 200 MB to download)"
  pip_ install --no-compile --progress-bar on "${torch_from[@]}" || die "pip install $TORCH_PIN failed (its message is above)"
fi
say "installing kvbridge (editable) with the mooncake and ucx engines, the test tools and the example plugin into $VENV"
pip_ install --no-compile --progress-bar on -e '.[mooncake,ucx,checksum,dev]' -e examples/kvbridge-zmq \
  || die "pip install failed (its message is above)"
say "installing $NIXL_PIN without its dependencies (it declares torch but does not import it)"
pip_ install --no-compile --progress-bar on --no-deps "$NIXL_PIN" || die "pip install $NIXL_PIN failed (its message is above)"

installed_ok || die "the installation finished but the check above failed"
# Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE set, as on the machine this project's CI runs on), every
# process compiles every module it imports again: import torch took 4.0 CPU-s instead of 2.5, vLLM's config
# 16 instead of 7, and the test suite starts hundreds of processes. Then compile the environment and the
# checkout once, on every core (about 30 s on 2 cores); a few modules that are not Python 3 fail, harmlessly.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  say "Python writes no bytecode here (PYTHONDONTWRITEBYTECODE is set): compiling $VENV and the checkout once"
  "$VPY" -m compileall -q -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    src tests examples benchmarks >/dev/null 2>&1 || true
fi
echo "$inputs" >"$stamp"
[ "$TORCH_MODE" = none ] && say "no torch (KVBRIDGE_TORCH=none): kvbridge demo is not available; the torch tests skip"
say "done: $VENV/bin/kvbridge demo, $VENV/bin/python -m pytest -q"
