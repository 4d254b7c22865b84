"""Progress that tells the truth: round lines in order, what a round is doing inside it, what an
outer step is doing, every ensemble member from the start, lines that fit 80 columns — and a
finished run whose records are complete when `run --json` prints it."""

from __future__ import annotations

import re
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import as_agent_of, run_outer

from tensorturn import config, runs
from tensorturn.modes import get_mode
from tensorturn.pool import telemetry
from tensorturn.runs.display import RunProgress
from tensorturn.spec import RunSpec
from tensorturn.state.attempts import Attempts
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import redis_client
from tensorturn.state.live import view

FUSED_SPEC = {"mode": "fused", "options": {"rounds": 8, "shards": 8, "sync_every": 25}}
WORKER = "local2@a-machine-with-a-rather-long-hostname.example.org"


def fused_doc(rounds: list[int], state: str = "running", **extra) -> dict:
    return {"run_id": "r", "mode": "fused", "state": state, "spec": FUSED_SPEC,
            "rounds": [{"round": r, "loss": 1.0 / (r + 1), "val_loss": 0.5} for r in rounds],
            "attempts": [], **extra}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# ---- fast: formatting and ordering from descriptions --------------------------------------------

def test_round_lines_come_out_in_order_however_the_records_arrive(capsys):
    progress = RunProgress(fused_doc([]))
    seen: list[int] = []
    for r in (0, 2, 1, 5, 6, 3, 4, 7):  # the order a diabetes run recorded its rounds
        seen.append(r)
        progress(fused_doc(seen))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == [str(r) for r in range(8)]
    assert lines[0] == "round 0 (1 of 8)  loss 1  val_loss 0.5"


def test_figures_print_to_4_digits_and_a_regression_shows_its_own_metrics(capsys):
    """Round lines, an ensemble member's line and the result round for people (``--json`` keeps
    the stored float32's every digit); a regression's lines show the recipe's own metrics, in
    the user's units, beside its loss."""
    from tensorturn.runs.display import result_lines

    regression = {"round": 0, "loss": 0.61234567, "val_loss": 2941.1234, "val_accuracy": None,
                  "val_mae": 43.212345, "val_r2": 0.4712345, "val_rows": 44}
    classifier = {"round": 1, "loss": 0.2, "val_loss": 0.123456, "val_accuracy": 0.9750000238418579}
    progress = RunProgress(fused_doc([]))
    progress({**fused_doc([]), "rounds": [regression, classifier]})
    assert capsys.readouterr().err.splitlines() == [
        "round 0 (1 of 8)  loss 0.6123  val_loss 2941  val_mae 43.21  val_r2 0.4712",
        "round 1 (2 of 8)  loss 0.2  val_loss 0.1235  val_acc 0.975"]
    members = [{"member": 0, "state": "succeeded", "segments_done": 1,
                "metrics": {"test_loss": 2941.1234, "test_mae": 43.212345, "val_mae": 40.0}},
               {"member": 1, "state": "succeeded", "segments_done": 1,
                "metrics": {"test_loss": 0.31, "test_accuracy": 0.9750000238418579}}]
    _, _, events = get_mode("ensemble").progress({"spec": {"options": {"members": 2, "segments": 1}},
                                                  "members": members})
    assert [line for _, line in events] == ["member 0 succeeded  test_loss 2941  test_mae 43.21",
                                            "member 1 succeeded  test_acc 0.975"]
    doc = {"run_id": "r", "state": "succeeded", "metrics": {"test_accuracy": 0.9750000238418579, "test_rows": 40}}
    assert result_lines(doc) == ["run r: succeeded", "  test_accuracy: 0.975", "  test_rows: 40"]

def test_a_finished_run_prints_the_rounds_it_has_in_order_even_with_a_gap(capsys):
    progress = RunProgress(fused_doc([]))
    progress(fused_doc([0, 2]))
    progress(fused_doc([0, 2, 3], state="failed"))
    assert [line.split()[1] for line in capsys.readouterr().err.splitlines()] == ["0", "2", "3"]


