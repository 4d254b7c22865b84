"""The inner loop shared by both modes: a fixed number of optimizer steps on given rows."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tensorturn import testbed_hooks
from tensorturn.train.device import autocast, grad_scaler, seed_global_generators
from tensorturn.train.seeding import derive_seed as derive_seed  # where the tasks and benchmarks take it from

if TYPE_CHECKING:  # the train layer sits below recipes: a recipe is handed in
    from tensorturn.recipes import Recipe

log = logging.getLogger(__name__)


def set_threads(n: int) -> None:
    """CPU threads for torch in this process; CPU results depend on it, so runs record it.

    At most this machine's cores: a run may ask for more than some machine of the pool has
    (``--threads-per-task`` is bounded at submit by a ceiling, not by the submitter's cores),
    and more threads than cores only slow a task down — or, by the thousand, crash it."""
    cores = os.cpu_count() or n
    if n > cores:
        log.warning("--threads-per-task %d is more than this machine's %d cores: using %d "
                    "(CPU results then match a machine of %d threads)", n, cores, cores, cores)
        n = cores
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def load_model(recipe: Recipe, state: dict[str, torch.Tensor], config: dict[str, Any],
               device: torch.device) -> nn.Module:
    """The recipe's model for ``config`` with ``state`` loaded, on ``device``."""
    model = recipe.model(config)
    model.load_state_dict(state)
    return model.to(device)


def train_steps(recipe: Recipe, model: nn.Module, optimizer: torch.optim.Optimizer,
                x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, steps: int,
                batch_size: int, seed: int, device: torch.device,
                on_step=None, precision: str = "auto", accumulate: int = 1) -> tuple[float, int]:
    """Train ``steps`` optimizer steps, each on ``accumulate`` minibatches of ``batch_size``
    drawn epoch by epoch (reshuffled) from ``rows`` of (x, y), in ``precision``
    (:func:`device.autocast`; fp16 with a gradient scaler).

    Deterministic for a given seed, thread count, device and precision. Returns (mean loss,
    samples seen).
    """
    gen = torch.Generator().manual_seed(seed)
    seed_global_generators(seed)  # dropout and other in-model randomness
    model.train()
    order = rows[torch.randperm(len(rows), generator=gen)]
    pos, total, samples = 0, 0.0, 0
    scaler = grad_scaler(device, precision)
    pace = testbed_hooks.step_pacer()  # None but where tests and benchmarks emulate a machine's speed
    for step in range(steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        value = 0.0
        for _ in range(accumulate):
            if pos + batch_size > len(order):
                order = rows[torch.randperm(len(rows), generator=gen)]
                pos = 0
            batch = order[pos:pos + batch_size]
            pos += batch_size
            xb, yb = x[batch].to(device), y[batch].to(device)
            with autocast(device, precision):
                loss = recipe.loss(model, xb, yb)
            if accumulate > 1:  # the mean over the micro-batches (exactly today's loss at 1)
                loss = loss / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
            value += float(loss.detach())
            samples += len(batch)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if not math.isfinite(value):
            raise FloatingPointError(f"non-finite training loss ({value} at step {step})")
        total += value
        if pace is not None:
            pace(time.perf_counter() - t0)
        if on_step is not None:
            on_step(step + 1, value)
    return total / max(steps, 1), samples
