"""Vocabulary transfer: give a base model's embedding a new tokenizer's rows before phase 1.

A token whose string is in both vocabularies keeps its base row exactly. A new token's row is the
mean of the base rows of the base tokenizer's pieces for the same bytes (so "Ġbaşqa" starts where
"Ġba" + "ÅŁ" + "qa" were). A special token absent from the base starts at the mean of all base rows.
Both tokenizers are byte-level BPE (ours and Llama 3's), so a token string names the same bytes in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer


@dataclass(frozen=True)
class TransferStats:
    copied: int
    averaged: int
    special_mean: int

    def __str__(self) -> str:
        return f"copied={self.copied} averaged={self.averaged} special_mean={self.special_mean}"


def transfer_embedding(
    base_rows: torch.Tensor, base_tok: Tokenizer, new_tok: Tokenizer, new_vocab_size: int | None = None
) -> tuple[torch.Tensor, TransferStats]:
    """New (new_vocab_size, dim) fp32 matrix built from `base_rows` (base_vocab, dim); ids past the
    tokenizer's (padding up to a multiple) get the overall mean too."""
    base_rows = base_rows.float()
    base_vocab = base_tok.get_vocab(with_added_tokens=True)
    new_vocab = new_tok.get_vocab(with_added_tokens=True)
    n = new_vocab_size or new_tok.get_vocab_size(with_added_tokens=True)
    mean = base_rows.mean(0)
    out = mean.repeat(n, 1)
    specials = {i for i, t in new_tok.get_added_tokens_decoder().items() if t.special}
    copied = averaged = special_mean = 0
    for token, i in new_vocab.items():
        if i >= n:
            raise ValueError(f"tokenizer id {i} ({token!r}) is outside the model's vocab of {n}")
        j = base_vocab.get(token)
        if j is not None and j < base_rows.shape[0]:
            out[i] = base_rows[j]
            copied += 1
        elif i in specials:
            special_mean += 1
        else:
            # The base BPE model applied straight to the byte-level string: the same bytes, its pieces.
            pieces = [t.id for t in base_tok.model.tokenize(token) if t.id < base_rows.shape[0]]
            if pieces:
                out[i] = base_rows[pieces].mean(0)
                averaged += 1
            else:
                special_mean += 1
    return out, TransferStats(copied, averaged, special_mean)
