"""``kvbridge demo``: a router, a prefill and a decode server on loopback, checked token by token.

It starts the two servers of ``kvbridge.demo.server`` (each with its TP ranks)
and the router as processes, each in its own process group, sends requests
of varied prompt lengths through the router, and compares every generated
sequence (and every draft guess) with a colocated run of the same model in
this process (TP 1, no transfer). The table reports what kvbridge moved per
state type, the transfer rate while transfers ran, transfer latency, TTFT,
and PASS or FAIL. Exit status: 0 PASS, 1 FAIL, 2 usage error. Ctrl-C or
SIGTERM stops every process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from kvbridge import ui
from kvbridge.config import TransferConfig, add_transfer_args
from kvbridge.core.control.auth import ENV_SECRET, ENV_SECRET_FILE
from kvbridge.demo.parent import ENV as PARENT_ENV

__all__ = ["add_arguments", "run_from_args", "prompts"]

STALL_S = 60.0  # no answer at all for this long: the run fails instead of waiting
START_S = 120.0  # servers and router must be ready within this
TEXT = (b"Prefill computes the prompt's caches; decode generates from them. Between the two, kvbridge moves "
        b"full-attention pages, sliding-window pages, Mamba conv and SSM state, indexer keys, compressed tokens "
        b"into host memory, the draft head's caches and a metadata row, across different TP sizes. ")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags plus the transfer flags every host server gets (``add_transfer_args``)."""
    parser.add_argument("--prefill-tp", type=int, default=2, choices=(1, 2, 4),
                        help="prefill server's TP ranks (default: %(default)s)")
    parser.add_argument("--decode-tp", type=int, default=1, choices=(1, 2, 4),
                        help="decode server's TP ranks (default: %(default)s)")
    parser.add_argument("--requests", type=_positive, default=16, help="requests to generate (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=_positive, default=16,
                        help="tokens generated per request (default: %(default)s)")
    parser.add_argument("--concurrency", type=_positive, default=4,
                        help="requests in flight at once (default: %(default)s)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where models and caches live (default: %(default)s)")
    parser.add_argument("--draft", action=argparse.BooleanOptionalAction, default=True,
                        help="run the MTP draft head (its caches move too) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the weights and the prompts (default: %(default)s)")
    parser.add_argument("--layerwise", action=argparse.BooleanOptionalAction, default=True,
                        help="prefill sends each layer as the model computes it, hiding the transfer behind "
                             "compute; --no-layerwise sends each chunk once computed (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON document (progress still goes to stderr)")
    parser.add_argument("--inject-fault", help=argparse.SUPPRESS)  # tests: passed on to the decode server
    add_transfer_args(parser)
    parser.set_defaults(demo_parser=parser)


def prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of varied length (1 to 300 tokens, so some need several prefill chunks)."""
    rng = np.random.default_rng(seed)
    text = TEXT * 4
    out = []
    for _ in range(n):
        length, offset = int(rng.integers(1, 301)), int(rng.integers(0, len(TEXT)))
        out.append(list(text[offset:offset + length]))
    return out


# -- processes ------------------------------------------------------------------------------------
class Children:
    """Processes this demo started, each in its own session (process group), so that stopping a
    server also stops the TP rank processes it forked."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.logs: dict[str, IO[str]] = {}
        self.lines: dict[str, queue.Queue[str]] = {}
        env = dict(os.environ)
        for key, value in {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "MC_LOG_LEVEL": "WARNING"}.items():
            env.setdefault(key, value)  # engines on loopback (docs/engines.md)
        if ENV_SECRET not in env and ENV_SECRET_FILE not in env:
            # One secret for this run's processes, passed in their environment (never on a
            # command line): every control message between them is authenticated (docs/security.md).
            env[ENV_SECRET] = secrets.token_hex(32)
        env[PARENT_ENV] = str(os.getpid())  # each child ends with this process, even if it is SIGKILLed
        self.env = env

    def start(self, name: str, module: str, args: list[str]) -> None:
        log = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=log,
                                text=True, env=self.env, start_new_session=True)
        self.procs[name], self.logs[name], self.lines[name] = proc, log, queue.Queue()
        threading.Thread(target=self._drain, args=(proc, self.lines[name]), daemon=True).start()

    @staticmethod
    def _drain(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    def ready(self, name: str, deadline: float) -> dict[str, Any]:
        """The JSON of ``name``'s ``READY`` line; a process that exits first fails the demo."""
        proc = self.procs[name]
        while time.monotonic() < deadline:
            try:
                line = self.lines[name].get(timeout=0.05)
            except queue.Empty:
                if proc.poll() is not None:
                    why = f"the {name} process exited with {proc.returncode} before it was ready"
                    raise Failure(why, self.tail(name))
                continue
            if line.startswith("READY "):
                return json.loads(line[len("READY "):])
        raise Failure(f"the {name} process was not ready within {START_S:g} s", self.tail(name))

    def check(self) -> None:
        """Fail now if a process ended before its time (rather than wait for answers that cannot come)."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise Failure(f"the {name} process exited with {proc.returncode}", self.tail(name))

    def tail(self, name: str, chars: int = 3000) -> str:
        log = self.logs[name]
        log.flush()
        log.seek(0)
        return log.read()[-chars:]

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.01, deadline - time.monotonic()))

    def stop(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after 5 s."""
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.procs.values() if p.poll() is None or _group_alive(p.pid)]
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
            deadline = time.monotonic() + grace
            while any(p.poll() is None or _group_alive(p.pid) for p in alive) and time.monotonic() < deadline:
                time.sleep(0.02)
        for log in self.logs.values():
            log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Failure(Exception):
    """The run could not complete; ``log`` is the tail of the process at fault."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log


class Stopped(BaseException):
    """SIGTERM: unwind like Ctrl-C, stopping every child on the way out."""


# -- the run --------------------------------------------------------------------------------------
@dataclass
class Result:
    prompt: list[int]
    submitted: float = 0.0
    first_at: float | None = None
    done: dict[str, Any] = field(default_factory=dict)


def _server_args(args: argparse.Namespace, cfg: TransferConfig, role: str, tp: int) -> list[str]:
    out = ["--role", role, "--tp", str(tp), "--device", args.device, "--seed", str(args.seed),
           "--draft" if args.draft else "--no-draft", "--transfer-backend", cfg.backend, "--transfer-host", cfg.host]
    for key, value in cfg.backend_options.items():
        out += ["--transfer-option", f"{key}={value}"]
    timeouts = {"--transfer-bootstrap-timeout": cfg.bootstrap_timeout,
                "--transfer-waiting-timeout": cfg.waiting_timeout,
                "--transfer-timeout": cfg.transfer_timeout,
                "--transfer-heartbeat-interval": cfg.heartbeat_interval,
                "--transfer-heartbeat-timeout": cfg.heartbeat_timeout}
    for flag, seconds in timeouts.items():
        out += [flag, repr(seconds)]
    if cfg.strict_index_lengths:
        out.append("--transfer-strict-index-lengths")
    if role == "prefill":
        out.append("--layerwise" if args.layerwise else "--no-layerwise")
    if role == "prefill" and cfg.bootstrap:
        out += ["--transfer-bootstrap", cfg.bootstrap]
    if role == "decode" and args.inject_fault:
        out += ["--inject-fault", args.inject_fault]
    return out


def run(args: argparse.Namespace, cfg: TransferConfig, progress: Any) -> dict[str, Any]:
    """Start everything, generate, check; the summary as plain data."""
    t0 = time.monotonic()
    work = prompts(args.requests, args.seed)
    children = Children()
    reference: dict[str, Any] = {}
    stop = threading.Event()
    thread = threading.Thread(target=_colocated, args=(args, work, reference, stop.is_set), daemon=True)
    interrupted = False
    try:
        children.start("prefill", "kvbridge.demo.server", _server_args(args, cfg, "prefill", args.prefill_tp))
        children.start("decode", "kvbridge.demo.server", _server_args(args, cfg, "decode", args.decode_tp))
        thread.start()  # the reference computes while the servers start
        deadline = time.monotonic() + START_S
        progress.stage("starting servers")
        fronts = {name: children.ready(name, deadline)["front"] for name in ("prefill", "decode")}
        children.start("router", "kvbridge.demo.router", ["--prefill", fronts["prefill"], "--decode", fronts["decode"],
                                                          "--host", cfg.host])
        router = children.ready("router", deadline)["front"]
        progress.stage(None)
        results, stats = _generate(router, work, args, progress, children.check)
        children.wait(10)  # shut down by the router; stopped below if not
        thread.join(STALL_S)
        if "outputs" not in reference:
            raise Failure(f"the colocated reference run did not finish: {reference.get('error', 'timed out')}")
    except Failure as exc:
        return {"result": "FAIL", "problems": [str(exc)], "log_tail": exc.log}
    except BaseException:  # Ctrl-C, SIGTERM: the program leaves with os._exit (cli.main), which a thread
        interrupted = True  # still inside torch cannot abort; it is not waited for long
        raise
    finally:
        # A second Ctrl-C or a SIGTERM must not cut the clean-up short: they wait (blocked) until it is done,
        # then interrupt as usual.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            stop.set()
            children.stop()
            if thread.is_alive():  # a thread inside torch when the interpreter exits aborts it
                thread.join(1.0 if interrupted else STALL_S)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return summarize(args, cfg, results, reference["outputs"], stats, time.monotonic() - t0)


def _colocated(args: argparse.Namespace, work: list[list[int]], out: dict[str, Any], stop: Any) -> None:
    try:
        import torch

        from .generate import colocated
        from .model import ModelConfig

        torch.set_num_threads(1)
        outputs = colocated(ModelConfig(draft=args.draft, seed=args.seed), work, args.max_new_tokens, args.device, stop)
        if len(outputs) == len(work):
            out["outputs"] = outputs
    except Exception as exc:  # reported as the run's failure
        out["error"] = repr(exc)


def _generate(router: str, work: list[list[int]], args: argparse.Namespace, progress: Any,
              check: Callable[[], None]) -> tuple[list[Result], dict[str, Any]]:
    """Every request through the router, ``--concurrency`` at a time; then both servers' metrics."""
    from .client import Client

    client = Client(router)
    results = [Result(p) for p in work]
    try:
        next_up, in_flight, finished, failed, last = 0, 0, 0, 0, time.monotonic()
        while finished < len(work):
            while in_flight < args.concurrency and next_up < len(work):
                rid = client.submit(work[next_up], args.max_new_tokens)
                results[rid].submitted = time.monotonic()
                next_up, in_flight = next_up + 1, in_flight + 1
            msg = client.receive(0.5)
            if msg is None:
                check()
                if time.monotonic() - last > STALL_S:
                    raise Failure(f"no answer from the router for {STALL_S:g} s ({finished} of {len(work)} requests done)")
                continue
            last = time.monotonic()
            r = results[msg["id"]]
            if msg["op"] == "first":
                r.first_at = time.monotonic()
            elif msg["op"] == "done":
                r.done = msg
                in_flight, finished = in_flight - 1, finished + 1
                failed += not msg["ok"]
                progress.advance(note=f"{failed} failed")
        stats = client.call({"op": "stats"}, STALL_S)
        client.call({"op": "shutdown"}, 10)
    finally:
        client.close()
    return results, stats


