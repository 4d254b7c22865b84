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

A machine's upload does not hold it either: a shard task hands its pseudo-gradient to a thread
that uploads it under a lease (:mod:`~tensorturn.modes.fused.uploads`), and ends. Round r's
outer step is queued once every shard of the round ended its task and θ_r is stored, and waits
there for the uploads; an upload whose lease lapses is a shard trained again — from the same
weights with the same seed, so the same bytes: whichever machines ran it, and whatever died, the
run's weights are the same.

The price is staleness: the outer step applies pseudo-gradients that did not see the last
average. ``--outer auto`` takes plain averaging (sgd) here: a Nesterov step one round late
overshoots.
"""

from __future__ import annotations

from tensorturn import layout
from tensorturn.modes.fused.options import options
from tensorturn.modes.fused.plans import (
    Context,
    QueueEval,
    QueueRound,
    QueueStep,
    ShardDone,
    ShardPlan,
    StepDone,
    StepPlan,
    Work,
)
from tensorturn.modes.fused.sync.rounds import Rounds, last_stored_round


class Overlap(Rounds):
    """Rounds one step apart: round r trains from θ_{r−1} while round r−1's outputs go up and
    its outer step runs."""

    name = "overlap"

    def start(self, run: Context) -> list[Work]:
        return [QueueRound(r) for r in range(min(2, options(run.spec).rounds))]  # both train from θ_0

    def resume(self, run: Context) -> tuple[list[Work], str]:
        """Continue from the last round whose global weights are stored: θ_r lets rounds r and
        r+1 train; what of them is stored already is not redone, and what was handed over or
        uploading before is forgotten (those uploads' agents are gone: their tasks run again)."""
        spec = run.spec
        r, evals = last_stored_round(spec, run.store, run.board)
        rounds = options(spec).rounds
        run.board.uploads.forget_uploads(spec.run_id, range(max(r - 1, 0), rounds), options(spec).shards)
        works = [*evals, *(QueueRound(n) for n in range(r, min(r + 2, rounds)))]
        works += step_when_ready(run, r)  # its shards may all be stored already
        return works, f"resumed at round {r} of 0..{rounds - 1}, overlapped"

    def shard_plan(self, r: int, k: int) -> ShardPlan:
        """From θ_{r−1} minus its own output of round r−1; uploaded in the background. (Round
        r+2 is queued once θ_{r+1} is stored: its base is there before it.)"""
        return ShardPlan(base=max(r - 1, 0), own_start=True, background=True)

    def step_plan(self, r: int) -> StepPlan:
        return StepPlan(uploads=True)

    def on_output(self, run: Context, done: ShardDone) -> list[Work]:
        return step_when_ready(run, done.r)

    def on_step(self, run: Context, done: StepDone) -> list[Work]:
        """θ_{r+1} is stored (or this outer step ended without it: then nothing follows yet):
        round r+2 can train, round r+1's outer step run once its shards are in, and θ_{r+1} be
        evaluated."""
        spec, r = run.spec, done.r
        if not run.store.exists(layout.key("global", spec.run_id, r + 1)):
            return []
        rounds = options(spec).rounds
        works: list[Work] = [QueueRound(r + 2)] if r + 2 < rounds else []
        if r + 1 < rounds:  # the evaluation first: round r+1's outer step may end the run
            works += [QueueEval(r), *step_when_ready(run, r + 1)]
        return works


def step_when_ready(run: Context, r: int) -> list[Work]:
    """Round r's outer step, once θ_r is stored and every shard of the round ended its task (its
    output stored or uploading). Both facts are written before either side looks at the other's,
    so whichever comes last queues it."""
    spec, store = run.spec, run.store
    run_id = spec.run_id
    if not store.exists(layout.key("global", run_id, r)):
        return []
    handed = run.board.uploads.handed(run_id, r)
    if any(k not in handed and not store.exists(layout.key("shard", run_id, r, k))
           for k in range(options(spec).shards)):
        return []
    return [QueueStep(r)]
