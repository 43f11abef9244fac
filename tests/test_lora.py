"""LoRA: the layer against its formula and autograd, injection, and our adapters loaded by peft."""

import json
import os

import pytest
import torch
from torch import nn

from minilm_az.hf import save_pretrained
from minilm_az.lora import (
    TARGETS,
    AdapterError,
    LoRALinear,
    apply_lora,
    count_parameters,
    draw_seed,
    keep_mask,
    load_adapter,
    lora_parameters,
    lora_state_dict,
    merge_lora,
    reset_lora_parameters,
    save_adapter,
)
from minilm_az.model import ModelConfig, build_model, get_preset, meta_model

CFG = ModelConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    vocab_size=320,
    rope_theta=500000.0,
    rope_factor=8.0,
    rope_original_max_seq_len=32,
    max_seq_len=256,
)


def _layer(r=4, alpha=8.0, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    base = nn.Linear(12, 10, bias=False)
    layer = LoRALinear(base, r, alpha, dropout)
    return base, layer


def _trained(layer, seed=1):
    with torch.no_grad():  # B is zero at init: give it values so the adapter does something
        layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=torch.Generator().manual_seed(seed)))
    return layer


def _ids(V=320, T=29):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(7))


def test_lora_linear_equals_base_at_init():
    base, layer = _layer()
    x = torch.randn(3, 5, 12)
    assert layer.lora_A.shape == (4, 12) and layer.lora_B.shape == (10, 4)
    assert torch.count_nonzero(layer.lora_A) > 0 and torch.count_nonzero(layer.lora_B) == 0
    assert layer.lora_A.abs().max() <= 1 / 12**0.5  # kaiming-uniform(a=sqrt 5): bound 1/sqrt(in)
    assert torch.equal(layer(x), base(x))


def test_lora_linear_matches_formula_and_autograd_with_dropout():
    """The seeded dropout branch (mask drawn again in backward) against autograd through the same mask."""
    _, layer = _layer(dropout=0.3)
    _trained(layer)
    layer.train()
    x = torch.randn(3, 4, 12, requires_grad=True)
    torch.manual_seed(123)
    y = layer(x)
    y.square().sum().backward()
    got = [t.grad.clone() for t in (x, layer.lora_A, layer.lora_B)]
    for t in (x, layer.lora_A, layer.lora_B):
        t.grad = None
    torch.manual_seed(123)
    keep = keep_mask(x, 0.3, draw_seed())
    assert 0.5 < keep.float().mean() < 0.9  # a Bernoulli(0.7) mask
    dx = x * keep / 0.7
    by_hand = x @ layer.weight.T + layer.scaling * dx @ layer.lora_A.T @ layer.lora_B.T
    assert layer.scaling == 8.0 / 4
    torch.testing.assert_close(y, by_hand, rtol=0, atol=1e-5)
    by_hand.square().sum().backward()
    for g, t in zip(got, (x, layer.lora_A, layer.lora_B)):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5 * float(t.grad.abs().max()))
    layer.eval()  # dropout off in eval
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ layer.weight.T + 2.0 * x @ layer.lora_A.T @ layer.lora_B.T)


