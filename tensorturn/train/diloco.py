"""The DiLoCo math, once: what a replica does in a round and what the outer step does with it.

DiLoCo (Douillard et al., 2023, arXiv 2311.08105): each of S replicas starts a round from the
global weights θ_r, takes H inner AdamW steps on its shard and reports the pseudo-gradient
Δ_k = θ_r − θ_k; the outer step averages them (weighted by samples, summed in shard-id order) and
applies an outer optimizer — Nesterov SGD, lr 0.7, momentum 0.9 by default; SGD with lr 1 and no
momentum is FedAvg. The functions here are pure (tensors in, tensors out); fused mode's tasks
(:mod:`tensorturn.modes.fused.shard`, and the one outer step, :mod:`tensorturn.modes.fused.step`, tensor by tensor) and
``benchmarks/diloco.py`` both call them, and their list forms are the bits the streaming step is
tested against.

Guarantee: the result depends on (S, H, seed, threads) only — a replica's rows, seed and starting
weights are functions of the run and the shard id, never of the machine that trains it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tensorturn.store.tensors import StateDict, decode_delta, encode_delta, float_keys, is_finite
from tensorturn.train.device import seed_global_generators
from tensorturn.train.loop import load_model, train_steps
from tensorturn.train.seeding import derive_seed
from tensorturn.train.seeding import shard_rows as shard_rows  # a shard's rows are part of what a replica does

if TYPE_CHECKING:  # the train layer sits below recipes: a recipe is handed in
    from tensorturn.recipes import Recipe


class UpdateRejected(Exception):
    """A shard's pseudo-gradient is non-finite or absurdly large; the shard is trained again."""


def initial_state(recipe: Recipe, seed: int) -> StateDict:
    """θ_0: the recipe's model initialized from the run's seed (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        seed_global_generators(derive_seed(seed, "init"))
        model = recipe.model(recipe.default_config())
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def train_replica(recipe: Recipe, theta: StateDict, x: torch.Tensor, y: torch.Tensor,
                  rows: torch.Tensor, steps: int, lr: float, batch_size: int, seed: int,
                  device: torch.device, on_step=None, precision: str = "auto",
                  accumulate: int = 1) -> tuple[StateDict, float, int]:
    """One replica's round: H AdamW steps from θ_r on ``rows`` (a fresh inner optimizer: its
    state is reset every round, so only weights move); returns (Δ = θ_r − θ_k, mean loss,
    samples)."""
    model = load_model(recipe, theta, recipe.default_config(), device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=recipe.weight_decay)
    try:
        loss, samples = train_steps(recipe, model, opt, x, y, rows, steps, batch_size, seed,
                                    device, on_step=on_step, precision=precision,
                                    accumulate=accumulate)
    except FloatingPointError as exc:
        raise UpdateRejected(str(exc)) from None
    trained = {name: v.detach().cpu() for name, v in model.state_dict().items()}
    delta = {name: theta[name].float() - trained[name].float() for name in float_keys(theta)}
    return delta, loss, samples


def check_update(delta: StateDict, theta: StateDict, max_ratio: float) -> None:
    """Raise UpdateRejected for a non-finite pseudo-gradient or one far larger than the weights."""
    if not is_finite(delta):
        raise UpdateRejected("non-finite (NaN/Inf) pseudo-gradient")
    d_norm = torch.sqrt(torch.stack([(v.float() ** 2).sum() for v in delta.values()]).sum())
    w_norm = torch.sqrt(torch.stack([(theta[k].float() ** 2).sum() for k in delta]).sum())
    if float(d_norm) > max_ratio * max(float(w_norm), 1e-12):
        raise UpdateRejected(f"pseudo-gradient norm {float(d_norm):.3g} exceeds {max_ratio:g}× "
                             f"the weights' norm {float(w_norm):.3g}")


# The side that applies an update (a fused round's outer step, an asynchronous run's applier)
# looks at it again: the trainer checked it before storing it, but an update is applied on the
# word of no other machine's arithmetic (both through ``modes.fused.step.InputCheck``). ``what``
# names the update in the refusal, ``by`` the side refusing it.

def check_samples(what: str, samples: int, most: int, by: str) -> None:
    """UpdateRejected unless ``samples`` is 1..``most`` (H × batch × accumulate)."""
    if not 0 < samples <= most:
        raise UpdateRejected(f"{what} claims {samples} samples, not 1..{most} (H × batch × "
                             f"accumulate); refused by {by}")


def finite_squares(what: str, name: str, value: torch.Tensor, by: str) -> float:
    """The sum of squares of tensor ``name`` of an update (for its norm); UpdateRejected if it
    holds NaN/Inf."""
    if not bool(torch.isfinite(value).all()):
        raise UpdateRejected(f"{what} holds NaN/Inf ({name}); refused by {by}")
    return float(value.double().square().sum())


def check_norm(what: str, squares: float, theta_squares: float, max_ratio: float, by: str) -> None:
    """UpdateRejected if the update's norm is above ``max_ratio`` × the weights' it steps."""
    norm, w_norm = math.sqrt(squares), max(math.sqrt(theta_squares), 1e-12)
    if norm > max_ratio * w_norm:
        raise UpdateRejected(f"{what} has norm {norm:.3g}, over {max_ratio:g}× θ's norm "
                             f"{w_norm:.3g}; refused by {by}")


def weighted_average(deltas: list[StateDict], samples: list[int]) -> StateDict:
    """Σ_k w_k Δ_k with w_k ∝ samples, accumulated in list (shard-id) order."""
    total = float(sum(samples))
    out: StateDict = {}
    for delta, n in zip(deltas, samples):
        accumulate(out, delta, n / total)
    return out


def accumulate(into: StateDict, delta: StateDict, w: float) -> None:
    """``into += w·delta`` in place, key by key — one step of :func:`weighted_average`, so a
    streaming average (one shard in memory at a time) is bit-identical to the list's."""
    for name, value in delta.items():
        if name in into:
            into[name].add_(w * value)  # the same rounding as into + w·value, without a new sum
        else:
            into[name] = w * value


