import os

# Engine environment for CPU-only loopback machines (docs/engines.md):
# keep UCX on loopback, avoid NIXL's SIGSEGV at exit, quiet Mooncake's per-call logs.
for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
    os.environ.setdefault(key, value)
