"""Load on the inference API: requests/s, rows/s and p50/p99 latency, loopback only, bounded.

Trains a small fused digits model on an embedded pool (or serves --run from --store), starts
`tensorturn serve` on a free loopback port pinned to one core (``taskset -c 0``), pins this load
generator to another (``taskset -c 1``), and drives it from asyncio clients on raw keep-alive
connections (pre-encoded requests, responses read by Content-Length), so the client is not the
bottleneck. Each scenario runs for a fixed time after a warm-up. Scenarios:

* ``rows R, clients C``: C clients each sending R-row requests back to back.
* ``flood``: 8 valid clients (1 row) while 64 more clients send wrong tokens back to back; the
  valid clients' latency is compared with the same 8 clients quiet.
* ``big bodies``: 2 clients sending ~5 MB requests (4,096 rows of full-precision floats) back to
  back while one client polls ``/v2/health/live``: does the event loop stay responsive?

Prints a table and merges the results into benchmarks/results/serve_load.json under ``--label``.

    python benchmarks/serve_load.py                       # this tree's server, as 'after'
    git worktree add /tmp/tt-before HEAD                  # and side by side with HEAD's:
    python benchmarks/serve_load.py --before-tree /tmp/tt-before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

from tensorturn.pool.embedded import free_port, stop_process_group

SCENARIOS = [(1, 1), (1, 8), (1, 32), (32, 1), (32, 8)]  # (rows per request, clients)


def child_env(work: str, server_tree: str | None = None, plain_uvicorn: bool = False) -> dict:
    """The CLI's environment: no pool or store inherited; the pool key is the work dir's file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORTURN_", "AWS_"))}
    paths = []
    if plain_uvicorn:  # the old dependencies: no uvloop, no httptools (uvicorn falls back)
        block = Path(work) / "block-standard"
        block.mkdir(exist_ok=True)
        for name in ("uvloop", "httptools"):
            (block / f"{name}.py").write_text("raise ImportError('blocked by serve_load.py')\n")
        paths.append(str(block))
    if server_tree:
        paths.append(server_tree)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def tt_json(*args: str, cwd: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tensorturn", *args, "--json"], cwd=cwd,
                         env=child_env(cwd), capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise SystemExit(f"tensorturn {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def request_bytes(path: str, token: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


async def read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    if length:
        await reader.readexactly(length)
    return status


class Client:
    """One keep-alive connection sending one pre-encoded request back to back."""

    def __init__(self, port: int, request: bytes, expect: int):
        self.port, self.request, self.expect = port, request, expect
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.errors = 0
        self.recording = False

    async def run(self, stop: asyncio.Event) -> None:
        reader = writer = None
        while not stop.is_set():
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                assert reader is not None
                t0 = time.perf_counter()
                writer.write(self.request)
                status = await read_response(reader)
                dt = time.perf_counter() - t0
            except (OSError, asyncio.IncompleteReadError, ValueError):
                if self.recording:
                    self.errors += 1
                if writer is not None:
                    writer.close()
                reader = writer = None
                await asyncio.sleep(0.01)
                continue
            if self.recording:
                self.statuses[status] = self.statuses.get(status, 0) + 1
                if status == self.expect:
                    self.latencies.append(dt)
                else:
                    self.errors += 1
        if writer is not None:
            writer.close()


def quantile(q: list[float], p: float) -> float:
    return q[min(len(q) - 1, int(p * len(q)))] if q else float("nan")


async def drive(groups: list[list[Client]], warmup: float, duration: float) -> float:
    stop = asyncio.Event()
    everyone = [c for g in groups for c in g]
    tasks = [asyncio.create_task(c.run(stop)) for c in everyone]
    await asyncio.sleep(warmup)
    for c in everyone:
        c.recording = True
    t0 = time.perf_counter()
    await asyncio.sleep(duration)
    for c in everyone:
        c.recording = False
    wall = time.perf_counter() - t0
    stop.set()
    await asyncio.wait(tasks, timeout=30)
    for t in tasks:
        t.cancel()
    return wall


def summary(clients: list[Client], wall: float, rows: int) -> dict:
    q = sorted(x for c in clients for x in c.latencies)
    statuses: dict[str, int] = {}
    for c in clients:
        for s, n in c.statuses.items():
            statuses[str(s)] = statuses.get(str(s), 0) + n
    return {"clients": len(clients), "rows": rows, "ok": len(q),
            "errors": sum(c.errors for c in clients), "statuses": statuses,
            "requests_per_s": len(q) / wall, "rows_per_s": rows * len(q) / wall,
            "p50_ms": 1000 * quantile(q, 0.5), "p99_ms": 1000 * quantile(q, 0.99),
            "max_ms": 1000 * q[-1] if q else float("nan")}


def line(name: str, r: dict) -> str:
    return (f"{name:28s} {r['requests_per_s']:8.1f} req/s {r['rows_per_s']:9.0f} rows/s  "
            f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after", help="key of these results in the JSON")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds measured per scenario")
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--store", default=None, help="a store with --run in it (with its key in "
                                                      "--workdir/.tensorturn)")
    parser.add_argument("--run", default=None, help="serve this run instead of training one")
    parser.add_argument("--workdir", default=None, help="where the pool key and store live")
    parser.add_argument("--server-tree", default=None,
                        help="a source tree to run the server from (PYTHONPATH), e.g. HEAD's")
    parser.add_argument("--before-tree", default=None,
                        help="also measure the server of this tree (e.g. a `git worktree` of "
                             "HEAD, run without uvloop/httptools) first, as 'before'")
    parser.add_argument("--plain-uvicorn", action="store_true",
                        help="hide uvloop and httptools from the server (the old dependencies)")
    parser.add_argument("--server-cpu", default="0")
    parser.add_argument("--client-cpu", default="1")
    parser.add_argument("--no-flood", action="store_true")
    parser.add_argument("--no-big", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "serve_load.json"))
    args = parser.parse_args()

    pin = shutil.which("taskset")
    if pin and args.client_cpu:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpu.split(",")})
    work = args.workdir or tempfile.mkdtemp(prefix="tt-serve-load-")
    store = args.store or str(Path(work) / "store")
    run_id = args.run or tt_json("run", "--recipe", "digits-mlp", "--local-workers", "2",
                                 "--store", store, cwd=work)["run_id"]
    token = tt_json("token", "create", "--name", "load", "--store", store, cwd=work)["token"]
    servers = [(args.label, args.server_tree, args.plain_uvicorn)]
    if args.before_tree:  # both, side by side in this one run: HEAD's first, then this tree's
        servers = [("before", args.before_tree, True), ("after", None, False)]
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {}
    if "results" in doc:  # the old flat format
        doc = {}
    for label, tree, plain in servers:
        print(f"-- {label}: server from {tree or 'this tree'}"
              f"{' without uvloop/httptools' if plain else ''}", flush=True)
        loadavg = os.getloadavg()
        port = free_port()
        command = [sys.executable, "-m", "tensorturn", "serve", run_id, "--store", store,
                   "--host", "127.0.0.1", "--port", str(port)]
        if pin and args.server_cpu:
            command = [pin, "-c", args.server_cpu, *command]
        server = subprocess.Popen(command, cwd=work, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True,
                                  env=child_env(work, tree, plain))
        try:
            results = asyncio.run(measure(args, port, run_id, token))
        finally:
            stop_process_group(server, grace=10)
        doc[label] = {
            "results": results, "server_cpu": args.server_cpu, "client_cpu": args.client_cpu,
            "server_tree": tree or "this tree", "plain_uvicorn": plain,
            "duration_s": args.duration, "loadavg_at_start": loadavg,
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out} [{label}]", flush=True)


