"""Work stealing: does a pool with one slow machine reach the sum of its machines' rates?

Three embedded agents; local3 is made 3× slower than local1 and local2 by the testbed's throttle
``TESTBED_SLOWDOWN`` (an agent started with it set to f sleeps so that its training loops
take f× their compute time, paced against a deadline; ``testbed.emulate.Throttle``). Each measurement is
a fused digits-mlp run of the same total work (rounds × shards × H steps), rated
samples / (last shard finish − first shard start):

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
so that the three need ~1.2 cores and the CPU no longer hides how well stealing does; H is
halved there so that tasks last about as long.

A second table splits the agents' time (3 × the run's span) into training, waiting at the end of a
round for its last shard (the straggler tail), the gap between rounds (chord, outer step,
dispatch) and the rest (fetching the next task), for the dynamic run, one more dynamic run with
``--more-shards`` (48) shards per round, and the static run: it shows what the ratio loses where.

    python benchmarks/stealing.py [--shards 24] [--sync-every 600] [--rounds 2] [--reps 2]
                                  [--more-shards 48] [--variants 1,2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from _common import (
    figure,
    machine,
    run_job,
    shard_span,
    short,
    succeeded,
    table,
    total_samples,
    write_outputs,
)

from tensorturn.pool.celery_app import app
from tensorturn.pool.embedded import LocalPool
from tensorturn.pool.remote_control import send
from tensorturn.runs.records import workers
from tensorturn.runs.report import worker_stats

SLOW_FACTOR = 3  # the slow agent's throttle relative to the fast ones


def queues_by_worker() -> dict[str, list[str]]:
    replies = app.control.inspect(timeout=2.0).active_queues() or {}
    return {w: sorted(q["name"] for q in qs) for w, qs in replies.items()}


def only(worker: str | None, queues: dict[str, list[str]]) -> None:
    """Let only ``worker`` consume (None: every worker consumes its queues again); the agents
    take these commands signed with the pool key only, for their current start."""
    started = {w["name"]: w["incarnation"] for w in workers(app.conf.broker_url)}
    for w, names in queues.items():
        for q in names:
            command = "add_consumer" if worker is None or w == worker else "cancel_consumer"
            send(app, command, {"queue": q}, worker=w, incarnation=started[w], reply=True)
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
            os.environ["TESTBED_SLOWDOWN"] = f"{factor:g}"
        try:
            pool.start_agent(i)
        finally:
            os.environ.pop("TESTBED_SLOWDOWN", None)
    pool.wait_ready()


def rate(doc: dict) -> float:
    return total_samples(doc) / shard_span(doc)


def agent_time(doc: dict, agents: list[str]) -> dict:
    """Where the agents' time went in a run (shares of agents × span): training; waiting at the
    end of a round for its last shard (the straggler tail); between rounds (the chord, outer
    step and dispatch); and the rest (fetching the next task, starting late)."""
    by_round: dict[int, list[dict]] = {}
    for a in succeeded(doc):
        by_round.setdefault(int(a["task"].split("/")[0][1:]), []).append(a)
    span = shard_span(doc)
    total = span * len(agents)
    training = sum(a["finished_at"] - a["started_at"] for a in succeeded(doc))
    tail = between = 0.0
    rounds = sorted(by_round)
    for r in rounds:
        end = max(a["finished_at"] for a in by_round[r])
        start = min(a["started_at"] for a in by_round[r])
        for w in agents:
            mine = [a["finished_at"] for a in by_round[r] if short(a["worker"]) == w]
            tail += end - (max(mine) if mine else start)
        if r + 1 in by_round:
            between += (min(a["started_at"] for a in by_round[r + 1]) - end) * len(agents)
    return {"training": training / total, "round_tail": tail / total,
            "between_rounds": between / total,
            "other_idle": (total - training - tail - between) / total}


def measure(args, fast: float) -> dict:
    """Solo, dynamic and static runs on a fresh pool whose fast agents are throttled by ``fast``.

    H is ``--sync-every`` / ``fast``, so a task lasts about as long in every variant."""
    h = max(1, round(args.sync_every / fast))
    h_static = args.shards * h // 3
    label = f"local1/2 ×{fast:g}, local3 ×{SLOW_FACTOR * fast:g}"
    print(f"\n== variant: {label} (TESTBED_SLOWDOWN) ==", flush=True)
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
                doc = run_job(pool, store, **job(args, args.shards, h))
                assert {a["worker"] for a in succeeded(doc)} == {w}, "another agent took work"
                solo[short(w)] = rate(doc)
                print(f"solo {short(w)}: {solo[short(w)]:,.0f} samples/s", flush=True)
            only(None, queues)
            dynamic, static, more = [], [], []
            plan = [("dynamic", args.shards, h, dynamic)] * args.reps
            plan.insert(1, ("static", 3, h_static, static))
            if args.more_shards:
                plan.append(("more shards", args.more_shards, h, more))
            for kind, shards, steps, out in plan:
                doc = run_job(pool, store, **job(args, shards, steps))
                out.append(doc)
                counts = Counter(short(a["worker"]) for a in succeeded(doc))
                print(f"{kind} ({shards} shards × H={steps}): {rate(doc):,.0f} samples/s; tasks "
                      f"per agent {dict(sorted(counts.items()))}", flush=True)
            names = [short(w) for w in workers]
    best_dyn, best_sta = max(dynamic, key=rate), max(static, key=rate)
    solo_sum = sum(solo.values())
    in_run = {short(s["worker"]): s["samples_per_s"] for s in worker_stats(best_dyn)}
    in_run_sum = sum(in_run.values())
    return {
        "variant": label, "fast_slowdown": fast, "slow_slowdown": SLOW_FACTOR * fast,
        "samples_per_run": total_samples(best_dyn), "sync_every": h,
        "static_sync_every": h_static,
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
        "slow_factor_measured": statistics.mean(
            v for n, v in solo.items() if n != "local3") / solo["local3"],
        "agent_time_dynamic": agent_time(best_dyn, names),
        "agent_time_static": agent_time(best_sta, names),
        "more_shards": ({"shards": args.more_shards, "samples_per_s": rate(more[0]),
                         "ratio_vs_solo_sum": rate(more[0]) / solo_sum,
                         "agent_time": agent_time(more[0], names),
                         "tasks_per_agent": dict(sorted(Counter(
                             short(a["worker"]) for a in succeeded(more[0])).items()))}
                        if more else None),
        "_docs": (best_dyn, best_sta),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=24, help="shards per round, dynamic run")
    parser.add_argument("--sync-every", type=int, default=600,
                        help="H of the dynamic run at full speed (divided by a variant's throttle)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2, help="dynamic runs (the best counts)")
    parser.add_argument("--more-shards", type=int, default=48,
                        help="one more dynamic run with this many shards per round (0: none), "
                             "rated against the same solo rates")
    parser.add_argument("--variants", default="1,2",
                        help="throttles of the fast agents, one pool each (the slow one gets 3×): "
                             "1 = the machine's full speed; 2 = sleep-emulated machines that "
                             "leave the CPU half idle, so contention does not hide stealing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    variants = [float(f) for f in args.variants.split(",") if f]
    if args.shards % 3:
        parser.error("--shards must be a multiple of 3 (the static run has 3 shards of the same work)")
    info = machine()
    results = [measure(args, f) for f in variants]

    print(f"\nWork stealing: 3 agents, local3 {SLOW_FACTOR}× slower; digits-mlp, {args.rounds} "
          f"rounds; dynamic {args.shards} shards × H, static 3 shards × {args.shards // 3}·H (the "
          f"same samples); best of {args.reps}; {info['nproc']} cores, {info['cpu_model']}\n")
    rows = []
    for r in results:
        solo = r["solo_samples_per_s"]
        rows.append([r["variant"], r["sync_every"],
                     " + ".join(f"{v:,.0f}" for _, v in sorted(solo.items())),
                     f"{r['slow_factor_measured']:.1f}×", f"{r['solo_sum']:,.0f}",
                     f"{r['dynamic_best']:,.0f}", f"{r['ratio_dynamic_vs_solo_sum']:.3f}",
                     f"{r['static_best']:,.0f}", f"{r['ratio_static_vs_solo_sum']:.3f}",
                     f"{r['ratio_dynamic_vs_static']:.2f}×",
                     " / ".join(str(c) for c in r["dynamic_tasks_per_agent"].values()),
                     f"{r['contention_factor']:.3f}"])
    print(table(["throttles", "H", "solo local1 + local2 + local3", "slow ÷ fast (solo)",
                 "Σ solo", f"dynamic ({args.shards} shards)", "dynamic ÷ Σ solo",
                 "static (3 shards)", "static ÷ Σ solo", "dynamic ÷ static",
                 "dynamic tasks local1/2/3", "Σ in-run rates ÷ Σ solo"], rows))
    print("\nWhere the agents' time went (share of 3 agents × the run's span):\n")
    rows = []
    for r in results:
        runs = [(f"dynamic, {args.shards} shards", r["agent_time_dynamic"], r["ratio_dynamic_vs_solo_sum"]),
                ("static, 3 shards", r["agent_time_static"], r["ratio_static_vs_solo_sum"])]
        if r["more_shards"]:
            m = r["more_shards"]
            runs.insert(1, (f"dynamic, {m['shards']} shards", m["agent_time"], m["ratio_vs_solo_sum"]))
        for name, t, ratio in runs:
            rows.append([r["variant"], name, f"{ratio:.3f}", f"{t['training']:.3f}",
                         f"{t['round_tail']:.3f}", f"{t['between_rounds']:.3f}",
                         f"{t['other_idle']:.3f}"])
    print(table(["throttles", "run", "÷ Σ solo", "training", "waiting for a round's last shard",
                 "between rounds", "fetching / other"], rows))
    print("\nsamples/s, best of the dynamic runs; 'Σ in-run rates' = each agent's samples over "
          "its busy seconds in that run: below 1 it is what running side by side on this CPU "
          "costs each agent. The more-shards run is rated against the solo rates measured at "
          f"{args.shards} shards.")

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
        timeline(ax_dyn, best_dyn, f"dynamic: {args.shards} shards × H={r['sync_every']} per round")
        timeline(ax_sta, best_sta, f"static: 3 shards × H={r['static_sync_every']} per round")
        right = max(ax_dyn.get_xlim()[1], ax_sta.get_xlim()[1])
        ax_dyn.set_xlim(0, right)
        ax_sta.set_xlim(0, right)
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
