"""The fused plan's math (tensorturn/modes/fused/plan.py): a round's predicted time per policy, and
what --plan auto chooses from the links, step times and the data — the figures of BENCHMARKS
§13b (gpt2-small, 85.5M values, 3 trainers, 20/100 Mbit/s, 40 ms) as the case it must get right."""

from __future__ import annotations

import pytest

from tensorturn.modes.fused.plan import (
    BYTES_PER_VALUE,
    MAX_PLANNED_SYNC_EVERY,
    TARGET_UTILISATION,
    Bounds,
    Given,
    Machine,
    OuterSide,
    choose,
    codec_pairs,
    fitted_shards,
    outer_units,
    predict,
)

GPT2_SMALL = 85_500_000  # float values
MBIT = 1e6 / 8           # bytes/s in a Mbit/s
BOUNDS = Bounds(shards=3, sync_every=25, max_sync_every=351)  # gpt2-small's built-in corpus, 3 shards


def home(step_s: float = 1.0, n: int = 3) -> list[Machine]:
    """Trainers behind 20/100 Mbit/s links with a 40 ms round trip, as §13b emulates them."""
    return [Machine(f"w{i}", step_s, 20 * MBIT, 100 * MBIT, 0.04) for i in range(n)]


def loopback(n: int = 3) -> list[Machine]:
    return [Machine(f"w{i}") for i in range(n)]  # nothing measured: taken as loopback


def test_the_round_model_predicts_the_measured_blocking_rows_within_ten_percent():
    """§13b: fp32 blocking rounds, 1.5 s steps — 0.165 steady at H = 25 (issue 49's figure), 0.330
    at H = 64 (Table 1); ternary blocking at H = 40 of 2.5 s steps, 0.658 (its outer step ran on
    cores the trainers shared: the model's 0.70 is the figure for a coordinator of its own)."""
    for h, step, codec, measured, tolerance in [(25, 1.5, "fp32", 0.165, 0.1), (64, 1.5, "fp32", 0.330, 0.1),
                                                (40, 2.5, "ternary", 0.658, 0.1)]:
        p = predict(GPT2_SMALL, home(step), step, 3, h, "rounds", codec, codec, outer_beside_store=True)
        assert abs(p.utilisation - measured) <= tolerance * measured, (h, codec, p)


def test_overlapped_rounds_hide_the_transfers_that_fit_under_a_rounds_compute():
    blocking = predict(GPT2_SMALL, home(), 1.0, 3, 100, "rounds", "ternary", "int2", True)
    overlapped = predict(GPT2_SMALL, home(), 1.0, 3, 100, "overlap", "ternary", "int2", True)
    assert overlapped.utilisation > blocking.utilisation
    assert overlapped.utilisation >= TARGET_UTILISATION
    assert overlapped.bytes_per_round == blocking.bytes_per_round  # the same bytes, hidden


def test_beside_the_store_a_round_lasts_at_least_the_step_and_the_evaluation():
    """The agent beside the store takes every round's outer step and evaluation, one after the
    other: where the two outlast the round's compute, the round is theirs (the speed-up
    benchmark's home run: 30–38 s steps and 27–32 s evaluations, rounds of 65 s where the plan
    without the evaluation said 55 s), and the plan takes a larger H to reach its target."""
    side = OuterSide(None, eval_s=40.0)
    without = predict(GPT2_SMALL, home(), 1.0, 3, 25, "overlap", "ternary", "int8", True)
    evaluated = predict(GPT2_SMALL, home(), 1.0, 3, 25, "overlap", "ternary", "int8", True, side)
    on_trainers = predict(GPT2_SMALL, home(), 1.0, 3, 25, "overlap", "ternary", "int8", False, side)
    assert evaluated.round_s > without.round_s and evaluated.utilisation < without.utilisation
    assert on_trainers.round_s == predict(GPT2_SMALL, home(), 1.0, 3, 25, "overlap", "ternary", "int8",
                                          False).round_s  # a trainer's queue takes it: not this chain
    plain = choose(GPT2_SMALL, home(), 1.0, BOUNDS, Given(), True)
    with_eval = choose(GPT2_SMALL, home(), 1.0, BOUNDS, Given(), True, outer=side)
    assert with_eval.sync_every > plain.sync_every
    assert with_eval.predicted_utilisation >= TARGET_UTILISATION


