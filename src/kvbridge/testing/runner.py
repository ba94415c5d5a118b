"""``kvbridge conformance NAME [pytest args...]``: the conformance suite against an installed backend.

It writes the one small test file a plugin author would write (a subclass of
:class:`~kvbridge.testing.conformance.BackendConformance` naming the backend)
into a temporary directory and runs pytest on it in this process; the exit
code is pytest's.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from kvbridge.core.plugins import get_registry
from kvbridge.core.records import OptionError

TEST_FILE = '''"""Written by `kvbridge conformance`."""

from kvbridge.testing.conformance import BackendConformance


class Test{cls}(BackendConformance):
    backend = {name!r}
    backend_options = {options!r}
    timeout_scale = {scale!r}
'''


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transfer-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a backend option for every manager the suite starts (repeatable; before NAME)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, metavar="X",
                        help="multiply every deadline and wait the suite allows, for slow transports (before NAME)")
    parser.add_argument("name", metavar="NAME", help="an installed backend (`kvbridge plugins` lists them)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, metavar="PYTEST_ARGS",
                        help="passed to pytest, e.g. -x -q -k frozen")


def _usage_error(message: str) -> NoReturn:
    print(f"kvbridge conformance: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_from_args(args: argparse.Namespace) -> int:
    registry = get_registry()
    registry.backend_spec(args.name)  # unknown: the registry's error, listing what is installed
    if not registry.backend_available(args.name):
        registry.load_backend(args.name)  # raises, saying which package installs the engine
    options = {}
    for item in args.transfer_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _usage_error(f"--transfer-option {item!r} is not KEY=VALUE")
        options[key] = value
    try:
        registry.backend_spec(args.name).check_options(options)
    except OptionError as exc:
        _usage_error(str(exc))
    if args.timeout_scale <= 0:
        _usage_error(f"--timeout-scale must be > 0, got {args.timeout_scale}")
    try:
        import pytest
    except ImportError:
        raise SystemExit("kvbridge conformance: needs pytest (pip install pytest)") from None

    cls = "".join(part.capitalize() for part in re.split(r"[-_]", args.name))
    with tempfile.TemporaryDirectory(prefix="kvbridge-conformance-") as tmp:
        test_file = Path(tmp) / f"test_{args.name.replace('-', '_')}_conformance.py"
        test_file.write_text(TEST_FILE.format(cls=cls, name=args.name, options=options, scale=args.timeout_scale))
        # An ini file here makes this directory the rootdir, so no project's pytest settings apply.
        (Path(tmp) / "pytest.ini").write_text("[pytest]\naddopts = -ra\n")
        return int(pytest.main([str(test_file), "-p", "no:cacheprovider", *args.pytest_args]))
