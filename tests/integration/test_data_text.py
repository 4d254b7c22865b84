"""`data push` of a folder of text: every UTF-8 file (binary ones skipped and counted), `--include`,
splits by share of the characters — whole files held out where they can be, else by position —
and no split stored empty."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import tt, tt_json

import tensorturn
from tensorturn import data as datasets
from tensorturn.data.cache import ChunkCache
from tensorturn.data.source import Dataset
from tensorturn.store.objects import open_store

SPLITS = ("train", "val", "test")


def copy_sources(to: Path) -> int:
    """tensorturn's own files copied to ``to`` (no caches): its .py files and the dashboard's page,
    script and styles, all UTF-8 text; how many."""
    shutil.copytree(Path(tensorturn.__file__).parent, to, ignore=shutil.ignore_patterns("__pycache__"))
    return sum(1 for path in to.rglob("*") if path.is_file())


def split_texts(store: str, name: str, tmp_path: Path) -> dict[str, list[tuple[str, str]]]:
    """Each split's (path, text) rows as a recipe reads them."""
    data = Dataset(name, store=open_store(store), cache=ChunkCache(tmp_path / "cache", 1 << 30))
    return {s: [(p, t) for table in data.batches(s) for p, t in zip(table.column("path").to_pylist(),
                                                                   table.column("text").to_pylist())]
            for s in SPLITS}


def test_a_folder_of_source_files_pushes_every_text_file_with_rows_in_every_split(tmp_path):
    src = tmp_path / "src"
    n_texts = copy_sources(src)
    (src / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")   # one image: still text
    (src / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))      # not UTF-8
    (src / "blank.py").write_text("\n\n")                                    # no text
    (src / "NOTES").write_text("a text file with no suffix\n")
    (src / ".git").mkdir()
    (src / ".git" / "config").write_text("[core]\n")                         # hidden: never read
    store = (tmp_path / "store").as_uri()
    doc = tt_json("data", "push", str(src), "--name", "code", "--store", store, "--json")
    assert doc["kind"] == "text" and doc["split_by"] == "file"
    assert doc["files"] == {"text": n_texts + 1, "skipped": 2, "skipped_names": ["latin1.txt", "logo.png"],
                            "empty": 1}
    assert all(doc["rows"][s] > 0 for s in SPLITS) and sum(doc["rows"].values()) == n_texts + 1
    texts = split_texts(store, "code", tmp_path)
    chars = {s: sum(len(t) for _, t in texts[s]) for s in SPLITS}
    total = sum(chars.values())
    assert all(0.05 <= chars[s] / total <= 0.15 for s in ("val", "test"))  # half to 1.5x their share
    held_out = {p for s in ("val", "test") for p, _ in texts[s]}
    assert held_out and not held_out & {p for p, _ in texts["train"]}     # whole files held out
    again = tt("data", "push", str(src), "--name", "code", "--store", store)
    assert again.returncode == 0, again.stderr
    first, second = again.stdout.strip().splitlines()
    assert first.startswith("dataset code v2 (text): ") and " validation / " in first
    assert second == (f"  {n_texts + 1} text files; skipped 2 binary or not UTF-8 (latin1.txt, logo.png); "
                      f"skipped 1 empty; split by file (whole files held out, by share of the characters)")


