"""The household's caps on a real store: a 100 MB transfer under an owner's cap, on a folder and
on a real S3 endpoint (moto), is timed — its rate is a measurement, and a cap can only be
undershot by a loaded machine, so only the upper bound is asserted — and the agent's own
figure (its average of timed transfers) says the same. The data budget counts on a real
redis-server; the probe measures within its bounds; a bad cap is one clear line."""

from __future__ import annotations

import time

import pytest
import redis
from conftest import clean_env, tt

from tensorturn.state.budget import Budget
from tensorturn.state.traffic import Traffic
from tensorturn.store import links
from tensorturn.store.links import PROBE_BYTES, meter, probe
from tensorturn.store.objects import ObjectMissing, open_store

MB = 1_000_000
SIZE = 100 * MB
CAP_MBIT = 400.0            # 50 MB/s: 100 MB in about 2 s
CAP = CAP_MBIT * links.MBIT


@pytest.fixture
def capped():
    """This process's store transfers capped at CAP both ways, its measurements afresh."""
    fresh = links.Meter()
    saved = links.meter.__dict__.copy()
    meter.__dict__.update(fresh.__dict__)
    meter.set_caps(CAP, CAP)
    yield meter
    meter.__dict__.update(saved)


@pytest.fixture
def payload(tmp_path):
    path = tmp_path / "payload"
    with open(path, "wb") as f:
        for _ in range(SIZE // MB):
            f.write(bytes(range(256)) * (MB // 256) + bytes(MB % 256))
    return path


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def check_capped(seconds: float, what: str) -> None:
    rate = SIZE / seconds
    print(f"{what}: {rate * 8 / 1e6:.1f} Mbit/s under a cap of {CAP_MBIT:g} ({seconds:.2f} s for 100 MB)")
    assert rate <= CAP * 1.05, f"{what}: {rate * 8 / 1e6:.1f} Mbit/s over a cap of {CAP_MBIT:g}"


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_100_mb_transfer_keeps_to_the_owners_cap_both_ways(kind, capped, payload, tmp_path, request):
    if kind == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        store = open_store(f"s3://{bucket}/capped")
    else:
        store = open_store((tmp_path / "store").as_uri())
    check_capped(timed(lambda: store.put_file("big", payload)), f"{kind} put_file")
    assert capped.rate("up") is not None and capped.rate("up") <= CAP * 1.05  # the agent's figure agrees
    check_capped(timed(lambda: store.get_file("big", tmp_path / "back")), f"{kind} get_file")
    assert capped.rate("down") is not None and capped.rate("down") <= CAP * 1.05
    assert (tmp_path / "back").stat().st_size == SIZE
    data = payload.read_bytes()
    check_capped(timed(lambda: store.put_bytes("bytes", data)), f"{kind} put_bytes")
    check_capped(timed(lambda: store.get_bytes("bytes")), f"{kind} get_bytes")
    with pytest.raises(ObjectMissing):  # a missing object is one, capped or not
        store.get_bytes("none")


def test_the_start_probe_measures_within_its_bounds_and_leaves_nothing(tmp_path, capped):
    store = open_store((tmp_path / "store").as_uri())
    done = probe(store, "agent@host")
    assert done.up_bps is not None and done.down_bps is not None
    assert 0 < done.nbytes <= 2 * PROBE_BYTES  # at most 4 MB each way
    assert store.list("") == []  # its objects are gone
    assert meter.rate("up") == pytest.approx(done.up_bps)  # the agent's figure starts from it
    meter.set_caps(256 * 1024, 256 * 1024)  # 2 Mbit/s: the time bound ends it, after about 2 s of bytes
    slow = probe(store, "agent@host")
    print(f"probe at a 2.1 Mbit/s cap: {slow.up_bps * 8 / 1e6:.2f} up, {slow.down_bps * 8 / 1e6:.2f} down, "
          f"{slow.nbytes} bytes")
    assert slow.up_bps is not None and slow.up_bps <= 256 * 1024 * 1.05
    assert slow.down_bps is not None and slow.down_bps <= 256 * 1024 * 1.05
    assert slow.nbytes < PROBE_BYTES


def test_every_attempts_store_bytes_count_against_its_machines_data_budget(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    traffic, budget = Traffic(r), Budget(r)
    traffic.add_store_bytes("run1", 3 * MB, 2 * MB, "pc@home")
    traffic.add_store_bytes("run2", MB, 0, "pc@home")
    assert [budget.used("pc@home", p) for p in ("day", "week", "month")] == [6 * MB] * 3
    assert budget.used("laptop@home", "month") == 0
    assert all(0 < r.ttl(k) <= 32 * 86400 for k in r.scan_iter("tt:data:*"))


def test_a_bad_data_cap_or_link_cap_stops_the_agent_at_once_in_one_line():
    """Before it connects or imports torch: one line, exit 2, nothing started."""
    for flags, env, says in ((["--data-cap-gb", "lots"], None, "a data cap is GB per day, week or month"),
                             (["--data-cap-gb", "200/year"], None, "e.g. 200/month (got '200/year')"),
                             ([], clean_env(TENSORTURN_DATA_CAP_GB="5"), "(got '5')"),
                             ([], clean_env(TENSORTURN_MAX_UPLOAD_MBIT="-3"), "TENSORTURN_MAX_UPLOAD_MBIT must be")):
        out = tt("agent", "--broker", "redis://127.0.0.1:1/0", *flags, env=env)
        assert out.returncode == 2 and says in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_plan_reads_each_machines_effective_rates_and_never_a_made_up_one(redis_server, monkeypatch):
    """What a run's plan reads (:func:`tensorturn.state.roster.links`) from signed heartbeats:
    None where neither a measurement nor a cap is known, the cap alone before a measurement,
    the smaller of the two after one, and a measurement ten minutes old said to be stale."""
    from tensorturn.pool import owner
    from tensorturn.pool.owner import OwnerRules
    from tensorturn.pool.telemetry import Heartbeat, inventory
    from tensorturn.state.broker import redis_client
    from tensorturn.state.clock import broker_now
    from tensorturn.state.roster import links

    inventory()  # (torch imported before the first beat: its time is not the heartbeat's)
    r = redis_client(redis_server.url)
    hb = Heartbeat.__new__(Heartbeat)  # the agent's heartbeat step, without a worker around it
    hb.client, hb.node, hb.tref, hb.outer = r, "pc@home", None, []
    hb.beat(first=True)
    bare = links(r)["pc@home"]
    assert bare["up_bps"] is None and bare["down_bps"] is None and not bare["measured"]
    assert bare["rtt_s"] is not None and bare["rtt_s"] > 0  # the broker's round trip is measured at once
    monkeypatch.setattr(owner.standing, "rules", OwnerRules(max_upload_mbit=20))
    hb.beat()
    assert links(r)["pc@home"]["up_bps"] == 2_500_000 and links(r)["pc@home"]["down_bps"] is None
    Workers = type(hb.workers)
    Workers(r).link_sample("pc@home", "up", 4 * MB, 2.0)     # a pool process's timed transfers
    Workers(r).link_sample("pc@home", "down", 30 * MB, 1.0)
    hb.beat()  # takes them
    hb.beat()  # says them
    now = broker_now(r)
    seen = links(r, now=now)["pc@home"]
    assert seen["up_bps"] == 2 * MB and seen["down_bps"] == 30 * MB and seen["measured"] and not seen["stale"]
    hb.links.measured_at = now - 601  # its last transfer of a megabyte or more, ten minutes ago
    hb.beat()
    old = links(r)["pc@home"]
    assert old["stale"] and old["up_bps"] == 2 * MB  # its figure still given, said to be old


def test_a_task_takes_its_owners_caps_from_its_agents_heartbeat(redis_server, capped):
    """A pool process is not the process that reads the owner's rules: it takes the caps its
    agent's heartbeat says in the round trips it makes anyway (the attempt's first look, each
    progress report)."""
    from tensorturn.state.board import RunBoard
    from tensorturn.state.broker import redis_client
    from tensorturn.state.workers import Workers

    r = redis_client(redis_server.url)
    r.hset("tt:worker:pc@home", mapping={"cap_up_bps": "2500000", "cap_down_bps": "0"})
    RunBoard(r).state_and_standing("some-run", "pc@home")
    assert meter.cap("up") == 2_500_000 and meter.cap("down") == 0
    r.hset("tt:worker:pc@home", mapping={"cap_up_bps": "1250000", "cap_down_bps": "12500000"})
    Workers(r).report("pc@home", "r0/shard-0", {"step": 1})
    assert meter.cap("up") == 1_250_000 and meter.cap("down") == 12_500_000
