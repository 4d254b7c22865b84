"""The CLI answers at once: commands that train nothing load neither torch nor Celery nor boto3,
argument and recipe errors come before any pool starts, and a failed run exits non-zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env, tt

PROBE = """
import sys
from tensorturn.cli import main
sys.argv = ["tensorturn", *{args!r}]
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = sorted(m for m in ("torch", "celery", "boto3") if m in sys.modules)
print("PROBE", code, ",".join(heavy), file=sys.stderr)
"""


def modules_loaded(args: list[str], cwd: Path) -> tuple[int, list[str], str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    line = [x for x in proc.stderr.splitlines() if x.startswith("PROBE")][-1].split(" ")
    return int(line[1]), [m for m in line[2:] if m for m in m.split(",")], proc.stderr


@pytest.mark.parametrize("args,code", [
    (["--help"], 0),
    (["runs"], 0),
    (["status", "no-such-run"], 2),
    (["report", "no-such-run"], 2),
    (["resume", "no-such-run"], 2),
    (["run", "--recipe", "unknown-name"], 2),
    (["run", "--recipe", "nosuchmodule:Thing"], 2),
    (["run", "--recipe", "digits-mlp", "--rounds", "0"], 2),
    (["run", "--mode", "fused", "--recipe", "digits-mlp", "--vote", "hard"], 2),
    (["run", "--mode", "ensemble", "--recipe", "digits-mlp", "--members", "1"], 2),
])
def test_commands_that_train_nothing_import_no_torch(tmp_path, args, code):
    exit_code, heavy, stderr = modules_loaded(args, tmp_path)
    assert exit_code == code, stderr
    assert heavy == [], f"{args} imported {heavy}"
    assert "starting an embedded pool" not in stderr
    assert not (tmp_path / "tensorturn-store" / "runs").exists()


@pytest.mark.parametrize("flag,value,line", [
    ("--accumulate", "0", "error: --accumulate must be a whole number ≥ 1 (got 0)"),
    ("--eval-batches", "-1", "error: --eval-batches must be a whole number ≥ 0 (got -1)"),
])
def test_bad_training_options_are_one_line_before_anything_starts(tmp_path, flag, value, line):
    proc = tt("run", "--recipe", "digits-mlp", flag, value, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == line
    assert not (tmp_path / "tensorturn-store").exists()
    proc = tt("run", "--recipe", "digits-mlp", "--precision", "fp8", cwd=tmp_path)
    assert proc.returncode == 2 and "'fp8' is not one of" in proc.stderr
    proc = tt("run", "--recipe", "digits-mlp", "--sync", "eventually", cwd=tmp_path)
    assert proc.returncode == 2 and "'eventually' is not one of 'rounds', 'backup', 'async'" in proc.stderr
    proc = tt("run", "--recipe", "digits-mlp", "--broadcast-codec", "int3", cwd=tmp_path)
    assert proc.returncode == 2 and "'int3' is not one of" in proc.stderr
    assert not (tmp_path / "tensorturn-store").exists()


def test_an_option_of_the_other_mode_is_refused_by_name(tmp_path):
    proc = tt("run", "--mode", "fused", "--recipe", "digits-mlp", "--segments", "2", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --segments is an option of --mode ensemble; "
                                   "it does not apply to --mode fused")


def test_status_of_a_failed_run_exits_1(tmp_path):
    run_dir = tmp_path / "store" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({
        "run_id": "r1", "mode": "fused", "state": "failed", "recipe": "digits-mlp",
        "error": "r0/shard-1: ValueError: boom", "metrics": {}, "rounds": [], "attempts": []}))
    proc = tt("status", "r1", "--store", str(tmp_path / "store"))
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: r0/shard-1: ValueError: boom"
    assert json.loads(tt("status", "r1", "--store", str(tmp_path / "store"), "--json").stdout)["state"] == "failed"


def test_status_runs_and_report_read_the_store_when_the_coordinator_is_stopped(redis_server, tmp_path):
    """Runs saved while the coordinator ran; it stops; with the join file, `status`, `runs` and
    `report` warn once (URL masked) and read the store; `resume` still needs the broker."""
    from conftest import TEST_POOL_KEY

    from tensorturn.pool.coordinator import make_join
    from tensorturn.spec import RunSpec
    from tensorturn.state.board import RunBoard
    from tensorturn.state.broker import redis_client
    from tensorturn.state.manifest import save_spec, write_manifest
    from tensorturn.store.objects import open_store

    store = open_store((tmp_path / "store").as_uri())
    board = RunBoard(redis_client(redis_server.url))
    done, live = (RunSpec.create(store_url=store.url, mode="fused", recipe="digits-mlp")
                  for _ in range(2))
    for spec in (done, live):
        board.runs.create(spec)
        save_spec(store, spec)
    board.finish(done.run_id, "succeeded", metrics={"test_accuracy": 0.75})
    board.runs.mark_running(live.run_id)
    for spec in (done, live):
        write_manifest(store, board, spec.run_id)
    join = tmp_path / "join"
    join.write_text(make_join(redis_server.url, store.url, TEST_POOL_KEY) + "\n")
    redis_server.stop()  # the coordinator is stopped
    warning = (f"warning: cannot reach broker redis://default:***@127.0.0.1:{redis_server.port}/0: ")

    proc = tt("status", done.run_id, "--join-file", str(join), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["run_id"], doc["state"], doc["metrics"]) == (done.run_id, "succeeded", {"test_accuracy": 0.75})
    [line] = proc.stderr.splitlines()
    assert line.startswith(warning) and line.endswith(f"; reading the store {store.url} instead")
    assert redis_server.password not in proc.stderr

    proc = tt("status", live.run_id, "--join-file", str(join), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"run {live.run_id}: running" in proc.stdout
    assert proc.stderr.splitlines()[1] == (
        f"warning: the last saved state is 'running', but the broker does not answer (start the "
        f"coordinator again to follow it); continue it with `tensorturn resume {live.run_id}`")

    proc = tt("runs", "--join-file", str(join), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert {m["run_id"] for m in json.loads(proc.stdout)} == {done.run_id, live.run_id}
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(warning)

    proc = tt("report", done.run_id, "--join-file", str(join), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(warning)

    # what needs the pool still says it cannot reach it
    proc = tt("resume", live.run_id, "--join-file", str(join), cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: cannot reach broker redis://default:***@")



def test_an_interruption_lost_in_a_destructor_prints_no_traceback():
    """Ctrl-C or SIGTERM landing while a destructor runs (a Redis client's ``__del__``) raises
    there, where Python prints "Exception ignored ... Traceback" and drops it; the command raises
    it again as it polls (``raise_if_interrupted``), so nothing is printed. Other errors in
    destructors still are."""
    code = ("import gc\n"
            "from tensorturn import cli\n"
            "cli.stop_on_signals()\n"
            "class Closing:\n"
            "    def __init__(self, error): self.error = error\n"
            "    def __del__(self): raise self.error\n"
            "cli._interrupted.set()\n"
            "Closing(KeyboardInterrupt()); gc.collect()\n"
            "Closing(ValueError('a real one')); gc.collect()\n"
            "try:\n"
            "    cli.raise_if_interrupted()\n"
            "except KeyboardInterrupt:\n"
            "    print('raised again')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "raised again\n"
    assert "KeyboardInterrupt" not in proc.stderr
    assert "ValueError: a real one" in proc.stderr


def test_run_help_lists_the_common_options_first_and_every_option_once():
    import re

    import click
    from click.testing import CliRunner

    from tensorturn.cli import cli

    text = CliRunner().invoke(cli, ["run", "--help"], terminal_width=100).output
    headings = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == ["Options:", "Where it runs, and how the command waits:",
                        "Expert options, --mode fused:", "Expert options, --mode ensemble:",
                        "Expert options, training:"]
    common = text[text.index("\nOptions:"):text.index("\nWhere it runs")]
    for flag in ("--mode", "--recipe", "--recipe-option", "--config", "--rounds", "--members", "--seed",
                 "--local-workers", "--join-file", "--json", "--print-config", "--help"):
        assert re.search(rf"^\s+(-h, )?{flag}\b", common, re.M), flag
    assert "--outer-momentum" not in common and "--precision" not in common
    for param in cli.commands["run"].params:  # each listed once, under one heading: none hidden
        if isinstance(param, click.Option):
            assert len(re.findall(rf"^  {re.escape(param.opts[0])}[ ,\n]", text, re.M)) == 1, param.opts
