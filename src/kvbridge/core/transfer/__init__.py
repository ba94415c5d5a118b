"""The transport: moving a planned batch through the backends.

Rule: everything between a ``TransferPlan`` and a backend's ``write``; may
import the description and planning layers, never the control plane or the
sessions. ``backend`` (the ``Backend`` base class plugins implement), ``lanes``
(which backend carries which descriptors), ``staging`` (host gather buffers)
and ``transport`` (``Transport``: one per rank, owns the lanes).
"""
