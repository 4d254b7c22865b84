"""Home links: TensorTurn fused (fp32, int8; rounds and async; outer steps beside the store or on
the trainers) against a per-step all-reduce (PyTorch DDP over gloo) on the same emulated links,
the same data and the same samples.

Needs root (network namespaces; see ``testbed/netlab.py``). Three agents, each in its own
namespace behind a veth link shaped by ``tc tbf`` (default 20 Mbit/s up, 100 down) with ~40 ms
RTT from a delay proxy in front of Redis and the S3 endpoint (moto's server), and one agent with
``--role outer`` on the coordinator itself, beside the store. Compute is emulated: every training
step takes ``--sim-step`` seconds (``TESTBED_SIM_STEP_S`` for the agents; for the DDP ranks a
sleep of what their own compute leaves), so the 2 cores here do not decide the figures and
*compute utilisation* = emulated compute ÷ (3 × wall) is exact, as long as the emulated step is
longer than a real one with 3 agents on 2 cores (checked first). Wall: from the first task's
start to the last one's end (fused), from the first step to the last (DDP; evaluations off the
clock). The DDP ranks run in the same namespaces, routed through the coordinator's (a relay: a
peer's bytes cross two links).
Bytes on the wire are read from the links' interface counters (Redis and HTTP included), set
beside TensorTurn's own accounting: ``store_bytes_up`` + ``store_bytes_down`` (every object body
its tasks moved through the store) and, apart, ``bytes_up`` + ``bytes_down`` (shard tasks'
pseudo-gradients and weights only).

    python benchmarks/wan.py [--rates 20/100,1000/1000] [--rtt-ms 40] [--rounds 2] [--sync-every 100]
                             [--long-sync-every 500] [--sim-step 0.3] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import figure, machine, run_job, table, write_outputs

from tensorturn.layout import parse_label
from tensorturn.pool.embedded import free_port, stop_process_group
from testbed import netlab
from testbed.s3 import start_moto

HERE = Path(__file__).resolve().parent
AGENTS = 3
TRAINERS = {f"local{i + 1}" for i in range(AGENTS)}  # the LinkPool's agents behind links


def wire(pool) -> tuple[int, int]:
    ups, downs = zip(*(link.counters() for link in pool.links))
    return sum(ups), sum(downs)


def settled(pool, run_id: str) -> dict[str, Any]:
    """The run's description once its last attempt has recorded what it moved (a run is
    marked finished inside its last task, a moment before that task's figures are in)."""
    from tensorturn.state.board import RunBoard
    from tensorturn.state.broker import redis_client

    board = RunBoard(redis_client(pool.broker_url))
    last = None
    while True:
        doc = board.describe(run_id)
        now = (doc["store_bytes_up"], doc["store_bytes_down"])
        if all(a["outcome"] != "running" for a in doc["attempts"]) and now == last:
            return doc
        last = now
        time.sleep(0.5)


def steady_utilisation(doc: dict[str, Any], sync: str, compute_s: float) -> float | None:
    """Compute ÷ wall between the starts of consecutive rounds, over the rounds that waited for
    an outer step's weights (round 1 on in blocking runs; round 2 on with ``--sync overlap``,
    whose round 1 trains from θ_0 too): for each shard, the time from its start in round r to
    its start in round r+1, averaged; None with too few rounds."""
    from tensorturn.modes.fused.policies import policy

    if sync == "async":
        return None
    starts: dict[tuple[int, int], float] = {}
    for a in doc["attempts"]:
        label = parse_label(a["task"])
        if a["outcome"] == "succeeded" and label is not None and label.kind == "shard":
            starts[(label.round, label.shard)] = a["started_at"]
    plan = policy(sync).shard_plan
    periods = [starts[(r + 1, k)] - starts[(r, k)] for (r, k) in starts
               if (r + 1, k) in starts and plan(r + 1, k).base >= 1]
    return compute_s / (sum(periods) / len(periods)) if periods else None


