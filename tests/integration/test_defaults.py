"""Defaults that fit the data in front of them. A fused run whose user gave no --shards or
--sync-every gets them from its training rows (one shard per 700 rows, 2 to 8; H 25, fewer so a
shard goes over its rows at most 4 times a round), prints no warning about them, and records them
in its spec; the user's flags always win, and are warned about when they go over the rows many
times. Each README example's defaults are checked here without training (what a run decides at
start), and the quick start once end to end."""

from __future__ import annotations

import csv

import pytest
from conftest import ROOT

from tensorturn import config, runs, trust
from tensorturn.modes.fused.options import EPOCHS_PER_ROUND_WARNING, epochs_per_round, settle_options
from tensorturn.pool.celery_app import configure
from tensorturn.recipes import resolve
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import redis_client
from tensorturn.state.manifest import load_spec
from tensorturn.store.objects import open_store


def settle(recipe: str, recipe_options: dict | None = None, **given) -> tuple[RunSpec, list[str], float]:
    """What a fused run of ``recipe`` decides when it starts: its spec, the warnings `run`
    prints, and how often a shard goes over its rows a round."""
    spec = RunSpec.create("fused", recipe, "file:///unused", recipe_options=recipe_options or {}, **given)
    built = resolve(recipe, spec.recipe_options)
    warnings = settle_options(spec, built)
    return spec, warnings, epochs_per_round(spec, built)


@pytest.fixture
def readme_recipes(tmp_path, monkeypatch):
    """The README's recipes beside the built-ins: the wine example, and `tabular` over a CSV
    pushed as `tensorturn data push` does (wine's rows, class names as labels)."""
    from sklearn.datasets import load_wine

    from tensorturn import data

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    store = (tmp_path / "store").as_uri()
    config.use(trust.with_allowed(config.current().with_(store_url=store, cache_dir=str(tmp_path / "cache")),
                                  ["wine_recipe:Wine"]))
    wine = load_wine()
    with (tmp_path / "wine.csv").open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow([*wine.feature_names, "cultivar"])
        out.writerows([*x, wine.target_names[y]] for x, y in zip(wine.data, wine.target))
    data.push(open_store(store), str(tmp_path / "wine.csv"), "wine", label="cultivar")


@pytest.mark.parametrize("recipe, recipe_options, shards, sync_every", [
    ("digits-mlp", {}, 2, 25),                   # the quick start: 1293 rows
    ("wine_recipe:Wine", {}, 2, 14),              # the README's recipe example: 113 rows, batch 16
    ("tabular", {"dataset": "wine"}, 2, 4),       # a pushed CSV: 142 rows, batch 64
    ("charlm", {}, 8, 25),                        # large data keeps 8 × 25
])
def test_a_readme_examples_defaults_fit_its_data_and_are_not_warned_about(
        readme_recipes, recipe, recipe_options, shards, sync_every):
    spec, warnings, epochs = settle(recipe, recipe_options)
    opts = spec.options
    assert (opts.shards, opts.sync_every) == (shards, sync_every)
    assert opts.chosen == ["shards", "sync_every"]
    assert epochs <= EPOCHS_PER_ROUND_WARNING
    assert warnings == []


def test_the_users_flags_win_and_are_warned_about_when_they_go_over_the_rows():
    # the quick start's former defaults, given by hand: 162 rows a shard, gone over 5 times
    spec, warnings, epochs = settle("digits-mlp", shards=8, sync_every=25)
    assert (spec.options.shards, spec.options.sync_every, spec.options.chosen) == (8, 25, [])
    assert round(epochs, 1) == 4.9
    assert warnings[0].startswith("outer optimizer sgd (FedAvg), chosen by --outer auto")
    assert warnings[1].startswith("each shard holds about 162 training rows but trains 25 steps × "
                                  "batch 32 per round, going over them 5 times")
    # one flag given: the other is chosen for it, from the data
    spec, _, epochs = settle("digits-mlp", shards=8)
    assert (spec.options.shards, spec.options.sync_every, spec.options.chosen) == (8, 20, ["sync_every"])
    assert epochs <= EPOCHS_PER_ROUND_WARNING
    spec, _, _ = settle("digits-mlp", sync_every=100)
    assert (spec.options.shards, spec.options.sync_every, spec.options.chosen) == (2, 100, ["shards"])
    # a larger batch makes a smaller H (H × batch is what goes over the rows)
    spec, warnings, _ = settle("digits-mlp", batch_size=128, accumulate=2)
    assert (spec.options.shards, spec.options.sync_every, warnings) == (2, 10, [])


