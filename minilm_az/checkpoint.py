"""Hugging Face model directories in and out (config.json + safetensors), and training checkpoints (DCP).

Our parameter names already are Hugging Face's, so loading is a straight copy tensor by tensor,
read lazily with `safe_open` (never two full copies in memory). Exports go through outputs.staged_output.

Training checkpoints are written with `torch.distributed.checkpoint` into `step-N.tmp`, renamed into
place, then pointed at by `latest` (`Checkpointer`, synchronous or in the background); `resume` loads
the newest complete one that loads, falling back to older ones. Nothing in a checkpoint is unpickled
freely: DCP's `.metadata` admits only DCP's own classes, everything else loads with weights_only=True.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import pickle
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from minilm_az.kernels import TORCH_OPS, Ops
from minilm_az.model import Llama, ModelConfig, materialize, meta_model
from minilm_az.outputs import atomic_write_json, atomic_write_text, read_json, staged_output
from minilm_az.parallel import copy_into, full_tensor

HF_STAGE = "hf-model"  # the stage name save_pretrained records in the output marker


class CheckpointError(ValueError):
    """A model directory or checkpoint that cannot be used; the message names the file and tensor."""


# ---------------------------------------------------------------- Hugging Face config.json


def config_from_hf(hf: dict, path: str = "config.json") -> ModelConfig:
    """ModelConfig from a HF Llama config dict; reads both `rope_scaling` and 5.x `rope_parameters`.

    Every field is type-checked here ("hidden_size": "64" is refused naming the file and field), so a
    hand-edited config fails with one CheckpointError, not a TypeError deep inside the model.
    """
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(hf).__name__}")

    def integer(key, value, lo=1):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise CheckpointError(f"{path}: field {key!r} must be an integer >= {lo}, got {value!r}")
        return value

    def number(key, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{path}: field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def need(key):
        if key not in hf or hf[key] is None:
            raise CheckpointError(f"{path}: missing field {key!r}")
        return integer(key, hf[key])

    def optional(key, default, check=integer):
        return default if hf.get(key) is None else check(key, hf[key])

    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{path}: field 'rope_scaling' must be an object or null, got {rope!r}")
    theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"{path}: rope type {rope_type!r} is not supported (default or llama3)")
    heads = need("num_attention_heads")
    dim = need("hidden_size")
    head_dim = optional("head_dim", None)
    tie = hf.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise CheckpointError(f"{path}: field 'tie_word_embeddings' must be true or false, got {tie!r}")
    llama3 = rope_type == "llama3"
    if llama3 and "factor" not in rope:
        raise CheckpointError(f"{path}: llama3 rope_scaling without 'factor'")
    return ModelConfig(
        dim=dim,
        n_layers=need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=optional("num_key_value_heads", heads),
        ffn_dim=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        rope_theta=number("rope_theta", theta),
        rope_factor=number("rope_scaling.factor", rope["factor"]) if llama3 else None,
        rope_low_freq_factor=number("rope_scaling.low_freq_factor", rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=number("rope_scaling.high_freq_factor", rope.get("high_freq_factor", 4.0)),
        rope_original_max_seq_len=integer(
            "rope_scaling.original_max_position_embeddings", rope.get("original_max_position_embeddings", 8192)
        ),
        norm_eps=optional("rms_norm_eps", 1e-5, number),
        tie_embeddings=tie,
        max_seq_len=optional("max_position_embeddings", 2048),
        head_dim_override=head_dim if head_dim and head_dim != dim // heads else None,
    )


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
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    return config_from_hf(read_json(f, CheckpointError), f)


# ---------------------------------------------------------------- safetensors in


@contextmanager
def _safetensors(file: str):
    """safe_open, with a corrupt or truncated file (or a tensor that cannot be read) as one CheckpointError."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); re-export or re-download it") from None