def fused(pool, store: str, args, codec: str, sync: str, outer: str, h: int | None = None) -> dict[str, Any]:
    from tensorturn.runs.records import remove_run

    h = h or args.sync_every
    rounds = args.overlap_rounds if sync == "overlap" else args.rounds
    before, before_store, before_redis = wire(pool), pool.carried("store"), pool.carried("redis")
    doc = run_job(pool, store, timeout_s=7200, recipe=args.recipe, recipe_options=args.options, mode="fused",
                  rounds=rounds, shards=AGENTS, sync_every=h, codec=codec, sync=sync, batch_size=args.batch,
                  threads_per_task=1, eval_batches=args.eval_batches, seed=args.seed)
    doc = settled(pool, doc["run_id"])
    remove_run(doc["run_id"], pool.broker_url, store)  # moto holds objects in memory
    after, after_store, after_redis = wire(pool), pool.carried("store"), pool.carried("redis")
    store_carried = sum(after_store) - sum(before_store)
    broker = sum(after_redis) - sum(before_redis)
    ats = [a for a in doc["attempts"] if a["finished_at"]]
    start = min(a["started_at"] for a in ats)
    span = max(a["finished_at"] for a in ats) - start
    steps = rounds * AGENTS * h
    up, down = after[0] - before[0], after[1] - before[1]
    return {"system": f"TensorTurn fused {codec}, {sync}, outer steps {outer}", "H": h, "wall_s": span,
            "rounds": rounds, "utilisation": steps * args.sim_step / (AGENTS * span),
            "steady_utilisation": steady_utilisation(doc, sync, h * args.sim_step),
            "val_loss": doc["rounds"][-1]["val_loss"], "wire_up": up, "wire_down": down,
            "to_own_loss_s": doc["rounds"][-1]["at"] - start,
            "model_bytes": doc["bytes_up"] + doc["bytes_down"],
            # what the three trainers' tasks moved through the store: their links carry it (the
            # outer agent's traffic stays on the coordinator)
            "accounted": (accounted := sum(v["up"] + v["down"] for w, v in doc["store_bytes_by_worker"].items()
                                           if w.split("@")[0] in TRAINERS)),
            "wire_vs_accounted": (up + down) / max(accounted, 1),
            # what the links' proxies carried: S3 (bodies and HTTP headers) and Redis
            "store_carried": store_carried, "broker_carried": broker,
            "store_vs_accounted": store_carried / max(accounted, 1),
            "wire_vs_carried": (up + down) / max(store_carried + broker, 1)}


