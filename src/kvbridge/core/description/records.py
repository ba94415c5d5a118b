"""Registration records that plugins return from the ``kvbridge_register_*`` hooks.

A plugin module stays cheap to import: a record names its implementation as a
``"module:attribute"`` string that is imported only when that backend or
handler is selected, so listing plugins never imports an engine.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .layout import check_role

__all__ = [
    "PLUGIN_API_VERSION", "BackendCapabilities", "BackendSpec", "HandlerCapabilities", "OptionError", "OptionSpec",
    "StateHandlerSpec", "assign_options",
]

#: The plugin contract's version (hooks, records, the Backend contract): ``major.minor``. A minor
#: release only adds; a form it deprecates still loads, with a DeprecationWarning naming the new
#: form, for at least one more minor release; only a major release removes it (docs/plugin-authors.md).
#: 1.1: capabilities given as a dict are deprecated (a BackendCapabilities / HandlerCapabilities record).
#: 1.2: lanes. Added, all optional: ``Backend.select`` and ``Backend.abort_peer``,
#: ``BackendCapabilities.whole_plans``, ``TransferPlan.memory`` on every batch core posts, and the helpers
#: ``checkpoint``, ``wait_until``, ``expired``, ``host_id``; TCP resets moved behind ``abort_peer``
#: (``kvbridge.plugins.tcpfence``).
#: 1.3: pipelined batches and inline writes. Added, all optional: ``BackendCapabilities.batches_in_flight``
#: with ``Backend.post``, and ``BackendCapabilities.inline_writes``.
#: 1.4: ``Backend.warm`` (optional): prepare for a peer's writes before its handshake is answered.
PLUGIN_API_VERSION = "1.4"

#: Type names an :class:`OptionSpec` may use instead of a parse function.
OPTION_TYPES = ("str", "int", "float", "bool")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class OptionError(ValueError):
    """A backend option is unknown or its value is not allowed; the text says which and what is."""


class BackendCapabilities(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a transport can do, declared by the backend (never inferred).

    ``None`` for a limit means the engine has none that kvbridge must respect.
    """

    #: Memory kinds it can read from and write to ("dram", "vram"). Core refuses
    #: to register, or to pair with a peer describing, memory of any other kind.
    memory_kinds: tuple[str, ...] = ("dram",)
    #: Most descriptors one ``Backend.write`` call may carry; core splits plans to it.
    max_descriptors_per_batch: int | None = None
    #: Most descriptors in flight to one peer at once (e.g. Mooncake's TCP lane
    #: queue). Core writes to a peer one batch at a time, so it caps batches to it too.
    max_descriptors_in_flight: int | None = None
    #: Most bytes one ``write`` call may carry; core cuts longer descriptors and
    #: bounds batches to it, so a deadline is checked at least that often.
    max_bytes_per_batch: int | None = None
    #: The engine tells the receiver that a transfer landed.
    native_notifications: bool = False
    #: Prefill writes into decode memory without decode posting receives.
    one_sided: bool = True
    #: Moves bytes between hosts. ``False`` (e.g. a same-host shared-memory
    #: transport) keeps the backend out of the default choice.
    cross_host: bool = True
    #: Core may post some descriptors from a staging buffer of its own (host memory,
    #: registered with the rank's regions): heterogeneous-TP token rows gathered into
    #: contiguous runs (``kvbridge.core.transfer.staging``). ``False`` opts out: every
    #: descriptor is posted as planned, and only the rank's own regions are registered.
    host_staging: bool = True
    #: ``Backend.write`` takes a whole plan (still within the declared limits, unexpanded where the
    #: planner left it so: ``TransferPlan.factors``) and calls ``kvbridge.core.transfer.backend.checkpoint()``
    #: between its own posts, instead of core cutting it into fence-sized batches and checking
    #: between those. For a copy kernel that moves a plan in a few launches (``cuda_ipc``).
    whole_plans: bool = False
    #: Batches core may keep posted to one peer at once through ``Backend.post`` (pipelined: the
    #: next batch is posted while the engine still moves the last). 1: ``Backend.write``, one batch
    #: at a time. Core caps it (``kvbridge.core.transfer.pipeline.FENCE_BATCHES_IN_FLIGHT``) so the fence's
    #: bound on what a frozen prefill can still write stays small (docs/failures.md).
    batches_in_flight: int = 1
    #: A small write to a peer on the same host completes whether or not the peer's process runs (CMA,
    #: ``process_vm_writev``), and ``Backend.write`` may be called from any thread: core then writes a
    #: small chunk to such a peer from the thread that called ``Sender.send`` (the host's) while the
    #: peer's worker is idle, one thread hand-off less per small request (still one write per peer at a
    #: time, in order). ``False`` (the default): only from core's worker threads, so that a frozen peer
    #: holds up a worker, never the host.
    inline_writes: bool = False

    def __post_init__(self) -> None:
        for name in ("max_descriptors_per_batch", "max_descriptors_in_flight", "max_bytes_per_batch", "batches_in_flight"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"BackendCapabilities.{name} must be a positive integer or None, got {value!r}")
        unknown = [k for k in self.memory_kinds if k not in ("dram", "vram")]
        if not self.memory_kinds or unknown:
            raise ValueError(f"BackendCapabilities.memory_kinds must name 'dram' and/or 'vram', got {self.memory_kinds!r}")

    @property
    def batch_descriptors(self) -> int | None:
        """Most descriptors core puts in one ``write`` call (the tighter declared limit)."""
        limits = [n for n in (self.max_descriptors_per_batch, self.max_descriptors_in_flight) if n is not None]
        return min(limits) if limits else None


