"""Kill one process of a live cluster during a burst of streamed requests, each kind in turn.

``python -m bench.bench_faults`` starts ``python -m bana_sglang.launch`` (2P2D,
the global store, the bana router, the launcher's supervision on: as a user runs
it) and first takes every prompt's tokens from the healthy cluster (greedy; the
cluster's tokens equal a plain worker's, the suite's core test). Then, for each
fault in ``--faults``:

- half of ``--requests`` streamed greedy ``/generate`` requests start, spaced a
  little;
- once they all stream (a decode fault) or the first has tokens (the others),
  the fault: SIGKILL of a whole process (a worker is its HTTP server and every
  child), or ``stop-<part>`` (SIGSTOP of it for ``--stop-seconds``, then
  SIGCONT: a hung process, which keeps its connections open and answers
  nothing); the other half is sent after it;
- every stream is read to its end.

Per fault: requests, failed (not 200, an error event, or no ``[DONE]``), wrong
(tokens other than the healthy cluster's), the slowest completion, and the time
from the fault until the cluster is whole again (the router's ``/health`` is
``ok`` with every worker healthy, and the launcher restarted what it killed).

Outputs: ``bench/runs/faults-<UTC time>/summary.json`` and ``report.md``;
``--write-results`` replaces the "Faults" section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

from bana_sglang.launch import READY_MARK
from bench.results import ROOT, machine_description, parse_cluster_bench_args, write_results_section

logger = logging.getLogger("bench.faults")

KEY = "bench-faults-key"
H = {"Authorization": f"Bearer {KEY}"}
FAULTS = (
    "decode",
    "prefill",
    "stop-prefill",
    "kv-index",
    "kv-storage",
    "mooncake-master",
    "stop-decode",
    "stop-kv-index",
    "stop-kv-storage",
    "stop-mooncake-master",
)
# how each non-worker part is found among the launcher's children
MARKERS = {
    "kv-index": "bana_sglang.radix_global.service",
    "kv-storage": "bana_sglang.radix_global.storage_server",
    "mooncake-master": "mooncake_master",
}


class Stream:
    """One streamed greedy /generate request read on a thread."""

    def __init__(self, url: str, ids: list[int], n: int):
        self.ids, self.n = ids, n
        self.tokens: list[int] = []
        self.error: str | None = None
        self.done = False
        self.first = threading.Event()
        self.t0 = time.monotonic()
        self.elapsed = float("nan")
        self._t = threading.Thread(target=self._read, args=(url,), daemon=True)
        self._t.start()

    def _read(self, url: str) -> None:
        body = {
            "input_ids": self.ids,
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": self.n, "ignore_eos": True},
        }
        try:
            with httpx.stream("POST", url + "/generate", json=body, headers=H, timeout=600) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        self.done = True
                        continue
                    ev = json.loads(data)
                    if "error" in ev:
                        self.error = str(ev["error"])[:300]
                        continue
                    self.tokens = list(ev.get("output_ids") or self.tokens)
                    self.first.set()
        except Exception as e:  # a broken stream is a failed request, named
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.elapsed = time.monotonic() - self.t0
            self.first.set()

    def join(self, timeout: float) -> None:
        self._t.join(timeout)
        if self._t.is_alive():
            self.error = self.error or f"no end within {timeout:.0f} s"

    @property
    def failed(self) -> bool:
        return self.error is not None or not self.done


def plain_tokens(url: str, ids: list[int], n: int) -> list[int]:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
    }
    r = httpx.post(url + "/generate", json=body, headers=H, timeout=600)
    r.raise_for_status()
    return r.json()["output_ids"]


def router_counts(url: str) -> dict[str, float]:
    """The router's counters this benchmark reports: resumed streams, retried requests."""
    text = httpx.get(url + "/metrics", headers=H, timeout=10).text
    out = {"resumed": 0.0, "retried": 0.0}
    for line in text.splitlines():
        if line.startswith('bana_router_stream_resumes_total{result="resumed"}'):
            out["resumed"] += float(line.split()[-1])
        elif line.startswith("bana_router_retries_total{"):
            out["retried"] += float(line.split()[-1])
    return out


