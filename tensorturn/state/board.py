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
``tensorturn run --json`` and ``status --json`` print. Everything else is the structure's own,
called through it: ``board.claims.claim(...)``, ``board.members.all(...)``.

Everything here can be rebuilt from the store (``runs/<id>/manifest.json`` and the outputs), which
is what ``tensorturn resume`` does after Redis lost its data. A finished run's keys expire after
``TENSORTURN_RUN_TTL_S`` (:meth:`RunBoard.expire`); its manifest in the store keeps its record.
"""

from __future__ import annotations

import json
from typing import Any

from tensorturn import config, layout
from tensorturn.config import mask_text
from tensorturn.spec import FINISHED, RunSpec, RunState
from tensorturn.state.announcements import Announcements
from tensorturn.state.attempts import Attempts
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
from tensorturn.state.workers import Workers, take_caps

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
        self.incidents = Incidents(client)
        self.attempts = Attempts(client, self.runs, self.incidents)
        self.rounds = Rounds(client)
        self.members = Members(client)
        self.claims = Claims(client)
        self.announcements = Announcements(client)
        self.uploads = UploadLeases(client)
        self.traffic = Traffic(client)
        self.progress = Progress(client)
        self.workers = Workers(client)

    # -- the run --
    def state_and_standing(self, run_id: str, worker: str) -> tuple[str | None, bool, str | None]:
        """The run's state, whether ``worker`` is out of rotation, and why it is paused (None
        when it is not), in one command. The same command reads the owner's caps on the store
        link from ``worker``'s heartbeat and hands them to this process's store
        (:func:`tensorturn.state.workers.take_caps`): a task's transfers keep to the rules its
        owner set while it waited in the queue."""
        reply = list(read_state(self.r, run_id, worker)) + [None] * 4
        take_caps(reply[4], reply[5])
        return state_of(reply), bool(reply[2]), reply[3] or None

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
    def expire(self, run_id: str) -> None:
        """Let every key of the finished run expire after ``TENSORTURN_RUN_TTL_S``: its record
        stays in the store's manifest, where ``status``, ``runs`` and ``report`` read it after.
        A run finishing is also when the pool's other leftovers are pruned, at most once an
        hour (:func:`tensorturn.state.housekeeping.maybe_prune`)."""
        self.runs.expire(run_id, max(1, int(config.current().run_ttl_s)))
        maybe_prune(self.r)

    # -- one-time claims and shards (Claims) --
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
        self.rounds.record(run_id, round_, info, pipe)
        self.progress.clear(run_id, pipe, str(layout.outer_label(round_)), str(layout.eval_label(round_)))
        self.runs.touch(run_id, pipe)
        pipe.execute()

    # -- ensemble members --
    def member_done(self, run_id: str, member: int) -> int:
        """Mark a member finished (succeeded or dropped) once; returns how many are finished."""
        done = self.members.done(run_id, member)
        self.runs.touch(run_id)
        return done

    # -- resuming --
    def restore(self, spec: RunSpec, doc: dict[str, Any] | None) -> None:
        """Re-create a run's records from its last manifest (or from the spec alone), in place
        of whatever is left of them (the keys a task still wrote after the record was lost)."""
        self.runs.forget(spec.run_id)
        self.runs.create(spec, state=RunState.RUNNING)
        if not doc:
            return
        pipe = self.r.pipeline()
        for r in doc.get("rounds", []):
            self.rounds.record(spec.run_id, r["round"], r, pipe)
        self.attempts.restore(spec.run_id, doc.get("attempts", []), pipe)
        self.incidents.restore(spec.run_id, doc.get("incidents", []), pipe)
        for m in doc.get("members", []):
            self.members.record(spec.run_id, m["member"], m, pipe)
        pipe.execute()

    def reopen(self, run_id: str) -> None:
        """Back to running for a resume: clear the one-time claims and any failure, and give
        every task a fresh allowance of attempts (the cause of the failure was fixed). Its keys
        no longer expire."""
        self.runs.persist(run_id)
        pipe = self.r.pipeline()
        self.claims.clear(run_id, pipe)
        self.progress.forget(run_id, pipe)
        self.attempts.fresh_allowance(run_id, pipe)
        self.runs.reopen(run_id, pipe)
        pipe.execute()

    # -- reading --
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
            "rounds": self.rounds.all(run_id),
            "attempts": self.attempts.all(run_id),
            "incidents": self.incidents.all(run_id),
            "warnings": self.incidents.warnings(run_id),
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
            out["members"] = self.members.all(run_id)
        if h["state"] not in FINISHED:  # what its running tasks are doing now
            out.update(live_view(out, self.progress.entries(run_id)))
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
