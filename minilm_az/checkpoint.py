"""Hugging Face model directories in and out (config.json + safetensors), and training checkpoints (DCP).

Our parameter names already are Hugging Face's, so loading is a straight copy tensor by tensor,
read lazily with `safe_open` (never two full copies in memory). Training checkpoints are written with
`torch.distributed.checkpoint` into a temp dir, renamed into place, then pointed at by `latest`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minilm_az.kernels import TORCH_OPS, Ops
from minilm_az.model import Llama, ModelConfig, copy_full_into, materialize, meta_model
from minilm_az.outputs import atomic_write_json, staged_output

HF_STAGE = "hf-model"  # the stage name save_pretrained records in the output marker


class CheckpointError(ValueError):
    """A model directory or checkpoint that cannot be used; the message names the file and tensor."""


# ---------------------------------------------------------------- Hugging Face config.json

def config_from_hf(hf: dict, path: str = "config.json") -> ModelConfig:
    """ModelConfig from a HF Llama config dict; reads both `rope_scaling` and 5.x `rope_parameters`."""
    def need(key):
        if key not in hf or hf[key] is None:
            raise CheckpointError(f"{path}: missing field {key!r}")
        return hf[key]

    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"{path}: rope type {rope_type!r} is not supported (default or llama3)")
    heads = need("num_attention_heads")
    dim = need("hidden_size")
    head_dim = hf.get("head_dim")
    llama3 = rope_type == "llama3"
    return ModelConfig(
        dim=dim, n_layers=need("num_hidden_layers"), n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=need("intermediate_size"),
        vocab_size=need("vocab_size"), rope_theta=float(theta),
        rope_factor=float(rope["factor"]) if llama3 else None,
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_seq_len=int(rope.get("original_max_position_embeddings", 8192)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        head_dim_override=head_dim if head_dim and head_dim != dim // heads else None,
    )


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype, bos_id: int | None = None,
                 eos_id: int | None = None, pad_id: int | None = None) -> dict:
    """A config.json every reader understands: the classic `rope_theta` + `rope_scaling` keys."""
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
    }
    if cfg.rope_factor is not None:
        hf["rope_scaling"] = {
            "rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        }
    return hf


def read_config(path: str) -> ModelConfig:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        with open(f, encoding="utf-8") as fh:
            hf = json.load(fh)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    return config_from_hf(hf, f)


# ---------------------------------------------------------------- safetensors in

def weight_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from model.safetensors or a sharded index."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            wm = json.load(fh).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map'")
        out = {name: os.path.join(path, file) for name, file in wm.items()}
        for file in sorted(set(out.values())):
            if not os.path.isfile(file):
                raise CheckpointError(f"{index}: shard {os.path.basename(file)} is missing")
        return out
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def iter_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, one file open at a time, each tensor read only when reached."""
    files = weight_files(path)
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


def read_tensor(path: str, name: str) -> torch.Tensor:
    """One tensor of a HF directory, read alone."""
    files = weight_files(path)
    if name not in files:
        raise CheckpointError(f"{path}: no tensor {name!r}")
    with safe_open(files[name], framework="pt") as f:
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
            raise CheckpointError(f"{path}/{where}: unknown tensor {name!r} (not a Llama weight of this shape)")
        p = params[name]
        if tuple(tensor.shape) != tuple(p.shape):
            raise CheckpointError(f"{path}/{where}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {tuple(p.shape)} (config.json disagrees with weights)")
        with torch.no_grad():
            copy_full_into(p, tensor.to(device=p.device, dtype=torch.float32))
        seen.add(name)
    for name, tensor in overrides.items():
        with torch.no_grad():
            copy_full_into(params[name], tensor.to(device=params[name].device, dtype=torch.float32))
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def load_pretrained(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    ops: Ops = TORCH_OPS) -> Llama:
    """Our Llama from a Hugging Face model directory (single-process; see parallel.py for sharded)."""
    model = materialize(meta_model(read_config(path), ops), device, init=False)
    load_weights_into(model, path)
    return model.to(dtype)


# ---------------------------------------------------------------- safetensors out

def _full(t: torch.Tensor) -> torch.Tensor:
    # A DTensor parameter is gathered whole (every rank must call this); a plain one is returned as is.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _hf_weight_files(path: str) -> list[str]:
    # Every weight layout an HF directory can have: a new export replaces whichever one is there.
    names = os.listdir(path) if os.path.isdir(path) else []
    return ["model.safetensors", "model.safetensors.index.json",
            *sorted(n for n in names if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n))]


