"""Helpers shared by the benchmark scripts: the machine, running a job on a pool, timing it from
its attempts, printing a table, and writing ``<name>.json`` / ``<name>.png`` into ``benchmarks/results/``."""

from __future__ import annotations

import bisect
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# the repository's root: benchmarks use the link harness in testbed/, which is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import torch

from tensorturn import runs
from tensorturn.layout import parse_label
from tensorturn.spec import RunSpec
from testbed import emulate

# every process a benchmark starts (agents, embedded pools) installs the testbed's emulations:
# TESTBED_SIM_STEP_S and TESTBED_SLOWDOWN in its environment pace its training (testbed.emulate)
emulate.reach_children()

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # every script's JSON and PNG (the docs' benchmark pages show them)


def machine() -> dict[str, Any]:
    """nproc, CPU model, RAM, load, Python and torch versions of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gb = round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "ram_gb": ram_gb,
            "loadavg_1m_at_start": os.getloadavg()[0], "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(terse=True)}


def sample_agent_peaks(peaks: dict[str, int], done, every_s: float = 0.2) -> None:
    """Until ``done`` (an Event) is set, keep in ``peaks`` each local agent's largest peak
    resident set (``VmHWM``) of any of its processes, found by their Celery titles."""
    import psutil

    while not done.wait(every_s):
        for p in psutil.process_iter(["cmdline"]):
            title = " ".join(p.info["cmdline"] or [])
            agent = next((f"local{i}" for i in range(1, 17) if f"local{i}@" in title), None)
            if agent is None:
                continue
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
            except OSError:
                continue
            hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines()
                        if line.startswith("VmHWM:")), 0)
            peaks[agent] = max(peaks.get(agent, 0), hwm)


def short(worker: str) -> str:
    return worker.split("@", 1)[0]


def pool_processes(pool) -> list[psutil.Process]:
    """A pool's processes now: its agents' process trees and its redis-server."""
    procs = []
    for pid in [p.pid for p in pool.agents] + [pool.redis.proc.pid]:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return procs


def cpu_of(procs: list[psutil.Process]) -> float:
    """The CPU seconds ``procs`` have used so far (one that ended counts nothing)."""
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_seconds(pool) -> float:
    """CPU seconds used so far by the pool: its agents' process trees and its redis-server."""
    return cpu_of(pool_processes(pool))


class CpuTrace:
    """The CPU seconds a pool's processes have used, sampled every ``every_s`` in a thread while
    in use (``with``), so the CPU of any span inside — a training window known only afterwards
    — is read back by interpolation (:meth:`between`). The processes are listed once, at the
    start (:func:`pool_processes`); a sample reads each one's ``/proc`` times, about 20 µs a
    process."""

    def __init__(self, pool, every_s: float = 0.02):
        self.every_s, self.samples = every_s, []
        self.procs = pool_processes(pool)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), cpu_of(self.procs)))
            if self.stop.wait(self.every_s):
                self.samples.append((time.time(), cpu_of(self.procs)))
                return

    def __enter__(self) -> CpuTrace:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def at(self, t: float) -> float:
        """The CPU seconds used by time ``t`` (linear between the samples around it)."""
        times = [s[0] for s in self.samples]
        i = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * min(max((t - t0) / max(t1 - t0, 1e-9), 0.0), 1.0)

    def between(self, start: float, end: float) -> float:
        return self.at(end) - self.at(start)


def run_job(pool, store_url: str, timeout_s: float = 900, **spec_fields: Any) -> dict[str, Any]:
    """Submit one run to ``pool`` and wait for it; raises unless it succeeded."""
    spec = RunSpec.create(recipe=spec_fields.pop("recipe", "digits-mlp"), store_url=store_url,
                   **spec_fields)
    runs.submit(spec, pool.broker_url)
    doc = runs.wait(pool.broker_url, spec.run_id, poll_s=0.25, timeout_s=timeout_s)
    if doc["state"] != "succeeded":
        failed = [f"{a['task']} on {a.get('worker')}: {a['outcome']} "
                  f"{(a.get('traceback') or '').strip().splitlines()[-1:]}" for a in doc.get("attempts", [])
                  if a.get("outcome") not in ("succeeded", "running")]
        raise RuntimeError(f"run {spec.run_id} ended {doc['state']}: {doc.get('error')}"
                           + "".join(f"\n  {line}" for line in failed))
    return doc


def succeeded(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's successful training attempts (shards and segments)."""
    return [a for a in doc["attempts"] if a["outcome"] == "succeeded"
            and (label := parse_label(a["task"])) is not None and label.kind in ("shard", "segment")]


def shard_span(doc: dict[str, Any]) -> float:
    """Seconds from the first shard start to the last shard finish."""
    done = [a for a in succeeded(doc) if getattr(parse_label(a["task"]), "kind", None) == "shard"]
    return max(a["finished_at"] for a in done) - min(a["started_at"] for a in done)


def training_window(doc: dict[str, Any], store_dir: Path) -> float:
    """The seconds of :func:`window_bounds`."""
    start, end = window_bounds(doc, store_dir)
    return end - start


def window_bounds(doc: dict[str, Any], store_dir: Path) -> tuple[float, float]:
    """(start, end), seconds since the epoch: from the moment every shard of round 0 trains (the
    last one's first step: its attempt's ``trained_from``, after fetching θ_0 and its data) to
    the final weights θ_R stored (their file's time in the file store ``store_dir``: the last
    outer step's average and step done, its evaluation not) — the window torchft's replicas are
    timed by (from the last replica's first step to its last sync)."""
    from tensorturn import layout

    first = [a for a in succeeded(doc) if (label := parse_label(a["task"])) is not None
             and label.kind == "shard" and label.round == 0]
    final = store_dir / layout.key("global", doc["run_id"], len(doc["rounds"]))
    return max(a["trained_from"] for a in first), final.stat().st_mtime


def total_samples(doc: dict[str, Any]) -> int:
    return sum(int(r["samples"]) for r in doc["rounds"])


def round_gaps(doc: dict[str, Any]) -> list[float]:
    """Per round boundary: next round's first shard start − previous round's last shard finish."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for a in succeeded(doc):
        label = parse_label(a["task"])
        if label is not None and label.kind == "shard" and label.round is not None:
            by_round.setdefault(label.round, []).append(a)
    rs = sorted(by_round)
    return [min(a["started_at"] for a in by_round[r + 1]) - max(a["finished_at"] for a in by_round[r])
            for r in rs[:-1] if r + 1 in by_round]


def table(headers: list[str], rows: Iterable[list[Any]]) -> str:
    """A plain-text table (also valid Markdown)."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in body)])


def figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def write_outputs(name: str, summary: dict[str, Any], fig, out_dir: Path | None = None) -> None:
    """``<name>.json`` and ``<name>.png`` in ``benchmarks/results/`` (or in ``out_dir``)."""
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary.setdefault("finished_at", time.strftime("%Y-%m-%d %H:%M:%S"))
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    fig.savefig(out_dir / f"{name}.png", format="png", metadata={"Software": None})
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.png')}")


def replot(name: str, draw, out_dir: Path | None = None) -> None:
    """Redraw ``<name>.png`` from ``<name>.json`` with ``draw(summary) -> figure``."""
    out_dir = Path(out_dir or RESULTS)
    summary = json.loads((out_dir / f"{name}.json").read_text())
    draw(summary).savefig(out_dir / f"{name}.png", format="png", metadata={"Software": None})
    print(f"redrew {out_dir / (name + '.png')}")
