"""Fused mode: data-sharded training merged every H steps, DiLoCo-style, into one model.

DiLoCo (Douillard et al., 2023, arXiv 2311.08105): each of S replicas starts a round from the
global weights θ_r, takes H inner AdamW steps on its shard, and reports the pseudo-gradient
Δ_k = θ_r − θ_k. The outer step averages them (weighted by samples, summed in shard-id order) and
applies an outer optimizer — Nesterov SGD, lr 0.7, momentum 0.9 by default; SGD with lr 1 and no
momentum is FedAvg.

Guarantees:

* Shards are *virtual replicas*: the result depends on (S, H, seed, threads) only — not on which
  machines, or how many, ran the shards.
* A round is a Celery chord: header = one task per shard, body = :func:`outer_step`. Shard outputs
  sit at deterministic keys and a task whose output exists returns at once, so a duplicate or late
  attempt is harmless; the outer step checks completeness in the store (the chord counter alone
  is not proof), and the next round is dispatched once (guarded in Redis).
* The inner optimizer state is reset each round: the result then stays independent of where a
  shard ran, and nothing but weights moves (see the README's notes on this choice).
* Weights never pass through the broker; tasks return small deterministic JSON.
* Downloads are as small as the run allows (:func:`fetch_global`): θ_0 is rebuilt from the seed,
  a machine reuses the θ it holds, and with ``--codec fp16|int8`` a machine holding θ_{r−1}
  fetches only the compressed move θ_r − θ_{r−1} (:func:`compress_broadcast`, error feedback).
  Every rebuilt θ is checked against the stored file's sha256 before use.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from functools import lru_cache
from typing import Any

import torch
from celery import chord

from .celery_app import app, forget_results
from .capacity import queue_for
from .device import pick_device
from .errors import RecipeError, TensorTurnError
from .recipes import Recipe, load_splits, resolve
from .runs import RunBoard, RunSpec, load_spec, redis_client, write_manifest
from .store import ObjectMissing, Store, open_store, sha256_hex
from .tensors import (BROADCAST_FORMAT, StateDict, decode_delta, delta_bytes, delta_from_bytes, encode_delta,
                      float_keys, from_bytes, is_finite, metadata_of, model_bytes, to_bytes)
from .telemetry import TaskReporter
from .training import derive_seed, set_threads, train_steps

log = logging.getLogger(__name__)

OUTER_STEP_RETRIES = 5


# ---- keys -------------------------------------------------------------------------------------

def global_key(run_id: str, r: int) -> str:
    return f"runs/{run_id}/global/r{r:04d}.safetensors"


def outer_state_key(run_id: str, r: int) -> str:
    return f"runs/{run_id}/outer/r{r:04d}.safetensors"


def shard_key(run_id: str, r: int, k: int) -> str:
    return f"runs/{run_id}/r{r:04d}/shard-{k:03d}.safetensors"


def round_key(run_id: str, r: int) -> str:
    return f"runs/{run_id}/rounds/r{r:04d}.json"


def broadcast_key(run_id: str, r: int) -> str:
    """θ_r − θ_{r−1} in the run's codec: what a machine that holds θ_{r−1} downloads instead of θ_r."""
    return f"runs/{run_id}/broadcast/r{r:04d}.safetensors"


def final_key(run_id: str) -> str:
    return f"runs/{run_id}/final/model.safetensors"


# ---- the math ---------------------------------------------------------------------------------

