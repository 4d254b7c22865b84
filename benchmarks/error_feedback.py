"""Error feedback on the pseudo-gradients: what a codec of 16× or more costs on ``charlm`` with
and without it — the measurement that decides whether TensorTurn needs per-shard residuals.

Error feedback (EF) keeps, per shard, what the codec did not send (``e_k``) and adds it to the next
round's pseudo-gradient before encoding: ``u = Δ_k + e_k``, send ``Q(u)``, keep ``e_k = u − Q(u)``.
In a pool the residual lives on the machine that trained the shard, and work stealing moves shards
between machines; this script runs the fused round in this process with every shard's residual at
hand — what a design with shards pinned to machines (and a residual moved or rebuilt when a shard
moves) would compute. It is not the pool's code path; ``codecs.py`` measures the shipped codecs
on a real pool.

The round is the production one (``diloco.train_replica`` on ``recipe.shard_data``, the outer step
and evaluation ``modes.fused.outer.outer_round`` with its broadcast compression, same seeds), so
the ``fp32`` and ``ternary`` rows are the runs ``codecs.py`` measures on a pool. Upload codecs:

* ``fp32``, ``int4``, ``ternary``: the shipped codecs (their real files; bytes as stored);
* ``topk<P>``: a prototype, not a shipped codec — in chunks of 4,096 values the P % largest
  magnitudes, each sent as a sign and one magnitude bit (two levels per chunk: the means of the
  kept values below and above their median, as float16), with a 12-bit index: bytes counted as
  ``kept × 14 bits + 32 bits a chunk`` (SparseLoCo's top-k with 2-bit values, roughly).

``CODEC/DOWN`` sends the broadcast in codec ``DOWN`` instead of ``--broadcast``'s
(``ternary/int4``: ternary up, int4 down). ``--corpus-chars N`` trains on a longer text than
charlm's built-in 400,000 characters: the standard library's modules, sorted by name, cut at N
(written to a file beside the run; the same text for the same Python), so that a long comparison
does not run many epochs over a small text (fp32 overfits the built-in text after ~32 rounds).

With ``+ef`` the shard's residual is fed back (``+ef0.9``: 0.9 of it, a decaying accumulator);
``@sgd`` (or ``@nesterov``) sets the outer optimizer (default: ``auto``, as ``run`` decides).
The broadcast (θ_{r+1} − θ_r, down) uses the run's codec (``--broadcast``; the outer step's own
error feedback is already shipped).

    python benchmarks/error_feedback.py [--variants fp32,ternary,ternary+ef,topk3+ef]
        [--broadcast ternary] [--seeds 0,1] [--rounds 8] [--sync-every 50] [--shards 3] [--jobs 2]

Writes ``benchmarks/results/error_feedback.json`` (and ``.png``); prints a table.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
from _common import figure, machine, table, write_outputs

from tensorturn import layout
from tensorturn.modes.fused.options import settle_options
from tensorturn.modes.fused.outer import outer_round
from tensorturn.modes.fused.weights import global_bytes
from tensorturn.recipes import resolve
from tensorturn.spec import RunSpec
from tensorturn.store import seals
from tensorturn.store.objects import open_store
from tensorturn.store.tensorfile import TensorReader, delta_tensors, write_delta
from tensorturn.train import diloco
from tensorturn.train.device import pick_device
from tensorturn.train.loop import derive_seed, set_threads
from tensorturn.trust import PoolKey

CHUNK = 4096


def topk_two_bit(u: torch.Tensor, percent: float) -> tuple[torch.Tensor, float]:
    """The prototype: (what a receiver decodes, bits it costs) for tensor ``u``."""
    flat = u.reshape(-1).double()
    n = flat.numel()
    chunks = math.ceil(n / CHUNK)
    padded = torch.zeros(chunks * CHUNK, dtype=torch.float64)
    padded[:n] = flat
    blocks = padded.view(chunks, CHUNK)
    k = max(1, round(CHUNK * percent / 100))
    mags, idx = blocks.abs().topk(k, dim=1)
    median = mags.median(dim=1, keepdim=True).values
    low = torch.where(mags <= median, mags, torch.nan).nanmean(dim=1, keepdim=True)
    high = torch.where(mags > median, mags, torch.nan).nanmean(dim=1, keepdim=True)
    high = torch.where(torch.isnan(high), low, high)
    level = torch.where(mags > median, high, low).half().double()  # the scales travel as float16
    signs = torch.gather(blocks, 1, idx).sign()
    out = torch.zeros_like(blocks)
    out.scatter_(1, idx, signs * level)
    bits = chunks * (k * 14 + 32)
    return out.reshape(-1)[:n].view(u.shape).float(), bits


def encode_upload(delta: dict[str, torch.Tensor], codec: str, path: Path,
                  extra: dict[str, str]) -> tuple[dict[str, torch.Tensor], int]:
    """Write what the outer step reads for this shard; (what it decodes, bytes sent)."""
    if codec.startswith("topk"):
        sent, bits = {}, 0.0
        for name, value in delta.items():
            sent[name], b = topk_two_bit(value, float(codec.removeprefix("topk")))
            bits += b
        write_delta(path, sent, "fp32", extra)  # the decoded values; the bytes are counted above
        return sent, int(bits / 8)
    write_delta(path, delta, codec, extra)
    with TensorReader(path) as f:
        sent = dict(delta_tensors(f))
    return sent, path.stat().st_size


def corpus(chars: int, path: Path) -> Path:
    """The standard library's ``.py`` sources, sorted by relative path, joined and cut at ``chars``."""
    root = Path(os.__file__).parent
    parts, total = [], 0
    for source in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if "site-packages" in source.parts or "test" in source.parts or "tests" in source.parts:
            continue
        try:
            text = source.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(f"# ---- {source.relative_to(root).as_posix()} ----\n{text}")
        total += len(parts[-1])
        if total >= chars:
            break
    path.write_text("\n".join(parts)[:chars], encoding="utf-8")
    return path