def ddp(pool, args) -> dict[str, Any]:
    """The all-reduce baseline: one DDP rank per namespace, the same samples as a fused run."""
    for link in pool.links:
        link.route()
    steps = args.rounds * args.sync_every  # per rank: rounds × shards × H ÷ ranks, shards = ranks
    master = f"{pool.links[0].agent_ip}:{free_port()}"
    before = wire(pool)
    with tempfile.TemporaryDirectory(prefix="tt-ddp-") as tmp:
        procs = []
        for rank, link in enumerate(pool.links):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": link.agent_if}
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", link.ns, sys.executable, str(HERE / "_ddp_worker.py"),
                 "--rank", str(rank), "--world", str(AGENTS), "--master", master,
                 "--steps", str(steps), "--sim-step", str(args.sim_step), "--seed", str(args.seed),
                 "--recipe", args.recipe, "--out", f"{tmp}/rank{rank}.json", "--batch", str(args.batch),
                 "--eval-every", str(max(1, args.sync_every // 10))], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"a DDP rank failed: {err.strip().splitlines()[-1:]}")
        outs = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(AGENTS)]
    after = wire(pool)
    wall = max(o["wall_s"] for o in outs)
    return {"system": "DDP (gloo), per-step all-reduce", "H": 1, "wall_s": wall,
            "utilisation": steps * args.sim_step / wall, "val_loss": outs[0]["val"]["loss"],
            "curve": outs[0]["curve"],
            "wire_up": after[0] - before[0], "wire_down": after[1] - before[1],
            "model_bytes": None, "accounted": None, "wire_vs_accounted": None,
            "store_carried": None, "broker_carried": None, "store_vs_accounted": None, "wire_vs_carried": None}


def measure(rate: str, store: str, store_env: dict[str, str], args) -> list[dict[str, Any]]:
    up, down = (float(v) for v in rate.split("/"))
    print(f"\n== links {up:g}/{down:g} Mbit/s, RTT {args.rtt_ms:g} ms ==", flush=True)
    os.environ["TESTBED_SIM_STEP_S"] = str(args.sim_step)
    try:
        with tempfile.TemporaryDirectory(prefix="tt-wan-") as tmp, \
                netlab.LinkPool(AGENTS, store, store_env, rtt_ms=args.rtt_ms, up_mbit=up,
                                down_mbit=down, workdir=Path(tmp), outer_agent=True,
                                allow=(args.recipe,)) as pool:
            rows = []

            def add(row: dict[str, Any]) -> None:
                rows.append(row)
                print({k: v for k, v in row.items() if k != "curve"}, flush=True)

            beside = "beside the store"
            for variant in args.variants.split(","):
                codec, sync = variant.split("/")
                add(fused(pool, store, args, codec, sync, "on the trainers" if sync == "async" else beside))
            if args.long_sync_every and rate == args.rates.split(",")[0]:
                add(fused(pool, store, args, "int8", "rounds", beside, h=args.long_sync_every))
            if not args.no_ddp:
                outer = pool.agents[-1]  # a clean stop: the trainers take the outer steps at once
                outer.terminate()
                outer.wait(timeout=120)
                add(fused(pool, store, args, "int8", "rounds", "on the trainers"))
                add(ddp(pool, args))
                compare_to_ddp(rows, args)
    finally:
        os.environ.pop("TESTBED_SIM_STEP_S", None)
    for row in rows:
        row.update(rate=rate)
    return rows


def recipe_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs, values read as JSON where they parse (``context=32`` is a number), as
    ``--recipe-option`` reads them."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def compare_to_ddp(rows: list[dict[str, Any]], args) -> None:
    """When DDP (the last row) reached the fused int8 run's final validation loss."""
    mark = next(r for r in rows if r["system"].startswith("TensorTurn fused int8, rounds, outer steps beside")
                and r["H"] == args.sync_every)
    target = mark["val_loss"]
    mark["to_fused_loss_s"] = mark["to_own_loss_s"]  # its own final loss, by definition
    reached = [p for p in rows[-1]["curve"] if p["val_loss"] <= target]
    rows[-1]["to_fused_loss_s"] = reached[0]["wall_s"] if reached else None
    rows[-1]["fused_loss"] = target
    print(f"DDP reached fused int8's val loss {target:.4f} after "
          f"{rows[-1]['to_fused_loss_s'] if reached else 'never'} s", flush=True)


def real_step_s(recipe_name: str, options: dict[str, str], batch_size: int) -> float:
    """Seconds one training step of the recipe takes here on one thread: the median of 10 steps
    of a shard task's own training loop, after one that pays for first-time imports."""
    import torch

    from tensorturn.recipes import resolve
    from tensorturn.train.diloco import initial_state, train_replica

    torch.set_num_threads(1)
    recipe = resolve(recipe_name, options)
    x, y, rows = recipe.shard_data(0, AGENTS, 0)
    marks = [time.perf_counter()]
    train_replica(recipe, initial_state(recipe, 0), x, y, rows, 11, recipe.lr, batch_size, 0,
                  torch.device("cpu"), on_step=lambda _step, _loss: marks.append(time.perf_counter()))
    times = [b - a for a, b in zip(marks[1:], marks[2:])]
    return sorted(times)[len(times) // 2]


def draw(summary: dict) -> Any:
    rows = summary["results"]
    fig = figure(8, 4)
    ax = fig.subplots()
    labels = [f"{r['system']}\n{r['rate']} Mbit/s, H = {r['H']}" for r in rows]
    ax.barh(range(len(rows)), [r["utilisation"] for r in rows], color="C0")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel("compute utilisation (emulated compute ÷ agents × wall)")
    ax.set_xlim(0, 1)
    return fig


def to_loss(row: dict[str, Any]) -> str:
    """Seconds to the fused int8 run's final validation loss (at H): its own wall for that run,
    the first evaluation at or below it for DDP."""
    if "to_fused_loss_s" not in row:
        return "—"
    return f"{row['to_fused_loss_s']:.1f}" if row["to_fused_loss_s"] is not None else "not reached"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="20/100,1000/1000", help="up/down Mbit/s per link, comma-separated")
    parser.add_argument("--rtt-ms", type=float, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=100, help="H (DDP takes rounds × H steps per rank)")
    parser.add_argument("--long-sync-every", type=int, default=500,
                        help="one more fused int8 row at this H (DiLoCo's), first rate only; 0: none")
    parser.add_argument("--sim-step", type=float, default=0.3, help="emulated compute per step, seconds")
    parser.add_argument("--batch", type=int, default=16, help="rows per step (fused and DDP)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", default="charlm", help="charlm, or gpt2-small (85.5M parameters at context 32)")
    parser.add_argument("--recipe-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--variants", default="fp32/rounds,int8/rounds,int8/async",
                        help="fused runs as codec/sync, comma-separated (sync: rounds, overlap, async)")
    parser.add_argument("--overlap-rounds", type=int, default=4,
                        help="rounds of --sync overlap runs (its steady state starts at round 2)")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--no-ddp", action="store_true",
                        help="no DDP row, nor the outer steps on the trainers (a model of 86M+ on CPU)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    why = netlab.unavailable()
    if why:
        sys.exit(f"wan.py: {why}")
    args.options = recipe_options(args.recipe_option)
    real = real_step_s(args.recipe, args.options, args.batch) * max(1.0, AGENTS / (os.cpu_count() or 1))
    print(f"a real {args.recipe} step here: {real:.3f} s with {AGENTS} agents sharing the cores", flush=True)
    if real * 1.2 > args.sim_step:
        sys.exit(f"wan.py: the emulated step ({args.sim_step} s) is not longer than a real one here "
                 f"({real:.3f} s, +20 %): the figures would measure this machine's cores; pass "
                 f"--sim-step {real * 1.5:.2f} or a smaller --batch")
    moto, store_env = start_moto()
    os.environ.update(store_env)
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket="tt-wan")
        results = []
        for rate in args.rates.split(","):
            results += measure(rate, "s3://tt-wan/runs", store_env, args)
    finally:
        stop_process_group(moto, grace=5)
    print(f"\n{args.recipe} {args.options} ({args.rounds} rounds × {AGENTS} shards × H; DDP "
          f"{args.rounds} × H steps per "
          f"rank: the same samples), batch {args.batch}, emulated compute {args.sim_step} s/step, "
          f"RTT {args.rtt_ms:g} ms\n")
    print(table(["links Mbit/s", "system", "H", "rounds", "wall s", "compute utilisation",
                 "steady utilisation", "val loss",
                 "time to fused int8's loss s", "wire up MB", "wire down MB", "store accounted MB",
                 "S3 carried ÷ accounted", "Redis carried MB", "wire ÷ carried"],
                [[r["rate"], r["system"], r["H"], r.get("rounds", args.rounds), f"{r['wall_s']:.1f}",
                  f"{r['utilisation']:.3f}",
                  f"{r['steady_utilisation']:.3f}" if r.get("steady_utilisation") else "—",
                  f"{r['val_loss']:.4f}", to_loss(r), f"{r['wire_up'] / 1e6:.1f}",
                  f"{r['wire_down'] / 1e6:.1f}",
                  f"{r['accounted'] / 1e6:.2f}" if r["accounted"] else "—",
                  f"{r['store_vs_accounted']:.3f}" if r["store_vs_accounted"] else "—",
                  f"{r['broker_carried'] / 1e6:.2f}" if r["broker_carried"] is not None else "—",
                  f"{r['wire_vs_carried']:.3f}" if r["wire_vs_carried"] else "—"] for r in results]))
    summary = {"machine": machine(), "args": vars(args), "results": results}
    write_outputs("wan", summary, draw(summary), Path(args.out_dir) if args.out_dir else None)


if __name__ == "__main__":
    main()
