"""Run files: `tensorturn run --config FILE` runs a TOML file's settings, flags given with it win,
`--print-config` writes the resolved settings and starts nothing, a bad file is one line and
exit 2, and a run from `--print-config`'s file is the run from the flags again (same sha256),
its settings kept with it for `status`."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
from conftest import clean_env, tt_here


def write(path, text: str):
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,line", [
    ('recipe = "digits-mlp"\nroundz = 2\n', "{f}: unknown setting 'roundz'; did you mean 'rounds'?"),
    ('recipe = "digits-mlp"\nrounds = "two"\n', "{f}: rounds must be a whole number (got 'two')"),
    ('recipe = "digits-mlp"\nbootstrap = 1\n', "{f}: bootstrap must be true or false (got 1)"),
    ('recipe = "digits-mlp"\nrecipe_options = 3\n', "{f}: recipe_options must be a table ([recipe_options]) (got 3)"),
    ('recipe = "digits-mlp"\nrounds = 0\n', "--rounds must be a whole number ≥ 1 (got 0)"),
    ('recipe = "digits-mlp"\nmembers = 3\n',
     "--members is an option of --mode ensemble; it does not apply to --mode fused"),
    ('recipe = "digits-mlp"\nmerge = "soup"\n', "--merge 'soup' is not one of none, distill"),
    ('recipe = "digits-mlp"\nbroker = "redis://default:hunter2@10.0.0.1:6379/0"\n',
     "{f}: 'broker' is where the run goes, not what runs: give --broker (or its environment variable) instead"),
    ('recipe = "digits-mlp\n', "{f} is not a valid TOML file: Illegal character '\\n' (at line 1, column 21)"),
    ('rounds = 2\n', "--recipe is required"),
    ('recipe = "digits-mlp"\n[recipe_options]\nwhen = 2026-12-07T01:02:03\n',
     "{f}: recipe option 'when' is a TOML datetime (2026-12-07 01:02:03), which a run's options cannot hold: "
     "write it as a string (\"2026-12-07 01:02:03\")"),
    ('recipe = "digits-mlp"\n[recipe_options]\nat = [12:00:00]\n',
     "{f}: recipe option 'at' is a TOML time (12:00:00), which a run's options cannot hold: write it as a "
     "string (\"12:00:00\")"),
])
def test_a_bad_run_file_is_one_line_and_exit_2(tmp_path, text, line):
    f = write(tmp_path / "run.toml", text)
    proc = tt_here("run", "--config", f, "--store", str(tmp_path / "store"))
    assert (proc.returncode, proc.stderr) == (2, f"error: {line.format(f=f)}\n")
    assert "hunter2" not in proc.stdout + proc.stderr
    assert not (tmp_path / "store").exists()  # nothing started


@pytest.mark.parametrize("setting", ["local_workers = 100000", "timeout = -1"])
def test_print_config_writes_only_what_run_takes(tmp_path, setting):
    f = write(tmp_path / "run.toml", f'recipe = "digits-mlp"\n{setting}\n')
    printed, ran = (tt_here("run", "--config", f, *extra, "--store", str(tmp_path / "store"))
                    for extra in (("--print-config",), ()))
    assert printed.returncode == ran.returncode == 2 and printed.stdout == ""
    flag = "--" + setting.split()[0].replace("_", "-")
    assert printed.stderr == ran.stderr and printed.stderr.startswith(f"error: {flag}")


def test_a_missing_run_file_is_one_line(tmp_path):
    proc = tt_here("run", "--config", str(tmp_path / "nope.toml"))
    assert (proc.returncode, proc.stderr) == (2, f"error: no run file {tmp_path / 'nope.toml'}\n")


def test_flags_given_win_over_the_file_and_defaults_do_not(tmp_path):
    f = write(tmp_path / "run.toml", 'mode = "ensemble"\nrecipe = "digits-mlp"\nseed = 7\nmembers = 3\n'
                                     'segment-steps = 50\n[recipe_options]\na = 1\nb = "x"\n')
    proc = tt_here("run", "--config", f, "--members", "4", "--recipe-option", "b=y", "--print-config")
    assert proc.returncode == 0, proc.stderr
    settings = tomllib.loads(proc.stdout)
    # the file's mode and seed stand (the flags' defaults do not override them); given flags win
    chosen = (settings["mode"], settings["seed"], settings["members"], settings["segment_steps"])
    assert chosen == ("ensemble", 7, 4, 50)
    assert settings["recipe_options"] == {"a": 1, "b": "y"}
    # every default is written out, so the file says all that ran — but no embedded pool's size
    # the user never gave (how the command runs it, not what runs), and lr and batch_size are
    # the recipe's, which the run settles (status --print-config shows them)
    assert (settings["max_attempts"], settings["vote"]) == (3, "soft")
    assert not {"local_workers", "lr", "batch_size"} & set(settings)
    assert "# lr and batch_size not given: the recipe's own" in proc.stdout
    given = tt_here("run", "--config", f, "--local-workers", "3", "--lr", "0.01", "--batch-size", "8",
                    "--print-config").stdout
    assert {k: tomllib.loads(given)[k] for k in ("local_workers", "lr", "batch_size")} == {
        "local_workers": 3, "lr": 0.01, "batch_size": 8}
    assert "not given" not in given


def test_print_config_answers_without_torch_celery_or_boto3(tmp_path):
    probe = ("import sys\nfrom tensorturn.cli import main\n"
             "sys.argv = ['tensorturn', 'run', '--recipe', 'digits-mlp', '--print-config']\n"
             "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code\n"
             "print(sorted(m for m in ('torch', 'celery', 'boto3') if m in sys.modules), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stderr.strip() == "[]", proc.stderr
    assert tomllib.loads(proc.stdout)["recipe"] == "digits-mlp"


def test_a_run_on_a_standing_pool_keeps_no_embedded_pool_size(tmp_path, monkeypatch):
    """`run --broker` (or a join file): the pool's own agents run it, so the run's settings keep
    no `local_workers` — as Pool.run on a connected pool — and an out-of-range value is still
    refused in one line, when the request is made (before anything is queued)."""
    from tensorturn.errors import SpecError
    from tensorturn.runs.launch import Launcher
    from tensorturn.runs.request import RunRequest

    launched = []
    monkeypatch.setattr(Launcher, "launch", lambda self, stages, recipes, local_workers, *args:
                        launched.append((stages, local_workers)) or [])
    request = RunRequest.of({"recipe": "digits-mlp", "local_workers": 5}, None)
    store = (tmp_path / "store").as_uri()
    Launcher("redis://127.0.0.1:1/0", store).run(request)
    assert launched[0][1] is None
    spec = request.spec_for(store, None)
    assert "local_workers" not in spec.run_config and spec.store_url == store
    Launcher(None, store).run(request)  # embedded: its size is what ran
    assert launched[1][1] == 5 and request.spec_for(store, 5).run_config["local_workers"] == 5
    assert request.spec_for(store, 5).run_id != request.spec_for(store, 5).run_id  # a run id per launch
    with pytest.raises(SpecError, match=r"--local-workers must be at most 64 \(got 9,999\)"):
        RunRequest.of({"recipe": "digits-mlp", "local_workers": 9999})
