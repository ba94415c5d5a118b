#!/usr/bin/env bash
# The whole `kvbridge demo` matrix, outside CI (CI runs a few cells: tests/test_demo.py):
# every available backend x prefill TP -> decode TP in 2->1, 1->2, 2->4 x draft head on/off.
#   bash scripts/demo_matrix.sh                 # every available backend
#   BACKENDS="nixl ucx" bash scripts/demo_matrix.sh --device cuda
# Extra arguments go to every `kvbridge demo` run. Prints one line per cell; exits 1 if any failed.
set -uo pipefail
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} UCX_MODULES=${UCX_MODULES:-^ib} MC_LOG_LEVEL=${MC_LOG_LEVEL:-WARNING}
BACKENDS=${BACKENDS:-$(python3 -c "from kvbridge.testing import available_backends; print(' '.join(available_backends()))")}
EXTRA=("$@")
failed=0
printf "%-10s %-8s %-9s %-6s %7s  %s\n" backend tp draft result seconds "problems"
for backend in $BACKENDS; do
  for tp in "2 1" "1 2" "2 4"; do
    set -- $tp
    for draft in --draft --no-draft; do
      start=$(date +%s%N)
      out=$(kvbridge demo --transfer-backend "$backend" --prefill-tp "$1" --decode-tp "$2" "$draft" \
              --requests 8 --json "${EXTRA[@]}" 2>/dev/null)
      rc=$?
      tenths=$(( ($(date +%s%N) - start) / 100000000 ))
      line=$(printf '%s' "$out" | python3 -c 'import json,sys
try:
    s = json.load(sys.stdin); print(s["result"], "; ".join(s["problems"])[:100])
except ValueError:
    print("FAIL", "no summary")' )
      [ "$rc" = 0 ] || failed=1
      printf "%-10s %-8s %-9s %-6s %5d.%d  %s\n" "$backend" "$1->$2" "${draft#--}" "${line%% *}" $((tenths / 10)) $((tenths % 10)) "${line#* }"
    done
  done
done
exit $failed
