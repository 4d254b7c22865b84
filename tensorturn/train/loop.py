"""The inner loop shared by both modes: a fixed number of optimizer steps on given rows."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tensorturn import config
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


class Throttle:
    """Stretch a loop to ``factor`` × its compute time by sleeping, without burning CPU.

    Sleeps are paced against a deadline — after each step, sleep until ``factor × (compute time
    so far)`` has passed since the loop began — rather than ``(factor − 1) × step`` after every
    step: short steps would otherwise pay the sleep's own overshoot each time (a 1 ms step with a
    2 ms sleep ran ~5.7× slower instead of 3×). Sleeps shorter than ``min_sleep`` are deferred.
    """

    def __init__(self, factor: float, min_sleep: float = 0.02):
        self.factor, self.min_sleep = factor, min_sleep
        self.start = time.perf_counter()
        self.compute = 0.0

    def step(self, seconds: float) -> None:
        """Account one step of ``seconds`` of work; sleep if the loop is ahead of its pace."""
        self.compute += seconds
        ahead = self.start + self.factor * self.compute - time.perf_counter()
        if ahead >= self.min_sleep:
            time.sleep(ahead)


class SimulatedStep:
    """Make every step of a loop take ``seconds`` of wall time, sleeping out what its compute
    did not use (benchmarks and tests: ``TENSORTURN_SIM_STEP_S`` gives an agent a speed of its
    own, so many agents of different speeds share two cores without competing for them).

    Paced against a deadline from the loop's start — step i ends at start + i × seconds — so a
    sleep's overshoot is paid back by the next one; a step whose compute takes longer than
    ``seconds`` simply runs late (the figure is then the compute's, not the emulated one).
    """

    def __init__(self, seconds: float, clock=time.perf_counter, sleep=time.sleep):
        self.seconds, self.clock, self.sleep = seconds, clock, sleep
        self.start = clock()
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        ahead = self.start + self.steps * self.seconds - self.clock()
        if ahead > 0:
            self.sleep(ahead)


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
    # benchmarks/tests only: TENSORTURN_SLOWDOWN emulates a slower machine on the same host
    slowdown = config.current().slowdown
    throttle = Throttle(slowdown) if slowdown > 1 else None
    sim_step = config.current().sim_step_s
    simulated = SimulatedStep(sim_step) if sim_step > 0 else None
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
        if throttle is not None:
            throttle.step(time.perf_counter() - t0)
        if simulated is not None:
            simulated.step()
        if on_step is not None:
            on_step(step + 1, value)
    return total / max(steps, 1), samples
