"""Trust boundaries: what a stranger with the broker or the store cannot make a machine do.

Forged task messages, specs and model files naming code outside the allowlist, another store, or
carrying a bad signature are refused before anything is imported or read — in-process here
against a real redis-server, and with real agents and a real server in the e2e tests. Secrets
stay off every process's command line in the documented flows.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from conftest import TEST_POOL_KEY, clean_env, tt, tt_many

from tensorturn import config, layout, runs, trust
from tensorturn.modes.fused import driver as fused
from tensorturn.pool.celery_app import configure
from tensorturn.recipes import resolve
from tensorturn.serve import tokens
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import redis_client
from tensorturn.store.objects import open_store
from tensorturn.store.tensors import MODEL_FORMAT
from tensorturn.tasks.attempt import signed
from tensorturn.tasks.start import start_run
from tensorturn.trust import PoolKey, UntrustedError

FUSED = dict(mode="fused", recipe="digits-mlp", rounds=1, shards=2, sync_every=5)
OTHER_KEY = PoolKey.generate()


@pytest.fixture
def world(redis_server, tmp_path):
    """A run submitted in-process to a real redis-server; this process plays its agent."""
    configure(redis_server.url)
    store_url = (tmp_path / "store").as_uri()
    config.use(config.current().with_(store_url=store_url))
    spec = RunSpec.create(store_url=store_url, **FUSED)
    runs.submit(spec, redis_server.url)
    return spec, redis_client(redis_server.url), open_store(store_url)


def refusals(r) -> list[dict]:
    return [json.loads(x) for x in r.lrange(layout.REFUSED, 0, -1)]


# ---- the key -------------------------------------------------------------------------------------

def test_a_signed_document_refuses_any_change_another_key_and_another_purpose():
    key = PoolKey.from_text(TEST_POOL_KEY)
    doc = key.sign_doc("spec", {"recipe": "digits-mlp", "seed": 1})
    assert key.check_doc("spec", doc, "the spec") == {"recipe": "digits-mlp", "seed": 1}
    with pytest.raises(UntrustedError, match="not signed by this pool's key"):
        key.check_doc("spec", {**doc, "recipe": "evil_recipe:Evil"}, "the spec")
    with pytest.raises(UntrustedError, match="not signed by this pool's key"):
        OTHER_KEY.check_doc("spec", doc, "the spec")
    with pytest.raises(UntrustedError, match="not signed by this pool's key"):
        key.check_doc("manifest", doc, "the manifest")  # a spec's signature is no manifest's
    with pytest.raises(UntrustedError, match="is not signed"):
        key.check_doc("spec", {"recipe": "digits-mlp"}, "the spec")
    assert TEST_POOL_KEY not in repr(key)


def test_secret_files_are_private_from_their_first_byte(tmp_path):
    path = tmp_path / "secrets" / "pool-key"
    trust.write_secret(path, "ttk1.x\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with pytest.raises(FileExistsError):  # O_EXCL: never written through an existing file
        trust.write_secret(path, "ttk1.y\n")
    trust.replace_secret(path, "ttk1.z\n")
    assert path.read_text() == "ttk1.z\n" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_embedded_pool_makes_its_key_once(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORTURN_POOL_KEY")
    monkeypatch.chdir(tmp_path)
    config.reload()
    with pytest.raises(UntrustedError, match="no pool key"):
        trust.pool_key()
    made = trust.pool_key_or_create()
    assert trust.pool_key().text() == made.text() == (tmp_path / ".tensorturn/pool-key").read_text().strip()
    assert stat.S_IMODE((tmp_path / ".tensorturn/pool-key").stat().st_mode) == 0o600


# ---- recipes: code a machine agreed to import ------------------------------------------------------

def test_a_recipe_outside_the_allowlist_is_never_imported(marker):
    with pytest.raises(UntrustedError, match="not allowed on this machine"):
        resolve("evil_recipe:Evil")
    assert not marker.exists()
    config.use(trust.with_allowed(config.current(), ["evil_*:*"]))
    with pytest.raises(Exception, match="not a tensorturn Recipe"):
        resolve("evil_recipe:Evil")  # allowed: imported (and found to be no recipe)
    assert marker.exists()


# ---- task messages -------------------------------------------------------------------------------

def test_forged_task_messages_are_refused_before_anything_is_read(world, marker):
    spec, r, store = world
    before = sorted(store.list(layout.RUNS))
    fused.train_shard.apply(args=(spec.run_id, 0, 0)).get()                      # no signature
    fused.train_shard.apply(args=(spec.run_id, 0, 1), kwargs={"sig": "0" * 64}).get()
    forged = OTHER_KEY.sign("task", {"run_id": spec.run_id, "task": "r0/shard-0"})
    fused.train_shard.apply(args=(spec.run_id, 0, 0), kwargs={"sig": forged}).get()
    # a valid signature is for one unit only: it does not pass for another
    fused.train_shard.apply(args=(spec.run_id, 0, 1), kwargs=signed(spec.run_id, "r0/shard-0")).get()
    assert [x["reason"] for x in refusals(r)] == [
        "missing or bad signature: queued by someone without the pool key"] * 4
    assert {x["task"] for x in refusals(r)} == {"tensorturn.fused.train_shard"}
    assert sorted(store.list(layout.RUNS)) == before          # nothing written
    assert r.hlen(layout.run_key(spec.run_id, "attempts")) == 0  # not even an attempt record
    fused.outer_step.apply(args=([], spec.run_id, 0)).get()  # unsigned
    assert RunBoard(r).describe(spec.run_id)["state"] == "queued"  # untouched


def test_a_spec_rewritten_in_the_store_is_refused_and_the_run_fails_saying_so(world, marker):
    spec, r, store = world
    key = layout.key("spec", spec.run_id)
    doc = store.get_json(key)
    store.put_json(key, {**doc, "recipe": "evil_recipe:Evil"})  # store write access, no pool key
    for _ in range(spec.max_attempts):
        fused.train_shard.apply(args=(spec.run_id, 0, 0), kwargs=signed(spec.run_id, "r0/shard-0")).get()
    board = RunBoard(r).describe(spec.run_id)
    assert board["state"] == "failed", board
    assert f"the spec of run {spec.run_id} is not signed by this pool's key" in board["error"]
    assert not marker.exists()


def start_reply(r, run_id: str) -> dict:
    answer = r.blpop([layout.run_key(run_id, "started")], timeout=240)
    assert answer is not None, "no answer from start_run"
    return json.loads(answer[1])


def test_a_run_request_is_refused_for_a_bad_signature_another_store_or_an_unallowed_recipe(
        redis_server, tmp_path, marker):
    configure(redis_server.url)
    r = redis_client(redis_server.url)
    mine, theirs = (tmp_path / "mine").as_uri(), (tmp_path / "theirs").as_uri()
    config.use(config.current().with_(store_url=mine))
    key = trust.pool_key()

    evil = RunSpec.create(store_url=theirs, **{**FUSED, "recipe": "evil_recipe:Evil"}).to_json()
    start_run.apply(args=[evil], kwargs={"sig": OTHER_KEY.sign("submit", evil)}).get()
    assert r.keys(layout.run_key(evil["run_id"], "*")) == []  # refused: its answer is in tt:refused
    assert "missing or bad signature" in runs.start_answer(r, evil["run_id"])["error"]

    elsewhere = RunSpec.create(store_url=theirs, **FUSED).to_json()
    start_run.apply(args=[elsewhere], kwargs={"sig": key.sign("submit", elsewhere)}).get()
    reply = start_reply(r, elsewhere["run_id"])
    assert "this pool's agents use the store" in reply["error"] and reply["exit_code"] == 2

    unallowed = RunSpec.create(store_url=mine, **{**FUSED, "recipe": "evil_recipe:Evil"}).to_json()
    start_run.apply(args=[unallowed], kwargs={"sig": key.sign("submit", unallowed)}).get()
    assert "recipe 'evil_recipe:Evil' is not allowed on this machine" in start_reply(
        r, unallowed["run_id"])["error"]

    assert not marker.exists()
    assert not (tmp_path / "theirs").exists() and not (tmp_path / "mine" / "runs").exists()
    assert len(refusals(r)) == 1  # the forged one; the others were signed, and answered


# ---- tokens --------------------------------------------------------------------------------------

def test_a_token_record_written_without_the_pool_key_is_not_a_token(tmp_path):
    store = open_store((tmp_path / "store").as_uri())
    secret, record = tokens.create(store, "real")
    minted = {**record, "id": "f0f0f0f0", "name": "minted", "sha256": tokens._digest("tt_minted")}
    minted.pop("signature", None)
    store.put_json(layout.key("token", "f0f0f0f0"), minted)                   # unsigned
    store.put_json(layout.key("token", "e0e0e0e0"), OTHER_KEY.sign_doc(       # another key
        "token", {**minted, "id": "e0e0e0e0"}))
    assert tokens.active_digests(store) == {tokens._digest(secret)}
    assert [r["name"] for r in tokens.records(store)] == ["real"]


# ---- model files, in `tensorturn serve` ------------------------------------------------------------

def forge_result(store_dir: Path, run_id: str, recipe: str, file_recipe: str | None = None,
                 key: PoolKey | None = None, sign: bool = True) -> None:
    """A 'succeeded' run in a store whose model names ``recipe`` — written with store access."""
    import torch
    from safetensors.torch import save

    from tensorturn.store.objects import sha256_hex

    store = open_store(store_dir.as_uri())
    data = save({"w": torch.zeros(2)}, metadata={"format": MODEL_FORMAT, "recipe": file_recipe or recipe,
                                                 "config": "{}"})
    store.put_bytes(layout.key("final_model", run_id), data)
    manifest = {"run_id": run_id, "mode": "fused", "state": "succeeded", "recipe": recipe,
                "model_uri": "x", "model_sha256": sha256_hex(data)}
    if sign:
        manifest = (key or trust.pool_key()).sign_doc("manifest", manifest)
    store.put_json(layout.key("manifest", run_id), manifest)


FORGED = {
    "unallowed": "recipe 'evil_recipe:Evil' is not allowed on this machine",
    "unsigned": "the manifest of run forged is not signed",
    "other-key": "the manifest of run forged is not signed by this pool's key",
    "file-names-another-recipe": "the model file names recipe 'evil_recipe:Evil'",
}


@pytest.fixture(scope="module")
def served_forgeries(tmp_path_factory):
    """`serve` of each forged store (FORGED), all at once (each loads torch): case → (its
    answer, the marker file the evil recipe would have left)."""
    work = tmp_path_factory.mktemp("forged")
    markers = {case: work / f"{case}-evil-imported" for case in FORGED}
    for case in FORGED:
        forge_result(work / case, "forged", "evil_recipe:Evil" if case == "unallowed" else "digits-mlp",
                     file_recipe="evil_recipe:Evil" if case == "file-names-another-recipe" else None,
                     key=OTHER_KEY if case == "other-key" else None, sign=case != "unsigned")
    answers = tt_many(*(("serve", "forged", "--store", str(work / case), "--port", "1") for case in FORGED),
                      envs=[clean_env(TT_EVIL_MARKER=str(markers[case])) for case in FORGED])
    return {case: (answer, markers[case]) for case, answer in zip(FORGED, answers)}


@pytest.mark.parametrize("case, expected", list(FORGED.items()))
def test_serve_refuses_a_forged_model_before_importing_it(served_forgeries, case, expected):
    proc, marker = served_forgeries[case]
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists()


# ---- the same with real agents ---------------------------------------------------------------------


def test_the_join_file_carries_the_key_and_the_owners_allowlist(tmp_path):
    from tensorturn.pool.coordinator import load_join, make_join

    key = PoolKey.generate()
    join = make_join("redis://default:pw@h:1/0", "file:///s", key.text(), ("mine.*:*",))
    path = tmp_path / "join"
    trust.write_secret(path, join + "\n")
    settings = load_join(None, str(path), config.Settings())
    assert (settings.broker_url, settings.store_url, settings.pool_key) == (
        "redis://default:pw@h:1/0", "file:///s", key.text())
    assert trust.allowed_patterns(settings) == ("mine.*:*",)


# ---- from the review: replays, odd signatures, copied documents, weak keys ---------------------

def test_a_replayed_run_request_changes_nothing(world):
    spec, r, store = world
    doc = store.get_json(layout.key("spec", spec.run_id))
    doc.pop("signature")
    before = RunBoard(r).describe(spec.run_id)
    start_run.apply(args=[doc], kwargs={"sig": trust.pool_key().sign("submit", doc)}).get()
    assert refusals(r)[0]["reason"] == "this run exists already (a replayed request?)"
    after = RunBoard(r).describe(spec.run_id)
    assert (after["state"], after["created_at"]) == (before["state"], before["created_at"])
    assert not RunBoard(r).incidents.all(spec.run_id)


def test_odd_signatures_and_records_are_refused_not_errors(tmp_path):
    key = trust.pool_key()
    assert key.verify("spec", {}, "é") is False and key.verify("spec", {}, None) is False
    with pytest.raises(UntrustedError):
        key.check_doc("spec", {"signature": "é"}, "the spec")
    store = open_store((tmp_path / "store").as_uri())
    secret, _ = tokens.create(store, "real")
    store.put_json(layout.key("token", "aaaaaaaa"), {"id": "aaaaaaaa", "signature": "é"})
    store.put_bytes(layout.key("token", "bbbbbbbb"), b"not json at all")
    assert tokens.active_digests(store) == {tokens._digest(secret)}


@pytest.mark.parametrize("text", ["ttk1.changemechangemechangemechangeme",
                                  "ttk1.change-me-make-one-with-the-command-above", "ttk1.AAAA"])
def test_a_weak_or_damaged_pool_key_is_refused(text):
    from tensorturn.errors import SpecError

    with pytest.raises(SpecError, match="invalid pool key"):
        PoolKey.from_text(text)


def test_serve_refuses_another_runs_signed_manifest_copied_over(tmp_path, marker):
    store = tmp_path / "store"
    forge_result(store, "other", "digits-mlp")
    st = open_store(store.as_uri())
    st.put_json(layout.key("manifest", "forged"), st.get_json(layout.key("manifest", "other")))
    st.put_bytes(layout.key("final_model", "forged"), st.get_bytes(layout.key("final_model", "other")))
    proc = tt("serve", "forged", "--store", str(store), "--port", "1")
    assert proc.returncode == 2 and "the manifest stored for run forged is run 'other''s" in proc.stderr


def test_an_unsigned_or_forged_start_request_writes_only_its_refusal(redis_server, tmp_path):
    from tensorturn.tasks.start import start_run

    configure(redis_server.url)
    r = redis_client(redis_server.url)
    store_url = (tmp_path / "store").as_uri()
    config.use(config.current().with_(store_url=store_url))
    doc = RunSpec.create("fused", "digits-mlp", store_url, rounds=1, shards=2, sync_every=5).to_json()
    before = set(r.keys("*"))
    start_run.apply(args=[doc]).get()                                    # its signature left out
    start_run.apply(args=[doc], kwargs={"sig": PoolKey.generate().sign("submit", doc)}).get()
    written = set(r.keys("*")) - before
    assert written and all(k.startswith(layout.REFUSED) for k in written), written
    assert r.keys(layout.run_key(doc["run_id"], "*")) == []
    assert [json.loads(e)["task"] for e in r.lrange(layout.REFUSED, 0, -1)] == ["tensorturn.start_run"] * 2
    assert not (tmp_path / "store").exists()


def test_a_start_request_replayed_after_its_run_left_the_broker_starts_nothing(redis_server, tmp_path):
    """Its signature still verifies, and the broker no longer knows the run (its keys expired,
    or were deleted): the run's spec in the store says it started once already."""
    from tensorturn import runs, trust
    from tensorturn.store.objects import open_store
    from tensorturn.tasks.start import start_run

    configure(redis_server.url)
    r = redis_client(redis_server.url)
    store_url = (tmp_path / "store").as_uri()
    config.use(config.current().with_(store_url=store_url))
    spec = RunSpec.create("fused", "digits-mlp", store_url, rounds=1, shards=2, sync_every=5)
    doc = spec.to_json()
    request = {"sig": trust.pool_key().sign("submit", doc)}  # as the submitter sent it
    runs.submit(spec, redis_server.url)
    stored = sorted(open_store(store_url).list(layout.RUNS))
    r.flushdb()
    start_run.apply(args=[doc], kwargs=request).get()
    assert [json.loads(e)["reason"] for e in r.lrange(layout.REFUSED, 0, -1)] == [
        "this run exists in the store already (a replayed request?)"]
    assert r.keys(layout.run_key(spec.run_id, "*")) == [] and not r.exists(layout.run_key(spec.run_id))
    assert sorted(open_store(store_url).list(layout.RUNS)) == stored
