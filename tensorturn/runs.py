"""RunSpec, run state in Redis, attempts, and the manifest in the store.

Redis holds the live state of a run (``tt:run:<id>`` and a few sibling keys); the store holds
everything needed to rebuild it (``runs/<id>/spec.json``, weights, ``manifest.json``). The JSON
that ``tensorturn run --json`` and ``tensorturn status --json`` print comes from :func:`describe`.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import redis

from .errors import BrokerError, NotFound, SpecError
from .settings import KEY_PREFIX, mask_url, mask_text
from .store import Store
from .tensors import CODECS

log = logging.getLogger(__name__)

MODES = ("fused", "ensemble")
OUTERS = ("nesterov", "sgd")
VOTES = ("soft", "hard")
DIVERSITY = ("full", "seed")
STATES = ("queued", "running", "succeeded", "failed")
FINISHED = ("succeeded", "failed")


@dataclass
class RunSpec:
    """Everything that determines a run's result. Stored at ``runs/<id>/spec.json``."""

    mode: str
    recipe: str
    store_url: str
    run_id: str = ""
    recipe_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    # fused
    rounds: int = 8
    sync_every: int = 25
    shards: int = 8
    outer: str = "nesterov"
    outer_lr: float | None = None       # None: 0.7 for nesterov (DiLoCo), 1.0 for sgd (FedAvg)
    outer_momentum: float = 0.9
    codec: str = "fp32"
    # ensemble
    members: int | None = None          # None: one per online machine, at least 2 (set at submit)
    min_members: int = 1
    vote: str = "soft"
    segments: int = 3
    segment_steps: int = 400
    bootstrap: bool = True
    diversity: str = "full"             # full: seed + config draw; seed: seed (+ bootstrap) only
    deadline: float | None = None       # seconds after creation; later segments drop their member
    # inner training (None: the recipe's default)
    lr: float | None = None
    batch_size: int | None = None
    threads_per_task: int = 1
    max_attempts: int = 3
    # fused: a pseudo-gradient whose norm exceeds this multiple of the weights' norm is rejected
    max_update_ratio: float = 10.0
    # bytes one task needs on a machine (set at submit from capacity.estimate)
    memory_needed_bytes: int | None = None
    # fused: sha256 of θ_0's model file, so machines can rebuild θ_0 from the seed (set at start)
    init_sha256: str = ""
    created_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.run_id:
            self.run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
        if not self.created_at:
            self.created_at = time.time()
        if self.outer_lr is None:
            self.outer_lr = 0.7 if self.outer == "nesterov" else 1.0

    def validate(self) -> "RunSpec":
        """Raise SpecError with a one-line reason for the first invalid option."""
        if self.mode not in MODES:
            raise SpecError(f"unknown mode {self.mode!r}: choose fused or ensemble")
        if self.outer not in OUTERS:
            raise SpecError(f"unknown outer optimizer {self.outer!r}: choose nesterov or sgd")
        if self.codec not in CODECS:
            raise SpecError(f"unknown codec {self.codec!r}: choose one of {', '.join(CODECS)}")
        positive = {"--rounds": self.rounds, "--sync-every": self.sync_every,
                    "--shards": self.shards, "--threads-per-task": self.threads_per_task,
                    "--max-attempts": self.max_attempts}
        if self.batch_size is not None:
            positive["--batch-size"] = self.batch_size
        if self.mode == "ensemble":
            if self.vote not in VOTES:
                raise SpecError(f"unknown vote rule {self.vote!r}: choose soft or hard")
            if self.diversity not in DIVERSITY:
                raise SpecError(f"unknown diversity {self.diversity!r}: choose full or seed")
            positive.update({"--segments": self.segments, "--segment-steps": self.segment_steps,
                             "--min-members": self.min_members})
            if self.members is not None:
                positive["--members"] = self.members
            if self.deadline is not None and self.deadline <= 0:
                raise SpecError(f"--deadline must be a positive number of seconds (got {self.deadline})")
        for flag, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"{flag} must be a whole number ≥ 1 (got {value})")
        if self.mode == "ensemble" and self.members is not None and self.min_members > self.members:
            raise SpecError(f"--min-members ({self.min_members}) cannot exceed --members ({self.members})")
        if self.lr is not None and not (0 < self.lr < 10):
            raise SpecError(f"--lr must be in (0, 10) (got {self.lr})")
        if not (0 < float(self.outer_lr) <= 10):
            raise SpecError(f"--outer-lr must be in (0, 10] (got {self.outer_lr})")
        if not (0 <= self.outer_momentum < 1):
            raise SpecError(f"--outer-momentum must be in [0, 1) (got {self.outer_momentum})")
        return self

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunSpec":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def spec_key(run_id: str) -> str:
    return f"runs/{run_id}/spec.json"


