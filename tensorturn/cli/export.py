"""``export``: a succeeded run's model as a self-describing folder (:mod:`tensorturn.export`)."""

from __future__ import annotations

import click

from tensorturn.cli import cli, emit_json, pool_options


@cli.command()
@click.argument("run_id")
@click.argument("dest", metavar="DIR", type=click.Path(file_okay=False, writable=True))
@click.option("--format", "formats", multiple=True, type=click.Choice(["onnx", "transformers"]),
              help="Also write the model in this format: onnx (model.onnx: raw rows in, the served "
                   "outputs out; any recipe that traces) or transformers (config.json, "
                   "model.safetensors, tokenizer.json...: DIR itself loads as a GPT-2 with its "
                   "tokenizer, for charlm, gpt2-small and textlm). Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the folder, its files, the run.")
@pool_options()
def export(broker, store, run_id, dest, formats, as_json):
    """Write run RUN_ID's model into the new folder DIR.

    \b
    DIR gets tensorturn.safetensors (the run's own model file: its sha256 is the run's
    model_sha256; an ensemble's members are in it, with the vote), tensorturn.json (recipe,
    options, model config, task, inputs and outputs, class names, lineage) and README.md (a
    model card the Hugging Face Hub reads: metrics, data, how it was trained). Load it anywhere,
    with no pool or store:

    \b
        import tensorturn
        model = tensorturn.load("DIR")
        model.predict(rows)      # what `tensorturn serve` answers for the run

    Only a run that succeeded is exported; DIR must be new or empty. Reads only the store.
    """
    from tensorturn.export.folder import export_run
    from tensorturn.store.objects import open_store

    result = export_run(open_store(store), run_id, dest, formats)
    if as_json:
        emit_json(result.to_json())
        return
    click.echo(f"exported run {result.run_id} ({result.mode}, {result.recipe}) to {result.path}")
    for name, size in result.files.items():
        click.echo(f"  {name}  {size:,} bytes")
