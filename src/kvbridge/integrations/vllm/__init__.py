"""kvbridge as a vLLM KV connector: ``kv_connector_module_path="kvbridge.integrations.vllm"``.

Importing it imports vLLM (install vLLM first; ``kvbridge[vllm]`` does not pull it in).
"""

try:
    from .connector import KVBridgeConnector
    from .params import decode_first_params
except ImportError as exc:  # pragma: no cover - depends on the environment
    if exc.name and exc.name.split(".")[0] == "vllm":
        raise ImportError(
            "kvbridge.integrations.vllm needs vLLM (>= 0.33); install vLLM the way your hardware needs "
            "(`pip install vllm` on CUDA hosts), then `pip install kvbridge[vllm]`"
        ) from exc
    raise

__all__ = ["KVBridgeConnector", "decode_first_params"]