def manifest_key(run_id: str) -> str:
    return f"runs/{run_id}/manifest.json"


def load_spec(store: Store, run_id: str) -> RunSpec:
    return RunSpec.from_json(store.get_json(spec_key(run_id)))


# ---- Redis ------------------------------------------------------------------------------------

def redis_client(url: str, patient: bool = True) -> redis.Redis:
    """A client that rides out a broker restart: connection errors are retried with backoff for
    about a minute (``patient=False`` gives up at once, for probing)."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retry = Retry(ExponentialBackoff(cap=4.0, base=0.1), 20 if patient else 0)
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_keepalive=True,
                                health_check_interval=10, decode_responses=True, retry=retry,
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def check_broker(url: str) -> redis.Redis:
    """A client for ``url`` after a successful PING; BrokerError (URL masked) otherwise."""
    try:
        redis_client(url, patient=False).ping()
    except redis.RedisError as exc:
        raise BrokerError(f"cannot reach broker {mask_url(url)}: {mask_text(str(exc))}") from None
    return redis_client(url)


def _k(run_id: str, part: str = "") -> str:
    return f"{KEY_PREFIX}run:{run_id}" + (f":{part}" if part else "")


class RunBoard:
    """Live run state in Redis: the run hash, per-round records, and task attempts."""

    def __init__(self, client: redis.Redis):
        self.r = client

    # -- the run --
    def create(self, spec: RunSpec) -> None:
        pipe = self.r.pipeline()
        pipe.hset(_k(spec.run_id), mapping={
            "run_id": spec.run_id, "mode": spec.mode, "state": "queued",
            "spec": json.dumps(spec.to_json()), "created_at": spec.created_at,
        })
        pipe.zadd(f"{KEY_PREFIX}runs", {spec.run_id: spec.created_at})
        pipe.execute()

    def exists(self, run_id: str) -> bool:
        return bool(self.r.exists(_k(run_id)))

    def state(self, run_id: str) -> str | None:
        return self.r.hget(_k(run_id), "state")

    def mark_running(self, run_id: str) -> None:
        # queued → running only; never overwrite a finished state.
        self.r.eval("if redis.call('hget', KEYS[1], 'state') == 'queued' then "
                    "redis.call('hset', KEYS[1], 'state', 'running', 'started_at', ARGV[1]) end",
                    1, _k(run_id), time.time())

    def finish(self, run_id: str, state: str, **fields: Any) -> bool:
        """Move to a finished state once; later calls (a duplicate task) change nothing."""
        mapping = {k: json.dumps(v) if isinstance(v, (dict, list)) else v
                   for k, v in fields.items() if v is not None}
        mapping.update(state=state, finished_at=time.time())
        args = [x for kv in mapping.items() for x in kv]
        return bool(self.r.eval(
            "local s = redis.call('hget', KEYS[1], 'state') "
            "if s == 'succeeded' or s == 'failed' then return 0 end "
            "redis.call('hset', KEYS[1], unpack(ARGV)) return 1",
            1, _k(run_id), *args))

    def fail(self, run_id: str, error: str) -> bool:
        return self.finish(run_id, "failed", error=mask_text(error))

    def claim(self, run_id: str, what: str) -> bool:
        """True the first time ``what`` is claimed for this run (guards one-time dispatches)."""
        return bool(self.r.hsetnx(_k(run_id, "claims"), what, time.time()))

    # -- rounds --
    def record_round(self, run_id: str, round_: int, info: dict[str, Any]) -> None:
        self.r.hset(_k(run_id, "rounds"), str(round_), json.dumps(info))

    def rounds(self, run_id: str) -> list[dict[str, Any]]:
        raw = self.r.hgetall(_k(run_id, "rounds"))
        return [json.loads(raw[k]) for k in sorted(raw, key=int)]

    # -- ensemble members --
    def record_member(self, run_id: str, member: int, info: dict[str, Any]) -> None:
        self.r.hset(_k(run_id, "members"), str(member), json.dumps(info))

    def member(self, run_id: str, member: int) -> dict[str, Any]:
        raw = self.r.hget(_k(run_id, "members"), str(member))
        return json.loads(raw) if raw else {}

    def members(self, run_id: str) -> list[dict[str, Any]]:
        raw = self.r.hgetall(_k(run_id, "members"))
        return [json.loads(raw[k]) for k in sorted(raw, key=int)]

    def member_done(self, run_id: str, member: int) -> int:
        """Mark a member finished (succeeded or dropped) once; returns how many are finished."""
        self.r.hsetnx(_k(run_id, "members_done"), str(member), time.time())
        return int(self.r.hlen(_k(run_id, "members_done")))

    # -- bytes moved, counted once per task --
    def add_bytes(self, run_id: str, task: str, up: int, down: int) -> None:
        self.r.hsetnx(_k(run_id, "bytes"), task, f"{up},{down}")

    def bytes_moved(self, run_id: str) -> tuple[int, int]:
        up = down = 0
        for v in self.r.hvals(_k(run_id, "bytes")):
            u, d = v.split(",")
            up, down = up + int(u), down + int(d)
        return up, down

    # -- attempts --
    def start_attempt(self, run_id: str, task: str, worker: str) -> tuple[str, int]:
        """Record a new attempt of ``task``; returns its key and its number (1, 2, ...)."""
        n = int(self.r.hincrby(_k(run_id, "attempt_n"), task, 1))
        key = f"{task}#{n}"
        for i in range(1, n):  # an earlier attempt still "running" was lost with its machine
            raw = self.r.hget(_k(run_id, "attempts"), f"{task}#{i}")
            if raw and json.loads(raw)["outcome"] == "running":
                self.finish_attempt(run_id, f"{task}#{i}", "lost: requeued to another attempt")
                self.incident(run_id, "requeued", task, json.loads(raw)["worker"],
                              f"attempt {i} was lost (its worker stopped answering); attempt {n} "
                              f"started on {worker}")
        self.r.hset(_k(run_id, "attempts"), key, json.dumps({
            "task": task, "attempt": n, "worker": worker, "started_at": time.time(),
            "finished_at": None, "outcome": "running"}))
        self.mark_running(run_id)
        return key, n

    def begin_attempt(self, run_id: str, task: str, worker: str,
                      max_attempts: int) -> tuple[str, int] | None:
        """Record a new attempt, or — past ``max_attempts`` (a task that keeps killing its
        worker is redelivered without end) — record its refusal and return None."""
        key, n = self.start_attempt(run_id, task, worker)
        if n <= max_attempts:
            return key, n
        self.finish_attempt(run_id, key, "refused: attempt limit reached")
        self.incident(run_id, "attempt_limit", task, worker,
                      f"attempt {n} refused: the task already had {max_attempts}")
        return None

    def finish_attempt(self, run_id: str, key: str, outcome: str) -> None:
        raw = self.r.hget(_k(run_id, "attempts"), key)
        if raw is None:
            return
        entry = json.loads(raw)
        entry.update(finished_at=time.time(), outcome=mask_text(outcome))
        self.r.hset(_k(run_id, "attempts"), key, json.dumps(entry))

    def attempts(self, run_id: str) -> list[dict[str, Any]]:
        entries = [json.loads(v) for v in self.r.hgetall(_k(run_id, "attempts")).values()]
        return sorted(entries, key=lambda e: (e["started_at"], e["task"]))

    # -- incidents: requeued, duplicate or late attempts ignored, updates rejected --
    def incident(self, run_id: str, kind: str, task: str, worker: str | None, detail: str) -> None:
        self.r.rpush(_k(run_id, "incidents"), json.dumps({
            "kind": kind, "task": task, "worker": worker, "at": time.time(),
            "detail": mask_text(detail)}))

    def incidents(self, run_id: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.lrange(_k(run_id, "incidents"), 0, -1)]

    # -- rebuilding after the broker lost its data --
    def restore(self, spec: RunSpec, doc: dict[str, Any] | None) -> None:
        """Re-create a run's records from its last manifest (or from the spec alone)."""
        self.create(spec)
        self.r.hset(_k(spec.run_id), "state", "running")
        self.r.hdel(_k(spec.run_id), "error", "finished_at")
        if not doc:
            return
        pipe = self.r.pipeline()
        for r in doc.get("rounds", []):
            pipe.hset(_k(spec.run_id, "rounds"), str(r["round"]), json.dumps(r))
        for a in doc.get("attempts", []):
            pipe.hset(_k(spec.run_id, "attempts"), f"{a['task']}#{a['attempt']}", json.dumps(a))
            pipe.hset(_k(spec.run_id, "attempt_n"), a["task"], a["attempt"])
        for i in doc.get("incidents", []):
            pipe.rpush(_k(spec.run_id, "incidents"), json.dumps(i))
        for m in doc.get("members", []):
            pipe.hset(_k(spec.run_id, "members"), str(m["member"]), json.dumps(m))
        pipe.execute()

    def reopen(self, run_id: str) -> None:
        """Back to running for a resume: clear the one-time claims and any failure."""
        self.r.delete(_k(run_id, "claims"))
        self.r.hset(_k(run_id), "state", "running")
        self.r.hdel(_k(run_id), "error", "finished_at")

    # -- reading --
    def list_runs(self, limit: int = 50) -> list[dict[str, Any]]:
        ids = self.r.zrevrange(f"{KEY_PREFIX}runs", 0, limit - 1)
        return [self.summary(i) for i in ids if self.exists(i)]

    def summary(self, run_id: str) -> dict[str, Any]:
        h = self.r.hgetall(_k(run_id))
        if not h:
            raise NotFound(f"no run {run_id!r} on this broker (see `tensorturn runs`)")
        spec = json.loads(h["spec"])
        return {
            "run_id": run_id, "mode": h["mode"], "state": h["state"], "recipe": spec["recipe"],
            "created_at": float(h["created_at"]),
            "finished_at": float(h["finished_at"]) if "finished_at" in h else None,
            "metrics": json.loads(h.get("metrics", "{}")),
            "error": h.get("error"),
        }

    def describe(self, run_id: str) -> dict[str, Any]:
        """The run as the CLI/JSON contract shows it."""
        h = self.r.hgetall(_k(run_id))
        if not h:
            raise NotFound(f"no run {run_id!r} on this broker (see `tensorturn runs`)")
        spec = json.loads(h["spec"])
        rounds = self.rounds(run_id)
        bytes_up, bytes_down = self.bytes_moved(run_id)
        out: dict[str, Any] = {
            "run_id": run_id,
            "mode": h["mode"],
            "state": h["state"],
            "recipe": spec["recipe"],
            "metrics": json.loads(h.get("metrics", "{}")),
            "model_uri": h.get("model_uri"),
            "model_sha256": h.get("model_sha256"),
            "rounds": rounds,
            "attempts": self.attempts(run_id),
            "incidents": self.incidents(run_id),
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            "created_at": float(h["created_at"]),
            "started_at": float(h["started_at"]) if "started_at" in h else None,
            "finished_at": float(h["finished_at"]) if "finished_at" in h else None,
            "error": h.get("error"),
            "spec": spec,
        }
        if h["mode"] == "ensemble":
            out["members"] = self.members(run_id)
        return out


def write_manifest(store: Store, board: RunBoard, run_id: str) -> dict[str, Any]:
    """Save the run's description beside its weights (rebuildable without Redis)."""
    doc = board.describe(run_id)
    store.put_json(manifest_key(run_id), doc)
    return doc