def test_the_live_view_counts_shards_and_steps_inside_the_round():
    now = time.time()
    attempts = [{"task": f"r3/shard-{k}", "outcome": "succeeded" if k < 5 else "running",
                 "worker": "local1@h", "started_at": now - 20} for k in range(8)]
    attempts += [{"task": "r2/shard-0", "outcome": "succeeded", "worker": "local1@h", "started_at": now - 40},
                 {"task": "r2/outer", "outcome": "running", "worker": WORKER, "started_at": now - 30}]
    entries = {f"shard-{k}": {"label": f"r3/shard-{k}", "step": 10 + k, "steps": 25} for k in range(5, 8)}
    entries["shard-4"] = {"label": "r3/shard-4", "step": 25, "steps": 25}  # done: counted once
    entries["r2/outer"] = {"label": "r2/outer", "phase": "evaluating", "worker": WORKER, "at": now - 12}
    doc = fused_doc([0, 1], attempts=attempts)
    doc.update(view(doc, entries))
    assert doc["in_round"] == {"round": 3, "shards_done": 5, "shards": 8,
                               "steps_done": 5 * 25 + 15 + 16 + 17, "steps_total": 200}
    [outer] = doc["outer_steps"]
    assert (outer["round"], outer["phase"], outer["worker"]) == (2, "evaluating", WORKER)
    line = get_mode("fused").live_line(doc)
    assert re.match(r"round 3 \(4 of 8\): 5/8 shards, 173/200 steps; round 2 evaluating on local2 \(\d+[smh]", line)
    assert len(line) <= 80
    assert len(get_mode("fused").live_line(doc, 40)) == 40 and get_mode("fused").live_line(doc, 40).endswith("…")


def test_before_any_attempt_the_round_is_round_0_with_nothing_done():
    doc = fused_doc([])
    doc.update(view(doc, {}))
    assert doc["in_round"] == {"round": 0, "shards_done": 0, "shards": 8, "steps_done": 0, "steps_total": 200}
    assert doc["outer_steps"] == []


def ensemble_doc(states: list[tuple[str, int]], entries: dict, segments: int = 3) -> dict:
    members = [{"member": m, "state": s, "segments_done": d, "metrics": {}, "reason": "boom"}
               for m, (s, d) in enumerate(states)]
    doc = {"run_id": "e", "mode": "ensemble", "state": "running", "attempts": [],
           "spec": {"mode": "ensemble", "options": {"members": len(states), "segments": segments}},
           "members": members}
    doc.update(view(doc, entries))
    return doc


def test_every_ensemble_member_shows_from_the_start():
    mode = get_mode("ensemble")
    assert mode.live_line(ensemble_doc([("queued", 0)] * 4, {})) == \
        "m0 queued, m1 queued, m2 queued, m3 queued"
    doc = ensemble_doc([("running", 1), ("queued", 0), ("succeeded", 3), ("dropped", 1)],
                       {"m0": {"label": "m0/seg-1", "step": 40, "steps": 100, "loss": 0.41234}})
    assert mode.live_line(doc) == "m0 1.4/3 0.412, m1 queued, m2 done, m3 dropped"
    # a finished segment's report, before the next one reports, counts as the segments done
    doc = ensemble_doc([("running", 2)], {"m0": {"label": "m0/seg-1", "step": 100, "steps": 100, "loss": 0.3}})
    assert mode.live_line(doc).startswith("m0 2.0/3")


def test_many_members_still_fit_80_columns():
    entries = {f"m{m}": {"label": f"m{m}/seg-1", "step": 50, "steps": 100, "loss": 0.4} for m in range(16)}
    line = get_mode("ensemble").live_line(ensemble_doc([("running", 1)] * 14 + [("queued", 0)] * 2, entries))
    assert line == "16 members: 2 queued, 14 training; 21.0/48 segments"


def test_without_a_terminal_the_live_line_is_printed_when_it_changes_at_most_every_2s(capsys):
    clock = Clock()
    doc = fused_doc([])
    progress = RunProgress(doc, clock=clock)

    def at(t: float, steps: int) -> None:
        clock.t = t
        d = fused_doc([], in_round={"round": 0, "shards_done": 0, "shards": 8, "steps_done": steps,
                                    "steps_total": 200}, outer_steps=[])
        progress(d)

    at(0.0, 10)
    at(0.5, 20)   # changed, too soon
    at(2.0, 30)
    at(4.5, 30)   # unchanged
    at(5.0, 40)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"  round 0 (1 of 8): 0/8 shards, {n}/200 steps" for n in (10, 30, 40)]


