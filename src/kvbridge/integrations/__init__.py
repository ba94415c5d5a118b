"""Integrations with inference frameworks (vLLM, SGLang): each sits above core and imports its framework only when used."""
