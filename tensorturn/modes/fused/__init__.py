"""Fused mode: data-sharded training merged every H steps, DiLoCo-style, into one model.

The plug-in (this module, no torch) holds the options and what the CLI and client need; the
Celery tasks — shard, outer step — are in :mod:`.tasks`, the math in :mod:`tensorturn.diloco`.

Guarantees:

* Shards are *virtual replicas*: the result depends on (S, H, seed, threads) only — not on which
  machines, or how many, ran the shards.
* A round is a Celery chord: header = one task per shard, body = the outer step. Every task goes
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
from ...spec import ModeOptions, check_positive

if TYPE_CHECKING:
    from ...board import RunBoard
    from ...recipes import Recipe
    from ...spec import RunSpec
    from ...store import Store

OUTERS = ("nesterov", "sgd")
CODECS = ("fp32", "fp16", "int8")


@dataclass
class FusedOptions(ModeOptions):
    rounds: int = 8
    sync_every: int = 25
    shards: int = 8
    outer: str = "nesterov"
    outer_lr: float | None = None       # None: 0.7 for nesterov (DiLoCo), 1.0 for sgd (FedAvg)
    outer_momentum: float = 0.9
    codec: str = "fp32"
    # a pseudo-gradient whose norm exceeds this multiple of the weights' norm is rejected
    max_update_ratio: float = 10.0
    # derived at start: sha256 of θ_0's model file, so machines can rebuild θ_0 from the seed
    init_sha256: str = ""

    def __post_init__(self) -> None:
        if self.outer_lr is None:
            self.outer_lr = 0.7 if self.outer == "nesterov" else 1.0

    def validate(self) -> None:
        if self.outer not in OUTERS:
            raise SpecError(f"unknown outer optimizer {self.outer!r}: choose nesterov or sgd")
        if self.codec not in CODECS:
            raise SpecError(f"unknown codec {self.codec!r}: choose one of {', '.join(CODECS)}")
        check_positive({"rounds": self.rounds, "sync_every": self.sync_every,
                        "shards": self.shards})
        if not (0 < float(self.outer_lr or 0) <= 10):
            raise SpecError(f"--outer-lr must be in (0, 10] (got {self.outer_lr})")
        if not (0 <= self.outer_momentum < 1):
            raise SpecError(f"--outer-momentum must be in [0, 1) (got {self.outer_momentum})")


class Fused:
    name = "fused"
    Options = FusedOptions
    unit = "rounds"

    def prepare(self, spec: "RunSpec", online_workers: int) -> None:
        pass

    def model_configs(self, spec: "RunSpec", recipe: "Recipe") -> list[dict[str, Any]]:
        return [recipe.default_config()]

    def start(self, spec: "RunSpec", store: "Store", board: "RunBoard") -> None:
        from .tasks import start

        start(spec, store, board)

    def resume(self, spec: "RunSpec", store: "Store", board: "RunBoard") -> str:
        from .tasks import resume

        return resume(spec, store, board)

    def progress(self, doc: dict[str, Any]) -> tuple[int, int, list[tuple[str, str]]]:
        total = int((doc.get("spec") or {}).get("options", {}).get("rounds", 0))
        events = []
        for r in doc.get("rounds", []):
            line = (f"round {r['round']} ({r['round'] + 1} of {total})  loss {r['loss']:.4f}  "
                    f"val_loss {r['val_loss']:.4f}")
            if r.get("val_accuracy") is not None:
                line += f"  val_acc {r['val_accuracy']:.3f}"
            events.append((f"r{r['round']}", line))
        return len(events), total, events

    def final_key(self, run_id: str) -> str:
        return layout.final_model_key(run_id)


MODE = Fused()
