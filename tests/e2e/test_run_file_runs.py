"""A run from the file `--print-config` wrote is the same run, and `status` shows it."""

from __future__ import annotations

import json
import tomllib

from conftest import tt, tt_here, tt_json, tt_json_many

from tensorturn.recipes.digits import DigitsMLP


def write(path, text: str):
    path.write_text(text)
    return str(path)



def test_a_run_from_the_printed_file_is_the_same_run_and_status_shows_it(tmp_path):
    flags = ("--recipe", "digits-mlp", "--rounds", "1", "--local-workers", "1", "--seed", "3")
    printed = tt_here("run", *flags, "--print-config")
    assert printed.returncode == 0, printed.stderr
    f = write(tmp_path / "run.toml", printed.stdout)
    by_flags, by_file = tt_json_many(("run", *flags, "--store", str(tmp_path / "a"), "--json"),
                                     ("run", "--config", f, "--store", str(tmp_path / "b"), "--json"),
                                     cwd=tmp_path)
    assert by_flags["state"] == by_file["state"] == "succeeded"
    assert by_flags["run_id"] != by_file["run_id"]
    assert by_flags["model_sha256"] == by_file["model_sha256"]
    # what ran is kept with each run: in status --json, on status's `ran with:` line, as a file
    # again — the printed settings and what the run decided at its start (shards, the outer lr...)
    settings = tomllib.loads(printed.stdout)
    kept = []
    for doc, store in ((by_flags, "a"), (by_file, "b")):
        shown = tt("status", doc["run_id"], "--store", str(tmp_path / store), "--json", cwd=tmp_path)
        kept.append(json.loads(shown.stdout)["spec"]["run_config"])
        assert kept[-1].items() >= settings.items()
    assert kept[0] == kept[1] and kept[0]["shards"] >= 1 and kept[0]["sync_every"] >= 1
    # what the run used: the recipe's lr and batch, and the embedded pool's size it ran on
    assert (kept[0]["lr"], kept[0]["batch_size"], kept[0]["local_workers"]) == (
        DigitsMLP.lr, DigitsMLP.batch_size, 1)
    again = tt_here("status", by_file["run_id"], "--store", str(tmp_path / "b"), "--print-config")
    assert tomllib.loads(again.stdout) == kept[1]
    rerun = tt_json("run", "--config", write(tmp_path / "again.toml", again.stdout), "--store",
                    str(tmp_path / "c"), "--json", cwd=tmp_path)
    assert rerun["model_sha256"] == by_flags["model_sha256"]
    text = tt_here("status", by_flags["run_id"], "--store", str(tmp_path / "a")).stdout
    assert "  ran with: mode=fused recipe=digits-mlp" in text and " seed=3 " in text
    # the run's own line first, then its rounds, then what it ran with
    assert text.index(f"run {by_flags['run_id']}: succeeded") < text.index("  round 0:") < text.index("  ran with:")