def outer_update(theta: StateDict, delta: StateDict, momentum_buf: StateDict | None,
                 lr: float, momentum: float, nesterov: bool) -> tuple[StateDict, StateDict]:
    """One outer step on the averaged pseudo-gradient ``delta`` (the "gradient" is θ_r − θ_avg).

    Same update as ``torch.optim.SGD(lr, momentum, nesterov)``:
    ``b ← μ·b + Δ``;  ``θ ← θ − lr·(Δ + μ·b)`` with Nesterov, ``θ ← θ − lr·b`` without.
    Entries without a delta (integer buffers) are copied through. Returns (θ_new, b_new).
    """
    new_theta, new_buf = {}, {}
    for name, value in theta.items():
        if name not in delta:
            new_theta[name] = value.clone()
            continue
        d = delta[name].to(torch.float32)
        if momentum:
            prev = momentum_buf.get(name) if momentum_buf else None
            buf = d.clone() if prev is None else prev * momentum + d
            new_buf[name] = buf
            step = d + momentum * buf if nesterov else buf
        else:
            step = d
        new_theta[name] = (value.to(torch.float32) - lr * step).to(value.dtype)
    return new_theta, new_buf


def weighted_average(deltas: list[StateDict], samples: list[int]) -> StateDict:
    """Σ_k w_k Δ_k with w_k ∝ samples, accumulated in list (shard-id) order."""
    total = float(sum(samples))
    out: StateDict = {}
    for delta, n in zip(deltas, samples):
        w = n / total
        for name, value in delta.items():
            out[name] = out[name] + w * value if name in out else w * value
    return out


def apply_step(theta: StateDict, step: StateDict) -> StateDict:
    """θ + step for the entries in ``step`` (float32 arithmetic, CPU); the rest copied through.
    The coordinator and every worker rebuild θ_{r+1} with this very function, so bit for bit."""
    return {name: (value.float() + step[name]).to(value.dtype) if name in step else value.clone()
            for name, value in theta.items()}


def compress_broadcast(theta: StateDict, target: StateDict, residual: StateDict | None,
                       codec: str) -> tuple[dict, StateDict, StateDict]:
    """Encode the move θ_r → θ_{r+1} for the download, with error feedback.

    Returns (packed tensors, θ_{r+1} as every machine will rebuild it, the new residual). The
    run's θ_{r+1} *is* the rebuilt one; what the codec dropped (``residual``) is added to the
    next round's move, so quantization error does not accumulate (error feedback, as in 1-bit
    SGD/EF-SGD, applied to the broadcast).
    """
    want = {k: target[k].float() - theta[k].float() + (residual[k] if residual else 0.0)
            for k in float_keys(theta)}
    packed = encode_delta(want, codec)
    sent = decode_delta(packed, codec, {k: list(v.shape) for k, v in want.items()})
    return packed, apply_step(theta, sent), {k: want[k] - sent[k] for k in want}


def initial_state(recipe: Recipe, seed: int) -> StateDict:
    """θ_0: the recipe's model initialized from the run's seed (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "init"))
        model = recipe.model(recipe.default_config())
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def global_bytes(spec: RunSpec, recipe: Recipe, theta: StateDict) -> bytes:
    """The model file of a global θ (its sha256 identifies the weights of a round)."""
    return model_bytes(theta, spec.recipe, recipe.default_config(), spec.recipe_options)


def shard_rows(n_train: int, shards: int, k: int, seed: int) -> torch.Tensor:
    """Training rows of shard k: a seeded permutation dealt round-robin over the shards."""
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(derive_seed(seed, "shards")))
    return perm[k::shards]


# ---- per-process helpers ----------------------------------------------------------------------

@lru_cache(maxsize=8)
def _store(url: str) -> Store:
    return open_store(url)


@lru_cache(maxsize=1)
def _board() -> RunBoard:
    return RunBoard(redis_client(app.conf.broker_url))


@lru_cache(maxsize=8)
def _recipe(name: str, options_json: str) -> Recipe:
    return resolve(name, json.loads(options_json))


def recipe_of(spec: RunSpec) -> Recipe:
    return _recipe(spec.recipe, json.dumps(spec.recipe_options, sort_keys=True))


def load_model(recipe: Recipe, state: StateDict, config: dict[str, Any], device: torch.device):
    model = recipe.model(config)
    model.load_state_dict(state)
    return model.to(device)


# ---- start ------------------------------------------------------------------------------------

def start(spec: RunSpec, store: Store, board: RunBoard) -> None:
    """Write the spec and initial weights, record the run, dispatch round 0."""
    recipe = resolve(spec.recipe, spec.recipe_options)
    theta0 = global_bytes(spec, recipe, initial_state(recipe, spec.seed))
    spec.init_sha256 = sha256_hex(theta0)  # lets machines rebuild θ_0 from the seed, verified
    store.put_json(f"runs/{spec.run_id}/spec.json", spec.to_json())
    store.put_bytes(global_key(spec.run_id, 0), theta0)
    board.create(spec)
    write_manifest(store, board, spec.run_id)
    dispatch_round(spec, 0)


def dispatch_round(spec: RunSpec, r: int) -> None:
    """Queue round r: its shards, then the outer step, on machines that can hold the model."""
    queue = queue_for(spec.memory_needed_bytes)
    header = [train_shard.s(spec.run_id, spec.store_url, r, k).set(queue=queue)
              for k in range(spec.shards)]
    result = chord(header)(outer_step.s(spec.run_id, spec.store_url, r).set(queue=queue))
    forget_results([*result.parent.results, result])


# ---- tasks ------------------------------------------------------------------------------------

class UpdateRejected(Exception):
    """A shard's pseudo-gradient is non-finite or absurdly large; the shard is trained again."""


