"""The one executor, driven with a fake unit: what a queued task (:func:`execute`) and a unit
run in another's task (:func:`run_here`) record and answer for each way an attempt can end —
done, done before, past its cap, not yet, cancelled, handed back, failed, the recipe's fault,
its follow-up failing. A real redis-server and a file store; no training, no Celery worker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery.exceptions import Retry
from conftest import as_agent_of

from tensorturn.errors import BrokerError, RecipeFault
from tensorturn.layout import Label
from tensorturn.pool.owner import HandedBack
from tensorturn.tasks.attempt import (
    CANCELLED,
    SUCCEEDED,
    Attempt,
    NotYet,
    RunCancelled,
    Unit,
    execute,
    run_here,
    signed,
)

LABEL = Label("outer", round=0)
FUSED = dict(mode="fused", recipe="digits-mlp", rounds=2, shards=2, sync_every=10)


class Task:
    """What :func:`execute` reads of a Celery task: its request, its app's broker, ``retry``."""

    name = "tests.fake"

    def __init__(self, broker_url: str):
        self.request = SimpleNamespace(hostname="w1", properties={}, id="t1", is_eager=False)
        self.app = SimpleNamespace(conf=SimpleNamespace(broker_url=broker_url))

    def retry(self, countdown: float, max_retries: int | None = None) -> Retry:
        return Retry(when=countdown)


class Fake(Unit):
    """A unit whose ``done``, ``run`` and ``then`` do what the test says, and which notes
    what was called."""

    done_before = False
    work = staticmethod(lambda unit: SUCCEEDED)
    follow = staticmethod(lambda unit: None)
    calls: list[str] = []

    def done(self) -> bool:
        self.calls.append("done")
        return self.done_before

    def run(self) -> str:
        self.calls.append("run")
        return self.work(self)

    def then(self) -> None:
        self.calls.append("then")
        self.follow(self)

    def give_up(self, message: str) -> None:
        self.calls.append(f"give_up: {message}")
        super().give_up(message)


def fake(**how) -> type[Fake]:
    return type("Unit", (Fake,), {"calls": [], **{k: staticmethod(v) if callable(v) else v
                                                   for k, v in how.items()}})


def raises(exc: BaseException):
    def work(unit):
        raise exc
    return work


@pytest.fixture
def spec(world):
    spec = world.submit(**FUSED)
    as_agent_of(spec)
    return spec


def in_place(world, spec, unit: type[Fake]) -> bool:
    from tensorturn.tasks.attempt import agent_store

    parent = Attempt(Task(world.broker), world.board, agent_store(), spec, Label("slot", 1, 0), "w1")
    return run_here(parent, LABEL, unit)


def queued(world, spec, unit: type[Fake]) -> dict:
    return execute(Task(world.broker), spec.run_id, LABEL, unit, signed(spec.run_id, str(LABEL))["sig"])


def outcomes(world, spec) -> list[str]:
    return [a["outcome"] for a in world.board.attempts.all(spec.run_id) if a["task"] == str(LABEL)]


def run_state(world, spec) -> tuple[str, str | None]:
    doc = world.board.describe(spec.run_id)
    return doc["state"], doc.get("error")


def spend(world, spec, n: int) -> None:
    """``n`` failed attempts of the unit, recorded as a queued message's would be."""
    for _ in range(n):
        key, _, _ = world.board.attempts.begin(spec.run_id, str(LABEL), "w0", spec.max_attempts)
        world.board.attempts.finish(spec.run_id, key, "failed: earlier")


# ---- in place (run_here) -------------------------------------------------------------------------

def test_in_place_a_unit_done_now_is_recorded_and_followed(world, spec):
    unit = fake()
    assert in_place(world, spec, unit) is True
    assert unit.calls == ["done", "run", "then"] and outcomes(world, spec) == [SUCCEEDED]


def test_in_place_a_unit_done_before_is_only_followed(world, spec):
    unit = fake(done_before=True)
    assert in_place(world, spec, unit) is True
    assert unit.calls == ["done", "then"] and outcomes(world, spec) == []
    assert world.board.incidents.all(spec.run_id) == []  # in place, no duplicate_ignored incident


def test_in_place_a_unit_past_its_cap_gives_up_as_its_message_would(world, spec):
    spend(world, spec, spec.max_attempts)
    unit = fake()
    assert in_place(world, spec, unit) is True
    assert unit.calls == ["done", f"give_up: r0/outer failed {spec.max_attempts} attempts"]
    assert run_state(world, spec) == ("failed", f"r0/outer failed {spec.max_attempts} attempts")


