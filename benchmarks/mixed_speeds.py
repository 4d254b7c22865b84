"""Mixed speeds: synchronous rounds vs rounds with backup copies vs asynchronous fused runs, on a
simulated-speed pool.

The pool (test- and benchmark-only): every agent is started with ``TESTBED_SIM_STEP_S`` =
base ÷ its speed, so each of its training steps takes that long — it sleeps out what the step's
real compute (a small model, ~1 ms) leaves — and 3 to 16 agents of different speeds share two
cores without competing for them. Everything else is real: Celery, Redis, the file store, the
outer steps, the evaluations and their CPU time.

Per pool (speeds such as 1:1:4, or a 16-agent long-tailed spread), the script

1. rates each distinct speed alone (the other agents stop consuming through Celery's
   ``cancel_consumer``): the *ideal* is the sum over agents of their solo rates;
2. runs the same job — R rounds × S shards × H steps, the same samples — as ``--sync rounds``,
   ``--sync backup`` and ``--sync async``, and reports useful throughput (samples in the model
   over the span from the first task's start to the last task's end) ÷ ideal, the final
   validation loss (equal samples), time to a target validation loss (the highest of the three
   variants' best losses, so every variant reaches it), and the loss the synchronous run had reached at the
   moment the asynchronous one finished (equal wall time);
3. plots validation loss against wall time per variant.

    python benchmarks/mixed_speeds.py [--pools 1:1:1,1:1:4,long16] [--recipes digits-mlp,charlm]

Issue 49's case (the planner's rule for mixed speeds, :mod:`tensorturn.modes.fused.speeds`):

    python benchmarks/mixed_speeds.py --pools 1:1:4 --recipes digits-mlp --shards 3 \
        --sync-every 60 --seeds 0,1 --name mixed_speeds_114_h60
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from _common import figure, machine, run_job, short, table, write_outputs
from stealing import only, queues_by_worker

from tensorturn.pool.embedded import LocalPool

POOLS = {
    "1:1:1": [1, 1, 1],
    "1:1:4": [1, 1, 4],
    # 16 agents: a few fast, most average, a long tail of slow ones (8× from fastest to slowest)
    "long16": [2] * 4 + [1] * 8 + [0.5] * 3 + [0.25],
    # one straggler among three (issue 28's async cases: run with --shards 3)
    "1:1:0.25": [1, 1, 0.25],
    "1:1:0.1": [1, 1, 0.1],
}
VARIANTS = ("rounds", "backup", "async")
# per recipe: (base step seconds at speed 1, H, rounds, shards per agent-speed unit); the base is
# well above the step's real compute so the emulated time is what an agent's speed is
RECIPES = {
    "digits-mlp": dict(step_s=0.02, sync_every=50, rounds=6),
    "charlm": dict(step_s=0.1, sync_every=20, rounds=6),
}


def job(recipe: str, args, shards: int, sync: str, rounds: int | None = None,
        seed: int | None = None) -> dict[str, Any]:
    cfg = {**RECIPES[recipe], **{k: v for k, v in (("sync_every", args.sync_every), ("rounds", args.rounds))
                                 if v}}
    extra: dict[str, Any] = {}
    if recipe == "charlm":  # a small model: its real compute stays well under the emulated step
        extra = {"recipe_options": {"n_layer": 1, "n_embd": 32, "n_head": 2, "context": 32},
                 "eval_batches": 4}
    return dict(recipe=recipe, mode="fused", sync=sync, rounds=rounds or cfg["rounds"], shards=shards,
                sync_every=cfg["sync_every"], threads_per_task=1,
                seed=args.seed if seed is None else seed,
                **extra)


def span(doc: dict) -> tuple[float, float]:
    """(first task start, last task finish) over every attempt of the run."""
    ats = [a for a in doc["attempts"] if a["finished_at"]]
    return min(a["started_at"] for a in ats), max(a["finished_at"] for a in ats)


def useful_rate(doc: dict) -> float:
    t0, t1 = span(doc)
    return sum(r["samples"] for r in doc["rounds"]) / (t1 - t0)


def curve(doc: dict) -> list[tuple[float, float]]:
    """(seconds since the first task, validation loss) at each round's evaluation."""
    t0 = span(doc)[0]
    return [(r["at"] - t0, r["val_loss"]) for r in doc["rounds"]]


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, loss in points if loss <= target), None)


def loss_at(points: list[tuple[float, float]], t: float) -> float | None:
    """The last validation loss a run had recorded by ``t`` seconds."""
    seen = [loss for at, loss in points if at <= t]
    return seen[-1] if seen else None