# -- the summary ------------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, 100 * q)) if values else None


def summarize(args: argparse.Namespace, cfg: TransferConfig, results: list[Result], expected: list[Any],
              stats: dict[str, Any], wall_s: float) -> dict[str, Any]:
    problems: list[str] = []
    mismatches: list[dict[str, Any]] = []
    ok = [r for r in results if r.done.get("ok")]
    for i, (r, want) in enumerate(zip(results, expected)):
        if not r.done.get("ok"):
            problems.append(f"request {i}: {r.done.get('reason') or 'no answer'}")
            continue
        checks = (("tokens", r.done["tokens"], want.tokens), ("draft", r.done["draft"], want.draft if args.draft else []))
        for what, got, exp in checks:
            if got != exp:
                at = next((j for j, (a, b) in enumerate(zip(got, exp)) if a != b), min(len(got), len(exp)))
                mismatches.append({"request": i, "prompt_tokens": len(r.prompt), "what": what,
                                   "first_difference_at": at, "expected": exp, "got": got})
    if mismatches:
        problems.append(f"{len({m['request'] for m in mismatches})} request(s) differ from the colocated run")
    backend_bytes: dict[str, int] = {}
    job_s = 0.0
    for snap in stats.get("prefill", []):  # prefill writes; its ranks count what moved (under their lanes' name)
        for b in snap["backends"].values():
            for state, n in b.get("bytes", {}).items():
                backend_bytes[state] = backend_bytes.get(state, 0) + n
            job_s += b.get("transfer_seconds", {}).get("sum", 0.0)
    total = sum(backend_bytes.values())
    ttft = [1e3 * (r.first_at - r.submitted) for r in ok if r.first_at is not None]
    lat = [r.done["prefill"]["transfer_ms"] for r in ok if r.done["prefill"].get("transfer_ms") is not None]
    chunks = sum(r.done["prefill"].get("chunks", 0) for r in ok)
    layerwise_chunks = sum(r.done["prefill"].get("layerwise_chunks", 0) for r in ok)
    return {
        "result": "PASS" if not problems else "FAIL",
        "token_check": "PASS" if not mismatches and len(ok) == len(results) else "FAIL",
        "backend": cfg.backend,
        "backend_options": dict(cfg.backend_options),
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "device": args.device,
        "draft": args.draft,
        "layerwise": args.layerwise,
        "requests": len(results),
        "succeeded": len(ok),
        "prompt_tokens": sum(len(r.prompt) for r in results),
        "generated_tokens": sum(len(r.done.get("tokens", [])) for r in ok),
        "draft_guesses_checked": sum(len(r.done.get("draft", [])) for r in ok),
        "bytes_by_state": dict(sorted(backend_bytes.items())),
        "bytes": total,
        "transfer_job_s": job_s,
        "transfer_GBps": total / job_s / 1e9 if job_s else None,
        "chunks": chunks,
        "layerwise_chunks": layerwise_chunks,
        "transfer_latency_p50_ms": _pct(lat, 0.5),
        "transfer_latency_p99_ms": _pct(lat, 0.99),
        "transfer_latency_ms_in_order": lat,  # requests in submission order: the first ones show a cold start
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p99_ms": _pct(ttft, 0.99),
        "wall_s": wall_s,
        "mismatches": mismatches,
        "problems": problems,
    }


