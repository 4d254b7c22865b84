"""One rank of the per-step all-reduce baseline of ``benchmarks/wan.py``: PyTorch
DistributedDataParallel over gloo, run by ``wan.py`` inside an agent's network namespace.

Every step emulates ``--sim-step`` seconds of compute, as ``TESTBED_SIM_STEP_S`` does for
TensorTurn's agents: it sleeps what the step's own compute (measured first, without the
all-reduce) leaves of it; the backward pass all-reduces the gradients across the links.
Every ``--eval-every`` steps rank 0 evaluates while the others wait, off the clock. Writes JSON:
wall seconds (training only), steps, and (rank 0) the validation loss curve and the final one.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tensorturn.recipes import resolve
from tensorturn.train.diloco import initial_state
from tensorturn.train.loop import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, kind in (("rank", int), ("world", int), ("master", str), ("steps", int),
                       ("sim-step", float), ("seed", int), ("recipe", str), ("out", str),
                       ("batch", int), ("eval-every", int)):
        parser.add_argument(f"--{name}", type=kind, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world)
    recipe = resolve(args.recipe, {})
    device = torch.device("cpu")
    model = DistributedDataParallel(load_model(recipe, initial_state(recipe, args.seed),
                                               recipe.default_config(), device))
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    x, y, rows = recipe.shard_data(args.rank, args.world, args.seed)
    gen = torch.Generator().manual_seed(args.seed + args.rank)

    def step() -> None:
        batch = rows[torch.randint(len(rows), (args.batch,), generator=gen)]
        opt.zero_grad(set_to_none=True)
        recipe.loss(model, x[batch], y[batch]).backward()  # gradients all-reduced here
        opt.step()

    own = []  # this machine's compute per step, without the all-reduce (not counted as training)
    with model.no_sync():
        for _ in range(5):
            t = time.perf_counter()
            batch = rows[torch.randint(len(rows), (args.batch,), generator=gen)]
            recipe.loss(model, x[batch], y[batch]).backward()
            own.append(time.perf_counter() - t)
    opt.zero_grad(set_to_none=True)  # no step was taken: the weights are untouched
    compute = sorted(own)[len(own) // 2]
    gen.manual_seed(args.seed + args.rank)  # the same batches as without the measurement
    curve = []

    def evaluate(done: int, wall: float) -> None:
        dist.barrier()
        if args.rank == 0:
            curve.append({"steps": done, "wall_s": wall,
                          "val_loss": recipe.evaluate_split(model.module, "val", device, 8)["loss"]})
        dist.barrier()

    dist.barrier()
    paused, t0 = 0.0, time.perf_counter()
    for done in range(1, args.steps + 1):
        time.sleep(max(0.0, args.sim_step - compute))  # the emulated compute of a step
        step()
        if done % args.eval_every == 0 or done == args.steps:
            p0 = time.perf_counter()
            evaluate(done, p0 - t0 - paused)
            paused += time.perf_counter() - p0
    dist.barrier()
    wall = time.perf_counter() - t0 - paused
    out = {"rank": args.rank, "wall_s": wall, "steps": args.steps, "own_step_s": compute}
    if args.rank == 0:
        out["curve"] = curve
        out["val"] = {"loss": curve[-1]["val_loss"]}
    with open(args.out, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