def health(url: str) -> dict:
    try:
        return httpx.get(url + "/health", headers=H, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


def workers(url: str) -> list[dict]:
    return httpx.get(url + "/bana/router/workers", headers=H, timeout=10).json()["workers"]


def worker_tree(url: str) -> list[psutil.Process]:
    """The SGLang worker serving ``url``: its HTTP server's process and every child."""
    port = url.rstrip("/").rsplit(":", 1)[1]
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if (
            "sglang.launch_server" in cmd
            and "--port" in cmd
            and cmd[cmd.index("--port") + 1] == port
        ):
            return [proc, *proc.children(recursive=True)]
    raise RuntimeError(f"no SGLang worker serves {url}")


def part_process(launcher: psutil.Process, marker: str) -> psutil.Process:
    for p in launcher.children():
        if any(marker in a for a in p.cmdline()):
            return p
    raise RuntimeError(f"no child of the launcher runs {marker}")


class Launcher:
    """``python -m bana_sglang.launch`` as a subprocess, its output kept."""

    def __init__(self, argv: list[str], log: Path):
        self.lines: list[str] = []
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bana_sglang.launch", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            self._log.write(line)
            self._log.flush()

    def restarted(self, name: str, since: int) -> bool:
        return any(f"restarted {name} " in x for x in self.lines[since:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def run_fault(
    launcher: Launcher,
    url: str,
    fault: str,
    prompts: list[list[int]],
    want: list[list[int]],
    n: int,
    stop_s: float,
    whole_timeout: float,
) -> dict:
    mark = len(launcher.lines)
    counts0 = router_counts(url)
    part = fault.removeprefix("stop-")
    stop = fault != part
    role = "decode" if part == "decode" else "prefill"
    half = max(1, len(prompts) // 2)
    streams = []
    for ids in prompts[:half]:
        streams.append(Stream(url, ids, n))
        time.sleep(0.15)
    # the fault lands while the first half streams (a decode fault) or as soon as one
    # has tokens (the others are still in their prefill); the second half comes after it
    for s in streams if role == "decode" else streams[:1]:
        s.first.wait(120)
    ws = workers(url)
    t_fault = time.monotonic()
    restarted_name = None

    def second_half() -> None:
        for ids in prompts[half:]:
            streams.append(Stream(url, ids, n))
            time.sleep(0.15)

    later = threading.Thread(target=second_half)
    if part in ("decode", "prefill"):
        # the worker of that role with the most requests in flight
        w = max((x for x in ws if x["role"] == role), key=lambda x: x.get("inflight", 0))
        tree = worker_tree(w["url"])
        victim = w["url"]
    else:
        tree = [part_process(psutil.Process(launcher.proc.pid), MARKERS[part])]
        victim = part
    if stop:
        for p in tree:
            p.suspend()
        later.start()
        time.sleep(stop_s)
        for p in tree:
            p.resume()
    else:
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        # a worker: any worker's restart line (the launcher names it); a part: its own
        restarted_name = "restart" if part in ("decode", "prefill") else part
        later.start()
    later.join()
    for s in streams:
        s.join(600)
    slowest = max(s.elapsed for s in streams)
    failed = [s for s in streams if s.failed]
    want_of = {tuple(ids): w for ids, w in zip(prompts, want, strict=True)}
    wrong = [s for s in streams if not s.failed and s.tokens != want_of[tuple(s.ids)]]
    # whole again: /health ok with every worker healthy, the killed part restarted
    n_p = sum(1 for x in ws if x["role"] == "prefill")
    n_d = sum(1 for x in ws if x["role"] == "decode")
    deadline = t_fault + whole_timeout
    whole_s = None
    while time.monotonic() < deadline:
        h = health(url)
        back = restarted_name is None or (
            any("restarted " in x for x in launcher.lines[mark:])
            if restarted_name == "restart"
            else launcher.restarted(restarted_name, mark)
        )
        if (
            back
            and h.get("status") == "ok"
            and h.get("healthy_prefill") == n_p
            and h.get("healthy_decode") == n_d
        ):
            whole_s = time.monotonic() - t_fault
            break
        time.sleep(0.5)
    # and it serves the healthy cluster's tokens again
    after_ok = plain_tokens(url, prompts[0], n) == want[0]
    counts = router_counts(url)
    return {
        "fault": fault,
        "victim": victim,
        "requests": len(streams),
        "failed": len(failed),
        "wrong": len(wrong),
        "errors": [s.error for s in failed][:3],
        "wrong_detail": [_diff(s.tokens, want_of[tuple(s.ids)]) for s in wrong][:3],
        "resumed": int(counts["resumed"] - counts0["resumed"]),
        "retried": int(counts["retried"] - counts0["retried"]),
        "slowest_s": round(slowest, 2),
        "whole_again_s": None if whole_s is None else round(whole_s, 1),
        "served_right_after": after_ok,
    }


def _diff(got: list[int], want: list[int]) -> dict:
    """Where a wrong answer leaves the right one."""
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {"first_diff": k, "got_len": len(got), "want_len": len(want), "got": got[k : k + 8]}


def report(rows: list[dict], args, when: str, machine: str) -> str:
    cmd = "python -m bench.bench_faults " + " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in (
            ("requests", args.requests),
            ("tokens", args.tokens),
            ("faults", args.faults),
            ("stop-seconds", args.stop_seconds),
            ("stall-timeout", args.stall_timeout),
        )
    )
    lines = [
        f"Run: `{cmd}` on {when}; {machine}.",
        "",
        "2P2D, the global store, the bana router, the launcher's supervision on. Each row: a "
        f"burst of {args.requests} streamed greedy `/generate` requests ({args.tokens} tokens "
        "each); the fault once the first half of them are all streaming (a decode worker) or "
        "once the first has tokens (the others), the second half sent after it; *wrong* "
        "compares with the healthy cluster's tokens; *resumed* and *retried*: the router's "
        "streams resumed on another decode worker and requests retried before their first "
        "byte; *whole again*: from the fault until `/health` is `ok` with every worker "
        "healthy and the launcher restarted what was killed. A `stop-` fault is SIGSTOP "
        f"for {args.stop_seconds:g} s, then SIGCONT; the router ran with "
        f"`--stall-timeout {args.stall_timeout:g}`.",
        "",
        "| fault | requests | failed | wrong | resumed | retried | slowest completion (s) "
        "| whole again (s) | right tokens after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        whole = "not within the timeout" if r["whole_again_s"] is None else f"{r['whole_again_s']}"
        lines.append(
            f"| {r['fault']} ({r['victim']}) | {r['requests']} | {r['failed']} | {r['wrong']} | "
            f"{r['resumed']} | {r['retried']} | "
            f"{r['slowest_s']} | {whole} | {'yes' if r['served_right_after'] else 'NO'} |"
        )
    errs = [(r["fault"], e) for r in rows for e in r["errors"]]
    if errs:
        lines += ["", "Errors the clients saw:", ""]
        lines += [f"- {f}: `{e}`" for f, e in errs]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="tiny", help="embedded model name or folder")
    p.add_argument("--requests", type=int, default=8, help="streams per burst")
    p.add_argument("--tokens", type=int, default=160, help="tokens per stream")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"of {', '.join(FAULTS)}")
    p.add_argument("--stop-seconds", type=float, default=10.0, help="stop-*: how long")
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=5.0,
        help="the router's --stall-timeout (shorter than --stop-seconds, so that a stopped "
        "decode worker's streams are resumed elsewhere, not only delayed)",
    )
    p.add_argument("--whole-timeout", type=float, default=240.0)
    args = parse_cluster_bench_args(p, argv, default_port=31300)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        p.error(f"unknown faults {bad}: choose from {', '.join(FAULTS)}")
    out = args.out or ROOT / "bench" / "runs" / time.strftime("faults-%Y%m%d-%H%M%S", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = machine_description()
    url = f"http://127.0.0.1:{args.port}"
    launcher = Launcher(
        [
            "--model-path",
            args.model,
            "--num-prefill",
            "2",
            "--num-decode",
            "2",
            "--port",
            str(args.port),
            "--api-key",
            KEY,
            "--log-dir",
            str(out / "logs"),
            "--router-args",
            f"--stall-timeout {args.stall_timeout}",
        ],
        out / "launcher.log",
    )
    rows: list[dict] = []
    try:
        deadline = time.monotonic() + 900
        while not any(READY_MARK in x for x in launcher.lines):
            if launcher.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the cluster did not start:\n" + "\n".join(launcher.lines[-30:]))
            time.sleep(1)
        rng = random.Random(7)
        for fault in faults:
            prompts = [
                [rng.randrange(10, 1000) for _ in range(args.prompt_tokens + 8 * i)]
                for i in range(args.requests)
            ]
            want = [plain_tokens(url, ids, args.tokens) for ids in prompts]
            logger.info("fault %s: %d streams", fault, len(prompts))
            row = run_fault(
                launcher,
                url,
                fault,
                prompts,
                want,
                args.tokens,
                args.stop_seconds,
                args.whole_timeout,
            )
            logger.info("%s", row)
            rows.append(row)
    finally:
        launcher.stop()
    text = report(rows, args, when, machine)
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    (out / "report.md").write_text(text)
    print(text, flush=True)
    if args.write_results:
        write_results_section(
            "faults", "Faults: one process killed or stopped during a burst", text
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
