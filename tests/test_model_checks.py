"""Model directories, adapters and dtypes checked where they come in: what our Llama would compute differently
is refused by name, a weight file is read only from inside its directory, non-finite weights never get used."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minilm_az.generate import sample_next
from minilm_az.hf import ModelDirError, config_from_hf, load_pretrained, read_config, save_pretrained, saved_dtype
from minilm_az.lora import AdapterError, apply_lora, load_adapter, save_adapter
from minilm_az.model import ModelConfig, build_model

transformers = pytest.importorskip("transformers")

TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=256)
SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=320)


def _model_dir(tmp_path, name="m", **save) -> str:
    path = str(tmp_path / name)
    save_pretrained(build_model(TINY, seed=3), path, **save)
    return path


def _edit_config(path: str, **fields) -> str:
    f = os.path.join(path, "config.json")
    with open(f) as fh:
        hf = json.load(fh)
    with open(f, "w") as fh:
        json.dump({**hf, **fields}, fh)
    return f


# ---------------------------------------------------------------- config.json


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_type", "mistral"),
        ("architectures", ["MistralForCausalLM"]),
        ("sliding_window", 4096),
        ("hidden_act", "gelu"),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("partial_rotary_factor", 0.5),
        ("quantization_config", {"quant_method": "gptq", "bits": 4}),
        ("torch_dtype", "int8"),
        ("dtype", "int32"),
    ],
)
def test_config_field_that_changes_the_maths_is_refused_by_name(tmp_path, field, value):
    path = _model_dir(tmp_path)
    f = _edit_config(path, **{field: value})
    with pytest.raises(ModelDirError) as e:
        read_config(path)
    assert str(e.value).startswith(f"{f}: field {field!r} is {value!r}"), str(e.value)
    assert "\n" not in str(e.value)


def test_a_whole_mistral_config_is_refused_and_a_rope_parameter_is_checked_too():
    mistral = transformers.MistralConfig(**SIZES).to_dict()
    with pytest.raises(ModelDirError, match="field 'model_type' is 'mistral'"):
        config_from_hf(mistral)
    # transformers 5 keeps partial_rotary_factor inside rope_parameters, and its default RoPE honours it there.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ModelDirError, match="field 'partial_rotary_factor' is 0.5"):
        config_from_hf({**SIZES, "rope_parameters": rope})


def test_fields_that_do_not_change_the_maths_are_accepted():
    llama = transformers.LlamaConfig(**SIZES, tie_word_embeddings=True).to_dict()  # every field transformers writes
    cfg = config_from_hf({**llama, "pretraining_tp": 2, "attention_dropout": 0.1, "use_cache": False, "dtype": None})
    assert (cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.tie_embeddings) == (64, 2, 320, True)
    hf = {**SIZES, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu"}
    hf |= {"sliding_window": None, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16"}
    assert config_from_hf(hf).dim == 64


def test_a_zero_rope_theta_is_refused_and_an_absent_norm_eps_is_llamaconfigs_default():
    # issue 29's audit: `rope_theta: 0` was read as the default 10000, and an absent rms_norm_eps as 1e-5
    with pytest.raises(ModelDirError, match="field 'rope_theta' must be a positive number, got 0"):
        config_from_hf({**SIZES, "rope_theta": 0})
    assert config_from_hf(SIZES).norm_eps == transformers.LlamaConfig().rms_norm_eps == 1e-6


def test_inconsistent_heads_and_odd_head_dim_name_config_json(tmp_path):
    path = _model_dir(tmp_path)
    f = _edit_config(path, head_dim=15)  # RoPE rotates pairs: an odd head_dim used to crash in the first forward
    with pytest.raises(ModelDirError, match=f"^{f}: .*head_dim=15 is odd"):
        read_config(path)
    f = _edit_config(path, head_dim=None, num_key_value_heads=3)
    with pytest.raises(ModelDirError, match=f"^{f}: .*n_kv_heads=3"):
        read_config(path)
    with pytest.raises(ModelDirError, match="field 'tie_word_embeddings' is 'yes'"):
        config_from_hf({**SIZES, "tie_word_embeddings": "yes"})


# ---------------------------------------------------------------- dtypes


def test_merge_dtype_is_floating_only(tmp_path):
    path = _model_dir(tmp_path, dtype=torch.bfloat16)
    assert saved_dtype(path) == torch.bfloat16
    f = _edit_config(path, torch_dtype=None, dtype="float16")  # the transformers 5 name
    assert saved_dtype(path) == torch.float16
    f = _edit_config(path, dtype=None, torch_dtype="int8")
    with pytest.raises(ModelDirError, match=f"^{f}: field 'torch_dtype' is 'int8'"):
        saved_dtype(path)  # it was torch.int8: a merged export of all-zero weights
    _edit_config(path, torch_dtype="Tensor")  # a torch attribute that is not a dtype at all
    with pytest.raises(ModelDirError, match="field 'torch_dtype' is 'Tensor'"):
        saved_dtype(path)


def test_save_pretrained_refuses_an_integer_dtype_and_writes_nothing(tmp_path):
    with pytest.raises(ModelDirError, match="floating dtype, not torch.int8"):
        save_pretrained(build_model(TINY, seed=3), str(tmp_path / "out"), dtype=torch.int8)
    assert not os.path.exists(tmp_path / "out")


# ---------------------------------------------------------------- weight files stay inside the model dir


def _sharded(tmp_path) -> tuple[str, str, dict]:
    path = _model_dir(tmp_path, max_shard_bytes=60_000)
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        return path, index, json.load(f)


def _point_first_shard_at(index: str, hf_index: dict, entry: str) -> None:
    first = sorted(set(hf_index["weight_map"].values()))[0]
    wm = {k: entry if v == first else v for k, v in hf_index["weight_map"].items()}
    with open(index, "w") as f:
        json.dump({**hf_index, "weight_map": wm}, f)


def test_weight_map_entry_outside_the_model_dir_is_refused(tmp_path):
    path, index, hf_index = _sharded(tmp_path)
    first = sorted(set(hf_index["weight_map"].values()))[0]
    outside = tmp_path / "outside"
    outside.mkdir()
    os.replace(os.path.join(path, first), outside / first)  # a valid shard, where the index must not reach
    os.symlink(outside, os.path.join(path, "linked"))
    for entry in (f"../outside/{first}", str(outside / first), f"linked/{first}", f"linked/../../outside/{first}"):
        _point_first_shard_at(index, hf_index, entry)
        with pytest.raises(ModelDirError, match=f"^{index}: shard '.*' is outside {path}$"):
            load_pretrained(path)


def test_shard_linked_to_a_blob_loads_as_in_the_hugging_face_cache(tmp_path):
    path, index, hf_index = _sharded(tmp_path)
    reference = load_pretrained(path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in set(hf_index["weight_map"].values()):  # the cache's layout: snapshots/<rev>/x -> ../../blobs/<sha>
        os.replace(os.path.join(path, shard), blobs / shard)
        os.symlink(os.path.relpath(blobs / shard, path), os.path.join(path, shard))
    back = load_pretrained(path)
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), back.state_dict().values()))


# ---------------------------------------------------------------- non-finite weights


def test_non_finite_base_weight_is_refused_naming_file_and_tensor(tmp_path):
    path = _model_dir(tmp_path)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    save_file(tensors, weights)
    with pytest.raises(ModelDirError, match=r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' holds NaN"):
        load_pretrained(path)


def test_nan_adapter_is_refused_naming_the_file(tmp_path):
    model = build_model(TINY, seed=3)
    apply_lora(model, r=2)
    save_adapter(model, str(tmp_path / "ad"))
    weights = str(tmp_path / "ad" / "adapter_model.safetensors")
    with safe_open(weights, "pt") as f:  # keep the metadata (the base's shape): only the values change
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, weights, metadata=meta)
    with pytest.raises(AdapterError, match=f"^{weights}: tensor '{key}' holds NaN or inf"):
        load_adapter(build_model(TINY, seed=3), str(tmp_path / "ad"))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_are_a_clear_error_not_a_token(temperature):
    for bad in (float("nan"), float("inf")):
        with pytest.raises(FloatingPointError, match="logits are NaN or inf"):
            sample_next(torch.tensor([0.5, bad, 1.0]), temperature, 0.9, torch.Generator().manual_seed(0))
