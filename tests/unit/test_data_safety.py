"""What `data push` reads and what a machine's chunk cache shows: a folder's links that lead out
of it are skipped and counted (a folder someone handed you may link to your secrets), an image
too large to decode safely is refused before it is decoded, and cached chunks are private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from conftest import tt_here

from tensorturn import data as datasets
from tensorturn.data.cache import ChunkCache
from tensorturn.data.source import Dataset
from tensorturn.store.objects import open_store

SECRET = "root:x:0:0:TOP-SECRET-LINE:/root:/bin/bash\n"


def rows(store: str, name: str, tmp_path: Path) -> list[dict]:
    data = Dataset(name, store=open_store(Path(store).as_uri()), cache=ChunkCache(tmp_path / "cache", 1 << 30))
    return [row for split in ("train", "val", "test") for table in data.batches(split) for row in table.to_pylist()]


def test_a_text_folder_push_skips_links_that_lead_out_of_it_and_says_how_many(tmp_path):
    outside = tmp_path / "outside"
    (outside / "keys").mkdir(parents=True)
    (outside / "passwd").write_text(SECRET)
    (outside / "keys" / "id.txt").write_text(SECRET)
    src = tmp_path / "books"
    (src / "sub").mkdir(parents=True)
    for i in range(6):
        (src / f"{i}.txt").write_text(f"chapter {i}\n" * 50)
    (src / "sub" / "7.txt").write_text("chapter 7\n" * 50)
    (src / "passwd").symlink_to(outside / "passwd")             # a file outside
    (src / "keys").symlink_to(outside / "keys")                 # a folder outside
    (src / "sub" / "up.txt").symlink_to("../../outside/passwd")  # relative, climbing out
    (src / "loop").symlink_to(src / "loop")                     # leads nowhere
    (src / "again.txt").symlink_to(src / "sub" / "7.txt")       # inside: read
    (src / "sub" / "books").symlink_to(src)                     # inside: its files are read once
    store = str(tmp_path / "store")
    shown = tt_here("data", "push", str(src), "--name", "books", "--store", store)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[-1] == ("  skipped 4 links that lead out of the folder "
                                             "(keys, loop, passwd, sub/up.txt)")
    index = datasets.show(open_store(Path(store).as_uri()), "books")
    assert index["links"] == {"skipped": 4, "skipped_names": ["keys", "loop", "passwd", "sub/up.txt"]}
    assert index["files"]["text"] == 8  # 0-5.txt, sub/7.txt and again.txt
    stored = rows(store, "books", tmp_path)
    assert sorted({r["path"] for r in stored}) == ["0.txt", "1.txt", "2.txt", "3.txt", "4.txt", "5.txt",
                                                   "again.txt", "sub/7.txt"]
    assert not [r for r in stored if "TOP-SECRET" in r["text"]]
    doc = tt_here("data", "push", str(src), "--name", "books", "--store", store, "--json")
    assert '"skipped": 4' in doc.stdout and "TOP-SECRET" not in doc.stdout


def test_a_folder_of_only_outside_links_is_refused_saying_so(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "passwd").write_text(SECRET)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "passwd").symlink_to(tmp_path / "outside" / "passwd")
    shown = tt_here("data", "push", str(tmp_path / "src"), "--name", "x", "--store", str(tmp_path / "store"))
    assert shown.returncode == 2
    assert shown.stderr.strip().endswith("(skipped 1 link that leads out of the folder)"), shown.stderr
    assert not (tmp_path / "store" / "datasets").exists()


def images(root: Path, per_class: int = 5, size: tuple[int, int] = (8, 8)) -> None:
    from PIL import Image

    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", size, (40 * i, 0, 0)).save(root / name / f"{i}.png")


def test_an_image_folder_skips_links_that_lead_out_of_it(tmp_path):
    from PIL import Image

    images(tmp_path / "pics")
    (tmp_path / "private").mkdir()
    Image.new("RGB", (8, 8), (255, 255, 255)).save(tmp_path / "private" / "me.png")
    (tmp_path / "pics" / "cat" / "me.png").symlink_to(tmp_path / "private" / "me.png")
    store = str(tmp_path / "store")
    shown = tt_here("data", "push", str(tmp_path / "pics"), "--name", "pets", "--store", store)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[-1] == "  skipped 1 link that leads out of the folder (cat/me.png)"
    index = datasets.show(open_store(Path(store).as_uri()), "pets")
    assert sum(index["rows"].values()) == 10 and index["links"]["skipped"] == 1


def bomb(path: Path, side: int) -> None:
    """A PNG of ``side`` x ``side`` black pixels: a few kB on disk, side² bytes and more decoded."""
    from PIL import Image

    Image.new("1", (side, side)).save(path)


def test_an_image_over_the_pixel_limit_is_refused_before_it_is_decoded(tmp_path, monkeypatch):
    from PIL import Image, ImageFile

    assert datasets.MAX_IMAGE_PIXELS < Image.MAX_IMAGE_PIXELS  # below PIL's own warning
    images(tmp_path / "pics")
    side = int(datasets.MAX_IMAGE_PIXELS ** 0.5) + 1
    bomb(tmp_path / "pics" / "dog" / "big.png", side)
    decoded, load = [], ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: (decoded.append(self.size), load(self))[1])
    store = tmp_path / "store"
    shown = tt_here("data", "push", str(tmp_path / "pics"), "--name", "pets", "--store", str(store))
    assert shown.returncode == 2
    assert shown.stderr == (f"error: {tmp_path / 'pics' / 'dog' / 'big.png'}: {side}x{side} pixels is more "
                            f"than the {datasets.MAX_IMAGE_PIXELS // 10 ** 6} megapixels an image may have: "
                            f"shrink it (or leave it out) and push again\n")
    assert (side, side) not in decoded  # refused from its header
    assert not (store / "datasets").exists()  # nothing stored


@pytest.mark.parametrize("resize", ["10000x10000", "0x8", "8x-1"])
def test_a_resize_outside_the_pixel_limit_is_refused(tmp_path, resize):
    images(tmp_path / "pics")
    shown = tt_here("data", "push", str(tmp_path / "pics"), "--name", "pets", "--resize", resize,
                    "--store", str(tmp_path / "store"))
    assert shown.returncode == 2 and len(shown.stderr.splitlines()) == 1
    assert shown.stderr.startswith("error: --resize must be WIDTHxHEIGHT of at least 1x1 and at most "), shown.stderr


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_chunk_cache_is_readable_by_its_owner_only_even_one_made_before(tmp_path):
    store = open_store((tmp_path / "store").as_uri())
    (tmp_path / "books").mkdir()
    for i in range(4):
        (tmp_path / "books" / f"{i}.txt").write_text(f"chapter {i}\n" * 50)
    index = datasets.push(store, str(tmp_path / "books"), "books", val_fraction=0, test_fraction=0)
    chunk = index["splits"]["train"][0]
    old = os.umask(0o022)  # a usual umask: what a cache gets unless it sets its own modes
    try:
        cache = ChunkCache(tmp_path / "cache" / "chunks", 1 << 30)
        path = cache.path(store, chunk)
        assert (mode(tmp_path / "cache" / "chunks"), mode(path), mode(path.parent / ".lock")) == (0o700, 0o600, 0o600)
        # a cache left by an older version: opened again, it is made private
        for p in (path, path.parent / ".lock"):
            p.chmod(0o644)
        path.parent.chmod(0o755)
        ChunkCache(tmp_path / "cache" / "chunks", 1 << 30)
        assert (mode(path.parent), mode(path), mode(path.parent / ".lock")) == (0o700, 0o600, 0o600)
    finally:
        os.umask(old)


def test_a_stored_image_unlike_the_datasets_is_refused_before_it_is_decoded():
    """A store writer's bomb in a chunk: the agent reads its header, never its pixels."""
    import io

    import pyarrow as pa
    from PIL import Image

    from tensorturn.errors import RecipeError
    from tensorturn.recipes.imagefolder import ImageFolder

    def png(w: int, h: int) -> bytes:
        out = io.BytesIO()
        Image.new("L", (w, h)).save(out, "PNG")
        return out.getvalue()

    recipe = object.__new__(ImageFolder)
    recipe.dataset, recipe.width, recipe.height = "pets", 8, 8
    x, y = recipe.tensors(pa.table({"image": [png(8, 8)], "label": [1]}))
    assert list(x.shape) == [1, 3, 8, 8] and y.tolist() == [1]
    with pytest.raises(RecipeError, match="a stored image of 6000x6000 pixels, where the dataset's are 8x8"):
        recipe.tensors(pa.table({"image": [png(6000, 6000)], "label": [1]}))
