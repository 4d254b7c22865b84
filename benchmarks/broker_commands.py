"""Broker commands per task: what a fused run costs the broker, by command, per shard task.

A pool of 3 agents on a private redis-server runs the digits job of issue 28 (3 shards × R
rounds × H = 67, digits-mlp); Redis's own ``INFO commandstats`` is read before and after the
run, and every call in between is divided by the run's shard tasks: the agents' task messages,
results, leases, heartbeats, progress and claims, and this script's own polling (``runs.wait``,
every 0.25 s). On a home link each command is a round trip (40 ms on the emulated links of
BENCHMARKS §13).

With ``--by-key`` (Redis ``MONITOR``) it also tells the commands clients *sent* — what a link
carries, a Lua script or each command of a pipeline one — from those Redis ran inside scripts
(``INFO commandstats`` counts both).

It counts commands, not bytes, and includes the pool's idle traffic over the run's wall time
(heartbeats every 3 s, lease refreshes every second per running task, Celery's polling of its
queues), which is what a task costs on a pool doing nothing else.

    python benchmarks/broker_commands.py [--rounds 8] [--agents 3]
    python benchmarks/broker_commands.py --protocol

``--protocol`` instead counts one shard task's own protocol in this process (no agents, no Celery
transport: the task is applied in this process as the tests' in-process world does): Redis's
commands, and the round trips the client made (each write of a command or a pipeline to a
socket), by the TensorTurn line that sent them. Commands a Lua script runs count in Redis's
statistics but are no round trip of their own.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import figure, machine, run_job, succeeded, table, write_outputs  # noqa: E402

from tensorturn.layout import parse_label  # noqa: E402
from tensorturn.pool.embedded import LocalPool  # noqa: E402
from tensorturn.state.broker import redis_client  # noqa: E402


def key_shape(command: str) -> str:
    """``HSET tt:run:<id>:attempts ...`` → ``hset tt:run:*:attempts``: the command and its first
    key with ids, numbers and hex folded, to tell who sends what."""
    parts = command.split(" ")
    name = parts[0].strip('"').lower()
    key = parts[1].strip('"') if len(parts) > 1 else ""
    key = re.sub(r"run:[^:\s]+", "run:*", key)
    key = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}", "<uuid>", key)
    key = re.sub(r"\d+", "N", key)
    return f"{name} {key}".strip()


class Monitor(threading.Thread):
    """Redis MONITOR in a thread: every command the server runs, by :func:`key_shape`."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.shapes, self.stop = url, Counter(), threading.Event()
        self.wire, self.scripted = Counter(), Counter()

    def run(self) -> None:
        import redis

        with redis.Redis.from_url(self.url).monitor() as m:
            for event in m.listen():
                if self.stop.is_set():
                    return
                shape = key_shape(event["command"])
                self.shapes[shape] += 1
                (self.scripted if event.get("client_type") == "lua" else self.wire)[shape] += 1


def calls(client) -> Counter:
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})


def protocol() -> None:
    """One fused shard task of round 1 (after a whole round 0), in this process."""
    import os
    import traceback

    from redis.connection import Connection

    from tensorturn import runs
    from tensorturn.modes.fused import (
        driver,
        tasks,  # noqa: F401 - the fused tasks registered
    )
    from tensorturn.pool.celery_app import configure
    from tensorturn.pool.embedded import RedisServer
    from tensorturn.spec import RunSpec
    from tensorturn.tasks.attempt import signed
    from tensorturn.trust import PoolKey

    os.environ.setdefault("TENSORTURN_POOL_KEY", PoolKey.generate().text())
    trips: Counter = Counter()
    send = Connection.send_packed_command

    def counted(self, command, check_health=True):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/tensorturn/" in f.filename and not f.filename.endswith("state/broker.py")]
        where = frames[-1] if frames else None
        trips[f"{Path(where.filename).parent.name}/{Path(where.filename).name}:{where.lineno} "
              f"{where.name}" if where else "(other)"] += 1
        return send(self, command, check_health)

    Connection.send_packed_command = counted
    with tempfile.TemporaryDirectory(prefix="tt-cmds-") as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        try:
            configure(server.url)
            from tensorturn import config

            config.use(config.current().with_(store_url=(Path(tmp) / "store").as_uri()))
            spec = RunSpec.create(store_url=(Path(tmp) / "store").as_uri(), mode="fused",
                                  recipe="digits-mlp", rounds=2, shards=3, sync_every=20,
                                  threads_per_task=1)
            runs.submit(spec, server.url)

            def shard(r: int, k: int) -> None:
                driver.train_shard.apply(args=(spec.run_id, r, k),
                                         kwargs=signed(spec.run_id, f"r{r}/shard-{k}")).get()

            for k in range(3):
                shard(0, k)
            driver.outer_step.apply(args=([], spec.run_id, 0), kwargs=signed(spec.run_id, "r0/outer")).get()
            client = redis_client(server.url)
            before = calls(client)
            trips.clear()
            shard(1, 0)
            Connection.send_packed_command = send  # the INFO below is not the task's
            used = calls(client) - before
            used["info"] -= 1  # the second INFO
        finally:
            server.stop()
    print(table(["command", "calls"], used.most_common()))
    print(table(["sent by", "round trips"], trips.most_common()))
    print(f"\none shard task's protocol: {sum(used.values())} commands in {sum(trips.values())} round trips")


