"""Distillation: how much of an ensemble's gain does one student model keep, at what cost?

For each seed: an ensemble run (``--members`` diverse members, the run's defaults) on an embedded
pool, then ``tensorturn distill`` of it on the same pool — a fused run of the student (the
recipe's default model) against the members' soft vote. Then, from the stored models, on one
basis (every output position, the same test rows; ``--finetune``: also the greedy and uniform
soups of members fine-tuned from one fused run):

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

from tensorturn import layout, runs
from tensorturn.merge.distill import ALPHA, MIXUP, TEMPERATURE, distill_spec
from tensorturn.pool.embedded import LocalPool
from tensorturn.predictor import Predictor
from tensorturn.store.objects import open_store
from tensorturn.train.loop import set_threads


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


@torch.no_grad()
def evaluate(recipe, members: list, others: dict[str, Any], eval_batches: int | None) -> dict[str, float]:
    """Test accuracy and NLL of each member, the vote (mean of the members' probabilities) and
    each other model, on one basis: every output position (a language model's every character),
    the same test rows (``--eval-batches`` pieces at most)."""
    sums: dict[str, list[float]] = {}
    n = 0

    def add(name: str, p: torch.Tensor, y: torch.Tensor) -> None:
        p = p.reshape(-1, p.shape[-1])
        y = y.reshape(-1)
        acc = float((p.argmax(-1) == y).float().sum())
        nll = float(-torch.log(p.gather(-1, y[:, None]).clamp_min(1e-12)).sum())
        total = sums.setdefault(name, [0.0, 0.0])
        total[0] += acc
        total[1] += nll

    for x, y in recipe.eval_pieces("test", eval_batches):
        probs = [torch.softmax(m.eval()(x).float(), -1) for m in members]
        for i, p in enumerate(probs):
            add(f"m{i}", p, y)
        add("vote", torch.stack(probs).mean(0), y)
        for name, model in others.items():
            add(name, torch.softmax(model.eval()(x).float(), -1), y)
        n += y.numel()
    out = {f"{name}_{metric}": value / n for name, (hits, nats) in sums.items()
           for metric, value in (("accuracy", hits), ("loss", nats))}
    accs = [out.pop(f"m{i}_accuracy") for i in range(len(members))]
    losses = [out.pop(f"m{i}_loss") for i in range(len(members))]
    out.update(mean_member_accuracy=sum(accs) / len(accs), best_member_accuracy=max(accs),
               mean_member_loss=sum(losses) / len(losses), best_member_loss=min(losses))
    return out


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
    parser.add_argument("--finetune", action="store_true",
                        help="members fine-tuned from one fused run (--init-from): soups are valid too")
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
            init = {}
            if args.finetune:  # one base model every ensemble's members start from
                base = run_job(pool, store_url, timeout_s=3600, mode="fused", recipe=args.recipe,
                               recipe_options=recipe_options, threads_per_task=1, seed=1000,
                               eval_batches=args.eval_batches)
                init = {"init_from": base["run_id"]}
                print(f"base model {base['run_id']}: test accuracy "
                      f"{base['metrics'].get('test_accuracy', float('nan')):.4f}", flush=True)
            for seed in seeds:
                ens = run_job(pool, store_url, timeout_s=3600, mode="ensemble", recipe=args.recipe,
                              recipe_options=recipe_options, members=args.members,
                              segments=args.segments, segment_steps=args.segment_steps,
                              threads_per_task=1, seed=seed, eval_batches=args.eval_batches, **init)
                t0 = time.monotonic()
                spec = distill_spec(ens["run_id"], store_url, temperature=args.temperature,
                                    alpha=args.alpha, mixup=args.mixup, rounds=args.rounds,
                                    sync_every=args.sync_every, shards=args.shards, seed=seed,
                                    threads_per_task=1, eval_batches=args.eval_batches)
                runs.submit(spec, pool.broker_url)
                student = runs.wait(pool.broker_url, spec.run_id, poll_s=0.25, timeout_s=3600)
                if student["state"] != "succeeded":
                    raise RuntimeError(f"distillation {spec.run_id} ended {student['state']}: "
                                       f"{student.get('error')}")
                seconds = time.monotonic() - t0
                vote = Predictor.from_bytes(store.get_bytes(layout.key("final_ensemble", ens["run_id"])))
                one = Predictor.from_bytes(store.get_bytes(layout.key("final_model", spec.run_id)))
                recipe = vote.recipe
                models = {"student": one.models[0]}
                if args.finetune:
                    from tensorturn.merge.soup import soup

                    for rule in ("greedy", "uniform"):
                        made = soup(store, ens["run_id"], rule, args.eval_batches)
                        models[f"soup_{rule}"] = Predictor.from_bytes(
                            store.get_bytes(layout.key("final_model", made["run_id"]))).models[0]
                figures = evaluate(recipe, vote.models, models, args.eval_batches)
                x = next(recipe.eval_pieces("test", 1))[0]
                rows.append({
                    "seed": seed, "ensemble_run": ens["run_id"], "student_run": spec.run_id,
                    "mixup": spec.recipe_options["mixup"],
                    "student_options": {k: getattr(spec.options, k) for k in ("rounds", "sync_every", "shards")},
                    **figures,
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
    if args.finetune:
        print("\nsoups (members fine-tuned from one model):\n")
        print(table(["seed", "vote", "student", "greedy soup", "uniform soup",
                     "NLL vote/student/greedy/uniform"],
                    [[r["seed"], round(r["vote_accuracy"], 4), round(r["student_accuracy"], 4),
                      round(r["soup_greedy_accuracy"], 4), round(r["soup_uniform_accuracy"], 4),
                      f"{r['vote_loss']:.4f} / {r['student_loss']:.4f} / {r['soup_greedy_loss']:.4f} / "
                      f"{r['soup_uniform_loss']:.4f}"] for r in rows]))
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
    name = "distill" if args.recipe == "digits-mlp" else f"distill_{args.recipe}"
    write_outputs(name + ("_finetuned" if args.finetune else ""), {
        "question": "share of the ensemble vote's gain over its mean member that one distilled "
                    "student keeps, and its inference cost",
        "command": "python benchmarks/distill.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if v not in (None, False) and k not in ("out_dir", "recipe_option")).replace(" True", ""),
        "machine": info, "rows": rows,
        "pooled_share_accuracy": pooled("accuracy"), "pooled_share_loss": pooled("loss"),
    }, fig, out_dir=args.out_dir)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
