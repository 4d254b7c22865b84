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
(no broker: the command starts Redis and three agents itself, and the run begins once the first
agent answers) and reads command → first shard attempt, on this machine as it is ("idle") and
with two processes spinning on its two cores ("loaded"). The attempt's start is when the agent
begins the task (the recipe built, θ fetched next and the first step a few ms later).

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


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, str]:
    """(start time, wall s, CPU s, stdout) of one command as its own process."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
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


def first_attempt(doc: dict) -> float:
    return min(a["started_at"] for a in doc["attempts"]
               if getattr(parse_label(a["task"]), "kind", None) == "shard")


def embedded_trials(tt: list[str], env: dict[str, str], trials: int, agents: int, loaded: bool) -> list[float]:
    """Command → first shard attempt of ``tensorturn run`` on an embedded pool of ``agents``."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if loaded else 0)]
    try:
        out = []
        with tempfile.TemporaryDirectory(prefix="tt-startup-embedded-") as tmp:
            for _ in range(trials):
                t0, _, _, text = timed([*tt, "run", "--local-workers", str(agents), "--recipe", "digits-mlp",
                                        "--rounds", "1", "--store", tmp, "--json"], env)
                out.append(first_attempt(json.loads(text)) - t0)
                print(f"  embedded ({'loaded' if loaded else 'idle'}): first attempt {out[-1]:.2f}s "
                      f"after the command", flush=True)
        return out
    finally:
        for p in burners:
            p.kill()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--embedded-agents", type=int, default=3)
    args = parser.parse_args()

    tt = [sys.executable, "-m", "tensorturn"]
    with tempfile.TemporaryDirectory(prefix="tt-startup-") as tmp:
        store = str(Path(tmp) / "store")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORTURN_")}
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

    embedded = {state: embedded_trials(tt, env, args.trials, args.embedded_agents, state == "loaded")
                for state in ("idle", "loaded")}
    med = lambda key: statistics.median(t[key] for t in trials)  # noqa: E731
    per_round = [x for t in trials for x in t["rounds_s"]]
    summary = {
        "machine": machine(), "agents": args.agents, "trials": trials, "light_commands": light,
        "cold_first_attempt_s": cold_first,
        "median_command_to_first_attempt_s": med("command_to_first_attempt_s"),
        "median_cli_cpu_s": med("cli_cpu_s"), "median_round_s": statistics.median(per_round),
        "config": {"rounds": args.rounds, "shards": args.shards, "sync_every": args.sync_every},
        "embedded_command_to_first_attempt_s": embedded,
    }
    print()
    print(table(["figure", "median"], [
        ["command → first shard attempt (warm pool)", f"{summary['median_command_to_first_attempt_s']:.2f} s"],
        ["`run` CLI process, CPU", f"{summary['median_cli_cpu_s']:.2f} CPU-s"],
        ["per round (first shard start → outer step end)", f"{summary['median_round_s']:.2f} s"],
        ["cold pool: submit → first attempt", f"{cold_first:.2f} s"],
        *[[f"embedded pool of {args.embedded_agents}, {state}: command → first shard attempt",
           f"{statistics.median(v):.2f} s (min {min(v):.2f}, max {max(v):.2f})"] for state, v in embedded.items()],
        *[[f"`{name}`", f"{v['wall_s']:.2f} s wall, {v['cpu_s']:.2f} CPU-s"] for name, v in light.items()],
    ]))
    fig = figure(7, 3.5)
    ax = fig.subplots()
    ax.bar(["→ first attempt", "CLI CPU-s", "round"],
           [summary["median_command_to_first_attempt_s"], summary["median_cli_cpu_s"],
            summary["median_round_s"]], color=["C0", "C1", "C2"])
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"start-up on a warm pool of {args.agents} agents (digits-mlp)", fontsize=9)
    write_outputs("startup", summary, fig)


if __name__ == "__main__":
    main()