def weight_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from model.safetensors or a sharded index."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        wm = read_json(index, CheckpointError).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index}: no 'weight_map'")
        out = {name: os.path.join(path, file) for name, file in wm.items()}
        for file in sorted(set(out.values())):
            if not os.path.isfile(file):
                raise CheckpointError(f"{index}: shard {os.path.basename(file)} is missing")
        return out
    if os.path.isfile(single):
        with _safetensors(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def iter_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, one file open at a time, each tensor read only when reached."""
    files = weight_files(path)
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with _safetensors(file) as f:
            keys = set(f.keys())
            for name in names:
                if name not in keys:
                    raise CheckpointError(f"{file}: no tensor {name!r} (the index names it in this file)")
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({e})") from None
                yield name, tensor


def read_tensor(path: str, name: str) -> torch.Tensor:
    """One tensor of a HF directory, read alone."""
    files = weight_files(path)
    if name not in files:
        raise CheckpointError(f"{path}: no tensor {name!r}")
    with _safetensors(files[name]) as f:
        if name not in f.keys():
            raise CheckpointError(f"{files[name]}: no tensor {name!r} (the index names it in this file)")
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
            raise CheckpointError(
                f"{path}/{where}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(p.shape)} (config.json disagrees with weights)"
            )
        with torch.no_grad():
            copy_into(p, tensor.to(device=p.device, dtype=torch.float32))
        seen.add(name)
    for name, tensor in overrides.items():
        with torch.no_grad():
            copy_into(params[name], tensor.to(device=params[name].device, dtype=torch.float32))
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        raise CheckpointError(
            f"{path}: missing tensor(s) {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )


def load_pretrained(
    path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", ops: Ops = TORCH_OPS
) -> Llama:
    """Our Llama from a Hugging Face model directory (single-process; see parallel.py for sharded)."""
    model = materialize(meta_model(read_config(path), ops), device, init=False)
    load_weights_into(model, path)
    return model.to(dtype)


# ---------------------------------------------------------------- safetensors out


def _hf_weight_files(path: str) -> list[str]:
    # Every weight layout an HF directory can have: a new export replaces whichever one is there.
    names = os.listdir(path) if os.path.isdir(path) else []
    return [
        "model.safetensors",
        "model.safetensors.index.json",
        *sorted(n for n in names if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n)),
    ]


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
        raise CheckpointError(
            "save_pretrained got a model with LoRA adapters: merge them first (lora.merge_lora) "
            "or save the adapter with lora.save_adapter"
        )
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


# ---------------------------------------------------------------- training checkpoints (DCP)
#
# ckpt_dir/step-00001000/   .metadata, __<rank>_0.distcp (DCP), rng-<rank>.safetensors, train_state.json
# ckpt_dir/latest           "step-00001000"
#
# Every rank writes into step-N.tmp; once all are done, local rank 0 of each host renames it to step-N
# (per-host disks, as on SageMaker, each get their own rename) and points `latest` at it, so a crash at
# any point leaves the previous checkpoint complete and named by `latest`.

_STEP_DIR = re.compile(r"step-(\d+)")


def _step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step-{step:08d}")


# DCP's `.metadata` is a pickle, so a file planted in a checkpoint dir could run code when read. These are
# the only globals a model + optimizer checkpoint's metadata holds (found by tracing find_class on real
# saves, FSDP2 and plain); every torch dtype is allowed too. Anything else is refused before it is called.
_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),  # the save's checkpoint_id (3.13 moved the class)
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, name: str):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.name}: refused to unpickle {module}.{name}: not DCP checkpoint metadata "
            f"(a tampered or foreign file)"
        )


def _load_metadata(path: str):
    """DCP's Metadata of checkpoint dir `path`. Raises CheckpointError on a refused global, else pickle's errors."""
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        return _MetadataUnpickler(f, file).load()


def read_metadata(path: str):
    """DCP's Metadata of a checkpoint dir, unpickled with only DCP's own classes allowed."""
    try:
        return _load_metadata(path)
    except CheckpointError:
        raise
    except Exception as e:  # a truncated pickle fails in many ways
        raise CheckpointError(f"{os.path.join(path, '.metadata')}: unreadable ({type(e).__name__}: {e})") from None


def _data_files_present(path: str, metadata) -> bool:
    """Every file the metadata names exists and is long enough for the byte ranges read from it."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        if os.path.basename(info.relative_path) != info.relative_path:
            raise CheckpointError(
                f"{path}/.metadata: names a data file outside the checkpoint ({info.relative_path!r})"
            )
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in need.items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file) or os.path.getsize(file) < size:
            return False
    return True