async def measure(args: argparse.Namespace, port: int, run_id: str, token: str) -> list[dict]:
    deadline = time.monotonic() + 180
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            if await read_response(reader) == 200:
                writer.close()
                break
        except (OSError, asyncio.IncompleteReadError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the server did not come up")
        await asyncio.sleep(0.2)
    x, _ = load_digits(return_X_y=True)
    path = f"/v2/models/{run_id}/infer"

    def body(rows: int) -> bytes:
        return json.dumps({"inputs": [{"name": "input", "shape": [rows, 64], "datatype": "FP32",
                                       "data": x[:rows].flatten().tolist()}]}).encode()

    results = []
    for rows, n in SCENARIOS:
        clients = [Client(port, request_bytes(path, token, body(rows)), 200) for _ in range(n)]
        wall = await drive([clients], args.warmup, args.duration)
        r = {"scenario": f"rows {rows}, clients {n}", **summary(clients, wall, rows)}
        results.append(r)
        print(line(r["scenario"], r), flush=True)
    if not args.no_big:
        rng = np.random.default_rng(0)
        big = json.dumps({"inputs": [{"name": "input", "shape": [4096, 64], "datatype": "FP32",
                                      "data": (rng.random(4096 * 64) * 16).tolist()}]}).encode()
        heavy = [Client(port, request_bytes(path, token, big), 200) for _ in range(2)]
        probe = [Client(port, b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 200)]
        wall = await drive([heavy, probe], args.warmup, args.duration)
        r = {"scenario": f"big bodies: 2 × {len(big) / 1e6:.1f} MB", **summary(heavy, wall, 4096),
             "health": summary(probe, wall, 0)}
        results.append(r)
        print(line(r["scenario"], r), flush=True)
        h = r["health"]
        print(f"{'  meanwhile /v2/health/live':28s} p50 {h['p50_ms']:.1f} ms  p99 {h['p99_ms']:.1f} ms"
              f"  max {h['max_ms']:.1f} ms  ({h['ok']} probes)", flush=True)
    if args.no_flood:
        return results
    valid = [Client(port, request_bytes(path, token, body(1)), 200) for _ in range(8)]
    wrong = [Client(port, request_bytes(path, "tt_" + "x" * 43, body(1)), 401)
             for _ in range(64)]
    wall = await drive([valid, wrong], args.warmup, args.duration)
    quiet = next(r for r in results if r["scenario"] == "rows 1, clients 8")
    flood = {"scenario": "flood: 8 valid + 64 wrong-token", **summary(valid, wall, 1),
             "wrong_token_statuses": summary(wrong, wall, 1)["statuses"],
             "valid_p50_vs_quiet": summary(valid, wall, 1)["p50_ms"] / quiet["p50_ms"]}
    results.append(flood)
    print(line("flood: 8 valid clients", flood), flush=True)
    print(f"{'':28s} wrong-token answers {flood['wrong_token_statuses']}; valid p50 "
          f"{flood['valid_p50_vs_quiet']:.2f}× quiet", flush=True)
    return results


if __name__ == "__main__":
    main()
