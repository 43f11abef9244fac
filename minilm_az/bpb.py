"""Bits per byte: a tokenizer-independent measure of how well a model predicts text.

BPB = (total NLL in nats) / (ln 2 * UTF-8 bytes of the text). Two models with different tokenizers
are compared on the same bytes: the stream scored is EOS, doc 1, EOS, doc 2, EOS, ... and every
document token and its closing EOS is predicted once (the leading EOS gives the first token a context).

The convention: the text is NFC-normalised once, and that string is both encoded and counted; EOS is
scored but stands for 0 bytes; the line breaks between documents are not counted. BPB depends on the
window length (`seq_len`): a longer window gives each token more context, so compare at equal windows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from minilm_az.model import IGNORE


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    if n_bytes <= 0:
        raise ValueError("bits per byte needs a positive number of bytes")
    return nll_nats / (math.log(2) * n_bytes)


def windows(tokens: np.ndarray, seq_len: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Cut a stream into (input, target) windows of seq_len; consecutive windows overlap by one token so
    every token after the first is a target exactly once. The last window is padded (targets IGNORE)."""
    n_targets = len(tokens) - 1
    for s in range(0, n_targets, seq_len):
        x = tokens[s : s + seq_len]
        y = tokens[s + 1 : s + seq_len + 1]
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


def rank_batches(items: Sequence, micro_batch: int, rank: int, world_size: int, filler: object) -> list[list]:
    """This rank's micro-batches of `items`, dealt out in rounds of `micro_batch` x `world_size` items.

    A sharded model needs every rank in each forward. So every rank gets one micro-batch a round, each of
    exactly `micro_batch` items, and `filler` (an item with no target) takes the place of missing items."""
    per_round = micro_batch * world_size
    filled = list(items) + [filler] * (-len(items) % per_round)  # whole rounds
    return [filled[s : s + micro_batch] for s in range(rank * micro_batch, len(filled), per_round)]


@torch.no_grad()
def total_nll(
    model,
    tokens: np.ndarray,
    seq_len: int,
    micro_batch: int,
    device,
    rank: int = 0,
    world_size: int = 1,
    max_windows: int | None = None,
    token_bytes: np.ndarray | None = None,
    progress=None,
) -> tuple[float, int, int]:
    """Summed NLL (nats), predicted tokens and their UTF-8 bytes over this rank's share of the windows.

    `max_windows` caps the windows scored, counted over all ranks, so a capped evaluation scores the same
    tokens on any number of processes; `token_bytes` (bytes per id) counts the exact bytes of the scored
    targets, which is what a capped evaluation must divide by. Every rank runs the same forwards
    (`rank_batches`), a rank short of windows an all-IGNORE one. Sum the results over ranks.
    `progress(done, total)` is called after each batch.
    """
    ws = list(windows(tokens, seq_len))[:max_windows]
    pad = (np.zeros(seq_len, dtype=np.int64), np.full(seq_len, IGNORE, dtype=np.int64))
    batches = rank_batches(ws, micro_batch, rank, world_size, filler=pad)
    nll, count, n_bytes = 0.0, 0, 0
    was_training = model.training
    model.eval()
    for b, mine in enumerate(batches, 1):
        y_np = np.stack([m[1] for m in mine])
        x = torch.from_numpy(np.stack([m[0] for m in mine])).to(device)
        y = torch.from_numpy(y_np).to(device)
        nll += float(model(x, targets=y, reduction="sum"))
        count += int((y_np != IGNORE).sum())
        if token_bytes is not None:
            n_bytes += int(token_bytes[y_np[y_np != IGNORE]].sum())
        if progress is not None:
            progress(b, len(batches))
    model.train(was_training)
    return nll, count, n_bytes
