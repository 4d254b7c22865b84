"""Work stealing: does a pool with one slow machine reach the sum of its machines' rates?

Three embedded agents; local3 is made 3× slower than local1 and local2 by the test-only throttle
``TENSORTURN_SLOWDOWN`` (an agent started with it set to f sleeps (f−1)× each step's time; see
tensorturn/training.py). Each measurement is a fused digits-mlp run of the same total work
(rounds × shards × H steps), rated samples / (last shard finish − first shard start):

1. solo: each agent alone (the other two stop consuming the queues through Celery's
   ``cancel_consumer``; they stay up, idle) runs the dynamic job; the ideal aggregate is the sum.
2. dynamic: all three run the job with many shards per round (``--shards``, default 24): faster
   agents come back for more shards sooner.
3. static: one shard per agent (3 shards of shards/3 × H steps: the same samples), so the slow
   agent is the straggler every round.

The CPU is the catch on a small machine: three CPU-bound agents (plus redis and this process) on
2 cores contend, so the solo rates, measured while the others are idle, overstate what the three
can do together. The table therefore also shows each agent's rate *while* it trained in the
dynamic run (samples over its busy seconds, from the attempts): aggregate ÷ their sum is the share
of agent time spent training — what stealing controls — apart from CPU contention. And it runs
the whole comparison twice (``--variants 1,2``): with the fast agents at full speed (local3 at
SLOWDOWN=3), and with every agent sleep-throttled (local1/2 at 2, local3 at 6: still 3× slower)
so that the three need ~1.2 cores and the CPU no longer hides how well stealing does.

    python benchmarks/stealing.py [--shards 24] [--sync-every 200] [--rounds 2] [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from _common import figure, machine, run_job, shard_span, short, succeeded, table, total_samples, write_outputs
from tensorturn.celery_app import app
from tensorturn.local import LocalPool
from tensorturn.report import worker_stats

SLOW_FACTOR = 3  # the slow agent's throttle relative to the fast ones


def queues_by_worker() -> dict[str, list[str]]:
    replies = app.control.inspect(timeout=2.0).active_queues() or {}
    return {w: sorted(q["name"] for q in qs) for w, qs in replies.items()}


def only(worker: str | None, queues: dict[str, list[str]]) -> None:
    """Let only ``worker`` consume (None: every worker consumes its queues again)."""
    for w, names in queues.items():
        for q in names:
            if worker is None or w == worker:
                app.control.add_consumer(q, destination=[w], reply=True, timeout=2.0)
            else:
                app.control.cancel_consumer(q, destination=[w], reply=True, timeout=2.0)
    now = queues_by_worker()
    for w in queues:
        expected = queues[w] if worker is None or w == worker else []
        if now.get(w, []) != expected:
            raise RuntimeError(f"{w} consumes {now.get(w)}, expected {expected}")
    time.sleep(1.5)  # a fetch issued before the change times out (kombu polls every second)


def job(args, shards: int, h: int) -> dict:
    return dict(mode="fused", rounds=args.rounds, shards=shards, sync_every=h, threads_per_task=1,
                seed=args.seed)


def timeline(ax, doc: dict, title: str) -> None:
    t0 = min(a["started_at"] for a in succeeded(doc))
    names = sorted({short(a["worker"]) for a in succeeded(doc)})
    for a in succeeded(doc):
        y = names.index(short(a["worker"]))
        r = int(a["task"].split("/")[0][1:])
        ax.barh(y, a["finished_at"] - a["started_at"], left=a["started_at"] - t0,
                color=f"C{r % 10}", edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(names)), [n + (" (slow)" if n == "local3" else "") for n in names])
    ax.set_xlabel("seconds (colour = round)")
    ax.set_title(title, fontsize=9)


def start_agents(pool, fast: float) -> None:
    """local1, local2 throttled by ``fast`` (1 = not at all), local3 by 3 × ``fast``."""
    for i, factor in enumerate((fast, fast, SLOW_FACTOR * fast)):
        if factor > 1:
            os.environ["TENSORTURN_SLOWDOWN"] = f"{factor:g}"
        try:
            pool.start_agent(i)
        finally:
            os.environ.pop("TENSORTURN_SLOWDOWN", None)
    pool.wait_ready()


def rate(doc: dict) -> float:
    return total_samples(doc) / shard_span(doc)


def measure(args, fast: float) -> dict:
    """Solo, dynamic and static runs on a fresh pool whose fast agents are throttled by ``fast``."""
    h_static = args.shards * args.sync_every // 3
    label = f"local1/2 ×{fast:g}, local3 ×{SLOW_FACTOR * fast:g}"
    print(f"\n== variant: {label} (TENSORTURN_SLOWDOWN) ==", flush=True)
    with tempfile.TemporaryDirectory(prefix="tt-stealing-") as tmp:
        store = (Path(tmp) / "store").as_uri()
        with LocalPool(0, store, workdir=Path(tmp) / "pool") as pool:
            start_agents(pool, fast)
            queues = queues_by_worker()
            workers = sorted(queues, key=short)
            solo = {}
            for w in workers:
                only(w, queues)
                run_job(pool, store, **job(args, 3, 5))  # warm the agent (imports, data)
                doc = run_job(pool, store, **job(args, args.shards, args.sync_every))
                assert {a["worker"] for a in succeeded(doc)} == {w}, "another agent took work"
                solo[short(w)] = rate(doc)
                print(f"solo {short(w)}: {solo[short(w)]:,.0f} samples/s", flush=True)
            only(None, queues)
            dynamic, static = [], []
            for rep in range(args.reps):
                for kind, shards, h, out in (("dynamic", args.shards, args.sync_every, dynamic),
                                             ("static", 3, h_static, static)):
                    doc = run_job(pool, store, **job(args, shards, h))
                    out.append(doc)
                    counts = Counter(short(a["worker"]) for a in succeeded(doc))
                    print(f"{kind} rep {rep + 1}: {rate(doc):,.0f} samples/s; tasks per agent "
                          f"{dict(sorted(counts.items()))}", flush=True)
    best_dyn, best_sta = max(dynamic, key=rate), max(static, key=rate)
    solo_sum = sum(solo.values())
    in_run = {short(s["worker"]): s["samples_per_s"] for s in worker_stats(best_dyn)}
    in_run_sum = sum(in_run.values())
    return {
        "variant": label, "fast_slowdown": fast, "slow_slowdown": SLOW_FACTOR * fast,
        "samples_per_run": total_samples(best_dyn), "static_sync_every": h_static,
        "solo_samples_per_s": solo, "solo_sum": solo_sum,
        "dynamic_samples_per_s": [rate(d) for d in dynamic],
        "static_samples_per_s": [rate(d) for d in static],
        "dynamic_best": rate(best_dyn), "static_best": rate(best_sta),
        "ratio_dynamic_vs_solo_sum": rate(best_dyn) / solo_sum,
        "ratio_static_vs_solo_sum": rate(best_sta) / solo_sum,
        "ratio_dynamic_vs_static": rate(best_dyn) / rate(best_sta),
        "in_run_samples_per_s": in_run, "in_run_sum": in_run_sum,
        "busy_share_dynamic": rate(best_dyn) / in_run_sum,
        "contention_factor": in_run_sum / solo_sum,
        "dynamic_tasks_per_agent": dict(sorted(Counter(
            short(a["worker"]) for a in succeeded(best_dyn)).items())),
        "static_tasks_per_agent": dict(sorted(Counter(
            short(a["worker"]) for a in succeeded(best_sta)).items())),
        "median_dynamic": statistics.median(rate(d) for d in dynamic),
        "median_static": statistics.median(rate(d) for d in static),
        "_docs": (best_dyn, best_sta),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=24, help="shards per round, dynamic run")
    parser.add_argument("--sync-every", type=int, default=200, help="H of the dynamic run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2, help="dynamic/static runs, interleaved")
    parser.add_argument("--variants", default="1,2",
                        help="throttles of the fast agents, one pool each (the slow one gets 3×): "
                             "1 = the machine's full speed; 2 = sleep-emulated machines that "
                             "leave the CPU half idle, so contention does not hide stealing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    if (args.shards * args.sync_every) % 3:
        parser.error("--shards × --sync-every must be a multiple of 3 (the static run's 3 shards)")
    info = machine()
    results = [measure(args, float(f)) for f in args.variants.split(",") if f]

    print(f"\nWork stealing: 3 agents, local3 {SLOW_FACTOR}× slower; digits-mlp, {args.rounds} "
          f"rounds; dynamic {args.shards} shards × H={args.sync_every}, static 3 shards × "
          f"H={results[0]['static_sync_every']} (same samples); best of {args.reps}; "
          f"{info['nproc']} cores, {info['cpu_model']}\n")
    rows = []
    for r in results:
        solo = r["solo_samples_per_s"]
        rows.append([r["variant"], " + ".join(f"{v:,.0f}" for _, v in sorted(solo.items())),
                     round(r["solo_sum"]), round(r["dynamic_best"]),
                     round(r["ratio_dynamic_vs_solo_sum"], 3), round(r["static_best"]),
                     round(r["ratio_static_vs_solo_sum"], 3),
                     round(r["ratio_dynamic_vs_static"], 2),
                     round(r["busy_share_dynamic"], 3), round(r["contention_factor"], 3),
                     " / ".join(str(c) for c in r["dynamic_tasks_per_agent"].values())])
    print(table(["throttles", "solo local1 + local2 + local3", "Σ solo", "dynamic",
                 "dynamic ÷ Σ solo", "static", "static ÷ Σ solo", "dynamic ÷ static",
                 "dynamic ÷ Σ in-run rates", "Σ in-run ÷ Σ solo (contention)",
                 "dynamic tasks local1/2/3"], rows))
    print("\nsamples/s; 'in-run rate' = an agent's samples over its busy seconds in the dynamic "
          "run, so 'dynamic ÷ Σ in-run rates' is the share of agent time spent training and "
          "'Σ in-run ÷ Σ solo' is what running side by side on this CPU costs each agent.")

    fig = figure(13, 4 * len(results))
    axes = fig.subplots(len(results), 3, width_ratios=[1, 1.4, 1.4], squeeze=False)
    for (ax_rate, ax_dyn, ax_sta), r in zip(axes, results):
        best_dyn, best_sta = r["_docs"]
        bottom = 0.0
        for n, v in sorted(r["solo_samples_per_s"].items()):
            ax_rate.bar("Σ solo", v, bottom=bottom, label=f"solo {n}")
            bottom += v
        ax_rate.bar("Σ in-run", r["in_run_sum"], color="gray")
        ax_rate.bar("dynamic", r["dynamic_best"], color="tab:green")
        ax_rate.bar("static", r["static_best"], color="tab:red")
        ax_rate.set_ylabel("samples/s")
        ax_rate.legend(fontsize=7)
        ax_rate.set_title(r["variant"], fontsize=9)
        timeline(ax_dyn, best_dyn, f"dynamic: {args.shards} shards/round")
        timeline(ax_sta, best_sta, "static: 3 shards/round")
        ax_sta.sharex(ax_dyn)
    for r in results:
        del r["_docs"]
    write_outputs("stealing", {
        "question": "aggregate samples/s with work stealing vs the sum of solo rates, and vs one "
                    "static shard per agent, with one agent 3× slower",
        "command": "python benchmarks/stealing.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "machine": info, "results": results}, fig, args.out_dir)


if __name__ == "__main__":
    main()
