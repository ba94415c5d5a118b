#!/usr/bin/env bash
# A prefill server (TP 2), a decode server (TP 1) and the router on loopback, then one prompt
# through them: the three processes `kvbridge demo` starts, by hand, on fixed ports.
#
#   bash examples/host_server/run_pair.sh [BACKEND] ["prompt text"]
#
# Ports 8100 (prefill), 8200 (decode), 8300 (router), 8998 (kvbridge bootstrap): change them here
# if they are taken. Stops every process it started when the prompt has its answer (or on Ctrl-C).
set -euo pipefail
BACKEND=${1:-memory}
PROMPT=${2:-"Prefill computes the prompt's caches; decode generates from them."}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} UCX_MODULES=${UCX_MODULES:-^ib} MC_LOG_LEVEL=${MC_LOG_LEVEL:-WARNING}

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
python3 -m kvbridge.demo.server --role prefill --tp 2 --port 8100 \
    --transfer-backend "$BACKEND" --transfer-bootstrap 127.0.0.1:8998 & pids+=($!)
python3 -m kvbridge.demo.server --role decode --tp 1 --port 8200 --transfer-backend "$BACKEND" & pids+=($!)
python3 -m kvbridge.demo.router --prefill tcp://127.0.0.1:8100 --decode tcp://127.0.0.1:8200 --port 8300 & pids+=($!)
# The router waits for both servers; the client waits for the router (zmq queues until they bind).
python3 -m kvbridge.demo.client --router tcp://127.0.0.1:8300 --max-new-tokens 16 "$PROMPT"
