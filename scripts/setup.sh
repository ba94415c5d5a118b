#!/usr/bin/env bash
# Installs everything kvbridge, its engines and its tests need, on a fresh
# machine or an already set-up one (each step is skipped when satisfied).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Mooncake's engine links against these (docs/engines.md).
missing=()
for lib in libibverbs.so.1 librdmacm.so.1 libnuma.so.1; do
  ldconfig -p | grep -q "$lib" || missing+=("$lib")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages for ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null
fi

pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: \(Location\|Running pip as\)" || true; }
# CPU torch first: NIXL's wheel depends on torch, and an unpinned torch pulls
# several GB of CUDA packages.
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU)"
  pip_q torch==2.13.0
fi
echo "setup: installing kvbridge with all engines and test tools"
pip_q -e '.[all,dev]'
echo "setup: installing the example plugin kvbridge-zmq (its conformance test runs with kvbridge's)"
pip_q -e examples/kvbridge-zmq
"$PY" -c "import kvbridge, kvbridge_zmq, torch, mooncake.engine, nixl_cu12, ucxx" || { echo "setup: an engine failed to import" >&2; exit 1; }
