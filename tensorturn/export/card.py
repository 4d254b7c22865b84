"""The exported folder's ``README.md``: a model card (Mitchell et al., "Model Cards for Model
Reporting", 2019; the layout Hugging Face model cards use) written from the run's record — what
the model is, how it scored, what it learnt from, and how it was trained."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any


def _when(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "unknown"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "unknown"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _number(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def machines(manifest: dict[str, Any]) -> list[str]:
    """The machines (agents) that ran the run's tasks, by name."""
    names = {a.get("worker") for a in manifest.get("attempts") or [] if a.get("worker")}
    for member in manifest.get("members") or []:
        names.update(member.get("workers") or [])
    return sorted(str(n) for n in names)


def training(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """How the run trained, as (what, value) rows."""
    spec = manifest.get("spec") or {}
    options = spec.get("options") or {}
    attempts = manifest.get("attempts") or []
    retried = sum(1 for a in attempts if a.get("outcome") not in (None, "succeeded"))
    rows = [("mode", str(manifest.get("mode"))), ("machines", ", ".join(machines(manifest)) or "unknown"),
            ("seed", str(spec.get("seed")))]
    if manifest.get("mode") == "fused":
        rows += [("rounds", f"{len(manifest.get('rounds') or [])} of {options.get('rounds')}"),
                 ("shards", str(options.get("shards"))), ("inner steps per round", str(options.get("sync_every"))),
                 ("sync", str(options.get("sync"))),
                 ("outer optimizer", f"{options.get('outer')} (lr {options.get('outer_lr')}, momentum "
                                     f"{options.get('outer_momentum')})"),
                 ("codec", str(options.get("codec")))]
    else:
        members = manifest.get("members") or []
        done = [m for m in members if m.get("state") == "succeeded"]
        rows += [("members", f"{len(done)} voting of {len(members)}"), ("vote", str(options.get("vote", "soft")))]
    rows += [("task attempts", f"{len(attempts)} ({retried} not succeeded: requeued or retried)"),
             ("model bytes up / down", f"{_size(manifest.get('bytes_up'))} / {_size(manifest.get('bytes_down'))}"),
             ("store bytes up / down", f"{_size(manifest.get('store_bytes_up'))} / "
                                       f"{_size(manifest.get('store_bytes_down'))}"),
             ("started", _when(manifest.get("started_at"))), ("finished", _when(manifest.get("finished_at")))]
    data_read = manifest.get("data_read_bytes") or {}
    if data_read:
        rows.append(("dataset bytes read", _size(sum(v for v in data_read.values() if isinstance(v, (int, float))))))
    return rows


def kept_round(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The record of the round whose weights the run kept (``metrics.kept_round``: the last, or
    with ``--keep best`` the one of lowest validation loss), or None (an ensemble has no rounds);
    a run that recorded no kept round kept its last."""
    rounds = manifest.get("rounds") or []
    kept = (manifest.get("metrics") or {}).get("kept_round")
    if kept is None:
        return rounds[-1] if rounds else None
    return next((r for r in rounds if r.get("round") == kept), None)


def model_card(doc: dict[str, Any], manifest: dict[str, Any]) -> str:
    """The card's Markdown for ``config.json``'s ``doc`` and the run's ``manifest``."""
    lineage, recipe = doc["lineage"], doc["recipe"]
    title = f"{recipe['name']} — {lineage['mode']} run {lineage['run_id']}"
    what = ("a voting ensemble of {n} models ({vote} vote)".format(
        n=len(doc["model"]["members"]), vote=doc["model"]["vote"])
        if doc["model"]["kind"] == "ensemble" else "one model")
    lines = [f"# {title}", "",
             f"A {doc['task'].replace('_', ' ')} model trained with TensorTurn: {what}, recipe "
             f"`{recipe['name']}`" + (f" with options `{json.dumps(recipe['options'], sort_keys=True)}`"
                                      if recipe["options"] else "") + ".", "",
             "## Use", "", "```python", "import tensorturn.export", "",
             'model = tensorturn.export.load("path/to/this/folder")',
             f"out = model.predict(rows)  # rows: [N, {', '.join(map(str, doc['input']['shape']))}] raw inputs",
             "```", "",
             "`predict` returns what `tensorturn serve` answers for this run: "
             + ", ".join(f"`{o['name']}` {o['shape']}" for o in doc["outputs"]) + ". "
             "`model.module` is the torch module (it takes the recipe's preprocessed inputs).", ""]
    if doc["formats"]:
        lines += ["Also exported: " + ", ".join(f"{fmt} (`{where}`)" for fmt, where in sorted(doc["formats"].items()))
                  + ".", ""]
    metrics = doc.get("metrics") or {}
    lines += ["## Metrics", ""]
    if metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_number(v)} |" for k, v in sorted(metrics.items())]
    else:
        lines.append("The run recorded no metrics.")
    kept = kept_round(manifest)
    if kept is not None:
        rounds = manifest.get("rounds") or []
        last = rounds[-1].get("round")
        which = (f"Round {kept.get('round')}, the last," if kept.get("round") == last else
                 f"Round {kept.get('round')}, kept by `--keep best` (lowest validation loss; the run's "
                 f"last was round {last}),")
        lines += ["", f"{which} is the exported model: train loss {_number(kept.get('loss'))}, "
                      f"validation loss {_number(kept.get('val_loss'))}, validation accuracy "
                      f"{_number(kept.get('val_accuracy'))}."]
    lines += ["", "## Data", ""]
    data = lineage["data"]
    if "dataset" in data:
        lines.append(f"Pushed dataset `{data['dataset']}` version {data['version']} (rows {data.get('rows')}); "
                     f"its index is in `dataset/`.")
    elif "file" in data:
        lines.append(f"The text file `{data['file']}` (the recipe's `data` option).")
    else:
        lines.append("The recipe's built-in data.")
    if doc.get("classes"):
        lines += ["", "Classes: " + ", ".join(f"`{c}`" for c in doc["classes"]) + "."]
    lines += ["", "## Training", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in training(manifest)]
    parents = lineage.get("parents") or {}
    lines += ["", "## Lineage", "", f"- run `{lineage['run_id']}`, model sha256 `{doc['model_sha256']}`"]
    lines += [f"- {'started from' if k == 'init_from' else 'distilled from'} run `{v}`" for k, v in parents.items()]
    lines += ["", "## Files", "", "- `model.safetensors` — the weights (the run's own model file)",
              "- `config.json` — recipe, options, model config, task, inputs and outputs, lineage",
              "- `README.md` — this card"]
    if doc.get("dataset"):
        lines.append("- `dataset/` — the pushed dataset's index (no rows): what preprocessing reads")
    lines += [f"- `{where}` — {fmt}" for fmt, where in sorted(doc["formats"].items())]
    return "\n".join(lines) + "\n"