def test_a_commands_own_choices_are_not_warned_about():
    """`tensorturn distill` chooses 100 steps a round for its student (measured for it): its
    choice, not the user's, so it is not warned about; the same value given by hand is."""
    _, warnings, epochs = settle("digits-mlp", shards=2, sync_every=100, chosen=["sync_every", "shards"])
    assert epochs > EPOCHS_PER_ROUND_WARNING and warnings == []
    _, warnings, _ = settle("digits-mlp", shards=2, sync_every=100)
    assert "going over them 5 times" in warnings[-1]


def test_the_chosen_defaults_are_in_the_stored_spec_and_nothing_is_warned(redis_server, tmp_path):
    """The quick start's spec and an ensemble's, started in this process against a real Redis:
    the spec every machine (and `resume`) reads holds the values chosen at start."""
    configure(redis_server.url)
    board = RunBoard(redis_client(redis_server.url))
    store = (tmp_path / "store").as_uri()
    quick = RunSpec.create("fused", "digits-mlp", store)
    ensemble = RunSpec.create("ensemble", "digits-mlp", store, members=2, segments=1, segment_steps=5)
    for spec in (quick, ensemble):
        runs.submit(spec, redis_server.url)
        assert board.describe(spec.run_id)["warnings"] == []
    stored = load_spec(open_store(store), quick.run_id).options
    assert (stored.shards, stored.sync_every, stored.outer, stored.outer_lr, stored.keep) == (2, 25, "sgd", 1.0, "last")
    assert stored.chosen == ["shards", "sync_every"]
    assert (stored.codec, stored.sync, stored.plan) == ("fp32", "rounds", "auto")  # planned: a small model
    assert stored.planned["sync_every"] == 25 and stored.planned["why"]
    assert stored.planned["chose"] == ["codec", "sync"]
    assert board.describe(quick.run_id)["spec"]["options"]["shards"] == 2


def test_plan_off_keeps_the_static_defaults_and_stores_no_plan():
    spec, warnings, _ = settle("digits-mlp", plan="off")
    opts = spec.options
    assert (opts.codec, opts.sync, opts.sync_every, opts.planned) == ("fp32", "rounds", 25, {})
    assert opts.chosen == ["shards", "sync_every"] and warnings == []


def test_a_plan_fills_only_what_the_user_left_out():
    from tensorturn.modes.fused.options import PlanFigures
    from tensorturn.modes.fused.plan import Machine

    capped = tuple(Machine(f"w{i}", 1.0, 20e6 / 8, 100e6 / 8, 0.04) for i in range(3))
    figures = PlanFigures(85_500_000, 1.0, capped, outer_beside_store=True)
    spec = RunSpec.create("fused", "digits-mlp", "file:///unused", sync="rounds")
    settle_options(spec, resolve("digits-mlp", {}), figures)
    opts = spec.options
    assert opts.sync == "rounds" and "sync" not in opts.planned["chose"]  # the user's
    assert opts.codec != "fp32" and "codec" in opts.planned["chose"]
    assert opts.planned["sync"] == "rounds" and "sync rounds: given" in opts.planned["why"]




def test_the_step_is_timed_only_where_the_plan_depends_on_it():
    """digits-mlp on this machine alone is planned alike at any step time (its transfers are
    nothing, and its H is the data's either way): nothing is trained to plan it, and the plan
    predicts no utilisation. Behind 200 ms of broker round trips, a round's fixed costs weigh
    on a step of a second, not on one of a millisecond: there the step is timed."""
    from tensorturn.modes.fused.options import PlanFigures, step_matters
    from tensorturn.modes.fused.plan import Machine
    from tensorturn.modes.fused.timing import float_values, plan_figures
    from tensorturn.train.diloco import initial_state

    spec = RunSpec.create("fused", "digits-mlp", "file:///unused")
    recipe = resolve("digits-mlp", {})
    figures = plan_figures(spec, recipe, initial_state(recipe, spec.seed), None)
    assert figures.step_s is None and any(n.startswith("no step timed") for n in figures.notes)
    settle_options(spec, recipe, figures)
    assert spec.options.planned["predicted_utilisation"] is None and spec.options.codec == "fp32"
    far = PlanFigures(float_values(initial_state(recipe, spec.seed)), None, (Machine("w1", None, 1e8, 1e8, 0.2),))
    assert step_matters(spec, recipe, far)