def is_complete(path: str) -> bool:
    """All of a checkpoint is here: its state, every rank's RNG file, DCP's metadata and all the data it names.

    On several hosts each one syncs its own disk to S3, so `latest` can arrive before another host's
    shards do, or a shard only partly; such a checkpoint does not count. Raises CheckpointError when the
    metadata holds anything but DCP's own classes (it is never silently skipped).
    """
    state_file = os.path.join(path, "train_state.json")
    if not (os.path.isfile(state_file) and os.path.isfile(os.path.join(path, ".metadata"))):
        return False
    try:
        with open(state_file) as fh:
            world = int(json.load(fh).get("world_size", 1))
    except (OSError, ValueError):
        return False
    if not all(os.path.isfile(os.path.join(path, f"rng-{r:05d}.safetensors")) for r in range(world)):
        return False
    try:
        metadata = _load_metadata(path)
    except CheckpointError:
        raise
    except Exception:  # truncated or half-synced
        return False
    return _data_files_present(path, metadata)


def _step_dirs(ckpt_dir: str) -> list[str]:
    """Names of the finished step dirs (not .tmp), newest step first."""
    names = [d for d in os.listdir(ckpt_dir) if _STEP_DIR.fullmatch(d)]
    return sorted(names, key=lambda d: int(_STEP_DIR.fullmatch(d).group(1)), reverse=True)


def _read_pointer(pointer: str) -> str:
    """The step dir name `latest` holds. Anything else (binary, a path, another file copied over it) is refused:
    which checkpoint it meant cannot be known, and guessing could resume the wrong one."""
    try:
        with open(pointer, "rb") as fh:
            raw = fh.read(256)
    except OSError as e:
        raise CheckpointError(f"{pointer}: unreadable checkpoint pointer ({e.strerror})") from None
    try:
        target = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        target = None
    if target is None or not _STEP_DIR.fullmatch(target):
        raise CheckpointError(
            f"{pointer}: not a checkpoint pointer (expected a name like step-00001000, got "
            f"{raw[:40]!r}); delete it to resume from the newest complete checkpoint, or use "
            f"--resume never"
        )
    return target


def complete_checkpoints(ckpt_dir: str | None) -> list[str]:
    """Complete checkpoints of ckpt_dir, newest first: the one `latest` names, then the others by step."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return []
    names = _step_dirs(ckpt_dir)
    pointer = os.path.join(ckpt_dir, "latest")
    if os.path.isfile(pointer):
        target = _read_pointer(pointer)
        if target in names:
            names = [target] + [n for n in names if n != target]
    return [os.path.join(ckpt_dir, n) for n in names if is_complete(os.path.join(ckpt_dir, n))]


def latest_checkpoint(ckpt_dir: str | None) -> str | None:
    """The newest complete checkpoint: the one `latest` names, else the highest complete step dir."""
    done = complete_checkpoints(ckpt_dir)
    return done[0] if done else None


def _write_rank_files(tmp: str, step: int, train_state: dict, rank: int) -> None:
    # RNG of this rank, and (rank 0) the run's state: both of the moment the model state is snapshotted.
    import torch.distributed as dist

    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, os.path.join(tmp, f"rng-{rank:05d}.safetensors"))
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        atomic_write_json(os.path.join(tmp, "train_state.json"), {**train_state, "step": step, "world_size": world})


def _prune(ckpt_dir: str, final: str, keep: int) -> None:
    """Keep `final` and the keep-1 checkpoints before it; drop leftovers of killed saves.

    Step dirs newer than `final` are from a run this one did not continue (a checkpoint that failed to
    load, or --resume never): left in place they would be taken for this run's latest.
    """

    def step_of(name: str) -> int:
        return int(_STEP_DIR.fullmatch(name).group(1))

    step = step_of(os.path.basename(final))
    older = [n for n in _step_dirs(ckpt_dir) if step_of(n) < step]
    drop = older[max(keep - 1, 0) :] + [n for n in _step_dirs(ckpt_dir) if step_of(n) > step]
    drop += [n for n in os.listdir(ckpt_dir) if n.startswith("step-") and n.endswith((".tmp", ".old"))]
    for n in drop:
        shutil.rmtree(os.path.join(ckpt_dir, n), ignore_errors=True)


def _publish(ckpt_dir: str, tmp: str, final: str, keep: int) -> None:
    """step-N.tmp -> step-N, `latest` -> step-N, prune. Run by one process per disk."""
    if os.path.isdir(final):  # the same step saved again (after resuming from it): never a moment with neither
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    atomic_write_text(os.path.join(ckpt_dir, "latest"), os.path.basename(final))
    _prune(ckpt_dir, final, keep)


def _one_line(e: BaseException) -> str:
    """A short reason for a failure; DCP wraps each rank's exception in a CheckpointException."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    text = str(e).strip()
    if "Weights only load failed" in text:  # torch's advice (load with weights_only=False) is what must not happen
        reason = text.split("WeightsUnpickler error:")[-1].strip().splitlines()
        return f"a data item is corrupt or not plain data, refused by weights_only=True ({reason[0] if reason else ''})"
    lines = text.splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


