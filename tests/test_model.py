"""Our Llama against transformers' LlamaForCausalLM: same weights, same logits and loss."""

import pytest
import torch
import torch.nn.functional as F

from minilm_az.model import KVCache, Llama, ModelConfig, build_model, get_preset

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "gqa-tied-llama3rope": ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=160,
        vocab_size=300,
        rope_theta=500000.0,
        rope_factor=32.0,
        rope_original_max_seq_len=16,
        tie_embeddings=True,
        max_seq_len=128,
    ),
    "mha-untied-plainrope": ModelConfig(
        dim=48,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=96,
        vocab_size=257,
        rope_theta=10000.0,
        rope_factor=None,
        tie_embeddings=False,
        max_seq_len=64,
    ),
}


def hf_twin(model: Llama):
    """A transformers LlamaForCausalLM with our config and a copy of our weights."""
    from minilm_az.hf import config_to_hf

    cfg = transformers.LlamaConfig(
        **{
            k: v
            for k, v in config_to_hf(model.config, torch.float32).items()
            if k not in ("architectures", "model_type", "torch_dtype")
        }
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if model.config.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(name):
    model = build_model(CONFIGS[name], seed=1).eval()
    hf = hf_twin(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ours.shape == (2, 40, model.config.vocab_size)
    assert (ours - theirs).abs().max().item() < 1e-5


def test_llama3_rope_scaling_changes_frequencies():
    # With original context 16 the scaling touches most frequencies; a wrong formula would not match HF above.
    from minilm_az.model import rope_inv_freq

    cfg = CONFIGS["gqa-tied-llama3rope"]
    plain = rope_inv_freq(ModelConfig(**{**cfg.to_dict(), "rope_factor": None}))
    scaled = rope_inv_freq(cfg)
    assert not torch.allclose(plain, scaled)
    # With the published 1B settings the highest frequency is kept and the lowest slowed by the factor.
    one_b = get_preset("llama3.2-1b")
    p1, s1 = rope_inv_freq(ModelConfig(**{**one_b.to_dict(), "rope_factor": None})), rope_inv_freq(one_b)
    assert s1[0] == p1[0] and torch.allclose(s1[-1], p1[-1] / 32)


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_matches_cross_entropy_and_transformers(name):
    model = build_model(CONFIGS[name], seed=2)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(1))
    targets = ids.roll(-1, dims=1)
    targets[:, -1] = -100
    targets[1, :5] = -100
    loss = model(ids, targets=targets)
    with torch.no_grad():
        ref = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert abs(loss.item() - ref.item()) < 1e-5
    # transformers shifts labels itself: labels=ids is the same as our targets shifted left
    t2 = ids.roll(-1, dims=1)
    t2[:, -1] = -100
    hf_loss = hf_twin(model)(ids, labels=ids).loss
    assert abs(model(ids, targets=t2).item() - hf_loss.item()) < 1e-5


def test_chunked_loss_gradients_match_full_logits():
    model = build_model(CONFIGS["gqa-tied-llama3rope"], seed=3)
    ids = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(2))
    targets = ids.roll(-1, 1)
    targets[0, 3:9] = -100
    model(ids, targets=targets).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
    for n, p in model.named_parameters():
        assert torch.allclose(ours[n], p.grad, atol=1e-6, rtol=1e-4), n


def test_sum_reduction_is_total_nll():
    model = build_model(CONFIGS["mha-untied-plainrope"], seed=4)
    ids = torch.randint(0, 257, (2, 16))
    t = ids.roll(-1, 1)
    t[:, -1] = -100
    with torch.no_grad():
        total = model(ids, targets=t, reduction="sum")
        mean = model(ids, targets=t)
    assert abs(total.item() - mean.item() * 30) < 1e-3


def test_meta_build_allocates_nothing_until_materialised():
    from minilm_az.model import meta_model

    m = meta_model(get_preset("llama3.2-1b"))
    assert all(p.is_meta for p in m.parameters())
    assert m.lm_head.weight is m.model.embed_tokens.weight
    n = sum(p.numel() for p in m.parameters())
    assert n == get_preset("llama3.2-1b").num_params() == 1_235_814_400  # Llama 3.2 1B's published count


def test_kv_cache_decoding_matches_full_forward():
    model = build_model(CONFIGS["gqa-tied-llama3rope"], seed=5).eval()
    ids = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config, 1, 32, "cpu", torch.float32)
        first = model(ids[:, :12], cache=cache, pos=0)
        steps = [model(ids[:, i : i + 1], cache=cache, pos=i) for i in range(12, 16)]
        chunk = model(ids[:, 16:], cache=cache, pos=16)  # a multi-token chunk on a non-empty cache
    got = torch.cat([first] + steps + [chunk], dim=1)
    assert (got - full).abs().max() < 1e-5


def test_bad_config_and_too_long_input_are_clear_errors():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(dim=64, n_heads=4, n_kv_heads=3)
    model = build_model(CONFIGS["mha-untied-plainrope"])
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))
