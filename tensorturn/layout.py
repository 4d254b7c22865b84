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
    runs/<id>/async/updates/u<JJJJJ>.safetensors      async: update j's pseudo-gradient
    runs/<id>/async/versions/v<VVVVV>-<token>.safetensors   async: θ after v updates (+ .state:
                                                      outer state); the token fences a stale applier
    runs/<id>/async/log/v<VVVVV>.json                 async: which update made version v, and its key
    runs/<id>/members/m<MM>/seg-<JJJ>.safetensors     ensemble: member m's weights after segment j
    runs/<id>/members/m<MM>/seg-<JJJ>.optim.safetensors   … and its AdamW state
    runs/<id>/final/model.safetensors                 fused: the result
    runs/<id>/teacher/<tag>/shard-<KKK>-of-<SSS>.safetensors   ensemble: its top-k soft vote on
                                                      a distillation's shard k of S (tag: T, k, mixup, seed, threads)
    runs/<id>/final/ensemble.safetensors              ensemble: the result (every member)
    runs/<id>/report/<name>.png                       `tensorturn report`'s plots
    runs/<id>/report/report.html                      … and its page (the plots embedded, tables)
    runs/<id>/serving/<server>.json                   a `tensorturn serve` of the run, while it runs
                                                      (refreshed; `runs rm` refuses a served run)
    auth/tokens/<token-id>.json                       API tokens (hashes only)
    datasets/<name>/v<NNNN>.json                      a pushed dataset's version: its chunk index
    datasets/chunks/<sha256>.parquet                  a dataset chunk (content-addressed, shared)

