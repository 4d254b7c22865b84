"""Fused defaults on small data: which outer optimizer, sync interval and result (last or best
round) give the lowest test loss on small tabular sets and digits? (What `--outer auto` decides
from: DiLoCo's Nesterov outer step when shards see their rows at most once a round, else FedAvg.)

Pushes three of scikit-learn's bundled datasets as tables (breast cancer: 569 rows, 2 classes;
wine: 178 rows, 3 classes; diabetes: 442 rows, regression), then runs the built-in `tabular`
recipe on each, and `digits-mlp`, with each configuration below on one embedded pool of 2
agents. Figures are test loss (NLL, or MSE for diabetes) and accuracy — deterministic for a seed
(CPU, one thread per task), so the machine's load changes the time, not the numbers.

    python benchmarks/defaults.py [--seeds 0]

``--scaled`` asks the next question: which shards and H should a run get when the user gives
none? It compares the fixed 8 shards × H 25 with defaults scaled to the data — shards one per
700 training rows (2 to 8), H at most 25 and small enough that a shard goes over its rows at
most E times a round, for each E of ``--epochs`` — on `digits-mlp` (the quick start), the README's
wine example recipe, the diabetes regression recipe of the tests, and `tabular` over pushed
tables (breast cancer and diabetes as Parquet, wine as a CSV with text labels). Every run keeps
the last round; the test figures of the round with the lowest validation loss (what `--keep
best` would keep) are computed from the stored weights, so one run answers both. Written to
``defaults_scaled.json``.

    python benchmarks/defaults.py --scaled [--seeds 0] [--epochs 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import RESULTS, machine, run_job  # noqa: E402

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
    from tensorturn.store.objects import open_store

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


def push_wine_csv(store_url: str) -> tuple[str, dict]:
    """Wine as a user would push it: a CSV whose label column holds class names."""
    import csv

    from sklearn.datasets import load_wine

    from tensorturn import data
    from tensorturn.store.objects import open_store

    wine = load_wine()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "wine.csv"
        with path.open("w", newline="") as f:
            out = csv.writer(f)
            out.writerow([*wine.feature_names, "cultivar"])
            for x, y in zip(wine.data, wine.target):
                out.writerow([*(f"{v:g}" for v in x), wine.target_names[y]])
        data.push(open_store(store_url), str(path), "winecsv", label="cultivar", seed=0)
    return "wine csv", {"recipe": "tabular", "recipe_options": {"dataset": "winecsv"}}


def scaled_plan(recipe, epochs: float | None) -> dict[str, int]:
    """The shards and H a run gets: fixed 8 × 25 (``epochs`` None), or scaled to the data."""
    from tensorturn.modes.fused import default_shards, default_sync_every

    if epochs is None:
        return {"shards": 8, "sync_every": 25}
    rows = recipe.train_rows()
    shards = default_shards(rows)
    return {"shards": shards, "sync_every": default_sync_every(rows, shards, recipe.batch_size, epochs)}


def best_round_test(store_url: str, doc: dict) -> tuple[int, dict]:
    """The round with the lowest validation loss (``--keep best``'s rule) and its test figures."""
    import math

    from tensorturn import layout
    from tensorturn.recipes import recipe_of
    from tensorturn.spec import RunSpec
    from tensorturn.store.objects import open_store
    from tensorturn.store.tensors import from_bytes
    from tensorturn.train.device import pick_device
    from tensorturn.train.loop import load_model

    def loss(rec: dict) -> float:
        value = rec.get("val_loss")
        return value if value is not None and math.isfinite(value) else math.inf

    best = min(doc["rounds"], key=lambda rec: (loss(rec), -rec["round"]))["round"]
    spec = RunSpec.from_json(doc["spec"])
    recipe = recipe_of(spec)
    weights = open_store(store_url).get_bytes(layout.key("global", doc["run_id"], best + 1))
    device = pick_device()
    model = load_model(recipe, from_bytes(weights), recipe.default_config(), device)
    return best, recipe.evaluate_split(model, "test", device, None)


def r_squared(recipe, mse: float) -> float | None:
    """1 − MSE / variance of the test targets (regression), in the recipe's target units."""
    from tensorturn.recipes.base import load_splits

    if recipe.task != "regression":
        return None
    y = load_splits(recipe).y_test.double()
    return 1.0 - mse / float(((y - y.mean()) ** 2).mean())


def fig(k: dict) -> str:
    """A result's test loss and accuracy (classification) or R² (regression)."""
    if k["test_accuracy"] is not None:
        return f"loss {k['test_loss']:.4f} acc {k['test_accuracy']:.4f}"
    return f"loss {k['test_loss']:.4f} R² {k['test_r2']:.4f}"


def scaled(args: argparse.Namespace, seeds: list[int]) -> None:
    """Fixed 8 × 25 against defaults scaled to the data, each with the last and the best round."""
    from tensorturn import config, trust
    from tensorturn.modes.fused import EPOCHS_PER_ROUND
    from tensorturn.pool.embedded import LocalPool
    from tensorturn.recipes import resolve

    plans: dict[str, float | None] = {"fixed 8 × H 25 (before)": None}
    plans.update({f"scaled, ≤ {e:g} passes a round{' (default)' if e == EPOCHS_PER_ROUND else ''}": e
                  for e in (float(x) for x in args.epochs.split(","))})
    rows = []
    with tempfile.TemporaryDirectory(prefix="tt-defaults-") as tmp:
        store = (Path(tmp) / "store").as_uri()
        config.use(trust.with_allowed(config.current().with_(store_url=store, cache_dir=str(Path(tmp) / "cache")),
                                      ["regress:Diabetes", "wine_recipe:Wine"]))
        jobs = [job for job in push_sklearn(store) if job[0] != "wine"]  # wine: as a CSV below
        jobs += [push_wine_csv(store), ("wine recipe", {"recipe": "wine_recipe:Wine"}),
                 ("diabetes recipe", {"recipe": "regress:Diabetes"})]
        with LocalPool(args.agents, store, workdir=Path(tmp) / "pool") as pool:
            for dataset, job in jobs:
                recipe = resolve(job["recipe"], job.get("recipe_options", {}))
                done: dict[tuple[int, int, int], dict] = {}  # a plan that comes out the same runs once
                for label, epochs in plans.items():
                    plan = scaled_plan(recipe, epochs)
                    for seed in seeds:
                        same = done.get((plan["shards"], plan["sync_every"], seed))
                        if same is not None:
                            rows.append({**same, "plan": label})
                            print(f"{dataset:15s} {label:36s} the same as {same['plan']}", flush=True)
                            continue
                        t0 = time.perf_counter()
                        doc = run_job(pool, store, mode="fused", rounds=8, keep="last", **job, **plan,
                                      seed=seed)
                        wall = time.perf_counter() - t0
                        best, best_test = best_round_test(store, doc)
                        m = doc["metrics"]
                        row = {"dataset": dataset, "plan": label, "seed": seed, **plan,
                               "train_rows": recipe.train_rows(), "batch_size": recipe.batch_size,
                               "outer": doc["spec"]["options"]["outer"], "wall_s": round(wall, 2),
                               "last": {"test_loss": m["test_loss"], "test_accuracy": m.get("test_accuracy"),
                                        "test_r2": r_squared(recipe, m["test_loss"])},
                               "best": {"round": best, "test_loss": best_test["loss"],
                                        "test_accuracy": best_test.get("accuracy"),
                                        "test_r2": r_squared(recipe, best_test["loss"])},
                               "val_loss_by_round": [r["val_loss"] for r in doc["rounds"]]}
                        rows.append(row)
                        done[plan["shards"], plan["sync_every"], seed] = row

                        print(f"{dataset:15s} {label:36s} S {plan['shards']} H {plan['sync_every']:2d} seed {seed} "
                              f"{row['outer']:8s} last: {fig(row['last'])}  best r{best}: {fig(row['best'])}  "
                              f"{wall:5.1f}s", flush=True)
    (RESULTS / "defaults_scaled.json").write_text(json.dumps(
        {"machine": machine(), "agents": args.agents, "plans": plans, "results": rows}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--scaled", action="store_true", help="fixed against data-scaled shards and H")
    ap.add_argument("--epochs", default="1,2,4", help="--scaled: passes over a shard's rows a round")
    ap.add_argument("--agents", type=int, default=2, help="--scaled: local agents")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.scaled:
        for folder in ("tests/recipes", "examples"):  # the diabetes and wine recipes, for every agent
            os.environ["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(HERE.parent / folder), os.environ.get("PYTHONPATH", "")) if p)
            sys.path.insert(0, str(HERE.parent / folder))
        os.environ["TENSORTURN_ALLOW_RECIPES"] = "regress:*,wine_recipe:*"
        if not os.environ.get("TENSORTURN_POOL_KEY"):
            from tensorturn.trust import PoolKey

            os.environ["TENSORTURN_POOL_KEY"] = PoolKey.generate().text()
        scaled(args, seeds)
        return
    from tensorturn import config
    from tensorturn.pool.embedded import LocalPool

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
    (RESULTS / "defaults.json").write_text(json.dumps({"machine": machine(), "configs": CONFIGS,
                                                    "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