class Checkpointer:
    """Training checkpoints of one run: write step-N (sync, or in the background), publish it, keep `keep`.

    With `async_save` the model and optimizer state are copied to CPU memory inside save() (on CUDA into
    pinned buffers made at the first save and reused after), and DCP writes that copy from a background
    thread while training goes on; its collectives run on a gloo group of their own, never on the training
    job's NCCL. A write is published (renamed, `latest` updated) only by finalize(), which every rank calls
    at the same step.
    """

    def __init__(self, ckpt_dir: str, rank: int, local_rank: int, keep: int = 2, async_save: bool = True):
        import torch.distributed as dist

        self.ckpt_dir, self.rank, self.local_rank, self.keep = ckpt_dir, rank, local_rank, keep
        self.async_save = async_save
        self._pending = None  # (step, future or None)
        self._group = self._writer = None
        if async_save:
            self._group = dist.new_group(backend="gloo")  # collective: every rank builds its Checkpointer together

    def _barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier(group=self._group)

    def save(self, step: int, model, optimizer, train_state: dict) -> None:
        """Start writing step's checkpoint; returns once the state is copied off the device (async) or written
        and published (sync). A previous pending save is finalized first. Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.finalize()  # one write in flight at most: the staging buffers are reused
        tmp = _step_dir(self.ckpt_dir, step) + ".tmp"
        if self.local_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, exist_ok=True)
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        _write_rank_files(tmp, step, train_state, self.rank)
        if self.async_save:
            fut = dcp.async_save(
                self._staged(state),
                checkpoint_id=tmp,
                storage_writer=self._async_writer(tmp),
                process_group=self._group,
            )
            self._pending = (step, getattr(fut, "upload_completion", fut))
        else:
            dcp.save(state, checkpoint_id=tmp)
            self._pending = (step, None)
            self.finalize()

    def _async_writer(self, tmp: str):
        """One DCP writer for the run: it also stages (copies the state to CPU) and keeps the pinned copy.

        Not DCP's DefaultStager: in torch 2.11 it clears itself after each stage and the next save fails,
        and SageMaker's torch 2.8 may lack it; FileSystemWriter(cache_staged_state_dict) is in all of them.
        """
        from torch.distributed.checkpoint import FileSystemWriter

        if self._writer is None:
            self._writer = FileSystemWriter(tmp, cache_staged_state_dict=torch.cuda.is_available())
        return self._writer  # async_save points it at this save's checkpoint_id

    def _staged(self, state: dict) -> dict:
        # Without CUDA the writer's staging may hand back the very CPU tensors training goes on updating
        # (torch versions differ), so the snapshot is taken here.
        return state if torch.cuda.is_available() else copy.deepcopy(state)

    def pending_done(self) -> bool:
        """Local and non-blocking: no save pending, or this rank's part of its write has finished."""
        return self._pending is None or self._pending[1] is None or self._pending[1].done()

    def finalize(self) -> str | None:
        """Collective: wait for the pending write on every rank, publish it (step-N, `latest`, prune).

        Returns its path, or None when nothing was pending (then it costs nothing and talks to no rank).
        Raises CheckpointError on every rank if any rank's write failed; `latest` then still names the previous one.
        """
        if self._pending is None:
            return None
        import torch.distributed as dist

        step, fut = self._pending
        self._pending = None
        error, failed = None, False
        if fut is not None:  # async; a sync save raised in save() already, on every rank (DCP gathers errors)
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                fut.result()
            except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
                error = _one_line(e)
            flag = torch.tensor([error is not None], dtype=torch.int32)
            if dist.is_initialized():  # every rank learns of a failure anywhere, so all take the same path
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            failed = bool(flag.item())
        final = _step_dir(self.ckpt_dir, step)
        if failed:
            raise CheckpointError(
                f"{final}.tmp: checkpoint of step {step} was not written "
                f"({error or 'failed on another rank'}); `latest` still names the previous one"
            )
        tmp = final + ".tmp"
        # One rename per disk: rank 0, and local rank 0 of any host whose disk lacks rank 0's .metadata
        # (per-host disks). On a shared disk the others see .metadata (or the dir already renamed) and wait.
        if (
            self.local_rank == 0
            and os.path.isdir(tmp)
            and (self.rank == 0 or not os.path.isfile(os.path.join(tmp, ".metadata")))
        ):
            _publish(self.ckpt_dir, tmp, final, self.keep)
        self._barrier()
        return final

    def close(self) -> None:
        """Finalize a pending save (collective), then release the pinned copy and the gloo group."""
        import torch.distributed as dist

        self.finalize()
        self._writer = None  # frees the pinned copy
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
            self._group = None


