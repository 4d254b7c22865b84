"""Emulated home links, for tests and benchmarks: each agent in its own network namespace.

Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable` says why not, for a clear skip.

* **Topology.** Agent i runs in namespace ``tt<tag>a<i>``, joined to the coordinator's (the root
  namespace) by a veth pair: ``10.77.<i>.1`` on the coordinator's side, ``10.77.<i>.2`` on the
  agent's. The agent reaches Redis and the store only by connecting out to ``10.77.<i>.1`` — as a
  machine behind a home router's NAT does; nothing connects in to it.
* **Rates.** ``tc`` token-bucket filters (``tbf``) on each end of the pair: the agent's side
  shapes its uplink, the coordinator's side its downlink (say 20 / 100 Mbit/s).
* **Latency.** This kernel has no ``netem``, so a small user-space proxy (:class:`DelayProxy`, in
  the coordinator's namespace) sits between each link and Redis / the store and holds every chunk
  of bytes ``rtt / 2`` in each direction, in order, without limiting throughput.
* **Partitions.** :meth:`Link.down` takes the coordinator's end of the pair down: the agent's
  packets go nowhere and its process keeps running, as when a home link drops; :meth:`Link.up`
  heals it.
* **Bytes on the wire.** :meth:`Link.counters` reads the interface's own counters (headers and
  retransmissions included), to check TensorTurn's own accounting against.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorturn.config import Settings
from tensorturn.pool.embedded import LocalPool

_indexes = itertools.count(1)


def sh(*args: str, ns: str | None = None) -> str:
    """Run an ``ip``/``tc`` command (inside namespace ``ns``); its stderr on failure."""
    argv = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why links cannot be emulated here (None when they can)."""
    if os.geteuid() != 0:
        return "emulated links need root (network namespaces, tc)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "emulated links need iproute2 (`ip`, `tc`)"
    probe = f"ttprobe{os.getpid()}"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "netns", "del", probe)
    except RuntimeError as exc:
        return f"network namespaces are not available here ({exc})"
    return None


@dataclass
class Link:
    """One agent's link: a namespace, a veth pair, optional rate limits."""

    index: int
    tag: str

    @property
    def ns(self) -> str:
        return f"tt{self.tag}a{self.index}"

    @property
    def host_if(self) -> str:
        return f"tt{self.tag}h{self.index}"   # the coordinator's end (interface names ≤ 15 bytes)

    @property
    def agent_if(self) -> str:
        return f"tt{self.tag}g{self.index}"

    @property
    def host_ip(self) -> str:
        return f"10.77.{self.index}.1"

    @property
    def agent_ip(self) -> str:
        return f"10.77.{self.index}.2"

    def create(self) -> "Link":
        """Make the namespace and the veth pair; a step that fails removes what the others made."""
        try:
            sh("ip", "netns", "add", self.ns)
            sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.agent_if)
            sh("ip", "link", "set", self.agent_if, "netns", self.ns)
            sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            sh("ip", "link", "set", self.host_if, "up")
            sh("ip", "addr", "add", f"{self.agent_ip}/24", "dev", self.agent_if, ns=self.ns)
            sh("ip", "link", "set", self.agent_if, "up", ns=self.ns)
            sh("ip", "link", "set", "lo", "up", ns=self.ns)
        except BaseException:
            self.destroy()
            raise
        return self

    def shape(self, up_mbit: float | None = None, down_mbit: float | None = None) -> None:
        """Token-bucket rate limits: the agent's uplink and downlink, in Mbit/s (None: none)."""
        for rate, dev, ns in ((up_mbit, self.agent_if, self.ns), (down_mbit, self.host_if, None)):
            if rate is None:
                continue
            # a burst of ~4 ms at the rate (at least 16 KB), a queue of 100 ms: a home router's
            burst = max(16 * 1024, int(rate * 1e6 / 8 * 0.004))
            sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}mbit",
               "burst", str(burst), "latency", "100ms", ns=ns)

    def route(self) -> None:
        """Let this agent reach the other agents' namespaces through the coordinator's (as a
        VPN relay would): for peer-to-peer baselines such as a per-step all-reduce. Traffic to
        a peer crosses both links: this one's uplink, the peer's downlink."""
        with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
            f.write("1")
        sh("ip", "route", "replace", "default", "via", self.host_ip, ns=self.ns)

    def down(self) -> None:
        sh("ip", "link", "set", self.host_if, "down")

    def up(self) -> None:
        sh("ip", "link", "set", self.host_if, "up")

    def counters(self) -> tuple[int, int]:
        """(bytes up, bytes down) on the wire so far: what the coordinator's end received and
        sent, headers and retransmissions included."""
        stats = Path("/sys/class/net") / self.host_if / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def destroy(self) -> None:
        for argv in (("ip", "netns", "del", self.ns), ("ip", "link", "del", self.host_if)):
            subprocess.run(argv, capture_output=True)


