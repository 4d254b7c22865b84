"""The outer step, once: θ and its outer state read from files a tensor at a time, moved by a rule,
and θ', the new state and (with a compressed broadcast) the move written the same way.

Every sync policy's step is this function. A round's (rounds, backup, overlap:
:func:`~tensorturn.modes.fused.outer.step_global`) moves θ_r by the round's averaged
pseudo-gradient with :class:`Synchronous` — DiLoCo's outer Nesterov step (Douillard et al. 2023,
arXiv 2311.08105), FedAvg with ``--outer sgd`` — and, when the broadcast is compressed, writes
θ_{r+1} as θ_r plus the move as every machine decodes it, keeping what the codec dropped for the
next round (error feedback). An asynchronous run's applier
(:func:`~tensorturn.modes.fused.async_apply.apply_one`) moves the latest weights by one
update with :class:`Delayed` (delayed Nesterov, spread).

Guarantees: the arithmetic is :mod:`tensorturn.train.diloco`'s per-tensor functions (their list
forms are the bit references the tests compare with), applied tensor by tensor — memory holds one
tensor of θ at a time besides the update, and a tensor's move is computed, encoded and decoded
once, its parts written at their places in each file it goes to. Each update was looked at as
it was read (:class:`InputCheck`) and its norm is checked against θ's before any file is
written. Nothing here touches the store: the caller decides what is stored, and in which order.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from tensorturn.store.objects import file_sha256
from tensorturn.store.tensorfile import DTYPES, TensorReader, TensorWriter, write_order
from tensorturn.store.tensors import BROADCAST_FORMAT, StateDict, decode_tensor, encode_tensor, part_specs
from tensorturn.train.diloco import (
    apply_step,
    async_update,
    check_norm,
    check_samples,
    finite_squares,
    outer_update,
)

RESIDUAL = "residual::"  # prefix of the broadcast's error-feedback residual in the outer state
MOMENTUM, ACCUMULATED = "m::", "a::"  # the delayed rule's two parts of the outer state, per tensor

Specs = dict[str, tuple[torch.dtype, list[int]]]


class InputCheck:
    """The stepping side's own look at the updates it applies (the trainer looked before storing
    each; a step is taken on the word of no other machine's arithmetic): each update's sample
    count is 1..``most`` (:meth:`samples`), its values finite as they are read (:meth:`values`),
    and its norm at most ``max_ratio`` × θ's before anything is written (:meth:`against`, from
    :func:`outer_step`). Refusals raise :class:`~tensorturn.train.diloco.UpdateRejected` naming
    the update and ``by``, the side refusing it."""

    def __init__(self, most: int, max_ratio: float, by: str):
        self.most, self.max_ratio, self.by = most, max_ratio, by
        self.norms: dict[str, float] = {}  # each update looked at → its sum of squares

    def samples(self, what: str, samples: int) -> None:
        """Update ``what``'s sample count, before its values are read."""
        check_samples(what, samples, self.most, self.by)

    def values(self, what: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Update ``what``'s ``tensors``, each looked at (finite; its squares summed) as it passes."""
        self.norms[what] = 0.0
        for name, value in tensors:
            self.norms[what] += finite_squares(what, name, value, self.by)
            yield name, value

    def against(self, theta_squares: float) -> None:
        """Each update's norm against θ's (``theta_squares``: its sum of squares)."""
        for what, squares in self.norms.items():
            check_norm(what, squares, theta_squares, self.max_ratio, self.by)


@dataclass
class Inputs:
    """What a rule reads: θ and its outer state (a tensor at a time), the update, θ's specs."""

    theta: TensorReader
    state: TensorReader | None
    delta: StateDict
    specs: Specs

    def part(self, entry: str) -> torch.Tensor | None:
        """The outer state's ``entry``, or None where there is none (a first step)."""
        if self.state is None or entry not in self.state.entries:
            return None
        return self.state.get(entry)


class Rule(Protocol):
    """How an outer step moves one tensor, exactly (before any broadcast codec)."""

    def squares_order(self, io: Inputs) -> list[str]:
        """The tensors of θ whose squares are summed for the norm check, in the order summed."""

    def moves(self, io: Inputs, name: str) -> tuple[torch.Tensor, StateDict]:
        """θ' of tensor ``name``, and the new outer state's entries that belong to it."""

    def state_specs(self, io: Inputs) -> Specs:
        """The entries of the rule's new outer state."""


@dataclass(frozen=True)
class Synchronous:
    """A round's outer step on its averaged pseudo-gradient
    (:func:`~tensorturn.train.diloco.outer_update`): Nesterov momentum as ``torch.optim.SGD``,
    or plain SGD (FedAvg with lr 1) with ``momentum`` 0; the state is the momentum of each
    tensor stepped."""

    lr: float
    momentum: float
    nesterov: bool

    def squares_order(self, io: Inputs) -> list[str]:
        return [name for name in write_order(io.specs) if name in io.delta]  # θ_{r+1}'s, as ever

    def moves(self, io: Inputs, name: str) -> tuple[torch.Tensor, StateDict]:
        prev = io.part(name) if self.momentum else None
        d = {name: io.delta[name]} if name in io.delta else {}
        theta, state = outer_update({name: io.theta.get(name)}, d, {name: prev} if prev is not None else None,
                                    self.lr, self.momentum, self.nesterov)
        return theta[name], state  # the momentum of ``name`` ({} without momentum)

    def state_specs(self, io: Inputs) -> Specs:
        return {name: (torch.float32, io.specs[name][1]) for name in io.delta} if self.momentum else {}


@dataclass(frozen=True)
class Delayed:
    """One update of an asynchronous run as it arrives
    (:func:`~tensorturn.train.diloco.async_update`: delayed Nesterov, spread — Liu et al. 2024,
    arXiv 2401.09135): ``weight`` is the update's, ``due`` whether the momentum moves with it,
    ``share`` 1/S; the state is each tensor's momentum and accumulated updates (zeros where
    there are none yet)."""

    lr: float
    momentum: float
    weight: float
    due: bool
    share: float

    def squares_order(self, io: Inputs) -> list[str]:
        return list(io.delta)  # the update's order, as the applier has always summed them

    def moves(self, io: Inputs, name: str) -> tuple[torch.Tensor, StateDict]:
        theta, buf, acc = async_update(io.theta.get(name), io.delta.get(name), io.part(MOMENTUM + name),
                                       io.part(ACCUMULATED + name), self.weight, self.lr, self.momentum,
                                       self.due, self.share)
        if not self.momentum or name not in io.delta:
            return theta, {}
        zeros = torch.zeros(io.specs[name][1], dtype=torch.float32)  # where there is none yet
        return theta, {MOMENTUM + name: buf if buf is not None else zeros,
                       ACCUMULATED + name: acc if acc is not None else zeros}

    def state_specs(self, io: Inputs) -> Specs:
        if not self.momentum:
            return {}
        return {prefix + name: (torch.float32, io.specs[name][1])
                for name in io.delta for prefix in (MOMENTUM, ACCUMULATED)}


@dataclass(frozen=True)
class Broadcast:
    """The move θ → θ' encoded with ``codec`` for the download (what the machines apply to the θ
    they hold, named by ``base_sha256``), with error feedback: θ' is θ plus the move as they
    decode it, and what the codec dropped is kept in the state (``residual::<name>``) and added
    to the next move (as in 1-bit SGD/EF-SGD;
    :func:`~tensorturn.train.diloco.compress_broadcast` is the in-memory form)."""

    codec: str
    base_sha256: str

    def send(self, name: str, theta: torch.Tensor, exact: torch.Tensor, residual: torch.Tensor | None
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """The move ``theta`` → ``exact`` of one tensor, plus the ``residual`` the codec left last
        time, encoded: (its encoded parts, θ' as every machine rebuilds it — θ plus the move as
        they decode it —, what the codec dropped)."""
        want = exact.float() - theta.float() + (residual if residual is not None else 0.0)
        parts = encode_tensor(name, want, self.codec)
        sent = decode_tensor(name, parts, self.codec, list(want.shape))
        return parts, apply_step({name: theta}, {name: sent})[name], want - sent


@dataclass(frozen=True)
class StepFiles:
    """What :func:`outer_step` wrote: θ', the new outer state (None when the rule keeps none and
    nothing was broadcast) and the broadcast (None when not compressed)."""

    next: Path
    state: Path | None
    broadcast: Path | None


def outer_step(scratch: Path, theta: Path, state: Path | None, delta: StateDict, rule: Rule,
               meta: dict[str, str], check: InputCheck | None = None, broadcast: Broadcast | None = None
               ) -> StepFiles:
    """Move θ (file ``theta``, its outer state in ``state``) by ``delta`` with ``rule``: the
    updates ``check`` looked at are checked against θ's norm first, then θ' (``scratch/next``,
    with ``meta``), the broadcast (``scratch/broadcast``) and the new state
    (``scratch/state-next``) are written together, a tensor of θ at a time: each tensor's move is
    computed and encoded once, and its parts written at their places in each file (the broadcast's
    header, which names θ''s sha256, last)."""
    with TensorReader(theta) as t, (TensorReader(state) if state is not None else contextlib.nullcontext()) as s, \
            contextlib.ExitStack() as files:
        io = Inputs(t, s, delta, {name: (DTYPES[e["dtype"]], e["shape"]) for name, e in t.entries.items()})
        squares = 0.0
        for name in rule.squares_order(io):
            squares += float(t.get(name).double().square().sum())
        if check is not None:
            check.against(squares)  # before anything is written
        next_path, state_path, broadcast_path = scratch / "next", scratch / "state-next", scratch / "broadcast"
        moved = [name for name, (dtype, _) in io.specs.items() if dtype.is_floating_point] if broadcast else []
        state_specs = rule.state_specs(io)
        state_specs.update({RESIDUAL + name: (torch.float32, io.specs[name][1]) for name in moved})
        out = files.enter_context(TensorWriter(next_path, io.specs, meta))
        state_out = files.enter_context(TensorWriter(state_path, state_specs)) if state_specs else None
        sent_out, sent_meta = None, {}
        if broadcast is not None and moved:
            shapes = {name: list(io.specs[name][1]) for name in moved}
            sent_meta = {"format": BROADCAST_FORMAT, "codec": broadcast.codec,
                         "shapes": json.dumps(shapes, sort_keys=True), "base_sha256": broadcast.base_sha256,
                         "sha256": "0" * 64}  # θ''s, once written
            sent_out = files.enter_context(TensorWriter(broadcast_path, {
                part: spec for name, shape in shapes.items()
                for part, spec in part_specs(name, shape, broadcast.codec).items()}, sent_meta))
        floats = set(moved)
        for name in out.order:
            exact, entries = rule.moves(io, name)
            if broadcast is not None:  # θ plus the move as every machine decodes it: the θ' they rebuild
                value = t.get(name)
                if name in floats:
                    parts, exact, entries[RESIDUAL + name] = broadcast.send(
                        name, value, exact, io.part(RESIDUAL + name))
                    for part, tensor in parts.items():
                        sent_out.put(part, tensor)  # type: ignore[union-attr]
                else:
                    exact = apply_step({name: value}, {})[name]
            out.write(name, exact)
            for entry, tensor in entries.items():
                if entry in state_specs:
                    state_out.put(entry, tensor)  # type: ignore[union-attr]
        out.close()
        if sent_out is not None:  # it names θ''s sha256
            sent_out.set_metadata({**sent_meta, "sha256": file_sha256(next_path)})
            sent_out.close()
        if state_out is not None:
            state_out.close()
    return StepFiles(next_path, state_path if state_specs else None, broadcast_path if moved else None)
