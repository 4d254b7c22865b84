"""``report.html``: one run's report as one self-contained page, to share as a single file.

The page holds the figures of :mod:`.figures` as ``data:`` URIs (no file beside it,
no script, no request to anywhere) and the run's description as tables: a summary (run, mode,
recipe, options, machines, rounds or members, final metrics, bytes, times), the rounds or the
members, the machines, what went wrong (the error, failed, lost and handed-back attempts with
their tracebacks, incidents, warnings) and every attempt.

It is rendered with Jinja2 with autoescaping on: every value — recipe options, machine names,
error texts, anything a user or a recipe controls — is HTML-escaped unless the template says
otherwise, and it never does. (``string.Template`` would leave each value to be escaped by hand;
Jinja2 is already installed with torch.) Free text is also passed through
:func:`tensorturn.config.mask_text`, so a URL's password never reaches the page.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

from tensorturn.config import mask_text, mask_url, public
from tensorturn.runs.report.facts import clock, machines, origin, size, timeline
from tensorturn.spec import Outcome, options_json

# what each figure shows, under it on the page
CAPTIONS = {
    "loss": "Loss per round (fused: training and validation, with the validation metric beside it; the top "
            "axis is time since the run was created) or per member (ensemble: test loss and metric, the "
            "vote as a line).",
    "timeline": "Who ran what: each task attempt on its machine's row, coloured by how it ended; outer steps, "
                "evaluations and the vote hatched; crosses are incidents, dotted lines the rounds' ends.",
    "samples_per_worker": "Samples per second of each machine while it trained, from its successful attempts.",
    "bytes": "The model's bytes per round or task, and per machine what it moved through the store and the "
             "dataset bytes it downloaded and its tasks read.",
}

# spec fields that are not options a person chose (shown elsewhere, or bookkeeping)
_NOT_OPTIONS = frozenset({"run_id", "created_at", "mode", "recipe", "recipe_options", "options", "store_url",
                          "chosen", "init_sha256", "memory_needed_bytes", "planned"})

TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>TensorTurn run {{ run_id }}: {{ state }}</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1180px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: .2em; }
h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
code { font-size: .95em; } table { border-collapse: collapse; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; } th { background: #f5f5f5; }
table.kv th { width: 11em; } .state { padding: .1em .5em; border-radius: .3em; color: #fff; background: #777; }
.succeeded { background: #2a8a2a; } .failed { background: #c62828; } .running, .queued { background: #1565c0; }
.cancelled { background: #777; } p.error { color: #c62828; font-weight: bold; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: .9em; }
pre { white-space: pre-wrap; font-size: .85em; background: #f8f8f8; padding: .5em; }
footer { margin-top: 2em; color: #777; font-size: .85em; }
</style>
</head>
<body>
<header>
<h1>TensorTurn run <code>{{ run_id }}</code> <span class="state {{ state }}">{{ state }}</span></h1>
<p>{{ headline }}</p>
{% if error %}<p class="error" id="error">{{ error }}</p>{% endif %}
</header>

<section id="summary">
<h2>Summary</h2>
<table class="kv">
{% for name, value in summary %}<tr><th>{{ name }}</th><td>{{ value }}</td></tr>
{% endfor %}</table>
</section>

<section id="figures">
<h2>Figures</h2>
{% for f in figures %}<figure id="figure-{{ f.name }}">
<img src="{{ f.src }}" alt="{{ f.name }}">
<figcaption>{{ f.caption }}</figcaption>
</figure>
{% endfor %}</section>

{% if rounds %}<section id="rounds">
<h2>Rounds</h2>
<table>
<tr>{% for h in rounds.head %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in rounds.rows %}<tr>{% for v in row %}<td class="n">{{ v }}</td>{% endfor %}</tr>
{% endfor %}</table>
</section>{% endif %}

{% if members %}<section id="members">
<h2>Members</h2>
<table>
<tr>{% for h in members.head %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in members.rows %}<tr>{% for v in row %}<td>{{ v }}</td>{% endfor %}</tr>
{% endfor %}</table>
</section>{% endif %}

<section id="machines">
<h2>Machines</h2>
{% if machines.rows %}<table>
<tr>{% for h in machines.head %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in machines.rows %}<tr>{% for v in row %}<td>{{ v }}</td>{% endfor %}</tr>
{% endfor %}</table>{% else %}<p>No machine has worked on this run yet.</p>{% endif %}
</section>

<section id="problems">
<h2>What went wrong</h2>
{% if not (error or problems or incidents or warnings) %}
<p>Nothing: no attempt failed, was lost or handed back, and no incident was recorded.</p>{% endif %}
{% if problems %}<h3>Attempts that did not succeed</h3>
<table>
<tr><th>task</th><th>attempt</th><th>machine</th><th>started</th><th>outcome</th></tr>
{% for p in problems %}<tr><td>{{ p.task }}</td><td class="n">{{ p.attempt }}</td><td>{{ p.worker }}</td>
<td class="n">{{ p.start }}</td><td>{{ p.outcome }}{% if p.traceback %}
<details><summary>traceback</summary><pre>{{ p.traceback }}</pre></details>{% endif %}</td></tr>
{% endfor %}</table>{% endif %}
{% if incidents %}<h3>Incidents</h3>
<table>
<tr><th>at</th><th>kind</th><th>task</th><th>machine</th><th>detail</th></tr>
{% for i in incidents %}<tr><td class="n">{{ i.at }}</td><td>{{ i.kind }}</td><td>{{ i.task }}</td>
<td>{{ i.worker }}</td><td>{{ i.detail }}</td></tr>
{% endfor %}</table>{% endif %}
{% if warnings %}<h3>Warnings</h3>
<ul>{% for w in warnings %}<li>{{ w }}</li>{% endfor %}</ul>{% endif %}
</section>

<section id="attempts">
<h2>Attempts</h2>
<details><summary>All {{ attempts|length }} task attempts, in start order</summary>
<table>
<tr><th>start</th><th>end</th><th>machine</th><th>task</th><th>attempt</th><th>outcome</th></tr>
{% for a in attempts %}<tr><td class="n">{{ a.start }}</td><td class="n">{{ a.end }}</td><td>{{ a.worker }}</td>
<td>{{ a.task }}</td><td class="n">{{ a.attempt }}</td><td>{{ a.outcome }}</td></tr>
{% endfor %}</table>
</details>
</section>

<footer>Made by <code>tensorturn report</code> from the run's description
{%- if made_at %} as of {{ made_at }}{% endif %}.
Times are on the broker's clock (UTC); "+12.3s" is time since the run was created.</footer>
</body>
</html>
"""