@dataclass(frozen=True, kw_only=True)
class OptionSpec:
    """One ``KEY=VALUE`` setting a backend reads from ``BackendConfig.options``.

    Declared by the backend's registration so that core can reject an unknown
    key or a bad value before any engine is created, and ``kvbridge plugins``
    and ``--transfer-option`` can list them. A ``name`` ending in ``*`` is a
    prefix: ``UCX_*`` accepts every key starting with ``UCX_``.

    ``default`` is what the backend uses when the option is not given, as the
    user would write it ("" when the engine decides). ``type`` is one of
    :data:`OPTION_TYPES` or a function that takes the string and raises
    ``ValueError`` (its message says what is allowed) for a bad value.
    ``minimum`` bounds ``int``/``float`` options; ``choices`` lists the only
    accepted strings. Core parses every value (and the default of every option
    not given) before creating the backend, which reads them typed from
    ``BackendConfig.options`` and never parses them again.
    """

    name: str
    help: str = ""
    default: str = ""
    choices: tuple[str, ...] | None = None
    type: str | Callable[[str], object] = "str"
    minimum: float | None = None

    def __post_init__(self) -> None:
        base = self.name[:-1] if self.name.endswith("*") else self.name
        _check_name("option", base)
        if isinstance(self.type, str) and self.type not in OPTION_TYPES:
            raise ValueError(f"option {self.name!r}: type {self.type!r} must be one of {', '.join(OPTION_TYPES)} or a function")
        if not isinstance(self.type, str) and not callable(self.type):
            raise TypeError(f"option {self.name!r}: type must be a type name or a function, got {self.type!r}")
        if self.choices is not None and (not self.choices or not all(isinstance(c, str) for c in self.choices)):
            raise ValueError(f"option {self.name!r}: choices must be a non-empty tuple of strings, got {self.choices!r}")

    @property
    def is_prefix(self) -> bool:
        return self.name.endswith("*")

    def matches(self, key: str) -> bool:
        """Whether ``key`` is this option (or, for a prefix, one of its keys)."""
        if self.is_prefix:
            return key.startswith(self.name[:-1]) and len(key) > len(self.name) - 1
        return key == self.name

    def allowed(self) -> str:
        """What a value may be, in words (for help and errors)."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        if not isinstance(self.type, str):
            return getattr(self.type, "__doc__", None) or f"a value accepted by {getattr(self.type, '__name__', 'its parser')}"
        words = {"str": "a string", "int": "an integer", "float": "a number", "bool": "one of " + "/".join(_TRUE[:2] + _FALSE[:2])}
        text = words[self.type]
        if self.minimum is not None and self.type in ("int", "float"):
            low = int(self.minimum) if self.type == "int" else self.minimum
            text += f" >= {low}"
        return text

    def parse(self, value: str, key: str | None = None) -> object:
        """The parsed value of ``key`` (default: :attr:`name`); :class:`OptionError` naming
        key, value and what is allowed if it is bad."""
        try:
            if self.choices is not None and value not in self.choices:
                raise ValueError(value)
            if not isinstance(self.type, str):
                return self.type(value)
            if self.type == "bool":
                low = value.strip().lower()
                if low not in _TRUE + _FALSE:
                    raise ValueError(value)
                return low in _TRUE
            if self.type in ("int", "float"):
                number: float = int(value) if self.type == "int" else float(value)
                if self.minimum is not None and number < self.minimum:
                    raise ValueError(value)
                return number
            return value
        except (TypeError, ValueError) as exc:
            detail = str(exc) if not isinstance(self.type, str) and str(exc) else ""
            raise OptionError(
                f"option {key or self.name}={value!r} is not allowed; expected {self.allowed()}" + (f" ({detail})" if detail else "")
            ) from None


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """A transport registration.

    ``factory`` is ``"module:attribute"``; ``requires`` lists the engine's
    top-level modules, checked (without importing them) to say whether the
    backend is available and, if not, which pip ``extra`` installs it; an
    entry ``"a|b"`` is met by either module (e.g. CUDA 12 and 13 builds).
    ``options`` declares every ``BackendConfig.options`` key the backend reads;
    core rejects any other key, and bad values, before creating the backend.
    """

    name: str
    factory: str
    capabilities: BackendCapabilities = BackendCapabilities()
    description: str = ""
    requires: tuple[str, ...] = ()
    extra: str | None = None
    options: tuple[OptionSpec, ...] = ()

    def __post_init__(self) -> None:
        _check_name("backend", self.name)
        _check_factory(self.name, self.factory)
        if isinstance(self.capabilities, Mapping):  # contract 1.0's form: loads, with a warning (PLUGIN_API_VERSION)
            object.__setattr__(self, "capabilities",
                               _capabilities_from_dict("backend", self.name, BackendCapabilities, self.capabilities))
        if not isinstance(self.capabilities, BackendCapabilities):
            raise TypeError(
                f"backend {self.name!r}: capabilities must be a BackendCapabilities, "
                f"got {type(self.capabilities).__name__}"
            )
        object.__setattr__(self, "options", tuple(self.options))
        names = [o.name for o in self.options]
        if not all(isinstance(o, OptionSpec) for o in self.options):
            raise TypeError(f"backend {self.name!r}: options must be OptionSpec records")
        if len(set(names)) != len(names):
            raise ValueError(f"backend {self.name!r}: option names are declared more than once: {names}")

    def option(self, key: str) -> OptionSpec | None:
        """The declaration ``key`` falls under (exact names win over prefixes), or None."""
        exact = [o for o in self.options if not o.is_prefix and o.matches(key)]
        matching = exact or [o for o in self.options if o.matches(key)]
        return matching[0] if matching else None

    def check_options(self, options: Mapping[str, object]) -> dict[str, str]:
        """``options`` as strings, after checking every key and value against :attr:`options`.

        Raises :class:`OptionError` listing the declared options for an
        unknown key, or naming the key, value and what is allowed for a bad one.
        """
        return {key: text for key, (text, _) in self._checked(options).items()}

    def parse_options(self, options: Mapping[str, object]) -> dict[str, object]:
        """What a backend receives as ``BackendConfig.options``: every value parsed to its type.

        Each declared (non-prefix) option is present, at its parsed default
        when not given (``None`` when its default is empty and its type is not
        ``str``: the engine decides); prefix options appear only as given.
        Raises :class:`OptionError` like :meth:`check_options`.
        """
        out: dict[str, object] = {}
        for o in self.options:
            if not o.is_prefix:
                out[o.name] = o.parse(o.default) if (o.default or o.type == "str") else None
        out.update({key: value for key, (_, value) in self._checked(options).items()})
        return out

    def _checked(self, options: Mapping[str, object]) -> dict[str, tuple[str, object]]:
        out: dict[str, tuple[str, object]] = {}
        for key, value in options.items():
            spec = self.option(str(key))
            if spec is None:
                declared = ", ".join(o.name for o in self.options)
                raise OptionError(
                    f"backend {self.name!r} has no option {key!r}; "
                    + (f"its options are: {declared}" if declared else "it declares no options")
                    + " (see `kvbridge plugins`)"
                )
            text = value if isinstance(value, str) else str(value)
            try:
                out[str(key)] = (text, spec.parse(text, str(key)))
            except OptionError as exc:
                raise OptionError(f"backend {self.name!r}: {exc}") from None
        return out


def assign_options(specs: Sequence[BackendSpec], options: Mapping[str, object]) -> list[dict[str, object]]:
    """``options`` shared out among lanes: each key to the first of ``specs`` that declares it.

    Returns one mapping per spec (keys as given, values unparsed). A key no spec declares raises
    :class:`OptionError` listing what each declares.
    """
    if len(specs) == 1:  # its own check names the key and what it declares
        return [dict(options)]
    out: list[dict[str, object]] = [{} for _ in specs]
    for key, value in options.items():
        for i, spec in enumerate(specs):
            if spec.option(str(key)) is not None:
                out[i][str(key)] = value
                break
        else:
            declared = "; ".join(f"{s.name}: {', '.join(o.name for o in s.options) or 'none'}" for s in specs)
            raise OptionError(f"no backend of {','.join(s.name for s in specs)!r} has an option {key!r} "
                              f"(declared: {declared}); `kvbridge plugins` lists them")
    return out


class HandlerCapabilities(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a state handler describes, declared (``kvbridge plugins`` shows it)."""

    #: The index spaces its regions are addressed by.
    index_spaces: tuple[str, ...]
    #: How heterogeneous TP treats its buffers, in words ("replicated", "slice heads", ...).
    hetero_tp: str = ""
    #: Page layouts it describes ("nhd", "hnd"); empty when pages have no head layout.
    layouts: tuple[str, ...] = ()
    #: It describes the draft (MTP) model's pools too.
    draft: bool = False
    #: Some of its destinations may be decode host memory while the source is device memory.
    host_destination: bool = False
    #: Region roles it uses besides core's (:data:`~kvbridge.core.description.layout.ROLES`), e.g.
    #: ``("wkv_a", "wkv_b")`` for several buffers per layer; ``describe()`` rejects any other.
    roles: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for role in self.roles:
            check_role(role, "HandlerCapabilities.roles")


