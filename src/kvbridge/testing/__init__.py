"""Test helpers shipped in the wheel (the backend conformance suite lives here)."""

from __future__ import annotations

from kvbridge.core.plugins import get_registry


def available_backends() -> list[str]:
    """Installed backends whose engine is importable, by name (what end-to-end tests run over)."""
    registry = get_registry()
    return sorted(name for name in registry.backends if registry.backend_available(name))
