"""One rank of the per-step all-reduce baseline of ``benchmarks/wan.py``: PyTorch
DistributedDataParallel over gloo, run by ``wan.py`` inside an agent's network namespace.

Every step emulates ``--sim-step`` seconds of compute (a sleep, as ``TENSORTURN_SIM_STEP_S`` does
for TensorTurn's agents), then the backward pass all-reduces the gradients across the links.
Writes a JSON line: wall seconds, steps, and (rank 0) the validation loss after training.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tensorturn.diloco import initial_state
from tensorturn.recipes import resolve
from tensorturn.training import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, kind in (("rank", int), ("world", int), ("master", str), ("steps", int),
                       ("sim-step", float), ("seed", int), ("recipe", str), ("out", str)):
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
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        batch = rows[torch.randint(len(rows), (recipe.batch_size,), generator=gen)]
        time.sleep(args.sim_step)  # the emulated compute of a step
        opt.zero_grad(set_to_none=True)
        recipe.loss(model, x[batch], y[batch]).backward()  # gradients all-reduced here
        opt.step()
    dist.barrier()
    wall = time.perf_counter() - t0
    out = {"rank": args.rank, "wall_s": wall, "steps": args.steps}
    if args.rank == 0:
        out["val"] = recipe.evaluate_split(model.module, "val", device, 8)
    with open(args.out, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
