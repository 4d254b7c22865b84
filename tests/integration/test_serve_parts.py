"""The inference API without a trained run: tokens read once for a burst of new ones, a batch with
one bad request, a language model's input check, serving a run that is not there, and a model with
non-finite weights refused in one line."""

from __future__ import annotations

import asyncio
import socket

import pytest
from conftest import tt, tt_many

from tensorturn import layout
from tensorturn.pool.embedded import free_port
from tensorturn.serve import tokens
from tensorturn.serve.auth import Authenticator, AuthError, FailureCounter, TokenCache, digest
from tensorturn.store.objects import open_store


def test_serving_a_run_that_does_not_exist_is_one_clear_error(tmp_path):
    proc = tt("serve", "nope", "--store", str(tmp_path), "--port", str(free_port()))
    assert proc.returncode != 0 and "no run 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_token_created_right_after_a_read_works_on_its_first_request(tmp_path):
    store = open_store(tmp_path.as_uri())
    first, _ = tokens.create(store, "first")

    async def scenario():
        cache = TokenCache(lambda: tokens.active_digests(store), refresh_s=3600,
                           min_refresh_s=0.05)
        cache.load_now()
        auth = Authenticator(cache, tarpit_s=0.0, failures=FailureCounter(limit=3))
        await auth.check(f"Bearer {first}", "a")          # in the set: no wait, no read
        reads = cache.reads
        second, _ = tokens.create(store, "second")        # made after the list was read
        await asyncio.gather(*(auth.check(f"Bearer {second}", "a") for _ in range(5)))
        assert cache.reads == reads + 1                   # one shared early re-read for all
        for _ in range(3):
            try:
                await auth.check("Bearer tt_" + "x" * 43, "b")
            except AuthError as exc:
                assert exc.status == 401
            else:
                raise AssertionError("a wrong token passed")
        try:
            await auth.check("Bearer tt_" + "x" * 43, "b")  # over its limit
        except AuthError as exc:
            assert exc.status == 429 and exc.retry_after and exc.retry_after > 0
        await auth.check(f"Bearer {second}", "b")         # a valid token from that address
        await auth.check(f"Bearer {second}", "a")         # other addresses are not limited
        tokens.revoke(store, "first")
        assert digest(first) in cache
        await cache.refresh()                             # (the server re-reads every 2 s)
        assert digest(first) not in cache and digest(second) in cache

    asyncio.run(scenario())


def test_one_bad_request_in_a_batch_fails_alone():
    """The model fails on a batch holding one bad request: the others in it still get answers."""
    import asyncio

    import numpy as np

    from tensorturn.serve.batching import Batcher

    def run(x):
        if (x < 0).any():
            raise IndexError("index out of range in self")
        return x * 2

    async def main():
        batcher = Batcher(run, lambda result, a, b: result[a:b], max_rows=64, window_s=0.2)
        batcher.start(asyncio.get_running_loop())
        try:
            return await asyncio.gather(*(batcher.submit(np.full((1, 2), v, np.float32))
                                          for v in (1.0, -1.0, 3.0)), return_exceptions=True)
        finally:
            batcher.stop()

    good, bad, other = asyncio.run(main())
    assert good.tolist() == [[2.0, 2.0]] and other.tolist() == [[6.0, 6.0]]
    assert isinstance(bad, IndexError)


def test_a_language_model_refuses_token_ids_outside_its_vocabulary():
    import numpy as np

    from tensorturn.recipes.charlm import CharLM

    recipe = CharLM()
    vocab = len(recipe.vocab())
    assert recipe.check_input(np.array([[0.0, vocab - 1.0]])) is None
    for bad in ([[vocab]], [[-1.0]], [[1.5]]):
        assert recipe.check_input(np.array(bad, np.float32)) == (
            f"inputs are token ids: whole numbers from 0 to {vocab - 1}")


def nan_model(store_dir, run_id: str, member_models: int = 0) -> None:
    """A signed, 'succeeded' digits-mlp run whose model holds a NaN weight (a run that diverged
    before the outer step learned to refuse it); ``member_models``: an ensemble of that many."""
    import torch

    from tensorturn import trust
    from tensorturn.recipes import resolve
    from tensorturn.store.objects import open_store, sha256_hex
    from tensorturn.store.tensors import ensemble_bytes, model_metadata, to_bytes

    recipe = resolve("digits-mlp")
    cfg = recipe.default_config()
    state = {k: v.clone() for k, v in recipe.model(cfg).state_dict().items()}
    first = next(iter(state))
    bad = {**state, first: torch.full_like(state[first], float("nan"))}
    store = open_store(store_dir.as_uri())
    if member_models:
        members = [(m, {k: v.clone() for k, v in (state if m == 0 else bad).items()}, cfg)
                   for m in range(member_models)]
        data, mode, final = ensemble_bytes(members, "digits-mlp", "soft"), "ensemble", "final_ensemble"
    else:
        data, mode, final = to_bytes(bad, model_metadata("digits-mlp", cfg)), "fused", "final_model"
    store.put_bytes(layout.key(final, run_id), data)
    store.put_json(layout.key("manifest", run_id), trust.pool_key().sign_doc("manifest", {
        "run_id": run_id, "mode": mode, "state": "succeeded", "recipe": "digits-mlp",
        "model_uri": "x", "model_sha256": sha256_hex(data)}))


NAN_MEMBERS = {0: "run diverged is not served: weight 0.weight holds NaN or infinite values",
               3: "run diverged is not served: member 1's weight 0.weight holds NaN or infinite values"}


@pytest.fixture(scope="module")
def served_nan_models(tmp_path_factory):
    """`serve` of a diverged fused model and of a diverged ensemble (3 members), both at once
    (each loads torch): members → its answer."""
    work = tmp_path_factory.mktemp("nan")
    for members in NAN_MEMBERS:
        nan_model(work / f"store-{members}", "diverged", members)
    with socket.socket() as holder:  # were it not refused, binding would fail rather than serve
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        answers = tt_many(*(("serve", "diverged", "--store", str(work / f"store-{members}"), "--port", port)
                            for members in NAN_MEMBERS))
    return dict(zip(NAN_MEMBERS, answers))


@pytest.mark.parametrize("members, expected", list(NAN_MEMBERS.items()))
def test_a_model_with_nan_weights_is_refused_in_one_line(served_nan_models, members, expected):
    proc = served_nan_models[members]
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {expected} (the run diverged)"]
