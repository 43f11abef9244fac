"""Bits per byte: a tokenizer-independent measure of how well a model predicts text.

BPB = (total NLL in nats) / (ln 2 * UTF-8 bytes of the text). Two models with different tokenizers
are compared on the same bytes: the stream scored is EOS, doc 1, EOS, doc 2, EOS, ... and every
document token and its closing EOS is predicted once (the leading EOS gives the first token a context).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch

IGNORE = -100


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    if n_bytes <= 0:
        raise ValueError("bits per byte needs a positive number of bytes")
    return nll_nats / (math.log(2) * n_bytes)


def windows(tokens: np.ndarray, seq_len: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Cut a stream into (input, target) windows of seq_len; consecutive windows overlap by one token so
    every token after the first is a target exactly once. The last window is padded (targets IGNORE)."""
    n_targets = len(tokens) - 1
    for s in range(0, n_targets, seq_len):
        x = tokens[s:s + seq_len]
        y = tokens[s + 1:s + seq_len + 1]
        if len(x) < seq_len:
            x = np.concatenate([x, np.zeros(seq_len - len(x), dtype=x.dtype)])
        if len(y) < seq_len:
            y = np.concatenate([y, np.full(seq_len - len(y), IGNORE, dtype=y.dtype)])
        yield x, y


def doc_stream(docs: Iterable[list[int]], eos_id: int) -> np.ndarray:
    """EOS, doc 1, EOS, doc 2, ..., EOS as one int64 array."""
    parts = [np.array([eos_id], dtype=np.int64)]
    for d in docs:
        parts.append(np.asarray(d, dtype=np.int64))
        parts.append(np.array([eos_id], dtype=np.int64))
    return np.concatenate(parts)


@torch.no_grad()
def total_nll(model, tokens: np.ndarray, seq_len: int, micro_batch: int, device, rank: int = 0,
              world_size: int = 1, max_batches: int | None = None) -> tuple[float, int]:
    """Summed NLL (nats) and number of predicted tokens over this rank's share of the windows.

    Every rank runs the same number of forwards (a sharded model needs all ranks in each one); ranks
    short of windows run all-IGNORE padding batches. Sum the results over ranks.
    """
    ws = list(windows(tokens, seq_len))
    per_batch = micro_batch * world_size
    n_batches = math.ceil(len(ws) / per_batch)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    nll, count = 0.0, 0
    pad = (np.zeros(seq_len, dtype=np.int64), np.full(seq_len, IGNORE, dtype=np.int64))
    was_training = model.training
    model.eval()
    for b in range(n_batches):
        lo = b * per_batch + rank * micro_batch
        mine = [ws[i] if i < len(ws) else pad for i in range(lo, lo + micro_batch)]
        x = torch.from_numpy(np.stack([m[0] for m in mine])).to(device)
        y = torch.from_numpy(np.stack([m[1] for m in mine])).to(device)
        nll += float(model(x, targets=y, reduction="sum"))
        count += int((y != IGNORE).sum())
    model.train(was_training)
    return nll, count
