"""Test helpers shipped in the wheel (the backend conformance suite lives here)."""
