"""Bounded evaluation: how long a fused outer step takes against a shard, for ``gpt2-small``
(85.9M parameters) on a 3 MB corpus, 1 round × 2 shards × 2 inner steps (batch 8 × 256 bytes),
at the default evaluation budget and at larger ``--eval-batches``.

Each case is one ``LocalPool`` of 2 agents on this machine (CPU), running the real tasks; times
come from the run's attempts: a shard's (fetch θ_0, train 2 steps, store its pseudo-gradient)
and the outer step's (average, step, evaluate on validation, then — the last round — store the
model and evaluate on test). It models the CPU cost of evaluating against training on one machine
kind; it does not model a GPU (where both are faster by a similar factor) or links.

    python benchmarks/evaluation.py [--eval-batches default,4,16]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import figure, machine, run_job, table, write_outputs  # noqa: E402

from tensorturn.layout import parse_label  # noqa: E402
from tensorturn.pool.embedded import LocalPool  # noqa: E402

CORPUS_BYTES = 3_000_000


def corpus(path: Path) -> Path:
    """A 3 MB text of seeded pseudo-words (its content does not change the times measured)."""
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgkjqxz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]
    out, size = [], 0
    while size < CORPUS_BYTES:
        line = " ".join(rng.choice(words) for _ in range(12)) + ".\n"
        out.append(line)
        size += len(line)
    path.write_text("".join(out)[:CORPUS_BYTES])
    return path


def seconds(doc: dict, kind: str) -> list[float]:
    return [a["finished_at"] - a["started_at"] for a in doc["attempts"]
            if a["outcome"] == "succeeded" and getattr(parse_label(a["task"]), "kind", None) == kind]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eval-batches", default="default",
                    help="comma-separated cases: 'default' or a number of forward passes")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="tt-eval-") as tmp:
        text = corpus(Path(tmp) / "corpus.txt")
        with LocalPool(2, (Path(tmp) / "store").as_uri(), workdir=Path(tmp) / "pool",
                       allow=["gpt2-small"]) as pool:
            for case in args.eval_batches.split(","):
                given = None if case == "default" else int(case)
                doc = run_job(pool, pool.store_url, timeout_s=3600, mode="fused", recipe="gpt2-small",
                              recipe_options={"data": str(text)}, rounds=1, shards=2, sync_every=2,
                              eval_batches=given)
                shard, outer = seconds(doc, "shard"), seconds(doc, "outer")
                row = {"eval_batches": case, "val_rows": doc["rounds"][0]["val_rows"],
                       "test_rows": doc["metrics"]["test_rows"], "shard_s": max(shard),
                       "outer_s": max(outer), "outer_over_shard": max(outer) / max(shard),
                       "val_loss": doc["rounds"][0]["val_loss"]}
                results.append(row)
                print(table(list(row), [list(row.values())]), flush=True)
    print(table(list(results[0]), [list(r.values()) for r in results]))
    fig = figure(6, 3.5)
    ax = fig.add_subplot()
    ax.bar([r["eval_batches"] for r in results], [r["outer_over_shard"] for r in results])
    ax.axhline(3.0, color="grey", linestyle="--", label="goal: ≤ 3× a shard")
    ax.set_xlabel("--eval-batches")
    ax.set_ylabel("outer step / shard (time)")
    ax.set_title("gpt2-small, 3 MB corpus, 1 round × 2 shards × 2 steps (CPU)")
    ax.legend()
    write_outputs("evaluation", {"machine": machine(), "results": results}, fig)


if __name__ == "__main__":
    main()