Redis (besides Celery's and kombu's own keys)::

    tt:runs                       sorted set of run ids by creation time
    tt:run:<id>                   hash: state, mode, spec, metrics, error, times; whole only
                                  with every field of RECORD (else treated as lost)
    tt:run:<id>:<part>            rounds, members, members_done, attempts, attempt_n,
                                  attempt_base, succeeded (task → its first successful
                                  attempt), bytes, claims, incidents and warnings (lists),
                                  started (an agent's answer to `run`, a list), data_bytes and data_read
                                  (per worker: dataset bytes downloaded, read by its tasks),
                                  owners (fused: shard → the worker that last trained it),
                                  slots-r<r> (fused: round r's slot → the shard it trains),
                                  stored-r<r> (fused: shards stored; the last queues the outer
                                  step, and backup copies stop),
                                  async (pointer: latest version, its keys), versions (v → key),
                                  applied (update → its record), pending (sorted set of updates
                                  stored, not yet applied), trainers, begun, apply_lock (who
                                  applies now), eval_lock (who evaluates the rounds due)
    tt:worker:<name>              hash: an agent's inventory, live figures and current task
                                  Every key of a finished run expires after TENSORTURN_RUN_TTL_S
                                  (its record stays in the store's manifest).
    tt:outer-queues               sorted set: "<outer queue>|<agent>" → its last heartbeat (Redis time)
    tt:refused                    list: the last 100 messages agents refused (JSON: why, who)
    tt:refused:total              counter: every message refused since the broker started
    tt:pruned                     lock: held an hour by whoever prunes leftovers (tensorturn.state.housekeeping)
    celery, tt.fits.<N>MB         task queues: the default one and one per memory class
    tt.agent.<name@host>          an agent's own queue (backup copies it queued for itself)
    tt.outer.<queue>              outer steps of capacity queue <queue>, for an agent beside the store

Task labels (``attempts[].task`` in the JSON): ``r<r>/shard-<k>``, ``r<r>/outer``,
``r<r>/backup-<k>`` (a backup copy of a straggling shard), ``u<j>`` (async updates) and
``u<j>/backup``,
``m<m>/seg-<j>``, ``vote``; a round's messages name slots (``r<r>/slot-<i>``), each bound to a
shard by the first worker that runs it. Claims (one-time dispatches, per run): ``dispatch-r<r>``,
``m<m>/seg-<j>``, ``vote``, ``backup-r<r>-<k>``, ``backup-u<j>``.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any

# ---- object store -------------------------------------------------------------------------------

RUNS = "runs/"
TOKENS = "auth/tokens/"
DATASETS = "datasets/"

# name, template: what ``key(name, ...)`` builds and ``parse(name, key)`` reads back
_STORE = """
spec            runs/{run_id}/spec.json
manifest        runs/{run_id}/manifest.json
global          runs/{run_id}/global/r{round:04d}.safetensors
outer           runs/{run_id}/outer/r{round:04d}.safetensors
broadcast       runs/{run_id}/broadcast/r{round:04d}.safetensors
shard           runs/{run_id}/r{round:04d}/shard-{shard:03d}.safetensors
round           runs/{run_id}/rounds/r{round:04d}.json
update          runs/{run_id}/async/updates/u{update:05d}.safetensors
version         runs/{run_id}/async/versions/v{version:05d}-{token}.safetensors
version_state   runs/{run_id}/async/versions/v{version:05d}-{token}.state.safetensors
version_log     runs/{run_id}/async/log/v{version:05d}.json
segment         runs/{run_id}/members/m{member:02d}/seg-{segment:03d}.safetensors
optim           runs/{run_id}/members/m{member:02d}/seg-{segment:03d}.optim.safetensors
final_model     runs/{run_id}/final/model.safetensors
teacher         runs/{run_id}/teacher/{tag}/shard-{shard:03d}-of-{shards:03d}.safetensors
final_ensemble  runs/{run_id}/final/ensemble.safetensors
report          runs/{run_id}/report/{name}.png
report_page     runs/{run_id}/report/report.html
serving         runs/{run_id}/serving/{server}.json
clock           clock/{token}
link_probe      links/{agent}/probe-{piece:02d}
token           auth/tokens/{token_id}.json
dataset         datasets/{name}/v{version:04d}.json
chunk           datasets/chunks/{sha256}.parquet
"""


class Template:
    """One kind of store key: built from values in the template's order, parsed back to them."""

    def __init__(self, template: str):
        self.template = template
        pattern, self.fields = "", []
        for literal, field, spec, _ in string.Formatter().parse(template):
            pattern += re.escape(literal)
            if field:
                self.fields.append(field)
                pattern += rf"(?P<{field}>\d+)" if (spec or "").endswith("d") else rf"(?P<{field}>[^/]+)"
        self.regex = re.compile(pattern + "$")

    def build(self, *values: Any) -> str:
        if len(values) != len(self.fields):
            raise TypeError(f"{self.template} takes {', '.join(self.fields)}")
        return self.template.format(**dict(zip(self.fields, values)))

    def prefix(self, *values: Any) -> str:
        """The folder of the keys of this kind with these first values (to list them)."""
        head = self.template.split("{" + self.fields[len(values)], 1)[0]
        return head.format(**dict(zip(self.fields, values))).rpartition("/")[0] + "/"

    def parse(self, key: str) -> dict[str, Any] | None:
        match = self.regex.match(key)
        if not match:
            return None
        return {k: int(v) if v.isdigit() and "{" + k + ":" in self.template else v
                for k, v in match.groupdict().items()}


TEMPLATES = {name: Template(template)
             for name, template in (line.split() for line in _STORE.strip().splitlines())}


def key(kind: str, *values: Any) -> str:
    """The store key of ``kind`` (a name in the table above) for ``values``, in order:
    ``key("shard", run_id, r, k)`` → ``runs/<id>/r0003/shard-002.safetensors``."""
    return TEMPLATES[kind].build(*values)


def prefix(kind: str, *values: Any) -> str:
    """Where keys of ``kind`` start: ``prefix("global", run_id)`` lists a run's global weights."""
    return TEMPLATES[kind].prefix(*values)


def parse(kind: str, text: str) -> dict[str, Any] | None:
    """The values of a key of ``kind`` (``{"run_id": ..., "round": 3}``), or None."""
    return TEMPLATES[kind].parse(text)


# ---- Redis --------------------------------------------------------------------------------------

PREFIX = "tt:"
RUN_INDEX = f"{PREFIX}runs"
WORKER_PATTERN = f"{PREFIX}worker:*"
REFUSED = f"{PREFIX}refused"   # list: the last task messages agents refused (bad signature, ...)
REFUSED_TOTAL = f"{REFUSED}:total"  # counter: every refusal (the list keeps only the last 100)
PRUNE_LOCK = f"{PREFIX}pruned"
RECORD = ("run_id", "mode", "state", "spec", "created_at")  # what makes a run's hash whole
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")    # what a run id may be (new_run_id's and more)
UNACKED = "unacked"  # kombu's default ``unacked_key``: messages delivered, not yet acknowledged
UNACKED_INDEX = "unacked_index"  # kombu's default ``unacked_index_key``: the leases


def run_key(run_id: str, part: str = "") -> str:
    """The run's hash, or one of its sibling records (``rounds``, ``attempts``, ...)."""
    return f"{PREFIX}run:{run_id}" + (f":{part}" if part else "")


def run_keys_pattern(run_id: str) -> str:
    """The SCAN pattern of the run's sibling records (``tt:run:<id>:*``; glob characters in the
    id are escaped, so one run's pattern never matches another's keys)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", run_key(run_id)) + ":*"


def parse_run_key(key: str) -> str | None:
    """The run id of a run's key (its hash or a sibling record), or None."""
    head = f"{PREFIX}run:"
    return key[len(head):].split(":", 1)[0] if key.startswith(head) else None


def live_key(run_id: str) -> str:
    """The run's live progress: {task label: JSON of its step, loss or phase, worker, time},
    written by running tasks at most once a second (:mod:`tensorturn.state.live`)."""
    return run_key(run_id, "live")


def slots_key(run_id: str, r: int) -> str:
    """Fused: round r's slot → the shard it trains (:class:`tensorturn.state.claims.Claims`)."""
    return run_key(run_id, f"slots-r{r}")


def stored_key(run_id: str, r: int) -> str:
    """Fused: round r's shards stored (shard → worker): the last queues the outer step, and
    backup copies stop."""
    return run_key(run_id, f"stored-r{r}")


def standby_key(run_id: str, r: int) -> str:
    """Fused: round r is complete — the list the slot of round r+1 standing by to take round
    r's outer step waits on (:meth:`tensorturn.state.announcements.Announcements.await_complete`)."""
    return run_key(run_id, f"complete-r{r}")


def global_stored_key(run_id: str, r: int) -> str:
    """Fused: θ_r is stored — the list round r's slots, queued while θ_r was being stepped, wait
    on (:meth:`tensorturn.state.announcements.Announcements.await_global`)."""
    return run_key(run_id, f"global-r{r}")


def handed_key(run_id: str, r: int) -> str:
    """``--sync overlap``: round r's shards whose task ended, their output stored or uploading."""
    return run_key(run_id, f"handed-r{r}")


def upload_key(run_id: str, r: int, k: int) -> str:
    """``--sync overlap``: the lease of shard k of round r's upload in the background (the
    uploading agent, expiring unless refreshed)."""
    return run_key(run_id, f"upload-r{r}-{k}")


def worker_key(name: str) -> str:
    return f"{PREFIX}worker:{name}"


def owner_key(name: str) -> str:
    """What the owner of agent ``name`` asked of it from any machine (``tensorturn pause``,
    ``tensorturn policy``): signed marks its agent reads every second."""
    return f"{PREFIX}owner:{name}"


def links_key(name: str) -> str:
    """Agent ``name``'s timed store transfers, from its pool processes to its heartbeat (a list,
    drained every beat: :meth:`tensorturn.state.workers.Workers.beat`). Not under ``tt:worker:``,
    whose keys are all heartbeat hashes."""
    return f"{PREFIX}links:{name}"


def data_key(name: str, period: str) -> str:
    """The bytes agent ``name`` moved to and from the store in ``period`` (``2026-12``,
    ``2026-W49``, ``2026-12-07``: :func:`tensorturn.pool.owner.period_of`), for its data cap."""
    return f"{PREFIX}data:{name}:{period}"


ADVERTISED = f"{PREFIX}outer-queues"  # sorted set: "<outer queue>|<agent>" → when that agent last beat


DEFAULT_QUEUE = "celery"
QUEUE_PATTERN = "tt.fits.*"
ANY_QUEUE_PATTERN = "tt.*"  # with DEFAULT_QUEUE, every task queue: memory classes, outer, agents'


def task_args(message: str | bytes) -> list[Any] | None:
    """The positional arguments of a queued Celery message (kombu's Redis envelope: JSON with a
    base64 body of ``[args, kwargs, embed]``); None for anything else."""
    import base64

    try:
        args = json.loads(base64.b64decode(json.loads(message)["body"]))[0]
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return args if isinstance(args, list) else None


def agent_queue(worker: str) -> str:
    """The queue only ``worker`` (``name@host``) consumes: backup copies it judged it would win."""
    return f"tt.agent.{worker}"


def memory_queue(size_mb: int) -> str:
    """The queue of tasks that need at most ``size_mb`` MB of device memory."""
    return f"tt.fits.{size_mb}MB"


OUTER_PREFIX = "tt.outer."


def outer_queue(queue: str) -> str:
    """The outer queue of capacity queue ``queue``: where outer steps of that size wait for an
    agent beside the store (:mod:`tensorturn.pool.routing`)."""
    return OUTER_PREFIX + queue


# ---- task labels and claims ---------------------------------------------------------------------

@dataclass(frozen=True)
class Label:
    """What one task works on. ``str(label)`` is its name in attempts and incidents."""

    kind: str                 # shard | slot | backup | outer | eval | update | segment | vote
    round: int | None = None
    shard: int | None = None
    member: int | None = None
    segment: int | None = None
    update: int | None = None

    @property
    def numbers(self) -> tuple[int, ...]:
        """(round, shard), (round,), (member, segment), (update,) or () — what the label names."""
        return tuple(v for v in (self.round, self.shard, self.member, self.segment, self.update)
                     if v is not None)

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"r{self.round}/shard-{self.shard}"
        if self.kind == "slot":
            return f"r{self.round}/slot-{self.shard}"
        if self.kind == "backup":
            return f"r{self.round}/backup-{self.shard}"
        if self.kind == "outer":
            return f"r{self.round}/outer"
        if self.kind == "eval":
            return f"r{self.round}/eval"
        if self.kind == "update":
            return f"u{self.update}"
        if self.kind == "update_backup":
            return f"u{self.update}/backup"
        if self.kind == "segment":
            return f"m{self.member}/seg-{self.segment}"
        return self.kind


def shard_label(r: int, k: int) -> Label:
    return Label("shard", round=r, shard=k)


def slot_label(r: int, i: int) -> Label:
    """Slot i of round r: a message that trains whichever shard its first worker claims."""
    return Label("slot", round=r, shard=i)


def backup_label(r: int, k: int) -> Label:
    """A backup copy of shard k of round r, run when the round waits only for stragglers."""
    return Label("backup", round=r, shard=k)


def update_label(j: int) -> Label:
    """Update j of an asynchronous fused run (shard j mod S, trained from the latest weights)."""
    return Label("update", update=j)


def update_backup_label(j: int) -> Label:
    """A backup copy of async update j, run when j straggles (at the end, or a round behind)."""
    return Label("update_backup", update=j)


def outer_label(r: int) -> Label:
    return Label("outer", round=r)


def eval_label(r: int) -> Label:
    """The evaluation of θ_{r+1}, round r's weights, queued by its outer step behind round r+1."""
    return Label("eval", round=r)


def segment_label(m: int, j: int) -> Label:
    return Label("segment", member=m, segment=j)


def vote_label() -> Label:
    return Label("vote")


_LABELS = (
    (re.compile(r"^r(\d+)/shard-(\d+)$"), lambda g: shard_label(int(g[0]), int(g[1]))),
    (re.compile(r"^r(\d+)/slot-(\d+)$"), lambda g: slot_label(int(g[0]), int(g[1]))),
    (re.compile(r"^r(\d+)/backup-(\d+)$"), lambda g: backup_label(int(g[0]), int(g[1]))),
    (re.compile(r"^r(\d+)/outer$"), lambda g: outer_label(int(g[0]))),
    (re.compile(r"^r(\d+)/eval$"), lambda g: eval_label(int(g[0]))),
    (re.compile(r"^u(\d+)$"), lambda g: update_label(int(g[0]))),
    (re.compile(r"^u(\d+)/backup$"), lambda g: update_backup_label(int(g[0]))),
    (re.compile(r"^m(\d+)/seg-(\d+)$"), lambda g: segment_label(int(g[0]), int(g[1]))),
    (re.compile(r"^(vote)$"), lambda g: Label(g[0])),
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


def outer_claim(r: int) -> str:
    """Claimed by whoever queues round r's outer step (``--sync overlap`` gives it back when the
    step finds an upload lost, so the shard trained again queues it)."""
    return f"outer-r{r}"


def eval_claim(r: int) -> str:
    """Claimed once by whoever queues the evaluation of round r's weights."""
    return f"eval-r{r}"


def segment_claim(m: int, j: int) -> str:
    """Claimed once by whoever queues segment j of member m."""
    return f"m{m}/seg-{j}"


def backup_claim(r: int, k: int) -> str:
    """Claimed once by whoever queues the backup copy of shard k of round r."""
    return f"backup-r{r}-{k}"


def update_backup_claim(j: int) -> str:
    """Claimed once by whoever queues the backup copy of async update j."""
    return f"backup-u{j}"


VOTE_CLAIM = "vote"
