"""KVBridgeConnector's tests drive vLLM's real scheduler; ``vllm_harness`` builds the servers."""

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import vllm_harness`: pytest runs with --import-mode=importlib


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    import vllm_harness as harness

    return harness.model_config(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture
def bootstrap() -> str:
    """A free loopback port for prefill's bootstrap endpoint (vLLM's config needs the address up front)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without torch (``KVBRIDGE_TORCH=none bash scripts/setup.sh``) vLLM cannot be imported: say so."""
    if importlib.util.find_spec("torch") is None:
        skip = pytest.mark.skip(reason="vLLM needs torch; this environment was set up with KVBRIDGE_TORCH=none")
        for item in items:
            if "integrations/vllm" in str(item.path):
                item.add_marker(skip)
