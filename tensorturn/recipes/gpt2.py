"""Built-in recipe ``gpt2-small``: ``charlm``'s transformer at GPT-2 small's shape, byte-level.

12 layers, 12 heads, 768 wide, a context of 256 bytes: GPT-2 small's body. The vocabulary is the
256 byte values (UTF-8 bytes of the text) instead of GPT-2's 50,257 BPE tokens, so the model has
85.9M parameters rather than 124M — the difference is GPT-2's token embedding (38.6M). It is here
to exercise the system with a model that fills a consumer GPU's worth of optimizer state
(``benchmarks/bigmodel.py``); on a CPU it trains, slowly.

    tensorturn run --recipe gpt2-small --recipe-option data=book.txt --rounds 2 --sync-every 2

Options: ``data`` (a UTF-8 text file on every machine; default the built-in corpus of
``charlm``) and ``charlm``'s model options, with these defaults. For a pushed text dataset, use
``textlm`` with the same sizes: ``--recipe textlm --recipe-option dataset=NAME --recipe-option
n_layer=12 --recipe-option n_head=12 --recipe-option n_embd=768 --recipe-option context=256``.
"""

from __future__ import annotations

import torch

from tensorturn.recipes.charlm import (
    MAX_EVAL_WINDOWS,
    TRAIN_FRACTION,
    VAL_FRACTION,
    ByteVocabulary,
    CharLM,
    load_text,
    windows,
)


class GPT2Small(ByteVocabulary, CharLM):
    name = "gpt2-small"
    lr = 3e-4         # GPT-2 small's peak learning rate (AdamW)
    batch_size = 8
    eval_batch_size = 16

    def __init__(self, data: str | None = None, context: int = 256, n_layer: int = 12,
                 n_head: int = 12, n_embd: int = 768, dropout: float = 0.0):
        super().__init__(data, context, n_layer, n_head, n_embd, dropout)

    def raw_data(self):
        ids = torch.frombuffer(bytearray(load_text(self.data).encode("utf-8")), dtype=torch.uint8).long()
        a, b = int(len(ids) * TRAIN_FRACTION), int(len(ids) * (TRAIN_FRACTION + VAL_FRACTION))
        x_train, y_train = windows(ids[:a], self.context)
        x_val, y_val = windows(ids[a:b], self.context, MAX_EVAL_WINDOWS)
        x_test, y_test = windows(ids[b:], self.context, MAX_EVAL_WINDOWS)
        if min(len(x_train), len(x_val), len(x_test)) == 0:
            raise ValueError(f"the text has {len(ids)} bytes: too short for windows of "
                             f"{self.context} in every split")
        return x_train, y_train, x_val, y_val, x_test, y_test
