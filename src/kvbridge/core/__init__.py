"""kvbridge's small, stable centre. Imports nothing from plugins or state handlers.

Everything a host server or a plugin author uses is exported here and from
``kvbridge`` itself: a backend's base class, config and errors, the
registration records, and a state handler's helpers (``DescribeContext``,
``Description``, ``buffer_region``, ``element_size``, ``item_count``).
"""

from .hookspecs import hookimpl
from .layout import KV_PAGE_SPACE, METADATA_SPACE, ROLES, KVArgs, IndexSpace, Region, Shard
from .plan import PlanError, TransferPlan, coalesce_runs, plan_pages
from .records import BackendCapabilities, BackendSpec, HandlerCapabilities, OptionError, OptionSpec, StateHandlerSpec
from .bootstrap import BootstrapServer
from .backend import Backend, BackendConfig, TransferCancelled, TransferError, TransferTimeout, checkpoint, host_id, may_post
from .session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
from .transport import Transport
from .describe import DescribeContext, Description, buffer_region, describe, element_size, item_count

__all__ = [
    "hookimpl",
    "Backend",
    "BackendConfig",
    "TransferCancelled",
    "TransferError",
    "TransferTimeout",
    "may_post",
    "Transport",
    "KVArgs",
    "IndexSpace",
    "Region",
    "Shard",
    "KV_PAGE_SPACE",
    "METADATA_SPACE",
    "ROLES",
    "DescribeContext",
    "Description",
    "buffer_region",
    "describe",
    "element_size",
    "item_count",
    "PlanError",
    "TransferPlan",
    "coalesce_runs",
    "plan_pages",
    "BackendCapabilities",
    "checkpoint",
    "host_id",
    "BackendSpec",
    "HandlerCapabilities",
    "OptionError",
    "OptionSpec",
    "StateHandlerSpec",
    "BootstrapServer",
    "DecodeManager",
    "Poll",
    "PrefillManager",
    "Receiver",
    "Sender",
    "SessionConfig",
]
