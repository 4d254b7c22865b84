"""``data``: datasets in the object store — push, list, show, rm."""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from typing import Any

import click

from tensorturn.cli import cli, emit_json, pool_options
from tensorturn.errors import SpecError, TensorTurnError


@cli.group()
def data():
    """Datasets in the store: Parquet chunks (content-addressed) and a versioned index.

    \b
      tensorturn data push table.csv --name housing --label price
      tensorturn data push photos/ --name pets            (photos/<class>/*.png|jpg)
      tensorturn data push books/ --name books            (a folder of UTF-8 text files)
      tensorturn data push src/ --name code --include '*.py'
      tensorturn data list / show NAME / rm NAME
    """


def _size(text: str | None) -> tuple[int, int] | None:
    """``--resize WxH``: at least 1x1, and no more pixels than a pushed image may have."""
    from tensorturn.data import MAX_IMAGE_PIXELS

    if not text:
        return None
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        w = h = 0
    if w < 1 or h < 1 or w * h > MAX_IMAGE_PIXELS:
        raise SpecError(f"--resize must be WIDTHxHEIGHT of at least 1x1 and at most "
                        f"{MAX_IMAGE_PIXELS // 10 ** 6} megapixels, e.g. 32x32 (got {text!r})")
    return w, h


@data.command("push")
@click.argument("source", metavar="SOURCE")
@click.option("--name", required=True, help="Dataset name (lowercase letters, digits, . _ -).")
@click.option("--label", default=None, metavar="COLUMN", help="The target column of a table.")
@click.option("--task", type=click.Choice(["classification", "regression"]), default=None,
              help="What the label is [default: text, booleans or an integer with at most 100 "
                   "values: classification; other numbers: regression].")
@click.option("--resize", default=None, metavar="WxH", help="Resize every image to this size.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the one shuffle of rows.")
@click.option("--val-fraction", type=float, default=0.1, show_default=True,
              help="The validation split's share of the rows (of the characters, for text).")
@click.option("--test-fraction", type=float, default=0.1, show_default=True,
              help="The test split's share of the rows (of the characters, for text).")
@click.option("--include", "include", multiple=True, metavar="GLOB",
              help="Only a folder's files that match (repeatable): '*.py' matches names at any depth, "
                   "'src/*.py' paths under the folder [default: every file].")
@click.option("--chunk-mb", type=click.FloatRange(min=0, min_open=True), default=16.0, show_default=True,
              help="About this much data per chunk (before compression).")
@click.option("--json", "as_json", is_flag=True, help="Print the new version's index summary as JSON.")
@pool_options()
def data_push(broker, store, source, name, label, task, resize, seed, val_fraction, test_fraction, include,
              chunk_mb, as_json):
    """Push SOURCE (a .csv/.parquet table, a folder of images by class, a folder of text files,
    or a Hugging Face dataset saved to disk) as the next version of dataset NAME.

    A folder of text is every UTF-8 file in it (binary and non-UTF-8 files are skipped and counted,
    hidden ones never read). It is split by file when whole files can give validation and test
    about their share of the characters, otherwise by position: the files joined and cut at line
    ends. A split whose fraction is above zero is never stored empty: too little data is refused.

    A folder's links that lead out of it are never followed (they are skipped and counted), and
    an image of more than 40 megapixels is refused from its header, before it is decoded."""
    from tensorturn import data as datasets
    from tensorturn.store.objects import open_store

    t0 = time.monotonic()
    with ExitStack() as stack:
        bar: Any = None

        def progress(done: int, total: int) -> None:  # a bar on a terminal, once chunks are written
            nonlocal bar
            if bar is None and sys.stderr.isatty():
                bar = stack.enter_context(click.progressbar(length=total, label=f"pushing {name}",
                                                            file=sys.stderr))
            if bar is not None:
                bar.update(done - bar.pos)

        index = datasets.push(open_store(store), source, name, label=label, task=task, seed=seed,
                              val_fraction=val_fraction, test_fraction=test_fraction, chunk_mb=chunk_mb,
                              image_size=_size(resize), include=include, on_chunk=progress)
    doc = datasets.summary(index)
    if as_json:
        emit_json(doc)
        return
    rows = index["rows"]
    click.echo(f"dataset {name} v{index['version']} ({index['kind']}): {rows['train']} train / "
               f"{rows['val']} validation / {rows['test']} test rows in {doc['chunks']} "
               f"chunk{'s' * (doc['chunks'] != 1)}, {_amount(index['bytes'])}, in "
               f"{time.monotonic() - t0:.1f}s")
    if index.get("files"):
        click.echo(f"  {_files_line(index)}")
    if index.get("links", {}).get("skipped"):
        click.echo(f"  {_links_line(index)}")