@app.task(bind=True, name="tensorturn.fused.train_shard")
def train_shard(self, run_id: str, store_url: str, r: int, k: int) -> dict[str, int]:
    """Train shard k for one round from θ_r and upload its pseudo-gradient."""
    result = {"round": r, "shard": k}
    store, board = _store(store_url), _board()
    if board.state(run_id) in ("succeeded", "failed"):
        return result
    out_key = shard_key(run_id, r, k)
    task = f"r{r}/shard-{k}"
    worker = self.request.hostname or "?"
    spec = load_spec(store, run_id)
    begun = board.begin_attempt(run_id, task, worker, spec.max_attempts)
    if begun is None:
        board.fail(run_id, f"{task} failed {spec.max_attempts} attempts")
        write_manifest(store, board, run_id)
        return result
    attempt, n = begun
    if store.exists(out_key) or store.exists(global_key(run_id, r + 1)):
        board.finish_attempt(run_id, attempt, "duplicate: output already stored")
        board.incident(run_id, "duplicate_ignored", task, worker,
                       "the shard's output was already stored; nothing was trained or counted")
        return result
    try:
        reporter = TaskReporter(self, board.r, task, spec.sync_every,
                                spec.batch_size or recipe_of(spec).batch_size)
        up, down = _train_shard(spec, store, r, k, out_key, reporter)
    except Exception as exc:  # noqa: BLE001 - recorded, then retried or failed
        message = _describe_failure(exc, worker)
        board.finish_attempt(run_id, attempt, f"failed: {message}")
        if isinstance(exc, UpdateRejected):
            board.incident(run_id, "update_rejected", task, worker, str(exc))
        if n < spec.max_attempts:
            raise self.retry(countdown=1, max_retries=None) from None
        board.fail(run_id, f"{task}: {message}")
        write_manifest(store, board, run_id)
        raise
    if up is None:  # another attempt stored the output while this one trained
        board.finish_attempt(run_id, attempt, "late: output already stored")
        board.incident(run_id, "late_ignored", task, worker,
                       "a late attempt finished after another stored the output; discarded")
        return result
    board.add_bytes(run_id, task, up, down)
    board.finish_attempt(run_id, attempt, "succeeded")
    reporter.done()
    return result


