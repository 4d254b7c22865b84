"""An ensemble member that diverged or evaluates to NaN is dropped from the vote with its reason:
the ensemble's counterpart of fused mode rejecting a non-finite update. Before,
`run --mode ensemble --lr 9.9` "succeeded" at chance with every broken member in its vote."""

import json
import math

import pytest
from conftest import tt, tt_here

from tensorturn import layout
from tensorturn.store.objects import open_store
from tensorturn.store.tensors import metadata_of


@pytest.mark.e2e
def test_members_that_diverge_or_evaluate_to_nan_are_dropped_with_a_reason(tmp_path):
    # tests/divergent.py: member 1 trains at lr 9.9, member 2 evaluates to NaN, member 3 holds a
    # NaN buffer; members 0 and 4 are sound
    proc = tt("run", "--mode", "ensemble", "--recipe", "divergent:Divergent", "--members", "5",
              "--segments", "1", "--segment-steps", "60", "--local-workers", "2", "--json",
              cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["state"] == "succeeded", doc.get("error")
    members = {m["member"]: m for m in doc["members"]}
    assert {k: m["state"] for k, m in members.items()} == {
        0: "succeeded", 1: "dropped", 2: "dropped", 3: "dropped", 4: "succeeded"}
    assert members[1]["reason"].startswith("diverged: its val loss ")
    assert "no lower than its untrained model's" in members[1]["reason"]
    assert members[2]["reason"].startswith("evaluates to NaN/Inf (its val_")
    assert members[3]["reason"] == "non-finite weights (NaN/Inf in spare)"
    incidents = [i for i in doc["incidents"] if i["kind"] == "member_dropped"]
    assert sorted((i["task"], i["detail"]) for i in incidents) == [
        (f"m{k}/seg-0", f"member {k} dropped: {members[k]['reason']}") for k in (1, 2, 3)]

    # the vote is the sound members' alone, and every figure of it is a number
    metrics = doc["metrics"]
    assert metrics["members_succeeded"] == 2 and metrics["members_dropped"] == 3
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["test_accuracy"] > 0.8
    store = open_store((tmp_path / "tensorturn-store").as_uri())
    meta = metadata_of(store.get_bytes(layout.key("final_ensemble", doc["run_id"])))
    assert [m["member"] for m in json.loads(meta["members"])] == [0, 4]

    status = tt_here("status", doc["run_id"], "--store", str(tmp_path / "tensorturn-store"))
    assert status.returncode == 0
    assert f"  member 1 dropped: {members[1]['reason']}\n" in status.stdout
    assert "  member 3 dropped: non-finite weights (NaN/Inf in spare)\n" in status.stdout


@pytest.mark.e2e
def test_an_ensemble_whose_members_all_diverge_fails_in_one_line(tmp_path):
    proc = tt("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--lr", "9.9", "--members", "2",
              "--segments", "1", "--segment-steps", "60", "--local-workers", "2", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: only 0 of 2 members finished (--min-members 1): member 0: diverged")
    assert "member 1: diverged" in last
    run_id = proc.stdout.split()[1].rstrip(":")
    status = tt_here("status", run_id, "--store", str(tmp_path / "tensorturn-store"), "--json")
    assert status.returncode == 1
    doc = json.loads(status.stdout)
    assert doc["state"] == "failed" and not doc.get("model_uri")
    assert [m["state"] for m in doc["members"]] == ["dropped", "dropped"]
    assert [i["task"] for i in doc["incidents"] if i["kind"] == "member_dropped"] in (
        ["m0/seg-0", "m1/seg-0"], ["m1/seg-0", "m0/seg-0"])