def table(s: dict[str, Any]) -> Any:
    """The summary as a rich table (two columns; wraps to the terminal's width)."""
    from rich import box
    from rich.table import Table

    if "backend" not in s:
        t = Table(title="kvbridge demo", box=box.SIMPLE_HEAD, show_header=False)
        t.add_column(style="bold")
        t.add_column(overflow="fold")
        for p in s["problems"]:
            t.add_row("problem", p)
        t.add_row("result", "[red bold]FAIL[/]")
        return t
    draft = "draft head on" if s["draft"] else "no draft head"
    t = Table(title=f"kvbridge demo: {s['backend']}, prefill TP {s['prefill_tp']} -> decode TP {s['decode_tp']}, "
                    f"{s['device']}, {draft}", box=box.SIMPLE_HEAD, show_header=False, title_justify="left")
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} ms"

    t.add_row("requests", f"{s['succeeded']} / {s['requests']} completed")
    t.add_row("tokens", f"{s['prompt_tokens']:,} prompt, {s['generated_tokens']:,} generated"
                        + (f", {s['draft_guesses_checked']:,} draft guesses" if s["draft"] else ""))
    for state, n in s["bytes_by_state"].items():
        t.add_row(f"bytes {state}", f"{n:,}")
    rate = s["transfer_GBps"]
    t.add_row("bytes total", f"{s['bytes']:,} in {1e3 * s['transfer_job_s']:.1f} ms of transfer jobs")
    t.add_row("transfer rate", "-" if rate is None else f"{rate:.3f} GB/s (bytes / time transfers ran)")
    if s["layerwise"]:
        t.add_row("layer-wise chunks", f"{s['layerwise_chunks']} / {s['chunks']} (the others were computed before "
                                       "decode's destination lists arrived: sent whole)")
    else:
        t.add_row("layer-wise chunks", f"off: {s['chunks']} chunks, each sent once computed")
    t.add_row("transfer latency p50 / p99", f"{ms(s['transfer_latency_p50_ms'])} / {ms(s['transfer_latency_p99_ms'])}")
    t.add_row("TTFT p50 / p99", f"{ms(s['ttft_p50_ms'])} / {ms(s['ttft_p99_ms'])}")
    check = s["token_check"]
    same = s["requests"] - len({m["request"] for m in s["mismatches"]})
    t.add_row("token check", f"[{'green' if check == 'PASS' else 'red'} bold]{check}[/]: {same} / {s['requests']} "
                             "requests equal the colocated run")
    for m in s["mismatches"][:3]:
        t.add_row("", f"request {m['request']} ({m['prompt_tokens']} prompt tokens): {m['what']} differ from "
                      f"position {m['first_difference_at']}")
    for p in s["problems"]:
        t.add_row("problem", p)
    t.add_row("wall time", f"{s['wall_s']:.1f} s")
    t.add_row("result", f"[{'green' if s['result'] == 'PASS' else 'red'} bold]{s['result']}[/]")
    return t


