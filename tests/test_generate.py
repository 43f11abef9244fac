"""Generation: the KV-cache path gives the same greedy tokens as recomputing everything; stops; sampling."""

import os

import pytest
import torch

from minilm_az.chat import encode_prompt
from minilm_az.generate import generate, generate_ids, sample_next
from minilm_az.model import build_model, get_preset
from minilm_az.tokenizer import EOS, EOT, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return load_tokenizer(small_tokenizer_dir)


@pytest.fixture(scope="module")
def model(tok):
    # std 0.2: a random model with peaked logits, so greedy ties (which could flip on rounding) do not occur.
    m = build_model(get_preset("tiny", vocab_size=tok.get_vocab_size()), seed=11)
    m.init_weights(std=0.2, seed=11)
    return m.eval()


def test_kv_cache_greedy_equals_full_recompute(model):
    prompt = [0, 2, 100, 98, 311, 3, 214]
    cached = generate_ids(model, prompt, max_new_tokens=24, temperature=0)
    full = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            full.append(int(model(torch.tensor([full]))[0, -1].argmax()))
    full = full[len(prompt) :]
    assert len(cached) == 24 and cached == full
    assert len(set(cached)) > 1


def test_stops_at_stop_id_and_respects_max_seq_len(model):
    prompt = [0, 2, 100, 98]
    free = generate_ids(model, prompt, max_new_tokens=12, temperature=0)
    stop = free[5]
    assert generate_ids(model, prompt, 12, temperature=0, stop_ids=(stop,)) == free[: free.index(stop)]
    with pytest.raises(ValueError, match="leaves no room"):
        generate_ids(model, list(range(model.config.max_seq_len)), 4)


def test_sampling_is_seeded_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0])
    assert sample_next(logits, 0, 1.0) == 0
    g = lambda s: torch.Generator().manual_seed(s)
    assert {sample_next(logits, 1.0, 0.5, g(s)) for s in range(30)} <= {0, 1}
    assert {sample_next(logits, 1.0, 0.01, g(s)) for s in range(30)} == {0}
    assert len({sample_next(logits, 5.0, 1.0, g(s)) for s in range(60)}) == 4


def test_generate_applies_the_template_and_returns_text(model, tok):
    messages = [{"role": "user", "content": "Salam!"}]
    a = generate(model, tok, messages, max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3)
    b = generate(model, tok, messages, max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3)
    assert isinstance(a, str) and a == b
    prompt = encode_prompt(messages, tok)
    assert prompt[-1] == tok.encode("\n\n", add_special_tokens=False).ids[-1]  # ends with the assistant header
    stop = (tok.token_to_id(EOT), tok.token_to_id(EOS))
    greedy = generate_ids(model, prompt, 8, temperature=0, stop_ids=stop)
    assert generate(model, tok, messages, max_new_tokens=8, temperature=0) == tok.decode(
        greedy, skip_special_tokens=True
    )
    assert model.training is False