def test_the_outer_steps_measured_rate_is_the_plans():
    """An agent beside the store publishes its outer step's seconds a unit of work; where its
    step is 3× slower than the model's (its cores shared with trainers, say), the chain of an
    overlapped round outlasts its compute sooner, and the plan takes a larger H to hide it."""
    assert outer_units(100, 3, "ternary", "int2") > outer_units(100, 3, "ternary", "int8") > \
        outer_units(100, 3, "ternary", "fp32") > outer_units(100, 3, "fp32", "fp32") == 400
    model = predict(GPT2_SMALL, home(), 1.0, 3, 40, "overlap", "ternary", "int4", True)
    slow = predict(GPT2_SMALL, home(), 1.0, 3, 40, "overlap", "ternary", "int4", True, OuterSide(1.2e-7))
    assert slow.round_s > model.round_s and slow.utilisation < model.utilisation
    fast_plan = choose(GPT2_SMALL, home(), 1.0, BOUNDS, Given(), True)
    slow_plan = choose(GPT2_SMALL, home(), 1.0, BOUNDS, Given(), True, outer=OuterSide(1.2e-7))
    assert slow_plan.sync_every > fast_plan.sync_every
    assert slow_plan.predicted_utilisation >= TARGET_UTILISATION


def test_more_shards_than_machines_train_in_waves():
    one = predict(GPT2_SMALL, loopback(3), 1.0, 3, 25, "rounds", "fp32", "fp32", True)
    two = predict(GPT2_SMALL, loopback(3), 1.0, 6, 25, "rounds", "fp32", "fp32", True)
    assert two.round_s > 1.9 * 25 and one.round_s < 2 * 25 + 1


def test_outer_steps_on_a_trainer_cost_its_uplink():
    beside = predict(GPT2_SMALL, home(), 1.0, 3, 100, "rounds", "int8", "int8", True)
    trainer = predict(GPT2_SMALL, home(), 1.0, 3, 100, "rounds", "int8", "int8", False)
    assert trainer.round_s > beside.round_s + 100  # θ, momentum and broadcast up at 20 Mbit/s
    assert trainer.bytes_per_round > beside.bytes_per_round


def test_on_capped_home_links_gpt2_small_gets_a_compressed_codec_and_overlapped_rounds():
    plan = choose(GPT2_SMALL, home(), 1.0, BOUNDS, Given(), outer_beside_store=True)
    assert plan.codec != "fp32" and plan.sync == "overlap"
    assert plan.predicted_utilisation >= TARGET_UTILISATION
    assert BOUNDS.sync_every <= plan.sync_every <= MAX_PLANNED_SYNC_EVERY
    assert plan.outer_role == "store"
    # H is the smallest that reaches the target with those codecs
    less = predict(GPT2_SMALL, home(), 1.0, 3, plan.sync_every - 1, plan.sync, plan.codec,
                   plan.broadcast_codec, True)
    assert less.utilisation < TARGET_UTILISATION
    assert any(w.startswith("sync overlap") for w in plan.why)
    assert any(w.startswith(f"codec {plan.codec} up") for w in plan.why)


def test_on_loopback_the_plan_keeps_whole_precision_and_blocking_rounds():
    plan = choose(GPT2_SMALL, loopback(), 1.0, BOUNDS, Given(), outer_beside_store=True)
    assert plan.codec in ("fp32", "int8") and plan.broadcast_codec in ("fp32", "int8")
    assert plan.sync == "rounds"
    assert any("too little to be worth hiding" in w for w in plan.why)


def test_shards_left_to_the_data_fill_whole_waves_on_the_machines():
    """2 shards (gpt2-small's built-in corpus) on 3 machines would leave one idle every round."""
    data = Bounds(2, 25, 351, rows_per_step=1406 / 8)
    plan = choose(GPT2_SMALL, home(), 1.0, data, Given(), outer_beside_store=True)
    assert plan.shards == 3 and plan.predicted_utilisation >= TARGET_UTILISATION
    assert any(w.startswith("shards 3, not the data's 2") for w in plan.why)
    fixed = choose(GPT2_SMALL, home(), 1.0, Bounds(2, 25, 351), Given(), outer_beside_store=True)
    assert fixed.shards == 2 and fixed.predicted_utilisation <= 2 / 3