def outer_update(theta: StateDict, delta: StateDict, momentum_buf: StateDict | None,
                 lr: float, momentum: float, nesterov: bool,
                 consume: bool = False) -> tuple[StateDict, StateDict]:
    """One outer step on the averaged pseudo-gradient ``delta`` (the "gradient" is θ_r − θ_avg).

    Same update as ``torch.optim.SGD(lr, momentum, nesterov)``:
    ``b ← μ·b + Δ``;  ``θ ← θ − lr·(Δ + μ·b)`` with Nesterov, ``θ ← θ − lr·b`` without.
    Entries without a delta (integer buffers) are copied through. Returns (θ_new, b_new).

    With ``consume`` the inputs' entries are removed as they are used, so memory holds about one
    copy of each of θ, Δ and b at any time rather than old and new side by side (big models).
    """
    new_theta, new_buf = {}, {}
    take = (lambda d, k: d.pop(k, None)) if consume else (lambda d, k: d.get(k))
    for name in list(theta):
        value = take(theta, name)
        d = take(delta, name)
        if d is None:
            new_theta[name] = value if consume else value.clone()
            continue
        d = d.to(torch.float32)
        if momentum:
            prev = take(momentum_buf, name) if momentum_buf else None
            buf = d.clone() if prev is None else prev * momentum + d
            del prev
            new_buf[name] = buf
            step = d + momentum * buf if nesterov else buf
        else:
            step = d
        new_theta[name] = (value.to(torch.float32) - lr * step).to(value.dtype)
        del value, d, step
    return new_theta, new_buf


STALENESS_POWER = 1.0  # benchmarks/mixed_speeds.py --pools 1:1:0.25,1:1:0.1 --shards 3 (BENCHMARKS §12)


def staleness_scale(staleness: int, shards: int, power: float = STALENESS_POWER) -> float:
    """The share of its weight an asynchronous update keeps, given how many versions were applied
    since the weights it trained from: all of it within a round's worth (fewer than S: the
    updates a synchronous round would average together), then ``(S / (staleness + 1))^power`` —
    FedAsync's polynomial staleness function (Xie et al. 2019, arXiv 1903.03934), counted in
    rounds. A straggler's update that lands 16 versions late on 3 shards keeps 3/17 of its
    weight: it still counts, without pulling the model back to where it trained."""
    if staleness < shards:
        return 1.0
    return (shards / (staleness + 1)) ** power


def async_update(value: torch.Tensor, d: torch.Tensor | None, buf: torch.Tensor | None,
                 acc: torch.Tensor | None, weight: float, lr: float, momentum: float,
                 momentum_due: bool, share: float) -> tuple[torch.Tensor, torch.Tensor | None,
                                                           torch.Tensor | None]:
    """One pseudo-gradient of an asynchronous fused run applied to one tensor, as it arrives.

    *Delayed Nesterov, spread*: as in Async Local-SGD's delayed Nesterov (Liu et al. 2024,
    arXiv 2401.09135) the momentum ``b`` moves only once every S updates, with their weighted
    sum ``a`` — stale updates do not each push it — but its movement is applied in S equal
    parts, one with each update, instead of in one jump at the S-th (updates in flight across
    a jump were trained from weights far from where they land). Per update, with ``w`` its
    weight (1/S for a full shard) and ``share`` = 1/S::

        θ ← θ − lr·(1 + μ)·w·Δ − lr·μ²·share·b        a ← a + w·Δ
        every S-th update:  b ← μ·b + a,  a ← 0

    Over S updates from the same θ the sum is exactly the synchronous Nesterov step
    ``θ − lr·(g + μ·(μ·b + g))`` with g their weighted sum. Measured against the one-jump form
    on charlm (BENCHMARKS.md §12): validation loss 2.296 vs 2.442 at equal samples, synchronous
    rounds 2.399. With μ = 0 it is FedAvg one update at a time, ``θ − lr·w·Δ``. A tensor without
    an update (an integer buffer) is returned as it is. Returns (θ', b', a').
    """
    if d is None:
        return value, buf, acc
    step = weight * d.to(torch.float32)
    if not momentum:
        return (value.to(torch.float32) - lr * step).to(value.dtype), None, None
    new = value.to(torch.float32) - lr * (1 + momentum) * step
    if buf is not None:
        new = new - lr * momentum * momentum * share * buf
    acc = step if acc is None else acc + step
    if momentum_due:
        buf = acc.clone() if buf is None else buf * momentum + acc
        acc = torch.zeros_like(acc)
    return new.to(value.dtype), buf, acc


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


def round_figures(losses: list[float], samples: list[int], val: dict[str, float],
                  bytes_up: int, bytes_down: int, r: int, val_rows: int) -> dict:
    """A round's record: sample-weighted training loss, validation figures — every metric the
    recipe's ``evaluate`` gave, as ``val_<metric>`` (a regression's in the user's units) — and
    the rows they were read from, bytes moved."""
    total = sum(samples)
    return {
        "round": r,
        "loss": sum(loss * n for loss, n in zip(losses, samples)) / total,
        **{f"val_{name}": value for name, value in val.items() if name != "rows"},
        "val_loss": val.get("loss"),  # None when the dataset has no validation rows
        "val_accuracy": val.get("accuracy"),
        "val_rows": val_rows,
        "samples": total,
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "bytes": bytes_up + bytes_down,
    }
