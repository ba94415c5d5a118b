"""kvbridge.ui: the tables, progress and command-line helpers every command (and the demo) uses."""

import argparse
import io

import pytest

from kvbridge import ui

COLUMNS = ["case", "backend", "descriptors", "kvbridge GB/s", "memcpy GB/s", "verified"]
ROWS = [("64 KiB pages, scattered", "mooncake", 4096, "1.50", None, True),
        ("one block per region", "kvbridge-zmq", 1, "9.75", "11.20", False)]


def render(table, columns, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(columns))
    out = io.StringIO()
    ui.print_table(table, out)
    return out.getvalue()


def test_cells_read_as_words():
    assert [ui.cell(v) for v in (True, False, None, "", (), 1234567, 0.5, ("dram", "vram"), "x")] == [
        "yes", "no", "-", "-", "-", "1,234,567", "0.500", "dram, vram", "x"]


@pytest.mark.parametrize("columns", [30, 45, 60, 80, 100, 160])
def test_a_table_fits_the_terminal_and_keeps_every_column(columns, monkeypatch):
    table = ui.table(COLUMNS, ROWS, right=["descriptors"], nowrap=["backend"])
    text = render(table, columns, monkeypatch)
    assert max(len(line) for line in text.splitlines()) <= columns
    assert "True" not in text and "None" not in text
    # rich leaves out columns that do not fit; every one got a width, and together they fit
    assert all(c.width >= 1 for c in table.columns)
    assert sum(c.width for c in table.columns) + 3 * (len(COLUMNS) - 1) <= columns
    if columns >= 80:  # wide enough for whole words: every value reads as written
        for value in ("64 KiB", "scattered", "mooncake", "4,096", "1.50", "kvbridge-zmq", "11.20", "yes", "no"):
            assert value in text


def test_markup_like_text_prints_as_written(monkeypatch):
    text = render(ui.table(["status"], [("needs kvbridge[nixl]",)]), 80, monkeypatch)
    assert "needs kvbridge[nixl]" in text


def test_progress_without_a_terminal_prints_a_line_per_quarter_with_an_eta():
    out = io.StringIO()
    with ui.progress(8, "requests", description="demo", file=out) as bar:
        for i in range(8):
            bar.advance(note=f"{i // 4} failed")
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [f"demo: {n}/8 requests" for n in (2, 4, 6, 8)]
    assert "ETA" in lines[0] and "ETA" not in lines[-1] and "1 failed" in lines[-1]


def test_progress_without_a_terminal_also_prints_a_line_every_interval_of_a_long_quarter(monkeypatch):
    out, now = io.StringIO(), [0.0]
    monkeypatch.setattr(ui, "_clock", lambda: now[0])
    with ui.progress(100, "pages", file=out) as bar:
        for seconds in (4.0, 11.0, 12.0, 23.0):  # 1 % each: no quarter, but 11 s and 23 s are 10 s after a line
            now[0] = seconds
            bar.advance()
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == ["2/100 pages", "4/100 pages"]


def test_progress_on_a_terminal_is_a_bar_with_an_eta():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    with ui.progress(3, "cases", description="bench", file=out) as bar:
        bar.advance()
        bar.update(3)
    assert "3/3" in out.getvalue() and "ETA" in out.getvalue() and "bench" in out.getvalue()


def test_progress_can_count_without_printing():
    with ui.progress(2, "cases", show=False) as bar:
        bar.advance(2)
    assert bar.completed == 2 and bar.line().startswith("2/2 cases")


def parser():
    p = argparse.ArgumentParser(prog="kvbridge thing", formatter_class=ui.HelpFormatter)
    p.add_argument("--reps", type=ui.int_at_least(5), default=5, help="repetitions")
    p.add_argument("--scale", type=ui.positive_number(), default=1.0, help="a factor (default: one)")
    p.add_argument("--json", action="store_true", help="JSON")
    p.add_argument("--name", help="no default to show")
    return p


def test_help_ends_every_option_with_its_default_unless_it_says_it_or_has_none():
    text = parser().format_help()
    assert "repetitions (default: 5)" in text and "(default: one)" in text
    assert "(default: 1.0)" not in text and "(default: False)" not in text and "(default: None)" not in text


@pytest.mark.parametrize("args, message", [
    (["--reps", "4"], "argument --reps: must be >= 5, got 4"),
    (["--reps", "x"], "argument --reps: expected a whole number, got 'x'"),
    (["--scale", "0"], "argument --scale: must be > 0, got '0'"),
])
def test_bad_values_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        parser().parse_args(args)
    err = capsys.readouterr().err
    assert exit.value.code == ui.EXIT_USAGE and err.startswith("usage: kvbridge thing") and message in err


def test_usage_error_exits_2_with_the_usage_line(capsys):
    with pytest.raises(SystemExit) as exit:
        ui.usage_error(parser(), "--reps and --scale disagree")
    assert exit.value.code == 2
    assert capsys.readouterr().err.endswith("kvbridge thing: error: --reps and --scale disagree\n")


def test_numbers_are_never_split_however_narrow_the_terminal(monkeypatch):
    # bench plan's shape at 80 columns (stdout piped): numbers with separators and ranges, long headers
    columns = ["case", "descriptors", "plan ms", "expanded ms (min-max)", "SGLang ms (min-max)", "speedup", "same"]
    rows = [("61 x 32,768 pages x 1152 B, fragmented", 1877885, "1.69", "34.01 (29.69-38.03)",
             "2395.41 (2285.19-3285.48)", "70x", True),
            ("61 x 1,048,576 pages x 1152 B, fragmented", 60018449, "126.06", "793.07 (549.03-4520.94)", None, None, None)]
    numbers = ["1,877,885", "60,018,449", "126.06", "(2285.19-3285.48)", "(549.03-4520.94)", "2395.41", "70x"]
    for width in (80, 40):
        text = render(ui.table(columns, rows, right=columns[1:6]), width, monkeypatch)
        words = text.split()
        for number in numbers:
            assert number in words, (width, number, text)
    text = render(ui.table(columns, rows, right=columns[1:6]), 80, monkeypatch)
    assert max(len(line) for line in text.splitlines()) <= 80  # wide enough once headers and text fold
