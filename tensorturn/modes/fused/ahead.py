"""What a slot standing by to take a round's outer step reads of the step's inputs while the
round's last shard still trains (:class:`ReadAhead`), and how the step reads a sealed object
(:data:`Fetch`)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

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
