"""Will the model fit? TensorTurn's honest limit, enforced before anything is queued.

Every machine must hold the whole model: weights, gradients, AdamW's two moments and one batch's
activations — or, for an outer step, the running average of the pseudo-gradients and one
evaluation batch's activations, whichever is more. The estimate builds the model on PyTorch's
``meta`` device (no memory is allocated, so a model far too big for this machine can still be
measured) and runs forward passes there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import TensorTurnError
from .layout import DEFAULT_QUEUE, memory_queue

if TYPE_CHECKING:
    from .recipes import Recipe

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


def check_fits(need: dict[str, Any], workers: list[dict[str, Any]]) -> None:
    """Raise DoesNotFit unless some online worker offers enough device memory."""
    online = [w for w in workers if w.get("state") != "offline"]
    if not online:
        return  # nothing to compare with yet; tasks wait for a machine that fits
    biggest = max(online, key=lambda w: w.get("device_memory_gb") or 0)
    offered = biggest.get("device_memory_gb") or 0
    if need["total_bytes"] > offered * GB:
        raise DoesNotFit(
            f"the model needs about {need['total_bytes'] / GB:.2f} GB per machine (weights, "
            f"gradients, optimizer state and a batch), but the largest connected worker, "
            f"{biggest['name']}, offers {offered:.2f} GB ({biggest.get('device')}); TensorTurn "
            f"does not split a model across machines")


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
