"""The planner's rule for machines of different speeds (tensorturn.modes.fused.speeds): which sync
policy beats blocking rounds, from the machines' seconds per inner step alone."""

import math

import pytest

from tensorturn.modes.fused.speeds import async_wall, backup_wall, choose_for_speeds, rounds_wall


def test_machines_of_one_speed_keep_blocking_rounds():
    assert choose_for_speeds([0.02, 0.02, 0.02]) is None
    assert choose_for_speeds([0.02, 0.02, 0.02], shards=8) is None  # 8 on 3: rounds lose 1/9 only


def test_two_slow_machines_and_one_four_times_faster_run_asynchronously():
    """The 1:1:4 pool of docs/benchmarks/mixed-speeds.md §12c: backup copies are predicted at
    0.75 of the rounds' wall (measured 0.86–0.87×), async at 0.50 (measured 0.64–0.87×)."""
    step_s = [0.02, 0.02, 0.005]
    assert rounds_wall(step_s, 3) == pytest.approx(0.02)
    assert backup_wall(step_s, 3) / rounds_wall(step_s, 3) == pytest.approx(0.75)
    assert async_wall(step_s, 3) / rounds_wall(step_s, 3) == pytest.approx(0.5)
    assert choose_for_speeds(step_s) == "async"


def test_one_straggler_among_fast_machines_is_copied_with_the_same_result():
    """One machine 4× slower than two others: the fast pair trains the round's three shards in
    half the straggler's time, so backup copies (bit for bit the rounds' weights) suffice."""
    assert backup_wall([1.0, 1.0, 4.0], 3) / rounds_wall([1.0, 1.0, 4.0], 3) == pytest.approx(0.5)
    assert choose_for_speeds([1.0, 1.0, 4.0]) == "backup"
    assert choose_for_speeds([1.0, 1.0, 10.0]) == "backup"


def test_a_modest_spread_keeps_rounds():
    """One machine 2× faster than two others: copies cannot shorten a round (the fast machine's
    second shard ends when the slow ones do) and async's 0.75 is not worth its result."""
    assert choose_for_speeds([1.0, 1.0, 0.5]) is None
    assert choose_for_speeds([2.0, 1.0]) is None


def test_more_shards_than_machines_are_counted_as_the_free_machine_takes_them():
    # 1:1:4 speeds, 8 shards: the two fast machines take three each, then a fourth each while
    # the straggler trains its one: the round ends at 4 either way
    assert rounds_wall([1.0, 1.0, 4.0], 8) == pytest.approx(4.0)
    assert backup_wall([1.0, 1.0, 4.0], 8) == pytest.approx(4.0)
    assert choose_for_speeds([1.0, 1.0, 4.0], shards=8) is None


def test_one_machine_or_no_shard_has_nothing_to_choose():
    assert choose_for_speeds([0.5]) is None
    assert choose_for_speeds([]) is None
    assert choose_for_speeds([1.0, 2.0], shards=0) is None


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_step_time_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError, match="positive seconds"):
        choose_for_speeds([1.0, bad])
