"""A read table made ready to store: its label as class numbers or values, the train split's
feature statistics, and its rows dealt into train, validation and test.

No split whose fraction is above zero is stored empty: a table or images too small to give it a
row is refused (:func:`empty_split`); a text folder is split by file when whole files can give
each split about its share of the characters, and otherwise by position (:func:`split_text`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorturn.errors import SpecError

if TYPE_CHECKING:
    import pyarrow as pa

SPLITS = ("train", "val", "test")
SPLIT_NAMES = {"train": "train", "val": "validation", "test": "test"}


def table_stats(train: pa.Table, about: dict[str, Any]) -> dict[str, Any]:
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


def label_table(table: pa.Table, about: dict[str, Any], task: str | None) -> tuple[pa.Table, dict[str, Any]]:
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
    if task == "regression" and "class_names" in out:
        raise SpecError(f"--task regression needs a numeric label; {name!r} is {kind} (its values "
                        f"would be class numbers): encode it as numbers, or drop --task")
    if task == "classification":
        if not pa.types.is_integer(table.column(name).type):
            raise SpecError(f"--task classification needs an integer or text label; {name!r} is {kind}")
        if pc.min(table.column(name)).as_py() < 0:
            raise SpecError(f"the label column {name!r} has negative class numbers")
        out["classes"] = int(pc.max(table.column(name)).as_py()) + 1  # over every split
    out["task"] = task
    return table, out


def split_text(table: pa.Table, seed: int, val_fraction: float, test_fraction: float, source: str
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


def empty_split(source: str, n: int, split: str, fraction: float) -> SpecError:
    """Why ``n`` rows give ``split`` none at ``fraction``, and how many rows would."""
    option = f"--{'val' if split == 'val' else 'test'}-fraction"
    need = next((m for m in range(n + 1, 10 * n + 10_000) if round(m * fraction) >= 1), None)
    more = f"push at least {need} rows, " if need else ""
    return SpecError(f"{source}: {n} rows give the {SPLIT_NAMES[split]} split none at {option} {fraction}: "
                     f"{more}raise {option}, or set it to 0 for no {SPLIT_NAMES[split]} split")
