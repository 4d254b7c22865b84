"""Requeue latency: how long after a machine drops does its fused shard start again elsewhere?

Each trial starts a fresh embedded pool of two agents with default settings, queues one long
fused shard (--sync-every 20000), SIGKILLs the process group of the agent that runs it (a machine
drop), and measures the time until the other agent starts the shard. Prints the distribution and
writes JSON to benchmarks/results/.

    python benchmarks/requeue.py [--trials 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import tempfile
import time
from pathlib import Path

import redis

from tensorturn import config, runs
from tensorturn.pool.celery_app import RESTORE_INTERVAL_S
from tensorturn.pool.embedded import LocalPool
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard


def trial(workdir: Path) -> float:
    store = (workdir / "store").as_uri()
    with LocalPool(2, store, workdir=workdir / "pool") as pool:
        spec = RunSpec.create(mode="fused", recipe="digits-mlp", store_url=store, rounds=1, shards=1,
                       sync_every=20000)
        runs.submit(spec, pool.broker_url)
        board = RunBoard(redis.Redis.from_url(pool.broker_url, decode_responses=True))
        while not (attempts := board.attempts.all(spec.run_id)):
            time.sleep(0.02)
        first = attempts[0]
        time.sleep(1.0)
        victim = int(first["worker"].split("@")[0].removeprefix("local")) - 1
        os.killpg(pool.agents[victim].pid, signal.SIGKILL)
        killed = time.time()
        while len(attempts := board.attempts.all(spec.run_id)) < 2:
            time.sleep(0.05)
        latency = attempts[1]["started_at"] - killed
        board.fail(spec.run_id, "benchmark trial over")
        for proc in pool.agents:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return latency


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "requeue.json"))
    args = parser.parse_args()
    latencies = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as tmp:
            latencies.append(trial(Path(tmp)))
        print(f"trial {i + 1}/{args.trials}: shard restarted {latencies[-1]:.1f}s after the kill",
              flush=True)
    q = sorted(latencies)
    p95 = q[min(len(q) - 1, max(0, -(-95 * len(q) // 100) - 1))]  # nearest rank
    summary = {
        "visibility_timeout_s": config.current().visibility_timeout_s, "restore_interval_s": RESTORE_INTERVAL_S,
        "trials": len(q), "min_s": q[0], "median_s": statistics.median(q), "p95_s": p95,
        "max_s": q[-1],
        "latencies_s": latencies, "machine": f"{platform.node()} {platform.processor()} "
                                               f"{os.cpu_count()} cores",
    }
    print(f"\nrequeue latency over {len(q)} kills (visibility {config.current().visibility_timeout_s}s, sweep every "
          f"{RESTORE_INTERVAL_S}s):  min {q[0]:.1f}s  median {statistics.median(q):.1f}s  "
          f"p95 {p95:.1f}s  max {q[-1]:.1f}s")
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
