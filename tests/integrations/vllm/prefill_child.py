"""A prefill vLLM server in its own process, for the kill test: runs one request, prints its
kv_transfer_params as a JSON line, then stops stepping (its Sender never writes) until killed."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import vllm_harness as harness  # noqa: E402

model_dir, bootstrap, req_id, prompt_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = harness.model_config(Path(model_dir))
extra = {"backend": "memory", "bootstrap": bootstrap, "sender_grace": 120, "bootstrap_timeout": 120}
prefill = harness.make_server(model, "kv_producer", extra, fill=True)
prefill.sched.add_request(harness.make_request(req_id, list(range(10, 10 + prompt_len)), 1, {"do_remote_decode": True}))
for _ in range(100):
    out = prefill.step().get(req_id)
    if out is not None and out.finished:
        print(json.dumps(out.kv_transfer_params), flush=True)
        break
time.sleep(600)
