import os
import secrets

# Engine environment for CPU-only loopback machines (docs/engines.md):
# keep UCX on loopback, avoid NIXL's SIGSEGV at exit, quiet Mooncake's per-call logs.
for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
    os.environ.setdefault(key, value)

# Tests run with authenticated control messages, as a deployment should: every
# process (this one and the drivers it starts, which inherit the environment)
# holds the same secret. Tests of what happens without one remove it for a child.
os.environ.setdefault("KVBRIDGE_SECRET", secrets.token_hex(32))
