"""The Python API as the README shows it: the README's example, verbatim, on a private embedded
pool, and again on a standing pool; a run from a run file on it; ``cancel``; and the command's
one-line errors raised as exceptions before anything is queued."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, TEST_POOL_KEY, clean_env, tt_here
from safetensors.torch import load_file

import tensorturn
from tensorturn import runfile
from tensorturn.errors import BrokerError, RunFailed, SpecError, TensorTurnError
from tensorturn.pool.coordinator import make_join

pytestmark = pytest.mark.e2e


def readme_example() -> str:
    """The Python block of the README's "Python API" section."""
    section = (ROOT / "README.md").read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def the_model_is_the_stored_one(run, model) -> None:
    """``run.model()`` holds the very weights of the run's model file in the store."""
    path = run.result()["model_uri"].removeprefix("file://")
    stored = load_file(path)
    assert model.state_dict().keys() == stored.keys()
    assert all(model.state_dict()[k].equal(v) for k, v in stored.items())


def test_the_readme_example_on_an_embedded_pool(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # its store and logs, as a user's script would make them
    scope: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), scope)
    pool, run, doc, model = scope["pool"], scope["run"], scope["doc"], scope["model"]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() in ([run.run_id, "queued"], [run.run_id, "running"])  # run() returned at once
    assert doc["state"] == "succeeded" and printed[1].split()[1] == doc["model_sha256"]
    assert printed[2].endswith("parameters")
    the_model_is_the_stored_one(run, model)
    # closed with the block: its processes are gone, and the run is read back from the store
    assert pool.closed and all(agent.poll() is not None for agent in pool.local.agents)
    assert run.status()["model_sha256"] == doc["model_sha256"]
    assert run.status()["spec"]["run_config"]["local_workers"] == 2  # the pool it ran on
    assert (tmp_path / "tensorturn-store" / "runs" / run.run_id).is_dir()


@pytest.mark.e2e
def test_a_user_recipe_runs_on_an_embedded_pool_that_allows_it(tmp_path):
    """A user's recipe on an embedded pool: refused in one line unless the pool allows it, and
    then trained, and loaded by ``run.model()`` with the same allowance (the machine's own
    allowlist does not name it)."""
    recipe = "regress:Diabetes"
    with tensorturn.Pool.embedded(workers=1, store=str(tmp_path / "store")) as plain:
        with pytest.raises(SpecError, match=r"^recipe 'regress:Diabetes' is not allowed on this embedded "
                                            r"pool's agents: start it with Pool.embedded\(allow="):
            plain.run(recipe=recipe, rounds=1)
    with tensorturn.Pool.embedded(workers=1, store=str(tmp_path / "store"), allow=[recipe]) as pool:
        run = pool.run(recipe=recipe, rounds=1, sync_every=5)
        assert run.result()["state"] == "succeeded"
        the_model_is_the_stored_one(run, run.model())


def test_the_readme_example_on_a_standing_pool_and_a_run_file(pool, tmp_path, capsys):
    """The example with the pool `tensorturn up` would make: its join file names the broker,
    the store and the pool key."""
    join = tmp_path / "join"
    join.write_text(make_join(pool.broker_url, pool.store_url, key=TEST_POOL_KEY))
    example = readme_example().replace("tensorturn.Pool.embedded(workers=2)",
                                       f"tensorturn.Pool.connect(join_file={str(join)!r})")
    assert "Pool.connect" in example
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    standing, run, doc = scope["pool"], scope["run"], scope["doc"]
    assert doc["state"] == "succeeded" and standing.local is None
    the_model_is_the_stored_one(run, scope["model"])
    # what ran is kept with the run; a run from it as a run file is the same run
    settings = run.status()["spec"]["run_config"]
    assert settings["rounds"] == 2 and settings["recipe"] == "digits-mlp" and "local_workers" not in settings
    (tmp_path / "run.toml").write_text(runfile.dumps(settings))
    again = standing.run(config=tmp_path / "run.toml").result()
    assert again["run_id"] != doc["run_id"] and again["model_sha256"] == doc["model_sha256"]


def test_merge_distill_is_the_ensemble_then_its_student(pool):
    """``merge="distill"``, as ``run --merge distill``: one Run, the student's once it starts."""
    run = tensorturn.Pool.connect(broker=pool.broker_url, store=pool.store_url).run(
        mode="ensemble", recipe="digits-mlp", members=2, segments=1, segment_steps=50, merge="distill")
    ensemble_id = run.run_id
    doc = run.result()
    assert doc["ensemble"]["run_id"] == ensemble_id and doc["ensemble"]["state"] == "succeeded"
    assert doc["run_id"] == run.run_id != ensemble_id and doc["state"] == "succeeded"
    assert doc["lineage"]["distilled_from"] == ensemble_id
    assert len(list(run.model().parameters())) > 0


def test_a_cancelled_run_raises_on_result(pool):
    run = tensorturn.Pool.connect(broker=pool.broker_url, store=pool.store_url).run(
        recipe="digits-mlp", rounds=200)
    assert run.cancel()["state"] == "cancelled"
    with pytest.raises(RunFailed, match=f"run {run.run_id} was cancelled; `tensorturn resume"):
        run.result()


@pytest.mark.parametrize("settings,flags", [
    ({"rounds": 0}, ["--rounds", "0"]),
    ({"members": 3}, ["--members", "3"]),
    ({"merge": "distill"}, ["--merge", "distill"]),
    ({"threads_per_task": 1000}, ["--threads-per-task", "1000"]),
])
def test_errors_are_the_commands_lines_raised_before_anything_is_queued(pool, tmp_path, settings, flags):
    """The same settings as keywords and as flags: the same one line, raised as the same error."""
    from tensorturn.runs.records import list_runs

    connected = tensorturn.Pool.connect(broker=pool.broker_url, store=pool.store_url)
    before = len(list_runs(pool.broker_url, pool.store_url))
    with pytest.raises(TensorTurnError) as raised:
        connected.run(recipe="digits-mlp", **settings)
    cli = tt_here("run", "--recipe", "digits-mlp", *flags, "--store", str(tmp_path / "store"),
                  "--print-config")
    assert cli.returncode == raised.value.exit_code == 2
    assert cli.stderr == f"error: {raised.value}\n"
    assert len(list_runs(pool.broker_url, pool.store_url)) == before


def test_api_only_mistakes_are_one_line_errors(pool):
    connected = tensorturn.Pool.connect(broker=pool.broker_url, store=pool.store_url)
    with pytest.raises(SpecError, match=r"^unknown setting 'roundz'; did you mean 'rounds'\?$"):
        connected.run(recipe="digits-mlp", roundz=2)
    with pytest.raises(SpecError, match=r"^local_workers is not a setting of Pool.run: use Pool.embedded"):
        connected.run(recipe="digits-mlp", local_workers=3)
    with pytest.raises(TensorTurnError, match="^recipe 'no_such_module:Recipe'"):
        connected.run(recipe="no_such_module:Recipe")
    with pytest.raises(BrokerError, match=r"^cannot reach broker redis://default:\*\*\*@127.0.0.1:1/0") as down:
        tensorturn.Pool.connect(broker="redis://default:hunter2@127.0.0.1:1/0")
    assert "hunter2" not in str(down.value)


def test_import_tensorturn_loads_neither_torch_nor_celery():
    probe = ("import sys, tensorturn\n"
             "assert tensorturn.Pool.run and tensorturn.Run.result\n"
             "print(sorted(m for m in ('torch', 'celery', 'boto3') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], env=clean_env(), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr
