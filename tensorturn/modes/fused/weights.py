"""The global weights a shard trains from, moving as few bytes as the run allows — and the one
cache of them this process keeps (:data:`cache`), for synchronous rounds and asynchronous
versions alike.

θ_0 is rebuilt from the seed, a machine reuses the θ it holds, and with ``--codec fp16|int8|int4`` a
machine holding θ_{r−1} fetches only the compressed move θ_r − θ_{r−1}. A rebuilt θ is used only
if its model file hashes to the one stored, so a different torch or a lost delta can only cost
bytes, never change the weights.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tensorturn import layout
from tensorturn.modes.fused.options import options
from tensorturn.recipes import Recipe
from tensorturn.spec import RunSpec
from tensorturn.store import seals
from tensorturn.store.objects import ObjectMissing, Store, counted_apart, sha256_hex
from tensorturn.store.tensorfile import TensorReader
from tensorturn.store.tensors import StateDict, delta_layout, from_bytes, iter_decoded, metadata_of, model_bytes
from tensorturn.train.diloco import apply_step, initial_state

log = logging.getLogger(__name__)


class ThetaCache:
    """This process's latest global weights per run — (step: a round or a version, sha256 of
    their model file, θ) — for the ``runs`` runs used last: a machine training several shards
    of a round downloads θ once."""

    def __init__(self, runs: int = 2):
        self.runs = runs
        self.held: OrderedDict[str, tuple[int, str, StateDict]] = OrderedDict()

    def get(self, run_id: str) -> tuple[int, str, StateDict] | None:
        return self.held.get(run_id)

    def put(self, run_id: str, step: int, sha: str, theta: StateDict) -> None:
        self.held[run_id] = (step, sha, theta)
        self.held.move_to_end(run_id)
        while len(self.held) > self.runs:
            self.held.popitem(last=False)

    def clear(self) -> None:
        self.held.clear()


cache = ThetaCache()


AHEAD_LOOK_S = 2.0      # how often a broadcast read ahead is looked for until the step stores it
AHEAD_WAIT_S = 600.0    # how long at most (the next task, waiting for it, downloads it then)


@dataclass
class _Look:
    """One broadcast looked for and read ahead (its own events and result: a look that another
    replaced never hands over what it read)."""

    key: str
    blob: bytes | None = None
    downloading: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class BroadcastAhead:
    """The next round's broadcast, downloaded in a thread of this process while this round
    trains. With overlapped rounds a machine trains round r+1 from θ_r while round r's outer
    step makes θ_{r+1}, and its next task begins with θ_{r+1}'s broadcast: read ahead, that
    download hides under the training instead of coming before the next task's (an int8 move of
    an 86M model is 23 s at 30 Mbit/s: BENCHMARKS §18). One broadcast at a time; only a saving —
    a failure is logged, and the next task downloads the broadcast itself."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.look: _Look | None = None

    def start(self, store: Store, key: str, counted: Callable[[int], None] = lambda n: None) -> None:
        """Look for ``key`` every :data:`AHEAD_LOOK_S` (until :meth:`take` or another start, for
        :data:`AHEAD_WAIT_S` at most), and download it (checked against its seal) once stored;
        ``counted(bytes)`` records what the download moved (in its thread)."""
        with self.lock:
            if self.look is not None and self.look.key == key:
                return
            if self.look is not None:
                self.look.stop.set()  # the one before
            look = self.look = _Look(key)

        def read() -> None:
            try:
                deadline = time.monotonic() + AHEAD_WAIT_S
                while not store.exists(key):
                    if look.stop.wait(AHEAD_LOOK_S) or time.monotonic() > deadline:
                        return
                with self.lock:
                    if look.stop.is_set():
                        return
                    look.downloading = True
                with counted_apart() as moved:
                    look.blob = seals.get_bytes(store, key)
                try:
                    counted(moved[1])
                except Exception as exc:  # noqa: BLE001 - a figure; the broker may be away
                    log.debug("bytes read ahead not recorded: %s", exc)
            except Exception as exc:  # noqa: BLE001 - only a saving: the task downloads it
                log.info("reading %s ahead failed (%s); the next task downloads it", key, exc)
            finally:
                look.done.set()

        threading.Thread(target=read, name=f"ahead-{key}", daemon=True).start()

    def take(self, key: str) -> bytes | None:
        """The broadcast at ``key`` if it was read ahead — waiting for a download under way, for
        :data:`AHEAD_WAIT_S` at most — or None (nothing read ahead for it: a look still waiting
        for it stops)."""
        with self.lock:
            look = self.look
            if look is None or look.key != key:
                return None
            self.look = None  # handed over (or given up) once
            if not look.downloading:
                look.stop.set()
                return None
        return look.blob if look.done.wait(AHEAD_WAIT_S) else None


ahead = BroadcastAhead()  # this process's


def global_bytes(spec: RunSpec, recipe: Recipe, theta: StateDict) -> bytes:
    """The model file of a global θ (its sha256 identifies the weights of a round)."""
    return model_bytes(theta, spec.recipe, recipe.default_config(), spec.recipe_options, spec.recipe_state)


def read_theta(store: Store, key: str) -> tuple[StateDict, str, int]:
    """The weights at ``key`` through a file — the model is never in memory twice (bytes and
    tensors) — checked against its seal; (θ, sha256, bytes)."""
    with tempfile.TemporaryDirectory(prefix="tt-global-") as tmp:
        path = Path(tmp) / "theta"
        sha = seals.get_file(store, key, path)
        with TensorReader(path) as f:
            theta = f.all()
        return theta, sha, path.stat().st_size


def fetch_global(spec: RunSpec, recipe: Recipe, store: Store, r: int) -> tuple[StateDict, int]:
    """θ_r for a shard task, moving as few bytes as it can; returns (θ_r, bytes downloaded).

    In order: θ_r already held (another shard of the round ran here) — nothing moves; round 0
    rebuilt from the seed — nothing moves; θ_{r−1} held and the run compresses — only the
    broadcast delta moves; else the full model file.
    """
    opts = options(spec)
    held = cache.get(spec.run_id)
    if held and held[0] == r:
        return held[2], 0
    moved, theta, sha = 0, None, None
    if r == 0 and opts.init_sha256:
        candidate = initial_state(recipe, spec.seed)
        if sha256_hex(global_bytes(spec, recipe, candidate)) == opts.init_sha256:
            theta, sha = candidate, opts.init_sha256
        else:
            log.warning("run %s: θ_0 rebuilt from the seed differs from the stored one "
                        "(another torch version?); downloading it", spec.run_id)
    elif held and held[0] == r - 1 and opts.down_codec != "fp32":
        theta, sha, moved = rebuild_from_broadcast(spec, recipe, store, r, held)
    if theta is None:
        theta, sha, size = read_theta(store, layout.key("global", spec.run_id, r))
        moved += size
    assert sha is not None
    cache.put(spec.run_id, r, sha, theta)
    return theta, moved


def rebuild_from_broadcast(spec: RunSpec, recipe: Recipe, store: Store, r: int,
                           held: tuple[int, str, StateDict]) -> tuple[StateDict | None, str, int]:
    """θ_r from the θ_{r−1} ``held`` and round r's broadcast delta, if it rebuilds the stored
    weights (their sha256); (θ_r or None, its sha256, bytes downloaded)."""
    key = layout.key("broadcast", spec.run_id, r)
    blob = ahead.take(key)  # read while this machine's last task trained, or None
    try:
        blob = blob if blob is not None else seals.get_bytes(store, key)
    except ObjectMissing:  # a run from before broadcasts existed
        return None, "", 0
    meta = metadata_of(blob)
    if meta.get("base_sha256") == held[1]:
        codec, shapes = delta_layout(meta)
        packed, base = from_bytes(blob), held[2]
        theta = {name: value.clone() for name, value in base.items() if name not in shapes}
        for name, move in iter_decoded(packed.__getitem__, codec, shapes):  # a tensor at a time
            theta.update(apply_step({name: base[name]}, {name: move}))
        del packed
        sha = sha256_hex(global_bytes(spec, recipe, theta))
        if sha == meta.get("sha256"):
            return theta, sha, len(blob)
    log.warning("run %s: round %d's broadcast delta does not rebuild the stored weights here; "
                "downloading them", spec.run_id, r)
    return None, "", len(blob)