def _when(t: Any) -> str:
    return "—" if t is None else datetime.fromtimestamp(float(t), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _number(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _since(t: Any, t0: float | None) -> str:
    return "—" if t is None or t0 is None else "+" + clock(max(0.0, float(t) - t0))


def _pairs(values: dict[str, Any]) -> str:
    """``k=v, k=v`` with each value as JSON writes it (strings unquoted), ``—`` when empty."""
    shown = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in values.items()]
    return ", ".join(shown) or "—"


def _summary(doc: dict[str, Any], workers: list[dict[str, Any]], t0: float | None) -> list[tuple[str, str]]:
    spec = doc.get("spec") or {}
    options = options_json(spec)
    chosen = {k: v for k, v in {**spec, **options}.items() if k not in _NOT_OPTIONS and v is not None}
    mode = doc.get("mode", "?")
    if mode == "fused" and options.get("sync"):
        mode += f" (--sync {options['sync']})"
    rows = [("run", doc.get("run_id", "?")), ("state", doc.get("state", "?")), ("mode", mode),
            ("recipe", doc.get("recipe") or spec.get("recipe") or "?"),
            ("recipe options", _pairs(public(spec.get("recipe_options") or {}))),
            ("options", _pairs(public(dict(sorted(chosen.items()))))),
            ("machines", f"{len(workers)}: " + ", ".join(m["worker"] for m in workers) if workers else "none yet")]
    if doc.get("mode") == "fused":
        rounds = doc.get("rounds") or []
        of = options.get("rounds")
        rows.append(("rounds", f"{len(rounds)} of {of}" if of else str(len(rounds))))
    else:
        members = doc.get("members") or []
        states = [m.get("state") for m in members]
        rows.append(("members", f"{len(members)}: " + ", ".join(
            f"{states.count(s)} {s}" for s in sorted({s for s in states if s})) if members else "none yet"))
    planned = options.get("planned") or {}
    if planned:
        from tensorturn.runs.display import measured_utilisation, plan_lines, utilisation_text

        chose = plan_lines(planned)[0].removeprefix("plan: ")
        rows.append(("plan", chose + " — " + "; ".join(planned.get("why") or [])))
        if planned.get("predicted_utilisation") is not None:
            rows.append(("utilisation", utilisation_text(planned, measured_utilisation(doc))))
    metrics = doc.get("metrics") or {}
    rows.append(("final metrics", ", ".join(f"{k} {_number(v)}" for k, v in sorted(metrics.items())) or "—"))
    if doc.get("model_uri"):
        rows.append(("model", f"{mask_url(doc['model_uri'])} (sha256 {doc.get('model_sha256') or '?'})"))
    rows.append(("model bytes", f"{size(doc.get('bytes_up'))} up, {size(doc.get('bytes_down'))} down"))
    rows.append(("store bytes", f"{size(doc.get('store_bytes_up'))} stored, "
                                f"{size(doc.get('store_bytes_down'))} fetched (every object, retries included)"))
    rows.append(("dataset bytes", f"{size(sum(m['data_downloaded'] for m in workers))} downloaded, "
                                  f"{size(sum(m['data_read'] for m in workers))} read by tasks"))
    if spec.get("store_url"):
        rows.append(("store", mask_url(spec["store_url"])))
    ended: dict[str, int] = {}
    for a in doc.get("attempts", []):
        word = Outcome.of(a.get("outcome") or "")
        ended[word.value if word else "other"] = ended.get(word.value if word else "other", 0) + 1
    rows.append(("attempts", f"{sum(ended.values())}" + (": " + ", ".join(
        f"{n} {w}" for w, n in sorted(ended.items())) if ended else "")))
    times = f"created {_when(doc.get('created_at'))}"
    if doc.get("started_at") is not None:
        times += f", started {_since(doc['started_at'], t0)}"
    if doc.get("finished_at") is not None:
        times += f", finished {_since(doc['finished_at'], t0)}"
    rows.append(("time", times))
    return [(name, mask_text(value)) for name, value in rows]


def _rounds(doc: dict[str, Any], t0: float | None) -> dict[str, Any] | None:
    rounds = doc.get("rounds") or []
    if doc.get("mode") != "fused" or not rounds:
        return None
    metric = "val_accuracy" if any(r.get("val_accuracy") is not None for r in rounds) else None
    stale = any("mean_staleness" in r for r in rounds)
    head = ["round", "at", "training loss", "validation loss"] + ([metric.replace("val_", "validation ")]
                                                                  if metric else [])
    head += ["samples", "bytes up", "bytes down"] + (["staleness (mean / max)"] if stale else [])
    rows = []
    for r in rounds:
        row = [r.get("round"), _since(r.get("at"), t0), _number(r.get("loss")), _number(r.get("val_loss"))]
        row += [_number(r.get(metric))] if metric else []
        row += [_number(r.get("samples")), size(r.get("bytes_up")), size(r.get("bytes_down"))]
        row += [f"{_number(r.get('mean_staleness'))} / {_number(r.get('max_staleness'))}"] if stale else []
        rows.append(row)
    return {"head": head, "rows": rows}


def _members(doc: dict[str, Any]) -> dict[str, Any] | None:
    members = doc.get("members") or []
    if doc.get("mode") != "ensemble" or not members:
        return None
    rows = []
    for m in members:
        metrics = m.get("metrics") or {}
        rows.append([f"m{m.get('member')}", m.get("state") or "?", _number(m.get("segments_done")),
                     _number(metrics.get("test_loss")), _number(metrics.get("test_accuracy")),
                     ", ".join(m.get("workers") or []) or "—", mask_text(m.get("reason") or "")])
    return {"head": ["member", "state", "segments done", "test loss", "test accuracy", "machines", "why dropped"],
            "rows": rows}


def _machines(workers: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for m in workers:
        rate = m.get("samples_per_s")
        rows.append([m["worker"], m["tasks"], f"{rate:.1f}" if rate else "—", clock(m["busy_s"]),
                     ", ".join(f"{n} {w}" for w, n in m["attempts"].items()) or "—",
                     f"{size(m['store_up'])} / {size(m['store_down'])}",
                     f"{size(m['data_downloaded'])} / {size(m['data_read'])}"])
    return {"head": ["machine", "training tasks", "samples/s while training", "busy training", "attempts",
                     "store: stored / fetched", "dataset: downloaded / read"], "rows": rows}


def render(doc: dict[str, Any], figures: dict[str, bytes]) -> str:
    """The page of one run: its description ``doc`` and its PNG ``figures`` by name."""
    import jinja2

    workers, bars, t0 = machines(doc), timeline(doc), origin(doc)
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    tracebacks = {(a.get("task"), a.get("attempt")): a.get("traceback") for a in doc.get("attempts", [])}
    problems = [{"task": b["task"], "attempt": b["attempt"], "worker": b["worker"],
                 "start": "+" + clock(b["start"]), "outcome": mask_text(b["outcome"]),
                 "traceback": mask_text(tracebacks.get((b["task"], b["attempt"])) or "")}
                for b in bars if b["ended"] not in (Outcome.SUCCEEDED, Outcome.RUNNING)]
    incidents = [{"at": _since(i.get("at"), t0), "kind": i.get("kind", "?"), "task": i.get("task") or "—",
                  "worker": i.get("worker") or "—", "detail": mask_text(i.get("detail") or "")}
                 for i in doc.get("incidents", [])]
    attempts = [{"start": "+" + clock(b["start"]), "end": "running" if b["running"] else "+" + clock(b["end"]),
                 "worker": b["worker"], "task": b["task"], "attempt": _number(b["attempt"]),
                 "outcome": mask_text(b["outcome"])} for b in bars]
    recipe = doc.get("recipe") or (doc.get("spec") or {}).get("recipe") or "?"
    headline = f"{doc.get('mode', '?')} run of {recipe} on {len(workers)} machine(s)"
    if doc.get("finished_at") is not None and doc.get("created_at") is not None:
        headline += f", {clock(float(doc['finished_at']) - float(doc['created_at']))} from creation to end"
    return env.from_string(TEMPLATE).render(
        run_id=doc.get("run_id", "?"), state=doc.get("state", "?"), headline=headline,
        error=mask_text(doc.get("error") or ""), summary=_summary(doc, workers, t0),
        figures=[{"name": name, "caption": CAPTIONS.get(name, ""),
                  "src": "data:image/png;base64," + base64.b64encode(png).decode("ascii")}
                 for name, png in figures.items()],
        rounds=_rounds(doc, t0), members=_members(doc), machines=_machines(workers),
        problems=problems, incidents=incidents, warnings=[mask_text(w) for w in doc.get("warnings", [])],
        attempts=attempts, made_at=_when(doc.get("progress_at")) if doc.get("progress_at") else "")
