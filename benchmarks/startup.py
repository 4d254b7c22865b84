"""Start-up: from the command to the first training step, CLI cost, and time per round.

On a standing pool (``LocalPool`` with warm agents, as after ``tensorturn up`` + ``agent``), each
trial runs the real command a user types — ``tensorturn run --broker URL --recipe digits-mlp
--rounds R --json`` — as its own process, and reads the run's record afterwards:

* command → first attempt: from launching the command to the first shard attempt starting on an
  agent (the task was queued, fetched and begun: the recipe is loaded and training starts);
* CLI CPU seconds: user + system CPU of the command's process (``os.wait4``), which covers
  validating, the memory check, θ_0 and following the run to its end;
* per-round wall time: from a round's first shard attempt starting to its outer step finishing.

An embedded block runs ``tensorturn run --local-workers 3 --recipe digits-mlp --rounds 1 --json``
(no broker: the command starts Redis and three agents itself) and reads command → first shard
attempt and command → first training step (the attempt's ``trained_from``: θ and the data
fetched), and how many agents ran its tasks, on this machine as it is ("idle") and with two
processes spinning on its two cores ("loaded").

A serve block times ``tensorturn serve RUN`` (a run of the embedded block) from the command to
its first 200 on ``/v2/health/ready``: the model loaded, checked and probed, the port open.

A second block measures the commands that train nothing (``runs``, ``status``, ``run`` with an
unknown recipe): wall and CPU seconds of the whole process.

What it does not model: agents on other machines (everything is on this host, so the network is
loopback), and a cold agent (the pool is warmed with one run first; an agent's first task after
it starts is reported apart as ``cold_first_attempt_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import figure, machine, table, write_outputs

from tensorturn.layout import parse_label
from tensorturn.pool.embedded import LocalPool


def timed(cmd: list[str], env: dict[str, str], check: bool = False) -> tuple[float, float, float, str]:
    """(start time, wall s, CPU s, stdout) of one command as its own process; with ``check``,
    its stderr's end when it fails."""
    t0 = time.time()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL, text=True)
        out = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if check and proc.returncode:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd[2:4])} exited {proc.returncode}: "
                               + err.read().decode(errors="replace")[-2000:])
    return t0, time.time() - t0, usage.ru_utime + usage.ru_stime, out


def round_times(doc: dict) -> list[float]:
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for a in doc["attempts"]:
        label = parse_label(a["task"])
        if label is None or label.round is None:
            continue
        if label.kind == "shard":
            starts[label.round] = min(starts.get(label.round, a["started_at"]), a["started_at"])
        elif label.kind == "outer" and a["finished_at"]:
            ends[label.round] = a["finished_at"]
    return [ends[r] - starts[r] for r in sorted(starts) if r in ends]


def first_attempt(doc: dict, field: str = "started_at") -> float:
    """When the run's first shard attempt started (``trained_from``: took its first step)."""
    return min(a[field] for a in doc["attempts"]
               if getattr(parse_label(a["task"]), "kind", None) == "shard" and a.get(field))


class Burners:
    """Two processes spinning on the machine's two cores while the block runs (``loaded``)."""

    def __init__(self, loaded: bool):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(2 if loaded else 0)]

    def __enter__(self) -> "Burners":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def embedded_trials(tt: list[str], env: dict[str, str], trials: int, agents: int, loaded: bool,
                    store: str) -> dict[str, list]:
    """Command → first shard attempt and → first step of ``tensorturn run`` on an embedded pool
    of ``agents``, and how many agents ran its tasks."""
    out: dict[str, list] = {"first_attempt_s": [], "first_step_s": [], "agents": [], "run_ids": []}
    with Burners(loaded):
        for _ in range(trials):
            t0, _, _, text = timed([*tt, "run", "--local-workers", str(agents), "--recipe", "digits-mlp",
                                    "--rounds", "1", "--store", store, "--json"], env, check=True)
            doc = json.loads(text)
            out["first_attempt_s"].append(first_attempt(doc) - t0)
            out["first_step_s"].append(first_attempt(doc, "trained_from") - t0)
            out["agents"].append(len({a["worker"] for a in doc["attempts"]}))
            out["run_ids"].append(doc["run_id"])
            print(f"  embedded ({'loaded' if loaded else 'idle'}): first attempt "
                  f"{out['first_attempt_s'][-1]:.2f}s, first step {out['first_step_s'][-1]:.2f}s after "
                  f"the command; {out['agents'][-1]} agents ran its tasks", flush=True)
    return out


