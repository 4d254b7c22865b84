"""What reshape 2 had to keep and no test pinned yet: a recipe the user named is allowed for one
call by its exact name (never as a pattern, never for the rest of the process, never from a
spec's options), and what an interrupted launch says and exits with — on a standing pool (the
run goes on) and on an embedded one stopped before its run was queued."""

from __future__ import annotations

import signal

import pytest
from conftest import tt_here

from tensorturn import trust
from tensorturn.errors import RecipeError, TensorTurnError
from tensorturn.recipes import BUILTIN, resolve
from tensorturn.runs import launch

MISSING = "tt_review_no_such_module:Model"  # allowed or not, its module is not there


def test_a_recipe_allowed_for_one_call_is_allowed_by_its_exact_name_only():
    with pytest.raises(TensorTurnError, match="is not allowed on this machine"):
        resolve(MISSING)
    # a name given to ``allow`` is escaped: a pattern in it matches nothing but itself
    with pytest.raises(TensorTurnError, match="is not allowed on this machine"):
        resolve(MISSING, allow=["tt_review_no_such_module:*"])
    # allowed: it gets as far as importing (and its module is not there)
    with pytest.raises(RecipeError, match="No module named 'tt_review_no_such_module'"):
        resolve(MISSING, allow=[MISSING])
    # and the process's settings are as they were: the next call without it is refused
    with pytest.raises(TensorTurnError, match="is not allowed on this machine"):
        trust.check_recipe_allowed(MISSING, BUILTIN)


def test_a_recipe_name_is_checked_without_running_any_of_its_packages(tmp_path, monkeypatch):
    """Whether ``package.module:Class`` exists is found without importing the package: its
    ``__init__`` is code, run only where the recipe is allowed and built."""
    import sys

    from tensorturn.recipes import check_name

    package = tmp_path / "tt_review_pkg"
    (package / "inner").mkdir(parents=True)
    marker = tmp_path / "ran"
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (package / "inner" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (package / "inner" / "models.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_name("tt_review_pkg.inner.models:Net")  # there
    with pytest.raises(RecipeError, match="No module named 'tt_review_pkg.inner.other'"):
        check_name("tt_review_pkg.inner.other:Net")
    with pytest.raises(RecipeError, match="No module named 'tt_review_pkg.models.x'"):
        check_name("tt_review_pkg.models.x:Net")  # (a part that is not a package)
    assert not marker.exists() and "tt_review_pkg" not in sys.modules


def test_a_student_builds_its_base_with_what_its_caller_allowed_and_never_with_its_options():
    student = {"teacher": "20260101-000000-abcdef", "recipe": MISSING}
    with pytest.raises(RecipeError, match="is not allowed on this machine"):
        resolve("distill", student)
    with pytest.raises(RecipeError, match="No module named 'tt_review_no_such_module'"):
        resolve("distill", student, allow=[MISSING])
    # a spec (from the broker) cannot widen what an agent imports through the recipe's options
    with pytest.raises(RecipeError, match="does not accept options"):
        resolve("distill", {**student, "allow": [MISSING]})


def test_an_embedded_pool_gives_its_agents_exactly_the_names_it_was_given(tmp_path, monkeypatch):
    from tensorturn.pool.embedded import LocalPool

    monkeypatch.chdir(tmp_path)  # the pool key is made here
    pool = LocalPool(1, (tmp_path / "store").as_uri(), workdir=tmp_path / "pool",
                     allow=["mine.models:Net", "x*:Y"])
    patterns = trust.allowed_patterns(pool.agent_settings(0))
    assert "mine.models:Net" in patterns and "x[*]:Y" in patterns and "x*:Y" not in patterns
    assert "mine.models:Net" not in trust.allowed_patterns(LocalPool(
        1, (tmp_path / "store").as_uri(), workdir=tmp_path / "pool2").agent_settings(0))


def test_interrupted_following_on_a_standing_pool_stops_following_not_the_run(monkeypatch):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "follow", interrupted)
    with pytest.raises(launch.Interrupted) as caught:
        launch.follow_on_pool("redis://127.0.0.1:1/0", "RUN", None)
    assert not caught.value.stopped  # the CLI prints it as it is (no "error:"), and exits 130
    assert str(caught.value) == ("stopped following; run RUN goes on in the pool "
                                 "(`tensorturn status RUN --watch` follows it again)")


def test_an_embedded_run_interrupted_before_it_is_queued_says_so_and_exits_130(tmp_path, monkeypatch):
    from tensorturn.pool import embedded

    class Starting:  # Ctrl-C while the pool starts
        def __init__(self, *_args, **_kwargs):
            pass

        def __enter__(self):
            raise KeyboardInterrupt

        def __exit__(self, *_exc):
            return False

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(embedded, "LocalPool", Starting)
    started = []
    stages = [("RUN", lambda broker_url, say: started.append(broker_url))]
    with pytest.raises(launch.Interrupted) as caught:
        launch.Launcher(None, (tmp_path / "store").as_uri()).launch(stages, ["digits-mlp"], 1)
    assert caught.value.stopped and started == []
    assert str(caught.value) == "interrupted before run RUN was queued; nothing to resume"

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:  # the command installs its own (Ctrl-C and SIGTERM stop the pool)
        proc = tt_here("run", "--recipe", "digits-mlp", "--rounds", "1")
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert proc.returncode == 130
    assert proc.stderr.splitlines()[-1].startswith("error: interrupted before run ")
    assert proc.stderr.splitlines()[-1].endswith(" was queued; nothing to resume")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_an_embedded_run_refused_at_submit_names_no_run(tmp_path, monkeypatch, redis_server):
    from tensorturn.pool import embedded

    class Ready:  # a pool that is up at once, on the test's redis-server
        broker_url = redis_server.url

        def __init__(self, *_args, **_kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *_exc):
            return False

    class Heard(launch.Quiet):
        def __init__(self):
            self.lines = []

        def say(self, line):
            self.lines.append(line)

    def refused(broker_url, say):
        raise RecipeError("recipe 'x' failed at the model: boom")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(embedded, "LocalPool", Ready)
    heard = Heard()
    with pytest.raises(RecipeError):
        launch.Launcher(None, (tmp_path / "store").as_uri(), heard).launch(
            [("20990101-000000-abcdef", refused)], ["digits-mlp"], 1)
    assert any(line.startswith("pool ready in ") for line in heard.lines), heard.lines
    assert not [line for line in heard.lines if "20990101-000000-abcdef" in line]  # it never existed


def test_a_recipe_option_left_out_is_named_with_the_flag_that_gives_it():
    with pytest.raises(RecipeError, match=r"^recipe 'tabular' needs the option dataset: pass "
                                          r"--recipe-option dataset=VALUE \(in a run file"):
        resolve("tabular", {})
    with pytest.raises(RecipeError, match="does not accept options"):  # an option it has no use for
        resolve("digits-mlp", {"nope": 1})
