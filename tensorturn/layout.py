"""Where everything lives: every object-store key, Redis key, claim name and task label.

Each name is built *and parsed* here only, so the layout of a run can be read in one place:

Object store (one folder per run)::

    runs/<id>/spec.json                               the run spec (what decides the result)
    runs/<id>/manifest.json                           the run's description, rebuildable state
    runs/<id>/global/r<RRRR>.safetensors              fused: global weights θ_r (r = 0..R)
    runs/<id>/outer/r<RRRR>.safetensors               fused: outer optimizer state entering r
    runs/<id>/broadcast/r<RRRR>.safetensors           fused: θ_r − θ_{r−1} in the run's codec
    runs/<id>/r<RRRR>/shard-<KKK>.safetensors         fused: shard k's pseudo-gradient of round r
    runs/<id>/rounds/r<RRRR>.json                     fused: round r's figures
    runs/<id>/members/m<MM>/seg-<JJJ>.safetensors     ensemble: member m's weights after segment j
    runs/<id>/members/m<MM>/seg-<JJJ>.optim.safetensors   … and its AdamW state
    runs/<id>/final/model.safetensors                 fused: the result
    runs/<id>/final/ensemble.safetensors              ensemble: the result (every member)
    runs/<id>/report/<name>.png                       `tensorturn report`'s plots
    auth/tokens/<token-id>.json                       API tokens (hashes only)

Redis (besides Celery's and kombu's own keys)::

    tt:runs                       sorted set of run ids by creation time
    tt:run:<id>                   hash: state, mode, spec, metrics, error, times
    tt:run:<id>:<part>            rounds, members, members_done, attempts, attempt_n,
                                  attempt_base, bytes, claims, incidents (a list)
    tt:worker:<name>              hash: an agent's inventory, live figures and current task
    celery, tt.fits.<N>MB         task queues: the default one and one per memory class

Task labels (``attempts[].task`` in the JSON): ``start``, ``r<r>/shard-<k>``, ``r<r>/outer``,
``m<m>/seg-<j>``, ``vote``. Claims (one-time dispatches, per run): ``dispatch-r<r>``,
``m<m>/seg-<j>``, ``vote``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---- object store -------------------------------------------------------------------------------

RUNS = "runs/"
TOKENS = "auth/tokens/"


def run_prefix(run_id: str) -> str:
    return f"{RUNS}{run_id}/"


def spec_key(run_id: str) -> str:
    return f"{RUNS}{run_id}/spec.json"


def manifest_key(run_id: str) -> str:
    return f"{RUNS}{run_id}/manifest.json"


_MANIFEST = re.compile(r"^runs/([^/]+)/manifest\.json$")


def manifest_run(key: str) -> str | None:
    """The run id of a manifest key, or None for any other key."""
    match = _MANIFEST.match(key)
    return match.group(1) if match else None


def global_key(run_id: str, r: int) -> str:
    return f"{RUNS}{run_id}/global/r{r:04d}.safetensors"


def global_prefix(run_id: str) -> str:
    return f"{RUNS}{run_id}/global/"


_GLOBAL = re.compile(r"^runs/[^/]+/global/r(\d{4,})\.safetensors$")


def global_round(key: str) -> int | None:
    """The round of a global-weights key, or None for any other key."""
    match = _GLOBAL.match(key)
    return int(match.group(1)) if match else None


def outer_state_key(run_id: str, r: int) -> str:
    return f"{RUNS}{run_id}/outer/r{r:04d}.safetensors"


def broadcast_key(run_id: str, r: int) -> str:
    """θ_r − θ_{r−1} in the run's codec: what a machine holding θ_{r−1} downloads instead of θ_r."""
    return f"{RUNS}{run_id}/broadcast/r{r:04d}.safetensors"


def shard_key(run_id: str, r: int, k: int) -> str:
    return f"{RUNS}{run_id}/r{r:04d}/shard-{k:03d}.safetensors"


def round_key(run_id: str, r: int) -> str:
    return f"{RUNS}{run_id}/rounds/r{r:04d}.json"


def segment_key(run_id: str, m: int, j: int) -> str:
    return f"{RUNS}{run_id}/members/m{m:02d}/seg-{j:03d}.safetensors"


def optim_key(run_id: str, m: int, j: int) -> str:
    return f"{RUNS}{run_id}/members/m{m:02d}/seg-{j:03d}.optim.safetensors"


def final_model_key(run_id: str) -> str:
    return f"{RUNS}{run_id}/final/model.safetensors"


def final_ensemble_key(run_id: str) -> str:
    return f"{RUNS}{run_id}/final/ensemble.safetensors"


def report_key(run_id: str, name: str) -> str:
    return f"{RUNS}{run_id}/report/{name}.png"


def token_key(token_id: str) -> str:
    return f"{TOKENS}{token_id}.json"


# ---- Redis --------------------------------------------------------------------------------------

PREFIX = "tt:"
RUN_INDEX = f"{PREFIX}runs"
WORKER_PATTERN = f"{PREFIX}worker:*"
UNACKED_INDEX = "unacked_index"  # kombu's default ``unacked_index_key``: the leases


def run_key(run_id: str, part: str = "") -> str:
    """The run's hash, or one of its sibling records (``rounds``, ``attempts``, ...)."""
    return f"{PREFIX}run:{run_id}" + (f":{part}" if part else "")


def worker_key(name: str) -> str:
    return f"{PREFIX}worker:{name}"


DEFAULT_QUEUE = "celery"
QUEUE_PATTERN = "tt.fits.*"


def memory_queue(size_mb: int) -> str:
    """The queue of tasks that need at most ``size_mb`` MB of device memory."""
    return f"tt.fits.{size_mb}MB"


# ---- task labels and claims ---------------------------------------------------------------------

@dataclass(frozen=True)
class Label:
    """What one task works on. ``str(label)`` is its name in attempts and incidents."""

    kind: str                 # start | shard | outer | segment | vote
    round: int | None = None
    shard: int | None = None
    member: int | None = None
    segment: int | None = None

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"r{self.round}/shard-{self.shard}"
        if self.kind == "outer":
            return f"r{self.round}/outer"
        if self.kind == "segment":
            return f"m{self.member}/seg-{self.segment}"
        return self.kind


def start_label() -> Label:
    return Label("start")


def shard_label(r: int, k: int) -> Label:
    return Label("shard", round=r, shard=k)


def outer_label(r: int) -> Label:
    return Label("outer", round=r)


def segment_label(m: int, j: int) -> Label:
    return Label("segment", member=m, segment=j)


def vote_label() -> Label:
    return Label("vote")


_LABELS = (
    (re.compile(r"^r(\d+)/shard-(\d+)$"), lambda g: shard_label(int(g[0]), int(g[1]))),
    (re.compile(r"^r(\d+)/outer$"), lambda g: outer_label(int(g[0]))),
    (re.compile(r"^m(\d+)/seg-(\d+)$"), lambda g: segment_label(int(g[0]), int(g[1]))),
    (re.compile(r"^(start|vote)$"), lambda g: Label(g[0])),
)


def parse_label(text: str) -> Label | None:
    """The label named ``text`` (``r3/shard-2``, ``m1/seg-0``, ...), or None."""
    for pattern, build in _LABELS:
        match = pattern.match(text)
        if match:
            return build(match.groups())
    return None


def dispatch_claim(r: int) -> str:
    """Claimed once by whoever queues round r."""
    return f"dispatch-r{r}"


def segment_claim(m: int, j: int) -> str:
    """Claimed once by whoever queues segment j of member m."""
    return f"m{m}/seg-{j}"


VOTE_CLAIM = "vote"
