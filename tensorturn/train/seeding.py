"""Seeds and shard rows: functions of the run and the shard id only, never of the machine.

A leaf module (torch only), so recipes, the training loop and the DiLoCo math can all use it.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (Python's ``hash`` differs between processes)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def shard_rows(n_train: int, shards: int, k: int, seed: int) -> torch.Tensor:
    """Training rows of shard k: a seeded permutation dealt round-robin over the shards."""
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(derive_seed(seed, "shards")))
    return perm[k::shards]
