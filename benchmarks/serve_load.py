"""Load on the inference API: requests/s and p50/p99 latency, loopback only, bounded.

Trains a small fused digits model on an embedded pool (or serves --run from --store), starts
`tensorturn serve` on a free loopback port, and sends a fixed number of requests from a few
client threads, each request one or more raw digit rows. Prints a table and writes JSON.

    python benchmarks/serve_load.py [--requests 600] [--threads 1,4,8] [--rows 1,32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from sklearn.datasets import load_digits

from tensorturn.local import free_port, stop_process_group


def tt_json(*args: str, cwd: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tensorturn", *args, "--json"], cwd=cwd,
                         capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL)
    return json.loads(out.stdout)


def load(url: str, token: str, body: dict, requests: int, threads: int) -> dict:
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    per_thread = requests // threads

    def worker():
        nonlocal errors
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
            for _ in range(per_thread):
                t0 = time.perf_counter()
                r = client.post(url, json=body)
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                    errors += r.status_code != 200

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    wall = time.perf_counter() - t0
    q = sorted(latencies)
    return {"threads": threads, "requests": len(q), "errors": errors,
            "requests_per_s": len(q) / wall,
            "p50_ms": 1000 * statistics.median(q), "p99_ms": 1000 * q[int(0.99 * (len(q) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--threads", default="1,4,8")
    parser.add_argument("--rows", default="1,32", help="rows per request")
    parser.add_argument("--store", default=None)
    parser.add_argument("--run", default=None, help="serve this run instead of training one")
    parser.add_argument("--out", default=str(Path(__file__).with_name("serve_load.json")))
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="tt-serve-load-")
    store = args.store or str(Path(work) / "store")
    run_id = args.run or tt_json("run", "--recipe", "digits-mlp", "--local-workers", "2",
                                 "--rounds", "4", "--store", store, cwd=work)["run_id"]
    token = tt_json("token", "create", "--name", "load", "--store", store, cwd=work)["token"]
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorturn", "serve", run_id, "--store",
                               store, "--host", "127.0.0.1", "--port", str(port)], cwd=work,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        x, _ = load_digits(return_X_y=True)
        results = []
        for rows in map(int, args.rows.split(",")):
            body = {"inputs": [{"name": "input", "shape": [rows, 64], "datatype": "FP32",
                                "data": x[:rows].flatten().tolist()}]}
            for threads in map(int, args.threads.split(",")):
                r = load(f"{base}/v2/models/{run_id}/infer", token, body, args.requests, threads)
                r["rows"] = rows
                results.append(r)
                print(f"rows {rows:3d}  threads {threads:2d}  {r['requests_per_s']:7.1f} req/s  "
                      f"p50 {r['p50_ms']:6.1f} ms  p99 {r['p99_ms']:6.1f} ms  errors {r['errors']}",
                      flush=True)
    finally:
        stop_process_group(server, grace=10)
    Path(args.out).write_text(json.dumps({
        "results": results, "machine": f"{platform.processor() or platform.machine()}, "
                                       f"{os.cpu_count()} cores"}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
