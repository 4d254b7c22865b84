"""Third-party formats of an exported model, where the architecture maps.

* ONNX (``model.onnx``), any recipe whose preprocessing and model trace with ``torch.export``:
  the graph is the *served* computation — raw rows in, the recipe's preprocessing, every model,
  the vote, and the outputs the API serves (``label`` + ``probabilities``, or ``prediction``)
  out — so an ONNX runtime answers what ``tensorturn serve`` answers. Written by torch's own
  exporter (``torch.onnx.export(dynamo=True)``, which needs ``onnx`` and ``onnxscript``), with the
  number of rows left dynamic.
* transformers (``transformers/``): charlm's GPT (``charlm``, ``gpt2-small``, ``textlm``) as a
  ``GPT2LMHeadModel`` folder (``save_pretrained``: safetensors + config.json). The layouts map
  one to one — token and position embeddings, pre-LayerNorm blocks with a fused q|k|v projection,
  a 4× MLP, a final LayerNorm — with three differences handled here: GPT-2's ``Conv1D`` keeps its
  weight transposed; charlm's MLP uses exact GELU (``activation_function="gelu"``, not GPT-2's
  tanh ``gelu_new``); and charlm's head has a bias where GPT-2's ``lm_head`` has none. The bias is
  folded into the final LayerNorm's: with W the head's weight, b its bias, solve W·δ = b and add
  δ to ``ln_f.bias`` (W·(y + δ) = W·y + b). That is exact when b lies in W's column space — always
  for a vocabulary no wider than the model (256 bytes ≤ 768 for gpt2-small) with W of full rank;
  otherwise the export is refused rather than written approximately.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tensorturn.errors import SpecError, TensorTurnError
from tensorturn.predictor import Predictor

log = logging.getLogger(__name__)

EXTRA = "pip install 'tensorturn[export]'"
FOLD_TOLERANCE = 1e-5  # largest |W·δ − b| accepted, relative to the bias's largest magnitude


class ServedGraph(nn.Module):
    """The served computation as one module (raw rows → the served outputs), for ``torch.export``:
    :meth:`Predictor.predict` after the recipe's ``preprocess``, then the kind's served outputs —
    the same functions the API calls, traced."""

    def __init__(self, predictor: Predictor):
        super().__init__()
        self.members = nn.ModuleList(predictor.models)  # the weights, as this module's own
        self.predictor = predictor

    def forward(self, raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        combined, _ = self.predictor.predict(self.predictor.recipe.preprocess(raw))
        return tuple(o.data for o in self.predictor.recipe.kind.served(combined, None))


def served_names(predictor: Predictor) -> list[str]:
    """The ONNX graph's output names: those the API serves (without ``class_name``, a string)."""
    probe = torch.zeros(1, 1)
    return [o.name for o in predictor.recipe.kind.served(probe, None)]


