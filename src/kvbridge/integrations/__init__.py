"""Integrations with inference frameworks: each sits above core and imports its framework only when used."""
