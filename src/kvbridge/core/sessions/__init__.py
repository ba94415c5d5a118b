"""Sessions: one request's life on each side, from handshake to SUCCESS or FAILED.

Rule: the only folder that holds per-request state and threads of work; it
may import every other folder of core, and nothing in core imports it except
``kvbridge.core`` itself. ``room`` (a request's state), ``manager`` (what both
sides share), ``prefill`` with ``fence`` (its write fence) and ``peers``
(prefill's view of decode), ``sender`` and ``writes`` (its writes on a
peer's worker); ``decode`` with ``servers`` (decode's view of prefill) and ``receiver``; ``worker`` (per-peer
write threads), ``row`` (the inline metadata row), ``checksum`` and
``session`` (the public ``SessionConfig`` and re-exports). A room never
reaches into its manager's or another room's private fields: ``PrefillSide``,
``WritingRoom`` and ``DecodeSide`` name what each uses.
"""
