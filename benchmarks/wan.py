"""Home links: TensorTurn fused (fp32, int8; rounds and async) against a per-step all-reduce
(PyTorch DDP over gloo) on the same emulated links, the same data and the same samples.

Needs root (network namespaces; see ``tensorturn/netlab.py``). Three agents, each in its own
namespace behind a veth link shaped by ``tc tbf`` (default 20 Mbit/s up, 100 down) with ~40 ms
RTT from a delay proxy in front of Redis and the S3 endpoint (moto's server). Compute is emulated:
every training step takes ``--sim-step`` seconds (``TENSORTURN_SIM_STEP_S`` for the agents, a
sleep per step for the DDP ranks), so the 2 cores here do not decide the figures and *compute
utilisation* = emulated compute ÷ (agents × wall) is exact. The DDP ranks run in the same
namespaces, routed through the coordinator's (a relay: a peer's bytes cross two links).
Bytes on the wire are read from the links' interface counters (Redis and HTTP included), set
beside TensorTurn's own accounting: ``store_bytes_up`` + ``store_bytes_down`` (every object body
its tasks moved through the store) and, apart, ``bytes_up`` + ``bytes_down`` (shard tasks'
pseudo-gradients and weights only).

    python benchmarks/wan.py [--rates 20/100,1000/1000] [--rtt-ms 40] [--rounds 2] [--sync-every 40]
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

from tensorturn import netlab
from tensorturn.local import free_port, stop_process_group

HERE = Path(__file__).resolve().parent
AGENTS = 3


def wire(pool) -> tuple[int, int]:
    ups, downs = zip(*(link.counters() for link in pool.links))
    return sum(ups), sum(downs)


def settled(pool, run_id: str) -> dict[str, Any]:
    """The run's description once its last attempt has recorded what it moved (a run is
    marked finished inside its last task, a moment before that task's figures are in)."""
    from tensorturn.board import RunBoard
    from tensorturn.broker import redis_client

    board = RunBoard(redis_client(pool.broker_url))
    last = None
    while True:
        doc = board.describe(run_id)
        now = (doc["store_bytes_up"], doc["store_bytes_down"])
        if all(a["outcome"] != "running" for a in doc["attempts"]) and now == last:
            return doc
        last = now
        time.sleep(0.5)


def fused(pool, store: str, args, codec: str, sync: str) -> dict[str, Any]:
    before = wire(pool)
    doc = run_job(pool, store, timeout_s=1800, recipe="charlm", mode="fused", rounds=args.rounds,
                  shards=AGENTS, sync_every=args.sync_every, codec=codec, sync=sync,
                  threads_per_task=1, eval_batches=8, seed=args.seed)
    doc = settled(pool, doc["run_id"])
    after = wire(pool)
    ats = [a for a in doc["attempts"] if a["finished_at"]]
    span = max(a["finished_at"] for a in ats) - min(a["started_at"] for a in ats)
    steps = args.rounds * AGENTS * args.sync_every
    up, down = after[0] - before[0], after[1] - before[1]
    return {"system": f"TensorTurn fused {codec}, {sync}", "wall_s": span,
            "utilisation": steps * args.sim_step / (AGENTS * span),
            "val_loss": doc["rounds"][-1]["val_loss"], "wire_up": up, "wire_down": down,
            "model_bytes": doc["bytes_up"] + doc["bytes_down"],
            "accounted": doc["store_bytes_up"] + doc["store_bytes_down"],
            "wire_vs_accounted": (up + down) / max(doc["store_bytes_up"] + doc["store_bytes_down"], 1)}


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
                 "--recipe", "charlm", "--out", f"{tmp}/rank{rank}.json"], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"a DDP rank failed: {err.strip().splitlines()[-1:]}")
        outs = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(AGENTS)]
    after = wire(pool)
    wall = max(o["wall_s"] for o in outs)
    return {"system": "DDP (gloo), per-step all-reduce", "wall_s": wall,
            "utilisation": steps * args.sim_step / wall, "val_loss": outs[0]["val"]["loss"],
            "wire_up": after[0] - before[0], "wire_down": after[1] - before[1],
            "model_bytes": None, "accounted": None, "wire_vs_accounted": None}


def measure(rate: str, store: str, store_env: dict[str, str], args) -> list[dict[str, Any]]:
    up, down = (float(v) for v in rate.split("/"))
    print(f"\n== links {up:g}/{down:g} Mbit/s, RTT {args.rtt_ms:g} ms ==", flush=True)
    os.environ["TENSORTURN_SIM_STEP_S"] = str(args.sim_step)
    try:
        with tempfile.TemporaryDirectory(prefix="tt-wan-") as tmp, \
                netlab.LinkPool(AGENTS, store, store_env, rtt_ms=args.rtt_ms, up_mbit=up,
                                down_mbit=down, workdir=Path(tmp)) as pool:
            rows = []
            for codec, sync in (("fp32", "rounds"), ("int8", "rounds"), ("int8", "async")):
                rows.append(fused(pool, store, args, codec, sync))
                print(rows[-1], flush=True)
            rows.append(ddp(pool, args))
            print(rows[-1], flush=True)
    finally:
        os.environ.pop("TENSORTURN_SIM_STEP_S", None)
    for row in rows:
        row.update(rate=rate)
    return rows


def draw(summary: dict) -> Any:
    rows = summary["results"]
    fig = figure(8, 4)
    ax = fig.subplots()
    labels = [f"{r['system']}\n{r['rate']} Mbit/s" for r in rows]
    ax.barh(range(len(rows)), [r["utilisation"] for r in rows], color="C0")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel("compute utilisation (emulated compute ÷ agents × wall)")
    ax.set_xlim(0, 1)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="20/100,1000/1000", help="up/down Mbit/s per link, comma-separated")
    parser.add_argument("--rtt-ms", type=float, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=40, help="H (DDP takes rounds × H steps per rank)")
    parser.add_argument("--sim-step", type=float, default=0.1, help="emulated compute per step, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    why = netlab.unavailable()
    if why:
        sys.exit(f"wan.py: {why}")
    moto, store_env = netlab.start_moto()
    os.environ.update(store_env)
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket="tt-wan")
        results = []
        for rate in args.rates.split(","):
            results += measure(rate, "s3://tt-wan/runs", store_env, args)
    finally:
        stop_process_group(moto, grace=5)
    print(f"\ncharlm ({args.rounds} rounds × {AGENTS} shards × H={args.sync_every}; DDP "
          f"{args.rounds * args.sync_every} steps per rank: the same samples), emulated compute "
          f"{args.sim_step} s/step, RTT {args.rtt_ms:g} ms\n")
    print(table(["links Mbit/s", "system", "wall s", "compute utilisation", "val loss",
                 "wire up MB", "wire down MB", "accounted MB", "wire ÷ accounted"],
                [[r["rate"], r["system"], f"{r['wall_s']:.1f}", f"{r['utilisation']:.3f}",
                  f"{r['val_loss']:.4f}", f"{r['wire_up'] / 1e6:.1f}", f"{r['wire_down'] / 1e6:.1f}",
                  f"{r['accounted'] / 1e6:.1f}" if r["accounted"] else "—",
                  f"{r['wire_vs_accounted']:.3f}" if r["wire_vs_accounted"] else "—"] for r in results]))
    summary = {"machine": machine(), "args": vars(args), "results": results}
    write_outputs("wan", summary, draw(summary), Path(args.out_dir) if args.out_dir else None)


if __name__ == "__main__":
    main()
