"""The control plane: typed messages over authenticated sockets.

Rule: messages, sockets, discovery and counters, knowing nothing of rooms or
requests; may import the description layer only. ``protocol`` (every message),
``auth`` (keys, sealing, host checks), ``channel`` (ZMQ sockets and the I/O
thread), ``bootstrap`` (rank discovery) and ``metrics``.
"""
