"""Built-in recipe ``charlm``: a small character-level GPT (nanoGPT-style) over a UTF-8 text.

Options (``--recipe-option KEY=VALUE``):

* ``data`` — path of a UTF-8 text file, read on every machine (so it must exist there, with the
  same content). Default: a built-in corpus, the source text of a fixed, sorted list of Python
  standard-library modules (:data:`CORPUS_MODULES`), concatenated and cut at
  :data:`CORPUS_CHARS` characters. No download; every machine with the same Python version gets
  the same text.
* ``context`` — characters per window (default 64).
* ``n_layer``, ``n_head``, ``n_embd``, ``dropout`` — the model's size (default 2, 4, 128, 0.0);
  they set :meth:`CharLM.default_config`, the configuration a fused run trains.
* ``vocabulary`` — the characters, in id order (a string or a list of characters), instead of
  the text's: the model and its input check are then built without reading the text. An
  exported folder loads with it (:meth:`CharLM.standalone_options`), so it needs no text file;
  a text with a character outside it cannot be trained on.

Data. The vocabulary is the sorted set of the text's characters. The text is split by position:
the first 90 % is the training text, the next 5 % validation, the last 5 % test. Each part is cut
into non-overlapping windows (stride = ``context``); a window's input is ``context`` characters and
its target the same characters shifted by one. Validation and test keep at most
:data:`MAX_EVAL_WINDOWS` windows each (the first ones), so evaluation stays cheap on a laptop.
Raw inputs are character ids (int64, shape ``[N, context]``); ``preprocess`` keeps them as int64.

Model. Token and position embeddings, ``n_layer`` pre-LayerNorm blocks of causal self-attention
(``scaled_dot_product_attention(is_causal=True)``) and a 4× MLP, a final LayerNorm and a linear
head (not tied to the embedding, so every tensor is its own: safetensors stores no shared
memory). The model has no buffers, so every entry of its state is a trained float tensor.

Loss and metrics are per character: cross-entropy over every position; ``evaluate`` reports the
mean NLL in nats per character and next-character accuracy; ``predict_proba`` is the
distribution of the character after each input window (its last position).
"""

from __future__ import annotations

import importlib.util
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tensorturn.recipes.base import Recipe

# The default corpus: these modules' source files, in this order, joined by a header line each.
CORPUS_MODULES = ("argparse", "bisect", "calendar", "colorsys", "contextlib", "copy", "csv",
                  "dataclasses", "difflib", "enum", "fnmatch", "fractions", "functools")
CORPUS_CHARS = 400_000
TRAIN_FRACTION, VAL_FRACTION = 0.90, 0.05    # the test split is the rest (the last 5 %)
MAX_EVAL_WINDOWS = 512
EVAL_BATCH = 128


@lru_cache(maxsize=4)
def load_text(data: str | None) -> str:
    """The recipe's text: the file at ``data``, or the built-in corpus when ``data`` is None."""
    if data is not None:
        return Path(data).expanduser().read_text(encoding="utf-8")
    parts = []
    for name in CORPUS_MODULES:
        found = importlib.util.find_spec(name)
        assert found is not None and found.origin is not None, name  # standard library modules
        origin = found.origin
        parts.append(f"# ---- {name} ----\n" + Path(origin).read_text(encoding="utf-8"))
    return "\n".join(parts)[:CORPUS_CHARS]


