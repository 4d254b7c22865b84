"""What a recipe learns from its training data, kept with the run.

A recipe's ``raw_data`` may compute state from the training split — a feature mean and std, a
target's scale, a vocabulary — and keep it on ``self`` for ``preprocess``, ``evaluate``,
``predict`` or ``unscale_targets``. But every hook may run on a fresh instance in another process
of another machine, and most of them never load the data: an agent finds the splits in its
cache, the outer step and the vote only evaluate, ``serve``, ``export`` and
:func:`tensorturn.load` have no training data at all.

So the lifecycle is: the recipe is built from its options (``__init__``); ``raw_data`` runs once
where the run starts, and every attribute it (or ``preprocess`` on the splits) sets is the run's
**learned state** (:func:`state_of`); the state is stored in the run's signed spec
(``recipe_state``) and set on every instance before any hook (:func:`restore`) — on trainers, the
outer step, the vote, in ``serve``, in an exported folder and in ``tensorturn.load``.

The state travels as JSON: numbers, strings, booleans, None, lists (a tuple comes back a list),
dicts with string keys, torch tensors and numpy arrays (their dtype and shape kept), at most
:data:`MAX_BYTES` in all. Anything else — a fitted scikit-learn object, a file handle, the data
itself — is refused at submit in one line naming the attribute.
"""

from __future__ import annotations

import json
from typing import Any

from tensorturn.errors import RecipeError

MAX_BYTES = 1 << 20  # the learned state's JSON at most: it is part of the run's signed spec
_TENSOR, _ARRAY = "__tensor__", "__ndarray__"
ADVICE = ("keep what raw_data learns as numbers, strings, lists, dicts or small tensors, or set "
          "it in __init__ from the recipe's options")


class Unstorable(ValueError):
    """A value the learned state cannot hold."""


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise Unstorable("a dict with keys that are not strings")
        return {k: _encode(v) for k, v in value.items()}
    kind = type(value).__module__.partition(".")[0]
    if kind == "torch" and type(value).__name__ in ("Tensor", "Parameter"):
        return {_TENSOR: {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                          "data": value.detach().cpu().flatten().tolist()}}
    if kind == "numpy":
        import numpy as np

        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            return {_ARRAY: {"dtype": str(value.dtype), "shape": list(value.shape),
                             "data": value.flatten().tolist()}}
        if isinstance(value, np.generic):
            return value.item()
    raise Unstorable(f"a {type(value).__module__}.{type(value).__qualname__}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {_TENSOR}:
        import torch

        t = value[_TENSOR]
        return torch.tensor(t["data"], dtype=getattr(torch, t["dtype"])).reshape(t["shape"])
    if set(value) == {_ARRAY}:
        import numpy as np

        a = value[_ARRAY]
        return np.array(a["data"], dtype=a["dtype"]).reshape(a["shape"])
    return {k: _decode(v) for k, v in value.items()}


def encode(learned: dict[str, Any]) -> dict[str, Any]:
    """The learned attributes as the spec keeps them; RecipeError naming the first attribute
    that cannot be kept, or the state's size when it is over :data:`MAX_BYTES`."""
    doc = {}
    for name, value in sorted(learned.items()):
        try:
            doc[name] = _encode(value)
        except Unstorable as exc:
            raise RecipeError(f"raw_data set self.{name} to {exc}, which "
                              f"cannot be kept with the run (every machine, serve and an exported "
                              f"model get what raw_data set): {ADVICE}") from None
    size = len(json.dumps(doc))
    if size > MAX_BYTES:
        largest = max(doc, key=lambda n: len(json.dumps(doc[n])))
        raise RecipeError(f"what raw_data set on the recipe is "
                          f"{size / 2**20:.1f} MiB (self.{largest} the largest), over the "
                          f"{MAX_BYTES // 2**20} MiB kept with the run: keep the data in the splits "
                          f"raw_data returns, not on self; {ADVICE}")
    return doc


def state_of(recipe: Any) -> dict[str, Any]:
    """The learned state of ``recipe``, whose splits this process loaded, as the spec keeps it
    (:func:`encode`); empty for a recipe that streams its data (its splits never load here)."""
    from tensorturn.recipes.base import learned_of

    return encode(learned_of(recipe) or {})


def restore(recipe: Any, state: dict[str, Any] | None) -> Any:
    """``recipe`` with the run's learned ``state`` set on it (before any hook runs); returns it."""
    for name, value in (state or {}).items():
        setattr(recipe, name, _decode(value))
    return recipe
