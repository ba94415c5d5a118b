"""Benchmarks reachable as ``kvbridge bench ...`` (scripts in ``benchmarks/`` call these)."""