def test_a_step_that_fails_when_timed_leaves_the_run_to_its_shard_tasks(monkeypatch):
    """θ_0's step, timed for the plan, fails inside the recipe (ShapeBug's batches of 32): the
    run starts anyway with the fixed defaults and a warning that says why; its shard tasks meet
    the failure where attempts and logs account for it (tests/e2e/test_tracebacks_embedded.py)."""
    import failing

    from tensorturn.modes.fused import timing
    from tensorturn.modes.fused.plan import Machine
    from tensorturn.train.diloco import initial_state

    # a pool behind 200 ms of round trips, no step timed there yet: the plan needs one
    far = [Machine("w1", None, 1e8, 1e8, 0.2)]
    monkeypatch.setattr(timing, "pool_machines", lambda client, recipe: (far, False, []))
    monkeypatch.setattr(timing, "outer_side", lambda client, recipe: (None, "the outer step's rate not measured yet"))
    spec = RunSpec.create("fused", "failing:ShapeBug", "file:///unused")
    recipe = failing.ShapeBug()
    figures, warning = timing.figures_or_reason(spec, recipe, initial_state(recipe, spec.seed), object())
    assert figures is None and warning is not None
    assert warning.startswith("the plan could not time a step of θ_0 (RuntimeError: mat1 and mat2")
    assert warning.endswith("the run starts with fp32, blocking rounds and the data's H")
    settle_options(spec, recipe, figures)
    assert (spec.options.codec, spec.options.sync, spec.options.planned) == ("fp32", "rounds", {})


def test_a_start_delivered_again_after_its_step_killed_its_process_does_not_time_it_again(
        redis_server, monkeypatch):
    """The first try of a start marks that it times θ_0's step, and its process dies in that
    step (a recipe that runs out of memory): Celery delivers the start again, and this try
    reads the mark and plans without timing — else the start would kill agent after agent."""
    import failing

    from tensorturn.modes.fused import timing
    from tensorturn.modes.fused.plan import Machine
    from tensorturn.state.runs import Runs
    from tensorturn.train.diloco import initial_state

    far = [Machine("w1", None, 1e8, 1e8, 0.2)]
    monkeypatch.setattr(timing, "pool_machines", lambda client, recipe: (far, False, []))
    monkeypatch.setattr(timing, "outer_side", lambda client, recipe: (None, "the outer step's rate not measured yet"))
    spec = RunSpec.create("fused", "failing:ShapeBug", "file:///unused")
    recipe = failing.ShapeBug()
    board = Runs(redis_client(redis_server.url))
    assert board.first_timing(spec.run_id, "local1@vm") is None  # the first try, before it died
    figures, warning = timing.figures_or_reason(spec, recipe, initial_state(recipe, spec.seed), object(),
                                                board, "local2@vm")
    assert figures is None and warning == ("the plan's step of θ_0 ended its process on local1@vm (out of "
                                           "memory? killed?): the run starts with fp32, blocking rounds "
                                           "and the data's H")
    assert board.first_timing(spec.run_id, "local3@vm") is None  # decided: no mark left behind


def test_a_slow_first_step_is_not_the_figure(monkeypatch):
    """A first step also allocates the optimizer's state and warms the device: it took 3.35 s of
    gpt2-small's paced 2.0 s steps on the speed-up benchmark's pool, and the plan, taking it as
    the step, chose whole precision over slow links. The figure is a step after it (a clock
    of its own here: the first step 3.5 s, then 2.0 s each)."""
    from tensorturn.modes.fused import timing
    from tensorturn.train.diloco import initial_state

    clock = {"now": 0.0, "steps": 0}

    def step(*args, **kwargs):
        clock["steps"] += 1
        clock["now"] += 3.5 if clock["steps"] == 1 else 2.0
        return 0.0, 1

    monkeypatch.setattr(timing, "train_steps", step)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    spec = RunSpec.create("fused", "digits-mlp", "file:///unused")
    recipe = resolve("digits-mlp", {})
    assert timing.time_step(spec, recipe, initial_state(recipe, spec.seed)) == 2.0
    assert clock["steps"] == 2  # the warm-up, then one within the 2 s budget


def test_a_shard_tasks_published_step_leaves_out_its_first_two(monkeypatch):
    """A shard task's first step builds the optimizer's state, and work that waited for it runs
    before the second: on the speed-up benchmark's warm-up (H = 10 of paced 2.0 s steps) the
    figure published for plans read 2.6-2.96 s. It is now the steps after the first two (a
    clock of its own: 5 s, 4 s, then 2.0 s each)."""
    from tensorturn.modes.fused import shard

    clock = {"now": 0.0}
    monkeypatch.setattr(shard.time, "perf_counter", lambda: clock["now"])
    seen = []
    timed = shard.StepClock(lambda n, loss: seen.append(n))
    for n, took in enumerate([5.0, 4.0, 2.0, 2.0, 2.0, 2.0], start=1):
        clock["now"] += took
        timed(n, 0.5)
    assert seen == [1, 2, 3, 4, 5, 6] and timed.step_s(17.0 / 6) == 2.0
    few = shard.StepClock(lambda n, loss: None)
    few(1, 0.5)
    assert few.step_s(3.0) == 3.0  # too few steps to leave any out: the whole training's
