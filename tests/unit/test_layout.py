"""Keys, labels, settings and the spec: built and parsed in one place each."""

from __future__ import annotations

import pytest

from tensorturn import config, layout
from tensorturn.errors import SpecError
from tensorturn.spec import RunSpec


@pytest.mark.parametrize("label", [layout.shard_label(3, 12), layout.slot_label(2, 5), layout.outer_label(0),
                                   layout.segment_label(4, 2), layout.vote_label()])
def test_task_labels_round_trip(label):
    assert layout.parse_label(str(label)) == label


def test_store_keys_parse_back():
    assert layout.key("shard", "run-1", 3, 2) == "runs/run-1/r0003/shard-002.safetensors"
    assert layout.parse("global", layout.key("global", "run-1", 12)) == {"run_id": "run-1", "round": 12}
    assert layout.parse("global", layout.key("shard", "run-1", 12, 0)) is None
    assert layout.parse("manifest", layout.key("manifest", "run-1")) == {"run_id": "run-1"}
    assert layout.parse("manifest", "runs/run-1/report/manifest.json") is None
    assert layout.prefix("global", "run-1") == "runs/run-1/global/"
    assert layout.parse("segment", layout.key("segment", "x", 4, 2)) == {"run_id": "x", "member": 4, "segment": 2}
    assert layout.parse_label("r1/shard-x") is None


def test_every_setting_has_a_variable():
    """(The documented table is generated from ``config.VARIABLES`` when the docs are built:
    test_docs checks that the configuration page asks for it.)"""
    fields = {f for f in config.Settings.__dataclass_fields__}
    assert {v.field for v in config.VARIABLES} == fields


def test_settings_from_the_environment():
    s = config.Settings.from_env({"TENSORTURN_STORE_RETRIES": "2", "TENSORTURN_STALL_S": "1.5",
                                  "TENSORTURN_BROKER_URL": "redis://x:1/0"})
    assert (s.store_retries, s.stall_s, s.broker_url) == (2, 1.5, "redis://x:1/0")
    assert s.visibility_timeout_s == 4 and s.lease_refresh_s == 1
    with pytest.raises(SpecError, match="TENSORTURN_HEARTBEAT_S must be a number"):
        config.Settings.from_env({"TENSORTURN_HEARTBEAT_S": "often"})
    for raw in ("-1", "nan", "inf", "0"):  # a stop limit of -1 s, NaN or none at all: refused
        with pytest.raises(SpecError, match=f"TENSORTURN_STOP_LIMIT_S must be a finite number > 0 \\(got '{raw}'\\)"):
            config.Settings.from_env({"TENSORTURN_STOP_LIMIT_S": raw})
    assert config.Settings.from_env({"TENSORTURN_STORE_RETRIES": "0"}).store_retries == 0
    with pytest.raises(SpecError, match="TENSORTURN_STORE_RETRIES must be a finite number ≥ 0"):
        config.Settings.from_env({"TENSORTURN_STORE_RETRIES": "-2"})
    assert config.Settings.from_env({"TENSORTURN_QUICK_END_S": "0"}).quick_end_s == 0  # the hand-over off
    with pytest.raises(SpecError, match="TENSORTURN_QUICK_END_S must be a finite number ≥ 0 \\(got '-1'\\)"):
        config.Settings.from_env({"TENSORTURN_QUICK_END_S": "-1"})


def test_spec_splits_common_and_mode_options():
    spec = RunSpec.create(mode="fused", recipe="digits-mlp", store_url="file:///s", rounds=3,
                          seed=4, codec="int8").validate()
    doc = spec.to_json()
    assert doc["seed"] == 4 and doc["options"]["rounds"] == 3 and "rounds" not in doc
    assert RunSpec.from_json(doc) == spec
    with pytest.raises(SpecError, match="--vote is an option of --mode ensemble"):
        RunSpec.create(mode="fused", recipe="digits-mlp", store_url="file:///s", vote="hard")
    with pytest.raises(SpecError, match="unknown mode 'relay'"):
        RunSpec.create(mode="relay", recipe="digits-mlp", store_url="file:///s")


def test_a_flat_spec_of_an_older_run_still_reads():
    flat = {"mode": "ensemble", "recipe": "digits-mlp", "store_url": "file:///s", "run_id": "old",
            "members": 4, "vote": "hard", "rounds": 8, "codec": "fp32", "seed": 1}
    spec = RunSpec.from_json(flat)
    assert (spec.options.members, spec.options.vote, spec.seed) == (4, "hard", 1)  # type: ignore[attr-defined]


def test_an_option_may_be_left_out_only_where_its_default_leaves_it_out():
    """``broadcast_codec`` left out (None) means the codec's, ``codec`` and ``sync`` left out
    mean the plan's (``--plan``); ``plan`` has no such meaning, and a run file or JSON spec naming
    it None (or an unknown codec) is refused in one line."""
    def spec(**options):
        return RunSpec.create(mode="fused", recipe="digits-mlp", store_url="file:///s", **options)

    spec(broadcast_codec=None).validate()
    spec(codec=None, sync=None).validate()
    assert spec(codec="ternary", broadcast_codec="int4").validate().options.down_codec == "int4"
    assert spec(codec="ternary").options.down_codec == "ternary"
    with pytest.raises(SpecError, match="^--plan None is not one of auto, off"):
        spec(plan=None).validate()
    with pytest.raises(SpecError, match="^--codec 'int3' is not one of fp32, "):
        spec(codec="int3").validate()
    with pytest.raises(SpecError, match="^--broadcast-codec 'int3' is not one of fp32, "):
        spec(broadcast_codec="int3").validate()