def parse_variant(variant: str) -> tuple[str, float | None, str]:
    """``CODEC[+ef[DECAY]][@OUTER]`` → (upload codec, residual decay or None without error
    feedback, outer optimizer or ``auto``): ``ternary+ef0.9@sgd`` keeps 0.9 of the residual a
    round (SparseLoCo's decaying accumulator) under a plain-averaging outer step."""
    body, _, outer = variant.partition("@")
    codec, _, ef = body.partition("+ef")
    decay = None if "+ef" not in body else float(ef) if ef else 1.0
    return codec, decay, outer or "auto"


def run(variant: str, broadcast: str, seed: int, rounds: int, sync_every: int, shards: int,
        corpus_chars: int = 0) -> dict:
    up_variant, _, down = variant.partition("/")
    codec, decay, outer = parse_variant(up_variant)
    ef = decay is not None
    set_threads(1)
    with tempfile.TemporaryDirectory(prefix="tt-ef-") as tmp:
        options = {"data": str(corpus(corpus_chars, Path(tmp) / "corpus.txt"))} if corpus_chars else {}
        spec = RunSpec.create(store_url=(Path(tmp) / "store").as_uri(), mode="fused", recipe="charlm",
                              recipe_options=options,
                              rounds=rounds, shards=shards, sync_every=sync_every, seed=seed, outer=outer,
                              codec="fp32" if codec == "fp32" and not down else down or broadcast,
                              threads_per_task=1)
        recipe = resolve(spec.recipe, spec.recipe_options)
        settle_options(spec, recipe)  # --outer auto, as `run` decides it
        device = pick_device()
        store = open_store(spec.store_url)
        theta = diloco.initial_state(recipe, spec.seed)
        seals.put_bytes(store, layout.key("global", spec.run_id, 0), global_bytes(spec, recipe, theta))
        residual: dict[int, dict[str, torch.Tensor]] = {}
        up = down = 0
        curve = []
        for r in range(rounds):
            if r > 0:
                name = "broadcast" if store.exists(layout.key("broadcast", spec.run_id, r)) else "global"
                down += shards * len(store.get_bytes(layout.key(name, spec.run_id, r)))
            for k in range(shards):
                x, y, rows = recipe.shard_data(k, shards, spec.seed)
                delta, loss, n = diloco.train_replica(
                    recipe, theta, x, y, rows, sync_every, spec.lr or recipe.lr,
                    spec.batch_size or recipe.batch_size, derive_seed(spec.seed, r, k), device)
                if ef and k in residual:
                    delta = {name: v + residual[k][name] for name, v in delta.items()}
                path = Path(tmp) / "delta"
                sent, size = encode_upload(delta, codec, path, {"samples": str(n), "loss": repr(loss),
                                                                "bytes_down": f"{0:015d}"})
                up += size
                if decay is not None:
                    residual[k] = {name: decay * (delta[name] - sent[name]) for name in delta}
                seals.put_file(store, layout.key("shard", spec.run_id, r, k), path)
            scratch = Path(tmp) / f"round-{r}"
            scratch.mkdir()
            curve.append(outer_round(spec, store, r, scratch)["val_loss"])
            with TensorReader(scratch / "next") as f:
                theta = f.all()
    return {"variant": variant, "seed": seed, "val_loss": curve[-1], "curve": curve,
            "bytes_up": up, "bytes_down": down}


