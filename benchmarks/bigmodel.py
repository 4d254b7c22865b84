"""Big models: the outer step's memory against S and model size, and whole fused runs of the
86M-parameter ``gpt2-small`` on the file store and on S3 (moto), fp32 against int8.

Part 1 (``--part outer``): for models of ~10M, ~50M and 86M parameters (``charlm`` at growing
sizes, and ``gpt2-small``) and S = 2, 4, 8 shards, a child process runs round 1's outer step on
stored random pseudo-gradients (Nesterov, so the momentum is read and written too) — the real
average and step (``average_and_step``: streaming) and, for contrast, the list-based step it
replaced (every shard's delta decoded into a list, then averaged) — and reports its peak
resident memory (``VmHWM``, reset just before the step), its time, and the part of it spent
computing (``compute_s``: what an agent publishes for plans, without fetching and storing). The validation pass that
follows in a real outer step is not included: its memory is the recipe's eval batch's.

Part 2 (``--part transfers``): one model-sized file (343 MB) up and down with the store's
``put_file``/``get_file`` (S3: boto3's transfer manager, 16 MiB parts), file store and moto.

Part 3 (``--part runs``): ``tensorturn run --recipe gpt2-small`` on an embedded pool of 2 agents,
2 rounds × 2 shards × 1 inner step of batch 2, with ``--codec fp32`` and ``int8``, on a file store
and on moto's S3 server: bytes moved per run, wall time, each agent's peak resident memory
(training in a shard task, or the outer step), and whether it succeeded.

    python benchmarks/bigmodel.py [--part outer|transfers|runs|all]
    python benchmarks/bigmodel.py --part outer --sizes 86M --shards 2 --codecs fp32,int8,int4 --name bigmodel_codecs
    python benchmarks/bigmodel.py --part outer --sizes 86M --shards 3 --up-codec ternary --codecs fp32,int2 \
        --name outer_ternary
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import RESULTS, figure, machine, sample_agent_peaks, table, write_outputs  # noqa: E402

SIZES = {  # name: (recipe, options)
    "10M": ("charlm", {"n_layer": 4, "n_head": 8, "n_embd": 448, "context": 64}),
    "50M": ("charlm", {"n_layer": 8, "n_head": 12, "n_embd": 720, "context": 64}),
    "86M": ("gpt2-small", {}),
}


# ---- part 1: the outer step ----------------------------------------------------------------------

def prepare(work: Path, size: str, shards: int, codec: str = "fp32", up: str = "fp32") -> tuple[str, str]:
    """A store with round 1 of a fused run ready for its outer step: θ_1, the momentum entering
    round 1, and S random pseudo-gradients encoded with ``up`` (the run's ``codec`` encodes round
    1's broadcast: of 3 rounds, only the last is kept exact). Returns (store URL, run id)."""
    import torch

    from tensorturn import layout
    from tensorturn.modes.fused.weights import global_bytes
    from tensorturn.recipes import resolve
    from tensorturn.spec import RunSpec
    from tensorturn.state.manifest import save_spec
    from tensorturn.store import seals
    from tensorturn.store.objects import open_store
    from tensorturn.store.tensors import delta_bytes, to_bytes
    from tensorturn.train.diloco import initial_state

    recipe_name, options = SIZES[size]
    store = open_store((work / f"store-{size}-{shards}-{codec}").as_uri())
    spec = RunSpec.create(mode="fused", recipe=recipe_name, store_url=store.url, recipe_options=options,
                          rounds=3, shards=shards, sync_every=2, outer="nesterov", eval_batches=1, codec=codec)
    recipe = resolve(recipe_name, options)
    theta = initial_state(recipe, 0)
    save_spec(store, spec)
    seals.put_bytes(store, layout.key("global", spec.run_id, 1), global_bytes(spec, recipe, theta))
    gen = torch.Generator().manual_seed(1)
    floats = {k: v for k, v in theta.items() if v.is_floating_point()}
    seals.put_bytes(store, layout.key("outer", spec.run_id, 1),
                    to_bytes({k: 1e-3 * torch.randn(v.shape, generator=gen) for k, v in floats.items()}))
    for k in range(shards):
        delta = {name: 1e-3 * torch.randn(v.shape, generator=gen) for name, v in floats.items()}
        seals.put_bytes(store, layout.key("shard", spec.run_id, 1, k),
                        delta_bytes(delta, up, {"samples": "16", "loss": "1.0",
                                                    "bytes_down": f"{0:015d}"}))
    return store.url, spec.run_id


def child(store_url: str, run_id: str, how: str) -> None:
    """Run one outer step in this process; print its peak memory above the baseline (JSON)."""
    import torch

    from tensorturn import layout
    from tensorturn.modes.fused.options import options
    from tensorturn.modes.fused.outer import OuterClock, average_and_step, step_global
    from tensorturn.recipes import recipe_of
    from tensorturn.state.manifest import load_spec
    from tensorturn.store.objects import open_store
    from tensorturn.store.tensors import delta_from_bytes
    from tensorturn.train.diloco import initial_state, weighted_average

    torch.set_num_threads(1)
    store = open_store(store_url)
    spec = load_spec(store, run_id)
    recipe = recipe_of(spec)
    recipe.default_config()
    params = sum(v.numel() for v in initial_state(recipe, 0).values())
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    base = _status("VmRSS")
    t0, clock = time.perf_counter(), OuterClock()
    if how == "streaming":
        with tempfile.TemporaryDirectory() as scratch:
            average_and_step(spec, store, 1, Path(scratch), clock=clock)
    else:  # the list-based step it replaced: every delta in memory, then the average
        decoded = [delta_from_bytes(store.get_bytes(layout.key("shard", run_id, 1, k)))
                   for k in range(options(spec).shards)]
        avg = weighted_average([d for d, _ in decoded], [int(m["samples"]) for _, m in decoded])
        del decoded
        step_global(spec, recipe, store, 1, avg)
    seconds = time.perf_counter() - t0
    print(json.dumps({"params": params, "baseline_bytes": base, "peak_bytes": _status("VmHWM"),
                      "seconds": round(seconds, 2), "compute_s": round(clock.seconds, 2) if clock.values else None}))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def part_outer(work: Path, sizes: list[str], shard_counts: list[int], codecs: list[str],
               up: str = "fp32") -> list[dict]:
    """Each size × S × codec: the streaming step (and, for fp32, the list-based one it
    replaced), each in a child process, from the same stored inputs (pseudo-gradients in ``up``)."""
    rows = []
    for size in sizes:
        for shards in shard_counts:
            for codec in codecs:
                url, run_id = prepare(work, size, shards, codec, up)
                for how in ("streaming", "list") if codec == "fp32" else ("streaming",):
                    from tensorturn import layout
                    from tensorturn.store.objects import open_store

                    store = open_store(url)  # the step's outputs go, so each variant starts alike
                    for kind in ("global", "outer", "broadcast"):
                        key = layout.key(kind, run_id, 2)
                        if store.exists(key):
                            store.delete(key)
                    proc = subprocess.run([sys.executable, __file__, "--child", url, run_id, how],
                                          capture_output=True, text=True)
                    if proc.returncode:
                        raise SystemExit(f"outer step {size} S={shards} {codec} {how} failed:\n"
                                         f"{proc.stderr[-3000:]}")
                    got = json.loads(proc.stdout.strip().splitlines()[-1])
                    model = got["params"] * 4
                    row = {"size": size, "shards": shards, "codec": codec, "up": up, "how": how, **got,
                           "model_fp32_bytes": model, "peak_over_model": round(got["peak_bytes"] / model, 2),
                           "growth_over_model": round((got["peak_bytes"] - got["baseline_bytes"]) / model, 2)}
                    rows.append(row)
                    print(f"{size:4s} S={shards}  {codec:4s} {how:9s}  model {model / 1e6:6.0f} MB  peak RSS "
                          f"{got['peak_bytes'] / 1e6:6.0f} MB ({row['peak_over_model']:.2f}× the model; "
                          f"+{row['growth_over_model']:.2f}× over the process before the step)  "
                          f"{got['seconds']:6.1f} s", flush=True)
                import shutil

                shutil.rmtree(work / f"store-{size}-{shards}-{codec}", ignore_errors=True)
    return rows


# ---- part 2: whole runs --------------------------------------------------------------------------

def moto() -> tuple[subprocess.Popen, dict[str, str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    return proc, env


def part_runs(work: Path, stores: list[str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORTURN_", "AWS_"))}
    env["TENSORTURN_CACHE_DIR"] = str(work / "cache")
    rows, server = [], None
    try:
        for kind in stores:
            run_env, store = dict(env), str(work / "runs-store")
            if kind == "s3":
                import boto3

                server, aws = moto()
                run_env.update(aws)
                boto3.client("s3", endpoint_url=aws["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                             aws_secret_access_key="testing-secret",
                             region_name="us-east-1").create_bucket(Bucket="big")
                store = "s3://big/runs"
            for codec in ("fp32", "int8"):
                import threading

                peaks: dict[str, int] = {}
                done = threading.Event()
                sampler = threading.Thread(target=sample_agent_peaks, args=(peaks, done, 0.5), daemon=True)
                sampler.start()
                t0 = time.monotonic()
                proc = subprocess.run(
                    [sys.executable, "-m", "tensorturn", "run", "--recipe", "gpt2-small", "--local-workers", "2",
                     "--rounds", "2", "--shards", "2", "--sync-every", "1", "--batch-size", "2",
                     "--eval-batches", "2", "--codec", codec, "--store", store, "--json"],
                    env=run_env, cwd=work, capture_output=True, text=True, stdin=subprocess.DEVNULL)
                wall = time.monotonic() - t0
                done.set()
                sampler.join()
                doc = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
                row = {"store": kind, "codec": codec, "state": doc.get("state", f"exit {proc.returncode}"),
                       "error": None if doc.get("state") == "succeeded" else
                       (doc.get("error") or (proc.stderr.strip().splitlines() or [""])[-1][:300]),
                       "wall_s": round(wall, 1), "bytes_up": doc.get("bytes_up"),
                       "bytes_down": doc.get("bytes_down"),
                       "bytes": (doc.get("bytes_up") or 0) + (doc.get("bytes_down") or 0),
                       "test_loss": (doc.get("metrics") or {}).get("test_loss"),
                       "agent_peak_rss_bytes": dict(sorted(peaks.items()))}
                rows.append(row)
                print(f"{kind:4s} {codec}  {row['state']:9s}  {wall:6.1f} s  bytes moved "
                      f"{row['bytes'] / 1e6:8.1f} MB (up {(row['bytes_up'] or 0) / 1e6:.1f}, down "
                      f"{(row['bytes_down'] or 0) / 1e6:.1f})  agents' peak RSS "
                      f"{', '.join(f'{v / 1e9:.2f}' for v in peaks.values())} GB  {row['error'] or ''}", flush=True)
            if server is not None:
                server.terminate()
                server.wait(10)
                server = None
    finally:
        if server is not None:
            server.kill()
    return rows


def part_transfers(work: Path, stores: list[str], mb: int = 343) -> list[dict]:
    """put_file / get_file of one model-sized file (the 86M model in fp32: 343 MB), timed."""
    from tensorturn.store.objects import open_store

    (work / "blob").write_bytes(os.urandom(mb * 10 ** 6))
    rows, server = [], None
    try:
        for kind in stores:
            if kind == "s3":
                import boto3

                server, aws = moto()
                os.environ.update(aws)
                boto3.client("s3").create_bucket(Bucket="xfer")
                store = open_store("s3://xfer/t")
            else:
                store = open_store((work / "xfer-store").as_uri())
            t0 = time.perf_counter()
            store.put_file("bench/blob", work / "blob")
            up = time.perf_counter() - t0
            t0 = time.perf_counter()
            store.get_file("bench/blob", work / "back")
            down = time.perf_counter() - t0
            (work / "back").unlink()
            rows.append({"store": kind, "bytes": mb * 10 ** 6, "upload_s": round(up, 2),
                         "download_s": round(down, 2), "upload_mb_s": round(mb / up, 1),
                         "download_mb_s": round(mb / down, 1)})
            print(f"{kind:4s}  {mb} MB up {up:6.2f} s ({mb / up:7.1f} MB/s)  down {down:6.2f} s "
                  f"({mb / down:7.1f} MB/s)", flush=True)
            if server is not None:
                server.terminate()
                server.wait(10)
                server = None
                for k in aws:
                    os.environ.pop(k, None)
    finally:
        if server is not None:
            server.kill()
    return rows


def draw(summary: dict):
    fig = figure(10, 4)
    left, right = fig.subplots(1, 2)
    outer = summary.get("outer", [])
    for how, style in (("streaming", "-o"), ("list", "--s")):
        for size in SIZES:
            pts = [(r["shards"], r["peak_bytes"] / 1e6) for r in outer if r["how"] == how and r["size"] == size]
            if pts:
                left.plot(*zip(*pts), style, label=f"{size} {how}")
    left.set_xlabel("shards S")
    left.set_ylabel("outer step peak RSS (MB)")
    left.set_title("outer step memory vs S")
    left.legend(fontsize=7)
    for how, style in (("streaming", "-o"), ("list", "--s")):
        pts = sorted((r["model_fp32_bytes"] / 1e6, r["peak_bytes"] / 1e6) for r in outer
                     if r["how"] == how and r["shards"] == 8)
        if pts:
            right.plot(*zip(*pts), style, label=f"{how}, S=8")
    right.set_xlabel("model size, fp32 (MB)")
    right.set_ylabel("outer step peak RSS (MB)")
    right.set_title("outer step memory vs model size")
    right.legend(fontsize=7)
    return fig


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("outer", "runs", "transfers", "all"), default="all")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--shards", default="2,4,8")
    ap.add_argument("--codecs", default="fp32", help="outer part: comma-separated --codec values")
    ap.add_argument("--up-codec", default="fp32", help="outer part: the codec of the stored pseudo-gradients")
    ap.add_argument("--stores", default="file,s3")
    ap.add_argument("--name", default="bigmodel", help="write NAME.json and NAME.png in benchmarks/results/")
    args = ap.parse_args()
    if not os.environ.get("TENSORTURN_POOL_KEY"):  # this script's own pool: its specs are signed
        from tensorturn.trust import PoolKey

        os.environ["TENSORTURN_POOL_KEY"] = PoolKey.generate().text()
    summary: dict = {"machine": machine()}
    previous = RESULTS / f"{args.name}.json"
    if args.part != "all" and previous.exists():  # keep the other part's figures
        summary = {**json.loads(previous.read_text()), **summary}
    with tempfile.TemporaryDirectory(prefix="tt-bigmodel-") as tmp:
        work = Path(tmp)
        if args.part in ("outer", "all"):
            summary["outer"] = part_outer(work, args.sizes.split(","), [int(s) for s in args.shards.split(",")],
                                          args.codecs.split(","), args.up_codec)
            print(table(["size", "S", "up", "codec", "how", "peak MB", "× model", "s", "computing s"],
                        [[r["size"], r["shards"], r.get("up", "fp32"), r.get("codec", "fp32"), r["how"],
                          round(r["peak_bytes"] / 1e6), r["peak_over_model"], r["seconds"], r.get("compute_s")]
                         for r in summary["outer"]]))
        if args.part in ("transfers", "all"):
            summary["transfers"] = part_transfers(work, args.stores.split(","))
        if args.part in ("runs", "all"):
            summary["runs"] = part_runs(work, args.stores.split(","))
    write_outputs(args.name, summary, draw(summary))


if __name__ == "__main__":
    main()
