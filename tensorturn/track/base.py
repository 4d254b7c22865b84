"""What a tracker is told, taken from a run's description (the JSON of ``status --json``):
the run's settings as parameters, one step of figures per fused round or finished ensemble member,
and at the end the final figures and a reference to the kept model. One small :class:`Tracker`
class per backend receives them; nothing here imports a tracking library."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tensorturn import config
from tensorturn.layout import parse_label
from tensorturn.runs.report import worker_stats
from tensorturn.spec import options_json

# the spec's fields that are not settings of the training (or could hold a secret: the store URL
# is logged masked, as `store`); `run_config` repeats the settings logged one by one
NOT_PARAMS = ("run_id", "created_at", "store_url", "options", "recipe_options", "memory_needed_bytes",
              "run_config")
Param = str | int | float | bool  # a logged setting: numbers and flags kept as such
# characters every backend takes in a metric name (MLflow is the strictest: no '@' in a name)
_UNSAFE = re.compile(r"[^\w.\-/ ]")


def metric_name(name: str) -> str:
    return _UNSAFE.sub("_", name)


@dataclass
class Logged:
    """What a tracker already holds of a run — rounds (fused), members (ensemble), the end — so a
    description seen twice, a resumed run or a second ``tensorturn track`` logs each once."""

    rounds: set[int] = field(default_factory=set)
    members: set[int] = field(default_factory=set)
    finished: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"rounds": sorted(self.rounds), "members": sorted(self.members), "finished": self.finished}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "Logged":
        return cls(set(doc.get("rounds") or []), set(doc.get("members") or []), bool(doc.get("finished")))

    def load(self, path: Path) -> "Logged":
        """This record, as kept in ``path`` (a backend that writes files keeps it beside them)."""
        if path.exists():
            return Logged.from_json(json.loads(path.read_text()))
        return self

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json()))


@dataclass
class ModelRef:
    """The run's kept model: its URI in the store, its sha256, and the file itself where the store
    is a folder on this machine (a tracker copies it then; otherwise it records the reference)."""

    uri: str
    sha256: str | None
    path: Path | None


@dataclass
class Final:
    """A finished run: its state, its error, its final figures (the vote's, for an ensemble) and
    model; its id and store URL (as the run's spec holds it: never logged — a tracker that logs
    the model itself exports it from there)."""

    state: str
    step: int
    metrics: dict[str, float]
    model: ModelRef | None
    error: str | None = None
    run_id: str = ""
    store_url: str | None = field(default=None, repr=False)


class Tracker(Protocol):
    """One tracking backend (MLflow, TensorBoard, W&B) for one TensorTurn run.

    ``start`` opens (or reopens) the tracker's run of that TensorTurn run, logs its parameters and
    says what it holds already; ``step`` logs one step's figures; ``finish`` the end. ``close``
    lets go without finishing (following stopped; the run goes on)."""

    name: str

    def start(self, run_id: str, params: dict[str, Param]) -> Logged: ...

    def where(self) -> str: ...

    def step(self, step: int, metrics: dict[str, float], logged: Logged) -> None: ...

    def finish(self, final: Final, logged: Logged) -> None: ...

    def close(self) -> None: ...


def params(doc: dict[str, Any]) -> dict[str, Param]:
    """The run's settings, flat: the spec's common fields, ``option.<name>`` for the mode's options
    and ``recipe.<name>`` for the recipe's. Each is the value the run used: a setting the user left
    out is the one the run decided at its start (the recipe's ``lr`` and batch size, the shards
    and H chosen from the data — :meth:`~tensorturn.spec.RunSpec.settle_run_config`), not
    ``None``. Numbers and flags stay numbers and flags, so a tracker sorts and filters on them
    (TensorBoard's HParams tab, W&B's config); lists and objects are JSON text, and a setting with
    no value at all is left out. Safe to log (:func:`tensorturn.config.public`): a recipe option
    named like a secret (``api_token``) is ``***``, and every URL's password in any value is
    masked — a tracker's records leave the machine (W&B, a shared MLflow server)."""
    spec = config.public(doc.get("spec") or {})
    used = spec.get("run_config") or {}
    out: dict[str, Any] = {"mode": str(doc.get("mode")), "recipe": str(doc.get("recipe"))}
    out["store"] = spec.get("store_url") or ""
    for key, value in spec.items():
        if key not in NOT_PARAMS:
            out[key] = used.get(key) if value is None else value
    options = config.public(options_json(doc.get("spec") or {}))
    for key, value in options.items():
        if key not in NOT_PARAMS:
            out[f"option.{key}"] = used.get(key) if value is None else value
    for key, value in (spec.get("recipe_options") or {}).items():
        out[f"recipe.{key}"] = value
    return {metric_name(k): _param(v) for k, v in out.items() if v is not None}


def as_text(values: dict[str, Param]) -> dict[str, str]:
    """The parameters as text, for a tracker that keeps text only (MLflow)."""
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in values.items()}


