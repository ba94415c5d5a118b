"""Test helpers shipped in the wheel.

- :mod:`~kvbridge.testing.conformance`: ``BackendConformance``, the suite every backend passes;
- :mod:`~kvbridge.testing.harness`: its fixture contract (driver processes, local managers);
- :mod:`~kvbridge.testing.requirements`: ``requires(...)``, capabilities a test needs;
- :mod:`~kvbridge.testing.e2e`, :mod:`~kvbridge.testing.hybrid`: the prefill and decode driver processes;
- :mod:`~kvbridge.testing.runner`: ``kvbridge conformance NAME``;
- :mod:`~kvbridge.testing.pair`: a destination engine in its own process, for tests of one adapter;
- :mod:`~kvbridge.testing.memory`: the ``memory`` backend (no engine, one host);
- :mod:`~kvbridge.testing.faulty`: deliberately broken backends the suite must fail.

Importing this package imports neither pytest nor an engine.
"""

from __future__ import annotations

__all__ = ["available_backends"]


def available_backends() -> list[str]:
    """Installed backends whose engine is importable, best first (what end-to-end tests run over)."""
    from kvbridge.core.description.plugins import get_registry

    return get_registry().available_backends()
