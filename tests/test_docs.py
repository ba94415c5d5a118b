"""The README and docs/ name only commands and options that exist, and every --help shows its defaults."""

import argparse
import re
from pathlib import Path

import pytest

from kvbridge import ui
from kvbridge.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Options of other programs the docs show (pip, pytest, setup scripts, benchmarks/ scripts' own), by name.
OTHERS = {"--no-deps", "--extra-index-url", "--index-url", "--help", "--version", "--durations", "--no-index",
          "--isolated", "--dist", "--maxprocesses", "--trace-config", "--import-mode", "--strict-markers",
          "--timeout", "--collect-only", "--progress-bar", "--dry-run", "--directory",
          "--lower-case-words",  # docs/cli.md's naming rule, as an example
          "--fault", "--cut",  # python -m kvbridge.testing.faults and .soak, named apart from their command lines (docs/failures.md)
          # the frameworks' own servers and routers (docs/integrations.md: vllm serve, sglang.launch_server, the router)
          "--kv-transfer-config", "--port", "--host", "--model-path", "--tp", "--disaggregation-mode",
          "--disaggregation-transfer-backend", "--disaggregation-bootstrap-port", "--pd-disaggregation", "--prefill",
          "--disaggregation-decode-host-receive-threshold"}
# Spans that show another program's command line (a module's or a script's own options).
ELSEWHERE = re.compile(r"python -m kvbridge\.(testing|bench)\.|benchmarks/|examples/|pip |pytest ")


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its words after ``kvbridge`` (``""``: the top level)."""
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(words: str, parser: argparse.ArgumentParser) -> None:
        out[words] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{words} {name}".strip(), sub)

    walk("", build_parser())
    return out


def spans() -> list[tuple[str, str]]:
    """(file, text) of every inline code span and code-block line in the docs."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            out += [(path.name, line) for line in block.splitlines()]
        out += [(path.name, m) for m in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    return out


def commands() -> list[tuple[str, str, list[str]]]:
    """(file, command words, options) for each ``kvbridge ...`` the docs show."""
    known = parsers()
    out = []
    for name, text in spans():
        for m in re.finditer(r"(?:^|[\s(])kvbridge((?: [a-z][a-z-]*)*)((?: [^#]*)?)", text):
            words = m.group(1).split()
            path = ""
            for w in words:  # the longest prefix that names a command; the rest are its arguments
                if f"{path} {w}".strip() in known:
                    path = f"{path} {w}".strip()
                else:
                    break
            rest = " ".join(words[len(path.split()) if path else 0:]) + " " + m.group(2)
            out.append((name, path, re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)))
    return out


def option_names(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_every_command_and_option_the_docs_show_exists():
    known = parsers()
    missing = []
    for name, path, options in commands():
        if not path:  # "kvbridge ... --json": a placeholder for any command
            continue
        for opt in options:
            if opt not in option_names(known[path]) and opt not in OTHERS and not opt.endswith("-"):
                missing.append(f"{name}: `kvbridge {path}` has no {opt}")
    assert not missing, "\n".join(sorted(set(missing)))
    assert {p for _, p, _ in commands()} >= {"demo", "plugins", "conformance", "bench plan", "bench transfer"}


def test_every_option_the_docs_name_exists_somewhere():
    everything = set().union(*(option_names(p) for p in parsers().values()))
    named = {opt for _, text in spans() if not ELSEWHERE.search(text)
             for opt in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?![\w*-])", text)}
    unknown = sorted(named - everything - OTHERS)
    assert not unknown, unknown


@pytest.mark.parametrize("words", sorted(parsers()))
def test_every_help_shows_each_options_default(words):
    parser = parsers()[words]
    assert parser.formatter_class is ui.HelpFormatter or issubclass(parser.formatter_class, ui.HelpFormatter), words
    lacking = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if action.default in (None, False, [], argparse.SUPPRESS) or isinstance(action, argparse._VersionAction):
            continue
        text = parser.formatter_class(parser.prog)._get_help_string(action) or ""
        if "default" not in text:
            lacking.append(action.option_strings[0])
    assert not lacking, f"kvbridge {words} --help: no default shown for {lacking}"
