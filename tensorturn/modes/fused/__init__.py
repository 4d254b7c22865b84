"""Fused mode: data-sharded training merged every H steps, DiLoCo-style, into one model.

The plug-in (this module, no torch) and its options (:mod:`.options`) are what the CLI and client
need. The rest, one job a module: :mod:`.weights` (the θ a shard trains from, and the one cache of
it), :mod:`.shard` (training a shard, storing its pseudo-gradient), :mod:`.outer` (the outer step,
streaming), :mod:`.finalize` (the run's end), :mod:`.backups` (copies of stragglers), and
:mod:`.sync` — one :class:`~.sync.base.SyncPolicy` class per ``--sync`` value (rounds, backup,
async). :mod:`.tasks` starts and resumes a run; the math is in :mod:`tensorturn.train.diloco`.

Guarantees:

* Shards are *virtual replicas*: the result depends on (S, H, seed, threads) only — not on which
  machines, or how many, ran the shards.
* A round is one task per shard — a *slot*, bound to a shard by the first worker that runs it,
  which takes a shard it trained before where it can (its chunks are cached there) — and the
  outer step, queued once by the shard task that finds the round's last shard stored. Every task
  goes through the attempt protocol (:mod:`tensorturn.tasks.attempt`): outputs sit at fixed
  keys, a duplicate or late attempt changes nothing, the outer step checks completeness in the
  store, and the next round is queued once.
* The inner optimizer state is reset each round: the result stays independent of where a shard
  ran, and nothing but weights moves.
* Downloads are as small as the run allows: θ_0 is rebuilt from the seed, a machine reuses the θ
  it holds, and with ``--codec fp16|int8|int4`` a machine holding θ_{r−1} fetches only the compressed
  move θ_r − θ_{r−1} (error feedback). Every rebuilt θ is checked against the stored file's sha256.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tensorturn.modes import ModeBase
from tensorturn.modes.fused.options import (
    AUTO_NESTEROV_EPOCHS,
    CODECS,
    EPOCHS_PER_ROUND,
    EPOCHS_PER_ROUND_WARNING,
    KEEPS,
    MAX_SHARDS,
    MAX_SYNC_EVERY,
    OUTERS,
    ROWS_PER_SHARD,
    SYNCS,
    FusedOptions,
    StartedOptions,
    default_shards,
    default_sync_every,
)
from tensorturn.spec import FINISHED, options_json
from tensorturn.state.live import WIDTH, figure, figures, fit

if TYPE_CHECKING:
    from tensorturn.recipes import Recipe
    from tensorturn.spec import RunSpec

__all__ = ["AUTO_NESTEROV_EPOCHS", "CODECS", "EPOCHS_PER_ROUND", "EPOCHS_PER_ROUND_WARNING", "KEEPS",
           "MAX_SHARDS", "MAX_SYNC_EVERY", "MODE", "OUTERS", "ROWS_PER_SHARD", "SYNCS", "Fused",
           "FusedOptions", "StartedOptions", "default_shards", "default_sync_every"]

class Fused(ModeBase):
    def model_configs(self, spec: "RunSpec", recipe: "Recipe") -> list[dict[str, Any]]:
        return [recipe.default_config()]

    def progress(self, doc: dict[str, Any]) -> tuple[int, int, list[tuple[str, str]]]:
        """A line per recorded round, in order: a round recorded before an earlier one (its
        outer step finished first: round r+1 trains while r's outer step evaluates) is held
        back until the earlier one is, or the run has finished."""
        total = int(options_json(doc.get("spec") or {}).get("rounds", 0))
        finished = doc.get("state") in FINISHED
        events = []
        for n, r in enumerate(sorted(doc.get("rounds", []), key=lambda rec: rec["round"])):
            if r["round"] != n and not finished:
                break
            line = f"round {r['round']} ({r['round'] + 1} of {total})  loss {figure(r['loss'])}"
            val = figures(r, "val_")  # the recipe's own metrics: a regression's in the user's units
            line += f"  {val}" if val else ""
            if r.get("max_staleness") is not None:  # --sync async: how stale its updates were
                line += f"  staleness ≤{r['max_staleness']}"
            events.append((f"r{r['round']}", fit(line)))  # 80 columns; `status` shows every metric
        return len(events), total, events

    def live_line(self, doc: dict[str, Any], width: int = WIDTH) -> str:
        """The round being trained (shards done, inner steps) and any outer step running, with
        its phase: ``round 3 (4 of 8): 5/8 shards, 130/200 steps; round 2 evaluating on w1 (12s)``."""
        now = doc.get("as_of") or time.time()  # the broker's clock, as the phases' times are
        parts = []
        live = doc.get("in_round")
        if live:
            total = int(options_json(doc.get("spec") or {}).get("rounds", 0))
            parts.append(f"round {live['round']} ({live['round'] + 1} of {total}): {live['shards_done']}/"
                         f"{live['shards']} shards, {live['steps_done']}/{live['steps_total']} steps")
        for o in doc.get("outer_steps") or []:
            parts.append(f"round {o['round']} {o['phase']} on {o['worker'].split('@')[0]} "
                         f"({max(now - o['since'], 0):.0f}s)")
        return fit("; ".join(parts), width)


MODE = Fused("fused", FusedOptions, "rounds", "tensorturn.modes.fused.tasks")
