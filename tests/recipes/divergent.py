"""A recipe for tests: digits-mlp whose ensemble members are broken on purpose, each in its own
way, by its member index (``fault_of`` below); the other members are sound. Members are drawn
with the default configuration, so only the fault tells them apart."""

from __future__ import annotations

import torch

from tensorturn.recipes.digits import DigitsMLP

# member index → what goes wrong with it
FAULTS = {1: "diverges", 2: "evaluates_nan", 3: "nan_weights"}


class Divergent(DigitsMLP):
    """Member 1 trains at 3300× the recipe's learning rate (9.9: it diverges, with a finite
    loss all along); member 2 evaluates to NaN; member 3 keeps a NaN in a buffer its forward pass
    never reads (its weights are not finite, its training is normal)."""

    def member_config(self, member, rng):
        fault = FAULTS.get(member, "")
        return {**self.default_config(), "fault": fault,
                "lr_scale": 3300.0 if fault == "diverges" else 1.0}

    def model(self, config):
        model = super().model(config)
        model.fault = config.get("fault", "")
        if model.fault == "nan_weights":
            model.register_buffer("spare", torch.tensor(float("nan")))
        return model

    def predict(self, model, x):
        out = super().predict(model, x)
        return out * float("nan") if getattr(model, "fault", "") == "evaluates_nan" else out