def test_two_waves_carry_twice_the_bytes_over_each_link():
    """Overlapped, a round still moves each of a machine's tasks' update over its link: 6 shards
    on 3 machines upload two updates a machine a round (fp32 at 20 Mbit/s: 2 × 137 s), which no
    overlap hides behind 2 × 60 s of compute."""
    one = predict(GPT2_SMALL, home(), 1.0, 3, 60, "overlap", "fp32", "fp32", True)
    two = predict(GPT2_SMALL, home(), 1.0, 6, 60, "overlap", "fp32", "fp32", True)
    upload = GPT2_SMALL * 4 / (20 * MBIT)
    assert two.round_s >= 2 * upload > one.round_s
    same_compute = predict(GPT2_SMALL, home(), 1.0, 3, 120, "overlap", "fp32", "fp32", True)
    assert same_compute.utilisation > two.utilisation


def test_where_the_links_set_the_pace_one_wave_a_round():
    """The data's 8 shards on 3 machines over home links: one shard a machine (each shard's
    update crosses the links once a round), not two waves — where the links are fast the waves
    stay."""
    data = Bounds(8, 25, 400, rows_per_step=100_000)
    plan = choose(GPT2_SMALL, home(2.0), 2.0, data, Given(), outer_beside_store=True)
    assert plan.shards == 3 and plan.predicted_utilisation >= TARGET_UTILISATION
    assert any("the links set the pace" in w for w in plan.why)
    fast = choose(GPT2_SMALL, [Machine(f"w{i}", 2.0, 1e12, 1e12, 0.0005) for i in range(3)], 2.0, data,
                  Given(), outer_beside_store=True)
    assert fast.shards == 6


@pytest.mark.parametrize("shards, machines, most, fitted", [(2, 3, 8, 3), (8, 3, 8, 6), (4, 2, 8, 4),
                                                             (2, 12, 8, 12), (8, 1, 8, 8), (5, 4, 8, 4)])
def test_fitted_shards(shards, machines, most, fitted):
    assert fitted_shards(shards, machines, most) == fitted


def test_a_small_model_keeps_todays_defaults():
    """digits-mlp-sized: a round's compute is shorter than its fixed costs, so no H reaches the
    target; the data's H, fp32 and blocking rounds stay (every determinism test runs such runs)."""
    plan = choose(20_000, loopback(3), 0.002, Bounds(2, 25, 80, rows_per_step=1293 / 32), Given(),
                  outer_beside_store=False)
    assert (plan.codec, plan.broadcast_codec, plan.sync, plan.sync_every, plan.shards) == \
        ("fp32", "fp32", "rounds", 25, 2)


def test_what_the_user_gave_wins():
    given = Given(codec="fp32", sync="rounds", sync_every=30)
    plan = choose(GPT2_SMALL, home(), 1.0, BOUNDS, given, outer_beside_store=True)
    assert (plan.codec, plan.broadcast_codec, plan.sync, plan.sync_every) == ("fp32", "fp32", "rounds", 30)
    assert plan.predicted_utilisation < 0.5  # said, not changed
    down = choose(GPT2_SMALL, home(), 1.0, BOUNDS, Given(broadcast_codec="fp32"), True)
    assert down.broadcast_codec == "fp32" and down.codec != "fp32"


def test_codec_pairs_go_from_the_most_faithful_to_the_smallest():
    pairs = codec_pairs(Given())
    assert pairs[0] == ("fp32", "fp32") and pairs[-1] == ("ternary", "int2")
    assert pairs.index(("int8", "int8")) < pairs.index(("int4", "fp32"))
    assert codec_pairs(Given(codec="int4")) == [("int4", "int4")]  # --codec alone: the broadcast's too


@pytest.mark.parametrize("codec", sorted(BYTES_PER_VALUE))
def test_the_plans_bytes_per_value_are_the_stores(codec):
    torch = pytest.importorskip("torch")
    from tensorturn.store.tensors import part_specs

    n = 1 << 20
    parts = part_specs("w", [n], codec)
    size = sum(torch.empty(0, dtype=dtype).element_size() * int(torch.tensor(shape).prod())
               for dtype, shape in parts.values())
    assert size / n == pytest.approx(BYTES_PER_VALUE[codec], rel=1e-3)


