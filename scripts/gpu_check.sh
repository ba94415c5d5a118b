#!/usr/bin/env bash
# The GPU test and benchmark set, for a CUDA machine without a package index.
#
# Bring the wheels it lacks in .whl/ (kvbridge's own, built with `pip wheel --no-deps -w .whl .`, plus
# nixl-cu13, msgspec and pyzmq for that machine's Python), then run `bash scripts/gpu_check.sh` there.
# Writes gpu-tests.log, kernel.{txt,json}, host.{txt,json} (STEPS=host), bench{,-4g}.{txt,json}, staging-tests.log,
# staging.txt, staging-{32,256}.json, layerwise.txt, demo.txt, request.{txt,json} and trace.txt (STEPS=request), cold.txt (STEPS=cold),
# checksum-tests.log and checksum.{txt,json} (STEPS=checksum), gpustage-tests.log and gpustage.{txt,json} (STEPS=gpustage),
# gpuwin-tests.log, gpuwin-64.{txt,json} and gpuwin-4.{txt,json} (STEPS=gpuwin), bigreq-*.{txt,json} and
# bigreq-host.{txt,json} (STEPS=bigreq) to $OUT (default ./gpu-out).
# KERNEL_TUNE=1 also tries several program sizes and warp counts for the copy kernel. STEPS picks parts
# (default "tests conformance kernel bench staging demo layerwise"; "host" alone: the host breakdown, which "kernel" includes), e.g.
# STEPS="layerwise demo" to fit a shorter session.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} UCX_MODULES=${UCX_MODULES:-^ib}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvb-site .whl/*.whl \
    || { echo "gpu_check: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/kvb-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # this checkout's code (a carried wheel may be older)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import sys, torch, triton, kvbridge; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'kvbridge', kvbridge.__version__, 'GPUs', torch.cuda.device_count())" | tee -a "$OUT/machine.txt"
python3 -m kvbridge.cli plugins | tee -a "$OUT/machine.txt"
rc=0
STEPS=" ${STEPS:-tests conformance kernel bench staging demo layerwise} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
# (Each step in braces: "want X && cmd || rc=1" would fail the run for every step not wanted.)
want tests && { python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_lanes.py \
  "tests/test_conformance.py::TestNixl" -k "gpu or layerwise or lane" \
  2>&1 | tee "$OUT/gpu-tests.log" || rc=1; }
# The same-host GPU copy is a backend like any other: the conformance suite, on GPU buffers.
want conformance && { python3 -m kvbridge.cli conformance cuda_ipc -q -p no:cacheprovider -rs \
  2>&1 | tee "$OUT/conformance.log" | tail -15 || rc=1; }
# BASELINE=DIR: the same bench with the kvbridge wheel in DIR (an older version), interleaved with this
# checkout's ROUNDS times (default 1) in one call on one machine, so drift shows as drift, not as a change.
if [ -n "${BASELINE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvb-old "$BASELINE"/*.whl .whl/[!k]*.whl || rc=1
fi
if want bench && [ -n "${BASELINE:-}" ]; then
  for round in $(seq "${ROUNDS:-1}"); do
    PYTHONPATH=/tmp/kvb-old python3 -m kvbridge.cli bench transfer --device cuda --json "$@" \
      > "$OUT/bench-before-$round.json" 2> "$OUT/bench-before-$round.txt" || rc=1
    tail -30 "$OUT/bench-before-$round.txt"
    python3 -m kvbridge.cli bench transfer --device cuda --json "$@" \
      > "$OUT/bench-after-$round.json" 2> "$OUT/bench-after-$round.txt" || rc=1
    tail -30 "$OUT/bench-after-$round.txt"
  done
fi
# Per-request cost on this host's CPU (#27's numbers): small requests through the whole control plane.
# With BASELINE: the baseline's figures first, then this checkout's, ROUNDS times, in one call.
want request && { for round in $(seq "${ROUNDS:-1}"); do
  if [ -n "${BASELINE:-}" ]; then
    PYTHONPATH=/tmp/kvb-old python3 -m kvbridge.cli bench request --backends nixl,memory --json \
      > "$OUT/request-before-$round.json" 2> "$OUT/request-before-$round.txt" || rc=1
  fi
  python3 -m kvbridge.cli bench request --backends nixl,memory --json > "$OUT/request-$round.json" 2> "$OUT/request-$round.txt" || rc=1
done
python3 -m kvbridge.cli bench request --backends nixl --trace > "$OUT/trace.txt" 2>&1 || rc=1
tail -40 "$OUT/trace.txt"; }
# A large request end to end (#27, STEPS=bigreq): 1 GiB of scattered 4 and 64 KiB pages, prefill's send to SUCCESS
# (fast ms, the fast_latency_ms column) beside the write (fast GB/s) and D2D; with BASELINE the baseline's first,
# ROUNDS times, in one call. Then the same requests' host work on this host's CPU, CUDA faked, every step of a
# request traced from decode's Receiver.init to its SUCCESS (benchmarks/gpu_host_bench.py --trace).
want bigreq && { for round in $(seq "${ROUNDS:-1}"); do
  if [ -n "${BASELINE:-}" ]; then
    PYTHONPATH=/tmp/kvb-old python3 -m kvbridge.cli bench transfer --device cuda --page-kib 4 64 --total-mib 1024 \
      --reps 10 --json > "$OUT/bigreq-before-$round.json" 2> "$OUT/bigreq-before-$round.txt" || rc=1
    tail -8 "$OUT/bigreq-before-$round.txt"
  fi
  python3 -m kvbridge.cli bench transfer --device cuda --page-kib 4 64 --total-mib 1024 --reps 10 --json \
    > "$OUT/bigreq-$round.json" 2> "$OUT/bigreq-$round.txt" || rc=1
  tail -8 "$OUT/bigreq-$round.txt"
done
python3 benchmarks/gpu_host_bench.py --page-kib 4 64 --total-mib 1024 --reps 9 --trace --json \
  > "$OUT/bigreq-host.json" 2> "$OUT/bigreq-host.txt" || rc=1
tail -100 "$OUT/bigreq-host.txt"; }
want kernel && { python3 benchmarks/gpu_kernel_bench.py --json ${KERNEL_TUNE:+--tune} > "$OUT/kernel.json" 2> "$OUT/kernel.txt" || rc=1
tail -20 "$OUT/kernel.txt"; }
# Where one write's host time goes (copy() vs D2D in one process, step by step); also part of "kernel".
want host && { python3 benchmarks/gpu_kernel_bench.py --host --json > "$OUT/host.json" 2> "$OUT/host.txt" || rc=1
tail -3 "$OUT/host.txt"; }
if want bench; then
  # With BASELINE, the "after" rounds above are this checkout's figures already.
  if [ -z "${BASELINE:-}" ]; then
    python3 -m kvbridge.cli bench transfer --device cuda --json "$@" > "$OUT/bench.json" 2> "$OUT/bench.txt" || rc=1
    tail -30 "$OUT/bench.txt"
  fi
  # 4 GiB per request: the write's fixed host cost (shape, table, launch) spread over more bytes
  python3 -m kvbridge.cli bench transfer --device cuda --page-kib 16 64 --total-mib 4096 --json \
    > "$OUT/bench-4g.json" 2> "$OUT/bench-4g.txt" || rc=1
  tail -6 "$OUT/bench-4g.txt"
fi
# The end-to-end checksum's cost (#28): host and GPU memory in one run, rooms of 64 MiB..4 GiB off and on
# (prefill's send to decode's SUCCESS), hash GB/s; the table goes to checksum.txt, the numbers to checksum.json.
want checksum && { python3 -m pytest -q -p no:cacheprovider -rs tests/test_wmix.py 2>&1 | tee "$OUT/checksum-tests.log" || rc=1
  if [ -n "${BASELINE:-}" ]; then  # the baseline's hash and rooms first, in the same call
    PYTHONPATH=/tmp/kvb-old python3 -m kvbridge.cli bench checksum --device cuda --json > "$OUT/checksum-before.json" \
      2> "$OUT/checksum-before.log" || rc=1
    tail -12 "$OUT/checksum-before.log"
  fi
  python3 -m kvbridge.cli bench checksum --device cpu cuda --json > "$OUT/checksum.json" \
    2> "$OUT/checksum.log" || rc=1
  python3 -c "import json, sys; from kvbridge import ui; from kvbridge.bench.checksum import format_table; \
ui.print_table(format_table(json.load(open(sys.argv[1]))))" "$OUT/checksum.json" > "$OUT/checksum.txt" 2>&1 || rc=1
  cat "$OUT/checksum.txt"; }
# Cold start: the demo in a fresh Triton cache (nothing compiled yet), this checkout and BASELINE's wheel if given:
# its transfer latency p99 and TTFT p99 against the p50 show what the first requests pay for.
if want cold; then
  for v in ${BASELINE:+before} after; do
    pp=$PYTHONPATH; [ "$v" = before ] && pp=/tmp/kvb-old
    echo "== cold start, $v" | tee -a "$OUT/cold.txt"
    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=$pp python3 -m kvbridge.cli demo --device cuda --requests 16 2>&1 \
      | grep -E "latency|TTFT|result|Error|error" | tee -a "$OUT/cold.txt" || rc=1
  done
fi
# GPU staging kernels (kvbridge.plugins.cuda_ipc.staging) and the device seam (kvbridge.staging_torch: unit runs, as
# Staged says a window, and piece addresses): the byte-exact tests on the device, then one gather and one scatter per
# window of 4 KiB .. 1 MiB pieces (32 and 256 MiB) beside a contiguous D2D copy, the seam by unit runs beside by address.
want staging && { python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_staging.py tests/test_gpu_staging_wired.py \
  -k "not sweep and not nixl" 2>&1 | tee "$OUT/staging-tests.log" || rc=1
for w in 32 256; do  # the kernels and the write path's whole call per window (seam), per window size
  python3 benchmarks/gpu_staging_bench.py --window-mib "$w" --json > "$OUT/staging-$w.json" 2>> "$OUT/staging.txt" || rc=1
done
tail -12 "$OUT/staging.txt"; }
# GPU staging wired into the write path (#29): the byte-exact tests (the seam's kernels, then scattered 4 KiB and 64 KiB
# pages VRAM -> VRAM through NIXL, fast path off, staging on), then the plain path with staging off vs on beside the
# fast path, 64 MiB and 1 GiB, 4 and 64 KiB pages. Each part is cut off (timeout) so the step ends within 4 minutes;
# the bench prints each case's line to gpustage.txt as it finishes (64 MiB first).
want gpustage && { timeout "${GPUSTAGE_TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider -rs \
  tests/test_gpu_staging_wired.py tests/test_gpu_staging.py -k "not sweep" 2>&1 | tee "$OUT/gpustage-tests.log" || rc=1
COLUMNS=${COLUMNS:-220} timeout "${GPUSTAGE_BENCH_S:-140}" python3 -m kvbridge.cli bench transfer --device cuda \
  --page-kib 4 64 --total-mib 64 1024 --staging on --reps 5 --json > "$OUT/gpustage.json" 2> "$OUT/gpustage.txt" || rc=1
tail -24 "$OUT/gpustage.txt"; }
# Where a staged GPU window's time goes (#29), and the slice size swept (STEPS=gpuwin): 1 GiB scattered (and its contiguous
# reference) of 64 KiB then 4 KiB pages, fast path off, staging on at 32, 128 and 256 MiB slices (decode's landing
# bounded: landing.device_slots), every staged window traced in both processes; first the sweep's byte-exact test (32 and
# 128 MiB slices, 256 MiB requests, traced). gpuwin-P.json holds the rows (each staged
# path's trace as PATH_trace), gpuwin-P.txt the table then each path's window tables. Each call cut off by timeout.
# DECODE_GPU=1 (a host of two GPUs): decode's pages on GPU 1, so the two processes' kernels do not take turns on one GPU.
want gpuwin && { timeout "${GPUWIN_TESTS_S:-75}" python3 -m pytest -q -p no:cacheprovider -rs \
  tests/test_gpu_staging_wired.py -k sweep 2>&1 | tee "$OUT/gpuwin-tests.log" || rc=1
for p in 64 4; do
  COLUMNS=${COLUMNS:-220} timeout "${GPUWIN_S:-150}" python3 -m kvbridge.cli bench transfer --device cuda --page-kib "$p" \
    ${DECODE_GPU:+--decode-gpu "$DECODE_GPU"} --total-mib 1024 --staging on --slice-mib ${GPUWIN_SLICES:-32 128 256} --reps 5 --trace --json \
    > "$OUT/gpuwin-$p.json" 2> "$OUT/gpuwin-$p.txt" || rc=1
  tail -60 "$OUT/gpuwin-$p.txt"
done; }
want demo && { python3 -m kvbridge.cli demo --device cuda --requests 16 2>&1 | tee "$OUT/demo.txt" | tail -25 || rc=1; }
# Layer-wise sending on the GPU: the synthetic model (a GPU kernel per layer, ready= CUDA events), the demo's
# tiny model, and the demo both ways (is the --layerwise default right on a GPU?).
export COLUMNS=${COLUMNS:-200}
if want layerwise; then
  { python3 -m kvbridge.cli bench layerwise --device cuda && python3 -m kvbridge.cli bench layerwise --device cuda --model tiny; } \
    > "$OUT/layerwise.txt" 2>&1 || rc=1
  tail -12 "$OUT/layerwise.txt"
  for lw in --layerwise --no-layerwise; do
    python3 -m kvbridge.cli demo --device cuda --requests 32 --concurrency 1 $lw 2>&1 | tee -a "$OUT/demo.txt" | tail -25 || rc=1
  done
fi
if want bench && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python3 -m kvbridge.cli bench transfer --device cuda --decode-gpu 1 --page-kib 16 64 --total-mib 1024 --json \
    > "$OUT/bench-2gpu.json" 2> "$OUT/bench-2gpu.txt" || rc=1
fi
exit $rc
