"""The figures a fused run's plan is made from (:mod:`.plan`): each trainer's links to the store
and broker, from its heartbeat, and its step time for the recipe, written with each of its shard
attempts' end (``step_s``: :meth:`tensorturn.state.workers.Workers.step_time`). No torch: ``run
--plan-only`` reads them from the CLI.

The links are the agent's own (``link_up_bps``, ``link_down_bps``, ``broker_rtt_s``; its owner's
caps ``cap_up_bps``/``cap_down_bps`` bound them — :func:`tensorturn.state.roster.links` when it
exists). A figure missing is said so in the plan's reasons ("not measured"), never invented: the
plan takes such a link as fast as loopback. A heartbeat is in Redis, so these figures are claims
like any other live figure; they steer the run's speed, never its result's correctness.
"""

from __future__ import annotations

import json
from typing import Any

from tensorturn.modes.fused.plan import Machine, OuterSide
from tensorturn.state import roster

STALE_S = 600.0  # a link measured longer ago than this is said to be stale


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") and number > 0 else None


def per_recipe(raw: Any) -> dict[str, Any]:
    """A worker's figures by recipe (``step_s``, ``eval_s``: JSON, recipe → seconds), or none."""
    try:
        doc = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str)} if isinstance(doc, dict) else {}


def link_figures(client: Any) -> dict[str, dict[str, Any]]:
    """Each agent's effective link figures by name: ``up_bps``, ``down_bps`` (bytes/s: the
    measured rate bounded by its owner's cap, the cap alone when not measured, None when
    neither), ``rtt_s`` and ``stale``. :func:`tensorturn.state.roster.links` where it exists;
    else read from the heartbeats' fields here."""
    links = getattr(roster, "links", None)
    if links is not None:
        return dict(links(client))
    from tensorturn.state.clock import broker_now

    now = broker_now(client)
    out: dict[str, dict[str, Any]] = {}
    for name, h in roster.heartbeats(client).items():
        def rate(measured: str, cap: str, h: dict[str, Any] = h) -> float | None:
            m, c = _number(h.get(measured)), _number(h.get(cap))
            return min(m, c) if m and c else (m or c)

        measured_at = _number(h.get("link_measured_at"))
        out[name] = {"up_bps": rate("link_up_bps", "cap_up_bps"),
                     "down_bps": rate("link_down_bps", "cap_down_bps"),
                     "rtt_s": _number(h.get("broker_rtt_s")),
                     "stale": measured_at is not None and now - measured_at > STALE_S}
    return out


def step_times(client: Any) -> dict[str, dict[str, float]]:
    """Each agent's published step seconds by recipe (its ``step_s`` field)."""
    return {name: {k: float(v) for k, v in per_recipe(h.get("step_s")).items() if _number(v)}
            for name, h in roster.heartbeats(client).items()}


def outer_side(client: Any, recipe: str | None = None) -> tuple[OuterSide, str]:
    """What the agents that take the run's outer steps measured — those beside the store that
    serve the outer queue, else the trainers: the seconds a unit of its work takes, as they
    published it after their last steady step, and the seconds an evaluation of a round of
    ``recipe`` took them (the slowest's of each: any of them may take the next) — and a
    sentence saying where the figures come from."""
    workers = [w for w in roster.list_workers(client) if w["state"] in roster.TAKES_TASKS]
    beside = [w["name"] for w in workers if w.get("role") in ("outer", "both")]
    takers = beside or [w["name"] for w in workers if w.get("role", "train") in ("train", "both")]
    beats = roster.heartbeats(client)
    rates = [r for name in takers if (r := _number((beats.get(name) or {}).get("outer_s_unit"))) is not None]
    evals = [e for name in beside if (e := _number(per_recipe((beats.get(name) or {}).get("eval_s"))
                                                   .get(recipe or ""))) is not None]
    eval_s = max(evals, default=0.0)  # (on the trainers, evaluations go behind the next round's shards)
    said = (f"the outer step's rate as measured on {len(rates)} of {len(takers)} agent(s) that take it"
            if rates else "the outer step's rate not measured yet on this pool: the model's figure taken")
    return (OuterSide(max(rates) if rates else None, eval_s),
            said + (f"; a round's evaluation {eval_s:.1f} s there" if eval_s else ""))


def pool_machines(client: Any, recipe: str) -> tuple[list[Machine], bool, list[str]]:
    """The pool's trainers as the plan sees them, whether an agent beside the store serves the
    outer queue (``--role outer`` or ``both``), and sentences on what was not measured."""
    workers = [w for w in roster.list_workers(client) if w["state"] in roster.TAKES_TASKS]
    trainers = [w for w in workers if w.get("role", "train") in ("train", "both")]
    beside = any(w.get("role") in ("outer", "both") for w in workers)
    links, steps = link_figures(client), step_times(client)
    machines, unmeasured, stale, untimed = [], [], [], []
    for w in trainers:
        name = w["name"]
        link = links.get(name) or {}
        step = steps.get(name, {}).get(recipe)
        if link.get("up_bps") is None or link.get("down_bps") is None:
            unmeasured.append(name)
        elif link.get("stale"):
            stale.append(name)
        if step is None:
            untimed.append(name)
        machines.append(Machine(name, step, link.get("up_bps"), link.get("down_bps"), link.get("rtt_s")))
    notes = []
    if unmeasured:
        notes.append(f"links not measured on {', '.join(unmeasured)}: taken as fast as loopback")
    if stale:
        notes.append(f"links measured over {STALE_S / 60:.0f} min ago on {', '.join(stale)}")
    if untimed and len(untimed) < len(machines):
        notes.append(f"no {recipe} step timed yet on {', '.join(untimed)}: θ_0's step time taken")
    return machines, beside, notes