def save_train_checkpoint(
    ckpt_dir: str, step: int, model, optimizer, train_state: dict, rank: int, local_rank: int, keep: int = 2
) -> str:
    """Sharded model + optimizer (DCP), this rank's RNG and `train_state.json`, written and published now."""
    Checkpointer(ckpt_dir, rank, local_rank, keep, async_save=False).save(step, model, optimizer, train_state)
    return _step_dir(ckpt_dir, step)


def _dcp_load(state: dict, path: str) -> None:
    """dcp.load with nothing unpickled freely: metadata through _MetadataUnpickler, and the non-tensor items
    (optimizer hyper-parameters) with weights_only=True (DCP's own planner uses weights_only=False)."""
    # DCP takes seconds to import and only training needs it: hence the imports and classes in here.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())
    except CheckpointException as e:  # DCP's: every rank's traceback in one message (and a BaseException)
        raise CheckpointError(f"{path}: {_one_line(e)}") from None


def load_train_checkpoint(path: str, model, optimizer, rank: int) -> dict:
    """Restore model + optimizer shards (any world size: DCP reshards), this rank's RNG; return train_state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state_file = os.path.join(path, "train_state.json")
    if not os.path.isfile(state_file):
        raise CheckpointError(f"{path}: incomplete checkpoint (no train_state.json)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    _dcp_load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = os.path.join(path, f"rng-{rank:05d}.safetensors")
    if os.path.isfile(rng_file):  # absent when resuming on more ranks than saved: fresh RNG for those
        with safe_open(rng_file, "pt") as f:
            torch.set_rng_state(f.get_tensor("cpu"))
            if torch.cuda.is_available() and "cuda" in f.keys():
                torch.cuda.set_rng_state(f.get_tensor("cuda"))
    with open(state_file) as fh:
        return json.load(fh)


# ---------------------------------------------------------------- resume: the one call train.py makes


def _on_rank0(fn, rank: int):
    """fn() run on rank 0, its result (or its CheckpointError) handed to every rank, so all take one path.

    Several hosts may see different files (each syncs its own disk); rank 0's view decides.
    """
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        try:
            box = [("ok", fn())]
        except CheckpointError as e:
            box = [("error", str(e))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def _first_error(error: str | None) -> str | None:
    """The first rank's load error (None if every rank loaded), known to every rank."""
    import torch.distributed as dist

    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _shown(saved, new):
    """(saved, new) as an error message shows them: for dicts only the entries that differ."""
    if isinstance(saved, dict) and isinstance(new, dict):
        keys = [k for k in {**saved, **new} if saved.get(k) != new.get(k)]
        return {k: saved.get(k) for k in keys}, {k: new.get(k) for k in keys}
    return saved, new


