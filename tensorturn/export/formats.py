"""Third-party formats of an exported model, where the architecture maps.

* ONNX (``model.onnx``), any recipe whose preprocessing and model trace with ``torch.export``:
  the graph is the *served* computation — raw rows in, the recipe's preprocessing, every model,
  the vote, and the outputs the API serves (``label`` + ``probabilities``, or ``prediction``)
  out — so an ONNX runtime answers what ``tensorturn serve`` answers. Written by torch's own
  exporter (``torch.onnx.export(dynamo=True)``, which needs ``onnx`` and ``onnxscript``), with the
  number of rows left dynamic.
* transformers (the folder itself: ``config.json``, ``model.safetensors``,
  ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``): charlm's GPT
  (``charlm``, ``gpt2-small``, ``textlm``) as a ``GPT2LMHeadModel``, so ``AutoTokenizer``,
  ``AutoModelForCausalLM`` and ``pipeline("text-generation")`` load the folder as it is. The
  layouts map one to one — token and position embeddings, pre-LayerNorm blocks with a fused
  q|k|v projection, a 4× MLP, a final LayerNorm — with three differences handled here: GPT-2's
  ``Conv1D`` keeps its weight transposed; charlm's MLP uses exact GELU
  (``activation_function="gelu"``, not GPT-2's tanh ``gelu_new``); and charlm's head has a bias
  where GPT-2's ``lm_head`` has none. The bias is folded into the final LayerNorm's: with W the
  head's weight, b its bias, solve W·δ = b and add δ to ``ln_f.bias`` (W·(y + δ) = W·y + b). That
  is exact when b lies in W's column space — always for a vocabulary no wider than the model (256
  bytes ≤ 768 for gpt2-small) with W of full rank; otherwise the export is refused rather than
  written approximately.

  The tokenizer encodes text as the recipe does (the ``tokenizers`` library, no Python code to
  trust): charlm's is a character-level WordLevel over its vocabulary (one token per character,
  an unknown character an error, as charlm refuses it); gpt2-small's and textlm's is GPT-2's
  byte-level mapping with no merges, so a token is a UTF-8 byte. The vocabularies have no
  begin/end-of-text token (the models were trained on running text), so none is declared: a
  generation runs to its length. Padding (a batch of prompts of different lengths) uses id 0
  under the attention mask, which transformers' GPT-2 honours (positions from the mask); a prompt
  and its continuation fit the model's context (``n_positions``).
"""

from __future__ import annotations

import json
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


def onnx_metadata(doc: dict[str, Any]) -> dict[str, str]:
    """The graph's ``metadata_props`` (``session.get_modelmeta().custom_metadata_map`` in
    onnxruntime): what a runtime needs to read the outputs — the task, the class names in label
    order — and where the model came from, from ``tensorturn.json``'s ``doc`` (already public)."""
    props = {"tensorturn.format": str(doc["format"]), "tensorturn.task": str(doc["task"]),
             "tensorturn.recipe": json.dumps(doc["recipe"], sort_keys=True),
             "tensorturn.run_id": str(doc["lineage"]["run_id"]),
             "tensorturn.model_sha256": str(doc["model_sha256"]),
             "tensorturn.input": json.dumps(doc["input"], sort_keys=True),
             "tensorturn.outputs": json.dumps(doc["outputs"], sort_keys=True)}
    if doc.get("classes"):
        props["tensorturn.classes"] = json.dumps(doc["classes"])
    if doc.get("vocabulary"):
        props["tensorturn.vocabulary"] = json.dumps(doc["vocabulary"])
    return props


def write_onnx(predictor: Predictor, doc: dict[str, Any], path: Path) -> None:
    """``model.onnx`` of the served computation; input ``input`` float32 ``[rows, *input_shape]``
    (raw rows, as the API takes them); ``metadata_props`` from ``doc`` (:func:`onnx_metadata`)."""
    input_shape = doc["input"]["shape"]
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
    program.model.metadata_props.update(onnx_metadata(doc))
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
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0}
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


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map (Radford et al. 2019, its ``encoder.py``): the
    printable Latin-1 bytes stand for themselves, the others for the characters from U+0100 on,
    in order. The ``tokenizers`` ByteLevel pre-tokenizer writes a text's bytes with it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tokenizer(recipe: Any) -> Any:
    """A ``PreTrainedTokenizerFast`` that encodes text to the ids the recipe's ``encode`` gives
    (module docstring): byte-level for a recipe over UTF-8 bytes, else one token per character
    of the recipe's vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tensorturn.recipes.charlm import ByteVocabulary

    if isinstance(recipe, ByteVocabulary):
        alphabet = byte_alphabet()
        tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok = Tokenizer(models.WordLevel(vocab={ch: i for i, ch in enumerate(recipe.vocab())}))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # each character
        tok.decoder = decoders.Fuse()  # characters joined as they are, no space between
    # clean_up_tokenization_spaces: off, or decode would drop the space before "." and ","
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=int(recipe.context),
                                   clean_up_tokenization_spaces=False)


def write_gpt2(predictor: Predictor, path: Path) -> list[str]:
    """The folder ``path`` as a transformers folder (module docstring): a ``GPT2LMHeadModel``
    (``config.json``, ``model.safetensors``), its ``generation_config.json`` and tokenizer.
    Returns the names written."""
    if predictor.vote != "single":
        raise SpecError(f"--format transformers holds one model; this run is an ensemble of "
                        f"{len(predictor.models)} (export it without the format, or use --format onnx)")
    try:
        from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel
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
    # greedy, as `predict`'s label; no end-of-text token to stop at; id 0 pads under the mask
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                               do_sample=False)
    from transformers.utils import logging as hf_logging

    before = set(path.iterdir())
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per shard written, on the export command's stderr
    try:
        model.save_pretrained(str(path), safe_serialization=True)
        tokenizer(predictor.recipe).save_pretrained(str(path))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return sorted(p.name for p in set(path.iterdir()) - before)
