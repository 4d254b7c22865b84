"""The data plane on a real pool: bytes each agent downloads, what its cache saves, and samples/s
with a cold cache, a warm cache, and the in-memory path every recipe used before.

Pushes a synthetic table (rows × 32 float32 features, 10 classes) as Parquet chunks to a file
store, then runs the same fused `tabular` job on an embedded pool of --agents agents:

* in-memory: every agent reads the whole table into memory (the base recipe's path);
* cold: each shard reads only its own rows' chunks, into an empty cache;
* warm: the same again, the chunks already cached;
* small cache: a cache budget of a quarter of the train split (chunks evicted and read again).

    python benchmarks/data_plane.py [--rows 200000] [--agents 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import RESULTS, machine, sample_agent_peaks  # noqa: E402


def tt(args: list[str], env: dict[str, str], cwd: Path, peaks: dict[str, int] | None = None) -> dict:
    """Run the CLI; with ``peaks``, sample the agents' processes (by their Celery titles) while it
    runs and keep each agent's largest peak resident set (VmHWM) of any of its processes."""
    proc = subprocess.Popen([sys.executable, "-m", "tensorturn", *args, "--json"], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    done = threading.Event()
    watcher = (threading.Thread(target=sample_agent_peaks, args=(peaks, done), daemon=True)
               if peaks is not None else None)
    if watcher:
        watcher.start()
    out, err = proc.communicate()
    done.set()
    if proc.returncode:
        raise SystemExit(f"tensorturn {' '.join(args)} failed: {err[-2000:]}")
    return json.loads(out)


def make_table(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 32)).astype(np.float32)
    y = (x @ rng.normal(size=(32, 10)) + rng.normal(size=(rows, 10))).argmax(1).astype(np.int64)
    pq.write_table(pa.table({**{f"f{i}": x[:, i] for i in range(32)}, "y": y}), path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shards", type=int, default=6)
    ap.add_argument("--sync-every", type=int, default=100)
    ap.add_argument("--chunk-mb", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tt-dataplane-") as tmp:
        work = Path(tmp)
        make_table(work / "table.parquet", args.rows)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORTURN_", "AWS_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
        store = str(work / "store")
        t0 = time.monotonic()
        pushed = tt(["data", "push", str(work / "table.parquet"), "--name", "bench", "--label", "y",
                     "--chunk-mb", str(args.chunk_mb), "--store", store], env, work)
        push_s = time.monotonic() - t0
        show = subprocess.run([sys.executable, "-m", "tensorturn", "data", "show", "bench", "--store", store],
                              env=env, cwd=work, capture_output=True, text=True, check=True)
        index = json.loads(show.stdout)
        train_bytes = sum(c["bytes"] for c in index["splits"]["train"])
        job = ["run", "--local-workers", str(args.agents), "--rounds", str(args.rounds), "--shards",
               str(args.shards), "--sync-every", str(args.sync_every), "--store", store,
               "--recipe-option", "dataset=bench", "--allow-recipe", "data_plane_recipes:*"]
        cases = [
            ("in-memory", "data_plane_recipes:InMemoryTabular", "cache-mem", 100.0),
            ("cold cache", "tabular", "cache-a", 100.0),
            ("warm cache", "tabular", "cache-a", 100.0),
            ("cache = 1/4 of train", "tabular", "cache-small", train_bytes / 4 / 1024 ** 3),
        ]
        rows = []
        for name, recipe, cache, gb in cases:
            case_env = {**env, "TENSORTURN_CACHE_DIR": str(work / cache), "TENSORTURN_CACHE_GB": str(gb)}
            t0 = time.monotonic()
            peaks: dict[str, int] = {}
            doc = tt([*job, "--recipe", recipe], case_env, work, peaks)
            wall = time.monotonic() - t0
            shards = [a for a in doc["attempts"] if "/shard-" in a["task"] and a["outcome"] == "succeeded"]
            busy = sum(a["finished_at"] - a["started_at"] for a in shards)
            samples = sum(r["samples"] for r in doc["rounds"])
            downloaded = {w.split("@")[0]: n for w, n in sorted(doc.get("data_bytes", {}).items())}
            read_by = {w.split("@")[0]: n for w, n in sorted(doc.get("data_read_bytes", {}).items())}
            tasks_by = {w.split("@")[0]: sum(a["worker"] == w for a in shards)
                        for w in {a["worker"] for a in shards}}
            per_agent = {a: {"shard_tasks": tasks_by.get(a, 0), "read": read_by.get(a, 0),
                             "downloaded": downloaded.get(a, 0)}
                         for a in sorted(set(downloaded) | set(tasks_by))}
            total = sum(downloaded.values())
            read_total = sum(read_by.values())
            rows.append({
                "case": name, "state": doc["state"], "model_sha256": doc["model_sha256"],
                "test_accuracy": doc["metrics"].get("test_accuracy"), "wall_s": round(wall, 2),
                "shard_task_s": round(busy, 2), "samples_per_task_s": round(samples / busy, 1),
                "per_agent": per_agent, "data_bytes": total, "data_read_bytes": read_total,
                "cache_hit_rate": round(1 - total / read_total, 3) if read_total and total <= read_total else None,
                "downloaded_of_train_x_rounds": (round(total / (train_bytes * args.rounds), 3)
                                                 if recipe == "tabular" else None),
                "cache_budget_bytes": int(gb * 1024 ** 3) if gb < 100 else None,
                "peak_rss_bytes_per_agent": dict(sorted(peaks.items())),
            })
            print(f"{name:22s} {doc['state']:9s} wall {wall:6.1f}s  shard tasks {busy:6.1f}s  "
                  f"{samples / busy:9.0f} samples/task-s  downloaded {total / 1e6:7.2f} MB of "
                  f"{read_total / 1e6:7.2f} MB read  acc {doc['metrics'].get('test_accuracy', 0):.4f}  "
                  f"sha {doc['model_sha256'][:12]}  peak RSS {max(peaks.values(), default=0) / 1e6:.0f} MB")
            for a, f in per_agent.items():
                print(f"    {a}: {f['shard_tasks']:2d} of {len(shards)} shard tasks "
                      f"({f['shard_tasks'] / max(len(shards), 1):.0%}), read {f['read'] / 1e6:6.2f} MB, "
                      f"downloaded {f['downloaded'] / 1e6:6.2f} MB ({f['downloaded'] / max(total, 1):.0%} of all)")
        out = {"machine": machine(), "args": vars(args), "dataset": {
                   "rows": pushed["rows"], "chunks": pushed["chunks"], "bytes": pushed["bytes"],
                   "train_bytes": train_bytes, "push_s": round(push_s, 2)},
               "results": rows}
        (RESULTS / "data_plane.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
