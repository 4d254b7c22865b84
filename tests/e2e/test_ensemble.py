"""Ensemble mode end to end: diverse members, the vote, a lost machine, a member that drops out."""

import json
import os
import signal
import textwrap

import pytest
import redis
from conftest import RECIPES, clean_env, submit_run, tt, tt_json, wait_for

from tensorturn import runs
from tensorturn.state.board import RunBoard


@pytest.mark.e2e
def test_vote_beats_the_mean_member(tmp_path):
    doc = tt_json("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--members", "4",
                  "--local-workers", "2", "--json", cwd=tmp_path)
    assert doc["state"] == "succeeded"
    members = doc["members"]
    assert [m["state"] for m in members] == ["succeeded"] * 4
    m = doc["metrics"]
    assert m["test_accuracy"] >= m["member_mean_test_accuracy"] + 0.005
    assert m["test_loss"] < m["member_mean_test_loss"]
    assert 0 < m["disagreement"] < 0.5
    # genuine diversity, recorded per member
    assert len({json.dumps(x["config"]["model"], sort_keys=True) + str(x["config"]["lr"])
                for x in members}) > 1
    assert len({x["config"]["seed"] for x in members}) == 4
    mean = sum(x["metrics"]["test_accuracy"] for x in members) / 4
    assert m["member_mean_test_accuracy"] == pytest.approx(mean)
    assert doc["model_uri"].endswith("/final/ensemble.safetensors") and doc["model_sha256"]


def _attempts(doc, task):
    return [a for a in doc["attempts"] if a["task"] == task]


@pytest.mark.e2e
def test_a_lost_machine_costs_one_segment_not_the_member(pool_factory):
    # leases of 4 s, not 8 (refreshed every second): the lost segment comes back sooner
    pool = pool_factory(2, loglevel="INFO", env={"TENSORTURN_VISIBILITY_TIMEOUT_S": "4"})
    spec = submit_run(pool, mode="ensemble", recipe="digits-mlp", members=2, segments=3,
                      segment_steps=2500)
    board = RunBoard(redis.Redis.from_url(pool.broker_url, decode_responses=True))
    victim = wait_for(lambda: next((a for a in board.attempts.all(spec.run_id)
                                    if a["task"].endswith("/seg-1") and a["outcome"] == "running"), None),
                      "a second segment running")
    index = int(victim["worker"].split("@")[0].removeprefix("local")) - 1
    os.killpg(pool.agents[index].pid, signal.SIGKILL)  # the machine drops
    doc = runs.wait(pool.broker_url, spec.run_id, timeout_s=240)

    assert doc["state"] == "succeeded", doc.get("error")
    member = victim["task"].split("/")[0]
    seg0, seg1 = _attempts(doc, f"{member}/seg-0"), _attempts(doc, f"{member}/seg-1")
    assert [a["outcome"] for a in seg0] == ["succeeded"]          # not trained again
    assert seg1[0]["outcome"].startswith("lost") and seg1[-1]["outcome"] == "succeeded"
    assert seg1[-1]["worker"] != victim["worker"]                 # resumed on the other agent
    m = next(x for x in doc["members"] if f"m{x['member']}" == member)
    assert m["state"] == "succeeded" and len(m["workers"]) == 2


FLAKY = textwrap.dedent('''
    from tensorturn.recipes.digits import DigitsMLP

    class Flaky(DigitsMLP):
        """Member 1 always fails: every training step of its model raises."""

        def member_config(self, member, rng):
            return {**super().member_config(member, rng), "fail": member == 1}

        def model(self, config):
            model = super().model(config)
            model.broken = config.get("fail", False)
            return model

        def loss(self, model, x, y):
            if model.broken:
                raise RuntimeError("member 1 is broken on purpose")
            return super().loss(model, x, y)
''')


@pytest.mark.e2e
def test_a_member_that_always_fails_drops_out_of_the_vote(tmp_path):
    (tmp_path / "flaky_recipe.py").write_text(FLAKY)
    proc = tt("run", "--mode", "ensemble", "--recipe", "flaky_recipe:Flaky", "--members", "3",
              "--segments", "2", "--segment-steps", "50", "--max-attempts", "2",
              "--local-workers", "2", "--json", env=clean_env(PYTHONPATH=str(tmp_path)),
              cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["state"] == "succeeded"
    states = {m["member"]: m["state"] for m in doc["members"]}
    assert states == {0: "succeeded", 1: "dropped", 2: "succeeded"}
    dropped = doc["members"][1]
    assert "failed 2 attempts" in dropped["reason"] and "broken on purpose" in dropped["reason"]
    assert [a["outcome"][:6] for a in _attempts(doc, "m1/seg-0")] == ["failed", "failed"]
    assert doc["metrics"]["members_succeeded"] == 2 and doc["metrics"]["members_dropped"] == 1


@pytest.mark.e2e
def test_a_recipe_whose_evaluate_raises_fails_the_run_with_its_error(tmp_path):
    """Reported bug: the run stayed `running` forever; the error was only in the agents' logs."""
    proc = tt("run", "--mode", "ensemble", "--recipe", "failing:Failing", "--members", "2",
              "--segments", "1", "--segment-steps", "20", "--local-workers", "2",
              env=clean_env(PYTHONPATH=str(RECIPES), TT_FAIL_IN="evaluate", TT_FAIL_OVER_ROWS="16",
                            TT_FAIL_AS="RuntimeError"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: only 0 of 2 members finished")
    assert "RuntimeError: boom in evaluate" in last and "Traceback" not in proc.stderr
    status = tt("status", proc.stdout.split()[1].rstrip(":"), "--store",
                str(tmp_path / "tensorturn-store"), "--json")
    assert status.returncode == 1
    doc = json.loads(status.stdout)
    assert [m["state"] for m in doc["members"]] == ["dropped", "dropped"]


@pytest.mark.e2e
def test_members_past_the_deadline_drop_out_and_the_run_says_why(tmp_path):
    proc = tt("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--members", "2",
              "--segments", "2", "--segment-steps", "20", "--deadline", "0.001",
              "--local-workers", "1", "--json", cwd=tmp_path)
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert doc["state"] == "failed"
    assert "only 0 of 2 members finished" in doc["error"]
    assert all(m["state"] == "dropped" and "missed the deadline" in m["reason"]
               for m in doc["members"])


@pytest.mark.e2e
def test_an_embedded_ensemble_has_a_member_per_agent_though_one_agent_starts_it(tmp_path):
    """The embedded pool queues the run once its first agent answers (the others join later);
    the members are still one per agent of the pool asked for."""
    doc = tt_json("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--segments", "1",
                  "--segment-steps", "10", "--local-workers", "3", "--json", cwd=tmp_path)
    assert doc["state"] == "succeeded"
    assert len(doc["members"]) == 3 and doc["spec"]["options"]["members"] == 3
