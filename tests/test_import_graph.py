"""kvbridge.core's import graph: layers, no cycles, and the old flat module paths.

The graph is read from the source (``ast``), so imports under ``TYPE_CHECKING`` and inside
functions count too: a cycle hidden behind ``TYPE_CHECKING`` is still two modules that cannot be
understood, tested or moved apart.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kvbridge.core

CORE = Path(kvbridge.core.__file__).parent
PACKAGE = "kvbridge.core"

# Which folders each folder of core may import (docs/architecture.md, "Module map").
ALLOWED = {
    "description": {"description"},
    "planning": {"description", "planning"},
    "transfer": {"description", "planning", "transfer"},
    "control": {"description", "control"},
    "sessions": {"description", "planning", "transfer", "control", "sessions"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(CORE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The kvbridge modules ``name`` imports anywhere in its source (a package's submodule when named)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("kvbridge"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("kvbridge"):
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known
            out.update(subs or {target})
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 else None


def test_core_imports_no_plugin_and_respects_its_layers() -> None:
    wrong = []
    for module, targets in _graph().items():
        for target in targets:
            if not target.startswith(PACKAGE + ".") and target != PACKAGE:
                if target.startswith("kvbridge"):
                    wrong.append(f"{module} imports {target}, outside core")
                continue
            src, dst = _folder(module), _folder(target)
            if src is None or dst is None:
                continue  # kvbridge.core itself and the folders' __init__ files
            if dst not in ALLOWED[src]:
                wrong.append(f"{module} ({src}/) imports {target} ({dst}/)")
    assert not wrong, "core's layers are broken:\n" + "\n".join(sorted(wrong))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among core's modules (packages' __init__ left out), or None."""
    nodes = {m for m in graph if not m.endswith(tuple(ALLOWED)) and m != PACKAGE}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m] & nodes):
            if state.get(t) == 1:
                return stack[stack.index(t) :] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(nodes):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_core_has_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle (TYPE_CHECKING imports count): " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"kvbridge.core.a.x": {"kvbridge.core.a.y"}, "kvbridge.core.a.y": {"kvbridge.core.a.x"}}
    assert _cycle(graph) == ["kvbridge.core.a.x", "kvbridge.core.a.y", "kvbridge.core.a.x"]


@pytest.mark.parametrize("old", sorted(kvbridge.core._MOVED))
def test_old_flat_paths_import_the_moved_module_and_warn(old: str) -> None:
    new = f"{PACKAGE}.{kvbridge.core._MOVED[old]}.{old}"
    sys.modules.pop(f"{PACKAGE}.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"{PACKAGE}.{old}")
    assert module is importlib.import_module(new)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(new in m and f"{PACKAGE}.{old}" in m for m in messages), messages


def test_an_old_path_does_not_shadow_a_public_name() -> None:
    """``describe`` is a module's old name and a function of kvbridge.core: the function stays."""
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import kvbridge.core.describe, kvbridge.core\n"
        "from kvbridge.core.describe import describe as d\n"
        "assert kvbridge.core.describe is d and callable(d), kvbridge.core.describe\n"
        "from kvbridge.core.backend import Backend\n"
        "assert Backend is kvbridge.core.Backend\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_core_module_imports() -> None:
    for name in _modules():
        importlib.import_module(name)
