"""Remote tracebacks: a failed attempt keeps its last frames (bounded, secrets masked), `status
--debug` and `check-recipe --debug` show the user's file and line, and an embedded pool keeps its
agents' logs in a folder named by the failure's error line."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import click
import pytest
from conftest import RECIPES, ROOT, clean_env, tt

from tensorturn import tracebacks
from tensorturn.cli import cli
from tensorturn.pool.embedded import KEEP_RUNS, keep_logs

SECRET_URL = "redis://default:hunter2secret@10.0.0.5:6379/0"
SECRET_KEY = "ttk1.c2VjcmV0LXBvb2wta2V5LW5vdC1mb3ItbG9ncw"


def bug_line() -> int:
    """The line of the failing recipe module where ShapeBug's loss hands torch a batch of the wrong width."""
    import failing

    lines, first = inspect.getsourcelines(failing.ShapeBug.loss)
    return first + next(i for i, line in enumerate(lines) if "return super().loss" in line)


def test_every_command_takes_debug():
    def leaves(group: click.Group, prefix: str):
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                yield from leaves(command, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}", command

    missing = [name for name, command in leaves(cli, "")
               if "--debug" not in {o for p in command.params for o in getattr(p, "opts", [])}]
    assert missing == []


def test_a_tail_is_bounded_keeps_the_users_frames_and_masks_secrets():
    def deep(n: int) -> None:  # frames of this file count as the user's
        if n == 0:
            raise ValueError(f"cannot reach {SECRET_URL} with {SECRET_KEY} " + "x" * 5000)
        deep(n - 1)

    with pytest.raises(ValueError) as caught:
        deep(60)
    text = tracebacks.tail(caught.value)
    assert len(text) <= tracebacks.MAX_CHARS
    assert text.count('  File "') <= tracebacks.MAX_FRAMES
    assert "hunter2secret" not in text and "c2VjcmV0" not in text and "redis://default:***@" in text
    assert text.splitlines()[0].startswith("Traceback (most recent call last; 8 of 62 frames)")
    assert "  ... 54 frames in user" in text and f'"{__file__}"' in text
    assert text.splitlines()[-1].startswith("ValueError: cannot reach")

    wrapped = RuntimeError("outer")
    wrapped.__cause__ = caught.value
    assert tracebacks.root_cause(wrapped) is caught.value
    here = Path(__file__).resolve()
    shown = here.relative_to(Path.cwd()) if here.is_relative_to(Path.cwd()) else here.name
    assert tracebacks.user_site(caught.value).startswith(f"{shown}:")


def test_status_debug_shows_a_failed_attempts_traceback_from_the_store(tmp_path):
    run_dir = tmp_path / "store" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    trace = ('Traceback (most recent call last; 1 of 1 frames):\n'
             '  File "/home/me/myrecipe.py", line 42, in loss\n    return model(x[:, :-1])\n'
             'RuntimeError: mat1 and mat2 shapes cannot be multiplied')
    attempts = [{"task": "r0/shard-1", "attempt": n, "worker": "local1@box", "started_at": n,
                 "finished_at": n + 0.5, "outcome": "failed: RuntimeError: mat1 and mat2",
                 "traceback": trace} for n in (1, 2)]
    (run_dir / "manifest.json").write_text(json.dumps({
        "run_id": "r1", "mode": "fused", "state": "failed", "recipe": "myrecipe:R",
        "error": "r0/shard-1 failed 2 attempts; last: RuntimeError: mat1 and mat2", "metrics": {},
        "rounds": [], "attempts": attempts}))
    store = str(tmp_path / "store")

    plain = tt("status", "r1", "--store", store)
    assert plain.returncode == 1 and "myrecipe.py" not in plain.stderr + plain.stdout
    debug = tt("status", "r1", "--store", store, "--debug")
    assert debug.returncode == 1
    lines = debug.stderr.strip().splitlines()
    assert lines[0] == "r0/shard-1 attempt 2 on local1@box failed:"
    assert '    File "/home/me/myrecipe.py", line 42, in loss' in lines  # indented under its attempt
    assert lines[-1] == "error: r0/shard-1 failed 2 attempts; last: RuntimeError: mat1 and mat2"


def test_check_recipe_debug_names_the_users_file_and_line():
    proc = tt("check-recipe", "failing:ShapeBug", "--debug", env=clean_env(TT_BUG_ROWS="0"), cwd=ROOT)
    assert proc.returncode == 2
    *trace, last = proc.stderr.strip().splitlines()
    assert last.startswith("error: recipe 'failing:ShapeBug' failed at loss: RuntimeError: mat1 and mat2")
    assert last.endswith(f"(at {(RECIPES / 'failing.py').relative_to(ROOT)}:{bug_line()} in loss)")
    assert trace[0].startswith("Traceback (most recent call last;")
    assert f'  File "{RECIPES / "failing.py"}", line {bug_line()}, in loss' in trace
    assert any("frames in torch" in line for line in trace)


def test_logs_kept_are_masked_and_only_the_last_runs_stay(tmp_path):
    logs = tmp_path / "logs"
    for i in range(KEEP_RUNS + 3):
        (logs / f"old-{i:02d}").mkdir(parents=True)
    agent = tmp_path / "agent-1.log"
    agent.write_text(f"connecting to {SECRET_URL}\nkey {SECRET_KEY}\npassword rawpass123 in a line\n")
    kept = keep_logs([agent, tmp_path / "never-written.log"], logs / "run-1", ["rawpass123"])
    text = (kept / "agent-1.log").read_text()
    assert "hunter2secret" not in text and "c2VjcmV0" not in text and "rawpass123" not in text
    assert "connecting to redis://default:***@10.0.0.5" in text
    assert not (kept / "never-written.log").exists()
    folders = sorted(p.name for p in logs.iterdir())
    assert len(folders) == KEEP_RUNS and "run-1" in folders


def test_an_error_inside_torch_names_the_layer_and_the_line_of_the_recipes_model():
    """No line of the recipe's is on the way (the built-in predict runs the recipe's
    nn.Sequential): the layer that raised and the recipe's `model` that built it are named."""
    import contract_recipes

    from tensorturn.recipes import resolve
    from tensorturn.recipes.contract import CheckFailed, check_contract

    recipe = resolve("contract_recipes:WrongWidth", allow=["contract_recipes:WrongWidth"])
    with pytest.raises(CheckFailed) as caught:  # (the failure's frames begin in TensorTurn's check)
        check_contract("contract_recipes:WrongWidth", recipe, "nothing was queued")
    line = inspect.getsourcelines(contract_recipes.WrongWidth.model)[1]
    assert re.fullmatch(rf"Linear\(in_features=65, out_features=32, bias=True\) of the model built at "
                        rf"\S*contract_recipes\.py:{line} in model", tracebacks.user_site(caught.value) or "")
