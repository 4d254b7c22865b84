"""The inner loop shared by both modes: a fixed number of optimizer steps on given rows."""

from __future__ import annotations

import hashlib
import math
import os
import time

import torch
from torch import nn

from .device import autocast
from .recipes import Recipe


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (Python's ``hash`` differs between processes)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def set_threads(n: int) -> None:
    """CPU threads for torch in this process; CPU results depend on it, so runs record it."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


# Benchmark/test-only: a factor ≥ 1 that makes this process train that many times slower (it
# sleeps (f−1)× each step's time), to emulate a slow machine beside fast ones on one host.
SLOWDOWN = float(os.environ.get("TENSORTURN_SLOWDOWN", "1"))


def train_steps(recipe: Recipe, model: nn.Module, optimizer: torch.optim.Optimizer,
                x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, steps: int,
                batch_size: int, seed: int, device: torch.device,
                on_step=None) -> tuple[float, int]:
    """Train ``steps`` minibatches drawn epoch by epoch (reshuffled) from ``rows`` of (x, y).

    Deterministic for a given seed, thread count and device. Returns (mean loss, samples seen).
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout and other in-model randomness
    model.train()
    order = rows[torch.randperm(len(rows), generator=gen)]
    pos, total, samples = 0, 0.0, 0
    for step in range(steps):
        t0 = time.perf_counter()
        if pos + batch_size > len(order):
            order = rows[torch.randperm(len(rows), generator=gen)]
            pos = 0
        batch = order[pos:pos + batch_size]
        pos += batch_size
        xb, yb = x[batch].to(device), y[batch].to(device)
        with autocast(device):
            loss = recipe.loss(model, xb, yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"non-finite training loss ({value} at step {step})")
        total += value
        samples += len(batch)
        if SLOWDOWN > 1:
            time.sleep((SLOWDOWN - 1) * (time.perf_counter() - t0))
        if on_step is not None:
            on_step(step + 1, value)
    return total / max(steps, 1), samples
