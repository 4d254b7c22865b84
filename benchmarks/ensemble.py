"""Ensemble: does the vote beat its members, and how does that grow with the number of members?

One ensemble run of 8 digits-mlp members on an embedded pool (the run's defaults: diverse
configurations, bootstrap samples, 3 segments of 400 steps). Then, from the members' final
checkpoints in the store (``runs/<id>/members/mXX/seg-NNN.safetensors``, loaded with
``tensorturn.predictor.Predictor``), the first k members' votes for k = 1..8 on the test split —
no retraining per k:

* soft vote: mean of the members' probabilities (accuracy, and NLL of that mean);
* hard vote: majority of the members' top classes, ties to the higher mean probability
  (accuracy; its NLL is that of the mean probability, as in the run's own metrics);
* best member and mean member among the first k (accuracy, NLL).

The k = 8 soft vote is checked against the run's own test metrics.

    python benchmarks/ensemble.py [--members 8] [--agents 2] [--segment-steps 400]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import figure, machine, run_job, table, write_outputs

from tensorturn import layout
from tensorturn.pool.embedded import LocalPool
from tensorturn.predictor import Predictor
from tensorturn.recipes import load_splits, resolve
from tensorturn.spec import options_json
from tensorturn.store.objects import open_store
from tensorturn.train.loop import set_threads


def nll(p: torch.Tensor, y: torch.Tensor) -> float:
    return float(F.nll_loss(torch.log(p.clamp_min(1e-12)), y))


def acc(p: torch.Tensor, y: torch.Tensor) -> float:
    return float((p.argmax(-1) == y).float().mean())


def votes(per_member: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """Per k: vote and member figures of the first k members' probabilities (k, rows, classes)."""
    out = []
    for k in range(1, len(per_member) + 1):
        p = per_member[:k]
        mean = p.mean(0)
        hard = F.one_hot(p.argmax(-1), mean.shape[-1]).float().mean(0)
        hard_labels = (hard + 1e-6 * mean).argmax(-1)
        accs = [acc(m, y) for m in p]
        nlls = [nll(m, y) for m in p]
        out.append({
            "k": k,
            "soft_accuracy": acc(mean, y), "soft_nll": nll(mean, y),
            "hard_accuracy": float((hard_labels == y).float().mean()),
            "best_member_accuracy": max(accs), "best_member_nll": min(nlls),
            "mean_member_accuracy": sum(accs) / k, "mean_member_nll": sum(nlls) / k,
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--segment-steps", type=int, default=400)
    parser.add_argument("--diversity", default="full", choices=["full", "seed"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    set_threads(1)
    info = machine()
    with tempfile.TemporaryDirectory(prefix="tt-ensemble-") as tmp:
        store_url = (Path(tmp) / "store").as_uri()
        with LocalPool(args.agents, store_url, workdir=Path(tmp) / "pool") as pool:
            doc = run_job(pool, store_url, mode="ensemble", members=args.members,
                          segments=args.segments, segment_steps=args.segment_steps,
                          diversity=args.diversity, threads_per_task=1, seed=args.seed)
        store = open_store(store_url)
        members = [m for m in doc["members"] if m["state"] == "succeeded"]
        models = [Predictor.from_bytes(store.get_bytes(
            layout.key("segment", doc["run_id"], m["member"], args.segments - 1))) for m in members]
    recipe = resolve(doc["recipe"], doc["spec"].get("recipe_options") or {})
    splits = load_splits(recipe)
    x, y = splits.x_test, splits.y_test
    per_member = torch.stack([pred.member_probabilities(x)[0] for pred in models])
    rows = votes(per_member, y)
    full = rows[-1]
    run_metrics = doc["metrics"]
    if options_json(doc["spec"])["vote"] == "soft" and len(members) == args.members:
        assert abs(full["soft_accuracy"] - run_metrics["test_accuracy"]) < 1e-6, (full, run_metrics)
        assert abs(full["soft_nll"] - run_metrics["test_loss"]) < 1e-4, (full, run_metrics)

    print(f"\nEnsemble of {len(members)} digits-mlp members (diversity {args.diversity}, "
          f"{args.segments}×{args.segment_steps} steps each), test split of {len(y)} rows; "
          f"vote of the first k members:\n")
    print(table(["k", "soft vote acc", "hard vote acc", "best member acc", "mean member acc",
                 "soft vote NLL", "best member NLL", "mean member NLL"],
                [[r["k"], round(r["soft_accuracy"], 4), round(r["hard_accuracy"], 4),
                  round(r["best_member_accuracy"], 4), round(r["mean_member_accuracy"], 4),
                  round(r["soft_nll"], 4), round(r["best_member_nll"], 4),
                  round(r["mean_member_nll"], 4)] for r in rows]))
    print("\nmembers:")
    for m in members:
        cfg = m["config"]
        print(f"  m{m['member']}: hidden {cfg['model']['hidden']}, dropout {cfg['model']['dropout']}, "
              f"lr {cfg['lr']:.4g}; test acc {m['metrics']['test_accuracy']:.4f}, "
              f"NLL {m['metrics']['test_loss']:.4f}")

    fig = figure(11, 4)
    ax_a, ax_n = fig.subplots(1, 2)
    ks = [r["k"] for r in rows]
    for key, label, style, color in (
            ("soft_accuracy", "soft vote", "o-", "C0"), ("hard_accuracy", "hard vote", "s-", "C1"),
            ("best_member_accuracy", "best member", "^--", "C2"),
            ("mean_member_accuracy", "mean member", "v:", "C3")):
        ax_a.plot(ks, [r[key] for r in rows], style, label=label, color=color)
    for key, label, style, color in (
            ("soft_nll", "vote (NLL of the mean probability)", "o-", "C0"),
            ("best_member_nll", "best member", "^--", "C2"),
            ("mean_member_nll", "mean member", "v:", "C3")):
        ax_n.plot(ks, [r[key] for r in rows], style, label=label, color=color)
    for ax, name in ((ax_a, "test accuracy"), (ax_n, "test NLL (nats)")):
        ax.set_xlabel("members k (the first k of the run)")
        ax.set_ylabel(name)
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"digits-mlp ensemble: vote vs members (run {doc['run_id']})", fontsize=9)
    write_outputs("ensemble", {
        "question": "test accuracy and NLL of the vote vs the best and mean member, k = 1..8",
        "command": "python benchmarks/ensemble.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "machine": info, "run_id": doc["run_id"], "run_metrics": run_metrics,
        "members": [{"member": m["member"], "config": m["config"], "metrics": m["metrics"],
                     "workers": m["workers"]} for m in members],
        "by_k": rows}, fig, args.out_dir)


if __name__ == "__main__":
    main()