class DelayProxy:
    """TCP forwarders that hold every chunk ``delay_s`` in each direction (latency without
    ``netem``), on an event loop in a thread of their own. ``moved[listen]`` counts the payload
    bytes each forwarder carried: [towards its target, back]."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.servers: list[Any] = []
        self.moved: dict[tuple[str, int], list[int]] = {}
        self.thread = threading.Thread(target=self.loop.run_forever, name="delay-proxy", daemon=True)
        self.thread.start()

    def forward(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
        asyncio.run_coroutine_threadsafe(self._serve(listen, target, delay_s), self.loop).result(10)

    async def _serve(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
        counts = self.moved.setdefault(listen, [0, 0])

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(*target)
            except OSError:
                writer.close()
                return
            try:
                await asyncio.gather(self._pump(reader, up_writer, delay_s, counts, 0),
                                     self._pump(up_reader, writer, delay_s, counts, 1))
            except asyncio.CancelledError:  # the proxy closes: the connection ends with it
                writer.close()
                up_writer.close()

        self.servers.append(await asyncio.start_server(handle, *listen))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    delay_s: float, counts: list[int], way: int) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            while True:
                try:
                    data = await reader.read(65536)
                except OSError:
                    data = b""
                queue.put_nowait((self.loop.time() + delay_s, data))
                if not data:
                    return

        async def write() -> None:
            try:
                while True:
                    due, data = await queue.get()
                    wait = due - self.loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if not data:
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    writer.write(data)
                    counts[way] += len(data)
                    await writer.drain()
            except OSError:
                writer.close()

        await asyncio.gather(read(), write())

    def close(self) -> None:
        async def stop() -> None:
            for server in self.servers:
                server.close()
            # the connections' pumps end with the loop: cancelled and awaited, not left pending
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class LinkPool(LocalPool):
    """An embedded pool whose agents each sit behind an emulated link (:class:`Link`): Redis and
    an S3 endpoint (``store_env``: the ``AWS_*`` variables of, say, moto's server on loopback) are
    reached through a :class:`DelayProxy` on the coordinator's end of each link. With
    ``outer_agent`` one more agent, ``--role outer``, runs on the coordinator itself (no link),
    beside the store, as `tensorturn agent --role outer` would on a user's coordinator."""

    def __init__(self, workers: int, store_url: str, store_env: dict[str, str], rtt_ms: float = 0.0,
                 up_mbit: float | None = None, down_mbit: float | None = None,
                 workdir: Path | None = None, loglevel: str = "WARNING", outer_agent: bool = False,
                 allow: tuple[str, ...] = (), link_rates: list[tuple[float, float]] | None = None,
                 agent_env: list[dict[str, str]] | None = None):
        super().__init__(workers + outer_agent, store_url, workdir=workdir, loglevel=loglevel,
                         roles=["train"] * workers + ["outer"] * outer_agent, allow=allow)
        self.trainers = workers
        self.store_env, self.rtt_ms = store_env, rtt_ms
        self.up_mbit, self.down_mbit = up_mbit, down_mbit
        # per trainer: its link's (up, down) Mbit/s, and variables of its own (a machine of its own
        # speed: ``TESTBED_SIM_STEP_S``); else every link at up_mbit/down_mbit, the same environment
        self.link_rates, self.own_env = link_rates, agent_env or []
        self.tag = f"{os.getpid() % 1000}{next(_indexes) % 100}"
        self.links: list[Link] = []
        self.proxy: DelayProxy | None = None

    def start(self, timeout: float = 90) -> None:
        from urllib.parse import urlsplit

        self.redis.start()
        self.proxy = DelayProxy()
        s3 = urlsplit(self.store_env["AWS_ENDPOINT_URL"])
        self.s3_target = (s3.hostname or "127.0.0.1", s3.port or 80)
        for i in range(self.workers):
            if i < self.trainers:
                self.add_link(i)
            self.start_agent(i)
        self.wait_ready(timeout)

    def add_link(self, i: int) -> Link:
        assert self.proxy is not None
        link = Link(next(_indexes) % 250 + 1, self.tag).create()
        self.links.append(link)
        up, down = self.link_rates[i] if self.link_rates else (self.up_mbit, self.down_mbit)
        link.shape(up, down)
        delay = self.rtt_ms / 2000
        self.proxy.forward((link.host_ip, self.redis.port), ("127.0.0.1", self.redis.port), delay)
        self.proxy.forward((link.host_ip, self.s3_target[1]), self.s3_target, delay)
        return link

    def carried(self, what: str) -> tuple[int, int]:
        """Payload bytes the links' proxies carried to ``what`` (``redis`` or ``store``) and
        back, summed over the links."""
        assert self.proxy is not None
        port = self.redis.port if what == "redis" else self.s3_target[1]
        counts = [self.proxy.moved.get((link.host_ip, port), [0, 0]) for link in self.links]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def agent_settings(self, i: int) -> Settings:
        if i >= self.trainers:  # the coordinator's own agent: no link
            return super().agent_settings(i)
        link = self.links[i]
        return super().agent_settings(i).with_(
            broker_url=f"redis://default:{self.redis.password}@{link.host_ip}:{self.redis.port}/0")

    def agent_environ(self, i: int) -> dict[str, str]:
        if i >= self.trainers:
            return {**os.environ, **self.store_env}
        link = self.links[i]
        own = self.own_env[i] if i < len(self.own_env) else {}
        return {**os.environ, **self.store_env, **own,
                "AWS_ENDPOINT_URL": f"http://{link.host_ip}:{self.s3_target[1]}"}

    def agent_argv(self, i: int) -> list[str]:
        if i >= self.trainers:
            return super().agent_argv(i)
        return ["ip", "netns", "exec", self.links[i].ns, *super().agent_argv(i)]

    def stop(self, grace: float = 30.0) -> None:
        for link in self.links:  # a partitioned agent cannot shut down
            subprocess.run(["ip", "link", "set", link.host_if, "up"], capture_output=True)
        try:
            super().stop(grace)
        finally:
            if self.proxy is not None:
                self.proxy.close()
            for link in self.links:
                link.destroy()
