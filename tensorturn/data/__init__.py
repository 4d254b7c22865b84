"""The data plane: datasets pushed to the object store as Parquet chunks and a versioned index.

``tensorturn data push SOURCE --name NAME`` reads a local dataset, shuffles its rows once
(``--seed``), splits them into train/validation/test, and writes each split as Parquet chunks of
about ``--chunk-mb`` (zstd) under ``datasets/chunks/<sha256>.parquet`` — content-addressed, so a
chunk that did not change is stored once — plus an index ``datasets/<name>/v<NNNN>.json`` naming
every chunk with its sha256, rows and bytes. Why Parquet through TensorTurn's own store and
cache, rather than a streaming library: docs/data-plane.md (measured side by side).

Sources (:func:`read_source`): a CSV or Parquet table (``--label COLUMN``), a folder of images by
class (``root/<class>/*.png|jpg``), a folder of text files — every UTF-8 file in it, one document
per file, binary ones skipped and counted, ``--include GLOB`` to choose — and a Hugging Face
``datasets`` dataset saved with ``save_to_disk`` (read with pyarrow, no ``datasets`` needed).
A folder's links that lead out of it are skipped and counted, never followed (a folder someone
handed you may link to your ``~/.ssh``, and a push would copy it into the store); an image of
more than :data:`MAX_IMAGE_PIXELS` is refused from its header, before it is decoded.

No split whose fraction is above zero is stored empty: a table or images too small to give it a
row is refused; a text folder is split by file when whole files can give each split about its
share of the characters, and otherwise by position (:func:`_split_text`).

Machines read datasets through :mod:`.cache`: only the chunks asked for, verified against their
sha256, kept under a byte budget.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorturn import layout
from tensorturn.errors import NotFound, SpecError

if TYPE_CHECKING:
    import pyarrow as pa

    from tensorturn.store.objects import Store

FORMAT = "tensorturn-dataset-1"
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}
# An image decodes to 3 bytes a pixel and more while it is converted: 40 megapixels (7300x5400,
# more than most cameras take) is 120 MB decoded, a push of it peaking at 260 MB, where PIL's own
# limit (89 megapixels, a warning only) let a crafted PNG of 11 kB take 500 MB (774 MB in the
# attack pass). Larger images are refused, not skipped: a dataset silently missing some of its
# pictures would be worse than one clear line.
MAX_IMAGE_PIXELS = 40_000_000
SKIPPED_SHOWN = 5  # skipped files and links named in the index (all of them are counted)
SPLITS = ("train", "val", "test")
SPLIT_NAMES = {"train": "train", "val": "validation", "test": "test"}


def check_name(name: str) -> None:
    if not NAME.fullmatch(name) or name == "chunks":
        raise SpecError(f"invalid dataset name {name!r}: use lowercase letters, digits, '.', '_' "
                        f"and '-' (not 'chunks')")


# ---- sources -------------------------------------------------------------------------------------

def read_source(source: str, label: str | None = None, image_size: tuple[int, int] | None = None,
                include: tuple[str, ...] = ()) -> tuple[pa.Table, dict[str, Any]]:
    """The source as one Arrow table and what the index says of it (kind, label, classes);
    ``include`` (globs) chooses a folder's files."""
    path = Path(source).expanduser()
    if not path.exists():
        raise SpecError(f"no such file or folder: {source}")
    if include and path.is_file():
        raise SpecError(f"--include chooses files in a folder; {source} is a file")
    if path.is_file():
        if path.suffix.lower() == ".csv":
            import pyarrow.csv as pcsv

            table = pcsv.read_csv(path)
        elif path.suffix.lower() in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        else:
            raise SpecError(f"{source}: a file source must be .csv or .parquet")
        return _table(table, label, source)
    if any((path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        if include:
            raise SpecError(f"{source} is a saved Hugging Face dataset: --include chooses files of a "
                            f"folder of images or text")
        return _hf_saved(path, label)  # a Dataset or a DatasetDict (its splits merged, split again)
    files, outside = _folder_files(path, include)
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    # a picture or two in a folder of source files does not make it an image folder
    if images and 2 * len(images) >= len(files):
        table, about = _images(path, images, image_size)
    elif files:
        table, about = _texts(path, files)
    else:
        skipped = f" (skipped {links_out(len(outside))})" if outside else ""
        raise SpecError(f"{source}: no CSV/Parquet table, images (root/<class>/*.png|jpg), text files "
                        f"or saved Hugging Face dataset found there{skipped}")
    about["links"] = {"skipped": len(outside), "skipped_names": outside[:SKIPPED_SHOWN]}
    return table, about


def links_out(n: int) -> str:
    """How many links a push did not follow, as its output says it."""
    return f"{n} link{'s' if n != 1 else ''} that lead{'s' if n == 1 else ''} out of the folder"


def _folder_files(root: Path, include: tuple[str, ...]) -> tuple[list[Path], list[str]]:
    """The folder's files, and (relative names) its links that lead out of it, which are not
    followed: a link is read only where it resolves inside the folder (one to a folder is not
    walked — rglob does not follow it — and one that loops counts as leading out). Hidden files
    (and those in hidden folders, such as .git) are left out; with ``include``, only those
    matching a glob: one without '/' matches the file's name at any depth, one with '/' its
    path under the folder ('*' crosses folders)."""
    entries = sorted(p for p in root.rglob("*") if (p.is_symlink() or p.is_file())
                     and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if include:
        def chosen(p: Path) -> bool:
            rel = p.relative_to(root).as_posix()
            return any(fnmatch.fnmatchcase(rel if "/" in glob else p.name, glob) for glob in include)

        picked = [p for p in entries if chosen(p)]
        if not picked:
            globs = " ".join(f"--include {g!r}" for g in include)
            raise SpecError(f"{root}: no file matches {globs} (of {len(entries)} files there)")
        entries = picked
    inside = root.resolve()
    files, outside = [], []
    for p in entries:
        if p.is_symlink() and not _resolves_inside(p, inside):
            outside.append(p.relative_to(root).as_posix())
        elif p.is_file():
            files.append(p)
    return files, outside


def _resolves_inside(link: Path, folder: Path) -> bool:
    try:
        return link.resolve().is_relative_to(folder)
    except (OSError, RuntimeError):  # a loop (RuntimeError before Python 3.13)
        return False


def _table(table: pa.Table, label: str | None, source: str) -> tuple[pa.Table, dict[str, Any]]:
    if label is None:
        raise SpecError(f"{source} is a table: name its target with --label COLUMN "
                        f"(columns: {', '.join(table.column_names)})")
    if label not in table.column_names:
        raise SpecError(f"{source} has no column {label!r} (columns: {', '.join(table.column_names)})")
    return table, {"kind": "table", "label": label,
                   "features": [c for c in table.column_names if c != label]}


def _table_stats(train: pa.Table, about: dict[str, Any]) -> dict[str, Any]:
    """What a recipe needs to read a table without a pass over it: the numeric features' mean
    and std on the train split, and the number of classes when the label is an integer."""
    import numpy as np
    import pyarrow as pa

    numeric = [c for c in about["features"] if pa.types.is_integer(train.schema.field(c).type)
               or pa.types.is_floating(train.schema.field(c).type)]
    stats: dict[str, Any] = {"numeric": numeric, "mean": [], "std": []}
    for c in numeric:
        col = train.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
        stats["mean"].append(float(np.nanmean(col)) if len(col) else 0.0)
        stats["std"].append(float(np.nanstd(col)) or 1.0 if len(col) else 1.0)
    return {"stats": stats}


MAX_CLASSES = 100  # an integer label with more distinct values is a regression unless --task says


def _label(table: pa.Table, about: dict[str, Any], task: str | None) -> tuple[pa.Table, dict[str, Any]]:
    """The table with its label ready to train on, and the task: text or booleans become class
    numbers (their names kept), an integer label with few values is a classification."""
    import pyarrow as pa
    import pyarrow.compute as pc

    name = about["label"]
    column = table.column(name)
    if column.null_count:
        raise SpecError(f"the label column {name!r} has {column.null_count} empty values; fill or "
                        f"drop those rows before pushing")
    kind = column.type
    out: dict[str, Any] = {}
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_boolean(kind):
        names = sorted(set(column.to_pylist()), key=str)
        codes = pc.index_in(column, value_set=pa.array(names, kind)).cast(pa.int64())
        table = table.set_column(table.schema.get_field_index(name), name, codes)
        out["class_names"] = [str(n) for n in names]
        guessed = "classification"
    elif pa.types.is_integer(kind):
        values = pc.unique(column)
        guessed = "classification" if len(values) <= MAX_CLASSES and pc.min(column).as_py() >= 0 else "regression"
    elif pa.types.is_floating(kind):
        guessed = "regression"
    else:
        raise SpecError(f"the label column {name!r} is {kind}: use numbers, text or booleans")
    task = task or guessed
    if task == "classification":
        if not pa.types.is_integer(table.column(name).type):
            raise SpecError(f"--task classification needs an integer or text label; {name!r} is {kind}")
        if pc.min(table.column(name)).as_py() < 0:
            raise SpecError(f"the label column {name!r} has negative class numbers")
        out["classes"] = int(pc.max(table.column(name)).as_py()) + 1  # over every split
    out["task"] = task
    return table, out


def _hf_saved(path: Path, label: str | None) -> tuple[pa.Table, dict[str, Any]]:
    import pyarrow as pa

    arrows = sorted(path.rglob("*.arrow"))
    if not arrows:
        raise SpecError(f"{path}: a saved Hugging Face dataset with no .arrow files")
    tables = []
    for file in arrows:
        with pa.memory_map(str(file)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    table = pa.concat_tables(tables)
    if label is None and "text" in table.column_names:
        return table, {"kind": "text", "label": None, "features": ["text"]}
    return _table(table, label, str(path))


def _images(root: Path, files: list[Path], size: tuple[int, int] | None) -> tuple[pa.Table, dict[str, Any]]:
    import pyarrow as pa

    classes = sorted({p.relative_to(root).parts[0] for p in files if len(p.relative_to(root).parts) == 2})
    if not classes:
        raise SpecError(f"{root}: images must be in one folder per class (root/<class>/*.png|jpg)")
    index = {c: i for i, c in enumerate(classes)}
    images, labels, sizes = [], [], set()
    for p in files:
        parts = p.relative_to(root).parts
        if len(parts) != 2:
            continue
        with _open_image(p) as opened:
            rgb = opened.convert("RGB")
        if size:
            rgb = rgb.resize(size)
        sizes.add(rgb.size)
        out = io.BytesIO()
        rgb.save(out, format="PNG")
        images.append(out.getvalue())
        labels.append(index[parts[0]])
    if len(sizes) > 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:4])
        raise SpecError(f"{root}: images of different sizes ({shown}, ...): pass --resize WxH")
    width, height = sizes.pop()
    table = pa.table({"image": pa.array(images, pa.binary()), "label": pa.array(labels, pa.int64())})
    return table, {"kind": "images", "label": "label", "features": ["image"], "classes": classes,
                   "image_size": [width, height]}


def _open_image(path: Path):
    """The image, its header read and nothing decoded; refused when it has more pixels than
    :data:`MAX_IMAGE_PIXELS`."""
    from PIL import Image

    try:
        image = Image.open(path)
    except Image.DecompressionBombError:  # past twice PIL's limit, refused as PIL read the header
        raise _too_large(path, "its size") from None
    if image.width * image.height > MAX_IMAGE_PIXELS:
        image.close()
        raise _too_large(path, f"{image.width}x{image.height} pixels")
    return image


def _too_large(path: Path, size: str) -> SpecError:
    return SpecError(f"{path}: {size} is more than the {MAX_IMAGE_PIXELS // 10 ** 6} megapixels an image "
                     f"may have: shrink it (or leave it out) and push again")


def _read_text(path: Path) -> str | None:
    """The file's text (newlines as '\\n', no BOM), or None when it is binary or not UTF-8."""
    with open(path, "rb") as f:
        head = f.read(8192)
        if b"\0" in head:  # binary: not worth reading the rest of a large file
            return None
        data = head + f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _texts(root: Path, files: list[Path]) -> tuple[pa.Table, dict[str, Any]]:
    import pyarrow as pa

    docs, paths, skipped, empty = [], [], [], 0
    for p in files:
        text = _read_text(p)
        if text is None:
            skipped.append(p.relative_to(root).as_posix())
        elif not text.strip():
            empty += 1  # no text to learn from, and a held-out split of blanks would look non-empty
        else:
            docs.append(text)
            paths.append(p.relative_to(root).as_posix())
    counts = {"text": len(docs), "skipped": len(skipped), "skipped_names": skipped[:SKIPPED_SHOWN],
              "empty": empty}
    if not docs:
        raise SpecError(f"{root}: no UTF-8 text there ({len(files)} file{'s' if len(files) != 1 else ''}: "
                        f"{len(skipped)} binary or not UTF-8, {empty} empty)")
    table = pa.table({"text": pa.array(docs, pa.large_string()), "path": pa.array(paths, pa.string())})
    return table, {"kind": "text", "label": None, "features": ["text"], "files": counts}


def _split_text(table: pa.Table, seed: int, val_fraction: float, test_fraction: float, source: str
                ) -> tuple[pa.Table, dict[str, Any], str]:
    """A folder's documents split for a language model, where what counts is characters, not
    files: the table to store, each split's row numbers, and how it was split.

    By file when it can be: files, shuffled by ``seed``, go to test and then to validation while
    each is short of its fraction of the characters (a file that would take it past 1.5x its share
    is passed over), the rest to train; kept when each gets at least half its share. Otherwise
    (too few files, or too uneven) by position, as ``charlm`` splits its text: the shuffled files
    joined and cut so that validation and test get their fractions, at the start of a line or file
    within a quarter of the smaller share of the exact cut (else at the character); a file cut in
    two is a row in each split. Too little text for that: a SpecError."""
    import numpy as np
    import pyarrow as pa

    docs = table.column("text").to_pylist()
    paths = table.column("path").to_pylist()
    order = [int(i) for i in np.random.default_rng(seed).permutation(len(docs))]
    total = sum(len(d) for d in docs)
    share = {"test": test_fraction * total, "val": val_fraction * total}
    taken: dict[str, list[int]] = {"test": [], "val": [], "train": []}
    used = {"test": 0, "val": 0}
    for i in order:
        size = len(docs[i])
        into = next((s for s in ("test", "val") if used[s] < share[s] and used[s] + size <= 1.5 * share[s]),
                    "train")
        taken[into].append(i)
        if into != "train":
            used[into] += size
    if taken["train"] and all(used[s] >= share[s] / 2 for s in used):
        return table, {s: np.array(taken[s], dtype=np.int64) for s in SPLITS}, "file"

    text = "".join(docs[i] for i in order)
    starts = np.cumsum([0] + [len(docs[i]) for i in order])  # where each file begins in ``text``
    n_test, n_val = round(total * test_fraction), round(total * val_fraction)
    tolerance = min(n for n in (n_test, n_val, total) if n > 0) / 4
    def cut(at: int, lo: int, hi: int) -> int:  # the line or file start nearest ``at``, if near
        before = max(text.rfind("\n", 0, at) + 1, int(starts[np.searchsorted(starts, at, "right") - 1]))
        after_line = text.find("\n", at)
        after_file = int(starts[np.searchsorted(starts, at, "left")]) if at <= total else total
        after = min(after_line + 1 if after_line >= 0 else total, after_file)
        near = [p for p in (before, after) if lo < p < hi and abs(p - at) <= tolerance]
        return min(near, key=lambda p: abs(p - at)) if near else at

    c2 = cut(total - n_test, 0, total) if n_test else total  # a cut moved never empties a split
    c1 = cut(c2 - n_val, 0, c2) if n_val else c2
    bounds = {"train": (0, c1), "val": (c1, c2), "test": (c2, total)}
    thin = [s for s, frac in (("val", val_fraction), ("test", test_fraction))
            if frac > 0 and not text[bounds[s][0]:bounds[s][1]].strip()]
    if thin or not text[:c1].strip():
        which = " and ".join(SPLIT_NAMES[s] for s in thin) or "train"
        raise SpecError(f"{source}: {total} characters of text are too few to give {which} a share of "
                        f"their own (--val-fraction {val_fraction}, --test-fraction {test_fraction}): "
                        f"push more text, or set the fraction to 0 for no such split")
    rows: list[str] = []
    row_paths: list[str] = []
    cuts: dict[str, Any] = {}
    for split in SPLITS:
        lo, hi = bounds[split]
        first = len(rows)
        for k, i in enumerate(order):  # the part of each file inside [lo, hi)
            s, e = int(starts[k]), int(starts[k + 1])
            if e > lo and s < hi:
                rows.append(docs[i][max(lo, s) - s:min(hi, e) - s])
                row_paths.append(paths[i])
        cuts[split] = np.arange(first, len(rows), dtype=np.int64)
    out = pa.table({"text": pa.array(rows, pa.large_string()), "path": pa.array(row_paths, pa.string())})
    return out, cuts, "position"


def _empty_split(source: str, n: int, split: str, fraction: float) -> SpecError:
    option = f"--{'val' if split == 'val' else 'test'}-fraction"
    need = next((m for m in range(n + 1, 10 * n + 10_000) if round(m * fraction) >= 1), None)
    more = f"push at least {need} rows, " if need else ""
    return SpecError(f"{source}: {n} rows give the {SPLIT_NAMES[split]} split none at {option} {fraction}: "
                     f"{more}raise {option}, or set it to 0 for no {SPLIT_NAMES[split]} split")


# ---- push ----------------------------------------------------------------------------------------

def _parquet_bytes(table: pa.Table) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = pa.BufferOutputStream()
    # no dictionary encoding: it bloats float columns (docs/data-plane.md); zstd compresses
    pq.write_table(table, out, compression="zstd", use_dictionary=False)
    return out.getvalue().to_pybytes()


def _chunks(table: pa.Table, chunk_bytes: int) -> list[pa.Table]:
    """``table`` cut into slices of about ``chunk_bytes`` of Arrow data (at least one row)."""
    if table.num_rows == 0:
        return []
    per_row = max(1, table.nbytes // table.num_rows)
    rows = max(1, chunk_bytes // per_row)
    return [table.slice(i, rows) for i in range(0, table.num_rows, rows)]


def push(store: Store, source: str, name: str, label: str | None = None, task: str | None = None,
         seed: int = 0,
         val_fraction: float = 0.1, test_fraction: float = 0.1, chunk_mb: float = 16.0,
         image_size: tuple[int, int] | None = None, include: tuple[str, ...] = (),
         on_chunk: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Push ``source`` as the next version of dataset ``name``; returns its index. Nothing is
    stored when a split whose fraction is above zero would be empty (a SpecError says why)."""
    import numpy as np

    check_name(name)
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise SpecError("--val-fraction and --test-fraction must be in [0, 1) and leave rows to train on")
    try:
        table, about = read_source(source, label, image_size, tuple(include))
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed file, in one line
        text = " ".join(str(exc).split())[:300]
        raise SpecError(f"{source}: cannot read it: {type(exc).__name__}: {text}") from None
    n = table.num_rows
    if n == 0:
        raise SpecError(f"{source}: the dataset is empty")
    if about["kind"] == "text" and "files" in about:  # a folder: split by characters, not files
        table, cuts, about["split_by"] = _split_text(table, seed, val_fraction, test_fraction, source)
    else:
        order = np.random.default_rng(seed).permutation(n)  # rows shuffled once: chunks are iid
        n_test, n_val = int(round(n * test_fraction)), int(round(n * val_fraction))
        cuts = {"test": order[:n_test], "val": order[n_test:n_test + n_val], "train": order[n_test + n_val:]}
        if len(cuts["train"]) == 0:
            raise SpecError(f"{source}: {n} rows leave none to train on")
        about["split_by"] = "row"
    if about["kind"] == "table":
        table, labelled = _label(table, about, task)
        about.update(labelled, **_table_stats(table.take(cuts["train"]), about))
    for split, fraction in (("val", val_fraction), ("test", test_fraction)):
        if fraction > 0 and len(cuts[split]) == 0:  # (a text folder's split never gets here empty)
            raise _empty_split(source, n, split, fraction)
    pieces = {split: _chunks(table.take(rows), int(chunk_mb * 1024 * 1024)) for split, rows in cuts.items()}
    total = sum(len(p) for p in pieces.values())
    done = 0
    splits: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        entries = []
        for piece in pieces[split]:
            data = _parquet_bytes(piece)
            sha = hashlib.sha256(data).hexdigest()
            key = layout.key("chunk", sha)
            if not store.exists(key):  # content-addressed: an unchanged chunk is stored once
                store.put_bytes(key, data)
            entries.append({"sha256": sha, "rows": piece.num_rows, "bytes": len(data)})
            done += 1
            if on_chunk:
                on_chunk(done, total)
        splits[split] = entries
    version = 1 + max((v["version"] for v in versions(store, name)), default=0)
    index = {"format": FORMAT, "name": name, "version": version, "created_at": time.time(),
             "source": Path(source).name, "seed": seed, **about,
             "schema": {f.name: str(f.type) for f in table.schema},
             "rows": {s: sum(c["rows"] for c in splits[s]) for s in SPLITS},
             "bytes": sum(c["bytes"] for s in SPLITS for c in splits[s]), "splits": splits}
    store.put_json(layout.key("dataset", name, version), index)
    return index


# ---- list, show, rm ------------------------------------------------------------------------------

def versions(store: Store, name: str) -> list[dict[str, Any]]:
    found = [layout.parse("dataset", k) for k in store.list(layout.prefix("dataset", name))]
    return sorted((f for f in found if f), key=lambda f: f["version"])


def names(store: Store) -> list[str]:
    out = set()
    for k in store.list(layout.DATASETS):
        parts = layout.parse("dataset", k)
        if parts:
            out.add(parts["name"])
    return sorted(out)


def show(store: Store, name: str, version: int | None = None) -> dict[str, Any]:
    """The index of ``name`` (its latest version unless ``version``); NotFound names what exists."""
    from tensorturn.store.objects import ObjectMissing

    check_name(name)
    known = versions(store, name)
    if not known:
        have = ", ".join(names(store)) or "none"
        raise NotFound(f"no dataset {name!r} in the store (datasets: {have}; see `tensorturn data push`)")
    version = version or known[-1]["version"]
    try:
        return store.get_json(layout.key("dataset", name, version))
    except ObjectMissing:
        raise NotFound(f"dataset {name!r} has no version {version} "
                       f"(versions: {', '.join(str(v['version']) for v in known)})") from None


def summary(index: dict[str, Any]) -> dict[str, Any]:
    return {k: index.get(k) for k in ("name", "version", "kind", "label", "rows", "bytes", "created_at",
                                     "source", "split_by", "files", "links")} | {
        "chunks": sum(len(c) for c in index["splits"].values())}


def remove(store: Store, name: str, version: int | None = None) -> list[int]:
    """Remove a version (or every version) of ``name``, and the chunks no other version uses."""
    show(store, name, version)  # NotFound unless it exists
    targets = ([show(store, name, version)] if version else
               [show(store, name, v["version"]) for v in versions(store, name)])
    dropping = {c["sha256"] for t in targets for s in t["splits"].values() for c in s}
    for t in targets:
        store.delete(layout.key("dataset", name, t["version"]))
    still = set()
    for other in names(store):
        for v in versions(store, other):
            idx = store.get_json(layout.key("dataset", other, v["version"]))
            still |= {c["sha256"] for s in idx["splits"].values() for c in s}
    for sha in dropping - still:
        store.delete(layout.key("chunk", sha))
    return [t["version"] for t in targets]
