"""The run board: one entry point to a run's live state in Redis, composed of the small classes
that each own one structure — :class:`~tensorturn.state.runs.Runs` (the run's hash, the list of
runs), :class:`~tensorturn.state.rounds.Rounds`, :class:`~tensorturn.state.members.Members`,
:class:`~tensorturn.state.attempts.Attempts`, :class:`~tensorturn.state.incidents.Incidents`,
:class:`~tensorturn.state.claims.Claims`, :class:`~tensorturn.state.announcements.Announcements`,
:class:`~tensorturn.state.uploads.UploadLeases`, :class:`~tensorturn.state.traffic.Traffic`, the live
hash (:class:`~tensorturn.state.live.Progress`) and the machines
(:class:`~tensorturn.state.workers.Workers`).

The board's own job is what spans them: a run finishing (its keys expire, leftovers are pruned),
a resume (the records rebuilt or reopened), and :meth:`RunBoard.describe` — the JSON that
``tensorturn run --json`` and ``status --json`` print. Its other methods are the structures' own,
by their old names, so that a task reads ``board.claim(...)``.

Everything here can be rebuilt from the store (``runs/<id>/manifest.json`` and the outputs), which
is what ``tensorturn resume`` does after Redis lost its data. A finished run's keys expire after
``TENSORTURN_RUN_TTL_S`` (:meth:`RunBoard.expire`); its manifest in the store keeps its record.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from tensorturn import config, layout
from tensorturn.config import mask_text
from tensorturn.spec import FINISHED, RunSpec, RunState
from tensorturn.state.announcements import Announcements
from tensorturn.state.attempts import Attempts, Figures
from tensorturn.state.claims import Claims
from tensorturn.state.housekeeping import maybe_prune
from tensorturn.state.incidents import Incidents
from tensorturn.state.live import Progress
from tensorturn.state.live import view as live_view
from tensorturn.state.members import Members
from tensorturn.state.rounds import Rounds
from tensorturn.state.runs import Runs, encode, read_state, state_of
from tensorturn.state.traffic import Traffic
from tensorturn.state.uploads import UploadLeases
from tensorturn.state.workers import Workers

# Read whole keys in one command. KEYS: the keys; ARGV: each key's kind, 'hash' or 'list'.
_READ_KEYS = """
local out = {}
for i, key in ipairs(KEYS) do
  if ARGV[i] == 'hash' then out[i] = redis.call('hgetall', key) else out[i] = redis.call('lrange', key, 0, -1) end
end
return out
"""


class Snapshot:
    """Some keys of a run as one command read them, answering the reads the state classes make
    of them (``hgetall``, ``hvals``, ``lrange``, ``exists``): ``RunBoard(snapshot)`` describes
    the run with each class's own parsing, in one round trip instead of one per key. Read-only."""

    def __init__(self, client: Any, hashes: list[str], lists: list[str]):
        keys = [*hashes, *lists]
        replies = client.eval(_READ_KEYS, len(keys), *keys, *(["hash"] * len(hashes) + ["list"] * len(lists)))
        self.hashes = {k: dict(zip(v[::2], v[1::2])) for k, v in zip(hashes, replies)}
        self.lists = dict(zip(lists, replies[len(hashes):]))

    def hgetall(self, key: str) -> dict[str, str]:
        return dict(self.hashes[key])

    def hvals(self, key: str) -> list[str]:
        return list(self.hashes[key].values())

    def lrange(self, key: str, start: int, end: int) -> list[str]:
        assert (start, end) == (0, -1), "a snapshot holds whole lists"
        return list(self.lists[key])

    def exists(self, key: str) -> int:
        return int(bool(self.hashes.get(key) or self.lists.get(key)))