def _check_state(path: str, saved: dict, must_match: dict, may_change: dict) -> list[str]:
    """Raise on a must_match key the checkpoint was saved with another value of; return may_change diffs."""
    for key, new in must_match.items():
        new = json.loads(json.dumps(new))  # as train_state.json would hold it (tuples become lists)
        if key in saved and saved[key] != new:  # a key an older checkpoint lacks is no error
            old, new = _shown(saved[key], new)
            raise CheckpointError(
                f"{path}: checkpoint was made with {key}={old!r}, this run has {new!r}; "
                f"use --resume never or another --checkpoint-dir"
            )
    changed = []
    for key, new in may_change.items():
        new = json.loads(json.dumps(new))
        if key in saved and saved[key] != new:
            changed.append(f"{key}={saved[key]!r}->{new!r}")
    return changed


def _read_train_state(path: str) -> dict:
    try:
        with open(os.path.join(path, "train_state.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/train_state.json: unreadable ({e})") from None


def _newer_incomplete(ckpt_dir: str, complete: list[str]) -> list[str]:
    """Finished step dirs newer than the newest complete checkpoint that are not complete themselves."""
    if not os.path.isdir(ckpt_dir):
        return []
    names = _step_dirs(ckpt_dir)
    newest = os.path.basename(complete[0]) if complete else None
    newer = names[: names.index(newest)] if newest in names else names
    return [os.path.join(ckpt_dir, n) for n in newer if os.path.join(ckpt_dir, n) not in complete]


def resume(
    ckpt_dir: str, model, optimizer, rank: int, must_match: dict, may_change: dict, warn
) -> tuple[int, dict | None]:
    """Load the newest loadable complete checkpoint of ckpt_dir; (step, train_state), or (0, None) if none.

    Collective. A checkpoint saved with another value of a `must_match` key (model shape, phase) raises
    CheckpointError; changed `may_change` keys (seed, batch) give one warning line. A checkpoint that
    fails to load gives a warning and the previous one is tried. `warn(line)` is called on rank 0 only.
    """
    candidates = _on_rank0(lambda: complete_checkpoints(ckpt_dir), rank)
    if rank == 0:
        for path in _newer_incomplete(ckpt_dir, candidates):
            warn(f"warning: {path} is incomplete (a save or a sync that did not finish); skipped")
    for path in candidates:
        saved = _on_rank0(functools.partial(_read_train_state, path), rank)
        changed = _check_state(path, saved, must_match, may_change)
        error = None
        try:
            load_train_checkpoint(path, model, optimizer, rank)
        except CheckpointError as e:
            error = str(e).removeprefix(f"{path}: ")
        except Exception as e:  # a corrupt RNG file, a rank's own failure
            error = _one_line(e)
        error = _first_error(error)
        if error is None:
            if changed and rank == 0:
                warn(f"warning: resuming from {path} with changed {', '.join(changed)}")
            return int(saved["step"]), saved
        if rank == 0:
            warn(f"warning: {path} could not be loaded ({error}); trying the previous checkpoint")
    if candidates:  # the model may be partly overwritten by the failed loads: never train on from there
        raise CheckpointError(
            f"{ckpt_dir}: no checkpoint could be loaded (tried {len(candidates)}); "
            f"use --resume never or another --checkpoint-dir"
        )
    return 0, None


# ---------------------------------------------------------------- identities (what a resume must agree on)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_fingerprint(model_dir: str | None) -> str | None:
    """A cheap identity of a HF model dir: config.json, and each weight file's size, first and last MiB."""
    if not model_dir:
        return None
    h = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        if name == "config.json" or name.endswith(".safetensors"):
            path = os.path.join(model_dir, name)
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                h.update(f"{name}:{size}".encode() + f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read())
    return h.hexdigest()
