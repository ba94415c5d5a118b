"""kvbridge's small, stable centre. Imports nothing from plugins or state handlers."""

from .hookspecs import hookimpl
from .layout import KVArgs, IndexSpace, Region, Shard
from .plan import PlanError, TransferPlan, coalesce_runs, plan_pages
from .records import BackendCapabilities, BackendSpec, HandlerCapabilities, OptionError, OptionSpec, StateHandlerSpec
from .bootstrap import BootstrapServer
from .backend import Backend, BackendConfig, TransferError, TransferTimeout
from .session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
from .transport import Transport

__all__ = [
    "hookimpl",
    "Backend",
    "BackendConfig",
    "TransferError",
    "TransferTimeout",
    "Transport",
    "KVArgs",
    "IndexSpace",
    "Region",
    "Shard",
    "PlanError",
    "TransferPlan",
    "coalesce_runs",
    "plan_pages",
    "BackendCapabilities",
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
