"""Overhead: samples/s of a fused run on one agent vs a plain PyTorch loop doing the same steps.

One embedded agent (a real Celery worker on a private redis-server, file store) runs fused runs of
R rounds × S shards × H steps. TensorTurn's rate is total samples / (last shard finish − first
shard start), from the run's attempts: it pays for every task's start (spec, weights download,
model build), its upload, and the outer step between rounds. The baseline is
``tensorturn.train.loop.train_steps`` — the very inner loop the shard task runs, so the ratio is
TensorTurn's own cost — called once for the same total steps, in this process, on the same
recipe, training split, batch size and one torch thread (``--threads-per-task 1``).

Task lengths H are chosen from a calibration of the plain loop's step time so that a task lasts
about 0.1 s, 0.5 s and 2 s (digits-mlp) or 1 s and 4 s (slower recipes such as charlm,
whose outer step evaluates a bigger model). Each (H, side) pair is measured ``--reps`` times,
interleaved (plain, TensorTurn, plain, ...), because the CPU is shared and its speed swings by
±30 % from one second to the next on a busy host: the table shows the ratio of the best rates
(noise only ever slows a run down), the median and range of the per-pair ratios, and the idle
time between consecutive tasks (from the attempts: the chord, outer step and dispatch between
rounds, the next fetch within a round). The JSON also has each pair's CPU ratio: CPU seconds per
sample of the plain loop over those of the whole pool (agent processes and redis-server, from
submit to the end of the run, final evaluation included). The agent is warmed up first with one
tiny run; its cold first task (imports, data load) is reported apart.

    python benchmarks/overhead.py [--reps N] [--seconds 4] [--shards 2]

Runs ``charlm`` too when ``tensorturn.recipes.BUILTIN`` has it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import (
    cpu_seconds,
    figure,
    machine,
    replot,
    run_job,
    shard_span,
    succeeded,
    table,
    total_samples,
    write_outputs,
)

from tensorturn.pool.embedded import LocalPool
from tensorturn.recipes import BUILTIN, load_splits, resolve
from tensorturn.train.loop import derive_seed, set_threads, train_steps

# Task lengths (seconds at the plain loop's step time) and pairs per length, by recipe; a recipe
# with slow steps and a costly evaluation in the outer step needs longer tasks to amortize it.
TASK_SECONDS = {"digits-mlp": (0.1, 0.5, 2.0)}
SLOW_TASK_SECONDS = (1.0, 4.0)
REPS = {"digits-mlp": 5}
SLOW_REPS = 3


def plain_run(recipe, steps: int, batch: int, seed: int = 0) -> tuple[float, float]:
    """(samples/s, CPU seconds per sample) of ``train_steps`` over ``steps`` steps on the whole
    training split, in this process."""
    splits = load_splits(recipe)
    torch.manual_seed(derive_seed(seed, "init"))
    model = recipe.model(recipe.default_config())
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    rows = torch.arange(len(splits.y_train))
    t0, c0 = time.perf_counter(), time.process_time()
    _, samples = train_steps(recipe, model, opt, splits.x_train, splits.y_train, rows, steps,
                             batch, seed, torch.device("cpu"))
    return samples / (time.perf_counter() - t0), (time.process_time() - c0) / samples


def step_seconds(recipe, batch: int) -> float:
    """The plain loop's seconds per step: steps doubled until a measurement lasts ≥ 1 s."""
    steps = 1
    while True:
        rate, _ = plain_run(recipe, steps, batch)
        if steps * batch / rate >= 1.0 or steps >= 4096:
            return batch / rate
        steps *= 2


def nice(x: float) -> int:
    """Round to two significant digits (at least 1)."""
    if x < 10:
        return max(1, round(x))
    p = 10 ** (len(str(int(x))) - 2)
    return int(round(x / p) * p)


def bench_recipe(name: str, pool, store: str, args) -> dict:
    recipe = resolve(name)
    batch = recipe.batch_size
    step_s = step_seconds(recipe, batch)
    warm = run_job(pool, store, mode="fused", recipe=name, rounds=1, shards=1, sync_every=5,
                   threads_per_task=1, seed=args.seed)
    cold = succeeded(warm)[0]
    cold_s = cold["finished_at"] - cold["started_at"]
    print(f"\n{name}: batch {batch}, plain step ≈ {step_s * 1e3:.2f} ms; agent's cold first task "
          f"(5 steps) took {cold_s:.2f} s", flush=True)
    rows = []
    reps = args.reps or REPS.get(name, SLOW_REPS)
    for task_s in TASK_SECONDS.get(name, SLOW_TASK_SECONDS):
        h = nice(task_s / step_s)
        rounds = max(2, round(args.seconds / (task_s * args.shards)))
        steps = rounds * args.shards * h
        plain, tt, gaps, cpu_ratio = [], [], [], []
        for rep in range(reps):
            rate, plain_cpu = plain_run(recipe, steps, batch, seed=args.seed)
            plain.append(rate)
            c0 = cpu_seconds(pool)
            doc = run_job(pool, store, mode="fused", recipe=name, rounds=rounds,
                          shards=args.shards, sync_every=h, threads_per_task=1, seed=args.seed)
            tt_cpu = (cpu_seconds(pool) - c0) / total_samples(doc)
            cpu_ratio.append(plain_cpu / tt_cpu)
            assert total_samples(doc) == steps * batch, (total_samples(doc), steps * batch)
            tt.append(total_samples(doc) / shard_span(doc))
            done = succeeded(doc)
            busy = sum(a["finished_at"] - a["started_at"] for a in done)
            gaps.append((shard_span(doc) - busy) / len(done))
            print(f"  H={h:<6} rounds={rounds:<3} rep {rep + 1}: plain {plain[-1]:,.0f}/s  "
                  f"tensorturn {tt[-1]:,.0f}/s  ratio {tt[-1] / plain[-1]:.3f}  "
                  f"CPU ratio {cpu_ratio[-1]:.3f}", flush=True)
        row = {
            "recipe": name, "sync_every": h, "task_s": h * step_s, "rounds": rounds,
            "shards": args.shards, "total_steps": steps, "batch_size": batch,
            "plain_samples_per_s": plain, "tensorturn_samples_per_s": tt,
            "ratio_best": max(tt) / max(plain),
            "ratio_median_of_pairs": statistics.median(t / p for t, p in zip(tt, plain)),
            "cpu_ratio_median": statistics.median(cpu_ratio), "cpu_ratios": cpu_ratio,
            "reps": reps,
            "idle_between_tasks_ms": statistics.median(gaps) * 1e3,
        }
        rows.append(row)
    return {"recipe": name, "batch_size": batch, "plain_step_ms": step_s * 1e3,
            "cold_first_task_s": cold_s, "rows": rows}