def _describe_failure(exc: Exception, worker: str | None) -> str:
    if isinstance(exc, RecipeError):
        return f"{exc} (on worker {worker})"
    if isinstance(exc, TensorTurnError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def check_update(delta: StateDict, theta: StateDict, max_ratio: float) -> None:
    """Raise UpdateRejected for a non-finite pseudo-gradient or one far larger than the weights."""
    if not is_finite(delta):
        raise UpdateRejected("non-finite (NaN/Inf) pseudo-gradient")
    d_norm = torch.sqrt(sum((v.float() ** 2).sum() for v in delta.values()))
    w_norm = torch.sqrt(sum((theta[k].float() ** 2).sum() for k in delta))
    if float(d_norm) > max_ratio * max(float(w_norm), 1e-12):
        raise UpdateRejected(f"pseudo-gradient norm {float(d_norm):.3g} exceeds {max_ratio:g}× "
                             f"the weights' norm {float(w_norm):.3g}")


def _train_shard(spec: RunSpec, store: Store, r: int, k: int, out_key: str,
                 on_step=None) -> tuple[int | None, int]:
    """Returns (bytes uploaded, or None when another attempt got there first; bytes downloaded)."""
    set_threads(spec.threads_per_task)
    recipe = recipe_of(spec)
    device = pick_device()
    splits = load_splits(recipe)
    theta, bytes_down = fetch_global(spec, recipe, store, r)
    config = recipe.default_config()
    model = load_model(recipe, theta, config, device)
    lr = spec.lr or recipe.lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=recipe.weight_decay)
    rows = shard_rows(len(splits.y_train), spec.shards, k, spec.seed)
    try:
        loss, samples = train_steps(
            recipe, model, opt, splits.x_train, splits.y_train, rows, spec.sync_every,
            spec.batch_size or recipe.batch_size, derive_seed(spec.seed, r, k), device,
            on_step=on_step)
    except FloatingPointError as exc:
        raise UpdateRejected(str(exc)) from None
    trained = {name: v.detach().cpu() for name, v in model.state_dict().items()}
    delta = {name: theta[name].float() - trained[name].float() for name in float_keys(theta)}
    check_update(delta, theta, spec.max_update_ratio)
    # bytes_down is written at a fixed width: it depends on where the shard ran (what that
    # machine held), and the upload's size must not
    blob = delta_bytes(delta, spec.codec, {"samples": str(samples), "loss": repr(loss),
                                           "bytes_down": f"{bytes_down:015d}"})
    if store.exists(out_key):  # never overwrite: the round may already have used it
        return None, bytes_down
    store.put_bytes(out_key, blob)
    return len(blob), bytes_down


# This process's latest global weights per run: (round, sha256 of the model file, θ).
_held: OrderedDict[str, tuple[int, str, StateDict]] = OrderedDict()
_HELD_RUNS = 2


def fetch_global(spec: RunSpec, recipe: Recipe, store: Store, r: int) -> tuple[StateDict, int]:
    """θ_r for a shard task, moving as few bytes as it can; returns (θ_r, bytes downloaded).

    In order: θ_r already held (another shard of the round ran here) — nothing moves; round 0
    rebuilt from the seed — nothing moves; θ_{r−1} held and the run compresses — only the
    broadcast delta moves; else the full model file. A rebuilt θ is used only if its model file
    hashes to the one the coordinator stored, so a different torch or a lost delta can only cost
    bytes, never change the weights.
    """
    held = _held.get(spec.run_id)
    if held and held[0] == r:
        return held[2], 0
    moved, theta, sha = 0, None, None
    if r == 0 and spec.init_sha256:
        candidate = initial_state(recipe, spec.seed)
        if sha256_hex(global_bytes(spec, recipe, candidate)) == spec.init_sha256:
            theta, sha = candidate, spec.init_sha256
        else:
            log.warning("run %s: θ_0 rebuilt from the seed differs from the stored one "
                        "(another torch version?); downloading it", spec.run_id)
    elif held and held[0] == r - 1 and spec.codec != "fp32":
        theta, sha, moved = _rebuild_from_broadcast(spec, recipe, store, r, held)
    if theta is None:
        data = store.get_bytes(global_key(spec.run_id, r))
        theta, sha, moved = from_bytes(data), sha256_hex(data), moved + len(data)
    _held[spec.run_id] = (r, sha, theta)
    _held.move_to_end(spec.run_id)
    while len(_held) > _HELD_RUNS:
        _held.popitem(last=False)
    return theta, moved


