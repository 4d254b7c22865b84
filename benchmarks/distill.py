"""Distillation: how much of an ensemble's gain does one student model keep, at what cost?

For each seed: an ensemble run (``--members`` diverse members, the run's defaults) on an embedded
pool, then ``tensorturn distill`` of it on the same pool — a fused run of the student (the
recipe's default model) against the members' soft vote. From the runs' own test figures:

* mean member, best member, the vote, the student: test accuracy and NLL (or loss);
* the share of the vote's gain the student keeps, (student − mean member) ÷ (vote − mean member),
  per seed and pooled over seeds (the sums of the gains: one seed's gain is a few test rows);
* inference cost: parameters, and milliseconds per 1,000 rows on one CPU thread (median of 5),
  of the vote (every member) and of the student.

    python benchmarks/distill.py [--recipe digits-mlp] [--members 4] [--seeds 0,1,2]
        [--rounds R] [--sync-every H] [--shards S] [--temperature T] [--alpha A] [--mixup N]

The student's options default to ``tensorturn distill``'s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import figure, machine, run_job, table, write_outputs

from tensorturn import client, layout
from tensorturn.artifact import Predictor
from tensorturn.cli.distill import ALPHA, MIXUP, TEMPERATURE, distill_spec
from tensorturn.local import LocalPool
from tensorturn.recipes import load_splits, resolve
from tensorturn.store import open_store
from tensorturn.training import set_threads


def forward_ms(predictor: Predictor, x: torch.Tensor) -> float:
    """Median milliseconds per 1,000 rows of the predictor's whole answer (every member)."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        predictor.predict(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000 * 1000 / len(x)


def parameters(predictor: Predictor) -> int:
    return sum(p.numel() for m in predictor.models for p in m.parameters())


