"""The exported folder's ``README.md``: a model card (Mitchell et al., "Model Cards for Model
Reporting", 2019; the layout Hugging Face model cards use) written from the run's record — what
the model is, how it scored, what it learnt from, and how it was trained.

It opens with the YAML front matter the Hugging Face Hub reads (``huggingface_hub.ModelCard``):
``library_name`` (``transformers`` where the folder is one, else ``tensorturn``), ``pipeline_tag``
from the task, ``tags``, ``license`` (``unknown``: a run does not say under which terms its data
and weights may be used — the owner sets it), ``metrics`` and a ``model-index`` with the test
figures. The front matter is written as JSON values, which YAML reads as they are."""

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


NOUNS = {"classification": "classification model", "regression": "regression model",
         "language_model": "language model"}
# the Hub's task for each kind (a model over images — rows of [channels, height, width] — is
# an image classifier; other rows are a table's)
PIPELINE_TAGS = {"language_model": "text-generation", "regression": "tabular-regression",
                 "classification": "tabular-classification"}
FORMAT_FILES = {
    "onnx": "the served computation as one ONNX graph: raw rows in (`input`), the outputs `predict` "
            "returns out; its `metadata_props` name the task, class names and recipe",
    "transformers": "the same model as transformers' GPT-2 and its tokenizer: `AutoModelForCausalLM`, "
                    "`AutoTokenizer` and `pipeline(\"text-generation\")` load this folder"}


def pipeline_tag(doc: dict[str, Any]) -> str:
    if doc["task"] == "classification" and len(doc["input"]["shape"]) == 3:
        return "image-classification"
    return PIPELINE_TAGS.get(doc["task"], "other")


def front_matter(doc: dict[str, Any], title: str) -> list[str]:
    """The YAML front matter's lines (module docstring)."""
    recipe, lineage = doc["recipe"], doc["lineage"]
    tags = ["tensorturn", recipe["name"], lineage["mode"], "safetensors", *sorted(doc["formats"])]
    tested = {k.removeprefix("test_"): v for k, v in sorted((doc.get("metrics") or {}).items())
              if k.startswith("test_") and k != "test_rows"  # a count of rows, not a figure of the model
              and isinstance(v, (int, float)) and not isinstance(v, bool)}
    data = lineage["data"]
    dataset = str(data.get("dataset") or data.get("file") or f"{recipe['name']} built-in data")
    index = [{"name": title, "results": [{
        "task": {"type": pipeline_tag(doc)},
        "dataset": {"name": dataset, "type": dataset, "split": "test"},
        "metrics": [{"type": k, "value": v, "name": f"test {k}"} for k, v in tested.items()]}]}]
    fields: dict[str, Any] = {"library_name": "transformers" if "transformers" in doc["formats"] else "tensorturn",
                              "pipeline_tag": pipeline_tag(doc), "tags": list(dict.fromkeys(tags)),
                              "license": "unknown", "metrics": list(tested)}
    if tested:
        fields["model-index"] = index
    return ["---", *(f"{k}: {json.dumps(v, ensure_ascii=False)}" for k, v in fields.items()), "---", ""]


def use(doc: dict[str, Any]) -> list[str]:
    """The card's "Use" section: TensorTurn's loader, and transformers' where the folder is one."""
    shape = ", ".join(map(str, doc["input"]["shape"]))
    rows = "token ids" if doc["task"] == "language_model" else "raw inputs"
    lines = ["## Use", "", "```python", "import tensorturn", "",
             'model = tensorturn.load("path/to/this/folder")',
             f"out = model.predict(rows)  # rows: [N, {shape}] {rows}", "```", "",
             "`predict` returns what `tensorturn serve` answers for this run: "
             + ", ".join(f"`{o['name']}` {o['shape']}" for o in doc["outputs"]) + ". "
             "`model.module` is the torch module (it takes the recipe's preprocessed inputs).", ""]
    if "transformers" in doc["formats"]:
        context = doc["input"]["shape"][0]
        lines += ["With transformers (the prompt and what it generates fit the model's context of "
                  f"{context} tokens):", "", "```python", "from transformers import pipeline", "",
                  'generate = pipeline("text-generation", model="path/to/this/folder")',
                  'generate("def main():", max_new_tokens=8)  # greedy: each token `predict`\'s label',
                  "```", ""]
    return lines


def model_card(doc: dict[str, Any], manifest: dict[str, Any]) -> str:
    """The card's Markdown for ``tensorturn.json``'s ``doc`` and the run's ``manifest``."""
    lineage, recipe = doc["lineage"], doc["recipe"]
    title = f"{recipe['name']} — {lineage['mode']} run {lineage['run_id']}"
    what = ("a voting ensemble of {n} models ({vote} vote)".format(
        n=len(doc["model"]["members"]), vote=doc["model"]["vote"])
        if doc["model"]["kind"] == "ensemble" else "one model")
    noun = NOUNS.get(doc["task"], f"{doc['task'].replace('_', ' ')} model")
    lines = [*front_matter(doc, title), f"# {title}", "",
             f"A {noun} trained with TensorTurn: {what}, recipe "
             f"`{recipe['name']}`" + (f" with options `{json.dumps(recipe['options'], sort_keys=True)}`"
                                      if recipe["options"] else "") + ".", "", *use(doc)]
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
    lines += ["", "## Files", "", "- `tensorturn.safetensors` — the weights (the run's own model file)",
              "- `tensorturn.json` — recipe, options, model config, task, inputs and outputs, lineage",
              "- `README.md` — this card"]
    if doc.get("dataset"):
        lines.append("- `dataset/` — the pushed dataset's index (no rows): what preprocessing reads")
    lines += [f"- {', '.join(f'`{name}`' for name in files)} — {FORMAT_FILES.get(fmt, fmt)}"
              for fmt, files in sorted(doc["formats"].items())]
    return "\n".join(lines) + "\n"
