"""Bounded options: every number a run takes has a ceiling a machine and the
broker can hold, in one table (``tensorturn.spec.LIMITS``) that ``--help`` shows; a value past it,
or a run whose options together are past what a pool can hold or finish, is refused in one line
before anything is queued."""

from __future__ import annotations

import click
import pytest
import redis
from conftest import tt

from tensorturn.cli import cli
from tensorturn.errors import SpecError
from tensorturn.modes import get_mode
from tensorturn.spec import LIMITS, MAX_MINIBATCHES, MAX_QUEUED, MAX_TASKS, RunSpec, flag

STORE = "file:///nowhere"
COMMANDS = ("run", "distill", "resume", "soup")


def numeric_flags() -> dict[str, str]:
    """Every number an option of a command that trains (or waits for training) takes:
    flag → the commands that have it."""
    found: dict[str, str] = {}
    for name in COMMANDS:
        for param in cli.commands[name].params:
            if isinstance(param, click.Option) and isinstance(param.type, (click.types.IntParamType,
                                                                           click.types.FloatParamType)):
                found.setdefault(param.opts[0], name)
    return found


def spec(mode: str = "fused", **values) -> RunSpec:
    return RunSpec.create(mode, "digits-mlp", STORE, **values).validate()


# ---- the table ------------------------------------------------------------------------------------

def test_every_numeric_option_has_a_bound_and_help_shows_it():
    flags = numeric_flags()
    assert {"--threads-per-task", "--shards", "--members", "--rounds", "--accumulate", "--top-k",
            "--local-workers", "--timeout"} <= set(flags)
    for option, command in flags.items():
        name = option[2:].replace("-", "_")
        assert name in LIMITS, f"{option} of `{command}` has no bound in LIMITS"
        param = next(p for p in cli.commands[command].params if p.opts[0] == option)
        assert f"[{LIMITS[name].shown()}]" in (param.help or ""), option


def test_the_mode_options_and_the_spec_take_nothing_the_table_misses():
    numeric = {"int", "float", "int | None", "float | None"}
    for mode in ("fused", "ensemble"):
        options = get_mode(mode).Options
        given = dict(options.flags())
        for f in options.__dataclass_fields__.values():
            if f.name in given and str(f.type) in numeric:
                assert f.name in LIMITS, f"{flag(f.name)} has no bound"
    for f in RunSpec.__dataclass_fields__.values():
        if str(f.type) in numeric and f.name not in ("memory_needed_bytes", "created_at"):
            assert f.name in LIMITS, f"{flag(f.name)} has no bound"


@pytest.mark.parametrize("name", sorted(name for name, bound in LIMITS.items() if bound.whole))
def test_each_ceiling_is_accepted_and_one_past_it_refused(name):
    bound = LIMITS[name]
    bound.check(name, bound.high)
    bound.check(name, bound.low)
    with pytest.raises(SpecError, match=f"^{flag(name)} must be at most {bound.high:,} "):
        bound.check(name, bound.high + 1)
    with pytest.raises(SpecError, match=f"^{flag(name)} must be a whole number ≥ {bound.low} "):
        bound.check(name, bound.low - 1)


@pytest.mark.parametrize("name, good, bad", [
    ("lr", 9.99, [0.0, 10.0, float("nan"), float("inf")]),
    ("outer_lr", 10.0, [0.0, 10.01, float("nan")]),
    ("outer_momentum", 0.0, [1.0, -0.1, float("nan")]),
    ("deadline", 3600.0, [0.0, float("inf"), 1e12]),
    ("temperature", 100.0, [0.0, 100.5, float("nan")]),
    ("alpha", 1.0, [-0.01, 1.01]),
    ("timeout", 60.0, [-1.0, float("inf")]),
])
def test_real_valued_options_are_finite_and_inside_their_interval(name, good, bad):
    LIMITS[name].check(name, good)
    for value in bad:
        with pytest.raises(SpecError, match=f"^{flag(name)} must be"):
            LIMITS[name].check(name, value)


# ---- what the attack pass sent ---------------------------------------------------------------------

