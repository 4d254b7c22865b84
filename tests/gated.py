"""A recipe for tests: digits-mlp whose shard tasks wait at a gate, so a test can act on the store
between two steps of a run however loaded the machine is.

The gate is the file named by ``TT_GATE``: while it exists, a shard task waits in ``shard_data``
(before it fetches θ) if the gate's JSON lets it — ``{"shard": k}``: only shard k waits;
``{"after": glob, "store": folder}``: only once a file matching ``glob`` exists under ``folder``.
The test removes the file to open the gate; agents read it at each call.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tensorturn.recipes.digits import DigitsMLP


def closed(k: int) -> bool:
    try:
        gate = json.loads(Path(os.environ["TT_GATE"]).read_text() or "{}")
    except (KeyError, FileNotFoundError):
        return False
    if "shard" in gate and int(gate["shard"]) != k:
        return False
    return "after" not in gate or any(Path(gate["store"]).glob(gate["after"]))


class Gated(DigitsMLP):
    name = "gated"

    def shard_data(self, k, shards, seed):
        while closed(k):
            time.sleep(0.05)
        return super().shard_data(k, shards, seed)