def import_interruptible(name: str) -> Any:
    """``importlib.import_module(name)``; a Ctrl-C that comes during the import is raised once it returns.

    A SIGINT landing inside ``import torch`` could be lost (seen here: in 5 of 16 bare ``import torch``
    runs with a SIGINT 1-3 s in, Python's handler ran and the import still returned normally): the
    KeyboardInterrupt raised inside the import can be caught there. So SIGINT is blocked in this
    thread while the import runs (delivered, and raised, as soon as it ends), and a handler notes one
    that still came through (another thread took it) to raise it after the import too. Where SIGINT
    is not Python's to handle (ignored, or not the main thread), it is a plain import."""
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        return importlib.import_module(name)
    handler: Callable[[int, Any], Any] = previous
    seen: list[int] = []

    def on_int(signum: int, frame: Any) -> None:
        seen.append(signum)
        handler(signum, frame)  # Python's default_int_handler: raises KeyboardInterrupt

    signal.signal(signal.SIGINT, on_int)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        module = importlib.import_module(name)
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a SIGINT held back is delivered now, and raised
    if seen:
        raise KeyboardInterrupt
    return module


def _environment_problem(device: str) -> str | None:
    """Why the demo cannot run here (a usage error, like an engine that is not installed), or None."""
    try:
        torch = import_interruptible("torch")
    except ImportError:
        return ("the demo runs a PyTorch model and torch is not installed: install PyTorch's CPU build "
                "(pip install torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu; from a checkout, "
                "bash scripts/setup.sh without KVBRIDGE_TORCH=none), or pip install 'kvbridge[torch]' on a GPU host")
    if device == "cuda" and not torch.cuda.is_available():
        return "argument --device: cuda was asked for but torch sees no CUDA device"
    return None


def run_from_args(args: argparse.Namespace) -> int:
    """``kvbridge demo``: 0 PASS, 1 FAIL, 2 usage error, 130 Ctrl-C and 143 SIGTERM at any moment (once every
    process and thread it started has been stopped)."""
    from rich.console import Console

    def on_term(*_: object) -> None:
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        parser = getattr(args, "demo_parser", None)
        cfg = TransferConfig.from_args(args, parser)  # the backend and its options, checked together; exits 2
        problem = _environment_problem(args.device)  # imports torch: Ctrl-C may come in the middle of it
        if problem is not None:
            if parser is None:
                raise SystemExit(f"kvbridge demo: error: {problem}")
            parser.error(problem)
        with ui.progress(args.requests, "requests", description="demo") as progress:
            summary = run(args, cfg, progress)
    except (KeyboardInterrupt, Stopped) as exc:
        print("kvbridge demo: interrupted; every process it started has been stopped", file=sys.stderr)
        return 143 if isinstance(exc, Stopped) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        Console().print(table(summary))
        if summary.get("log_tail"):
            print(summary["log_tail"], file=sys.stderr)
    return 0 if summary["result"] == "PASS" else 1