@pytest.mark.parametrize("mode, values, expected", [
    ("fused", {"threads_per_task": 100_000}, "--threads-per-task must be at most 256 (got 100,000)"),
    ("fused", {"shards": 1_000_000}, "--shards must be at most 1,024 (got 1,000,000)"),
    ("ensemble", {"members": 100_000}, "--members must be at most 64 (got 100,000)"),
    ("fused", {"rounds": 1_000_000_000}, "--rounds must be at most 10,000 (got 1,000,000,000)"),
    ("fused", {"accumulate": 1_000_000}, "--accumulate must be at most 1,024 (got 1,000,000)"),
    ("ensemble", {"segments": 1_000_000}, "--segments must be at most 10,000"),
    ("fused", {"seed": 2 ** 70}, "--seed must be at most"),
])
def test_the_absurd_values_of_the_attack_are_refused(mode, values, expected):
    with pytest.raises(SpecError) as refused:
        spec(mode, **values)
    assert str(refused.value).startswith(expected)
    assert "\n" not in str(refused.value)


# ---- what options add up to ------------------------------------------------------------------------

@pytest.mark.parametrize("mode, values, expected", [
    ("fused", {"rounds": 10_000, "shards": 1024},
     f"--rounds × --shards is 10,240,000 tasks; a run has at most {MAX_TASKS:,}"),
    ("fused", {"rounds": 100, "shards": 101, "sync": "async"},
     f"--sync async: --rounds × --shards queues 10,100 tasks at once; a run queues at most {MAX_QUEUED:,}"),
    ("fused", {"rounds": 10_000, "sync_every": 1001},
     f"--rounds × --sync-every is 10,010,000 minibatches for each model; a run trains at most {MAX_MINIBATCHES:,}"),
    ("fused", {"rounds": 1000, "sync_every": 100, "accumulate": 101},
     "--rounds × --sync-every × --accumulate is 10,100,000 minibatches"),
    ("fused", {"rounds": 10_000, "accumulate": 41},  # H left to the data: counted at its most, 25
     "--rounds × --sync-every × --accumulate is 10,250,000 minibatches"),
    ("ensemble", {"members": 64, "segments": 1563}, "--members × --segments is 100,032 tasks"),
    ("ensemble", {"segments": 11, "segment_steps": 1_000_000},
     "--segments × --segment-steps is 11,000,000 minibatches"),
])
def test_a_run_too_big_as_a_whole_is_refused(mode, values, expected):
    with pytest.raises(SpecError) as refused:
        spec(mode, **values)
    assert str(refused.value).startswith(expected)


def test_a_large_run_within_every_ceiling_is_accepted():
    spec("fused", rounds=1000, shards=100, sync_every=500, accumulate=8)    # 100,000 tasks
    spec("fused", rounds=100, shards=100, sync="async")                    # 10,000 queued
    spec("ensemble", members=64, segments=1000, segment_steps=10_000)
    spec("ensemble", min_members=64)  # members left to the pool: at least min_members


def test_members_left_to_a_large_pool_stop_at_the_ceiling():
    ensemble = get_mode("ensemble")
    run = RunSpec.create("ensemble", "digits-mlp", STORE)
    ensemble.prepare(run, online_workers=500)
    assert run.options.members == LIMITS["members"].high  # type: ignore[attr-defined]
    run.validate()


# ---- an agent with fewer cores than a task asks for ---------------------------------------------

def test_an_agent_runs_no_more_threads_than_it_has_cores(monkeypatch, caplog):
    import torch

    from tensorturn.train import loop as training

    asked: list[int] = []
    monkeypatch.setattr(training.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    training.set_threads(256)
    training.set_threads(3)
    assert asked == [4, 3]
    assert "--threads-per-task 256 is more than this machine's 4 cores: using 4" in caplog.text


# ---- through the CLI, against a live broker that must stay empty -----------------------------------

@pytest.mark.parametrize("args, expected", [
    (("--threads-per-task", "100000"), "--threads-per-task must be at most 256 (got 100,000)"),
    (("--shards", "1000000"), "--shards must be at most 1,024 (got 1,000,000)"),
    (("--mode", "ensemble", "--members", "100000"), "--members must be at most 64 (got 100,000)"),
    (("--rounds", "1000000000"), "--rounds must be at most 10,000 (got 1,000,000,000)"),
    (("--accumulate", "1000000"), "--accumulate must be at most 1,024 (got 1,000,000)"),
    (("--rounds", "10000", "--shards", "1000"), "--rounds × --shards is 10,000,000 tasks"),
])
def test_run_detach_with_an_absurd_value_is_one_line_and_queues_nothing(redis_server, tmp_path,
                                                                        args, expected):
    store = tmp_path / "store"
    proc = tt("run", "--detach", "--broker", redis_server.url, "--store", str(store),
              "--recipe", "digits-mlp", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [proc.stderr.strip()]  # one line
    assert proc.stderr.startswith(f"error: {expected}")
    assert redis.Redis.from_url(redis_server.url).keys("*") == []  # no run, no queue, no message
    assert not store.exists()
