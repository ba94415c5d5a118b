"""Connectors that let inference servers use kvbridge (each imports its framework only when used)."""
