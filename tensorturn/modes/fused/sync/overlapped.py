"""``--sync overlap``: rounds whose communication runs while the next round trains — DiLoCo
with a one-step-delayed outer step (DiLoCoX's one-step delay) and an eager start (Streaming
DiLoCo's eager updates, arXiv 2502.12996, in spirit), defined by rounds alone.

Round r's shard k trains from θ_{r−1} minus its own pseudo-gradient of round r−1 — the weights its
last round ended at, moved by the outer step it has not yet seen applied (round 0 trains from
θ_0, round 1 continues from where round 0 ended) — and the outer step of round r applies the
average of round r's pseudo-gradients to θ_r:

    start_{r,k} = θ_{r−1} − Δ_{r−1,k}          θ_{r+1} = outer(θ_r, mean_k Δ_{r,k})

So round r+1 needs θ_r and the shard's own last output only: θ_r is computed (round r−1's outer
step) while round r trains, and the output is on the machine that made it (another machine
downloads it). Starting from θ_{r−1} alone (plain one-step delay) counts each round's progress
twice: on ``charlm`` its validation loss ended 20 % worse than with the eager start (BENCHMARKS).

A machine's upload does not hold it either: a shard task writes its pseudo-gradient to a local
file, hands it to a thread that uploads it under a lease of its own (``upload-r<r>-<k>``,
refreshed as a task's), and ends; the agent takes its next task while the bytes go up. Round r's
outer step is queued once every shard of the round ended its task and θ_r is stored, and waits
there for the uploads. An upload whose lease lapses (its agent died or lost the network) is a
shard trained again — from the same weights with the same seed, so the same bytes: whichever
machines ran it, and whatever died, the run's weights are the same.

The price is staleness: the outer step applies pseudo-gradients that did not see the last
average. ``--outer auto`` takes plain averaging (sgd) here: a Nesterov step one round late
overshoots.
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
from tensorturn.modes.fused.sync.rounds import (
    NOT_YET_S,
    Rounds,
    last_stored_round,
    queue_eval,
    queue_outer,
    queue_round,
    queue_shard,
)
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import Hedged, lease_client
from tensorturn.state.claims import Claims
from tensorturn.store import seals
from tensorturn.store.objects import Store, counted_apart
from tensorturn.store.tensorfile import TensorReader, delta_tensors
from tensorturn.store.tensors import StateDict
from tensorturn.tasks.attempt import Attempt, NotYet, Unit, agent_store
from tensorturn.train.diloco import apply_step

log = logging.getLogger(__name__)

UPLOAD_LOOK_S = 0.5  # how often (at most) a waiting task looks whether the outputs it needs are stored
BIND_GRACE_S = 1.0  # how long a shard waits for its last round's task to be bound to a machine
FIRST_LOOK_S = 0.02  # its first look's pause, doubled up to UPLOAD_LOOK_S (an upload on a LAN takes ms)


class Overlap(Rounds):
    """Rounds one step apart: round r trains from θ_{r−1} while round r−1's outputs go up and
    its outer step runs."""

    name = "overlap"

    def base_round(self, r: int) -> int:
        return max(r - 1, 0)

    def start(self, spec: RunSpec, store: Store, board: RunBoard) -> None:
        for r in range(min(2, options(spec).rounds)):  # both train from θ_0
            queue_round(spec, board, r)

    def resume(self, spec: RunSpec, store: Store, board: RunBoard) -> str:
        """Continue from the last round whose global weights are stored: θ_r lets rounds r and
        r+1 train; what of them is stored already is not redone, and what was handed over or
        uploading before is forgotten (those uploads' agents are gone: their tasks run again)."""
        r, rounds = last_stored_round(spec, store, board), options(spec).rounds
        board.claims.forget_uploads(spec.run_id, range(max(r - 1, 0), rounds), options(spec).shards)
        for n in range(r, min(r + 2, rounds)):
            queue_round(spec, board, n)
        queue_outer_when_ready(spec, store, board, r)  # its shards may all be stored already
        return f"resumed at round {r} of 0..{rounds - 1}, overlapped"

    def output_in_flight(self, board: RunBoard, spec: RunSpec, r: int, k: int) -> bool:
        return board.claims.uploading(spec.run_id, r, k)

    def await_global(self, unit: Unit, r: int) -> None:
        """(Round r+2 is queued once θ_{r+1} is stored: its base is there before it.)"""

    def shard_start(self, unit: Unit, r: int, k: int, theta: StateDict) -> tuple[StateDict, int]:
        """θ_{r−1} minus the shard's own pseudo-gradient of round r−1: the weights its last round
        ended at, moved by the outer steps it missed (round 0: θ_0)."""
        if r == 0:
            return theta, 0
        path, moved, local = own_output(unit, r - 1, k)
        try:
            start = dict(theta)
            with TensorReader(path) as f:
                for name, d in delta_tensors(f):  # θ + (−Δ): the arithmetic every machine uses
                    start.update(apply_step({name: theta[name]}, {name: -d}))
        finally:
            if local:
                kept.release(path)
            else:
                path.unlink(missing_ok=True)
        return start, moved

    def store_output(self, unit: Unit, r: int, k: int, key: str, path: Path) -> None:
        upload_in_background(unit, r, k, key, path)

    def shard_stored(self, board: RunBoard, spec: RunSpec, r: int, k: int, worker: str) -> None:
        """(Handed over in :func:`upload_in_background`, before the task ends.)"""

    def after_shard(self, spec: RunSpec, store: Store, board: RunBoard, r: int, k: int,
                    worker: str, here: Attempt | None = None) -> None:
        queue_outer_when_ready(spec, store, board, r)

    def after_outer(self, spec: RunSpec, board: RunBoard, r: int) -> None:
        """θ_{r+1} is stored (or this outer step ended without it: then nothing follows yet):
        round r+2 can train, round r+1's outer step run once its shards are in, and θ_{r+1} be
        evaluated."""
        store = agent_store()
        if not store.exists(layout.key("global", spec.run_id, r + 1)):
            return
        rounds = options(spec).rounds
        if r + 2 < rounds:
            queue_round(spec, board, r + 2)
        if r + 1 < rounds:  # the evaluation first: round r+1's outer step may end the run
            queue_eval(spec, board, r)
            queue_outer_when_ready(spec, store, board, r + 1)

    def await_round(self, unit: Unit, r: int) -> str | None:
        """Wait while round r's outputs upload. A shard whose upload's lease lapsed is trained
        again, and so is one taken back already: this outer step then ends (the shard's task
        queues it again once it is handed over)."""
        spec, store, board = unit.spec, unit.store, unit.board
        run_id, shards = spec.run_id, options(spec).shards
        board.mark_phase(run_id, str(unit.a.label), "waiting for uploads", unit.a.worker)
        pause = FIRST_LOOK_S
        while True:
            missing = [k for k in range(shards) if not store.exists(layout.key("shard", run_id, r, k))]
            if not missing:
                return None
            handed = board.claims.handed(run_id, r)
            again = [k for k in missing if k not in handed]  # taken back: trained again now
            lost = [k for k in missing if k in handed and not board.claims.uploading(run_id, r, k)
                    and not store.exists(layout.key("shard", run_id, r, k))]  # looked at after the lease
            if lost:
                again += train_again(spec, board, r, lost, unit.a.worker)
            if again:
                return f"shard {', '.join(map(str, sorted(set(again))))} of round {r}: upload lost, trained again"
            unit.a.check_cancelled()
            time.sleep(pause)
            pause = min(pause * 2, UPLOAD_LOOK_S)


def queue_outer_when_ready(spec: RunSpec, store: Store, board: RunBoard, r: int) -> None:
    """Queue round r's outer step, once, when θ_r is stored and every shard of the round ended
    its task (its output stored or uploading). Both facts are written before either side looks
    at the other's, so whichever comes last queues it."""
    run_id = spec.run_id
    if not store.exists(layout.key("global", run_id, r)):
        return
    handed = board.claims.handed(run_id, r)
    if any(k not in handed and not store.exists(layout.key("shard", run_id, r, k))
           for k in range(options(spec).shards)):
        return
    queue_outer(spec, board, r)


def train_again(spec: RunSpec, board: RunBoard, r: int, lost: list[int], worker: str) -> list[int]:
    """Shards of round r whose upload was lost: each taken back — by one caller only, who
    queues it as a named shard, its attempt given back (the loss was its machine's) — and the
    outer step's claim given back (the shard task that hands it over queues it again). Returns
    the shards this call took back."""
    run_id = spec.run_id
    taken = [k for k in lost if board.claims.take_back(run_id, r, k)]
    if not taken:
        return []
    board.release(run_id, layout.outer_claim(r))
    for k in taken:
        label = str(layout.shard_label(r, k))
        board.incident(run_id, "upload_lost", label, worker,
                       "its upload's lease lapsed before it was stored (its agent died or lost "
                       "the network): trained again, from the same weights and seed")
        board.attempt_log.give_back(run_id, label)
        queue_shard(spec, r, k)
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


kept = KeptOutputs()
uploads: set[threading.Thread] = set()  # this process's uploads in flight


def own_output(unit: Unit, r: int, k: int) -> tuple[Path, int, bool]:
    """Shard k's output of round r: (a file of it, bytes downloaded, whether it is a kept file
    of this process's, to release). Trained here: the file this process uploads or uploaded;
    else the stored one, waited for while its upload goes on, and while its task runs on
    another machine (a slot of round r is bound to it) for up to a lease (a second, while it is
    not bound: its slot may have just been taken). Not there otherwise — queued and not yet
    taken, or lost with its upload (then it is trained again) — this task
    is queued again in a few seconds rather than wait here (it may hold the only slot that
    would train it), and :class:`~tensorturn.tasks.attempt.NotYet` ends this attempt."""
    run_id, store, board = unit.spec.run_id, unit.store, unit.board
    local = kept.get(run_id, r, k)
    if local is not None:
        return local, 0, True
    key = layout.key("shard", run_id, r, k)
    pause, began = FIRST_LOOK_S, time.monotonic()
    lease_s = config.current().visibility_timeout_s
    while not store.exists(key):
        if not board.claims.uploading(run_id, r, k) and not store.exists(key):
            handed = k in board.claims.handed(run_id, r)
            # its task runs on another machine (a slot took it), or is about to (its slot was
            # taken a moment ago, not yet bound): wait, for up to a lease or BIND_GRACE_S
            if not handed and time.monotonic() - began < (
                    lease_s if k in board.claims.bound_shards(run_id, r) else BIND_GRACE_S):
                unit.a.check_cancelled()
                time.sleep(pause)
                pause = min(pause * 2, UPLOAD_LOOK_S)
                continue
            lost = handed and train_again(unit.spec, board, r, [k], unit.a.worker)
            queue_shard(unit.spec, r + 1, k, countdown=NOT_YET_S)
            raise NotYet(f"round {r + 1}'s shard {k} starts from shard {k} of round {r}, "
                         + ("whose upload was lost: trained again first" if lost else "not stored yet")
                         + f"; queued again in {NOT_YET_S:g} s")
        unit.a.check_cancelled()
        time.sleep(pause)
        pause = min(pause * 2, UPLOAD_LOOK_S)
    fd, name = tempfile.mkstemp(prefix=f"tt-own-{run_id}-r{r}-{k}-")
    os.close(fd)
    path = Path(name)
    seals.get_file(store, key, path)
    return path, path.stat().st_size, False


def upload_in_background(unit: Unit, r: int, k: int, key: str, path: Path) -> None:
    """Move the pseudo-gradient at ``path`` to a spool file and upload it in a thread of this
    process under a lease (refreshed every ``lease_refresh_s``, lasting ``visibility_timeout_s``
    unrefreshed) — the lease is held before this returns, so the shard's task can end now. An
    output stored meanwhile (another copy's) is not stored over; a failed upload is recorded,
    and its lease given back at once, so the outer step has the shard trained again."""
    settings = config.current()
    lease_s, refresh_s = settings.visibility_timeout_s, settings.lease_refresh_s
    fd, name = tempfile.mkstemp(prefix=f"tt-upload-{unit.spec.run_id}-r{r}-{k}-")
    os.close(fd)
    spool = Path(name)
    shutil.move(path, spool)
    run_id, board, store, worker = unit.spec.run_id, unit.board, unit.store, unit.a.worker
    token = f"{worker}#{uuid.uuid4().hex[:12]}"
    kept.keep(run_id, r, k, spool)  # the shard's next round here starts from it
    board.claims.hand_over(run_id, r, k, token, lease_s)

    def upload() -> None:
        done = threading.Event()

        def put() -> None:
            moved = [0, 0]
            try:
                if not store.exists(key):  # never over a stored output: it may be in use
                    with counted_apart() as moved:  # not in the task this process runs meanwhile
                        seals.put_file(store, key, spool)
            except Exception as exc:  # noqa: BLE001 - recorded; the outer step has it trained again
                log.warning("run %s: the upload of shard %d of round %d failed: %s", run_id, k, r, exc)
                try:
                    board.incident(run_id, "upload_failed", str(layout.shard_label(r, k)), worker,
                                   f"its upload failed: {mask_text(str(exc))}")
                except Exception:  # noqa: BLE001 - the broker is away too: the lease lapses
                    pass
            finally:
                done.set()
            try:
                board.add_store_bytes(run_id, moved[0], moved[1], worker)
            except Exception as exc:  # noqa: BLE001 - a figure; the broker may be away
                log.debug("upload bytes not recorded: %s", exc)

        threading.Thread(target=put, name=f"upload-{run_id}-r{r}-{k}", daemon=True).start()
        # this upload saturates the uplink the refreshes share: hedged (tensorturn.pool.lease),
        # on connections that give up after a lease
        hedged = Hedged(f"run {run_id}: the lease of shard {k} of round {r}'s upload")
        quick = Claims(lease_client(board.r, lease_s))
        try:
            while not done.wait(refresh_s):
                hedged.send(quick.refresh_upload, run_id, r, k, token, lease_s)
            board.claims.upload_ended(run_id, r, k, token)
        except Exception as exc:  # noqa: BLE001 - the broker is away: the lease lapses by itself
            log.warning("run %s: the lease of shard %d of round %d's upload: %s", run_id, k, r, exc)
        finally:
            hedged.close()
            kept.release(spool)
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