def write_onnx(predictor: Predictor, input_shape: list[int], path: Path) -> None:
    """``model.onnx`` of the served computation; input ``input`` float32 ``[rows, *input_shape]``
    (raw rows, as the API takes them)."""
    for module in ("onnx", "onnxscript"):
        try:
            __import__(module)
        except ImportError:
            raise TensorTurnError(f"--format onnx needs the {module!r} package: {EXTRA}") from None
    graph = ServedGraph(predictor).eval()
    example = torch.zeros([2, *input_shape], dtype=torch.float32)
    rows = torch.export.Dim("rows", min=1, max=1 << 20)
    try:
        with quiet_exporter():
            program = torch.onnx.export(graph, (example,), input_names=["input"],
                                        output_names=served_names(predictor),
                                        dynamic_shapes=({0: rows},), dynamo=True, optimize=True,
                                        verbose=False)
    except Exception as exc:  # noqa: BLE001 - the recipe's code does not trace: one line
        raise SpecError(f"--format onnx: recipe {predictor.recipe.ref!r} does not export to ONNX: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    if program is None:
        raise TensorTurnError("--format onnx: torch.onnx.export returned no program")
    program.save(str(path))


@contextmanager
def quiet_exporter() -> Iterator[None]:
    """torch's exporter logs what it skips (torchvision's ops) and warns of its own deprecations
    on every export: nothing a user of ``export`` can act on. Errors still raise."""
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        exporter_log.setLevel(level)


def gpt2_state(model: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """charlm's GPT as ``GPT2LMHeadModel``: (its GPT2Config arguments, its state dict)."""
    from tensorturn.recipes.charlm import GPT

    if not isinstance(model, GPT):
        raise SpecError(f"--format transformers: the model is a {type(model).__name__}, not charlm's GPT "
                        f"(recipes charlm, gpt2-small and textlm map onto transformers' GPT-2)")
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    vocab, n_embd = sd["head.weight"].shape
    blocks = list(model.blocks)
    n_layer = len(blocks)
    n_head = int(getattr(blocks[0].attn, "n_head")) if blocks else 1  # noqa: B009 - a plain int attribute
    context = int(getattr(model, "context"))  # noqa: B009
    config = {"vocab_size": int(vocab), "n_positions": context, "n_embd": int(n_embd),
              "n_layer": n_layer, "n_head": int(n_head), "n_inner": 4 * int(n_embd),
              "activation_function": "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
              "layer_norm_epsilon": float(model.ln_f.eps), "tie_word_embeddings": False,
              "bos_token_id": None, "eos_token_id": None}
    out = {"transformer.wte.weight": sd["tok.weight"], "transformer.wpe.weight": sd["pos.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"],
           "transformer.ln_f.bias": sd["ln_f.bias"] + fold_bias(sd["head.weight"], sd["head.bias"]),
           "lm_head.weight": sd["head.weight"]}
    pairs = {"ln_1": ("ln1", False), "attn.c_attn": ("attn.qkv", True), "attn.c_proj": ("attn.proj", True),
             "ln_2": ("ln2", False), "mlp.c_fc": ("mlp.0", True), "mlp.c_proj": ("mlp.2", True)}
    for i in range(n_layer):
        for theirs, (ours, conv1d) in pairs.items():
            weight = sd[f"blocks.{i}.{ours}.weight"]
            out[f"transformer.h.{i}.{theirs}.weight"] = weight.t().contiguous() if conv1d else weight
            out[f"transformer.h.{i}.{theirs}.bias"] = sd[f"blocks.{i}.{ours}.bias"]
    return config, out


def fold_bias(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """δ with weight·δ = bias (least squares in float64), or SpecError when no δ is exact."""
    w, b = weight.double(), bias.double()
    delta = torch.linalg.lstsq(w, b.unsqueeze(1)).solution.squeeze(1)
    error = float((w @ delta - b).abs().max()) if b.numel() else 0.0
    if error > FOLD_TOLERANCE * max(1.0, float(b.abs().max())):
        raise SpecError(f"--format transformers: the model's output bias does not fold into GPT-2's "
                        f"bias-free lm_head (off by {error:.2g}; a vocabulary of {weight.shape[0]} is "
                        f"wider than the model's {weight.shape[1]}); use --format onnx")
    return delta.float()


def write_gpt2(predictor: Predictor, path: Path) -> None:
    """``transformers/``: a GPT2LMHeadModel folder (``from_pretrained`` loads it)."""
    if predictor.vote != "single":
        raise SpecError(f"--format transformers holds one model; this run is an ensemble of "
                        f"{len(predictor.models)} (export it without the format, or use --format onnx)")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise TensorTurnError(f"--format transformers needs the 'transformers' package: {EXTRA}") from None
    config, state = gpt2_state(predictor.models[0])
    model = GPT2LMHeadModel(GPT2Config(**config))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # GPT-2 keeps a causal mask as a buffer in some transformers versions: not a weight
    missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise TensorTurnError(f"--format transformers: the GPT-2 layout did not map (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per shard written, on the export command's stderr
    try:
        model.save_pretrained(str(path), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