def test_when_nothing_reaches_the_target_the_most_h_and_a_faithful_pair_near_the_best():
    """A 5 Mbit/s uplink: no codec reaches 0.9 by H = 100; the plan says so and takes H = 100."""
    slow = [Machine(f"w{i}", 1.0, 5 * MBIT, 100 * MBIT, 0.04) for i in range(3)]
    plan = choose(GPT2_SMALL, slow, 1.0, BOUNDS, Given(), outer_beside_store=False)
    assert plan.sync_every == MAX_PLANNED_SYNC_EVERY and plan.predicted_utilisation < TARGET_UTILISATION
    assert any("no H up to 100 reaches" in w for w in plan.why)
    best = max(predict(GPT2_SMALL, slow, 1.0, 3, 100, plan.sync, u, d, False).utilisation
               for u, d in codec_pairs(Given()))
    assert plan.predicted_utilisation >= 0.9 * best


def test_where_more_h_buys_little_utilisation_the_plan_keeps_h_small():
    """The speed-up benchmark's mixed pool as its agents measured it (steps of 2.47, 2.47 and
    6.33 s; one uplink at 2.1 Mbit/s): the slow machine bounds every H's utilisation below 0.5,
    so H = 100 would buy ≈ 0.05 of it for samples worth half (benchmarks §18). The plan weighs
    the two and keeps H near the data's."""
    from tensorturn.modes.fused.plan import sample_worth

    mixed = [Machine("a", 2.47, 2.1 * MBIT, 29 * MBIT, 0.08), Machine("b", 2.47, 7.6 * MBIT, 29 * MBIT, 0.08),
             Machine("c", 6.33, 7.6 * MBIT, 29 * MBIT, 0.08)]
    plan = choose(GPT2_SMALL, mixed, 2.47, BOUNDS, Given(), True)
    assert plan.predicted_utilisation < TARGET_UTILISATION and plan.sync_every < 40
    assert any("the most useful work a second" in w for w in plan.why)

    def useful(h: int) -> float:
        return predict(GPT2_SMALL, mixed, 2.47, 3, h, plan.sync, plan.codec, plan.broadcast_codec,
                       True).utilisation * sample_worth(h)
    assert useful(plan.sync_every) >= max(useful(h) for h in (25, 50, 75, 100))
    assert sample_worth(25) == 1.0 and sample_worth(99) == pytest.approx(0.5, abs=0.01)


def test_machines_of_very_different_speeds_take_the_mixed_speed_rule():
    from tensorturn.modes.fused.speeds import choose_for_speeds

    mixed = [Machine("fast", 1.0), Machine("slow", 4.0), Machine("slower", 4.0)]
    expected = choose_for_speeds([1.0, 4.0, 4.0], BOUNDS.shards)
    assert expected in ("backup", "async")
    plan = choose(GPT2_SMALL, mixed, 1.0, BOUNDS, Given(), True)
    assert plan.sync == expected and any("mixed-speed rule" in w for w in plan.why)
    # within the spread, the rule is not asked: equal machines plan as equal machines
    even = [Machine("a", 1.0), Machine("b", 1.5), Machine("c", 1.0)]
    assert choose(GPT2_SMALL, even, 1.0, BOUNDS, Given(), True).sync in ("rounds", "overlap")
    # steps of a few ms 3× apart (a small model's, timed on a busy machine): the slowest round
    # ends 8 ms after the fastest's, nothing to act on — rounds, as on equal machines
    noisy = [Machine("a", 0.001), Machine("b", 0.004), Machine("c", 0.001)]
    small = choose(20_000, noisy, 0.001, Bounds(2, 2, 80), Given(sync_every=2), True)
    assert small.sync == "rounds" and not any("mixed-speed rule" in w for w in small.why)
    # the 1:1:4 case of docs/benchmarks/mixed-speeds.md §12c (H 60 of 80 and 20 ms) still takes it
    pool = [Machine("a", 0.08), Machine("b", 0.08), Machine("c", 0.02)]
    assert any("mixed-speed rule" in w for w in choose(20_000, pool, 0.02, Bounds(3, 60, 80), Given(sync_every=60),
                                                        True).why)


def test_the_plan_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, tensorturn.modes.fused.options, tensorturn.modes.fused.plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