def _rebuild_from_broadcast(spec: RunSpec, recipe: Recipe, store: Store, r: int,
                            held: tuple[int, str, StateDict]) -> tuple[StateDict | None, str, int]:
    try:
        blob = store.get_bytes(broadcast_key(spec.run_id, r))
    except ObjectMissing:  # a run from before broadcasts existed
        return None, "", 0
    meta = metadata_of(blob)
    if meta.get("base_sha256") == held[1]:
        theta = apply_step(held[2], delta_from_bytes(blob)[0])
        sha = sha256_hex(global_bytes(spec, recipe, theta))
        if sha == meta.get("sha256"):
            return theta, sha, len(blob)
    log.warning("run %s: round %d's broadcast delta does not rebuild the stored weights here; "
                "downloading them", spec.run_id, r)
    return None, "", len(blob)


@app.task(bind=True, name="tensorturn.fused.outer_step")
def outer_step(self, _results: list, run_id: str, store_url: str, r: int) -> dict[str, int]:
    """Chord body: average round r's pseudo-gradients, step θ, then dispatch r+1 or finish."""
    store, board = _store(store_url), _board()
    if board.state(run_id) in ("succeeded", "failed"):
        return {"round": r}
    spec = load_spec(store, run_id)
    try:
        info = _outer_step(spec, store, r)
    except Exception as exc:  # noqa: BLE001
        if self.request.retries < OUTER_STEP_RETRIES:
            log.warning("outer step of round %d failed (%s); retrying", r, exc)
            raise self.retry(countdown=2, max_retries=OUTER_STEP_RETRIES) from None
        board.fail(run_id, f"outer step of round {r}: {_describe_failure(exc, self.request.hostname)}")
        write_manifest(store, board, run_id)
        raise
    board.record_round(run_id, r, info)
    store.put_json(round_key(run_id, r), info)
    if r + 1 < spec.rounds:
        write_manifest(store, board, run_id)
        if board.claim(run_id, f"dispatch-r{r + 1}"):
            dispatch_round(spec, r + 1)
    else:
        _finalize(spec, store, board)
    return {"round": r}


def _outer_step(spec: RunSpec, store: Store, r: int) -> dict[str, Any]:
    run_id = spec.run_id
    missing = [k for k in range(spec.shards) if not store.exists(shard_key(run_id, r, k))]
    if missing:
        raise RuntimeError(f"round {r}: shard outputs missing for shards {missing}")
    deltas, samples, losses, bytes_up, bytes_down = [], [], [], 0, 0
    for k in range(spec.shards):
        blob = store.get_bytes(shard_key(run_id, r, k))
        delta, meta = delta_from_bytes(blob)
        deltas.append(delta)
        samples.append(int(meta["samples"]))
        losses.append(float(meta["loss"]))
        bytes_up += len(blob)
        bytes_down += int(meta["bytes_down"])

    recipe = recipe_of(spec)
    next_key = global_key(run_id, r + 1)
    if store.exists(next_key):  # a duplicate body: θ_{r+1} is already decided
        new_theta = from_bytes(store.get_bytes(next_key))
    else:
        new_theta = _step_global(spec, recipe, store, r, weighted_average(deltas, samples))
    splits = load_splits(recipe)
    set_threads(spec.threads_per_task)
    model = load_model(recipe, new_theta, recipe.default_config(), torch.device("cpu"))
    val = recipe.evaluate(model, splits.x_val, splits.y_val)
    total = sum(samples)
    return {
        "round": r,
        "loss": sum(l * n for l, n in zip(losses, samples)) / total,
        "val_loss": val["loss"],
        "val_accuracy": val.get("accuracy"),
        "samples": total,
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "bytes": bytes_up + bytes_down,
    }