def test_in_place_not_yet_is_given_back_at_no_cost(world, spec):
    unit = fake(work=raises(NotYet("its inputs are not there")))
    assert in_place(world, spec, unit) is True
    assert outcomes(world, spec) == ["refused: its inputs are not there"]
    spend(world, spec, spec.max_attempts - 1)
    assert in_place(world, spec, fake()) is True  # the refused one did not count
    assert outcomes(world, spec)[-1] == SUCCEEDED


def test_in_place_a_cancelled_run_stops_before_and_during_the_work(world, spec):
    unit = fake(work=lambda u: (u.board.cancel(u.spec.run_id, "me"), u.a.check_cancelled(now=True)))
    assert in_place(world, spec, unit) is True
    assert unit.calls == ["done", "run"] and outcomes(world, spec) == [CANCELLED]
    again = fake()
    assert in_place(world, spec, again) is True
    assert again.calls == ["done"] and outcomes(world, spec) == [CANCELLED, CANCELLED]


def test_in_place_a_failure_is_recorded_and_left_to_the_message(world, spec):
    unit = fake(work=raises(ValueError("boom")))
    assert in_place(world, spec, unit) is False
    assert outcomes(world, spec) == ["failed: ValueError: boom"]
    assert run_state(world, spec)[0] == "running"


def test_in_place_the_recipes_fault_fails_the_run_at_once(world, spec):
    unit = fake(work=raises(RecipeFault("the recipe's evaluate raised ValueError")))
    assert in_place(world, spec, unit) is True
    message = "the recipe's evaluate raised ValueError (on worker w1)"
    assert outcomes(world, spec) == [f"failed: {message}"]
    assert run_state(world, spec) == ("failed", f"r0/outer failed: {message}")


def test_in_place_a_follow_up_that_fails_leaves_the_unit_done(world, spec):
    unit = fake(follow=raises(BrokerError("broker gone")))
    assert in_place(world, spec, unit) is False
    assert outcomes(world, spec) == [SUCCEEDED]


def test_in_place_a_machine_its_owner_needs_hands_the_unit_back_at_no_cost(world, spec):
    """The owner pausing the machine while a unit runs in another's task: the attempt ends
    handed back (none of the unit's attempts spent), and its message is queued for another."""
    unit = fake(work=raises(HandedBack("its owner needs it")))
    assert in_place(world, spec, unit) is False
    assert outcomes(world, spec) == ["handed back: its owner needs it"]
    spend(world, spec, spec.max_attempts - 1)
    assert in_place(world, spec, fake()) is True  # the handed back one did not count
    assert run_state(world, spec)[0] == "running"


# ---- queued (execute) ----------------------------------------------------------------------------

def test_queued_a_unit_done_now_is_recorded_and_followed(world, spec):
    unit = fake()
    assert queued(world, spec, unit) == {"run_id": spec.run_id, "task": "r0/outer"}
    assert unit.calls == ["done", "run", "then"] and outcomes(world, spec) == [SUCCEEDED]


def test_queued_a_unit_done_before_is_an_incident_and_followed(world, spec):
    unit = fake(done_before=True)
    queued(world, spec, unit)
    assert unit.calls == ["done", "then"] and outcomes(world, spec) == []
    assert [i["kind"] for i in world.board.incidents.all(spec.run_id)] == ["duplicate_ignored"]


def test_queued_a_follow_up_that_fails_is_retried_and_the_unit_stays_done(world, spec):
    with pytest.raises(Retry) as retry:
        queued(world, spec, fake(follow=raises(BrokerError("broker gone"))))
    assert retry.value.when == 2 and outcomes(world, spec) == [SUCCEEDED]
    with pytest.raises(Retry):  # a duplicate's follow-up the same
        queued(world, spec, fake(done_before=True, follow=raises(BrokerError("broker gone"))))


def test_queued_not_yet_and_a_cancel_end_the_attempt_unretried(world, spec):
    queued(world, spec, fake(work=raises(NotYet("later"))))
    queued(world, spec, fake(work=raises(RunCancelled("cancelled"))))
    assert outcomes(world, spec) == ["refused: later", CANCELLED]


def test_queued_handed_back_goes_back_to_the_queue_at_no_cost(world, spec):
    with pytest.raises(Retry) as retry:
        queued(world, spec, fake(work=raises(HandedBack("its owner needs it"))))
    assert retry.value.when == 0 and outcomes(world, spec) == ["handed back: its owner needs it"]


