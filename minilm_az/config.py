"""Run configs as dataclasses (the published recipe as defaults) and the one way flags are made from them.

Each field becomes a `--flag-name`; its `help` metadata is the flag's help. Booleans take `--x`, `--no-x`
and SageMaker's `--x true` / `--x "false"`; an int or float field whose default is None accepts "none".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

# The recipe (a Llama 3.2 1B, Azerbaijani CPT): phase 1 trains embeddings only, phase 2 everything.
PHASE_DEFAULTS: dict[int, dict[str, Any]] = {
    1: {"lr": 0.0032, "steps": 5000},
    2: {"lr": 0.0024, "steps": 15000},
}


def _f(default: Any, help: str, **kw) -> Any:
    return field(default=default, metadata={"help": help, **kw})


def env_default(*names: str) -> str | None:
    """The first set environment variable among `names` (SageMaker's SM_CHANNEL_* and friends)."""
    for n in names:
        if os.environ.get(n):
            return os.environ[n]
    return None


def in_sagemaker() -> bool:
    return "SM_MODEL_DIR" in os.environ or "SM_TRAINING_ENV" in os.environ


@dataclass
class TrainConfig:
    phase: int = _f(2, "1: train embeddings only (new vocabulary adapts); 2: train everything", choices=(1, 2))
    preset: str = _f("tiny", "model shape when there is no --base-model (tiny, llama3.2-1b)")
    base_model: str | None = _f(None, "Hugging Face model dir to start from (SM_CHANNEL_BASE_MODEL)")
    base_tokenizer: str | None = _f(None, "the base model's tokenizer dir, for vocabulary transfer in phase 1")
    tokenizer: str | None = _f(None, "our tokenizer dir (tokenize.py train) (SM_CHANNEL_TOKENIZER)")
    data: str | None = _f(None, "token shards dir (tokenize.py encode) (SM_CHANNEL_DATA)")
    out: str | None = _f(None, "where the final HF-format model and metrics.jsonl go (SM_MODEL_DIR)")
    checkpoint_dir: str | None = _f(None, "training checkpoints (default /opt/ml/checkpoints on SageMaker, "
                                          "else OUT/checkpoints)")
    resume: str = _f("auto", "auto: continue from the newest complete checkpoint; never: start fresh",
                     choices=("auto", "never"))
    steps: int | None = _f(None, "optimizer steps (default: phase 1 5000, phase 2 15000)")
    lr: float | None = _f(None, "peak learning rate (default: phase 1 0.0032, phase 2 0.0024)")
    min_lr_ratio: float = _f(0.1, "cosine decays to lr * this")
    warmup: int | None = _f(None, "linear warmup steps (default 5%% of --steps)")
    weight_decay: float = _f(0.1, "AdamW weight decay (not on norm weights)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "max global grad norm (0 disables)")
    seq_len: int = _f(2048, "tokens per sequence")
    micro_batch: int = _f(14, "sequences per GPU per forward")
    global_batch: int = _f(224, "sequences per optimizer step (gradient accumulation fills the gap)")
    eval_every: int = _f(500, "evaluate val BPB every N steps (0: only at the end)")
    eval_batches: int | None = _f(None, "cap on val micro-batches per evaluation (default: the whole val split)")
    log_every: int = _f(10, "print a metrics line every N steps")
    checkpoint_every: int = _f(1000, "write a training checkpoint every N steps (0: only on SIGTERM/end)")
    keep_checkpoints: int = _f(2, "complete checkpoints to keep")
    eval_only: bool = _f(False, "only evaluate BPB of --base-model with --tokenizer on --eval-text or val split")
    eval_text: list[str] | None = _f(None, "raw text files for BPB (default: the val split's documents)",
                                     nargs="+")
    device: str = _f("auto", "auto, cpu or cuda", choices=("auto", "cpu", "cuda"))
    seed: int = _f(0, "seed for init and the data order")
    liger: bool = _f(True, "Liger fused kernels on CUDA (RMSNorm, RoPE, SwiGLU, fused linear CE)")
    compile: bool = _f(False, "torch.compile each transformer block")
    ac: str = _f("none", "activation checkpointing", choices=("none", "full", "selective"))
    export_dtype: str = _f("float32", "dtype of the exported safetensors (bfloat16 halves the size)",
                           choices=("float32", "bfloat16"))


def str2bool(v: str | bool) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().strip('"').strip("'").lower()
    if s in ("1", "true", "yes", "y", "on"):
        return True
    if s in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {v!r}")


def _none_or(t):
    def parse(v: str):
        return None if str(v).lower() in ("none", "null", "") else t(v)
    parse.__name__ = t.__name__
    return parse


def add_dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    """One `--flag` per dataclass field, typed from the field's default."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        help_ = meta.pop("help", None)
        if f.type in ("bool", bool):
            parser.add_argument(flag, nargs="?", const=True, default=f.default, type=str2bool, help=help_,
                                metavar="BOOL")
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                help=argparse.SUPPRESS)
            continue
        base = str(f.type).split("|")[0].strip()
        typ = {"int": int, "float": float, "str": str, "list[str]": str}.get(base, str)
        if "None" in str(f.type) and typ is not str:
            typ = _none_or(typ)
        parser.add_argument(flag, default=f.default, type=typ, help=help_, **meta)


def from_args(cls, ns: argparse.Namespace):
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
