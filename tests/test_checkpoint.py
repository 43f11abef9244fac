"""Hugging Face directories both ways, against transformers' own reader and writer."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from minilm_az.hf import ModelDirError, load_pretrained, read_config, save_pretrained
from minilm_az.model import ModelConfig, build_model

transformers = pytest.importorskip("transformers")

TINY = ModelConfig(
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
UNTIED = ModelConfig(**{**TINY.to_dict(), "tie_embeddings": False, "rope_factor": None})


def _ids(V, T=33):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(7))


def hf_random_dir(tmp_path, tied=True):
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms to one: perturb them so a skipped tensor would show
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / ("hf_tied" if tied else "hf_untied")
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_directory_loads_with_same_logits(tmp_path, tied):
    hf, path = hf_random_dir(tmp_path, tied)
    ours = load_pretrained(path).eval()
    assert ours.config.tie_embeddings == tied and ours.config.rope_factor == 8.0
    ids = _ids(320)
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-5


@pytest.mark.parametrize("cfg", [TINY, UNTIED], ids=["tied", "untied"])
def test_export_loads_in_transformers_with_same_logits(tmp_path, cfg):
    ours = build_model(cfg, seed=3).eval()
    save_pretrained(ours, str(tmp_path / "out"))
    hf_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_cfg["architectures"] == ["LlamaForCausalLM"] and "rope_parameters" not in hf_cfg
    if cfg.tie_embeddings:
        from safetensors import safe_open

        with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = _ids(cfg.vocab_size)
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-5


def test_sharded_export_round_trips(tmp_path):
    ours = build_model(UNTIED, seed=4)
    save_pretrained(ours, str(tmp_path / "sh"), max_shard_bytes=60_000)
    files = sorted(os.listdir(tmp_path / "sh"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert "model.safetensors.index.json" in files and len(shards) > 2
    assert all("-of-" in f for f in shards)
    back = load_pretrained(str(tmp_path / "sh"))
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "sh"))
    with torch.no_grad():
        assert (back(_ids(320)) - hf(_ids(320)).logits).abs().max() < 1e-5


def test_bf16_export(tmp_path):
    ours = build_model(TINY, seed=5)
    save_pretrained(ours, str(tmp_path / "bf"), dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_pretrained(str(tmp_path / "bf"))
    w = ours.model.layers["0"].mlp.up_proj.weight
    assert torch.equal(back.model.layers["0"].mlp.up_proj.weight, w.to(torch.bfloat16).float())


def test_transformers5_rope_parameters_dialect(tmp_path):
    _, path = hf_random_dir(tmp_path)
    c = json.loads(open(os.path.join(path, "config.json")).read())
    c["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    c["rope_scaling"] = None
    c["rope_theta"] = None
    open(os.path.join(path, "config.json"), "w").write(json.dumps(c))
    cfg = read_config(path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_factor == 8.0 and cfg.rope_original_max_seq_len == 32


def test_bad_checkpoints_name_file_and_tensor(tmp_path):
    with pytest.raises(ModelDirError, match="no config.json"):
        load_pretrained(str(tmp_path))
    ours = build_model(TINY, seed=6)
    d = tmp_path / "m"
    save_pretrained(ours, str(d))
    sd = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight"}

    def write(tensors):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))

    write({k: v for k, v in sd.items() if k != "model.layers.1.mlp.down_proj.weight"})
    with pytest.raises(ModelDirError, match="missing tensor.*model.layers.1.mlp.down_proj.weight"):
        load_pretrained(str(d))
    write({**sd, "model.layers.9.self_attn.q_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ModelDirError, match="model.safetensors: unknown tensor 'model.layers.9"):
        load_pretrained(str(d))
    write({**sd, "model.norm.weight": torch.ones(63)})
    with pytest.raises(ModelDirError, match=r"'model.norm.weight' has shape \(63,\).*expects \(64,\)"):
        load_pretrained(str(d))
    os.remove(d / "model.safetensors")
    with pytest.raises(ModelDirError, match="no model.safetensors"):
        load_pretrained(str(d))
    save_pretrained(ours, str(d), max_shard_bytes=60_000)
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    os.remove(d / shard)
    with pytest.raises(ModelDirError, match=f"shard {shard} is missing"):
        load_pretrained(str(d))
