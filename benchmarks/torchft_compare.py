"""TensorTurn against torchft on the same DiLoCo job: the training window, and broker commands.

The job (issue 28): ``digits-mlp``, 3 shards on 3 workers, R rounds of H = 67 steps, one torch
thread each, on this machine. Each repetition runs, one after the other:

* **torchft 0.2.0** (``pip install -e '.[bench]'``): a lighthouse (min 3 replicas) and 3 replica
  groups of one process each (``_torchft_worker.py``: torchft's ``Manager`` over gloo and
  ``torchft.local_sgd.DiLoCo``), each training shard k of the recipe's training split. Its
  window: from the last replica's first step to the last replica's last sync (allreduce and
  outer step included); torchft's replicas read their data and build their model before it.
* **TensorTurn**: a pool of 3 agents (real Celery workers, private redis-server, file store),
  ``--sync rounds``. Its window, timed as torchft's: from the last round-0 shard's first step
  (its attempt's ``trained_from``: θ_0 fetched and its data read) to the final weights θ_R
  stored (the last outer step's average and step; its evaluation, the test and the model's save
  are not inside). Printed beside: the span of its shard tasks, from the first one's start to
  the last one's end (the setup of round 0 inside, the last outer step not).
  The same run counts Redis's commands (``INFO commandstats``); a second run of the same job,
  with Redis ``MONITOR`` watched from this process, counts the commands clients sent (a script
  is one) apart from those scripts ran. The window is the first run's: on these two cores the
  watching (Redis writing every command out, this process parsing it) takes CPU the trainers
  need — its window is printed beside, as ``window_monitored_s``.

Beside each window, the CPU seconds each side used in it (``cpu_s``): torchft's replicas' in
their training loops (each replica's ``time.process_time``, its manager's threads inside), and
TensorTurn's pool's — its agents' process trees and its redis-server — sampled every 20 ms
while the job runs (:class:`_common.CpuTrace`) and read at the window's ends. Divided by
cores × window: the share of the machine's cores each kept busy, which tells CPU spent apart
from cores left idle (at a round's barrier, where the machines wait for θ_{r+1}).

What it does not model: links (everything is loopback; on a 40 ms link each round trip costs
40 ms — TensorTurn's per-task protocol is 5 round trips, torchft's per sync a quorum and an
allreduce), GPUs, failures (torchft drops a failed replica's work; TensorTurn redoes it).

    python benchmarks/torchft_compare.py [--reps 3] [--rounds 8] [--sync-every 67] [--syncs rounds,overlap]
        [--eval-every 0,1] [--sim-step-s 0.003]

``--eval-every`` (TensorTurn's; 0, the default, stands for the rounds: only the last round is
evaluated, by the last outer step, outside the window — torchft evaluates nothing; 1 evaluates
every round, each evaluation a task of its own taking a machine inside the window).

``--sim-step-s S``: every training step of both sides lasts S seconds, sleeping out what its
compute left (``TESTBED_SIM_STEP_S`` for TensorTurn's agents; the same pacing,
:class:`~testbed.emulate.SimulatedStep`, in torchft's replicas, each round's pacing from
its first step and a step paced before its sync). The trainers then barely share the two cores,
as on machines of their own: what is left of the difference is each side's round boundary, not
its CPU.

Writes ``benchmarks/results/torchft_compare.json`` and ``.png`` (with ``--sim-step-s``:
``torchft_compare_sim.json`` and ``.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at info

from _common import (  # noqa: E402
    CpuTrace,
    figure,
    machine,
    run_job,
    shard_span,
    table,
    window_bounds,
    write_outputs,
)
from broker_commands import Monitor, calls  # noqa: E402

from tensorturn.layout import parse_label  # noqa: E402
from tensorturn.pool.embedded import LocalPool, free_port  # noqa: E402
from tensorturn.state.broker import redis_client  # noqa: E402

RECIPE = "digits-mlp"


def torchft_window(rounds: int, sync_every: int, replicas: int, seed: int, tmp: Path, sim_step_s: float = 0.0) -> dict:
    from torchft._torchft import LighthouseServer

    tmp.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=replicas, join_timeout_ms=10_000)
    try:
        procs, outs = [], []
        for k in range(replicas):
            out = tmp / f"torchft-{k}.json"
            outs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "_torchft_worker.py"), "--replica", str(k), "--replicas",
                 str(replicas), "--lighthouse", lighthouse.address(), "--store-port", str(free_port()),
                 "--rounds", str(rounds), "--sync-every", str(sync_every), "--seed", str(seed),
                 "--recipe", RECIPE, "--out", str(out), "--sim-step-s", str(sim_step_s)],
                env={**os.environ, "OMP_NUM_THREADS": "1"}))
        for p in procs:
            if p.wait(timeout=900) != 0:
                raise RuntimeError(f"a torchft replica exited {p.returncode}")
    finally:
        lighthouse.shutdown()
    ends = [json.loads(o.read_text()) for o in outs]
    return {"window_s": max(e["ended"] for e in ends) - max(e["started"] for e in ends),
            "syncs": [e["syncs"] for e in ends], "loss": [e["loss"] for e in ends],
            "cpu_s": sum(e["cpu_s"] for e in ends)}


def tensorturn_window(rounds: int, sync_every: int, agents: int, seed: int, tmp: Path, sync: str,
                      eval_every: int = 1, monitor: bool = True) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    store = (tmp / "store").as_uri()
    with LocalPool(agents, store, workdir=tmp / "pool") as pool:
        client = redis_client(pool.broker_url)
        watch = Monitor(pool.broker_url) if monitor else None
        if watch is not None:
            watch.start()
        before = calls(client)
        with CpuTrace(pool) as cpu:
            doc = run_job(pool, store, mode="fused", recipe=RECIPE, rounds=rounds, shards=agents,
                          sync_every=sync_every, seed=seed, threads_per_task=1, sync=sync, eval_every=eval_every)
        after = calls(client)
        if watch is not None:
            watch.stop.set()
    used = after - before
    shards = sum(1 for a in doc["attempts"] if a["outcome"] == "succeeded"
                 and getattr(parse_label(a["task"]), "kind", None) == "shard")
    start, end = window_bounds(doc, tmp / "store")
    out = {"window_s": end - start, "task_window_s": shard_span(doc), "cpu_s": cpu.between(start, end),
           "shard_tasks": shards, "commands": sum(used.values()),
           "per_shard_task": sum(used.values()) / shards, "val_loss": doc["rounds"][-1]["val_loss"]}
    if watch is not None:
        sent = sum(watch.wire.values())
        out.update(commands_sent=sent, sent_per_shard_task=sent / shards)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=67)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--syncs", default="rounds,overlap", help="TensorTurn's --sync values to run")
    ap.add_argument("--sim-step-s", type=float, default=0.0,
                    help="every training step of both sides lasts this long, sleeping out what its "
                         "compute left (TESTBED_SIM_STEP_S): each trainer as on a machine of its own")
    ap.add_argument("--eval-every", default="0",
                    help="TensorTurn's --eval-every values to run, comma-separated; 0: the rounds, so only "
                         "the last round is evaluated, outside the window (torchft evaluates nothing)")
    args = ap.parse_args()
    if args.sim_step_s > 0:  # TensorTurn's agents inherit it
        os.environ["TESTBED_SIM_STEP_S"] = str(args.sim_step_s)
    syncs = [(sync, int(every) or args.rounds)
             for sync in args.syncs.split(",") for every in args.eval_every.split(",")]
    pairs = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="tt-vs-torchft-") as tmp:
            ft = torchft_window(args.rounds, args.sync_every, args.agents, args.seed, Path(tmp) / "torchft",
                                args.sim_step_s)
            pair = {"torchft": ft}
            for sync, every in syncs:
                name = f"{sync} --eval-every {every}"
                tt = tensorturn_window(args.rounds, args.sync_every, args.agents, args.seed,
                                       Path(tmp) / f"{sync}-{every}", sync, every, monitor=False)
                counted = tensorturn_window(args.rounds, args.sync_every, args.agents, args.seed,
                                            Path(tmp) / f"{sync}-{every}-monitored", sync, every)
                tt.update(window_monitored_s=counted["window_s"], commands_sent=counted["commands_sent"],
                          sent_per_shard_task=counted["sent_per_shard_task"])
                pair[name] = {**tt, "ratio": tt["window_s"] / ft["window_s"],
                              "task_ratio": tt["task_window_s"] / ft["window_s"]}
                print(f"rep {rep}: torchft {ft['window_s']:.2f} s, TensorTurn --sync {name} {tt['window_s']:.2f} s "
                      f"(×{pair[name]['ratio']:.2f}; its tasks' span {tt['task_window_s']:.2f} s, "
                      f"×{pair[name]['task_ratio']:.2f}); {tt['sent_per_shard_task']:.1f} commands sent per shard "
                      f"task, {tt['per_shard_task']:.1f} run by Redis; CPU: torchft {ft['cpu_s']:.2f} s in its "
                      f"loops, TensorTurn's pool {tt['cpu_s']:.2f} s in its window", flush=True)
        pairs.append(pair)

    def row(what: str, values: list[float], digits: int = 2) -> list[str]:
        return [what, *(f"{v:.{digits}f}" for v in (statistics.median(values), min(values), max(values)))]

    cores = os.cpu_count() or 1
    rows = [row("torchft window, s", [p["torchft"]["window_s"] for p in pairs]),
            row("  CPU of its replicas in their training loops, s", [p["torchft"]["cpu_s"] for p in pairs]),
            row(f"  / ({cores} cores × window): the cores' share busy",
                [p["torchft"]["cpu_s"] / cores / p["torchft"]["window_s"] for p in pairs])]
    names = [f"{sync} --eval-every {every}" for sync, every in syncs]
    for name in names:
        rows += [row(f"TensorTurn --sync {name} window, s", [p[name]["window_s"] for p in pairs]),
                 row("  / torchft's (per pair)", [p[name]["ratio"] for p in pairs]),
                 row("  first shard task's start to last one's end, s", [p[name]["task_window_s"] for p in pairs]),
                 row("    / torchft's window (per pair)", [p[name]["task_ratio"] for p in pairs]),
                 row("  window of the run watched by MONITOR, s", [p[name]["window_monitored_s"] for p in pairs]),
                 row("  commands sent per shard task", [p[name]["sent_per_shard_task"] for p in pairs], 1),
                 row("  commands Redis ran per shard task", [p[name]["per_shard_task"] for p in pairs], 1),
                 row("  CPU of the pool in the window, s", [p[name]["cpu_s"] for p in pairs]),
                 row(f"  / ({cores} cores × window): the cores' share busy",
                     [p[name]["cpu_s"] / cores / p[name]["window_s"] for p in pairs])]
    print(table(["", "median", "min", "max"], rows))
    fig = figure(6, 4)
    ax = fig.add_subplot()
    ax.bar(["torchft 0.2.0", *(f"TT {name}" for name in names)],
           [statistics.median(p[name]["window_s"] for p in pairs) for name in ["torchft", *names]])
    ax.set_ylabel("training window, s (median)")
    ax.set_title(f"{RECIPE}: {args.agents} workers × {args.rounds} rounds × H = {args.sync_every}"
                 + (f", steps of {args.sim_step_s * 1000:g} ms" if args.sim_step_s > 0 else ""))
    out_name = "torchft_compare" + ("_sim" if args.sim_step_s > 0 else "")
    write_outputs(out_name, {"machine": machine(), "args": vars(args), "pairs": pairs}, fig)


if __name__ == "__main__":
    main()
