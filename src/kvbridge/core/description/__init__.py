"""The description layer: what memory a rank has and who handles it.

Rule: modules here describe memory and name the plugins that handle it; they
import nothing from the other folders of core (planning, transfer, control,
sessions). ``layout`` (regions, index spaces, shards), ``records`` (the
registration records and options), ``hookspecs``, ``plugins`` (discovery:
builds the registry) and ``registry`` (the registry built, and the choices made
from it), ``state`` (pool class -> handler), ``describe`` (pools -> one
``KVArgs``) and ``pools`` (core's own ``kv`` and ``metadata`` handlers).
"""
