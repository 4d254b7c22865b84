"""A recipe for tests: digits-mlp whose shard tasks wait at a gate, so a test can act on the store
between two steps of a run however loaded the machine is.

The gate is the file named by ``TT_GATE``: while it exists, a shard task waits in ``shard_data``
(before it fetches θ) if the gate's JSON lets it — ``{"shard": k}``: only shard k waits;
``{"after": glob, "store": folder}``: only once a file matching ``glob`` under ``folder`` was
written since the gate was closed (the store may hold earlier runs' files of that name).
The test removes the file to open the gate; agents read it at each call.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tensorturn.recipes.digits import DigitsMLP
from tensorturn.recipes.tabular import Tabular


def closed(k: int) -> bool:
    path = Path(os.environ.get("TT_GATE", "/nonexistent"))
    try:
        closed_at = path.stat().st_mtime_ns
        gate = json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        return False
    if "shard" in gate and int(gate["shard"]) != k:
        return False
    return "after" not in gate or any(_written_since(p, closed_at)
                                      for p in Path(gate["store"]).glob(gate["after"]))


def _written_since(path: Path, ns: int) -> bool:
    try:
        return path.stat().st_mtime_ns >= ns
    except FileNotFoundError:  # replaced meanwhile
        return False


class Gated(DigitsMLP):
    name = "gated"

    def shard_data(self, k, shards, seed):
        while closed(k):
            time.sleep(0.05)
        return super().shard_data(k, shards, seed)


class GatedTable(Tabular):
    """``tabular`` over a pushed dataset, built only while the gate lets it (with ``{"after":
    ...}``: a run's start builds it before its spec is stored, its tasks after): a test can change
    the store between a run's start and its tasks' first read of the dataset's index."""

    name = "gated-table"

    def __init__(self, dataset: str, version: int | None = None, hidden: list[int] | None = None):
        while closed(-1):
            time.sleep(0.05)
        super().__init__(dataset, version, hidden)


class FailsOnce(Gated):
    """Gated, and shard 1's first attempt fails (a URL with a password in its message, which
    must reach nobody unmasked): the file ``TT_FAIL_ONCE`` names records that it did, so the
    retry succeeds. A run with one failed attempt to show, however its tasks are scheduled."""

    name = "fails-once"

    def shard_data(self, k, shards, seed):
        marker = Path(os.environ.get("TT_FAIL_ONCE", "/nonexistent/marker"))
        if k == 1 and marker.parent.is_dir() and not marker.exists():
            marker.write_text("failed once")
            raise RuntimeError("shard 1 failed once on purpose (cache at redis://:hunter2-not-shown@10.9.8.7:6379/0)")
        return super().shard_data(k, shards, seed)
