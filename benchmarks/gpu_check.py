"""One fused round on this machine's GPU: which device a task picks, the precision it trains in,
samples/s and peak device memory — a quick check that the device path works where a GPU exists.

    python benchmarks/gpu_check.py [--recipe charlm] [--precision auto] [--steps 20]

It runs the real pieces in this process, as an agent would: the device an agent picks
(``device.pick_device``), one shard's inner steps (``diloco.train_replica``, autocast in
``--precision``), and the round's streaming outer step and validation on a file store, with
``torch.cuda.max_memory_allocated`` read after each. With ``--pool N`` it then runs one fused
run of the recipe on an embedded pool of N real agents (``redis-server`` on the PATH): what the
agents publish about the device (``workers``: device, VRAM) and the run's result. Without CUDA it
says so and exits 0 (on a CPU it can still run with ``--cpu``, to try the script).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="charlm")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe option (JSON values), e.g. n_layer=8")
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU when there is no CUDA device")
    ap.add_argument("--pool", type=int, default=0, metavar="N",
                    help="then one fused run of 2 rounds on an embedded pool of N agents")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print(json.dumps({"cuda": False, "note": "no CUDA device here; nothing to check (--cpu runs it anyway)"}))
        return
    from tensorturn.trust import PoolKey

    os.environ.setdefault("TENSORTURN_POOL_KEY", PoolKey.generate().text())  # before settings are read
    from tensorturn import layout
    from tensorturn.modes.fused.outer import outer_round
    from tensorturn.modes.fused.weights import global_bytes
    from tensorturn.recipes import resolve
    from tensorturn.recipes.base import load_splits
    from tensorturn.spec import RunSpec
    from tensorturn.state.manifest import save_spec
    from tensorturn.store import seals
    from tensorturn.store.objects import open_store
    from tensorturn.store.tensors import delta_bytes
    from tensorturn.train.device import pick_device
    from tensorturn.train.diloco import initial_state, train_replica
    options = {k: json.loads(v) if v[:1] in "0123456789[{-tfn" else v
               for k, v in (o.split("=", 1) for o in args.option)}
    device = pick_device()
    recipe = resolve(args.recipe, options)
    batch = args.batch_size or recipe.batch_size
    splits = load_splits(recipe)
    theta = initial_state(recipe, 0)
    params = sum(v.numel() for v in theta.values())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    delta, loss, samples = train_replica(recipe, theta, splits.x_train, splits.y_train,
                                         torch.arange(len(splits.y_train)), args.steps, recipe.lr, batch,
                                         seed=1, device=device, precision=args.precision)
    if cuda:
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    train_peak = torch.cuda.max_memory_allocated() if cuda else None
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(Path(tmp).as_uri())
        spec = RunSpec.create(mode="fused", recipe=args.recipe, store_url=store.url, recipe_options=options,
                              rounds=1, shards=1, sync_every=args.steps, batch_size=batch, outer="sgd",
                              eval_batches=4, precision=args.precision)
        save_spec(store, spec)
        seals.put_bytes(store, layout.key("global", spec.run_id, 0), global_bytes(spec, recipe, theta))
        seals.put_bytes(store, layout.key("shard", spec.run_id, 0, 0), delta_bytes(
            delta, "fp32", {"samples": str(samples), "loss": repr(loss), "bytes_down": f"{0:015d}"}))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        scratch = Path(tmp) / "scratch"
        scratch.mkdir()
        figures = outer_round(spec, store, 0, scratch)
        outer_s = time.perf_counter() - t0
    report = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else None,
        "precision": args.precision, "recipe": args.recipe, "parameters": params, "batch_size": batch,
        "steps": args.steps, "samples_per_s": round(samples / train_s, 1), "train_loss": round(loss, 4),
        "train_peak_vram_bytes": train_peak,
        "outer_step_s": round(outer_s, 2), "val_loss": figures["val_loss"],
        "outer_peak_vram_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    print(json.dumps(report, indent=2), flush=True)
    if args.pool:
        print(json.dumps(pool_run(args, options), indent=2))


def pool_run(args: argparse.Namespace, options: dict) -> dict:
    """One fused run on an embedded pool of real agents: what they publish and what it gives."""
    import subprocess

    from tensorturn import runs
    from tensorturn.pool.embedded import LocalPool

    with tempfile.TemporaryDirectory() as tmp, LocalPool(args.pool, (Path(tmp) / "store").as_uri(),
                                                          workdir=Path(tmp) / "pool") as pool:
        agents = [{k: w.get(k) for k in ("name", "state", "verified", "device", "device_name", "vram_gb",
                                         "device_memory_gb", "gpu_memory_used_gb")}
                  for w in runs.workers(pool.broker_url)]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "tensorturn", "run", "--broker", pool.broker_url, "--store",
             str(Path(tmp) / "store"), "--recipe", args.recipe, "--rounds", "2", "--sync-every",
             str(args.steps), "--precision", args.precision, "--json",
             *(f"--recipe-option={o}" for o in args.option)],
            capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 and not proc.stdout.strip():
            return {"pool": args.pool, "agents": agents, "error": proc.stderr[-2000:]}
        doc = json.loads(proc.stdout)
        after = {w["name"]: w.get("gpu_memory_used_gb") for w in runs.workers(pool.broker_url)}
    return {"pool": args.pool, "agents": agents, "state": doc["state"], "error": doc.get("error"),
            "wall_s": round(wall, 1), "metrics": doc.get("metrics"),
            "rounds": [{k: r.get(k) for k in ("round", "loss", "val_loss", "samples")} for r in doc.get("rounds", [])],
            "workers_of_attempts": sorted({a["worker"] for a in doc.get("attempts", [])}),
            "gpu_memory_used_after_gb": after}


if __name__ == "__main__":
    main()
