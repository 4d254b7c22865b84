"""Fused mode: data-sharded training merged every H steps, DiLoCo-style, into one model.

The plug-in (this module, no torch) holds the options and what the CLI and client need; the
Celery tasks — shard, outer step — are in :mod:`.tasks`, the math in :mod:`tensorturn.diloco`.

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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import layout
from ...errors import SpecError
from ...spec import ModeOptions, check_positive, options_json
from .. import ModeBase

if TYPE_CHECKING:
    from ...recipes import Recipe
    from ...spec import RunSpec

OUTERS = ("auto", "nesterov", "sgd")
CODECS = ("fp32", "fp16", "int8")
KEEPS = ("last", "best")
SYNCS = ("rounds", "backup", "async")
AUTO_NESTEROV_EPOCHS = 1.0  # --outer auto: Nesterov when a shard's round covers its rows at most this often
# a shard going over its rows more often than this per round is warned about (little data)
EPOCHS_PER_ROUND_WARNING = 4.0


@dataclass
class FusedOptions(ModeOptions):
    HELP = """
    rounds          outer rounds
    sync_every      inner steps per shard between weight averages (H)
    shards          virtual replicas per round; more than machines lets faster ones take more
    outer           outer optimizer: nesterov (DiLoCo), sgd (lr 1: FedAvg), auto (sgd if shards see rows >1× a round)
    outer_lr        outer learning rate (default 0.7 for nesterov, 1.0 for sgd)
    outer_momentum  outer momentum
    codec           encoding of pseudo-gradients up and weight updates down (int8: ~3.9× fewer bytes)
    keep            the result: the last round's weights, or those of the round with the lowest validation loss
    sync            rounds: a barrier per round; backup: and copies of its stragglers; async: no barrier (see README)
    """
    CHOICES = {"outer": OUTERS, "codec": CODECS, "keep": KEEPS, "sync": SYNCS}

    rounds: int = 8
    sync_every: int = 25
    shards: int = 8
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

    def __post_init__(self) -> None:
        if self.outer_lr is None and self.outer != "auto":
            self.outer_lr = 0.7 if self.outer == "nesterov" else 1.0

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
        check_positive({"rounds": self.rounds, "sync_every": self.sync_every,
                        "shards": self.shards})
        if self.outer_lr is not None and not (0 < float(self.outer_lr) <= 10):
            raise SpecError(f"--outer-lr must be in (0, 10] (got {self.outer_lr})")
        if not (0 <= self.outer_momentum < 1):
            raise SpecError(f"--outer-momentum must be in [0, 1) (got {self.outer_momentum})")


class Fused(ModeBase):
    def model_configs(self, spec: "RunSpec", recipe: "Recipe") -> list[dict[str, Any]]:
        return [recipe.default_config()]

    def progress(self, doc: dict[str, Any]) -> tuple[int, int, list[tuple[str, str]]]:
        total = int(options_json(doc.get("spec") or {}).get("rounds", 0))
        events = []
        for r in doc.get("rounds", []):
            line = f"round {r['round']} ({r['round'] + 1} of {total})  loss {r['loss']:.4f}"
            if r.get("val_loss") is not None:
                line += f"  val_loss {r['val_loss']:.4f}"
            if r.get("val_accuracy") is not None:
                line += f"  val_acc {r['val_accuracy']:.3f}"
            if r.get("max_staleness") is not None:  # --sync async: how stale its updates were
                line += f"  staleness ≤{r['max_staleness']}"
            events.append((f"r{r['round']}", line))
        return len(events), total, events

    def final_key(self, run_id: str) -> str:
        return layout.key("final_model", run_id)


MODE = Fused("fused", FusedOptions, "rounds", "tensorturn.modes.fused.tasks")
