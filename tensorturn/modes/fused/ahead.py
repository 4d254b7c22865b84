"""What a slot standing by to take a round's outer step reads of the step's inputs while the
round's last shard still trains (:class:`ReadAhead`), what an outer step keeps of its own
outputs for the next (:class:`KeptFiles`), and how the step reads a sealed object
(:data:`Fetch`)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from celery.signals import worker_process_shutdown, worker_shutdown

from tensorturn import layout
from tensorturn.spec import RunSpec
from tensorturn.store import seals
from tensorturn.store.objects import Store

log = logging.getLogger(__name__)

Fetch = Callable[[Store, str, Path], str]  # a sealed object to a local file; its sha256


class ReadAhead:
    """What a slot standing by to take round r's outer step
    (:func:`~tensorturn.modes.fused.standby.take_step`) reads of the step's inputs while the
    round's last shard still trains — the shards stored so far, θ_r, its outer state — each
    downloaded and checked against its seal once, into a folder of its own, and handed to the
    step (:meth:`fetch`) when it begins: at the round's end the step then downloads the last
    shard's file only (the other shards' headers are still looked up; a slot stands by once
    rounds end within ``TENSORTURN_QUICK_END_S``). About :data:`READ_AHEAD_BYTES` at most are
    held. θ_r and the outer state are never rewritten; a shard's file is stored once, or — two
    copies of its task racing — twice with the same pseudo-gradient (its header's download
    figure may differ), so a file read ahead gives the step the same weights."""

    def __init__(self, spec: RunSpec, store: Store, r: int, check: Callable[[], None] = lambda: None):
        """``check``: the slot's cancel and pause look, called before each download (a big
        model's files take a while on a home link; it keeps its own pace); what it raises stops
        the slot, as it would between its looks at the broker."""
        self.spec, self.store, self.r, self.check = spec, store, r, check
        self.folder: Path | None = None
        self.files: dict[str, tuple[Path, str]] = {}  # key → (its file here, its sha256)
        self.held = 0  # bytes
        self.stopped = False
        self.absent: set[str] = set()  # keys looked up and not stored (a run without outer state)

    def read(self, stored: set[int]) -> None:
        """Read what is not read yet of the step's inputs: the shards in ``stored``, then θ_r
        and its outer state (if stored). A failure stops the reading ahead, logged: the step
        reads the object itself, and meets the failure there if it lasts."""
        run_id, r = self.spec.run_id, self.r
        keys = [layout.key("shard", run_id, r, k) for k in sorted(stored)] + [layout.key("global", run_id, r)]
        state = layout.key("outer", run_id, r) if r > 0 else None
        if state is not None:
            keys.append(state)  # (where the run keeps one: looked up once)
        for key in keys:
            if self.stopped or self.held >= READ_AHEAD_BYTES:
                return
            if key in self.files or key in self.absent:
                continue
            self.check()
            try:
                if key == state and not self.store.exists(key):
                    self.absent.add(key)
                    continue
                if self.folder is None:
                    self.folder = Path(tempfile.mkdtemp(prefix="tt-ahead-"))
                path = self.folder / f"{len(self.files)}"
                self.files[key] = (path, seals.get_file(self.store, key, path))
                self.held += path.stat().st_size
            except Exception as exc:  # noqa: BLE001 - only an optimisation: the step reads it again
                self.stopped = True
                log.info("run %s: reading round %d's step inputs ahead stopped (%s)", run_id, r, exc)

    def fetch(self, store: Store, key: str, path: Path) -> str:
        """:func:`seals.get_file`, from what was read ahead where it can."""
        if key not in self.files:
            return seals.get_file(store, key, path)
        held, sha = self.files.pop(key)
        shutil.move(held, path)
        return sha

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder, self.files = None, {}


READ_AHEAD_BYTES = 2 * 1024 ** 3  # (a file is read whole once begun: it may hold one file more)


class KeptFiles:
    """The outer step's own outputs — θ_{r+1} and its outer state — kept on this machine once
    stored, so that this agent's next step reads them here instead of downloading them again:
    for an 86M model with a compressed broadcast, 1 GB a round not read back from the store
    (BENCHMARKS §18). A kept file is the very file whose sha256 was sealed (kept read-only); it
    is used only while the run holds a seal for those bytes at its key, else downloaded. Only
    the latest of each kind is kept (one run's θ and state)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.folder: Path | None = None
        self.files: dict[str, tuple[str, Path, str]] = {}  # key → (its kind, its file here, its sha256)

    def keep(self, kind: str, key: str, path: Path, sha256: str) -> None:
        """Keep ``path`` (stored at ``key`` with ``sha256``; left in place: a hard link, or a
        copy across file systems) in place of the kept file of the same ``kind``; only a saving:
        a failure is logged, and the next step downloads it."""
        try:
            with self.lock:
                if self.folder is None or not self.folder.exists():
                    self.folder = Path(tempfile.mkdtemp(prefix="tt-kept-"))
                for old in [k for k, (knd, _, _) in self.files.items() if knd == kind]:
                    self.files.pop(old)[1].unlink(missing_ok=True)
                held = self.folder / f"{kind}-{sha256[:16]}-{len(os.listdir(self.folder))}"
                try:
                    os.link(path, held)
                except OSError:
                    shutil.copyfile(path, held)
                held.chmod(0o444)  # (the step's own file too, when linked: nothing writes it again)
                self.files[key] = (kind, held, sha256)
        except Exception as exc:  # noqa: BLE001 - only a saving: the next step downloads it
            log.info("the outer step's %s not kept here (%s); the next step downloads it", kind, exc)

    def fetch(self, fallback: Fetch) -> Fetch:
        """``fallback``, but a file kept here is read here while the run holds its seal."""
        def read(store: Store, key: str, path: Path) -> str:
            with self.lock:
                kept = self.files.get(key)
            if kept is None:
                return fallback(store, key, path)
            try:
                seals.check(store, key, kept[2])  # the run stored these very bytes at this key
                try:
                    os.link(kept[1], path)
                except OSError:
                    shutil.copyfile(kept[1], path)
            except (seals.TamperedObject, OSError):  # not what the run holds now, or gone: download
                with self.lock:
                    if self.files.get(key) == kept:
                        self.files.pop(key)
                        kept[1].unlink(missing_ok=True)
                return fallback(store, key, path)
            return kept[2]
        return read

    def clear(self) -> None:
        """Remove what is kept (the process ends)."""
        with self.lock:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
            self.folder, self.files = None, {}


step_outputs = KeptFiles()  # this process's (an agent's pool process takes task after task)


@worker_process_shutdown.connect
@worker_shutdown.connect  # the threads pool: the agent's process's own
def _clear_kept(**_: object) -> None:
    step_outputs.clear()
