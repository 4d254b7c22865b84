"""How a run reads as text: the progress a followed run prints as it goes, and the lines that
say how it ended — what ``run``, ``resume``, ``distill`` and ``status`` print, callable from
Python (the CLI adds ``--json`` and the exit code).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from typing import Any

from tensorturn.registry import get_mode
from tensorturn.spec import MemberState, RunState
from tensorturn.state.live import WIDTH, figure, fit

LIVE_EVERY_S = 2.0  # without a terminal, what a run does now is printed at most this often
Say = Callable[[str], None]


def to_stderr(line: str) -> None:
    """A line on stderr, where progress goes (stdout holds the result)."""
    print(line, file=sys.stderr, flush=True)


def shape(note: str | None) -> str | None:
    """A line without its durations: "no progress for 130s" is not news after "… for 120s"."""
    return re.sub(r"\d+(\.\d+)?s\b", "Ns", note) if note else note


class RunProgress:
    """Live progress on stderr: a bar on a terminal, with what the run does now beside it;
    otherwise a line per finished unit, in order, and — indented, when it changed, at most
    every LIVE_EVERY_S — what the run does now. What a unit is (a round, a member's segment)
    and what "now" says are the mode's (``progress``, ``live_line``). Lines fit 80 columns;
    without a terminal they go to ``say``."""

    def __init__(self, doc: dict[str, Any], quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic, say: Say = to_stderr):
        self.mode = get_mode(doc["mode"])
        self.quiet, self.info, self.note, self.say = quiet, "", None, say
        self.clock, self.live, self.live_at = clock, "", float("-inf")
        self.lines_seen: set[str] = set()
        _, self.total, _ = self.mode.progress(doc)
        self.bar = None
        if sys.stderr.isatty() and not quiet:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            # state, a short bar and the time leave the info column about 50 of 80 columns
            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=10),
                                TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                                console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task("queued", total=self.total, info="")
            self.bar.start()

    def __call__(self, doc: dict[str, Any]) -> None:
        done, self.total, events = self.mode.progress(doc)
        for key, line in events:
            if key in self.lines_seen:
                continue
            self.lines_seen.add(key)
            self.info = line
            self._say(line)
        if shape(doc.get("note")) != shape(self.note):  # a stalled run says why, once per change
            self.note = doc.get("note")
            if self.note:
                self._say(f"warning: {self.note}")
        if self.bar is not None:
            width = max(self.bar.console.width - len(str(doc["state"])) - 10 - 7 - 3, 20)
            live = self.mode.live_line(doc, width)
            self.bar.update(self.task, completed=done, total=self.total, description=doc["state"],
                            info=live or fit(self.info, width))
            return
        live = self.mode.live_line(doc, WIDTH - 2)
        # a line that only counts seconds (an outer step evaluating) is not printed again
        if live and shape(live) != shape(self.live) and self.clock() - self.live_at >= LIVE_EVERY_S:
            self.live, self.live_at = live, self.clock()
            self._say("  " + live)

    def _say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line, highlight=False)
        elif not self.quiet:
            self.say(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def shown(doc: dict[str, Any]) -> dict[str, Any]:
    """A run's description as every command prints it: the recipe options and the settings it
    ran with passed through :func:`tensorturn.config.public` (a ``password=``, an ``api_key=``
    or a URL's password masked) — what the dashboard, ``report.html`` and ``runs`` show too."""
    from tensorturn.config import public

    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return doc
    masked = {**spec, **{k: public(spec[k]) for k in ("recipe_options", "run_config") if spec.get(k)}}
    planned = planned_of(doc)
    extra = {"utilisation": {"predicted": planned.get("predicted_utilisation"),
                             "measured": measured_utilisation(doc)}} if planned else {}
    return {**doc, "spec": masked, **extra}


def measured_utilisation(doc: dict[str, Any]) -> float | None:
    """The share of the trainers' time their shard tasks spent training, so far: the training
    seconds of the succeeded shard attempts (``trained_s``) ÷ (the machines that trained × the
    time from the first such attempt's start to the last one's end). What a fused run's plan
    predicted (``predicted_utilisation``) is the same measure in a steady round; a run's first
    round and its end (the last outer step, the test) count here, so a short run reads lower.
    None before a shard attempt has finished."""
    trained = [a for a in doc.get("attempts") or []
               if a.get("trained_s") is not None and a.get("outcome") == "succeeded" and a.get("finished_at")]
    if not trained:
        return None
    span = max(a["finished_at"] for a in trained) - min(a["started_at"] for a in trained)
    machines = len({a["worker"] for a in trained})
    return round(min(sum(a["trained_s"] for a in trained) / (machines * span), 1.0), 3) if span > 0 else None


def planned_of(doc: dict[str, Any]) -> dict[str, Any]:
    """A fused run's plan as its spec holds it (empty for any other run)."""
    spec = doc.get("spec")
    opts = spec.get("options") if isinstance(spec, dict) else None
    return (opts.get("planned") if isinstance(opts, dict) else None) or {}


def utilisation_text(plan: dict[str, Any], measured: float | None) -> str:
    """Predicted beside measured utilisation, in words. A round the plan predicts shorter than
    :data:`~tensorturn.modes.fused.plan.SMALL_ROUND_S` is mostly the fixed costs it assumes
    for any pool (dispatch, round trips): then the prediction is said to be rough."""
    from tensorturn.modes.fused.plan import SMALL_ROUND_S

    text = (f"predicted {plan['predicted_utilisation']:.2f} by the plan, measured "
            + ("— (no shard finished yet)" if measured is None else f"{measured:.2f}"))
    round_s = plan.get("round_s")
    if isinstance(round_s, (int, float)) and round_s < SMALL_ROUND_S:
        text += (f" (a round of {round_s:.1f} s is mostly the fixed costs the plan assumes for any "
                 f"pool: for a model this small its prediction is rough)")
    return text


def plan_lines(plan: dict[str, Any], indent: str = "") -> list[str]:
    """A fused run's plan (:class:`tensorturn.modes.fused.plan.Plan`) in a few lines: what it
    chose, what it predicts, and why."""
    down = "" if plan["broadcast_codec"] == plan["codec"] else f" up, {plan['broadcast_codec']} down"
    outer = "beside the store" if plan["outer_role"] == "store" else "on a trainer"
    lines = [f"{indent}plan: codec {plan['codec']}{down}; sync {plan['sync']}; H {plan['sync_every']}; "
             f"{plan['shards']} shards; outer steps {outer}",
             f"{indent}  " + (f"predicted utilisation {plan['predicted_utilisation']:.2f}, a round "
                              f"{plan['round_s']:.1f} s, " if plan.get("predicted_utilisation") is not None
                              else "no utilisation predicted (no step timed), ")
             + f"{plan['bytes_per_round'] / 1e6:,.1f} MB over the links a round"]
    lines += [f"{indent}  - {why}" for why in plan.get("why") or []]
    return lines


def result_lines(doc: dict[str, Any]) -> list[str]:
    """A run's outcome in a few lines: its state and error, when it was cancelled, its metrics,
    the ensemble members left out of its vote, what it was merged from, and its model."""
    lines = [f"run {doc['run_id']}: {doc['state']}"]
    if doc.get("error"):
        lines.append(f"  error: {doc['error']}")
    if doc["state"] == RunState.CANCELLED:
        cancelled = doc.get("cancelled") or {}
        at = cancelled.get("at") or doc.get("finished_at")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else "?"
        lines.append(f"  cancelled at {when}" + (f" by {cancelled['by']}" if cancelled.get("by") else "")
                     + f"; `tensorturn resume {doc['run_id']}` continues it")
    for k, v in sorted((doc.get("metrics") or {}).items()):
        lines.append(f"  {k}: {figure(v)}")  # rounded for people; --json keeps every digit
    best_r2 = (doc.get("metrics") or {}).get("best_member_test_r2")
    if isinstance(best_r2, (int, float)) and best_r2 < 0:
        lines.append(f"  warning: every member's R² on the test rows is below 0 (the best: {figure(best_r2)}): "
                     f"each predicts worse than the targets' mean (a learning rate too high? too few steps?)")
    utilisation = doc.get("utilisation") or {}
    if utilisation.get("predicted") is not None:
        lines.append("  utilisation: " + utilisation_text(planned_of(doc), utilisation.get("measured")))
    if doc.get("agents"):
        agents = doc["agents"]
        lines.append(f"  trained on {len(agents)} agent{'s' if len(agents) != 1 else ''}: {', '.join(agents)}")
    for m in doc.get("members") or []:  # an ensemble's members left out of its vote, and why
        if m["state"] == MemberState.DROPPED:
            lines.append(f"  member {m['member']} dropped: {m['reason']}")
    lineage = doc.get("lineage") or {}
    if "distilled_from" in lineage:
        lines.append(f"  distilled from: run {lineage['distilled_from']} (T {lineage['temperature']:g}, "
                     f"alpha {lineage['alpha']:g}, top-k {lineage['top_k']})")
    if "souped_from" in lineage:
        lines.append(f"  souped from: run {lineage['souped_from']} ({lineage['rule']} soup of "
                     f"members {', '.join(map(str, lineage['members']))})")
    if doc.get("model_uri"):
        lines.append(f"  model: {doc['model_uri']}")
        lines.append(f"  sha256: {doc['model_sha256']}")
    return lines


def as_one(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one launch as one object: the last run's description, holding the ensemble a
    student was distilled from (``run --merge distill``) as ``ensemble``."""
    return docs[0] if len(docs) == 1 else {**docs[-1], "ensemble": docs[0]}
