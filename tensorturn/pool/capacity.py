"""Will the model fit? TensorTurn's honest limit, enforced before anything is queued.

Every machine must hold the whole model: weights, gradients, AdamW's two moments and one batch's
activations — or, for an outer step, the running average of the pseudo-gradients and one
evaluation batch's activations, whichever is more. The estimate builds the model on PyTorch's
``meta`` device (no memory is allocated, so a model far too big for this machine can still be
measured) and runs forward passes there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorturn.errors import TensorTurnError
from tensorturn.layout import DEFAULT_QUEUE, memory_queue
from tensorturn.state.roster import TAKES_TASKS, WorkerState

if TYPE_CHECKING:
    from tensorturn.recipes import Recipe

GB = 1024 ** 3
OVERHEAD = 1.2  # framework buffers, fragmentation, the data itself


class DoesNotFit(TensorTurnError):
    """No connected worker can hold the model."""


def estimate(recipe: Recipe, config: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Bytes one task needs, by part; measured on the meta device. A training task holds the
    weights, their gradients, AdamW's two moments and one minibatch's activations; an outer step
    (streaming) the running average and one tensor at a time, then the new weights and one
    evaluation batch's activations. The larger decides."""
    import torch

    sample = recipe.sample_input()
    with torch.device("meta"):
        model = recipe.model(config)
        params = sum(p.numel() * p.element_size() for p in model.parameters())

        def activations(rows: int) -> int:
            total = 0

            def count(_module, _inputs, output):
                nonlocal total
                for t in output if isinstance(output, (tuple, list)) else (output,):
                    if torch.is_tensor(t):
                        total += t.numel() * t.element_size()

            hooks = [m.register_forward_hook(count) for m in model.modules()]
            try:
                model(torch.empty((rows, *sample.shape[1:]), dtype=sample.dtype, device="meta"))
            except Exception:  # noqa: BLE001 - a model that cannot run on meta: count weights only
                total = 0
            finally:
                for h in hooks:
                    h.remove()
            return total

        train_activations = activations(batch_size)
        eval_activations = activations(recipe.eval_batch_size)
    training = params * 4 + train_activations
    outer = params * 2 + eval_activations
    total = int(max(training, outer) * OVERHEAD)
    return {"parameters_bytes": params, "activations_bytes": train_activations,
            "eval_activations_bytes": eval_activations, "training_bytes": training,
            "outer_step_bytes": outer, "total_bytes": total, "total_gb": round(total / GB, 3)}


# roster states of a machine that takes tasks (verified, not quarantined), or will again by
# itself: a machine its owner paused comes back, so a run it can hold waits for it
LIVE = (*TAKES_TASKS, WorkerState.PAUSED)


def check_fits(need: dict[str, Any], workers: list[dict[str, Any]]) -> None:
    """Raise DoesNotFit unless some live machine can hold the model.

    Only machines whose heartbeat is signed with the pool key count (the roster's ``unverified``
    are not: anyone with the Redis password can write a heartbeat claiming 4 TB), and a machine
    holds the model when it consumes its memory class's queue — offering 0.7 GB, it does not
    take a 0.6 GB model's tasks, which go to the 1024 MB class."""
    live = [w for w in workers if w.get("state") in LIVE]
    if not live:
        return  # nothing to compare with yet; tasks wait for a machine that fits (`status` says so)
    if holders(need["total_bytes"], live):
        return
    biggest = max(live, key=lambda w: w.get("device_memory_gb") or 0)
    raise DoesNotFit(
        f"the model needs about {_size(need['total_bytes'])} per machine (weights, gradients, "
        f"optimizer state and a batch; memory class {_class_mb(need['total_bytes'])} MB), but "
        f"the largest connected worker, {biggest['name']}, offers "
        f"{_size((biggest.get('device_memory_gb') or 0) * GB)} ({biggest.get('device')}): no "
        f"live machine can hold it, and TensorTurn does not split a model across machines"
        f"{_unverified(workers)}")


def holders(need_bytes: int | None, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live machines among ``workers`` that train (an outer-only agent takes no shard) and
    whose device memory takes tasks of ``need_bytes``."""
    queue = queue_for(need_bytes)
    return [w for w in workers if w.get("state") in LIVE and w.get("role") != "outer"
            and (w.get("device_memory_gb") or 0) * GB >= (need_bytes or 0)
            and queue in queues_for(w.get("device_memory_gb") or 0)]


def why_unheld(need_bytes: int | None, workers: list[dict[str, Any]]) -> str | None:
    """Why no live machine takes a run's tasks (of ``need_bytes`` each), in words; None when
    one does. A run waiting on such a queue waits until a machine that can hold it joins."""
    if holders(need_bytes, workers):
        return None
    live = [w for w in workers if w.get("state") in LIVE]
    if not live:
        return (f"no live machine can hold it: every agent is offline, quarantined or unverified "
                f"(see `tensorturn workers`){_unverified(workers)}")
    biggest = max(w.get("device_memory_gb") or 0 for w in live)
    return (f"no live machine can hold it: its tasks need about {_size(need_bytes or 0)} (memory "
            f"class {_class_mb(need_bytes)} MB) and the largest live machine offers "
            f"{_size(biggest * GB)}{_unverified(workers)}")


def _size(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / MB:.1f} MB"


def _class_mb(need_bytes: int | None) -> int:
    return next((c for c in CLASSES_MB if c * MB >= (need_bytes or 0)), CLASSES_MB[-1])


def _unverified(workers: list[dict[str, Any]]) -> str:
    n = sum(1 for w in workers if w.get("state") == WorkerState.UNVERIFIED)
    return (f"; not counted: {n} machine(s) whose heartbeat is not signed with this pool's key "
            f"(see `tensorturn workers`)" if n else "")


# Tasks go to a queue per memory class (powers of two, 1 MB to 1 TB); an agent consumes the
# classes its device memory can hold, so a machine too small for a model never takes its tasks
# and work stealing goes on among the machines that can. Tasks of unknown size use "celery".
MB = 1024 ** 2
CLASSES_MB = [2 ** k for k in range(21)]


def queue_for(need_bytes: int | None) -> str:
    """The queue of the smallest memory class that holds ``need_bytes``."""
    if need_bytes is None:
        return DEFAULT_QUEUE
    need_mb = need_bytes / MB
    size = next((c for c in CLASSES_MB if c >= need_mb), CLASSES_MB[-1])
    return memory_queue(size)


def queues_for(offered_gb: float) -> list[str]:
    """The queues an agent offering ``offered_gb`` of device memory consumes."""
    return [DEFAULT_QUEUE] + [memory_queue(c) for c in CLASSES_MB if c * MB <= offered_gb * GB]


# Every capacity queue there is: the only ones an outer queue may stand for (:mod:`.routing`).
CAPACITY_QUEUES = frozenset(queues_for(CLASSES_MB[-1] * MB / GB))