def _param(value: Any) -> Param:
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def rates(doc: dict[str, Any], round_: int | None = None) -> dict[str, float]:
    """``rate/<machine>``: samples/s of each machine while it trained (:func:`worker_stats`), over
    the round ``round_``'s attempts, or the whole run's. An asynchronous run's round r is the
    updates that made its versions rS+1 .. (r+1)S (S shards), as its round record counts them."""
    if round_ is not None:
        shards = int(options_json(doc.get("spec") or {}).get("shards") or 1)
        updates = {int(u["update"]) for u in doc.get("updates") or []
                   if round_ * shards < int(u.get("version", 0)) <= (round_ + 1) * shards}

        def of_round(task: str) -> bool:
            label = parse_label(task)
            if label is None:
                return False
            return label.round == round_ if label.update is None else label.update in updates
        doc = {**doc, "attempts": [a for a in doc.get("attempts") or [] if of_round(a.get("task", ""))]}
    return {metric_name(f"rate/{s['worker']}"): float(s["samples_per_s"])
            for s in worker_stats(doc) if s.get("samples_per_s")}


def round_metrics(doc: dict[str, Any], record: dict[str, Any]) -> dict[str, float]:
    """One fused round's figures: ``train/loss``, ``val/<metric>``, samples, bytes up and down,
    each machine's samples/s, how stale an asynchronous round's updates were, seconds since the
    run was created (a time axis)."""
    out: dict[str, float | None] = {"train/loss": _number(record.get("loss")),
                                    "samples": _number(record.get("samples")),
                                    "bytes/up": _number(record.get("bytes_up")),
                                    "bytes/down": _number(record.get("bytes_down")),
                                    "staleness/max": _number(record.get("max_staleness")),
                                    "staleness/mean": _number(record.get("mean_staleness"))}
    for key, value in record.items():
        if key.startswith("val_") and key != "val_rows":
            out[f"val/{key[4:]}"] = _number(value)
    if record.get("at") and doc.get("created_at"):
        out["elapsed_s"] = float(record["at"]) - float(doc["created_at"])
    out.update(rates(doc, int(record["round"])))
    return {metric_name(k): v for k, v in out.items() if v is not None}


def member_metrics(member: dict[str, Any]) -> dict[str, float]:
    """A finished ensemble member's figures, as ``m<n>/<metric>``."""
    m = member["member"]
    out = {f"m{m}/{k}": _number(v) for k, v in (member.get("metrics") or {}).items()}
    out[f"m{m}/segments"] = _number(member.get("segments_done"))
    return {metric_name(k): v for k, v in out.items() if v is not None}


def final(doc: dict[str, Any]) -> Final:
    """The end of a finished run: its figures (an ensemble's are the vote's) as ``final/<metric>``,
    bytes moved, each machine's rate over the run; the kept model."""
    out: dict[str, float | None] = {f"final/{k}": _number(v) for k, v in (doc.get("metrics") or {}).items()}
    out["final/bytes_up"] = _number(doc.get("bytes_up"))
    out["final/bytes_down"] = _number(doc.get("bytes_down"))
    out.update(rates(doc))
    rounds = [int(r["round"]) for r in doc.get("rounds") or []]
    members = [int(m["member"]) for m in doc.get("members") or []]
    model = None
    if doc.get("model_uri"):
        uri = str(doc["model_uri"])
        local = Path(uri.removeprefix("file://")) if uri.startswith("file://") else None
        model = ModelRef(config.mask_url(uri), doc.get("model_sha256"),
                         local if local is not None and local.is_file() else None)
    return Final(str(doc.get("state")), max(rounds + members, default=0) + 1,
                 {metric_name(k): v for k, v in out.items() if v is not None}, model,
                 config.mask_text(doc["error"]) if doc.get("error") else None,
                 str(doc.get("run_id") or ""), (doc.get("spec") or {}).get("store_url"))