def main() -> None:
    if "--protocol" in sys.argv:
        protocol()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--sync-every", type=int, default=67)
    ap.add_argument("--sync", default="rounds")
    ap.add_argument("--by-key", nargs="?", const=40, default=0, type=int, metavar="N",
                    help="also: the N most frequent commands by key (Redis MONITOR), sent or run in scripts")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tt-cmds-") as tmp:
        store = (Path(tmp) / "store").as_uri()
        with LocalPool(args.agents, store, workdir=Path(tmp) / "pool") as pool:
            client = redis_client(pool.broker_url)
            monitor = Monitor(pool.broker_url) if args.by_key else None
            if monitor:
                monitor.start()
            before = calls(client)
            doc = run_job(pool, store, mode="fused", recipe="digits-mlp", rounds=args.rounds,
                          shards=args.agents, sync_every=args.sync_every, sync=args.sync)
            after = calls(client)
            if monitor:
                monitor.stop.set()
    used = after - before
    shards = sum(1 for a in succeeded(doc) if getattr(parse_label(a["task"]), "kind", None) == "shard")
    tasks = len([a for a in doc["attempts"] if a["outcome"] == "succeeded"])
    wall = doc["finished_at"] - doc["created_at"]
    total = sum(used.values())
    rows = [[name, n, round(n / shards, 1)] for name, n in used.most_common(15)]
    print(table(["command", "calls", "per shard task"], rows))
    if monitor:
        print(table(["command and key", "sent", "in scripts", "per shard task"],
                    [[shape, monitor.wire[shape], monitor.scripted[shape], round(n / shards, 1)]
                     for shape, n in monitor.shapes.most_common(int(args.by_key))]))
        sent = sum(monitor.wire.values())
        print(f"\nclients sent {sent} commands ({sent / shards:.1f} per shard task); "
              f"scripts ran {sum(monitor.scripted.values())} more")
    print(f"\n{total} commands over {wall:.1f} s for {shards} shard tasks ({tasks} tasks in all): "
          f"{total / shards:.1f} per shard task, {total / tasks:.1f} per task")
    fig = figure(7, 4)
    ax = fig.add_subplot()
    ax.barh([r[0] for r in rows][::-1], [r[2] for r in rows][::-1])
    ax.set_xlabel("Redis commands per shard task")
    ax.set_title(f"digits, {args.agents} agents × {args.rounds} rounds × H = {args.sync_every}")
    write_outputs("broker_commands", {
        "machine": machine(), "agents": args.agents, "rounds": args.rounds, "sync_every": args.sync_every,
        "wall_s": wall, "shard_tasks": shards, "tasks": tasks, "commands": total,
        "per_shard_task": total / shards, "per_task": total / tasks, "by_command": dict(used.most_common()),
        **({"sent": sum(monitor.wire.values()), "sent_per_shard_task": sum(monitor.wire.values()) / shards,
            "sent_by_key": dict(monitor.wire.most_common()), "in_scripts_by_key": dict(monitor.scripted.most_common())}
           if monitor else {})}, fig)


if __name__ == "__main__":
    main()
