"""``kvbridge new-backend NAME``: a backend plugin project to start from, the one the guide describes.

It writes ``kvbridge-NAME/`` (or ``--directory``): ``pyproject.toml`` (build
system, the entry point), ``src/kvbridge_NAME/__init__.py`` (the hook and
the declared capabilities), ``src/kvbridge_NAME/backend.py`` (a ``Backend``
whose engine calls are left to write, each saying what it must do) and
``tests/test_conformance.py``. Installed with ``pip install -e``, the backend
is listed by ``kvbridge plugins`` at once, and the conformance suite then
fails at the first method still to write. ``docs/plugin-authors.md`` walks
through each file; ``examples/kvbridge-zmq`` in kvbridge's repository is a
complete backend made the same way.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from string import Template

import kvbridge
from kvbridge import ui
from kvbridge.core.description.plugins import get_registry

__all__ = ["conformance_test_file", "create", "files"]

PYPROJECT = Template('''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "kvbridge transport backend '$name'"
requires-python = ">=3.10"
# Add your engine's package; kvbridge's conformance suite needs pytest (the test extra).
dependencies = [$requirement]

[project.optional-dependencies]
test = ["pytest>=8"]

# This entry point is what makes kvbridge see the backend.
[project.entry-points.kvbridge]
$name = "$package"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
''')

README = Template('''\
# $dist

kvbridge transport backend `$name`, made by `kvbridge new-backend $name`.

```bash
pip install -e '.[test]'      # then `kvbridge plugins` lists $name
python -m pytest -q           # the conformance suite (or: kvbridge conformance $name)
```

- `src/$package/__init__.py`: registers the backend and declares its capabilities; imports no engine.
- `src/$package/backend.py`: `$cls`, the `Backend` contract; each `NotImplementedError` marks an engine call to write.
- `tests/test_conformance.py`: kvbridge's conformance suite, run against this backend.
''')

HOOK = Template('''\
"""$dist: registers the ``$name`` backend with kvbridge.

kvbridge imports this module through the ``kvbridge`` entry point in
pyproject.toml and calls its hook once, when it builds its plugin registry.
Keep it cheap to import: the backend class is named by a string and imported
only when a manager selects ``$name``.
"""

from __future__ import annotations

from kvbridge import BackendCapabilities, BackendSpec, OptionSpec, hookimpl

__all__ = ["CAPABILITIES", "kvbridge_register_backends"]

#: Declared, never inferred: core splits every plan within these limits and the
#: conformance suite holds the backend to each promise. One object serves the
#: registration and $cls.capabilities (the suite checks they are equal).
CAPABILITIES = BackendCapabilities(
    memory_kinds=("dram",),  # add "vram" when the engine reads and writes GPU memory
    max_descriptors_per_batch=None,  # the engine's limits, None where it has none
    max_descriptors_in_flight=None,
    max_bytes_per_batch=None,
    one_sided=True,  # False if decode's process must take part in a write
    cross_host=True,  # False keeps a same-host transport out of the default choice
)

#: Every BackendConfig.options key the backend reads; core rejects others before creating it.
OPTIONS: tuple[OptionSpec, ...] = ()


@hookimpl
def kvbridge_register_backends() -> list[BackendSpec]:
    """Register ``$name``. ``requires``: your engine's top-level modules (checked, not imported)."""
    spec = BackendSpec(name="$name", factory="$package.backend:$cls", capabilities=CAPABILITIES,
                       options=OPTIONS, requires=(), description="$name transport")
    return [spec]
