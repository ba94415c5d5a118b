"""Sessions: one request's life on each side, from handshake to SUCCESS or FAILED.

Rule: the only folder that holds per-request state and threads of work; it
may import every other folder of core, and nothing in core imports it except
``kvbridge.core`` itself. ``room`` (a request's state), ``manager`` (what both
sides share), ``prefill``/``sender`` (prefill side), ``decode``/``receiver``
(decode side), ``worker`` (per-peer write threads), ``row`` (the inline
metadata row), ``checksum`` and ``session`` (the public ``SessionConfig`` and
re-exports).
"""
