"""Reading a local dataset into one Arrow table, and what its index says of it.

Sources (:func:`read_source`): a CSV or Parquet table (``--label COLUMN``), a folder of images by
class (``root/<class>/*.png|jpg``), a folder of text files — every UTF-8 file in it, one document
per file, binary ones skipped and counted, ``--include GLOB`` to choose — and a Hugging Face
``datasets`` dataset saved with ``save_to_disk`` (read with pyarrow, no ``datasets`` needed).
A folder's links that lead out of it are skipped and counted, never followed (a folder someone
handed you may link to your ``~/.ssh``, and a push would copy it into the store); an image of
more than :data:`MAX_IMAGE_PIXELS` is refused from its header, before it is decoded.
"""

from __future__ import annotations

import fnmatch
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorturn.errors import SpecError

if TYPE_CHECKING:
    import pyarrow as pa

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg"}
# An image decodes to 3 bytes a pixel and more while it is converted: 40 megapixels (7300x5400,
# more than most cameras take) is 120 MB decoded, a push of it peaking at 260 MB, where PIL's own
# limit (89 megapixels, a warning only) let a crafted PNG of 11 kB take 500 MB (774 MB in the
# attack pass). Larger images are refused, not skipped: a dataset silently missing some of its
# pictures would be worse than one clear line.
MAX_IMAGE_PIXELS = 40_000_000
SKIPPED_SHOWN = 5  # skipped files and links named in the index (all of them are counted)


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
