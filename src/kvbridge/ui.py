"""What every ``kvbridge`` command shares on the terminal: tables, progress, help and usage errors.

The conventions these implement are written down in ``docs/cli.md``:

- results go to stdout, as a :func:`table` (rich, wrapped to fit the
  terminal; ``COLUMNS`` or 80 columns when stdout is not one) or, with
  ``--json``, as JSON whose keys carry their units;
- progress goes to stderr through :func:`progress`, with the elapsed time and
  an ETA: a bar on a terminal, a line at each quarter (and every 10 s)
  elsewhere (CI logs);
- values read as words: ``yes``/``no``, ``-`` for none (:func:`cell`);
- ``--help`` shows every option's default (:class:`HelpFormatter`), and the
  parser enforces what the help says (:func:`int_at_least`, :func:`positive_number`);
- a usage error exits 2 with the usage line (:func:`usage_error`), a failed
  run exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, NoReturn

from rich import box
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "HelpFormatter",
    "Tracker",
    "cell",
    "console",
    "int_at_least",
    "positive_number",
    "print_table",
    "progress",
    "table",
    "usage_error",
]

EXIT_OK = 0
#: The command ran and something failed (a transfer, a check; with ``plugins --strict``, a plugin that did not load).
EXIT_FAILED = 1
#: The command line was wrong (argparse's own status): nothing ran.
EXIT_USAGE = 2


# -- tables ----------------------------------------------------------------------------
def console(file: IO[str] | None = None) -> Console:
    """A rich console on ``file`` (default: stdout) as wide as the terminal.

    Markup is off: plugin text such as ``kvbridge[nixl]`` prints as written.
    Without a terminal the width is ``COLUMNS``, or 80, and no colour codes are written.
    """
    return Console(file=file if file is not None else sys.stdout, markup=False, highlight=False, emoji=False)


def cell(value: Any) -> str:
    """``value`` as table text: ``yes``/``no`` for booleans, ``-`` for None or empty,
    integers with thousands separators, sequences joined with ``, ``."""
    if value is None or (isinstance(value, (str, tuple, list)) and not value):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3f}"
    if isinstance(value, (tuple, list)):
        return ", ".join(cell(v) for v in value)
    return str(value)


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None,
          right: Iterable[str] = (), nowrap: Iterable[str] = ()) -> Table:
    """A table of ``rows`` (values go through :func:`cell`) under ``columns``.

    Columns named in ``right`` (numbers) are right-aligned; columns named in
    ``nowrap`` (names, identifiers) keep each value on one line. Printed, it
    fits the console's width: the other cells wrap at spaces, and words longer
    than their column fold.
    """
    aligned, whole = set(right), set(nowrap)
    out = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, header_style="bold", show_edge=False,
                pad_edge=False)
    for name in columns:
        out.add_column(name, justify="right" if name in aligned else "left", overflow="fold", no_wrap=name in whole)
    for row in rows:
        out.add_row(*(cell(v) for v in row))
    return out


#: Characters between two columns: a space of padding each side of the separator.
_GAPS = 3


def print_table(renderable: RenderableType, file: IO[str] | None = None) -> None:
    """Print a :func:`table` (or any rich renderable) to ``file`` (default: stdout).

    A table keeps its words whole and its ``nowrap`` columns on one line when
    the console is wide enough for that; on a narrower one headers and text
    columns fold, but a number (a word of a right-aligned column) is never
    split: where even that does not fit, the table is printed wider than the
    console (rich would otherwise split numbers or leave columns out).
    """
    out = console(file)
    if isinstance(renderable, Table):
        needed = _fit(out, renderable)
        if needed > out.width:
            out.width = needed
    out.print(renderable)


def _fit(out: Console, t: Table) -> int:
    """Fix every column's width so the table fits ``out`` without rich leaving a column out; the width it takes.

    Each column gets its widest cell if all fit; else at least its longest word
    (a ``nowrap`` column: its widest cell) plus a share of the rest in
    proportion to what it lacks; on a console too narrow even for that,
    headers and the other columns fold, in proportion to their widest cell,
    while numeric (right-aligned) columns keep their longest word whole.
    """
    options = out.options.update_width(1 << 20)
    low, high, floor = [], [], []
    for column in t.columns:
        head = Measurement.get(out, options, column.header)
        cells = [Measurement.get(out, options, c) for c in column.cells]
        high.append(max(m.maximum for m in (head, *cells)))
        whole = max((m.maximum if column.no_wrap else m.minimum for m in cells), default=0)
        low.append(max(whole, head.maximum if column.no_wrap else head.minimum))
        floor.append(whole if column.justify == "right" else 1)
    gaps = _GAPS * (len(t.columns) - 1)
    room = out.width - gaps
    if sum(high) <= room:
        widths = high
    elif sum(low) <= room:
        spare, lack = room - sum(low), [h - lo for h, lo in zip(high, low)]
        widths = [lo + spare * need // max(1, sum(lack)) for lo, need in zip(low, lack)]
    else:  # too narrow for whole words: what may fold shares what the whole words leave
        spare = max(0, room - sum(floor))
        flexible = [h - f for h, f in zip(high, floor)]
        widths = [f + min(need, spare * need // max(1, sum(flexible))) for f, need in zip(floor, flexible)]
        for column in t.columns:
            column.no_wrap = False
    for column, width in zip(t.columns, widths):
        column.width = max(1, width)
    return sum(max(1, w) for w in widths) + gaps


# -- progress ----------------------------------------------------------------------------
_clock = time.monotonic  # what progress times itself by (tests substitute it)

#: Without a terminal, progress prints a line at each quarter, and at least this often (seconds) in between.
LINE_INTERVAL = 10.0


class Tracker:
    """Progress of one run; made by :func:`progress`."""

    def __init__(self, total: int, unit: str, description: str, file: IO[str] | None) -> None:
        self.total, self.unit, self.description, self.file = max(0, total), unit, description, file
        self.completed = 0
        self.note = ""
        self._t0 = self._last_line = _clock()
        self._next_quarter = 1
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        if file is not None and file.isatty():
            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                TextColumn("{task.fields[note]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(file=file, markup=False, highlight=False, emoji=False),
            )
            self._task = self._bar.add_task(description, total=self.total or None, note="")

    def stage(self, what: str | None) -> None:
        """A step before the counted work starts (``"starting servers"``); None: it is over, and
        elapsed time and ETA count from now."""
        if what is None:
            self._t0 = self._last_line = _clock()
        text = f"{self.description}: {what}" if what else self.description
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=text)
        elif what and self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()

    def advance(self, steps: int = 1, note: str | None = None) -> None:
        """``steps`` more are done; ``note`` (e.g. ``"1 failed"``) replaces the last one."""
        self.update(self.completed + steps, note)

    def update(self, completed: int, note: str | None = None, description: str | None = None,
               total: int | None = None) -> None:
        """``completed`` of the total are done (it only moves forward); ``total`` replaces the total
        (for work whose size is known only once it starts)."""
        if total is not None:
            self.total = max(0, total)
        self.completed = max(self.completed, min(completed, self.total) if self.total else completed)
        if note is not None:
            self.note = note
        if description is not None:
            self.description = description
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.completed, note=self.note, description=self.description,
                             total=self.total or None)
        elif self.file is not None and self.total:
            quarter = 4 * self.completed // self.total
            now = _clock()
            if quarter >= self._next_quarter or (now - self._last_line >= LINE_INTERVAL and self.completed < self.total):
                self._next_quarter = max(self._next_quarter, quarter + 1)
                self._last_line = now
                self.file.write(self.line() + "\n")
                self.file.flush()

    def eta(self) -> float | None:
        """Seconds left at the rate so far; None before the first step."""
        if not self.completed or not self.total:
            return None
        elapsed = _clock() - self._t0
        return elapsed / self.completed * (self.total - self.completed)

    def line(self) -> str:
        """The state in one line, as printed where there is no terminal."""
        elapsed = _clock() - self._t0
        eta = self.eta()
        text = f"{self.description + ': ' if self.description else ''}{self.completed:,}/{self.total:,} {self.unit}"
        text += f", {self.note}" if self.note else ""
        text += f", {elapsed:.1f} s elapsed"
        if eta is not None and self.completed < self.total:
            text += f", ETA {eta:.0f} s"
        return text

    def _start(self) -> None:
        if self._bar is not None:
            self._bar.start()

    def _stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()


@contextmanager
def progress(total: int, unit: str, *, description: str = "", file: IO[str] | None = None,
             show: bool = True) -> Iterator[Tracker]:
    """Show the progress of ``total`` ``unit`` (``"requests"``) on ``file`` (default: stderr) while the block runs.

    On a terminal: a rich bar with done/total, elapsed time and ETA, left in
    place when the block ends. Elsewhere: one :meth:`Tracker.line` at each
    quarter, and every :data:`LINE_INTERVAL` seconds of a long quarter.
    ``show=False`` counts without printing anything.
    """
    tracker = Tracker(total, unit, description, (file if file is not None else sys.stderr) if show else None)
    tracker._start()
    try:
        yield tracker
    finally:
        tracker._stop()


# -- command lines -------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's help ends with its default.

    ``(default: X)`` is added unless the help already mentions a default, or
    the default is nothing to show (None, False, an empty list).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == []
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exit with status 2 after ``parser``'s usage line and ``PROG: error: MESSAGE``.

    For problems found after parsing (values that depend on each other, a
    backend's options); problems argparse sees itself end the same way.
    """
    parser.error(message)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``minimum``; anything else is a usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def positive_number(unit: str = "") -> Callable[[str], float]:
    """An argparse ``type``: a number > 0 (of ``unit``, named in the error: ``"seconds"``)."""
    return _number(unit, zero=False)


def non_negative_number(unit: str = "") -> Callable[[str], float]:
    """An argparse ``type``: a number >= 0 (of ``unit``, named in the error: ``"seconds"``)."""
    return _number(unit, zero=True)


def _number(unit: str, zero: bool) -> Callable[[str], float]:
    of_unit, after = (f" of {unit}", f" {unit}") if unit else ("", "")
    bound = ">= 0" if zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number{of_unit}, got {text!r}") from None
        if not (value >= 0 if zero else value > 0):
            raise argparse.ArgumentTypeError(f"must be {bound}{after}, got {text!r}")
        return value

    parse.__name__ = f"number {bound}{after}"
    return parse
