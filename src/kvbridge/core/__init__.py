"""kvbridge's small, stable centre. Imports nothing from plugins or state handlers.

Everything a host server or a plugin author uses is exported here and from
``kvbridge`` itself: a backend's base class, config and errors, the
registration records, and a state handler's helpers (``DescribeContext``,
``Description``, ``buffer_region``, ``element_size``, ``item_count``).

The folders are layers; each imports only from the ones above it in this
list (``tests/test_import_graph.py`` checks it):

- ``description``: memory layout, registration records, the plugin registry;
- ``planning``: index lists + layouts -> a checked ``TransferPlan``;
- ``transfer``: backends, lanes, staging, ``Transport``;
- ``control``: messages, sockets, auth, bootstrap, metrics;
- ``sessions``: one request's life on prefill and decode.

The modules used to sit flat in this folder. Their old paths
(``kvbridge.core.backend``, ``kvbridge.core.plan``, ...) still import, as the
same module objects, with a ``DeprecationWarning`` naming the new path: see
``_MOVED`` and ``_MovedModuleFinder`` below.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

from .description.hookspecs import hookimpl
from .description.layout import KV_PAGE_SPACE, METADATA_SPACE, ROLES, KVArgs, IndexSpace, Region, Shard
from .planning.plan import PlanError, TransferPlan, coalesce_runs, plan_pages
from .description.records import BackendCapabilities, BackendSpec, HandlerCapabilities, OptionError, OptionSpec, StateHandlerSpec
from .control.bootstrap import BootstrapServer
from .transfer.backend import Backend, BackendConfig, TransferCancelled, TransferError, TransferTimeout, checkpoint, host_id, may_post
from .sessions.session import DecodeManager, Poll, PrefillManager, Receiver, Sender, SessionConfig
from .transfer.transport import Transport
from .description.describe import DescribeContext, Description, buffer_region, describe, element_size, item_count

# Old flat module name -> the folder it lives in now. Third-party plugins and
# docs written before the move import e.g. ``kvbridge.core.backend``; the
# plugin contract is public, so those paths keep working (with a warning)
# instead of breaking.
_MOVED = {
    **dict.fromkeys(("layout", "records", "hookspecs", "plugins", "state", "describe", "pools"), "description"),
    **dict.fromkeys(("indices", "plan", "pairing", "layers"), "planning"),
    **dict.fromkeys(("backend", "lanes", "transport", "staging"), "transfer"),
    **dict.fromkeys(("protocol", "auth", "channel", "bootstrap", "metrics"), "control"),
    **dict.fromkeys(
        ("room", "worker", "manager", "sender", "receiver", "prefill", "decode", "session", "row", "checksum"), "sessions"
    ),
}


class _AliasLoader(importlib.abc.Loader):
    """Hands out the module at its new path; the import system then files it under the old name too."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # stacklevel: the caller's import statement is outside importlib's frames, which Python hides
        # from warnings for ``import`` statements; 2 points at the nearest visible frame.
        warnings.warn(
            f"{spec.name} moved to {self.new_name}; import it from there (or the public names from kvbridge)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was executed once, under its new name."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves ``kvbridge.core.<old>`` to ``kvbridge.core.<folder>.<old>`` (one entry on ``sys.meta_path``)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        prefix, _, leaf = fullname.rpartition(".")
        if prefix != __name__ or leaf not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(f"{__name__}.{_MOVED[leaf]}.{leaf}"))


class _Core(ModuleType):
    """This package's module type: an old path imported must not shadow a public name here.

    The import system files a module on its parent under its last name. ``describe`` is both an
    old module name and a function exported here; after ``import kvbridge.core.describe`` the
    function must still be what ``kvbridge.core.describe`` means, as it was before the move.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _MOVED and isinstance(value, ModuleType) and not isinstance(self.__dict__.get(name, value), ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Core
if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())

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
