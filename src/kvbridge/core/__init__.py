"""kvbridge's small, stable centre. Imports nothing from plugins or state handlers."""

from .hookspecs import hookimpl
from .layout import KVArgs, IndexSpace, Region, Shard
from .plan import PlanError, TransferPlan, coalesce_runs, plan_pages
from .records import BackendCapabilities, BackendSpec, OptionError, OptionSpec, StateHandlerSpec
from .bootstrap import BootstrapServer
from .session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig

__all__ = [
    "hookimpl",
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