def draw(results: list[dict], info: dict):
    fig = figure()
    ax = fig.add_subplot()
    for i, res in enumerate(results):
        xs = [r["task_s"] for r in res["rows"]]
        ax.plot(xs, [r["ratio_median_of_pairs"] for r in res["rows"]], "o-", color=f"C{i}",
                label=f"{res['recipe']} (median of pairs)")
        ax.plot(xs, [r["ratio_best"] for r in res["rows"]], "x--", color=f"C{i}", alpha=0.6,
                label=f"{res['recipe']} (best vs best)")
        for r in res["rows"]:
            ax.annotate(f"H={r['sync_every']}", (r["task_s"], r["ratio_median_of_pairs"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=7, color=f"C{i}")
    ax.axhline(0.95, color="gray", linestyle=":", label="goal 0.95")
    ax.set_xscale("log")
    ax.margins(x=0.12)
    ax.set_xlabel("task length, seconds (H steps at the plain loop's speed)")
    ax.set_ylabel("TensorTurn ÷ plain loop, samples/s")
    ax.set_title(f"Overhead on one agent, 1 thread ({info['nproc']} cores, {info['cpu_model']})",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None,
                        help="interleaved pairs per task length (default: 5 for digits-mlp, "
                             "3 for slower recipes)")
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="about how long one measurement trains")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipes", default="digits-mlp,charlm",
                        help="comma-separated; those not in BUILTIN are skipped with a note")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--replot", action="store_true",
                        help="only redraw overhead.png from overhead.json")
    args = parser.parse_args()
    if args.replot:
        replot("overhead", lambda summary: draw(summary["results"], summary["machine"]), args.out_dir)
        return
    set_threads(1)
    info = machine()
    names = [n for n in args.recipes.split(",") if n]
    skipped = [n for n in names if n not in BUILTIN]
    for n in skipped:
        print(f"note: recipe {n!r} is not in tensorturn.recipes.BUILTIN here; skipped")
    results = []
    with tempfile.TemporaryDirectory(prefix="tt-overhead-") as tmp:
        store = (Path(tmp) / "store").as_uri()
        with LocalPool(1, store, workdir=Path(tmp) / "pool") as pool:
            for n in names:
                if n in BUILTIN:
                    results.append(bench_recipe(n, pool, store, args))

    headers = ["recipe", "H (steps)", "task ≈ s", "rounds×shards", "pairs",
               "plain samples/s (best)", "TensorTurn samples/s (best)", "ratio (best)",
               "ratio (median of pairs)", "ratio range", "idle between tasks ms"]
    rows = []
    for res in results:
        for r in res["rows"]:
            pairs = [t / p for t, p in zip(r["tensorturn_samples_per_s"], r["plain_samples_per_s"])]
            rows.append([r["recipe"], r["sync_every"], f"{r['task_s']:.2f}",
                         f"{r['rounds']}×{r['shards']}", r["reps"],
                         f"{max(r['plain_samples_per_s']):,.0f}",
                         f"{max(r['tensorturn_samples_per_s']):,.0f}", f"{r['ratio_best']:.3f}",
                         f"{r['ratio_median_of_pairs']:.3f}", f"{min(pairs):.2f}–{max(pairs):.2f}",
                         f"{r['idle_between_tasks_ms']:.0f}"])
    print(f"\nOverhead on one agent (interleaved pairs; "
          f"{info['nproc']} cores, {info['cpu_model']}):\n")
    print(table(headers, rows))
    for res in results:
        print(f"{res['recipe']}: the agent's cold first task took {res['cold_first_task_s']:.2f} s "
              f"(imports and data load, once per agent process)")
    for n in skipped:
        print(f"{n}: skipped (not a built-in recipe in this checkout)")

    fig = draw(results, info)
    write_outputs("overhead", {
        "question": "samples/s of TensorTurn (one agent) vs a plain loop of the same steps",
        "command": "python benchmarks/overhead.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "baseline": "tensorturn.train.loop.train_steps, one call over the same total steps",
        "machine": info, "skipped": skipped, "results": results}, fig, args.out_dir)


if __name__ == "__main__":
    main()
