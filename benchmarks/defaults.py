"""Fused defaults on small data: which outer optimizer, sync interval and result (last or best
round) give the lowest test loss on small tabular sets and digits? (What `--outer auto` decides
from: DiLoCo's Nesterov outer step when shards see their rows at most once a round, else FedAvg.)

Pushes three of scikit-learn's bundled datasets as tables (breast cancer: 569 rows, 2 classes;
wine: 178 rows, 3 classes; diabetes: 442 rows, regression), then runs the built-in `tabular`
recipe on each, and `digits-mlp`, with each configuration below on one embedded pool of 2
agents. Figures are test loss (NLL, or MSE for diabetes) and accuracy — deterministic for a seed
(CPU, one thread per task), so the machine's load changes the time, not the numbers.

    python benchmarks/defaults.py [--seeds 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import machine, run_job  # noqa: E402

NESTEROV = {"outer": "nesterov"}
CONFIGS = {
    "nesterov 0.7/0.9, H 25 (DiLoCo)": NESTEROV,
    "the same, keep best round": {**NESTEROV, "keep": "best"},
    "sgd lr 1 (FedAvg)": {"outer": "sgd"},
    "nesterov lr 0.3, momentum 0.5": {**NESTEROV, "outer_lr": 0.3, "outer_momentum": 0.5},
    "nesterov, H 10, 20 rounds": {**NESTEROV, "sync_every": 10, "rounds": 20},
    "nesterov, 4 shards": {**NESTEROV, "shards": 4},
    "auto (the default)": {"outer": "auto"},
}


def push_sklearn(store_url: str) -> list[tuple[str, dict]]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_breast_cancer, load_diabetes, load_wine

    from tensorturn import data
    from tensorturn.store import open_store

    store = open_store(store_url)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, loader, task in (("cancer", load_breast_cancer, "classification"),
                                   ("wine", load_wine, "classification"),
                                   ("diabetes", load_diabetes, "regression")):
            x, y = loader(return_X_y=True)
            if task == "regression":
                y = (y - y.mean()) / y.std()
            cols = {f"f{i}": x[:, i].astype(np.float32) for i in range(x.shape[1])}
            path = Path(tmp) / f"{name}.parquet"
            pq.write_table(pa.table({**cols, "y": y.astype(np.float32 if task == "regression" else np.int64)}), path)
            data.push(store, str(path), name, label="y", task=task, seed=0)
            out.append((name, {"recipe": "tabular", "recipe_options": {"dataset": name}}))
    return [*out, ("digits", {"recipe": "digits-mlp"})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    from tensorturn import config
    from tensorturn.local import LocalPool

    rows = []
    with tempfile.TemporaryDirectory(prefix="tt-defaults-") as tmp:
        store = (Path(tmp) / "store").as_uri()
        config.use(config.current().with_(store_url=store, cache_dir=str(Path(tmp) / "cache")))
        jobs = push_sklearn(store)
        with LocalPool(2, store, workdir=Path(tmp) / "pool") as pool:
            for dataset, job in jobs:
                for label, overrides in CONFIGS.items():
                    for seed in seeds:
                        spec = {"mode": "fused", "rounds": 8, "shards": 8, "sync_every": 25, **job,
                                **overrides, "seed": seed}
                        doc = run_job(pool, store, **spec)
                        m = doc["metrics"]
                        row = {"dataset": dataset, "config": label, "seed": seed,
                               "test_loss": m["test_loss"], "test_accuracy": m.get("test_accuracy"),
                               "test_mae": m.get("test_mae"), "kept_round": m.get("kept_round"),
                               "val_loss_by_round": [r["val_loss"] for r in doc["rounds"]]}
                        rows.append(row)
                        acc = f"{row['test_accuracy']:.4f}" if row["test_accuracy"] is not None else "   -  "
                        print(f"{dataset:9s} {label:34s} seed {seed}  test loss {row['test_loss']:.4f}  "
                              f"acc {acc}  kept r{row['kept_round']}", flush=True)
    (HERE / "defaults.json").write_text(json.dumps({"machine": machine(), "configs": CONFIGS,
                                                    "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
