"""Recipes that never finish a hook, for check-recipe's limit: ``LoopsInLoss`` loops in pure Python
catching everything (no exception an alarm could raise stops it), ``StuckInEvaluate`` is stuck
inside one C call that never returns to the interpreter (no signal handler ever runs). Only ending
their process stops them. Each writes its process id to ``TT_LOOP_PID_FILE`` first."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tensorturn.recipes import Recipe


def _started() -> None:
    Path(os.environ["TT_LOOP_PID_FILE"]).write_text(str(os.getpid()))


class Tiny(Recipe):
    """Four features, two classes, 48 rows: every other hook answers in milliseconds."""

    name = "tiny"

    def raw_data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(48, 4, generator=g)
        y = (x[:, 0] > 0).long()
        return x[:32], y[:32], x[32:40], y[32:40], x[40:], y[40:]

    def default_config(self) -> dict[str, Any]:
        return {}

    def model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Linear(4, 2)


class LoopsInLoss(Tiny):
    def loss(self, model, x, y):
        _started()
        while True:
            try:
                pass
            except BaseException:  # noqa: BLE001, S110 - on purpose: nothing stops it but a kill
                pass


class StuckInEvaluate(Tiny):
    def evaluate(self, model, x, y):
        _started()
        any(itertools.repeat(False))  # a C loop that checks for no signal
        return super().evaluate(model, x, y)