@dataclass(frozen=True, kw_only=True)
class StateHandlerSpec:
    """A state-handler registration.

    ``pool_types`` are the pool classes it serves, as classes or
    ``"module:QualName"`` strings (strings keep host-server classes unimported).
    A pool whose class derives from one of them is served by this handler
    unless a handler registered for a more specific class exists.
    """

    name: str
    factory: str
    pool_types: tuple[type | str, ...]
    capabilities: HandlerCapabilities = HandlerCapabilities(index_spaces=())
    description: str = ""

    def __post_init__(self) -> None:
        _check_name("state handler", self.name)
        if isinstance(self.capabilities, Mapping):  # contract 1.0's form: loads, with a warning (PLUGIN_API_VERSION)
            object.__setattr__(self, "capabilities",
                               _capabilities_from_dict("state handler", self.name, HandlerCapabilities, self.capabilities))
        if not isinstance(self.capabilities, HandlerCapabilities):
            raise TypeError(f"state handler {self.name!r}: capabilities must be a HandlerCapabilities, "
                            f"got {type(self.capabilities).__name__}")
        _check_factory(self.name, self.factory)
        if not self.pool_types:
            raise ValueError(f"state handler {self.name!r} registers no pool_types")
        for t in self.pool_types:
            if not isinstance(t, (type, str)) or (isinstance(t, str) and ":" not in t):
                raise ValueError(
                    f"state handler {self.name!r}: pool type {t!r} must be a class or "
                    "a 'module:QualName' string"
                )


def _capabilities_from_dict(kind: str, name: str, record: type[Any], given: Mapping[str, Any]) -> Any:
    """``given`` as a ``record``, after a DeprecationWarning that names the new form; a key or value the record
    does not accept is an error naming it."""
    fields = ", ".join(f"{k}={v!r}" for k, v in given.items())
    warnings.warn(
        f"{kind} {name!r}: capabilities given as a dict are deprecated since kvbridge's plugin contract 1.1 and "
        f"will stop loading in 2.0; pass capabilities={record.__name__}({fields}) "
        f"(from kvbridge import {record.__name__})", DeprecationWarning, stacklevel=4)
    try:
        return msgspec.convert(dict(given), record)
    except (msgspec.ValidationError, ValueError) as exc:
        raise TypeError(f"{kind} {name!r}: capabilities {dict(given)!r} do not make a {record.__name__}: {exc}") from None


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"{kind} name {name!r} must be a non-empty word (letters, digits, '_', '-')")


def _check_factory(name: str, factory: str) -> None:
    if not isinstance(factory, str) or factory.count(":") != 1 or factory.startswith(":") or factory.endswith(":"):
        raise ValueError(f"{name!r}: factory {factory!r} must be a 'module:attribute' string")