def serve_trials(tt: list[str], env: dict[str, str], trials: int, store: str, run_id: str,
                 loaded: bool) -> list[float]:
    """Command → first 200 of ``/v2/health/ready`` of ``tensorturn serve RUN``."""
    import urllib.request

    from tensorturn.pool.embedded import free_port

    out = []
    with Burners(loaded):
        for _ in range(trials):
            port = free_port()
            t0 = time.time()
            proc = subprocess.Popen([*tt, "serve", run_id, "--store", store, "--port", str(port)],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    stdin=subprocess.DEVNULL)
            try:
                while True:
                    assert proc.poll() is None, "serve exited"
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready",
                                                    timeout=2) as answer:
                            if answer.status == 200:
                                break
                    except OSError:
                        time.sleep(0.02)
                out.append(time.time() - t0)
            finally:
                proc.terminate()
                proc.wait()
            print(f"  serve ({'loaded' if loaded else 'idle'}): answered {out[-1]:.2f}s after the "
                  f"command", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--embedded-agents", type=int, default=3)
    parser.add_argument("--blocks", default="standing,embedded,serve",
                        help="Which blocks to run (comma-separated): standing, embedded, serve.")
    parser.add_argument("--out", default="startup", help="Name of the outputs (benchmarks/results/NAME.json).")
    args = parser.parse_args()
    blocks = set(args.blocks.split(","))

    tt = [sys.executable, "-m", "tensorturn"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORTURN_")}
    summary: dict = {"machine": machine()}
    rows: list[list[str]] = []
    if "standing" in blocks:
        summary.update(standing(args, tt, env))
        rows += summary.pop("rows")
    with tempfile.TemporaryDirectory(prefix="tt-startup-embedded-") as tmp:
        if "embedded" in blocks or "serve" in blocks:
            runs = {state: embedded_trials(tt, env, args.trials if "embedded" in blocks else 1,
                                           args.embedded_agents, state == "loaded", tmp)
                    for state in ("idle", "loaded")}
            summary["embedded"] = runs
            for state, v in runs.items():
                for key, what in (("first_attempt_s", "first shard attempt"), ("first_step_s", "first step")):
                    rows.append([f"embedded pool of {args.embedded_agents}, {state}: command → {what}",
                                 f"{statistics.median(v[key]):.2f} s (min {min(v[key]):.2f}, max {max(v[key]):.2f})"])
                rows.append([f"embedded pool of {args.embedded_agents}, {state}: agents that ran tasks",
                             " ".join(map(str, v["agents"]))])
        if "serve" in blocks:
            run_id = summary["embedded"]["idle"]["run_ids"][-1]
            summary["serve_ready_s"] = {state: serve_trials(tt, env, args.trials, tmp, run_id, state == "loaded")
                                        for state in ("idle", "loaded")}
            rows += [[f"`serve`, {state}: command → /v2/health/ready answers",
                      f"{statistics.median(v):.2f} s (min {min(v):.2f}, max {max(v):.2f})"]
                     for state, v in summary["serve_ready_s"].items()]
    print()
    print(table(["figure", "median"], rows))
    fig = summary.pop("figure", None)
    if fig is None:  # no standing block: the embedded pool's and serve's medians
        bars = {f"embedded {state}: first step": statistics.median(v["first_step_s"])
                for state, v in summary.get("embedded", {}).items()}
        bars.update({f"serve {state}": statistics.median(v) for state, v in summary.get("serve_ready_s", {}).items()})
        fig = figure(7, 3.5)
        ax = fig.subplots()
        ax.bar(list(bars), list(bars.values()), color="C0")
        ax.set_ylabel("seconds (median)")
        ax.set_title("start-up: embedded pool (command → first step) and serve (→ ready)", fontsize=9)
    write_outputs(args.out, summary, fig)


def standing(args: argparse.Namespace, tt: list[str], env: dict[str, str]) -> dict:
    """The standing-pool block: a warm pool of ``args.agents``, ``args.trials`` runs, and the
    commands that train nothing."""
    with tempfile.TemporaryDirectory(prefix="tt-startup-") as tmp:
        store = str(Path(tmp) / "store")
        with LocalPool(args.agents, Path(store).resolve().as_uri(), workdir=Path(tmp) / "pool") as pool:
            run = [*tt, "run", "--broker", pool.broker_url, "--store", store, "--recipe",
                   "digits-mlp", "--rounds", str(args.rounds), "--shards", str(args.shards),
                   "--sync-every", str(args.sync_every), "--json"]
            _, _, _, out = timed(run, env)       # warms every agent (imports, data)
            cold = json.loads(out)
            cold_first = first_attempt(cold) - cold["created_at"]
            trials = []
            for i in range(args.trials):
                t0, wall, cpu, out = timed(run, env)
                doc = json.loads(out)
                assert doc["state"] == "succeeded", doc.get("error")
                trials.append({"command_to_first_attempt_s": first_attempt(doc) - t0,
                               "cli_wall_s": wall, "cli_cpu_s": cpu, "rounds_s": round_times(doc)})
                print(f"  trial {i + 1}: first attempt {trials[-1]['command_to_first_attempt_s']:.2f}s "
                      f"after the command; CLI {cpu:.2f} CPU-s; rounds "
                      + " ".join(f"{x:.2f}" for x in trials[-1]["rounds_s"]), flush=True)
            light = {}
            for name, extra in (("runs", ["runs", "--store", store]),
                                ("status", ["status", doc["run_id"], "--store", store]),
                                ("unknown recipe", ["run", "--recipe", "no-such-recipe"])):
                samples = [timed([*tt, *extra], env)[1:3] for _ in range(3)]
                light[name] = {"wall_s": statistics.median(s[0] for s in samples),
                               "cpu_s": statistics.median(s[1] for s in samples)}

    med = lambda key: statistics.median(t[key] for t in trials)  # noqa: E731
    per_round = [x for t in trials for x in t["rounds_s"]]
    summary = {
        "agents": args.agents, "trials": trials, "light_commands": light,
        "cold_first_attempt_s": cold_first,
        "median_command_to_first_attempt_s": med("command_to_first_attempt_s"),
        "median_cli_cpu_s": med("cli_cpu_s"), "median_round_s": statistics.median(per_round),
        "config": {"rounds": args.rounds, "shards": args.shards, "sync_every": args.sync_every},
    }
    fig = figure(7, 3.5)
    ax = fig.subplots()
    ax.bar(["→ first attempt", "CLI CPU-s", "round"],
           [summary["median_command_to_first_attempt_s"], summary["median_cli_cpu_s"],
            summary["median_round_s"]], color=["C0", "C1", "C2"])
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"start-up on a warm pool of {args.agents} agents (digits-mlp)", fontsize=9)
    summary["figure"] = fig
    summary["rows"] = [
        ["command → first shard attempt (warm pool)", f"{summary['median_command_to_first_attempt_s']:.2f} s"],
        ["`run` CLI process, CPU", f"{summary['median_cli_cpu_s']:.2f} CPU-s"],
        ["per round (first shard start → outer step end)", f"{summary['median_round_s']:.2f} s"],
        ["cold pool: submit → first attempt", f"{cold_first:.2f} s"],
        *[[f"`{name}`", f"{v['wall_s']:.2f} s wall, {v['cpu_s']:.2f} CPU-s"] for name, v in light.items()],
    ]
    return summary


if __name__ == "__main__":
    main()
