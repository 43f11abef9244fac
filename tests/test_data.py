"""BatchStream: the batches of a step are a pure function of (seed, step), split across ranks without overlap."""

import numpy as np
import pytest

from minilm_az.data import BatchStream
from minilm_az.shards import ShardWriter, TokenStream

N_TOKENS = 5000


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """A train split of known ids (position mod 997) in shards of 700 tokens, so windows cross files."""
    out = tmp_path_factory.mktemp("shards") / "s"
    w = ShardWriter(str(out), vocab_size=1000, eos_id=999, tokenizer_hash="0" * 64, shard_tokens=700)
    w.add("train", np.arange(N_TOKENS) % 997, documents=1, nbytes=N_TOKENS)
    w.close()
    return TokenStream(str(out), "train")


def rows(bs: BatchStream, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.numpy(), y.numpy()) for x, y in bs.micro_batches(step)]


def test_batches_are_windows_of_the_stream_with_targets_shifted_by_one(stream):
    bs = BatchStream(stream, seq_len=16, global_batch=8, micro_batch=4, seed=3)
    everything = np.arange(N_TOKENS) % 997
    batches = rows(bs, 5)
    assert bs.accum_steps == 2 and len(batches) == 2
    starts = iter(bs.step_offsets(5))
    for x, y in batches:
        assert x.shape == y.shape == (4, 16)
        for xi, yi in zip(x, y):
            o = int(next(starts))
            np.testing.assert_array_equal(xi, everything[o : o + 16])
            np.testing.assert_array_equal(yi, everything[o + 1 : o + 17])


def test_a_step_is_a_pure_function_of_seed_and_step(stream):
    a = BatchStream(stream, seq_len=16, global_batch=8, micro_batch=2, seed=3)
    b = BatchStream(stream, seq_len=16, global_batch=8, micro_batch=2, seed=3)
    # Another instance, asked in another order (as after a resume), gives the same batches.
    first = {s: rows(a, s) for s in (0, 7, 3)}
    for s in (3, 0, 7):
        for (x1, y1), (x2, y2) in zip(first[s], rows(b, s)):
            np.testing.assert_array_equal(x1, x2)
            np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(a.step_offsets(3), a.step_offsets(4))
    other_seed = BatchStream(stream, seq_len=16, global_batch=8, micro_batch=2, seed=4)
    assert not np.array_equal(a.step_offsets(3), other_seed.step_offsets(3))


def test_rank_slices_concatenate_to_the_one_process_sequences(stream):
    one = np.concatenate([x for x, _ in rows(BatchStream(stream, 16, 8, micro_batch=2, world_size=1, seed=1), 4)])
    ranks = [BatchStream(stream, 16, 8, micro_batch=2, rank=r, world_size=2, seed=1) for r in (0, 1)]
    assert [r.accum_steps for r in ranks] == [2, 2]
    two = np.concatenate([x for r in ranks for x, _ in rows(r, 4)])
    np.testing.assert_array_equal(one, two)
    four = [BatchStream(stream, 16, 8, micro_batch=2, rank=r, world_size=4, seed=1) for r in range(4)]
    np.testing.assert_array_equal(one, np.concatenate([x for r in four for x, _ in rows(r, 4)]))


@pytest.mark.parametrize("global_batch, micro_batch, world", [(10, 4, 1), (8, 2, 3), (6, 4, 2)])
def test_a_global_batch_that_does_not_divide_is_refused(stream, global_batch, micro_batch, world):
    with pytest.raises(
        ValueError,
        match=f"--global-batch {global_batch} is not divisible by --micro-batch {micro_batch} x {world} processes",
    ):
        BatchStream(stream, 16, global_batch, micro_batch, world_size=world)


def test_a_split_shorter_than_one_sequence_is_refused(stream):
    with pytest.raises(ValueError, match="fewer than one sequence of --seq-len 5000"):
        BatchStream(stream, seq_len=N_TOKENS, global_batch=2, micro_batch=2)
