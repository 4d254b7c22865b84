"""The link's parts without a store: the token bucket on a clock of the test's own, the
average of measurements, data caps and their periods, and how a machine's links read."""

from __future__ import annotations

import datetime

import pytest

from tensorturn.errors import SpecError
from tensorturn.pool.owner import OwnerRules, Readings, why_paused
from tensorturn.runs.records import link_summary
from tensorturn.state.budget import GB, DataCap, parse_cap, period_of
from tensorturn.store.links import MEASURE_MIN_BYTES, Ewma, Meter, Sample, TokenBucket


class Clock:
    """A clock that moves only when the bucket sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_the_bucket_holds_its_rate_over_a_transfer_in_pieces_of_any_size():
    clock = Clock()
    bucket = TokenBucket(1_000_000, clock=clock, sleep=clock.sleep)  # 8 Mbit/s
    start = clock.t
    for n in [1 << 20] * 50 + [12345, 3, 700_000]:
        bucket.take(n)
    moved = 50 * (1 << 20) + 12345 + 3 + 700_000
    # at most one burst ahead of the rate, never more
    assert clock.t - start == pytest.approx((moved - bucket.burst) / 1_000_000)
    assert moved / (clock.t - start) <= 1_000_000 * 1.0005


def test_the_bucket_lets_a_burst_go_at_once_then_waits_for_its_debt():
    clock = Clock()
    bucket = TokenBucket(1_000_000, clock=clock, sleep=clock.sleep)
    assert bucket.take(int(bucket.burst)) == 0.0  # a full bucket
    assert bucket.take(500_000) == pytest.approx(0.5)  # then at the rate
    clock.t += 10  # idle: the bucket fills up to its burst, not more
    assert bucket.take(int(bucket.burst)) == 0.0
    assert bucket.take(100_000) == pytest.approx(0.1)


def test_a_bucket_without_a_rate_passes_everything_and_a_new_rate_holds_at_once():
    clock = Clock()
    bucket = TokenBucket(0, clock=clock, sleep=clock.sleep)
    assert bucket.take(10 ** 9) == 0.0 and clock.slept == []
    bucket.set_rate(2_000_000)
    bucket.take(int(bucket.burst))
    assert bucket.take(2_000_000) == pytest.approx(1.0)
    bucket.set_rate(0)
    assert bucket.take(10 ** 9) == 0.0


def test_the_average_weighs_the_newest_measurement_and_says_none_before_one():
    avg = Ewma(alpha=0.5)
    assert avg.value is None
    assert avg.add(10.0) == 10.0
    assert avg.add(20.0) == 15.0


def test_only_transfers_of_a_megabyte_or_more_are_measurements():
    meter, heard = Meter(), []
    meter.on_sample = heard.append
    meter.add(Sample("up", MEASURE_MIN_BYTES - 1, 0.001))
    assert meter.rate("up") is None and heard == []  # not measured: never made up
    meter.add(Sample("up", 4 * MEASURE_MIN_BYTES, 2.0))
    assert meter.rate("up") == pytest.approx(2 * MEASURE_MIN_BYTES) and meter.rate("down") is None
    assert heard == [Sample("up", 4 * MEASURE_MIN_BYTES, 2.0)]


@pytest.mark.parametrize("text,cap", [("200/month", DataCap(200, "month")), ("50/week", DataCap(50, "week")),
                                      ("0.5/day", DataCap(0.5, "day")), (" 10 GB / Day ", DataCap(10, "day"))])
def test_a_data_cap_is_gigabytes_per_period(text, cap):
    assert parse_cap(text) == cap
    assert parse_cap(text).bytes == int(cap.gb * GB)


@pytest.mark.parametrize("bad", ["200", "200/year", "month", "-5/day", "0/day", "abc/week", "", "200/month/2"])
def test_a_data_cap_written_wrong_is_one_clear_error(bad):
    with pytest.raises(SpecError, match=r"a data cap is GB per day, week or month, more than 0, e\.g\. 200/month"):
        parse_cap(bad)
    with pytest.raises(SpecError):
        OwnerRules(data_cap=bad or "x")


def test_periods_are_the_local_calendars_day_iso_week_and_month():
    when = datetime.datetime(2026, 12, 7, 23, 59)
    assert period_of("day", when) == "2026-12-07"
    assert period_of("week", when) == "2026-W50"
    assert period_of("week", datetime.datetime(2027, 1, 1)) == "2026-W53"  # ISO: the week of its Thursday
    assert period_of("month", when) == "2026-12"


def test_past_its_data_cap_the_agent_pauses_and_caps_go_through_json():
    rules = OwnerRules(max_upload_mbit=20, max_download_mbit=100, data_cap="1/day")
    assert OwnerRules.from_json(rules.to_json()) == rules
    assert rules.cap_up_bps == 2_500_000 and rules.cap_down_bps == 12_500_000
    now = datetime.time(12)
    assert why_paused(rules, Readings(local_time=now, data_used=GB - 1)) is None
    assert why_paused(rules, Readings(local_time=now, data_used=GB)) == "data cap (1 GB/day)"
    assert why_paused(rules, Readings(local_time=now)) is None  # not read: no pause made up
    assert "upload ≤ 20 Mbit/s" in rules.describe() and "pause past 1 GB/day" in rules.describe()
    with pytest.raises(SpecError, match="upload cap"):
        OwnerRules(max_upload_mbit=-1)


def test_a_machines_links_read_as_measured_against_capped_and_never_made_up():
    w = {"link_up_bps": 2_275_000.0, "link_down_bps": None, "cap_up_bps": 2_500_000.0, "cap_down_bps": 0.0,
         "broker_rtt_s": 0.0412, "link_stale": False, "data_cap_bytes": 200 * GB, "data_cap_period": "month",
         "data_used_bytes": 12_300_000_000}
    assert link_summary(w) == "up 18.2/20 down not measured Mbit/s, rtt 41 ms, data 12.3/200 GB this month"
    bare = {"link_up_bps": None, "link_down_bps": None, "broker_rtt_s": None, "link_stale": False}
    assert link_summary(bare) == "up not measured down not measured Mbit/s, rtt not measured"
    assert "(stale)" in link_summary({**w, "link_stale": True})


def test_a_probes_figure_is_its_largest_objects_rate_never_a_made_up_one():
    from tensorturn.store.links import largest_rate

    assert largest_rate([]) is None
    # per request 0.1 s whatever the size: the largest object says the most of the link
    assert largest_rate([(256_000, 0.2), (512_000, 0.3), (1_024_000, 0.5)]) == pytest.approx(2_048_000)
    # the first object of a size may have had the bucket's burst: the last of equals counts
    assert largest_rate([(256_000, 0.9), (256_000, 1.0)]) == pytest.approx(256_000)