def one(job: tuple) -> dict:
    t0 = time.perf_counter()
    out = run(*job)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print({k: v for k, v in out.items() if k != "curve"}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="fp32,ternary,ternary+ef,topk3+ef,topk10+ef")
    ap.add_argument("--broadcast", default="ternary", help="the run's codec: the broadcast's")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel processes (1 thread each)")
    ap.add_argument("--corpus-chars", type=int, default=0,
                    help="train on this many characters of the standard library (0: charlm's built-in text)")
    ap.add_argument("--name", default="error_feedback")
    args = ap.parse_args()
    os.environ.setdefault("TENSORTURN_POOL_KEY", PoolKey.generate().text())  # the spec is signed
    variants = args.variants.split(",")
    jobs = [(v, args.broadcast, int(s), args.rounds, args.sync_every, args.shards, args.corpus_chars)
            for v in variants for s in args.seeds.split(",")]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        runs = list(pool.map(one, jobs))
    base = [r for r in runs if r["variant"] == "fp32"]
    base_val = statistics.mean(r["val_loss"] for r in base) if base else None
    base_bytes = statistics.mean(r["bytes_up"] + r["bytes_down"] for r in base) if base else None
    base_up = statistics.mean(r["bytes_up"] for r in base) if base else None
    rows = []
    for v in variants:
        mine = [r for r in runs if r["variant"] == v]
        val = statistics.mean(r["val_loss"] for r in mine)
        up = statistics.mean(r["bytes_up"] for r in mine)
        both = statistics.mean(r["bytes_up"] + r["bytes_down"] for r in mine)
        rows.append([v, len(mine), f"{val:.4f}",
                     f"{100 * (val / base_val - 1):+.2f} %" if base_val else "",
                     ", ".join(f"{r['val_loss']:.4f}" for r in mine),
                     f"{up / 1e6:.2f} MB", f"{base_up / up:.1f}×" if base_up else "",
                     f"{base_bytes / both:.1f}×" if base_bytes else ""])
    print(table(["upload", "seeds", "val loss", "vs fp32", "per seed", "up", "up vs fp32",
                 "up+down vs fp32"], rows))
    write_outputs(args.name, {"machine": machine(), "args": vars(args), "runs": runs}, plot(runs, variants))


def plot(runs: list[dict], variants: list[str]):
    fig = figure()
    ax = fig.add_subplot()
    for v in variants:
        curves = [r["curve"] for r in runs if r["variant"] == v]
        ax.plot(range(1, len(curves[0]) + 1), [statistics.mean(c) for c in zip(*curves)], marker="o", label=v)
    ax.set_xlabel("round")
    ax.set_ylabel("validation loss (nats/char, mean over seeds)")
    ax.set_title("charlm: upload codecs with and without error feedback")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