def _files_line(index: dict[str, Any]) -> str:
    """What a text folder's push read, skipped, and how it split it."""
    files = index["files"]
    line = f"{files['text']} text file{'s' if files['text'] != 1 else ''}"
    if files["skipped"]:
        names = ", ".join(files["skipped_names"]) + (", ..." if files["skipped"] > len(files["skipped_names"])
                                                      else "")
        line += f"; skipped {files['skipped']} binary or not UTF-8 ({names})"
    if files["empty"]:
        line += f"; skipped {files['empty']} empty"
    if index.get("split_by") == "position":
        line += ("; too few or too uneven to hold whole files out, so split by position: the files "
                 "joined and cut at line ends, validation and test taking their share of the characters")
    elif index.get("split_by") == "file":
        line += "; split by file (whole files held out, by share of the characters)"
    return line


def _links_line(index: dict[str, Any]) -> str:
    """The links a folder's push skipped because they lead out of it."""
    from tensorturn.data import links_out

    links = index["links"]
    names = ", ".join(links["skipped_names"]) + (", ..." if links["skipped"] > len(links["skipped_names"]) else "")
    return f"skipped {links_out(links['skipped'])} ({names})"


@data.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@pool_options()
def data_list(broker, store, as_json):
    """The datasets in the store, with their latest version."""
    from tensorturn import data as datasets
    from tensorturn.store.objects import open_store

    st = open_store(store)
    items = [datasets.summary(datasets.show(st, n)) for n in datasets.names(st)]
    if as_json:
        emit_json(items)
        return
    if not items:
        click.echo("no datasets (push one with `tensorturn data push`)")
    for d in items:
        rows = d["rows"]
        click.echo(f"{d['name']:24s} v{d['version']:<4d} {d['kind']:7s} "
                   f"{rows['train'] + rows['val'] + rows['test']:>10,d} rows {d['chunks']:>5d} chunks "
                   f"{d['bytes'] / 1e6:>9.1f} MB")


@data.command("show")
@click.argument("name")
@click.option("--version", type=int, default=None, help="A version [default: the latest].")
@pool_options()
def data_show(broker, store, name, version):
    """A dataset version's index as JSON: splits, chunks (sha256, rows, bytes), schema."""
    from tensorturn import data as datasets
    from tensorturn.store.objects import open_store

    emit_json(datasets.show(open_store(store), name, version))


@data.command("rm")
@click.argument("name")
@click.option("--version", type=int, default=None, help="Only this version [default: every version].")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed without a terminal).")
@pool_options()
def data_rm(broker, store, name, version, yes):
    """Remove a dataset (or one version) and the chunks no other dataset uses. A run trained on
    it can then no longer be exported or served (they read the version's index). Asks first,
    unless --yes."""
    from tensorturn import data as datasets
    from tensorturn.cli.output import can_ask
    from tensorturn.store.objects import open_store

    st = open_store(store)
    datasets.show(st, name, version)  # NotFound unless it exists
    if not yes:
        if not can_ask():
            raise TensorTurnError(f"not removing dataset {name} without confirmation: no terminal to "
                                  f"ask on; pass --yes")
        what = f"version {version}" if version else \
            f"version(s) {', '.join(str(v['version']) for v in datasets.versions(st, name))}"
        if not click.confirm(f"remove dataset {name} {what}? Runs trained on it can then no longer be "
                             f"exported or served", default=False, err=True):
            click.echo(f"dataset {name} not removed", err=True)
            sys.exit(1)
    gone = datasets.remove(st, name, version)
    click.echo(f"removed dataset {name} version(s) {', '.join(map(str, gone))}")


def _amount(n: int) -> str:
    """Bytes as a person reads them: 0.1 MB and up in MB, less in kB."""
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