def save_pretrained(model: Llama, path: str, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 2 * 1024**3, token_ids: dict | None = None,
                    is_writer: bool = True) -> None:
    """Export to a HF model directory: config.json + model.safetensors (sharded above `max_shard_bytes`).

    Works on a sharded model too: call it on every rank; only `is_writer` writes. Tensors are gathered
    one at a time and written shard by shard, so at most one shard is held in memory. Files are staged
    inside `path` and moved in (outputs.staged_output), so `path` may be a mount point.
    """
    if any("lora_" in n for n, _ in model.named_parameters()):
        raise CheckpointError("save_pretrained got a model with LoRA adapters: merge them first (lora.merge_lora) "
                              "or save the adapter with lora.save_adapter")
    dtype = dtype or next(model.parameters()).dtype
    staged = staged_output(path, stage=HF_STAGE, replaces=_hf_weight_files(path)) if is_writer else nullcontext()
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
        t = _full(p.detach())
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


# ---------------------------------------------------------------- training checkpoints (DCP)

def _step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step-{step:08d}")


def is_complete(path: str) -> bool:
    """All of a checkpoint is here: its state, DCP's metadata and every saving rank's files.

    On several hosts each one syncs its own disk to S3, so `latest` can arrive before another
    host's shards do; a checkpoint counts only once every rank's last-written file is present.
    """
    state_file = os.path.join(path, "train_state.json")
    if not (os.path.isfile(state_file) and os.path.isfile(os.path.join(path, ".metadata"))):
        return False
    try:
        with open(state_file) as fh:
            world = int(json.load(fh).get("world_size", 1))
    except (OSError, ValueError):
        return False
    return all(os.path.isfile(os.path.join(path, f"rng-{r:05d}.safetensors")) for r in range(world))


def latest_checkpoint(ckpt_dir: str | None) -> str | None:
    """The newest complete checkpoint: the one `latest` names, else the highest complete step dir."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None
    pointer = os.path.join(ckpt_dir, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as fh:
            cand = os.path.join(ckpt_dir, fh.read().strip())
        if is_complete(cand):
            return cand
    done = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step-") and not d.endswith(".tmp")
                  and is_complete(os.path.join(ckpt_dir, d)))
    return os.path.join(ckpt_dir, done[-1]) if done else None


def save_train_checkpoint(ckpt_dir: str, step: int, model, optimizer, train_state: dict,
                          rank: int, local_rank: int, keep: int = 2) -> str:
    """Sharded model + optimizer (DCP), this rank's RNG, and `train_state.json`, written atomically.

    Every rank writes into `step-N.tmp`; after a barrier, local rank 0 of each host renames it to
    `step-N` (so per-host disks, as on SageMaker, work too), then points `latest` at it. A crash at any
    point leaves the previous complete checkpoint untouched and `latest` still naming it.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = _step_dir(ckpt_dir, step)
    tmp = final + ".tmp"
    if local_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, os.path.join(tmp, f"rng-{rank:05d}.safetensors"))
    if rank == 0:
        with open(os.path.join(tmp, "train_state.json"), "w") as fh:
            json.dump({**train_state, "step": step, "world_size": dist.get_world_size()}, fh, indent=2)
    dist.barrier()
    if local_rank == 0 and os.path.isdir(tmp):
        shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except FileNotFoundError:  # a shared disk: another host's local rank 0 renamed it first
            pass
        with open(os.path.join(ckpt_dir, "latest.tmp"), "w") as fh:
            fh.write(os.path.basename(final))
        os.replace(os.path.join(ckpt_dir, "latest.tmp"), os.path.join(ckpt_dir, "latest"))
        old = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step-") and not d.endswith(".tmp"))
        for d in old[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(ckpt_dir, d), ignore_errors=True)
    dist.barrier()
    return final


def load_train_checkpoint(path: str, model, optimizer, rank: int) -> dict:
    """Restore model + optimizer shards (any world size: DCP reshards), this rank's RNG; return train_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state_file = os.path.join(path, "train_state.json")
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{path}: incomplete checkpoint (no train_state.json)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = os.path.join(path, f"rng-{rank:05d}.safetensors")
    if os.path.isfile(rng_file):  # absent when resuming on more ranks than saved: fresh RNG for those
        with safe_open(rng_file, "pt") as f:
            torch.set_rng_state(f.get_tensor("cpu"))
            if torch.cuda.is_available() and "cuda" in f.keys():
                torch.cuda.set_rng_state(f.get_tensor("cuda"))
    with open(state_file) as fh:
        return json.load(fh)