def test_queued_failures_are_retried_with_backoff_then_given_up(world, spec):
    when = []
    for _ in range(spec.max_attempts - 1):
        with pytest.raises(Retry) as retry:
            queued(world, spec, fake(work=raises(ValueError("boom"))))
        when.append(retry.value.when)
    assert when == [1, 2][:spec.max_attempts - 1]
    unit = fake(work=raises(ValueError("boom")))
    queued(world, spec, unit)  # the last: given up
    final = f"r0/outer failed {spec.max_attempts} attempts; last: ValueError: boom"
    assert unit.calls[-1] == f"give_up: {final}"
    assert run_state(world, spec) == ("failed", final)
    assert outcomes(world, spec) == ["failed: ValueError: boom"] * spec.max_attempts


def test_queued_the_recipes_fault_fails_the_run_at_once(world, spec):
    queued(world, spec, fake(work=raises(RecipeFault("the recipe's evaluate raised ValueError"))))
    assert run_state(world, spec) == ("failed", "r0/outer failed: the recipe's evaluate raised "
                                                "ValueError (on worker w1)")


# ---- one pacing for every look and every wait ----------------------------------------------------

def test_a_wait_asks_at_once_then_after_pauses_doubling_to_a_cap_with_a_look_before_each():
    from tensorturn.tasks.poll import poll

    done: list[str] = []
    for n, _ in enumerate(poll(lambda: done.append("look"), first=0.02, cap=0.1, sleep=lambda s: done.append(s))):
        if n == 5:
            break
    assert done == ["look", 0.02, "look", 0.04, "look", 0.08, "look", 0.1, "look", 0.1]


def test_a_wait_ends_when_its_time_is_up_or_its_look_raises():
    from tensorturn.tasks.poll import poll

    now = [0.0]
    waited = list(poll(first=1, cap=4, within=10, sleep=lambda s: now.__setitem__(0, now[0] + s),
                       clock=lambda: now[0]))
    assert waited == [0, 1, 3, 7]  # asked at 0, then after 1, 2 and 4 s; at 15 s its time was up

    def look():
        raise RunCancelled("cancelled")

    with pytest.raises(RunCancelled):
        for _ in poll(look, sleep=lambda s: None):
            pass


def test_a_cancel_look_and_a_standing_look_keep_one_pace():
    """Whichever look came last, a paced one (``now=False``) asks the broker again only after
    CANCEL_LOOK_S; a look ``now`` always asks."""
    asked = []
    board = SimpleNamespace(
        runs=SimpleNamespace(state=lambda run_id: asked.append("state") or "running"),
        state_and_standing=lambda run_id, worker: asked.append("standing") or ("running", None, None))
    a = Attempt(task=None, board=board, store=None, spec=SimpleNamespace(run_id="r"), label=None, worker="w")
    a.look(now=True)
    a.look(standing=True)  # just looked: no round trip
    a.check_standing(now=False)
    a.check_cancelled()
    assert asked == ["state"]
    a.looked_at -= 2  # a while ago
    a.check_standing(now=False)
    a.check_cancelled()
    a.check_standing()
    assert asked == ["state", "standing", "standing"]


def test_a_standing_look_hands_the_unit_back_when_the_owner_pauses_the_machine():
    board = SimpleNamespace(state_and_standing=lambda run_id, worker: ("running", False, "its owner needs it"))
    a = Attempt(task=None, board=board, store=None, spec=SimpleNamespace(run_id="r"), label=None, worker="w")
    with pytest.raises(HandedBack, match="its owner needs it"):
        for _ in a.waits(standing=True):  # (its look, before its first pause, raises)
            a.looked_at -= 2  # as if a while passed


def test_queued_on_a_machine_without_the_runs_spec_the_runs_own_cap_holds(world, tmp_path):
    """A machine whose store is not the run's (a wrong --store) cannot read the spec, nor so its
    attempt cap: it takes the run's from the broker, not a cap of its own (it had spent a run's
    attempts at 3 of 10 before quarantine could take it out of rotation)."""
    from tensorturn import config

    spec = world.submit(**{**FUSED, "max_attempts": 5})
    config.use(config.current().with_(store_url=(tmp_path / "elsewhere").as_uri()))
    for _ in range(4):
        with pytest.raises(Retry):
            queued(world, spec, fake())
    assert run_state(world, spec)[0] == "running"  # (4 of 5 spent: not given up)
    assert len(outcomes(world, spec)) == 4 and all("no run" in o for o in outcomes(world, spec))
    queued(world, spec, fake())  # the fifth: the run's cap, given up
    state, error = run_state(world, spec)
    assert state == "failed" and error.startswith("r0/outer failed 5 attempts; last: store "), error
