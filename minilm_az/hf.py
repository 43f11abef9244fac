"""Hugging Face model directories in and out: config.json <-> ModelConfig, and safetensors weights.

Our parameter names already are Hugging Face's, so loading is a straight copy tensor by tensor,
read lazily with `safe_open` (never two full copies in memory). Exports go through outputs.staged_output.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from minilm_az.kernels import TORCH_OPS, Ops
from minilm_az.model import Llama, ModelConfig, materialize, meta_model
from minilm_az.outputs import atomic_write_json, content_sha256, file_sha256, read_json, staged_output
from minilm_az.parallel import copy_into, full_tensor

HF_STAGE = "hf-model"  # the stage name save_pretrained records in the output marker


class ModelDirError(ValueError):
    """A Hugging Face model directory that cannot be used; the message names the file and the field or tensor."""


# ---------------------------------------------------------------- Hugging Face config.json

# What our Llama computes, field by field (null or absent means the same). Any other value would be computed as a
# Llama without a word (a Mistral's sliding window, a GELU MLP, integer or quantized weights), so it is refused.
FLOATS = ("float32", "bfloat16", "float16", "float64")
IMPLEMENTED = {"model_type": ("llama",), "architectures": (["LlamaForCausalLM"],), "hidden_act": ("silu",)}
IMPLEMENTED |= {"attention_bias": (False,), "mlp_bias": (False,), "sliding_window": (), "quantization_config": ()}
IMPLEMENTED |= {"partial_rotary_factor": (1.0,), "tie_word_embeddings": (True, False), "torch_dtype": FLOATS}
IMPLEMENTED["dtype"] = FLOATS  # Transformers 5 writes torch_dtype as `dtype`.


def config_from_hf(hf: dict, path: str = "config.json") -> ModelConfig:
    """ModelConfig from a HF Llama config dict; reads both `rope_scaling` and 5.x `rope_parameters`.

    Every field is type-checked here ("hidden_size": "64" is refused naming the file and field), so a
    hand-edited config fails with one ModelDirError, not a TypeError deep inside the model.
    """
    if not isinstance(hf, dict):
        raise ModelDirError(f"{path}: expected a JSON object, got {type(hf).__name__}")

    def integer(key, value, lo=1):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ModelDirError(f"{path}: field {key!r} must be an integer >= {lo}, got {value!r}")
        return value

    def number(key, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ModelDirError(f"{path}: field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def need(key):
        if key not in hf or hf[key] is None:
            raise ModelDirError(f"{path}: missing field {key!r}")
        return integer(key, hf[key])

    def optional(key, default, check=integer):
        return default if hf.get(key) is None else check(key, hf[key])

    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelDirError(f"{path}: field 'rope_scaling' must be an object or null, got {rope!r}")
    for key, values in IMPLEMENTED.items():
        value = hf.get(key, rope.get(key))
        if value not in (None, *values):
            raise ModelDirError(f"{path}: field {key!r} is {value!r}; this Llama implements only {[*values, None]}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelDirError(f"{path}: rope type {rope_type!r} is not supported (default or llama3)")
    heads, theta = need("num_attention_heads"), hf.get("rope_theta")  # 0 is refused, not read as the default
    dim = need("hidden_size")
    head_dim = optional("head_dim", None)
    llama3 = rope_type == "llama3"
    if llama3 and "factor" not in rope:
        raise ModelDirError(f"{path}: llama3 rope_scaling without 'factor'")
    try:
        return ModelConfig(
            dim=dim,
            n_layers=need("num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=optional("num_key_value_heads", heads),
            ffn_dim=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            rope_theta=number("rope_theta", theta if theta is not None else rope.get("rope_theta", 10000.0)),
            rope_factor=number("rope_scaling.factor", rope["factor"]) if llama3 else None,
            rope_low_freq_factor=number("rope_scaling.low_freq_factor", rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=number("rope_scaling.high_freq_factor", rope.get("high_freq_factor", 4.0)),
            rope_original_max_seq_len=integer(
                "rope_scaling.original_max_position_embeddings", rope.get("original_max_position_embeddings", 8192)
            ),
            norm_eps=optional("rms_norm_eps", 1e-6, number),  # LlamaConfig's default, when the field is absent
            tie_embeddings=bool(hf.get("tie_word_embeddings")),
            max_seq_len=optional("max_position_embeddings", 2048),
            head_dim_override=head_dim if head_dim and head_dim != dim // heads else None,
        )
    except ValueError as e:  # ModelConfig's own checks name a field, not the file.
        raise e if isinstance(e, ModelDirError) else ModelDirError(f"{path}: {e}") from None


def config_to_hf(
    cfg: ModelConfig,
    dtype: torch.dtype,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
) -> dict:
    """A config.json every reader understands: the classic `rope_theta` + `rope_scaling` keys."""
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    if cfg.rope_factor is not None:
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        }
    return hf


def read_config(path: str) -> ModelConfig:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ModelDirError(f"{path}: no config.json (expected a Hugging Face model directory)")
    return config_from_hf(read_json(f, ModelDirError), f)


def saved_dtype(path: str) -> torch.dtype:
    """The floating dtype a HF model dir was saved in (config.json's torch_dtype), float32 when it does not say."""
    f = os.path.join(path, "config.json")
    hf = read_json(f, ModelDirError)
    config_from_hf(hf, f)  # It refuses an integer torch_dtype, in which a merge would be all zeros.
    return getattr(torch, hf.get("torch_dtype") or hf.get("dtype") or "float32")


# ---------------------------------------------------------------- safetensors in


@contextmanager
def open_safetensors(file: str, error: type[Exception] = ModelDirError, fix: str = "re-export or re-download it"):
    """safe_open, with a corrupt or truncated file (or a tensor that cannot be read) as one `error`."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise error(f"{file}: not a readable safetensors file ({e}); {fix}") from None


def weight_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from model.safetensors or a sharded index."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        wm = read_json(index, ModelDirError).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ModelDirError(f"{index}: no 'weight_map'")
        root = os.path.realpath(path)
        for file in sorted(set(wm.values())):
            # A shard's folder must resolve inside the model dir. The file may be a link, as in the HF cache.
            if os.path.commonpath([root, os.path.realpath(os.path.dirname(os.path.join(root, file)))]) != root:
                raise ModelDirError(f"{index}: shard {file!r} is outside {path}")
            if not os.path.isfile(os.path.join(path, file)):
                raise ModelDirError(f"{index}: shard {file} is missing")
        return {name: os.path.join(path, file) for name, file in wm.items()}
    if os.path.isfile(single):
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    raise ModelDirError(f"{path}: no model.safetensors or model.safetensors.index.json")


def model_fingerprint(model_dir: str | None) -> str | None:
    """The identity of a HF model dir by content: config.json and every byte of each weight file it loads.

    A resume compares it, so a base changed anywhere is a different input (reading only a file's ends missed a change
    in the middle). It costs one read of the weights: about 2-6 s for the 1B's 2.5 GB (outputs.content_sha256)."""
    if not model_dir:
        return None
    h = hashlib.sha256(f"config.json:{file_sha256(os.path.join(model_dir, 'config.json'))}".encode())
    index = os.path.join(model_dir, "model.safetensors.index.json")
    files = [index] if os.path.isfile(index) else []
    for path in files + sorted(set(weight_files(model_dir).values())):
        h.update(f"{os.path.relpath(path, model_dir)}:{content_sha256(path)}".encode())
    return h.hexdigest()


def iter_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, one file open at a time, each tensor read only when reached."""
    files = weight_files(path)
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            keys = set(f.keys())
            for name in names:
                if name not in keys:
                    raise ModelDirError(f"{file}: no tensor {name!r} (the index names it in this file)")
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise ModelDirError(f"{file}: tensor {name!r} cannot be read ({e})") from None
                yield name, tensor


def read_tensor(path: str, name: str) -> torch.Tensor:
    """One tensor of a HF directory, read alone."""
    files = weight_files(path)
    if name not in files:
        raise ModelDirError(f"{path}: no tensor {name!r}")
    with open_safetensors(files[name]) as f:
        if name not in f.keys():
            raise ModelDirError(f"{files[name]}: no tensor {name!r} (the index names it in this file)")
        return f.get_tensor(name)


def load_weights_into(model: Llama, path: str, overrides: dict[str, torch.Tensor] | None = None) -> None:
    """Copy a HF directory's tensors into `model` (plain or FSDP-sharded), checking names and shapes.

    `overrides` supplies some tensors instead of the files (the vocabulary-transferred embedding).
    """
    overrides = overrides or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    # LoRA adapters (lora_A/lora_B) are not in a base checkpoint: they are initialised, not loaded.
    expected = {n for n in params if "lora_" not in n and not (model.config.tie_embeddings and n == "lm_head.weight")}
    seen: set[str] = set()
    files = weight_files(path)
    for name, tensor in iter_tensors(path):
        where = os.path.basename(files[name])
        if name.endswith("rotary_emb.inv_freq"):  # old exports carried the RoPE buffer; we recompute it
            continue
        if (name == "lm_head.weight" and model.config.tie_embeddings) or name in overrides:
            continue  # some tied exports still carry the head; the embedding is the one we keep
        if name not in params:
            raise ModelDirError(f"{path}/{where}: unknown tensor {name!r} (not a Llama weight of this shape)")
        p = params[name]
        if tuple(tensor.shape) != tuple(p.shape):
            raise ModelDirError(
                f"{path}/{where}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(p.shape)} (config.json disagrees with weights)"
            )
        if not torch.isfinite(tensor).all():  # A NaN base would train to NaN and answer with garbage.
            raise ModelDirError(f"{path}/{where}: tensor {name!r} holds NaN or inf values")
        with torch.no_grad():
            copy_into(p, tensor.to(device=p.device, dtype=torch.float32))
        seen.add(name)
    for name, tensor in overrides.items():
        with torch.no_grad():
            copy_into(params[name], tensor.to(device=params[name].device, dtype=torch.float32))
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelDirError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{more}")


def load_pretrained(
    path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", ops: Ops = TORCH_OPS
) -> Llama:
    """Our Llama from a Hugging Face model directory (single-process; see parallel.py for sharded)."""
    model = materialize(meta_model(read_config(path), ops), device, init=False)
    load_weights_into(model, path)
    return model.to(dtype)


# ---------------------------------------------------------------- safetensors out


def save_pretrained(
    model: Llama,
    path: str,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    token_ids: dict | None = None,
    is_writer: bool = True,
) -> None:
    """Export to a HF model directory: config.json + model.safetensors (sharded above `max_shard_bytes`).

    Works on a sharded model too: call it on every rank; only `is_writer` writes. Tensors are gathered
    one at a time and written shard by shard, so at most one shard is held in memory. Files are staged
    inside `path` and moved in (outputs.staged_output), so `path` may be a mount point.
    """
    if any("lora_" in n for n, _ in model.named_parameters()):
        raise ModelDirError(
            "save_pretrained got a model with LoRA adapters: merge them first (lora.merge_lora) "
            "or save the adapter with lora.save_adapter"
        )
    dtype = dtype or next(model.parameters()).dtype
    if not dtype.is_floating_point:  # An integer export would round every weight, to zero at these scales.
        raise ModelDirError(f"{path}: weights are exported in a floating dtype, not {dtype}")
    # The other layout's file, where the previous export recorded it, goes; a shard goes only if it recorded it.
    layouts = ("model.safetensors", "model.safetensors.index.json")
    staged = staged_output(path, stage=HF_STAGE, replaces=layouts) if is_writer else nullcontext()
    with staged as tmp:
        weight_map, total = _write_shards(model, tmp, dtype, max_shard_bytes)
        if tmp is not None:
            _write_hf_layout(tmp, weight_map, total)
            atomic_write_json(os.path.join(tmp, "config.json"), config_to_hf(model.config, dtype, **(token_ids or {})))


def _write_shards(model: Llama, tmp: str | None, dtype: torch.dtype, max_shard_bytes: int) -> tuple[dict, int]:
    """Gather tensors one by one (every rank) and write them as model-0000i.safetensors into tmp (writer only)."""
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, n_shards, total = 0, 0, 0

    def flush():
        nonlocal shard, shard_bytes, n_shards
        if shard and tmp is not None:
            name = f"model-{n_shards + 1:05d}.safetensors"
            save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        n_shards += 1
        shard, shard_bytes = {}, 0

    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_embeddings:
            continue
        t = full_tensor(p.detach())
        if tmp is None:
            continue
        t = t.to(device="cpu", dtype=dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = t
        shard_bytes += nbytes
        total += nbytes
    flush()
    return weight_map, total


def _write_hf_layout(tmp: str, weight_map: dict[str, str], total: int) -> None:
    """One shard becomes model.safetensors; several get HF's -of-0000n names and an index."""
    files = sorted(set(weight_map.values()))
    if len(files) == 1:
        os.replace(os.path.join(tmp, files[0]), os.path.join(tmp, "model.safetensors"))
        return
    renames = {f: f.replace(".safetensors", f"-of-{len(files):05d}.safetensors") for f in files}
    for a, b in renames.items():
        os.replace(os.path.join(tmp, a), os.path.join(tmp, b))
    index = {"metadata": {"total_size": total}, "weight_map": {k: renames[v] for k, v in weight_map.items()}}
    atomic_write_json(os.path.join(tmp, "model.safetensors.index.json"), index)