def test_a_note_that_only_counts_seconds_is_printed_once(capsys):
    progress = RunProgress(fused_doc([]))
    for s in (120, 121, 150):
        progress(fused_doc([], note=f"no progress for {s}s: its tasks are queued"))
    assert capsys.readouterr().err.splitlines() == ["warning: no progress for 120s: its tasks are queued"]


def test_the_bar_fits_80_columns(monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    doc = fused_doc([0, 1], attempts=[{"task": "r2/outer", "outcome": "running", "worker": WORKER,
                                       "started_at": time.time()}])
    doc.update(view(doc, {}))
    progress = RunProgress(doc)
    try:
        assert progress.bar is not None
        progress.bar.console.width = 80
        progress(doc)
        out = Console(width=80, record=True, file=open("/dev/null", "w"))
        out.print(progress.bar.get_renderable())
        rows = [row for row in out.export_text().splitlines() if row.strip()]
    finally:
        progress.close()
    assert rows and all(len(row) <= 80 for row in rows)
    assert "round 2 (3 of 8): 0/8 shards" in rows[-1]


# ---- fast: against a real redis-server ------------------------------------------------------------

@pytest.fixture
def board(redis_server):
    return RunBoard(redis_client(redis_server.url))


def live_run(board: RunBoard, tmp_path) -> RunSpec:
    spec = RunSpec.create(store_url=(tmp_path / "store").as_uri(), mode="fused", recipe="digits-mlp",
                          rounds=2, shards=2, sync_every=10)
    board.runs.create(spec)
    return spec


def heartbeat(board: RunBoard, name: str) -> None:
    from tensorturn.pool.telemetry import Heartbeat

    beat = Heartbeat.__new__(Heartbeat)  # the bootstep's beat, without a worker around it
    beat.client, beat.node, beat.tref, beat.outer = board.r, name, None, []
    beat.beat(first=True)


def test_training_tasks_report_steps_that_describe_shows(board, tmp_path, monkeypatch):
    spec = live_run(board, tmp_path)
    monkeypatch.setattr(telemetry, "PROGRESS_EVERY_S", 0.0)
    done = board.attempts.begin(spec.run_id, "r0/shard-0", "w1@h", 3)
    assert done is not None
    board.attempts.finish(spec.run_id, done[0], "succeeded")
    board.attempts.begin(spec.run_id, "r0/shard-1", "w2@h", 3)
    task = SimpleNamespace(request=SimpleNamespace(hostname="w2@h"), send_event=lambda *a, **k: None)
    reporter = telemetry.TaskReporter(task, board.r, "r0/shard-1", 10, 32, live=(spec.run_id, "shard-1"))
    reporter(4, 0.5)
    assert board.describe(spec.run_id)["in_round"] == {
        "round": 0, "shards_done": 1, "shards": 2, "steps_done": 14, "steps_total": 20}
    reporter(7, 0.4)
    assert board.describe(spec.run_id)["in_round"]["steps_done"] == 17
    assert set(board.progress.entries(spec.run_id)) == {"shard-1"}  # one field per place, not per task


def test_a_cancel_reaches_a_training_loop_through_its_progress_report(board, tmp_path, monkeypatch):
    from tensorturn.tasks.attempt import RunCancelled, watch_cancelled

    spec = live_run(board, tmp_path)
    monkeypatch.setattr(telemetry, "PROGRESS_EVERY_S", 0.0)
    task = SimpleNamespace(request=SimpleNamespace(hostname="w2@h"), send_event=lambda *a, **k: None)
    reporter = telemetry.TaskReporter(task, board.r, "r0/shard-1", 10, 32, live=(spec.run_id, "shard-1"))
    step = watch_cancelled(reporter, SimpleNamespace(run_id=spec.run_id), reporter)
    step(1, 0.5)  # the run goes on: so does the loop
    assert board.cancel(spec.run_id, "a test")
    with pytest.raises(RunCancelled):
        step(2, 0.4)


def test_an_outer_step_that_evaluates_is_not_a_stall(board, redis_server, tmp_path):
    spec = live_run(board, tmp_path)
    heartbeat(board, "w1@h")
    config.use(config.current().with_(stall_s=0.0))
    begun = board.attempts.begin(spec.run_id, "r0/outer", "w1@h", 3)
    assert begun is not None
    board.progress.mark_phase(spec.run_id, "r0/outer", "evaluating", "w1@h")
    doc = runs.describe(spec.run_id, redis_server.url, spec.store_url)
    assert doc["outer_steps"][0]["phase"] == "evaluating"
    assert doc["note"].startswith("round 0's outer step is evaluating on w1@h (")
    assert "no progress" not in doc["note"]
    # recorded: the phase goes with the round, and with nothing running the run is stalled again
    board.record_round(spec.run_id, 0, {"round": 0, "loss": 1.0})
    board.attempts.finish(spec.run_id, begun[0], "succeeded")
    assert board.progress.entries(spec.run_id) == {}
    doc = runs.describe(spec.run_id, redis_server.url, spec.store_url)
    assert doc["outer_steps"] == [] and doc["note"].startswith("no progress for")


def test_a_training_task_that_reports_no_step_is_named_in_the_stall_note(board, redis_server, tmp_path):
    spec = live_run(board, tmp_path)
    heartbeat(board, "w1@h")  # its machine is alive: only the task is silent
    config.use(config.current().with_(stall_s=0.0))
    assert board.attempts.begin(spec.run_id, "r0/shard-1", "w1@h", 3) is not None
    doc = runs.describe(spec.run_id, redis_server.url, spec.store_url)
    assert doc["note"].startswith("no progress for")
    assert "r0/shard-1 on w1@h has reported no training step for" in doc["note"]


# ---- the task that finishes a run writes the state last -----------------------------------------

def drive_fused(spec: RunSpec) -> None:
    from tensorturn.modes.fused import driver as fused
    from tensorturn.tasks.attempt import signed

    as_agent_of(spec)
    for r in range(spec.options.rounds):  # type: ignore[attr-defined]
        for k in range(spec.options.shards):  # type: ignore[attr-defined]
            fused.train_shard.apply(args=(spec.run_id, r, k), kwargs=signed(spec.run_id, f"r{r}/shard-{k}")).get()
        run_outer(spec, r)


def drive_ensemble(spec: RunSpec) -> None:
    from tensorturn.modes.ensemble import tasks as ensemble
    from tensorturn.tasks.attempt import signed

    as_agent_of(spec)
    for m in range(spec.options.members):  # type: ignore[attr-defined]
        ensemble.train_segment.apply(args=(spec.run_id, m, 0), kwargs=signed(spec.run_id, f"m{m}/seg-0")).get()
    ensemble.vote.apply(args=(spec.run_id,), kwargs=signed(spec.run_id, "vote")).get()


def states_when_attempts_finish(monkeypatch, board: RunBoard) -> dict[str, str | None]:
    seen: dict[str, str | None] = {}
    real = Attempts.finish

    def finish_attempt(self, run_id, key, *args, **kwargs):
        seen[key] = board.runs.state(run_id)
        return real(self, run_id, key, *args, **kwargs)

    monkeypatch.setattr(Attempts, "finish", finish_attempt)
    return seen


def assert_complete(world, spec: RunSpec) -> None:
    from tensorturn.state.manifest import read_manifest
    from tensorturn.store.objects import open_store

    doc = world.board.describe(spec.run_id)
    saved = read_manifest(open_store(spec.store_url), spec.run_id)
    assert doc["state"] == saved["state"] == "succeeded"
    assert not [a for a in saved["attempts"] if a["outcome"] == "running"]
    for field in ("attempts", "store_bytes_up", "store_bytes_down", "store_bytes_by_worker", "metrics"):
        assert saved[field] == doc[field], field


def test_the_last_outer_step_finishes_the_run_with_its_own_records(world, monkeypatch):
    spec = world.submit(mode="fused", recipe="digits-mlp", rounds=2, shards=2, sync_every=5)
    seen = states_when_attempts_finish(monkeypatch, world.board)
    drive_fused(spec)
    assert seen["r1/outer#1"] == "running"  # its attempt and figures went with the state
    assert_complete(world, spec)


def test_the_vote_finishes_the_run_with_its_own_records(world, monkeypatch):
    spec = world.submit(mode="ensemble", recipe="digits-mlp", members=2, segments=1, segment_steps=5)
    seen = states_when_attempts_finish(monkeypatch, world.board)
    drive_ensemble(spec)
    assert seen["vote#1"] == "running"
    assert_complete(world, spec)


# ---- end to end: real agents ----------------------------------------------------------------------

