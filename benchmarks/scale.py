"""Scale: coordination time per round and broker memory with many agents and shards.

One embedded pool of ``--agents`` (16) real agent processes runs fused digits-mlp runs of tiny
tasks (H = ``--sync-every``, default 2 steps) with 16, 32 and 64 shards. Per run:

* coordination time per round boundary = next round's first shard start − the previous round's
  last shard finish (from the attempts): the chord's completion, the outer step (reading every
  shard's pseudo-gradient, averaging, validating, storing θ and the manifest) and dispatching
  the next round's tasks;
* the broker's ``INFO memory`` used_memory, key count and pub/sub channels before and after;
* the agents' total memory (PSS of main and pool processes) before and after.

The pool is warmed first (one run of many one-step shards) so that the agents' cold first tasks
(imports, data load) are not counted. 16 agents on a 2-core machine is heavy: the tasks are
tiny on purpose, and what is measured is the coordination cost, not training speed.

    python benchmarks/scale.py [--agents 16] [--shards 16,32,64] [--rounds 4] [--sync-every 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import redis
from _common import (
    figure,
    machine,
    replot,
    round_gaps,
    run_job,
    shard_span,
    short,
    succeeded,
    table,
    write_outputs,
)

from tensorturn.pool.embedded import LocalPool


def broker_figures(url: str) -> dict:
    r = redis.Redis.from_url(url)
    mem = r.info("memory")
    return {"used_memory": int(mem["used_memory"]), "keys": int(r.dbsize()),
            "pubsub_channels": len(r.pubsub_channels()),
            "clients": int(r.info("clients")["connected_clients"])}


def agents_rss(pool) -> int:
    """Proportional set size (PSS: shared pages split between the processes that share them) of
    every agent process, main and pool; RSS where PSS is not available."""
    total = 0
    for proc in pool.agents:
        try:
            root = psutil.Process(proc.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_full_info().pss
                except (AttributeError, psutil.AccessDenied):
                    total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def draw(results: list[dict], agents: int):
    fig = figure(11, 4)
    ax_c, ax_m = fig.subplots(1, 2)
    xs = [r["shards"] for r in results]
    ax_c.plot(xs, [r["coordination_median_s"] for r in results], "o-", label="median")
    ax_c.plot(xs, [r["coordination_max_s"] for r in results], "s--", label="max")
    ax_c.set_xlabel("shards per round")
    ax_c.set_ylabel("seconds between rounds")
    ax_c.set_title(f"coordination per round boundary, {agents} agents", fontsize=9)
    ax_c.set_xticks(xs)
    ax_c.set_ylim(bottom=0)
    ax_c.grid(alpha=0.3)
    ax_c.legend()
    labels = ["start"] + [f"after {r['shards']}" for r in results]
    keys = [results[0]["broker_before"]["keys"]] + [r["broker_after"]["keys"] for r in results]
    chans = ([results[0]["broker_before"]["pubsub_channels"]]
             + [r["broker_after"]["pubsub_channels"] for r in results])
    mem = ([results[0]["broker_before"]["used_memory"] / 1024 ** 2]
           + [r["broker_after"]["used_memory"] / 1024 ** 2 for r in results])
    ax_m.plot(labels, keys, "o-", label="keys")
    ax_m.plot(labels, chans, "s-", label="pub/sub channels")
    ax_m.set_ylabel("count")
    ax_m.set_xlabel("runs in order (shards per round)")
    ax_m.grid(alpha=0.3)
    ax_r = ax_m.twinx()
    ax_r.plot(labels, mem, "^:", color="gray", label="used_memory (MiB, right)")
    ax_r.set_ylabel("used_memory, MiB")
    ax_r.set_ylim(bottom=0)
    lines = ax_m.get_legend_handles_labels()
    more = ax_r.get_legend_handles_labels()
    ax_m.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    ax_m.set_title("broker: what stays behind after each run", fontsize=9)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--shards", default="16,32,64")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--replot", action="store_true", help="only redraw scale.png from scale.json")
    args = parser.parse_args()
    if args.replot:
        replot("scale", lambda summary: draw(summary["results"], summary["agents"]), args.out_dir)
        return
    info = machine()
    shard_counts = [int(x) for x in args.shards.split(",") if x]
    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="tt-scale-") as tmp:
        store = (Path(tmp) / "store").as_uri()
        pool = LocalPool(args.agents, store, workdir=Path(tmp) / "pool")
        t0 = time.monotonic()
        try:
            pool.start(timeout=600)
            startup_s = time.monotonic() - t0
            print(f"{args.agents} agents ready in {startup_s:.1f}s", flush=True)
            warm = run_job(pool, store, mode="fused", rounds=1, shards=4 * args.agents,
                           sync_every=1, threads_per_task=1, seed=args.seed)
            warm_workers = {a["worker"] for a in succeeded(warm)}
            print(f"warm-up: {len(warm_workers)} of {args.agents} agents took a task", flush=True)
            base = broker_figures(pool.broker_url)
            base_rss = agents_rss(pool)
            for shards in shard_counts:
                before, rss0 = broker_figures(pool.broker_url), agents_rss(pool)
                t = time.monotonic()
                doc = run_job(pool, store, mode="fused", rounds=args.rounds, shards=shards,
                              sync_every=args.sync_every, threads_per_task=1, seed=args.seed)
                wall = time.monotonic() - t
                after, rss1 = broker_figures(pool.broker_url), agents_rss(pool)
                gaps = round_gaps(doc)
                tasks = succeeded(doc)
                durations = [a["finished_at"] - a["started_at"] for a in tasks]
                res = {
                    "shards": shards, "rounds": args.rounds, "wall_s": wall,
                    "shard_span_s": shard_span(doc), "coordination_s": gaps,
                    "coordination_median_s": statistics.median(gaps),
                    "coordination_max_s": max(gaps),
                    "task_median_s": statistics.median(durations),
                    "agents_used": len({a["worker"] for a in tasks}),
                    "broker_before": before, "broker_after": after,
                    "broker_delta_bytes": after["used_memory"] - before["used_memory"],
                    "agents_rss_before": rss0, "agents_rss_after": rss1,
                }
                results.append(res)
                print(f"{shards} shards: coordination per round {statistics.median(gaps):.2f}s "
                      f"(max {max(gaps):.2f}s), broker +{res['broker_delta_bytes'] / 1024:.0f} KiB, "
                      f"{res['agents_used']} agents used", flush=True)
            final = broker_figures(pool.broker_url)
            final_rss = agents_rss(pool)
        finally:
            pool.stop()

    for r in results:
        rows.append([r["shards"], r["rounds"], r["agents_used"], f"{r['task_median_s']:.3f}",
                     f"{r['coordination_median_s']:.3f}", f"{r['coordination_max_s']:.3f}",
                     f"{r['coordination_median_s'] / r['shards'] * 1e3:.1f}",
                     f"{r['broker_before']['used_memory'] / 1024 ** 2:.2f} → "
                     f"{r['broker_after']['used_memory'] / 1024 ** 2:.2f}",
                     f"{r['broker_before']['keys']} → {r['broker_after']['keys']}",
                     f"{r['broker_before']['pubsub_channels']} → {r['broker_after']['pubsub_channels']}",
                     f"{r['agents_rss_before'] / 1024 ** 2:.0f} → {r['agents_rss_after'] / 1024 ** 2:.0f}"])
    print(f"\nScale: {args.agents} agents on {info['nproc']} cores ({info['cpu_model']}), "
          f"digits-mlp, H={args.sync_every}; pool start {startup_s:.0f}s\n")
    print(table(["shards", "rounds", "agents used", "task median s", "coordination median s",
                 "coordination max s", "ms per shard", "broker used_memory MiB",
                 "broker keys", "pub/sub channels", "agents PSS MiB"], rows))
    print(f"\nover all runs: broker {base['used_memory'] / 1024 ** 2:.2f} → "
          f"{final['used_memory'] / 1024 ** 2:.2f} MiB, keys {base['keys']} → {final['keys']}, "
          f"pub/sub channels {base['pubsub_channels']} → {final['pubsub_channels']}; agents' PSS "
          f"{base_rss / 1024 ** 2:.0f} → {final_rss / 1024 ** 2:.0f} MiB")

    fig = draw(results, args.agents)
    write_outputs("scale", {
        "question": "coordination time per round and broker memory with many agents and shards",
        "command": "python benchmarks/scale.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "machine": info, "agents": args.agents, "startup_s": startup_s,
        "warmup_agents_used": len(warm_workers), "broker_start": base, "broker_end": final,
        "agents_rss_start": base_rss, "agents_rss_end": final_rss, "results": results,
        "warmup_agents": sorted(short(w) for w in warm_workers)}, fig, args.out_dir)


if __name__ == "__main__":
    main()
