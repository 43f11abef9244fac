"""Deterministic training batches over token shards.

The sequences of optimizer step `s` depend only on (seed, s): `global_batch` random windows of
`seq_len + 1` tokens. Rank r of W takes its contiguous slice of them and walks it in micro-batches.
So a resumed run sees exactly the batches it would have seen, and any number of processes
(with gradient accumulation making up the rest) trains on the same sequences at every step.
"""

from __future__ import annotations

import numpy as np
import torch

from minilm_az.shards import TokenStream


class BatchStream:
    """The (inputs, targets) micro-batches of each optimizer step, for one rank."""

    def __init__(
        self,
        stream: TokenStream,
        seq_len: int,
        global_batch: int,
        micro_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        if global_batch % (micro_batch * world_size):
            raise ValueError(
                f"--global-batch {global_batch} is not divisible by --micro-batch {micro_batch} x "
                f"{world_size} processes; pick values where it is"
            )
        if stream.num_tokens < seq_len + 2:
            raise ValueError(
                f"the {stream.split} split has {stream.num_tokens} tokens, fewer than one sequence "
                f"of --seq-len {seq_len}: use a shorter --seq-len or more data"
            )
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.rank, self.world_size = rank, world_size
        self.accum_steps = global_batch // (micro_batch * world_size)

    def step_offsets(self, step: int) -> np.ndarray:
        """Start offsets of all `global_batch` windows of optimizer step `step` (same on every rank)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, self.stream.num_tokens - self.seq_len - 1, size=self.global_batch)

    def micro_batches(self, step: int, device: torch.device | str = "cpu"):
        """Yield this rank's `accum_steps` (inputs, targets) pairs for `step`, each (micro_batch, seq_len)."""
        per_rank = self.global_batch // self.world_size
        mine = self.step_offsets(step)[self.rank * per_rank : (self.rank + 1) * per_rank]
        for i in range(self.accum_steps):
            offsets = mine[i * self.micro_batch : (i + 1) * self.micro_batch]
            rows = [self.stream.get(int(offset), self.seq_len + 1) for offset in offsets]
            windows = torch.from_numpy(np.stack(rows))
            if torch.device(device).type == "cuda":
                windows = windows.pin_memory().to(device, non_blocking=True)
            yield windows[:, :-1], windows[:, 1:]  # the target of each token is the token after it