def windows(ids: torch.Tensor, context: int, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping (input, next-character target) windows of a 1-D id sequence."""
    n = (len(ids) - 1) // context
    if limit is not None:
        n = min(n, limit)
    x = ids[: n * context].view(n, context)
    y = ids[1: n * context + 1].view(n, context)
    return x.clone(), y.clone()


# ---- the model --------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head size)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Character ids [B, T] (T ≤ context) → next-character logits [B, T, vocab]."""

    def __init__(self, vocab_size: int, context: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(context, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)
        # GPT-2's initialisation: N(0, 0.02), zero biases, residual projections scaled down by
        # sqrt(2 · layers) so the residual stream does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"input of {t} characters exceeds the context of {self.context}")
        positions = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---- the recipe -------------------------------------------------------------------------------

class ByteVocabulary:
    """A language model over UTF-8 bytes: the vocabulary is the 256 byte values, whatever the text."""

    def vocab(self) -> list[str]:
        return [chr(i) for i in range(256)]

    def standalone_options(self) -> dict[str, Any]:
        return {}  # the 256 bytes, whatever the text: nothing to carry

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor(list(s.encode("utf-8")), dtype=torch.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class CharLM(Recipe):
    name = "charlm"
    task = "language_model"
    # AdamW lr: best of {5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3} for the default model after 400
    # steps of batch 32 (validation NLL 1.74, 1.64, 1.65, 1.73, 2.01, 2.22 nats/char)
    lr = 1e-3
    batch_size = 32
    input_dtype = "INT64"

    def __init__(self, data: str | None = None, context: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.0,
                 vocabulary: str | list[str] | None = None):
        for key, value in (("context", context), ("n_layer", n_layer), ("n_head", n_head),
                           ("n_embd", n_embd)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a whole number ≥ 1 (got {value!r})")
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        if not 0 <= float(dropout) < 1:
            raise ValueError(f"dropout must be in [0, 1) (got {dropout!r})")
        self.data = None if data is None else str(data)
        self.vocabulary = None if vocabulary is None else _fixed_vocabulary(vocabulary)
        self.context = context
        self._config = {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd,
                        "dropout": float(dropout)}

    # the text and its vocabulary, computed once per process (plain Python: no tensors, so this
    # also works inside torch.device("meta") where capacity.estimate builds the model)
    def text(self) -> str:
        return load_text(self.data)

    def vocab(self) -> list[str]:
        return list(self.vocabulary) if self.vocabulary is not None else _vocab(self.data)

    def standalone_options(self) -> dict[str, Any]:
        """The vocabulary: without it the model's size is that of the text's character set,
        which a machine without the text (or, for the built-in corpus, with another Python)
        cannot rebuild."""
        return {"vocabulary": self.vocab()}

    def input_shape(self) -> list[int]:
        return [self.context]  # a window of ids: known without reading the text

    def encode(self, s: str) -> torch.Tensor:
        index = {ch: i for i, ch in enumerate(self.vocab())}
        unknown = next((ch for ch in s if ch not in index), None)
        if unknown is not None:
            raise ValueError(f"character {unknown!r} is not in the vocabulary")
        return torch.tensor([index[ch] for ch in s], dtype=torch.int64)

    def decode(self, ids) -> str:
        vocab = self.vocab()
        return "".join(vocab[int(i)] for i in ids)

    def raw_data(self):
        text = self.text()
        ids = torch.tensor(_ids(self.data), dtype=torch.int64) if self.vocabulary is None else self.encode(text)
        a, b = int(len(ids) * TRAIN_FRACTION), int(len(ids) * (TRAIN_FRACTION + VAL_FRACTION))
        x_train, y_train = windows(ids[:a], self.context)
        x_val, y_val = windows(ids[a:b], self.context, MAX_EVAL_WINDOWS)
        x_test, y_test = windows(ids[b:], self.context, MAX_EVAL_WINDOWS)
        if min(len(x_train), len(x_val), len(x_test)) == 0:
            need = math.ceil((self.context + 1) / VAL_FRACTION)
            raise ValueError(f"the text has {len(text)} characters: too short for windows of "
                             f"{self.context} in every split (needs at least ~{need})")
        return x_train, y_train, x_val, y_val, x_test, y_test

    def preprocess(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.long()

    def check_input(self, raw: Any) -> str | None:
        vocab = len(self.vocab())
        if raw.size and (((raw % 1) != 0).any() or raw.min() < 0 or raw.max() >= vocab):
            return f"inputs are token ids: whole numbers from 0 to {vocab - 1}"
        return None

    def default_config(self) -> dict[str, Any]:
        """n_layer 2, n_head 4, n_embd 128, dropout 0.0 unless the options say otherwise."""
        return dict(self._config)

    def model(self, config: dict[str, Any]) -> nn.Module:
        return GPT(vocab_size=len(self.vocab()), context=self.context, n_layer=config["n_layer"],
                   n_head=config["n_head"], n_embd=config["n_embd"], dropout=config["dropout"])

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def predict_proba(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The distribution of the next character after each window: [N, vocab]."""
        model.eval()
        return torch.softmax(model(x)[:, -1, :], dim=-1)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Mean NLL (nats per character) and next-character accuracy over every position."""
        model.eval()
        device = next(model.parameters()).device
        nll, correct, count = 0.0, 0, 0
        for i in range(0, len(x), EVAL_BATCH):
            xb, yb = x[i:i + EVAL_BATCH].to(device), y[i:i + EVAL_BATCH].to(device)
            logits = model(xb).float()
            logits, yb = logits.reshape(-1, logits.shape[-1]), yb.reshape(-1)
            nll += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(-1) == yb).sum())
            count += yb.numel()
        return {"accuracy": correct / max(count, 1), "loss": nll / max(count, 1)}


def _fixed_vocabulary(vocabulary: Any) -> tuple[str, ...]:
    """The ``vocabulary`` option as a tuple of distinct characters, or ValueError."""
    chars = list(vocabulary) if isinstance(vocabulary, (str, list, tuple)) else None
    if not chars or not all(isinstance(c, str) and len(c) == 1 for c in chars):
        raise ValueError("vocabulary must be a non-empty string or list of single characters")
    if len(set(chars)) != len(chars):
        raise ValueError("vocabulary lists a character twice")
    return tuple(chars)


@lru_cache(maxsize=4)
def _vocab(data: str | None) -> list[str]:
    return sorted(set(load_text(data)))


@lru_cache(maxsize=4)
def _ids(data: str | None) -> tuple[int, ...]:
    index = {ch: i for i, ch in enumerate(_vocab(data))}
    return tuple(index[ch] for ch in load_text(data))
