"""Bits per byte: exact on a uniform byte model, every target scored once, the same over any number of ranks."""

import math

import numpy as np
import pytest
import torch

from minilm_az import bpb
from minilm_az.model import ModelConfig, build_model

BYTES = ModelConfig(
    dim=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    ffn_dim=64,
    vocab_size=256,
    rope_factor=None,
    tie_embeddings=False,
    max_seq_len=64,
)
TEXT = "Azərbaycan dili türk dillərinin oğuz qrupuna daxildir. Bakı, Gəncə, Sumqayıt. " * 3


def byte_stream(text: str) -> np.ndarray:
    """A context token, then the UTF-8 bytes as ids 0..255: every byte is a target once."""
    return np.concatenate([[0], np.frombuffer(text.encode("utf-8"), dtype=np.uint8)]).astype(np.int64)


@pytest.fixture(scope="module")
def uniform():
    """Our Llama with a zero head: logits 0 for all 256 ids, whatever the input."""
    model = build_model(BYTES, seed=1)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


def test_uniform_model_over_bytes_gives_exactly_8_bits_per_byte(uniform):
    tokens = byte_stream(TEXT)
    n_bytes = len(TEXT.encode("utf-8"))
    assert n_bytes % 48 != 0  # the last window is padded: its IGNORE targets must add nothing
    token_bytes = np.ones(256, dtype=np.int64)  # each id is one byte
    nll, count, scored_bytes = bpb.total_nll(
        uniform, tokens, seq_len=48, micro_batch=3, device="cpu", token_bytes=token_bytes
    )
    assert count == n_bytes == scored_bytes
    assert nll == pytest.approx(n_bytes * math.log(256), rel=1e-6)
    assert bpb.bits_per_byte(nll, n_bytes) == pytest.approx(8.0, abs=1e-5)


@pytest.mark.parametrize("n, seq_len", [(2, 4), (17, 4), (16, 4), (100, 7), (5, 64)])
def test_windows_cover_every_target_exactly_once(n, seq_len):
    tokens = np.arange(n, dtype=np.int64)  # each id is its position
    targets = []
    for x, y in bpb.windows(tokens, seq_len):
        assert x.shape == y.shape == (seq_len,)
        real = y != bpb.IGNORE
        np.testing.assert_array_equal(y[real], x[real] + 1)  # each target is predicted from the token before it
        assert real[: real.sum()].all()  # padding only at the end
        targets += y[real].tolist()
    assert targets == list(range(1, n))


def test_doc_stream_puts_eos_before_and_after_each_document():
    s = bpb.doc_stream([[5, 6], [7]], eos_id=1)
    np.testing.assert_array_equal(s, [1, 5, 6, 1, 7, 1])
    assert s.dtype == np.int64


@pytest.mark.parametrize("world", [2, 3])
def test_rank_shares_sum_to_the_one_rank_total(world):
    model = build_model(BYTES, seed=2)  # a random (not uniform) model: per-window NLLs differ
    tokens = byte_stream(TEXT)
    one_nll, one_count, _ = bpb.total_nll(model, tokens, seq_len=16, micro_batch=2, device="cpu")
    shares = [bpb.total_nll(model, tokens, 16, 2, "cpu", rank=r, world_size=world) for r in range(world)]
    assert sum(c for _, c, _ in shares) == one_count == len(tokens) - 1
    assert sum(n for n, _, _ in shares) == pytest.approx(one_nll, rel=1e-6)
    assert all(c > 0 for _, c, _ in shares)
    # And the same as plain cross-entropy on the logits of each window, scored one by one.
    ref = 0.0
    for x, y in bpb.windows(tokens, 16):
        with torch.no_grad():
            logits = model(torch.from_numpy(x)[None])[0]
        ref += float(
            torch.nn.functional.cross_entropy(logits, torch.from_numpy(y), ignore_index=bpb.IGNORE, reduction="sum")
        )
    assert one_nll == pytest.approx(ref, rel=1e-5)


def test_bits_per_byte_needs_bytes():
    assert bpb.bits_per_byte(math.log(2) * 10, 10) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="positive number of bytes"):
        bpb.bits_per_byte(1.0, 0)


@pytest.mark.parametrize("world", [2, 3])
def test_a_capped_evaluation_scores_the_same_tokens_and_bytes_on_any_number_of_ranks(world):
    model = build_model(BYTES, seed=3)
    tokens = byte_stream(TEXT)
    token_bytes = np.ones(256, dtype=np.int64)
    token_bytes[0] = 0  # pretend id 0 is a special token: scored, but no bytes
    one = bpb.total_nll(model, tokens, 16, 2, "cpu", max_windows=5, token_bytes=token_bytes)
    shares = [
        bpb.total_nll(model, tokens, 16, 2, "cpu", rank=r, world_size=world, max_windows=5, token_bytes=token_bytes)
        for r in range(world)
    ]
    assert one[1] == 5 * 16 < len(tokens) - 1  # the cap is in windows over all ranks
    assert sum(s[1] for s in shares) == one[1] and sum(s[2] for s in shares) == one[2]
    assert sum(s[0] for s in shares) == pytest.approx(one[0], rel=1e-6)
    exact = int(token_bytes[tokens[1 : 5 * 16 + 1]].sum())  # the bytes of exactly the scored targets
    assert one[2] == exact
