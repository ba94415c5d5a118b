"""Planning: index lists and two memory descriptions -> a checked list of copies.

Rule: pure computation over numpy arrays, no I/O, no threads, no backend; may
import the description layer only. ``indices`` (the checked index-list type),
``transferplan`` (``TransferPlan``, what every backend is handed) with
``parts`` (how it stores descriptors) and ``regions`` (``RegionTable``: which
region holds an address), ``plan`` (the planners: ``plan_pages``,
``plan_segments`` over ``RegionPairs``), ``pairing`` (regions paired once per
peer, ``Route.plan`` per request) and ``layers`` (a plan cut by layer).
"""