def test_compiled_lora_with_dropout_trains_and_matches_eager_without():
    """--compile: a compiled LoRA layer traces whole with dropout on (the eager seeded branch is bypassed, the
    mask drawn in-graph), its adapter output differs from the undropped one, and with dropout 0 it gives
    eager's gradients."""
    torch.manual_seed(0)
    _, layer = _layer(dropout=0.5)
    _trained(layer)
    layer.train()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # the trace, not a C++ toolchain
    x = torch.ones(64, 12, requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    base_out = x.detach() @ layer.weight.T
    delta = (y.detach() - base_out) / layer.scaling  # dropout(x) A^T B^T
    full = x.detach() @ layer.lora_A.T @ layer.lora_B.T
    assert not torch.allclose(delta, full, atol=1e-4)  # dropout acted
    assert layer.lora_A.grad is not None and layer.lora_A.grad.abs().sum() > 0
    for p in (x, layer.lora_A, layer.lora_B):
        p.grad = None
    layer.lora_dropout = nn.Identity()
    layer(x).square().sum().backward()
    want = [t.grad.clone() for t in (x, layer.lora_A, layer.lora_B)]
    for p in (x, layer.lora_A, layer.lora_B):
        p.grad = None
    torch._dynamo.reset()
    torch.compile(layer, fullgraph=True, backend="aot_eager")(x).square().sum().backward()
    for g, t in zip(want, (x, layer.lora_A, layer.lora_B)):
        torch.testing.assert_close(t.grad, g)


def test_adapters_sharing_an_input_save_it_once_and_no_dropout_output():
    """q/k/v-style adapters on one input: autograd keeps that input once, not a dropped copy and mask each."""
    torch.manual_seed(0)
    layers = [LoRALinear(nn.Linear(64, 64, bias=False), 4, 8.0, 0.1) for _ in range(3)]
    x = torch.randn(32, 64, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for m in layers for p in m.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sum(m(x).sum() for m in layers).backward()
    activations = sum(n for ptr, n in saved.items() if ptr not in params)
    assert activations <= x.numel() * 4 + 3 * 32 * 4 * 4  # x once, plus each adapter's (32, r) A output


def test_gradients_of_a_and_b_match_hand_computation():
    layer = _trained(_layer()[1])
    x = torch.randn(7, 12)
    g = torch.randn(7, 10)  # upstream gradient dL/dy
    (layer(x) * g).sum().backward()
    s, A, B = layer.scaling, layer.lora_A.detach(), layer.lora_B.detach()
    # y = xW^T + s·(xA^T)B^T  =>  dL/dB = s·g^T(xA^T),  dL/dA = s·(gB)^T x
    torch.testing.assert_close(layer.lora_B.grad, s * g.T @ (x @ A.T), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.lora_A.grad, s * (g @ B).T @ x, rtol=1e-5, atol=1e-6)
    assert layer.weight.grad is None and not layer.weight.requires_grad


def test_apply_lora_only_adapters_get_gradients():
    model = build_model(CFG, seed=1)
    names = apply_lora(model, r=4, alpha=8, dropout=0.0)
    assert len(names) == 7 * CFG.n_layers and "model.layers.0.self_attn.q_proj" in names
    assert set(model.state_dict()) >= {"model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.lora_A"}
    _trained(model.model.layers["0"].self_attn.q_proj)
    loss = model(_ids(), targets=_ids())
    loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, _ in model.named_parameters() if "lora_" in n}
    assert len(lora_parameters(model)) == 2 * len(names)


def test_apply_lora_rejects_unknown_target():
    with pytest.raises(ValueError, match=r"\['qproj'\] match no nn.Linear"):
        apply_lora(build_model(CFG), targets=("q_proj", "qproj"))


def test_trainable_fraction_of_1b_preset_on_meta():
    model = meta_model(get_preset("llama3.2-1b"))
    apply_lora(model, r=64)
    trainable, total = count_parameters(model)
    c = get_preset("llama3.2-1b")
    kv = c.n_kv_heads * c.head_dim
    per_layer = 64 * ((c.dim + c.dim) * 2 + (c.dim + kv) * 2 + (c.dim + c.ffn_dim) * 3)
    assert trainable == c.n_layers * per_layer == 45_088_768
    assert total == c.num_params() + trainable


def test_reset_is_seeded_and_meta_injection_materialises(tmp_path):
    a = meta_model(CFG)
    apply_lora(a, r=4)
    a.to_empty(device="cpu")
    reset_lora_parameters(a, seed=3)
    b = build_model(CFG)
    apply_lora(b, r=4)
    reset_lora_parameters(b, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if "lora_" in n:
            assert torch.equal(p, q), n
    assert not torch.equal(a.model.layers["0"].mlp.up_proj.lora_A, a.model.layers["1"].mlp.up_proj.lora_A)


def _adapted(tmp_path, r=8, alpha=28):
    model = build_model(CFG, seed=2).eval()
    save_pretrained(model, str(tmp_path / "base"))
    apply_lora(model, r=r, alpha=alpha, dropout=0.05)
    reset_lora_parameters(model, seed=5)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in lora_parameters(model):
            if p.abs().sum() == 0:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_adapter_is_peft_format_and_peft_gives_same_logits(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = _adapted(tmp_path)
    save_adapter(model, str(tmp_path / "adapter"), base_model_name_or_path=str(tmp_path / "base"))
    assert sorted(os.listdir(tmp_path / "adapter")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "minilm-az-output.json",
    ]
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 28 and sorted(cfg["target_modules"]) == sorted(TARGETS)
    keys = set(lora_state_dict(model))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = _ids()
    with torch.no_grad():
        ours, theirs = model(ids), pm(input_ids=ids).logits
        base = build_model(CFG, seed=2).eval()(ids)
    assert (ours - base).abs().max() > 1e-3  # the adapter changes the output ...
    assert (ours - theirs).abs().max() <= 1e-5  # ... and peft sees the same change


def test_load_adapter_round_trips_and_merge_keeps_logits(tmp_path):
    model = _adapted(tmp_path)
    save_adapter(model, str(tmp_path / "ad"))
    back = build_model(CFG, seed=2).eval()
    load_adapter(back, str(tmp_path / "ad"))
    ids = _ids()
    with torch.no_grad():
        ref = model(ids)
        assert (back(ids) - ref).abs().max() == 0
        merged = merge_lora(back)
        assert not any("lora_" in n for n in merged.state_dict())
        assert (merged(ids) - ref).abs().max() < 1e-5


def test_adapter_for_a_different_base_is_refused(tmp_path):
    save_adapter(_adapted(tmp_path), str(tmp_path / "ad"))
    wider = build_model(ModelConfig(**{**CFG.to_dict(), "ffn_dim": 160}))
    with pytest.raises(AdapterError, match="different base model.*ffn_dim"):
        load_adapter(wider, str(tmp_path / "ad"))
    deeper = build_model(ModelConfig(**{**CFG.to_dict(), "n_layers": 1}))
    with pytest.raises(AdapterError, match="different base"):
        load_adapter(deeper, str(tmp_path / "ad"))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter(build_model(CFG), str(tmp_path))
