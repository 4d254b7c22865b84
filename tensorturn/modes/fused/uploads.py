"""A shard's output uploaded while the next work goes on (``--sync overlap``'s mechanism): the
pseudo-gradient written to a local file, handed to a thread that uploads it under a lease of its
own (``upload-r<r>-<k>``, refreshed as a task's), and the task ends; the agent takes its next
task while the bytes go up. The shard's next round here starts from that file
(:data:`own_outputs`, :func:`start_from_own`); another machine downloads it once stored.

An upload whose lease lapses (its agent died or lost the network) is a shard trained again
(:func:`train_again`) — from the same weights with the same seed, so the same bytes: whichever
machines ran it, and whatever died, the run's weights are the same. The outer step waits for
the round's uploads (:func:`await_uploads`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

from celery.signals import worker_process_shutdown, worker_shutdown

from tensorturn import config, layout
from tensorturn.config import mask_text
from tensorturn.modes.fused.options import options
from tensorturn.modes.fused.plans import NOT_YET_S, QueueShard, ShardDone, Wires
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import Hedged, lease_client
from tensorturn.state.uploads import UploadLeases
from tensorturn.store import seals
from tensorturn.store.objects import counted_apart
from tensorturn.store.tensorfile import TensorReader, delta_tensors
from tensorturn.store.tensors import StateDict
from tensorturn.tasks.attempt import NotYet, Unit
from tensorturn.train.diloco import apply_step

log = logging.getLogger(__name__)

UPLOAD_LOOK_S = 0.5  # how often (at most) a waiting task looks whether the outputs it needs are stored
BIND_GRACE_S = 1.0  # how long a shard waits for its last round's task to be bound to a machine


def in_flight(board: RunBoard, spec: RunSpec, r: int, k: int) -> bool:
    """Whether shard k of round r's output is on its way to the store (its upload's lease held)."""
    return board.uploads.uploading(spec.run_id, r, k)


def start_from_own(unit: Unit, wires: Wires, r: int, k: int, theta: StateDict) -> tuple[StateDict, int]:
    """θ_{r−1} (``theta``, not to be changed: it is cached) minus the shard's own pseudo-gradient
    of round r−1: the weights its last round ended at, moved by the outer steps it missed
    (round 0: θ_0); and the bytes that took to download."""
    if r == 0:
        return theta, 0
    path, moved, local = own_output(unit, wires, r - 1, k)
    try:
        start = dict(theta)
        with TensorReader(path) as f:
            for name, d in delta_tensors(f):  # θ + (−Δ): the arithmetic every machine uses
                start.update(apply_step({name: theta[name]}, {name: -d}))
    finally:
        if local:
            own_outputs.release(path)
        else:
            path.unlink(missing_ok=True)
    return start, moved


def await_uploads(unit: Unit, wires: Wires, r: int) -> str | None:
    """Before round r's outer step averages: wait while the round's outputs upload; None once
    every one is stored. A shard whose upload's lease lapsed is trained again, and so is one
    taken back already: then why the outer step ends without stepping (the shard's task queues
    it again once it is handed over)."""
    spec, store, board = unit.spec, unit.store, unit.board
    run_id, shards = spec.run_id, options(spec).shards
    board.progress.mark_phase(run_id, str(unit.a.label), "waiting for uploads", unit.a.worker)
    for _ in unit.a.waits(cap=UPLOAD_LOOK_S):
        missing = [k for k in range(shards) if not store.exists(layout.key("shard", run_id, r, k))]
        if not missing:
            return None
        handed = board.uploads.handed(run_id, r)
        again = [k for k in missing if k not in handed]  # taken back: trained again now
        lost = [k for k in missing if k in handed and not board.uploads.uploading(run_id, r, k)
                and not store.exists(layout.key("shard", run_id, r, k))]  # looked at after the lease
        if lost:
            again += train_again(wires, spec, board, r, lost, unit.a.worker)
        if again:
            return f"shard {', '.join(map(str, sorted(set(again))))} of round {r}: upload lost, trained again"
    raise AssertionError("unreachable")  # (poll never ends by itself)


def train_again(wires: Wires, spec: RunSpec, board: RunBoard, r: int, lost: list[int], worker: str) -> list[int]:
    """Shards of round r whose upload was lost: each taken back — by one caller only, who
    queues it as a named shard, its attempt given back (the loss was its machine's) — and the
    outer step's claim given back (the shard task that hands it over queues it again). Returns
    the shards this call took back."""
    run_id = spec.run_id
    taken = [k for k in lost if board.uploads.take_back(run_id, r, k)]
    if not taken:
        return []
    board.claims.release(run_id, layout.outer_claim(r))
    for k in taken:
        label = str(layout.shard_label(r, k))
        board.incidents.add(run_id, "upload_lost", label, worker,
                            "its upload's lease lapsed before it was stored (its agent died or lost "
                            "the network): trained again, from the same weights and seed")
        board.attempts.give_back(run_id, label)
        wires.queue([QueueShard(r, k)])
    return taken


class KeptOutputs:
    """This process's own shard outputs of the last rounds, as uploaded (the files), so the
    shard's next round starts from them without a download when it runs here. A file in use
    (uploading, or being read) is deleted only once it is released."""

    def __init__(self, rounds: int = 2, runs: int = 2):
        self.rounds, self.runs = rounds, runs
        self.files: dict[tuple[str, int, int], Path] = {}  # in the order they were kept
        self.busy: dict[Path, int] = {}
        self.dropped: set[Path] = set()
        self.lock = threading.Lock()

    def keep(self, run_id: str, r: int, k: int, path: Path) -> None:
        """Keep shard k's output of round r, in use until released; forget this run's older
        than r−1, and every file of runs before the last ``runs`` kept here."""
        with self.lock:
            self.busy[path] = self.busy.get(path, 0) + 1
            replaced = self.files.pop((run_id, r, k), None)
            if replaced is not None and replaced != path:
                self._drop(replaced)
            self.files[(run_id, r, k)] = path
            recent = list(dict.fromkeys(key[0] for key in reversed(self.files)))[:self.runs]
            for old in [key for key in self.files
                        if key[0] not in recent or (key[0] == run_id and key[1] <= r - self.rounds)]:
                self._drop(self.files.pop(old))

    def get(self, run_id: str, r: int, k: int) -> Path | None:
        """The kept file, in use until released; None if there is none here."""
        with self.lock:
            path = self.files.get((run_id, r, k))
            if path is None or not path.exists():
                return None
            self.busy[path] = self.busy.get(path, 0) + 1
            return path

    def release(self, path: Path) -> None:
        with self.lock:
            self.busy[path] = self.busy.get(path, 1) - 1
            if self.busy[path] <= 0:
                del self.busy[path]
                if path in self.dropped:
                    self.dropped.discard(path)
                    path.unlink(missing_ok=True)

    def _drop(self, path: Path) -> None:
        if path in self.busy:
            self.dropped.add(path)  # deleted when released
        else:
            path.unlink(missing_ok=True)


own_outputs = KeptOutputs()
uploads: set[threading.Thread] = set()  # this process's uploads in flight


def own_output(unit: Unit, wires: Wires, r: int, k: int) -> tuple[Path, int, bool]:
    """Shard k's output of round r: (a file of it, bytes downloaded, whether it is a kept file
    of this process's, to release). Trained here: the file this process uploads or uploaded;
    else the stored one, waited for while its upload goes on, and while its task runs on
    another machine (a slot of round r is bound to it) for up to a lease (a second, while it is
    not bound: its slot may have just been taken). Not there otherwise — queued and not yet
    taken, or lost with its upload (then it is trained again) — this task
    is queued again in a few seconds rather than wait here (it may hold the only slot that
    would train it), and :class:`~tensorturn.tasks.attempt.NotYet` ends this attempt."""
    run_id, store, board = unit.spec.run_id, unit.store, unit.board
    local = own_outputs.get(run_id, r, k)
    if local is not None:
        return local, 0, True
    key = layout.key("shard", run_id, r, k)
    began, lease_s = time.monotonic(), config.current().visibility_timeout_s
    for _ in unit.a.waits(cap=UPLOAD_LOOK_S):
        if store.exists(key):
            break
        # handed first: a hand-over sets the upload's lease with it, and the lease goes only once
        # the output is stored or its upload failed or lapsed — read the other way round, a
        # hand-over between the two looks reads as an upload lost
        handed = k in board.uploads.handed(run_id, r)
        if board.uploads.uploading(run_id, r, k) or store.exists(key):
            continue
        # its task runs on another machine (a slot took it), or is about to (its slot was
        # taken a moment ago, not yet bound): wait, for up to a lease or BIND_GRACE_S
        if not handed and time.monotonic() - began < (
                lease_s if k in board.claims.bound_shards(run_id, r) else BIND_GRACE_S):
            continue
        lost = handed and train_again(wires, unit.spec, board, r, [k], unit.a.worker)
        wires.queue([QueueShard(r + 1, k, countdown=NOT_YET_S)])
        raise NotYet(f"round {r + 1}'s shard {k} starts from shard {k} of round {r}, "
                     + ("whose upload was lost: trained again first" if lost else "not stored yet")
                     + f"; queued again in {NOT_YET_S:g} s")
    fd, name = tempfile.mkstemp(prefix=f"tt-own-{run_id}-r{r}-{k}-")
    os.close(fd)
    path = Path(name)
    seals.get_file(store, key, path)
    return path, path.stat().st_size, False


def upload_in_background(unit: Unit, wires: Wires, r: int, k: int, key: str, path: Path) -> None:
    """Move the pseudo-gradient at ``path`` to a spool file and upload it in a thread of this
    process under a lease (refreshed every ``lease_refresh_s``, lasting ``visibility_timeout_s``
    unrefreshed) — the lease is held before this returns, so the shard's task can end now. An
    output stored meanwhile (another copy's) is not stored over; a failed upload is recorded,
    and its lease given back at once, so the outer step has the shard trained again.

    Once stored, the output is handed to the run's policy again (``wires.follow``, as the
    shard's task did when it ended): what follows is queued once, by one-time claims, so this
    costs a look when the task queued it already — and when it could not, it is queued now. (The
    task's look can come too early: a shard taken back as lost while its upload still went on,
    whose copy trained again found it in flight and did nothing, left the round's outer step
    queued by no one.)"""
    settings = config.current()
    lease_s, refresh_s = settings.visibility_timeout_s, settings.lease_refresh_s
    fd, name = tempfile.mkstemp(prefix=f"tt-upload-{unit.spec.run_id}-r{r}-{k}-")
    os.close(fd)
    spool = Path(name)
    shutil.move(path, spool)
    run_id, board, store, worker = unit.spec.run_id, unit.board, unit.store, unit.a.worker
    token = f"{worker}#{uuid.uuid4().hex[:12]}"
    own_outputs.keep(run_id, r, k, spool)  # the shard's next round here starts from it
    board.uploads.hand_over(run_id, r, k, token, lease_s)

    def upload() -> None:
        done, stored = threading.Event(), threading.Event()

        def put() -> None:
            moved = [0, 0]
            try:
                if not store.exists(key):  # never over a stored output: it may be in use
                    with counted_apart() as moved:  # not in the task this process runs meanwhile
                        seals.put_file(store, key, spool)
                stored.set()
            except Exception as exc:  # noqa: BLE001 - recorded; the outer step has it trained again
                log.warning("run %s: the upload of shard %d of round %d failed: %s", run_id, k, r, exc)
                try:
                    board.incidents.add(run_id, "upload_failed", str(layout.shard_label(r, k)), worker,
                                        f"its upload failed: {mask_text(str(exc))}")
                except Exception:  # noqa: BLE001 - the broker is away too: the lease lapses
                    pass
            finally:
                done.set()
            try:
                board.traffic.add_store_bytes(run_id, moved[0], moved[1], worker)
            except Exception as exc:  # noqa: BLE001 - a figure; the broker may be away
                log.debug("upload bytes not recorded: %s", exc)

        threading.Thread(target=put, name=f"upload-{run_id}-r{r}-{k}", daemon=True).start()
        # this upload saturates the uplink the refreshes share: hedged (tensorturn.pool.lease),
        # on connections that give up after a lease
        hedged = Hedged(f"run {run_id}: the lease of shard {k} of round {r}'s upload")
        quick = UploadLeases(lease_client(board.r, lease_s))
        try:
            while not done.wait(refresh_s):
                hedged.send(quick.refresh_upload, run_id, r, k, token, lease_s)
            board.uploads.upload_ended(run_id, r, k, token)
            if stored.is_set():
                wires.follow(ShardDone(r, k, worker))
        except Exception as exc:  # noqa: BLE001 - the broker is away: the lease lapses by itself, and
            # what follows the shard was queued by its task where it could be
            log.warning("run %s: the upload of shard %d of round %d, after it: %s", run_id, k, r, exc)
        finally:
            hedged.close()
            own_outputs.release(spool)
            uploads.discard(threading.current_thread())

    thread = threading.Thread(target=upload, name=f"lease-{run_id}-r{r}-{k}", daemon=True)
    uploads.add(thread)
    thread.start()


@worker_process_shutdown.connect
@worker_shutdown.connect  # the threads pool: its uploads are the agent's process's own
def _finish_uploads(**_: object) -> None:
    """A pool process ending (the agent stopping) finishes its uploads first, for as long as a
    stop may take: one cut off is a shard trained again."""
    deadline = time.monotonic() + config.current().shutdown_grace_s
    for thread in list(uploads):
        thread.join(max(0.0, deadline - time.monotonic()))