def test_include_chooses_files_and_a_glob_that_matches_nothing_is_one_line(tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    for rel in ("a.py", "pkg/b.py", "pkg/sub/c.py", "pkg/d.md", "e.txt"):
        (src / rel).write_text(f"# {rel}\n" + "x = 1\n" * 200)
    st = open_store((tmp_path / "store").as_uri())
    index = datasets.push(st, str(src), "py", include=("*.py",))
    paths = {p for rows in split_texts(st.url, "py", tmp_path).values() for p, _ in rows}
    assert paths == {"a.py", "pkg/b.py", "pkg/sub/c.py"} and index["files"]["text"] == 3
    index = datasets.push(st, str(src), "pkg", include=("pkg/*.py", "*.txt"))  # a path, and a name
    paths = {p for rows in split_texts(st.url, "pkg", tmp_path).values() for p, _ in rows}
    assert paths == {"pkg/b.py", "pkg/sub/c.py", "e.txt"}
    store = str(tmp_path / "store2")
    for args, expected in (
            ([str(src), "--include", "*.rs"], f"error: {src}: no file matches --include '*.rs' (of 5 files there)"),
            ([str(src / "a.py"), "--include", "*.py"], f"error: --include chooses files in a folder; {src / 'a.py'} "
                                                       f"is a file")):
        proc = tt("data", "push", *args, "--name", "none", "--store", store)
        assert proc.returncode == 2 and proc.stderr.strip() == expected
        assert not (tmp_path / "store2" / "datasets").exists()


def test_a_few_files_are_split_by_position_at_line_starts(tmp_path):
    src = tmp_path / "few"
    src.mkdir()
    (src / "one.py").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(300)))
    (src / "two.py").write_text("".join(f"y{i} = {i} * 2\n" for i in range(100)))
    store = (tmp_path / "store").as_uri()
    proc = tt("data", "push", str(src), "--name", "few", "--store", store)
    assert proc.returncode == 0, proc.stderr
    assert "split by position: the files joined and cut at line ends" in proc.stdout
    texts = split_texts(store, "few", tmp_path)
    assert all(texts[s] for s in SPLITS)
    chars = {s: sum(len(t) for _, t in texts[s]) for s in SPLITS}
    total = sum(chars.values())
    assert total == sum(len(p.read_text()) for p in src.iterdir())             # every character, once
    assert all(abs(chars[s] / total - 0.1) < 0.03 for s in ("val", "test"))
    assert all(texts[s][-1][1].endswith("\n") for s in SPLITS)              # cut where a line starts


@pytest.mark.parametrize("make, args, expected", [
    (lambda d: (d / "a.py").write_text("x\n"), [],
     "2 characters of text are too few to give validation and test a share of their own "
     "(--val-fraction 0.1, --test-fraction 0.1): push more text, or set the fraction to 0 for no such split"),
    (lambda d: (d / "a.bin").write_bytes(b"\x00\x01"), [],
     "no UTF-8 text there (1 file: 1 binary or not UTF-8, 0 empty)"),
    (lambda d: (d / "t.csv").write_text("x,y\n1,0\n2,1\n3,0\n"), ["t.csv", "--label", "y"],
     "3 rows give the validation split none at --val-fraction 0.1: push at least 6 rows, raise "
     "--val-fraction, or set it to 0 for no validation split"),
], ids=["too-little-text", "only-binary", "too-small-a-table"])
def test_a_split_that_would_be_empty_is_one_line_and_nothing_is_stored(tmp_path, make, args, expected):
    src = tmp_path / "src"
    src.mkdir()
    make(src)
    source = str(src / args[0]) if args else str(src)
    proc = tt("data", "push", source, *args[1:], "--name", "tiny", "--store", str(tmp_path / "store"))
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {source}: {expected}"
    assert not (tmp_path / "store" / "datasets").exists()


def test_a_fraction_of_zero_asks_for_no_split(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x\n")
    st = open_store((tmp_path / "store").as_uri())
    index = datasets.push(st, str(tmp_path / "src"), "tiny", val_fraction=0, test_fraction=0)
    assert index["rows"] == {"train": 1, "val": 0, "test": 0}


def test_one_long_line_is_cut_by_characters(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "min.js").write_text("var a=1;" * 500)                # 4000 characters, no newline
    st = open_store((tmp_path / "store").as_uri())
    index = datasets.push(st, str(tmp_path / "src"), "min")
    assert index["split_by"] == "position" and index["rows"] == {"train": 1, "val": 1, "test": 1}
    texts = split_texts(st.url, "min", tmp_path)
    assert [len(texts[s][0][1]) for s in SPLITS] == [3200, 400, 400]