def start_agents(pool: LocalPool, speeds: list[float], step_s: float) -> None:
    for i, speed in enumerate(speeds):
        os.environ["TESTBED_SIM_STEP_S"] = f"{step_s / speed:g}"
        try:
            pool.start_agent(i)
        finally:
            os.environ.pop("TESTBED_SIM_STEP_S", None)
    pool.wait_ready(timeout=300)


def measure(recipe: str, name: str, speeds: list[float], args) -> list[dict[str, Any]]:
    """The pool's solo ratings, then every variant once per seed: one result per seed."""
    cfg = {**RECIPES[recipe], **{k: v for k, v in (("sync_every", args.sync_every), ("rounds", args.rounds),
                                                   ("step_s", args.step_s)) if v}}
    shards = args.shards or (8 if len(speeds) <= 3 else 2 * len(speeds))
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    variants = args.variants.split(",")
    print(f"\n== {recipe}, pool {name}: speeds {speeds}, base step {cfg['step_s']} s, "
          f"{cfg['rounds']} rounds × {shards} shards × H={cfg['sync_every']}, seeds {seeds} ==", flush=True)
    out = []
    with tempfile.TemporaryDirectory(prefix="tt-mixed-") as tmp:
        store = (Path(tmp) / "store").as_uri()
        with LocalPool(0, store, workdir=Path(tmp) / "pool") as pool:
            start_agents(pool, speeds, cfg["step_s"])
            queues = queues_by_worker()
            by_name = {short(w): w for w in queues}
            speed_of = {f"local{i + 1}": s for i, s in enumerate(speeds)}
            solo: dict[float, float] = {}
            for speed in sorted(set(speeds), reverse=True):
                worker = by_name[next(n for n, s in speed_of.items() if s == speed)]
                only(worker, queues)
                run_job(pool, store, **job(recipe, args, 2, "rounds", rounds=1))  # warm it up
                doc = run_job(pool, store, **job(recipe, args, args.solo_shards, "rounds", rounds=1))
                solo[speed] = useful_rate(doc)
                print(f"solo, speed {speed:g}: {solo[speed]:,.1f} samples/s", flush=True)
            only(None, queues)
            ideal = sum(solo[s] for s in speeds)
            for seed in seeds:
                docs, load = {}, {}
                for sync in variants:
                    load[sync] = os.getloadavg()[0]
                    doc = run_job(pool, store, timeout_s=1800, **job(recipe, args, shards, sync, seed=seed))
                    docs[sync] = doc
                    rate = useful_rate(doc)
                    tasks = Counter(short(a["worker"]) for a in doc["attempts"] if a["outcome"] == "succeeded"
                                    and a["task"].split("/")[-1][:1] in ("s", "b", "u"))
                    print(f"seed {seed}, {sync}: {rate:,.1f} samples/s = {rate / ideal:.3f} of ideal; span "
                          f"{span(doc)[1] - span(doc)[0]:.1f} s; final val loss "
                          f"{doc['rounds'][-1]['val_loss']:.4f}, test loss {doc['metrics']['test_loss']:.4f}; "
                          f"{sum(tasks.values())} training tasks {dict(tasks)}; load {load[sync]:.1f}", flush=True)
                out.append(summarise(recipe, name, speeds, cfg, shards, seed, solo, ideal, docs, load))
    return out


def summarise(recipe: str, name: str, speeds: list[float], cfg: dict[str, Any], shards: int, seed: int,
              solo: dict[float, float], ideal: float, docs: dict[str, dict], load: dict[str, float]
              ) -> dict[str, Any]:
    curves = {sync: curve(doc) for sync, doc in docs.items()}
    target = max(min(loss for _, loss in points) for points in curves.values())
    async_end = curves["async"][-1][0] if "async" in curves else None
    first = next(iter(docs.values()))
    staleness = {sync: [u["staleness"] for u in doc.get("updates", [])] for sync, doc in docs.items()}
    return {
        "recipe": recipe, "pool": name, "speeds": speeds, "step_s": cfg["step_s"], "seed": seed,
        "rounds": cfg["rounds"], "shards": shards, "sync_every": cfg["sync_every"],
        "samples": sum(r["samples"] for r in first["rounds"]),
        "solo_samples_per_s": {f"{k:g}": v for k, v in solo.items()}, "ideal": ideal,
        "variants": {sync: {
            "samples_per_s": useful_rate(doc), "of_ideal": useful_rate(doc) / ideal,
            "span_s": span(doc)[1] - span(doc)[0],
            "final_val_loss": doc["rounds"][-1]["val_loss"],
            "final_val_accuracy": doc["rounds"][-1].get("val_accuracy"),
            "test": doc["metrics"],
            "time_to_target_s": time_to(curves[sync], target),
            "val_loss_at_async_end": loss_at(curves[sync], async_end) if async_end is not None else None,
            "curve": curves[sync],
            "backups": sum(1 for i in doc["incidents"] if i["kind"] == "backup_queued"),
            "loadavg_1m_at_start": load[sync],
            "staleness": {"mean": sum(staleness[sync]) / max(len(staleness[sync]), 1),
                          "max": max(staleness[sync], default=0),
                          "histogram": dict(sorted(Counter(staleness[sync]).items()))},
        } for sync, doc in docs.items()},
        "target_val_loss": target,
        "async_staleness": {"mean": sum(staleness.get("async", [])) / max(len(staleness.get("async", [])), 1),
                            "max": max(staleness.get("async", []), default=0),
                            "histogram": dict(sorted(Counter(staleness.get("async", [])).items()))},
    }


