"""One replica group of ``benchmarks/torchft_compare.py``: torchft's DiLoCo on a TensorTurn recipe.

A replica group of one process: its own TCPStore, a torchft ``Manager`` (gloo) that joins the
lighthouse, and ``torchft.local_sgd.DiLoCo`` around an AdamW inner optimizer, syncing every
``--sync-every`` steps (outer SGD with Nesterov momentum, lr 0.7 — DiLoCo's). It trains shard
``--replica`` of ``--replicas`` of the recipe's training split (TensorTurn's own
``recipe.shard_data``), with the recipe's batch size and learning rate, from the same θ_0 as a
TensorTurn run of the same seed, for ``--rounds`` syncs. Writes JSON to ``--out``: when its
first step began and its last sync ended (``time.time()``), steps, and the final loss.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from tensorturn.recipes import resolve
from tensorturn.train.diloco import initial_state
from tensorturn.train.loop import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testbed/ beside the package, not installed
from testbed.emulate import SimulatedStep  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, kind in (("replica", int), ("replicas", int), ("lighthouse", str), ("store-port", int),
                       ("rounds", int), ("sync-every", int), ("seed", int), ("recipe", str), ("out", str)):
        ap.add_argument(f"--{name}", type=kind, required=True)
    ap.add_argument("--sim-step-s", type=float, default=0.0,
                    help="each step lasts this long, sleeping out what its compute left (TensorTurn's "
                         "TESTBED_SIM_STEP_S, the same pacing): a machine of its own")
    args = ap.parse_args()
    torch.set_num_threads(1)
    recipe = resolve(args.recipe, {})
    device = torch.device("cpu")
    model = load_model(recipe, initial_state(recipe, args.seed), recipe.default_config(), device)
    inner = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = TCPStore("localhost", args.store_port, is_master=True, wait_for_workers=False)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=args.replicas,
                      use_async_quorum=False, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"replica{args.replica}", store_addr="localhost", store_port=args.store_port,
                      rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname="localhost",
                      timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=30))
    x, y, rows = recipe.shard_data(args.replica, args.replicas, args.seed)
    gen = torch.Generator().manual_seed(args.seed + args.replica)
    order, pos = rows[torch.randperm(len(rows), generator=gen)], 0
    steps, loss = args.rounds * args.sync_every, float("nan")
    started, cpu = time.time(), time.process_time()
    pace: list[SimulatedStep | None] = [None]
    if args.sim_step_s > 0:  # registered before DiLoCo's own hook: a step is paced before its
        # sync, as in TensorTurn's loop (its steps paced, then its pseudo-gradient stored)
        def paced(*_: object) -> None:
            assert pace[0] is not None
            pace[0].step()
            if pace[0].steps == args.sync_every:  # the round's last step: its sync comes next
                pace[0] = None

        inner.register_step_post_hook(paced)
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every, pin_memory=False):
        for _ in range(steps):
            if args.sim_step_s > 0 and pace[0] is None:  # a round's pacing starts with its first step
                pace[0] = SimulatedStep(args.sim_step_s)
            if pos + recipe.batch_size > len(order):
                order, pos = rows[torch.randperm(len(rows), generator=gen)], 0
            batch = order[pos:pos + recipe.batch_size]
            pos += recipe.batch_size
            inner.zero_grad(set_to_none=True)
            value = recipe.loss(model, x[batch], y[batch])
            value.backward()
            inner.step()  # DiLoCo's hook syncs every sync_every steps
            loss = float(value.detach())
    ended, cpu = time.time(), time.process_time() - cpu
    with open(args.out, "w") as f:
        json.dump({"replica": args.replica, "started": started, "ended": ended, "steps": steps,
                   "syncs": manager.current_step(), "loss": loss, "cpu_s": cpu}, f)
    manager.shutdown(wait=False)
    del store


if __name__ == "__main__":
    main()