''')

BACKEND = Template('''\
"""``$cls``: kvbridge's Backend contract over your engine.

Core has already done everything else when these methods run: memory kinds
checked, every descriptor bounds-checked against both sides' regions, plans
split within CAPABILITIES, the deadline checked before each batch. Each
method only talks to the engine. The contract in full: docs/plugin-authors.md,
section 4, in kvbridge's repository.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

from kvbridge import Backend, BackendCapabilities, BackendConfig, Region, TransferError, TransferPlan

from . import CAPABILITIES


class $cls(Backend):
    """Writes batches into peers through the engine."""

    capabilities: ClassVar[BackendCapabilities] = CAPABILITIES

    def __init__(self, config: BackendConfig) -> None:
        # config.host: listen on and advertise it; config.options: the declared options,
        # parsed; config.transfer_timeout: no engine wait may be longer.
        super().__init__(config)
        self._lock = threading.Lock()  # write() runs on worker threads, add/remove_peer on the I/O thread
        self._peers: dict[str, bytes] = {}
        self._closed = False

    def register(self, regions: Sequence[Region]) -> None:
        """Make every region (``addr``, ``nbytes``, ``mem``, ``device``) writable by peers."""
        raise NotImplementedError("$cls.register: register each region's memory with the engine")

    def metadata(self) -> bytes:
        """What a peer needs to reach this endpoint; it travels in kvbridge's handshake."""
        raise NotImplementedError("$cls.metadata: return the engine's address or descriptor as bytes")

    def add_peer(self, peer: str, metadata: bytes, regions: Sequence[Region]) -> None:
        """Prepare to write to ``peer``; raise for metadata this engine cannot use; replace a known peer."""
        with self._lock:
            self._peers[peer] = bytes(metadata)

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` (unknown peers are ignored); later writes to it raise TransferError."""
        with self._lock:
            self._peers.pop(peer, None)

    def write(self, peer: str, batch: TransferPlan, deadline: float) -> None:
        """Write every ``(src_addr, dst_addr, nbytes)`` of ``batch`` into ``peer`` and return once all of it
        has landed. Raise TransferError on failure and TransferTimeout (from kvbridge) at ``deadline``
        (``time.monotonic()`` seconds), never later, even for a dead or frozen peer."""
        with self._lock:
            if self._closed or peer not in self._peers:
                raise TransferError(f"$name: cannot write to peer {peer!r}: " + ("closed" if self._closed else "unknown peer"))
        raise NotImplementedError("$cls.write: move the batch with the engine, waiting at most until the deadline")

    def close(self) -> None:
        """Deregister memory and release the engine; idempotent."""
        with self._lock:
            self._closed = True
            self._peers.clear()
''')

CONFORMANCE_TEST = Template('''\
"""kvbridge's backend conformance suite, against the installed ``$name`` backend.$note"""

from kvbridge.testing.conformance import BackendConformance


class Test${cls}Conformance(BackendConformance):
    backend = $name_repr$settings
''')


def _class_name(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[-_]", name) if part)


def conformance_test_file(name: str, backend_options: dict[str, str] | None = None, timeout_scale: float | None = None,
                          note: str = "") -> str:
    """The one test file a plugin needs: a ``BackendConformance`` subclass naming backend ``name``."""
    settings = "".join(
        f"\n    {attr} = {value!r}" for attr, value in (("backend_options", backend_options), ("timeout_scale", timeout_scale))
        if value is not None
    )
    return CONFORMANCE_TEST.substitute(name=name, name_repr=json.dumps(name), cls=_class_name(name), settings=settings,
                                       note=f"\n\n{note}\n" if note else "")


def files(name: str) -> dict[str, str]:
    """Relative path -> text of the project for backend ``name``."""
    package = "kvbridge_" + name.replace("-", "_")
    version = kvbridge.__version__
    requirement = '"kvbridge"' if "unknown" in version else f'"kvbridge>={version}"'
    values = dict(name=name, dist=f"kvbridge-{name}", package=package, cls=_class_name(name) + "Backend",
                  requirement=requirement)
    return {
        "pyproject.toml": PYPROJECT.substitute(values),
        "README.md": README.substitute(values),
        f"src/{package}/__init__.py": HOOK.substitute(values),
        f"src/{package}/backend.py": BACKEND.substitute(values),
        "tests/test_conformance.py": conformance_test_file(name),
    }


def create(name: str, directory: Path) -> list[Path]:
    """Write the project for backend ``name`` into ``directory`` (which must not hold files); the paths written."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} already exists and is not an empty directory")
    written = []
    for rel, text in files(name).items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def _backend_name(text: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9_-]*", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a backend name: lowercase letters, digits, '_' and '-', starting with a letter")
    reg = get_registry().backends.get(text)
    if reg is not None:
        raise argparse.ArgumentTypeError(
            f"a backend named {text!r} is already installed (from {reg.provider.distribution}); choose another name")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", type=_backend_name,
                        help="the backend's name, as users will pass it to --transfer-backend")
    parser.add_argument("--directory", metavar="DIR", type=Path,
                        help="where to write the project (default: ./kvbridge-NAME); must not hold files")


def run_from_args(args: argparse.Namespace) -> int:
    directory: Path = args.directory or Path(f"kvbridge-{args.name}")
    try:
        written = create(args.name, directory)
    except FileExistsError as exc:
        ui.usage_error(args.command_parser, str(exc))
    print(f"created backend plugin {args.name!r} in {directory}/:")
    for path in written:
        print(f"  {path.relative_to(directory)}")
    print(f"next: cd {directory} && pip install -e '.[test]' && kvbridge plugins && python -m pytest -q")
    return ui.EXIT_OK
