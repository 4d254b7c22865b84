"""Ensemble mode: diverse full models trained independently on every machine, then a vote.

Each of M members gets its own seed, its own draw from the recipe's configuration space and, by
default, its own bootstrap sample of the training rows — diversity is what makes a vote beat its
members (Dietterich 2000; Lakshminarayanan et al. 2017, arXiv 1612.01474). Everything drawn is
recorded per member in the manifest. The plug-in (this module, no torch) holds the options; the
Celery tasks are :mod:`.tasks` (segments) and :mod:`.vote` (the vote).

Guarantees:

* A member trains in segments chained through checkpoints in the store (weights and AdamW
  state), so a machine lost mid-member costs one segment; the next segment runs on any machine.
* Every task goes through the attempt protocol: a segment whose checkpoint exists is not trained
  again and writes nothing, each next segment and the vote are queued once, so duplicate or late
  deliveries change nothing.
* A member whose segment (or its evaluation) fails ``max_attempts`` times, that is still
  training at the deadline, or that diverged — NaN/Inf weights or metrics, or a validation loss
  no lower than its untrained model's (:func:`.tasks.judge`) — drops out of the vote with a
  ``member_dropped`` incident, and the manifest says why; the run succeeds while at least
  ``min_members`` members remain, and fails with every member's reason otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorturn.errors import SpecError
from tensorturn.modes import ModeBase
from tensorturn.spec import LIMITS, MemberState, ModeOptions, Workload, check_bounds, options_json
from tensorturn.state.live import WIDTH, figures, fit

if TYPE_CHECKING:
    from tensorturn.recipes import Recipe
    from tensorturn.spec import RunSpec
    from tensorturn.state.board import RunBoard

VOTES = ("soft", "hard")
DIVERSITY = ("full", "seed")


@dataclass
class EnsembleOptions(ModeOptions):
    HELP = """
    members         models to train, at least 2 (default: one per online machine)
    min_members     the run fails if fewer members finish
    vote            soft = mean probability, hard = majority of top classes
    segments        checkpointed segments per member (a lost machine costs one)
    segment_steps   optimizer steps per segment
    bootstrap       train each member on its own bootstrap sample of the data
    diversity       full = seed + a draw from the recipe's config space; seed = seed only
    deadline        seconds after submission; members still training then drop out
    init_from       start every member from this finished one-model run (members keep its architecture; a soup needs it)
    """
    CHOICES = {"vote": VOTES, "diversity": DIVERSITY}

    members: int | None = None          # None: one per online machine, at least 2 (set at submit)
    min_members: int = 1
    vote: str = "soft"
    segments: int = 3
    segment_steps: int = 400
    bootstrap: bool = True
    diversity: str = "full"             # full: seed + config draw; seed: seed (+ bootstrap) only
    deadline: float | None = None       # seconds after creation; later segments drop their member
    init_from: str | None = None        # a finished one-model run every member starts from
    # derived at start from init_from: its model's configuration and its file's sha256
    init_config: dict[str, Any] | None = None
    init_sha256: str = ""

    def validate(self) -> None:
        super().validate()
        if self.members == 1:
            raise SpecError("--members must be at least 2: an ensemble of 1 does not vote "
                            "(use --mode fused for one model)")
        check_bounds({"members": self.members, "min_members": self.min_members,
                      "segments": self.segments, "segment_steps": self.segment_steps,
                      "deadline": self.deadline})
        if self.members is not None and self.min_members > self.members:
            raise SpecError(f"--min-members ({self.min_members}) cannot exceed "
                            f"--members ({self.members})")

    def workload(self) -> Workload:
        """A task per member and segment, every member's first queued at once. Members left to
        the pool count as 2 here and are checked again once the pool has set them."""
        members = self.members or 2
        return Workload(tasks=(members * self.segments, "--members × --segments"),
                        queued=(members, "--members"),
                        steps=(self.segments * self.segment_steps, "--segments × --segment-steps"))


def options(spec: "RunSpec") -> EnsembleOptions:
    return spec.opts(EnsembleOptions)


def all_finished(spec: "RunSpec", board: "RunBoard") -> bool:
    """Whether every member has finished (succeeded or dropped): the vote may run."""
    return board.members.done_count(spec.run_id) >= (options(spec).members or 0)


class Ensemble(ModeBase):
    def prepare(self, spec: "RunSpec", online_workers: int) -> None:
        self.size(spec, online_workers)
        opts = spec.opts(EnsembleOptions)
        if opts.init_from:
            from tensorturn.modes.ensemble.tasks import pin_init

            pin_init(spec)

    def size(self, spec: "RunSpec", workers: int) -> None:
        """Members by default: one per machine of the pool (``workers``), at least two."""
        opts = spec.opts(EnsembleOptions)
        if opts.members is None:
            opts.members = min(max(2, opts.min_members, workers), int(LIMITS["members"].high))

    def model_configs(self, spec: "RunSpec", recipe: "Recipe") -> list[dict[str, Any]]:
        from tensorturn.modes.ensemble.tasks import member_plan

        return [m["model"] for m in member_plan(spec, recipe)]

    def progress(self, doc: dict[str, Any]) -> tuple[int, int, list[tuple[str, str]]]:
        options = options_json(doc.get("spec") or {})
        total = int(options.get("members") or 0) * int(options.get("segments", 0))
        done, events = 0, []
        for m in doc.get("members", []):
            done += m.get("segments_done", 0)
            if m["state"] == MemberState.SUCCEEDED:
                test = figures(m["metrics"], "test_", brief=True)  # a regression's: loss, MAE…
                events.append((f"m{m['member']}", f"member {m['member']} succeeded"
                               + (f"  {test}" if test else "")))
            elif m["state"] == MemberState.DROPPED:
                events.append((f"m{m['member']}", f"member {m['member']} dropped: {m['reason']}"))
        return done, total, events

    def live_line(self, doc: dict[str, Any], width: int = WIDTH) -> str:
        """Every member from the start: queued, training (segments done, with the one in hand as
        a fraction, and its latest loss), done or dropped — ``m0 1.4/3 0.412, m1 queued``; when
        that does not fit, the losses go, then the members are counted by state."""
        members = doc.get("members") or []
        n = int(options_json(doc.get("spec") or {}).get("segments", 0))
        if not members:
            return ""
        counts: dict[str, int] = {}
        short, long, segments = [], [], 0.0
        for m in members:
            state, live = m.get("state", MemberState.QUEUED), m.get("live")
            done = float(m.get("segments_done", 0))
            if live and live["segment"] >= done and live["steps"]:
                done = live["segment"] + min(live["step"] / live["steps"], 1.0)
            segments += n if state == MemberState.SUCCEEDED else done
            counts[state] = counts.get(state, 0) + 1
            if state == MemberState.RUNNING:
                word = f"m{m['member']} {done:.1f}/{n}"
                loss = live.get("loss") if live else None
                short.append(word)
                long.append(word + (f" {loss:.3g}" if loss is not None else ""))
            else:
                word = f"m{m['member']} {'done' if state == MemberState.SUCCEEDED else state}"
                short.append(word)
                long.append(word)
        for words in (long, short):
            line = ", ".join(words)
            if len(line) <= width:
                return line
        names: dict[str, str] = {MemberState.RUNNING: "training", MemberState.SUCCEEDED: "done"}
        states = ", ".join(f"{c} {names.get(s, s)}" for s, c in sorted(counts.items()))
        return fit(f"{len(members)} members: {states}; {segments:.1f}/{len(members) * n} segments", width)


MODE = Ensemble("ensemble", EnsembleOptions, "segments", "tensorturn.modes.ensemble.tasks")