RESIDUAL = "residual::"  # prefix of the broadcast's error-feedback residual in the outer state


def _step_global(spec: RunSpec, recipe: Recipe, store: Store, r: int, avg: StateDict) -> StateDict:
    """θ_{r+1} from θ_r and the averaged pseudo-gradient; stores the outer state, the broadcast
    delta (compressed runs) and then θ_{r+1}, whose existence decides the round."""
    run_id = spec.run_id
    theta_bytes = store.get_bytes(global_key(run_id, r))
    theta = from_bytes(theta_bytes)
    use_momentum = spec.outer == "nesterov" and spec.outer_momentum > 0
    compress = spec.codec != "fp32" and r + 1 < spec.rounds  # the final θ is kept exact
    state: StateDict = {}
    state_key = outer_state_key(run_id, r)
    if r > 0 and (use_momentum or (spec.codec != "fp32" and store.exists(state_key))):
        state = from_bytes(store.get_bytes(state_key))  # (no residual yet: a run from before)
    buf = {k: v for k, v in state.items() if not k.startswith(RESIDUAL)}
    residual = {k[len(RESIDUAL):]: v for k, v in state.items() if k.startswith(RESIDUAL)}
    new_theta, new_buf = outer_update(
        theta, avg, buf or None, float(spec.outer_lr),
        spec.outer_momentum if use_momentum else 0.0, nesterov=use_momentum)
    if compress:
        packed, new_theta, new_residual = compress_broadcast(theta, new_theta, residual or None,
                                                             spec.codec)
        new_buf.update({RESIDUAL + k: v for k, v in new_residual.items()})
    if new_buf:  # the outer state of r+1 is stored before θ_{r+1} decides the round
        store.put_bytes(outer_state_key(run_id, r + 1), to_bytes(new_buf))
    new_bytes = global_bytes(spec, recipe, new_theta)
    if compress:
        shapes = {k: list(theta[k].shape) for k in float_keys(theta)}
        store.put_bytes(broadcast_key(run_id, r + 1), to_bytes(packed, {
            "format": BROADCAST_FORMAT, "codec": spec.codec,
            "shapes": json.dumps(shapes, sort_keys=True),
            "base_sha256": sha256_hex(theta_bytes), "sha256": sha256_hex(new_bytes)}))
    store.put_bytes(global_key(run_id, r + 1), new_bytes)
    return new_theta


def _finalize(spec: RunSpec, store: Store, board: RunBoard) -> None:
    run_id = spec.run_id
    data = store.get_bytes(global_key(run_id, spec.rounds))
    sha = store.put_bytes(final_key(run_id), data)
    recipe = recipe_of(spec)
    splits = load_splits(recipe)
    model = load_model(recipe, from_bytes(data), recipe.default_config(), torch.device("cpu"))
    test = recipe.evaluate(model, splits.x_test, splits.y_test)
    metrics = {f"test_{k}": v for k, v in test.items()}
    board.finish(run_id, "succeeded", metrics=metrics, model_uri=store.uri(final_key(run_id)),
                 model_sha256=sha)
    write_manifest(store, board, run_id)


def resume(spec: RunSpec, store: Store, board: RunBoard) -> str:
    """Continue from the last round whose global weights are in the store; says what it did."""
    done = [int(key.rsplit("/r", 1)[1][:4]) for key in store.list(f"runs/{spec.run_id}/global/")
            if key.endswith(".safetensors")]
    r = max(done, default=0)
    for past in range(r):  # rounds the broker forgot are rebuilt from the store
        if store.exists(round_key(spec.run_id, past)):
            board.record_round(spec.run_id, past, store.get_json(round_key(spec.run_id, past)))
    if r >= spec.rounds:
        _finalize(spec, store, board)
        return f"all {spec.rounds} rounds were complete; finalized"
    board.claim(spec.run_id, f"dispatch-r{r}")
    dispatch_round(spec, r)
    return f"resumed at round {r} of {spec.rounds}"
