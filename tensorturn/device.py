"""Which device a task trains on, and mixed precision where it helps."""

from __future__ import annotations

import contextlib

import torch

from . import config


def pick_device() -> torch.device:
    """CUDA if present, else Apple MPS, else CPU; ``TENSORTURN_DEVICE`` overrides."""
    forced = config.current().device
    if forced:
        return torch.device(forced)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def autocast(device: torch.device):
    """bf16 autocast on CUDA devices that support it; a no-op elsewhere (CPU results stay exact)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
