"""The built-in backends run the conformance suite exactly the way a third-party backend does."""

from kvbridge.testing import available_backends
from kvbridge.testing.conformance import BackendConformance


class TestMooncake(BackendConformance):
    backend = "mooncake"


class TestNixl(BackendConformance):
    backend = "nixl"


class TestUcx(BackendConformance):
    backend = "ucx"


class TestMemory(BackendConformance):
    # The reference for tests/test_faulty_backends.py: the faulty backends are this one, broken.
    backend = "memory"


def test_every_builtin_backend_is_installed_so_none_is_silently_skipped():
    # The suite fails (never skips) a backend that is not installed; this says so up front. CI installs every engine.
    assert {"mooncake", "nixl", "ucx", "memory"} <= set(available_backends()), f"installed backends: {available_backends()}"
