"""Which device a task trains on, and mixed precision where it helps."""

from __future__ import annotations

import contextlib

import torch

from tensorturn import config


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


def seed_global_generators(value: int) -> None:
    """Seed torch's global generators — the CPU's, and CUDA's and MPS's where this machine has
    them — as ``torch.manual_seed`` does, without its cost on a machine that has neither: there
    it queues a seeding for CUDA, and for other accelerators, each with a formatted stack trace
    (1.7 ms a task on this project's CPU runs, whose tasks are 50 ms)."""
    torch.random.default_generator.manual_seed(value)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(value)
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        torch.mps.manual_seed(value)


PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def autocast(device: torch.device, precision: str = "auto"):
    """The mixed precision a task trains in: ``auto`` is bf16 on CUDA devices that support it and
    fp32 elsewhere (CPU results stay exact); ``bf16``/``fp16`` autocast on any device (bf16
    autocast runs on CPUs too); ``fp32`` none."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16 needs its gradients scaled (they underflow otherwise); bf16 and fp32 do not."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
