"""Fused mode: data-sharded training merged every H steps, DiLoCo-style, into one model.

The plug-in (this module, no torch) holds the options and what the CLI and client need; the
Celery tasks — shard, outer step — are in :mod:`.tasks`, the math in :mod:`tensorturn.train.diloco`.

Guarantees:

* Shards are *virtual replicas*: the result depends on (S, H, seed, threads) only — not on which
  machines, or how many, ran the shards.
* A round is a Celery chord: header = one task per shard — a *slot*, bound to a shard by the
  first worker that runs it, which takes a shard it trained before where it can (its chunks are
  cached there) — body = the outer step. Every task goes
  through the attempt protocol (:mod:`tensorturn.tasks.attempt`): outputs sit at fixed keys, a
  duplicate or late attempt changes nothing, the outer step checks completeness in the store
  (the chord counter alone is not proof), and the next round is queued once.
* The inner optimizer state is reset each round: the result stays independent of where a shard
  ran, and nothing but weights moves.
* Downloads are as small as the run allows: θ_0 is rebuilt from the seed, a machine reuses the θ
  it holds, and with ``--codec fp16|int8`` a machine holding θ_{r−1} fetches only the compressed
  move θ_r − θ_{r−1} (error feedback). Every rebuilt θ is checked against the stored file's sha256.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorturn import layout
from tensorturn.modes import ModeBase
from tensorturn.spec import FINISHED, ModeOptions, Workload, check_bounds, options_json
from tensorturn.state.live import WIDTH, fit

if TYPE_CHECKING:
    from tensorturn.recipes import Recipe
    from tensorturn.spec import RunSpec

OUTERS = ("auto", "nesterov", "sgd")
CODECS = ("fp32", "fp16", "int8")
KEEPS = ("last", "best")
SYNCS = ("rounds", "backup", "async")
AUTO_NESTEROV_EPOCHS = 1.0  # --outer auto: Nesterov when a shard's round covers its rows at most this often
# a shard going over its rows more often than this per round, with --shards or --sync-every
# given, is warned about (little data)
EPOCHS_PER_ROUND_WARNING = 4.0
# Defaults scaled to the data, when --shards / --sync-every are not given (benchmarks/defaults.py
# --scaled): fewer shards and H than 8 × 25 on little data matched or beat them on digits and the
# small tables, 2-4× faster; a cap of 4 passes beat 1 and 2, which undertrain the smallest sets.
MAX_SHARDS = 8           # large data: 8 shards, so the math does not depend on the pool
ROWS_PER_SHARD = 700     # one shard per this many training rows, 2 to MAX_SHARDS
MAX_SYNC_EVERY = 25      # H on large data
EPOCHS_PER_ROUND = EPOCHS_PER_ROUND_WARNING  # H is cut so a shard goes over its rows at most this often


@dataclass
class FusedOptions(ModeOptions):
    HELP = """
    rounds          outer rounds
    sync_every      inner steps per shard between weight averages (H); unset: 25, fewer when shards hold few rows
    shards          virtual replicas per round (more than machines lets fast ones take more); unset: 1 per 700 rows, 2-8
    outer           outer optimizer: nesterov (DiLoCo), sgd (lr 1: FedAvg), auto (sgd if shards see rows >1× a round)
    outer_lr        outer learning rate (default 0.7 for nesterov, 1.0 for sgd)
    outer_momentum  outer momentum
    codec           encoding of pseudo-gradients up and weight updates down (int8: ~3.9× fewer bytes)
    keep            the result: the last round's weights, or those of the round with the lowest validation loss
    sync            rounds: a barrier per round; backup: and copies of its stragglers; async: no barrier (see README)
    """
    CHOICES = {"outer": OUTERS, "codec": CODECS, "keep": KEEPS, "sync": SYNCS}

    rounds: int = 8
    sync_every: int | None = None       # None: from the data at start (see fill_from_data)
    shards: int | None = None           # None: from the data at start
    outer: str = "auto"                 # decided at start from the data (see resolve_outer)
    outer_lr: float | None = None       # None: 0.7 for nesterov (DiLoCo), 1.0 for sgd (FedAvg)
    outer_momentum: float = 0.9
    codec: str = "fp32"
    keep: str = "last"
    sync: str = "rounds"
    # a pseudo-gradient whose norm exceeds this multiple of the weights' norm is rejected
    max_update_ratio: float = 10.0
    # derived at start: sha256 of θ_0's model file, so machines can rebuild θ_0 from the seed
    init_sha256: str = ""
    # which of shards and sync_every TensorTurn chose (from the data, or a command's own
    # defaults) rather than the user: a run warns about its shards' passes only for the user's
    chosen: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.outer_lr is None and self.outer != "auto":
            self.outer_lr = 0.7 if self.outer == "nesterov" else 1.0

    def fill_from_data(self, train_rows: int, samples_per_step: int) -> None:
        """Choose the shards and H the user did not give, from the data: :func:`default_shards`,
        then :func:`default_sync_every` for those shards. Done once, at start, and stored in the
        spec, so every machine and ``resume`` use the same values (the math never depends on
        the pool)."""
        if self.shards is None:
            self.shards = default_shards(train_rows)
            self.chosen.append("shards")
        if self.sync_every is None:
            self.sync_every = default_sync_every(train_rows, self.shards, samples_per_step)
            self.chosen.append("sync_every")

    def resolve_outer(self, epochs_per_round: float) -> str | None:
        """Decide ``auto``: DiLoCo's Nesterov outer step (lr 0.7, momentum 0.9) when a shard's
        round covers its rows at most once — large data, as in the paper and on ``charlm`` — and
        plain averaging (FedAvg: sgd, lr 1) when it goes over them again and again: on small
        data the Nesterov step overshoots (benchmarks/defaults.py: test NLL 0.34 vs 0.15 on digits,
        0.57 vs 0.05 on breast cancer). Returns a sentence on what was chosen, for the run."""
        if self.outer != "auto":
            return None
        self.outer = "nesterov" if epochs_per_round <= AUTO_NESTEROV_EPOCHS else "sgd"
        if self.outer_lr is None:
            self.outer_lr = 0.7 if self.outer == "nesterov" else 1.0
        if self.outer == "nesterov":
            return None
        return (f"outer optimizer sgd (FedAvg), chosen by --outer auto: each shard goes over its "
                f"rows {epochs_per_round:.1f} times a round, where DiLoCo's Nesterov step overshoots "
                f"(--outer nesterov forces it)")

    def validate(self) -> None:
        super().validate()
        check_bounds({"rounds": self.rounds, "sync_every": self.sync_every, "shards": self.shards,
                      "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum})

    def workload(self) -> Workload:
        """A task per shard and round; ``--sync async`` queues them all at once. Shards and H
        left to the data count at the most the data can give them (MAX_SHARDS, MAX_SYNC_EVERY)."""
        shards = self.shards or MAX_SHARDS
        tasks = (self.rounds * shards, "--rounds × --shards")
        queued = (tasks[0], "--sync async: " + tasks[1]) if self.sync == "async" else (shards, "--shards")
        return Workload(tasks=tasks, queued=queued,
                        steps=(self.rounds * (self.sync_every or MAX_SYNC_EVERY),
                               "--rounds × --sync-every"))


class StartedOptions(FusedOptions):
    """What :class:`FusedOptions` are once the run has started (:meth:`~FusedOptions.fill_from_data`):
    the shards and H are numbers. A type for the tasks, never made."""

    shards: int
    sync_every: int


def default_shards(train_rows: int) -> int:
    """Shards when the user gives none: one per ~700 training rows, 2 to 8. On little data many
    small shards each gone over many times a round cost accuracy (benchmarks/distill.py,
    benchmarks/defaults.py); on large data 8 fixed shards keep the math independent of the pool."""
    return max(2, min(MAX_SHARDS, train_rows // ROWS_PER_SHARD))


def default_sync_every(train_rows: int, shards: int, samples_per_step: int,
                       epochs: float = EPOCHS_PER_ROUND) -> int:
    """H when the user gives none: 25, or fewer so that a shard goes over its rows at most
    ``epochs`` times a round (at least 1 step): the small sets of benchmarks/defaults.py went
    over their rows 10-30 times a round with H 25."""
    rows = train_rows / max(shards, 1)
    return max(1, min(MAX_SYNC_EVERY, int(epochs * rows // max(samples_per_step, 1))))


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
            line = f"round {r['round']} ({r['round'] + 1} of {total})  loss {r['loss']:.4f}"
            if r.get("val_loss") is not None:
                line += f"  val_loss {r['val_loss']:.4f}"
            if r.get("val_accuracy") is not None:
                line += f"  val_acc {r['val_accuracy']:.3f}"
            if r.get("max_staleness") is not None:  # --sync async: how stale its updates were
                line += f"  staleness ≤{r['max_staleness']}"
            events.append((f"r{r['round']}", line))
        return len(events), total, events

    def live_line(self, doc: dict[str, Any], width: int = WIDTH) -> str:
        """The round being trained (shards done, inner steps) and any outer step running, with
        its phase: ``round 3 (4 of 8): 5/8 shards, 130/200 steps; round 2 evaluating on w1 (12s)``."""
        now = time.time()
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

    def final_key(self, run_id: str) -> str:
        return layout.key("final_model", run_id)


MODE = Fused("fused", FusedOptions, "rounds", "tensorturn.modes.fused.tasks")
