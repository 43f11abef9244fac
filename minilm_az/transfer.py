"""Vocabulary transfer: give a base model's embedding a new tokenizer's rows before phase 1.

A token whose string is in both vocabularies keeps its base row exactly. A new token gets the mean
of the rows of the base tokenizer's pieces for the same bytes ("ĠbaÅŁqa", " başqa", gets the mean
of "Ġba", "ÅŁ" and "qa"). A special token absent from the base gets the mean of all base rows. Both
tokenizers are byte-level BPE (ours and Llama 3's), so a token string names the same bytes in both.
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
    """Return `new_tok`'s fp32 rows (new_vocab_size, dim), built from `base_rows`, and the stats.
    Ids past the tokenizer's vocabulary (padding up to a multiple) get the mean of all base rows."""
    base_rows = base_rows.float()
    base_vocab = base_tok.get_vocab(with_added_tokens=True)
    new_vocab = new_tok.get_vocab(with_added_tokens=True)
    num_rows = new_vocab_size or new_tok.get_vocab_size(with_added_tokens=True)
    mean = base_rows.mean(0)
    out = mean.repeat(num_rows, 1)
    specials = {i for i, t in new_tok.get_added_tokens_decoder().items() if t.special}
    copied = averaged = special_mean = 0
    for token, new_id in new_vocab.items():
        if new_id >= num_rows:
            raise ValueError(f"tokenizer id {new_id} ({token!r}) is outside the model's vocab of {num_rows}")
        base_id = base_vocab.get(token)
        if base_id is not None and base_id < base_rows.shape[0]:
            out[new_id] = base_rows[base_id]
            copied += 1
        elif new_id in specials:
            special_mean += 1
        else:
            # Run the base BPE model on the byte-level string. It splits the same bytes into base pieces.
            pieces = [t.id for t in base_tok.model.tokenize(token) if t.id < base_rows.shape[0]]
            if pieces:
                out[new_id] = base_rows[pieces].mean(0)
                averaged += 1
            else:
                special_mean += 1
    return out, TransferStats(copied, averaged, special_mean)
