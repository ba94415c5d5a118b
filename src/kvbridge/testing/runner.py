"""``kvbridge conformance NAME [options] [pytest args...]``: the conformance suite against an installed backend.

It writes the one small test file a plugin author would write (a subclass of
:class:`~kvbridge.testing.conformance.BackendConformance` naming the backend)
into a temporary directory and runs pytest on it in this process; the exit
code is pytest's. kvbridge's own options (``--transfer-option``,
``--timeout-scale``) may come before or after NAME; everything else, and
everything after ``--``, goes to pytest. Every option is checked before a
test runs: a bad one is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kvbridge import ui
from kvbridge.config import _backend_type, _option_type, available_backends
from kvbridge.core.description.plugins import get_registry
from kvbridge.core.description.records import OptionError


def _add_own_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transfer-option", dest="transfer_options", type=_option_type, action="append", default=[],
                        metavar="KEY=VALUE",
                        help="a backend option for every manager the suite starts, repeatable (`kvbridge plugins` lists them)")
    parser.add_argument("--timeout-scale", type=ui.positive_number(), default=1.0, metavar="X",
                        help="multiply every deadline and wait the suite allows, for slow transports")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_own_options(parser)
    names = ", ".join(available_backends()) or "none"
    # NAME is checked after parsing: argparse calls a REMAINDER positional after it "required" when NAME is missing.
    parser.add_argument("name", metavar="NAME", type=_backend_type, nargs="?",
                        help=f"an installed backend (available here: {names})")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, metavar="PYTEST_ARGS",
                        help="optional, passed to pytest, e.g. -x -q -k frozen (after --, passed as they are)")
    parser.usage = "%(prog)s [-h] [--transfer-option KEY=VALUE] [--timeout-scale X] NAME [PYTEST_ARGS ...]"


def _own_options_after_name(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Take kvbridge's options out of what followed NAME (into ``args``); the rest is pytest's."""
    rest: list[str] = list(args.pytest_args)
    verbatim: list[str] = []
    if "--" in rest:
        cut = rest.index("--")
        rest, verbatim = rest[:cut], rest[cut + 1:]
    # No abbreviations: pytest's own --timeout must not be taken for --timeout-scale.
    own = argparse.ArgumentParser(prog=parser.prog, add_help=False, allow_abbrev=False, exit_on_error=False)
    _add_own_options(own)
    try:
        _, pytest_args = own.parse_known_args(rest, namespace=args)
    except argparse.ArgumentError as exc:
        ui.usage_error(parser, str(exc))
    return pytest_args + verbatim


def run_from_args(args: argparse.Namespace) -> int:
    from kvbridge.scaffold import conformance_test_file

    parser: argparse.ArgumentParser = args.command_parser
    if args.name is None:
        ui.usage_error(parser, "the following argument is required: NAME (an installed backend; available here: "
                               f"{', '.join(available_backends()) or 'none'})")
    pytest_args = _own_options_after_name(args, parser)
    options = dict(args.transfer_options)
    try:
        get_registry().backend_spec(args.name).check_options(options)
    except OptionError as exc:
        ui.usage_error(parser, f"argument --transfer-option: {exc}")
    try:
        import pytest
    except ImportError:
        raise SystemExit(f"{parser.prog}: error: needs pytest (pip install pytest)") from None

    with tempfile.TemporaryDirectory(prefix="kvbridge-conformance-") as tmp:
        test_file = Path(tmp) / f"test_{args.name.replace('-', '_')}_conformance.py"
        test_file.write_text(conformance_test_file(args.name, options, args.timeout_scale,
                                                   note="Written by `kvbridge conformance`."))
        # An ini file here makes this directory the rootdir, so no project's pytest settings apply.
        (Path(tmp) / "pytest.ini").write_text("[pytest]\naddopts = -ra\n")
        return int(pytest.main([str(test_file), "-p", "no:cacheprovider", *pytest_args]))