def share(student: float, mean: float, vote: float) -> float | None:
    return (student - mean) / (vote - mean) if vote != mean else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="digits-mlp")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--segment-steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=None, help="default: distill's")
    parser.add_argument("--sync-every", type=int, default=None, help="default: distill's")
    parser.add_argument("--shards", type=int, default=None, help="default: distill's")
    parser.add_argument("--temperature", type=float, default=TEMPERATURE)
    parser.add_argument("--alpha", type=float, default=ALPHA)
    parser.add_argument("--mixup", type=int, default=MIXUP)
    parser.add_argument("--eval-batches", type=int, default=None)
    parser.add_argument("--recipe-option", action="append", default=[], metavar="KEY=JSON")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    import json

    recipe_options = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.recipe_option)}
    set_threads(1)
    info = machine()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tt-distill-") as tmp:
        store_url = (Path(tmp) / "store").as_uri()
        store = open_store(store_url)
        with LocalPool(args.agents, store_url, workdir=Path(tmp) / "pool") as pool:
            for seed in seeds:
                ens = run_job(pool, store_url, timeout_s=3600, mode="ensemble", recipe=args.recipe,
                              recipe_options=recipe_options, members=args.members,
                              segments=args.segments, segment_steps=args.segment_steps,
                              threads_per_task=1, seed=seed, eval_batches=args.eval_batches)
                t0 = time.monotonic()
                spec = distill_spec(ens["run_id"], store_url, temperature=args.temperature,
                                    alpha=args.alpha, mixup=args.mixup, rounds=args.rounds,
                                    sync_every=args.sync_every, shards=args.shards, seed=seed,
                                    threads_per_task=1, eval_batches=args.eval_batches)
                client.submit(spec, pool.broker_url)
                student = client.wait(pool.broker_url, spec.run_id, poll_s=0.25, timeout_s=3600)
                if student["state"] != "succeeded":
                    raise RuntimeError(f"distillation {spec.run_id} ended {student['state']}: "
                                       f"{student.get('error')}")
                seconds = time.monotonic() - t0
                vote = Predictor.from_bytes(store.get_bytes(layout.key("final_ensemble", ens["run_id"])))
                one = Predictor.from_bytes(store.get_bytes(layout.key("final_model", spec.run_id)))
                x = load_splits(resolve(args.recipe, recipe_options)).x_test[:1000]
                e, s = ens["metrics"], student["metrics"]
                rows.append({
                    "seed": seed, "ensemble_run": ens["run_id"], "student_run": spec.run_id,
                    "mixup": spec.recipe_options["mixup"],
                    "student_options": {k: getattr(spec.options, k) for k in ("rounds", "sync_every", "shards")},
                    "mean_member_accuracy": e["member_mean_test_accuracy"],
                    "best_member_accuracy": e["best_member_test_accuracy"],
                    "vote_accuracy": e["test_accuracy"], "student_accuracy": s["test_accuracy"],
                    "mean_member_loss": e["member_mean_test_loss"],
                    "best_member_loss": e["best_member_test_loss"],
                    "vote_loss": e["test_loss"], "student_loss": s["test_loss"],
                    "vote_parameters": parameters(vote), "student_parameters": parameters(one),
                    "vote_ms_per_1000": forward_ms(vote, x), "student_ms_per_1000": forward_ms(one, x),
                    "distill_seconds": seconds,
                })
                r = rows[-1]
                print(f"seed {seed}: mean member {r['mean_member_accuracy']:.4f}, vote "
                      f"{r['vote_accuracy']:.4f}, student {r['student_accuracy']:.4f} "
                      f"(loss {r['mean_member_loss']:.4f} / {r['vote_loss']:.4f} / "
                      f"{r['student_loss']:.4f}) in {seconds:.0f}s", flush=True)

    def pooled(metric: str) -> float | None:
        return share(*(sum(r[f"{who}_{metric}"] for r in rows)
                       for who in ("student", "mean_member", "vote")))

    f = rows[0]["student_options"]
    print(f"\n{args.recipe}: ensembles of {args.members} members, students distilled on "
          f"{args.agents} agents ({f['rounds']} rounds × {f['sync_every']} steps × {f['shards']} "
          f"shards, T {args.temperature:g}, alpha {args.alpha:g}, mixup {rows[0]['mixup']}):\n")
    print(table(["seed", "mean member", "best member", "vote", "student", "gain kept (acc)",
                 "NLL mean/vote/student", "gain kept (NLL)"],
                [[r["seed"], round(r["mean_member_accuracy"], 4), round(r["best_member_accuracy"], 4),
                  round(r["vote_accuracy"], 4), round(r["student_accuracy"], 4),
                  _fmt(share(r["student_accuracy"], r["mean_member_accuracy"], r["vote_accuracy"])),
                  f"{r['mean_member_loss']:.4f} / {r['vote_loss']:.4f} / {r['student_loss']:.4f}",
                  _fmt(share(r["student_loss"], r["mean_member_loss"], r["vote_loss"]))]
                 for r in rows]))
    print(f"\npooled over seeds: the student keeps {_fmt(pooled('accuracy'))} of the vote's accuracy "
          f"gain and {_fmt(pooled('loss'))} of its NLL gain")
    r = rows[-1]
    print(f"inference: vote {r['vote_parameters']:,} parameters, {r['vote_ms_per_1000']:.2f} ms per "
          f"1,000 rows; student {r['student_parameters']:,} parameters, "
          f"{r['student_ms_per_1000']:.2f} ms per 1,000 rows (1 CPU thread)")
    fig = figure(11, 4)
    ax_a, ax_n = fig.subplots(1, 2)
    who = (("mean_member", "mean member", "C3"), ("best_member", "best member", "C2"),
           ("vote", "vote", "C0"), ("student", "student", "C1"))
    width = 0.8 / len(who)
    for ax, metric, name in ((ax_a, "accuracy", "test accuracy"), (ax_n, "loss", "test NLL (nats)")):
        for i, (key, label, color) in enumerate(who):
            ax.bar([j + i * width for j in range(len(rows))], [r[f"{key}_{metric}"] for r in rows],
                   width, label=label, color=color)
        values = [r[f"{key}_{metric}"] for r in rows for key, _, _ in who]
        span = max(values) - min(values)
        ax.set_ylim(min(values) - span, max(values) + span / 2)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"seed {r['seed']}" for r in rows])
        ax.set_ylabel(name)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(f"{args.recipe}: ensemble of {args.members} vs one distilled student "
                 f"(gain kept, pooled: accuracy {_fmt(pooled('accuracy'))}, NLL {_fmt(pooled('loss'))})",
                 fontsize=9)
    write_outputs("distill" if args.recipe == "digits-mlp" else f"distill_{args.recipe}", {
        "question": "share of the ensemble vote's gain over its mean member that one distilled "
                    "student keeps, and its inference cost",
        "command": "python benchmarks/distill.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if v is not None and k not in ("out_dir", "recipe_option")),
        "machine": info, "rows": rows,
        "pooled_share_accuracy": pooled("accuracy"), "pooled_share_loss": pooled("loss"),
    }, fig, out_dir=args.out_dir)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