def draw(summary: dict) -> Any:
    results = summary["results"]
    fig = figure(5 * len(results), 4)
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, res in zip(axes, results):
        for sync, v in res["variants"].items():
            ts, losses = zip(*v["curve"])
            ax.plot(ts, losses, marker="o", markersize=3,
                    label=f"{sync} ({v['of_ideal']:.2f} of ideal)")
        ax.set_title(f"{res['recipe']}, speeds {res['pool']}, seed {res.get('seed', 0)}", fontsize=9)
        ax.set_xlabel("seconds since the first task")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", default="1:1:1,1:1:4,long16", help=f"of {', '.join(POOLS)}")
    parser.add_argument("--recipes", default="digits-mlp,charlm",
                        help="charlm runs on the 3-agent pools only (16 CPU-bound models would "
                             "compete for the two cores)")
    parser.add_argument("--shards", type=int, default=0,
                        help="shards per round (0: the default 8 on 3 agents, 2 per agent on more)")
    parser.add_argument("--solo-shards", type=int, default=6, help="shards of each solo rating run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", default="", help="several seeds, comma-separated (one pool start)")
    parser.add_argument("--sync-every", type=int, default=0, help="H (0: the recipe's)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (0: the recipe's)")
    parser.add_argument("--step-s", type=float, default=0.0,
                        help="seconds of a speed-1 step (0: the recipe's); longer keeps a fast agent's "
                             "real compute within its emulated step on a loaded machine")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="sync policies to run, comma-separated; the first is the baseline")
    parser.add_argument("--name", default="mixed_speeds", help="the results' file name")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    results = []
    for recipe in args.recipes.split(","):
        for name in args.pools.split(","):
            if recipe != "digits-mlp" and len(POOLS[name]) > 3:
                continue
            results.extend(measure(recipe, name, POOLS[name], args))
    info = machine()
    print(f"\nMixed speeds on a simulated-speed pool ({info['nproc']} cores, {info['cpu_model']}); "
          "the same samples per variant; ideal = Σ solo rates\n")
    rows = []
    for res in results:
        base = next(iter(res["variants"].values()))
        for sync, v in res["variants"].items():
            ttt = v["time_to_target_s"]
            rows.append([res["recipe"], res["pool"], res.get("seed", 0), sync, f"{v['samples_per_s']:,.0f}",
                         f"{res['ideal']:,.0f}", f"{v['of_ideal']:.3f}", f"{v['span_s']:.1f}",
                         f"{v['span_s'] / base['span_s']:.2f}×",
                         f"{v['final_val_loss']:.4f}",
                         f"{v['final_val_loss'] / base['final_val_loss'] - 1:+.1%}",
                         f"{v['test']['test_loss']:.4f}",
                         f"{v['test']['test_loss'] / base['test']['test_loss'] - 1:+.1%}",
                         f"{ttt:.1f}" if ttt is not None else "—",
                         f"{v['val_loss_at_async_end']:.4f}" if v["val_loss_at_async_end"] else "—",
                         v["backups"], v["staleness"]["max"], f"{v['loadavg_1m_at_start']:.1f}"])
    print(table(["recipe", "speeds", "seed", "sync", "samples/s", "ideal", "÷ ideal", "span s", "wall ×",
                 "final val loss", "vs first", "test loss", "vs first", "s to target",
                 "val loss when async ended", "backups", "max staleness", "load"], rows))
    for res in results:
        st = res["async_staleness"]
        print(f"{res['recipe']} {res['pool']}: async staleness mean {st['mean']:.2f}, max {st['max']}, "
              f"histogram {st['histogram']}; target val loss {res['target_val_loss']:.4f}")
    summary = {"machine": info, "results": results}
    write_outputs(args.name, summary, draw(summary), Path(args.out_dir) if args.out_dir else None)


if __name__ == "__main__":
    main()