class RunBoard:
    """Live run state in Redis (keys from :mod:`tensorturn.layout`). ``r`` is the client, for
    the classes of this package only (``tests/unit/test_layering.py``)."""

    def __init__(self, client: Any):
        self.r: Any = client  # decode_responses=True: every reply is str (the stubs cannot say)
        self.runs = Runs(client)
        self.incident_log = Incidents(client)
        self.attempt_log = Attempts(client, self.runs, self.incident_log)
        self.round_log = Rounds(client)
        self.member_log = Members(client)
        self.claims = Claims(client)
        self.announcements = Announcements(client)
        self.uploads = UploadLeases(client)
        self.traffic = Traffic(client)
        self.progress = Progress(client)
        self.workers = Workers(client)

    # -- the run --
    def create(self, spec: RunSpec, state: str = RunState.QUEUED) -> None:
        self.runs.create(spec, state)

    def update_spec(self, spec: RunSpec) -> None:
        self.runs.update_spec(spec)

    def exists(self, run_id: str) -> bool:
        """Whether the broker holds the run's record, whole (a partial hash is a lost record)."""
        return self.runs.record(run_id) is not None

    def state(self, run_id: str) -> str | None:
        """The run's state; None when the broker has no whole record of it."""
        return self.runs.state(run_id)

    def is_finished(self, run_id: str) -> bool:
        return self.state(run_id) in FINISHED

    def state_and_standing(self, run_id: str, worker: str) -> tuple[str | None, bool, str | None]:
        """The run's state, whether ``worker`` is out of rotation, and why it is paused (None
        when it is not), in one command."""
        reply = list(read_state(self.r, run_id, worker)) + [None, None]
        return state_of(reply), bool(reply[2]), reply[3] or None

    def mark_running(self, run_id: str, pipe: Any = None) -> None:
        self.runs.mark_running(run_id, pipe)

    def touch(self, run_id: str, pipe: Any = None) -> None:
        self.runs.touch(run_id, pipe)

    def finish(self, run_id: str, state: str, pipe: Any = None, **fields: Any) -> bool:
        """Move to a finished state once; later calls (a duplicate task) change nothing, nor
        does a call for a run without a whole record. Its keys then expire (:meth:`expire`).
        In ``pipe``, when given: then the answer is not known here (True), and the keys expire
        when the manifest holding the final state is saved
        (:func:`tensorturn.state.manifest.write_manifest`)."""
        finished = self.runs.finish(run_id, state, pipe, **fields)
        if finished and pipe is None:
            self.expire(run_id)
        return finished

    def fail(self, run_id: str, error: str) -> bool:
        return self.finish(run_id, RunState.FAILED, error=mask_text(error))

    def cancel(self, run_id: str, by: str) -> bool:
        """Cancel a live run (``by``: who asked, for ``status``); False if it had finished. No
        task of it starts afterwards, and running ones stop at their next look
        (:meth:`tensorturn.tasks.attempt.Attempt.check_cancelled`)."""
        return self.finish(run_id, RunState.CANCELLED, cancelled_by=mask_text(by))

    # -- how long the run's keys live --
    def keys(self, run_id: str) -> list[str]:
        return self.runs.keys(run_id)

    def expire(self, run_id: str) -> None:
        """Let every key of the finished run expire after ``TENSORTURN_RUN_TTL_S``: its record
        stays in the store's manifest, where ``status``, ``runs`` and ``report`` read it after.
        A run finishing is also when the pool's other leftovers are pruned, at most once an
        hour (:func:`tensorturn.state.housekeeping.maybe_prune`)."""
        self.runs.expire(run_id, max(1, int(config.current().run_ttl_s)))
        maybe_prune(self.r)

    def persist(self, run_id: str) -> None:
        self.runs.persist(run_id)

    def keep(self, run_id: str) -> None:
        """Keep every key of the run, marked ``kept``: its final manifest could not be saved,
        so the broker holds its only whole record (the prune leaves such a record alone,
        until a manifest is saved — :func:`tensorturn.state.manifest.write_manifest` — or `runs rm`)."""
        self.runs.keep(run_id)

    def forget(self, run_id: str) -> int:
        return self.runs.forget(run_id)

    # -- one-time claims and shards (Claims) --
    def claim(self, run_id: str, what: str) -> bool:
        return self.claims.claim(run_id, what)

    def release(self, run_id: str, what: str) -> None:
        self.claims.release(run_id, what)

    def once(self, run_id: str, what: str, dispatch: Callable[[], Any]) -> bool:
        return self.claims.once(run_id, what, dispatch)

    def claim_shard(self, run_id: str, r: int, slot: int, worker: str, shards: int,
                    held: Iterable[int] = ()) -> int:
        return self.claims.claim_shard(run_id, r, slot, worker, shards, held)

    def shard_owners(self, run_id: str) -> dict[int, str]:
        return self.claims.shard_owners(run_id)

    def unclaimed_shards(self, run_id: str, r: int, shards: int) -> list[int]:
        return self.claims.unclaimed_shards(run_id, r, shards)

    def forget_rounds(self, run_id: str, rounds: range) -> None:
        """No shard of ``rounds`` counted stored, and nothing announced of them (a resume: their
        tasks mark what is stored again, so a shard lost from the store is not counted); one
        round trip."""
        pipe = self.r.pipeline(transaction=False)
        self.claims.forget_stored(run_id, rounds, pipe)
        self.announcements.forget(run_id, rounds, pipe)
        pipe.execute()

    # -- rounds, and what running tasks report --
    def record_round(self, run_id: str, round_: int, info: dict[str, Any]) -> None:
        """Record round ``round_``; the live phases of its outer step and evaluation go with it
        (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        self.round_log.record(run_id, round_, info, pipe)
        self.progress.clear(run_id, pipe, str(layout.outer_label(round_)), str(layout.eval_label(round_)))
        self.runs.touch(run_id, pipe)
        pipe.execute()

    def has_round(self, run_id: str, round_: int) -> bool:
        return self.round_log.has(run_id, round_)

    def rounds(self, run_id: str) -> list[dict[str, Any]]:
        return self.round_log.all(run_id)

    def mark_phase(self, run_id: str, label: str, phase: str, worker: str) -> None:
        self.progress.mark_phase(run_id, label, phase, worker)

    def live(self, run_id: str) -> dict[str, dict[str, Any]]:
        return self.progress.entries(run_id)

    # -- ensemble members --
    def record_member(self, run_id: str, member: int, info: dict[str, Any]) -> None:
        self.member_log.record(run_id, member, info)

    def update_member(self, run_id: str, member: int, **fields: Any) -> dict[str, Any]:
        return self.member_log.update(run_id, member, **fields)

    def member(self, run_id: str, member: int) -> dict[str, Any]:
        return self.member_log.get(run_id, member)

    def members(self, run_id: str) -> list[dict[str, Any]]:
        return self.member_log.all(run_id)

    def member_done(self, run_id: str, member: int) -> int:
        """Mark a member finished (succeeded or dropped) once; returns how many are finished."""
        done = self.member_log.done(run_id, member)
        self.runs.touch(run_id)
        return done

    # -- bytes moved (Traffic) --
    def add_bytes(self, run_id: str, task: str, up: int, down: int, pipe: Any = None) -> None:
        self.traffic.add_bytes(run_id, task, up, down, pipe)

    def add_store_bytes(self, run_id: str, up: int, down: int, worker: str, pipe: Any = None) -> None:
        self.traffic.add_store_bytes(run_id, up, down, worker, pipe)

    def add_data_bytes(self, run_id: str, worker: str, downloaded: int, read: int = 0) -> None:
        self.traffic.add_data_bytes(run_id, worker, downloaded, read)

    # -- attempts and incidents --
    def begin_attempt(self, run_id: str, task: str, worker: str, max_attempts: int,
                      lease: str | None = None, lease_s: float = 0.0) -> tuple[str, int, str | None] | None:
        return self.attempt_log.begin(run_id, task, worker, max_attempts, lease, lease_s)

    def finish_attempt(self, run_id: str, key: str, outcome: str,
                       also: Callable[[Any], None] | None = None,
                       traceback: str | None = None, figures: Figures | None = None) -> None:
        self.attempt_log.finish(run_id, key, outcome, also, traceback, figures)

    def attempts(self, run_id: str) -> list[dict[str, Any]]:
        return self.attempt_log.all(run_id)

    def has_succeeded(self, run_id: str, task: str) -> bool:
        return self.attempt_log.has_succeeded(run_id, task)

    def incident(self, run_id: str, kind: str, task: str, worker: str | None, detail: str) -> None:
        self.incident_log.add(run_id, kind, task, worker, detail)

    def incidents(self, run_id: str) -> list[dict[str, Any]]:
        return self.incident_log.all(run_id)

    def warn(self, run_id: str, text: str) -> None:
        self.incident_log.warn(run_id, text)

    def warnings(self, run_id: str) -> list[str]:
        return self.incident_log.warnings(run_id)

    # -- resuming --
    def restore(self, spec: RunSpec, doc: dict[str, Any] | None) -> None:
        """Re-create a run's records from its last manifest (or from the spec alone), in place
        of whatever is left of them (the keys a task still wrote after the record was lost)."""
        self.forget(spec.run_id)
        self.create(spec, state=RunState.RUNNING)
        if not doc:
            return
        pipe = self.r.pipeline()
        for r in doc.get("rounds", []):
            self.round_log.record(spec.run_id, r["round"], r, pipe)
        self.attempt_log.restore(spec.run_id, doc.get("attempts", []), pipe)
        self.incident_log.restore(spec.run_id, doc.get("incidents", []), pipe)
        for m in doc.get("members", []):
            self.member_log.record(spec.run_id, m["member"], m, pipe)
        pipe.execute()

    def reopen(self, run_id: str) -> None:
        """Back to running for a resume: clear the one-time claims and any failure, and give
        every task a fresh allowance of attempts (the cause of the failure was fixed). Its keys
        no longer expire."""
        self.persist(run_id)
        pipe = self.r.pipeline()
        self.claims.clear(run_id, pipe)
        self.progress.forget(run_id, pipe)
        self.attempt_log.fresh_allowance(run_id, pipe)
        self.runs.reopen(run_id, pipe)
        pipe.execute()

    # -- reading --
    def list_runs(self, limit: int = 50) -> list[dict[str, Any]]:
        return self.runs.list_runs(limit)

    def live_specs(self) -> dict[str, dict[str, Any]]:
        return self.runs.live_specs()

    def absent(self, run_id: str) -> str:
        return self.runs.absent(run_id)

    def describe(self, run_id: str) -> dict[str, Any]:
        """The run as the CLI/JSON contract shows it, read in one command (:class:`Snapshot`:
        ``run`` and ``status`` poll it, and every outer step saves it in the manifest)."""
        return RunBoard(self._snapshot(run_id))._describe(run_id)

    def describe_finished(self, run_id: str, state: str, **fields: Any) -> dict[str, Any]:
        """The run as :meth:`describe` will show it once :meth:`finish` (``state``, ``fields``)
        has moved it: what its manifest holds before the board says it
        (:func:`tensorturn.state.manifest.end_run`). A run finished already is described as it is."""
        snap = self._snapshot(run_id)
        h = snap.hashes[layout.run_key(run_id)]
        if h.get("state") not in FINISHED:
            h.update({k: str(v) for k, v in encode(fields).items()}, state=str(state))
            snap.hashes[layout.live_key(run_id)] = {}  # a finished run's live progress goes with it
        return RunBoard(snap)._describe(run_id)

    def _snapshot(self, run_id: str) -> Snapshot:
        hashes = [layout.run_key(run_id)] + [layout.run_key(run_id, part) for part in (
            "bytes", "store_bytes", "rounds", "attempts", "data_bytes", "data_read", "applied", "members")]
        hashes.append(layout.live_key(run_id))
        lists = [layout.run_key(run_id, part) for part in ("incidents", "warnings")]
        return Snapshot(self.r, hashes, lists)

    def _describe(self, run_id: str) -> dict[str, Any]:
        h = self.runs.hash(run_id)
        spec = json.loads(h["spec"])
        bytes_up, bytes_down = self.traffic.bytes_moved(run_id)
        store_up, store_down = self.traffic.store_bytes(run_id)
        out: dict[str, Any] = {
            "run_id": run_id,
            "mode": h["mode"],
            "state": h["state"],
            "recipe": spec["recipe"],
            "metrics": json.loads(h.get("metrics", "{}")),
            "model_uri": h.get("model_uri"),
            "model_sha256": h.get("model_sha256"),
            "rounds": self.rounds(run_id),
            "attempts": self.attempts(run_id),
            "incidents": self.incidents(run_id),
            "warnings": self.warnings(run_id),
            "data_bytes": self.traffic.data_bytes(run_id),
            "data_read_bytes": self.traffic.data_bytes(run_id, "data_read"),
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            # every object body the run's tasks stored and fetched (θ, outer state, evaluation
            # and dataset reads, retries, its start): what its agents moved through the store
            "store_bytes_up": store_up,
            "store_bytes_down": store_down,
            "store_bytes_by_worker": self.traffic.store_bytes_by_worker(run_id),
            "created_at": float(h["created_at"]),
            "started_at": float(h["started_at"]) if "started_at" in h else None,
            "finished_at": float(h["finished_at"]) if "finished_at" in h else None,
            "progress_at": float(h["progress_at"]) if "progress_at" in h else None,
            "error": h.get("error"),
            "spec": spec,
        }
        # the agents that ran its tasks (training, outer steps, evaluation): `run` says how many
        out["agents"] = sorted({a["worker"] for a in out["attempts"] if a.get("worker")})
        if h["state"] == RunState.CANCELLED:
            out["cancelled"] = {"at": out["finished_at"], "by": h.get("cancelled_by")}
        if h["mode"] == "ensemble":
            out["members"] = self.members(run_id)
        if h["state"] not in FINISHED:  # what its running tasks are doing now
            out.update(live_view(out, self.live(run_id)))
        if spec["recipe"] == "distill":  # a student of an ensemble: where it came from
            o = spec.get("recipe_options") or {}
            out["lineage"] = {"distilled_from": o.get("teacher"), "recipe": o.get("recipe"),
                              "temperature": o.get("temperature"), "alpha": o.get("alpha"),
                              "top_k": o.get("top_k"), "mixup": o.get("mixup", 0),
                              "student": o.get("student") or {}}
        applied = self.r.hvals(layout.run_key(run_id, "applied"))
        if applied:  # an asynchronous fused run: every update, with its staleness
            out["updates"] = sorted((json.loads(v) for v in applied), key=lambda u: u["version"])
        return out
