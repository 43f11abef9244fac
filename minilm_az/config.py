"""Every stage's settings as a dataclass, with the published recipe as the defaults.

Each field's metadata holds its `help` text and, where it has them, `lo`/`hi` bounds and `choices`.
launch/flags.py turns each field into a `--flag-name`, so the flags, their help and their checks live here.
The metadata also states the SageMaker contract in one table. `channel` names the input channel that is
mounted at /opt/ml/input/data/<channel> to feed the field. `container` is the fixed container path an
output goes to. The launcher (launch/sagemaker.py) reads the same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

CONTAINER_INPUT = "/opt/ml/input/data"  # fixed by SageMaker
CONTAINER_MODEL = "/opt/ml/model"
CONTAINER_CHECKPOINTS = "/opt/ml/checkpoints"  # CheckpointConfig.LocalPath; SageMaker syncs it with S3
CONTAINER_TENSORBOARD = "/opt/ml/output/tensorboard"  # TensorBoardOutputConfig's local path (the SDKs' default)


@dataclass(frozen=True)
class PhaseRecipe:
    """One phase of the recipe (a Llama 3.2 1B, Azerbaijani CPT): the defaults of --lr and --steps, and what trains."""

    lr: float
    steps: int
    embeddings_only: bool  # phase 1 freezes the backbone, so the new vocabulary adapts to it first


MAX_STEPS = 99_999_999  # a checkpoint's folder holds its step in 8 digits, which order them by name
PHASE_1 = PhaseRecipe(lr=0.0032, steps=5000, embeddings_only=True)
PHASE_2 = PhaseRecipe(lr=0.0024, steps=15000, embeddings_only=False)


def _f(default: Any, help: str, **meta) -> Any:
    return field(default=default, metadata={"help": help, **meta})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_values(cfg) -> None:
    """Raise ValueError, naming the flag, for a value that cannot mean what was asked: an empty string (a path or a
    prompt of nothing; leaving the flag out gives its default), or a flag that does nothing in this mode (a field
    whose metadata says which flags it `needs`). Every config calls it as it is made, from flags or from code."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        blank = lambda v: isinstance(v, str) and v.strip() == ""  # noqa: E731 (spaces only are empty too)
        if blank(value) or (isinstance(value, list) and any(map(blank, value))):
            raise ValueError(f"{_flag(f.name)} is empty; give a value, or leave the flag out for its default")
        given = value not in (None, False, f.default)
        needs, unused_with = f.metadata.get("needs", ()), f.metadata.get("not_with", ())
        if given and needs and not any(getattr(cfg, n) for n in needs):
            raise ValueError(
                f"{_flag(f.name)} does nothing without {' or '.join(map(_flag, needs))}; drop it (it would be ignored)"
            )
        if given and (used := [n for n in unused_with if _mode_on(cfg, n)]):
            raise ValueError(f"{_flag(f.name)} does nothing with {_mode(used[0])}; drop it (it would be ignored)")


def _mode_on(cfg, mode: str) -> bool:
    """A `not_with` entry: a field that is set ("eval_only"), or a field at one value ("lang=none", "quality=False")."""
    name, eq, value = mode.partition("=")
    return str(getattr(cfg, name, None)) == value if eq else bool(getattr(cfg, name, None))


def _mode(mode: str) -> str:
    name, _, value = mode.partition("=")
    return f"--no-{name.replace('_', '-')}" if value == "False" else f"{_flag(name)} {value}".strip()


# ---------------------------------------------------------------- train.py and finetune.py


OVERWRITE = "replace what an earlier run of this stage wrote in --out (only the files its marker lists)"


@dataclass
class LoopFlags:
    """What the loops of train.py and finetune.py share: checkpoints and resume (minilm_az/checkpoint.py), and
    TensorBoard event files written from the same records as metrics.jsonl (minilm_az/logs.py)."""

    checkpoint_dir: str | None = _f(
        None,
        "training checkpoints (default OUT/checkpoints; s3://BUCKET/PREFIX on S3)",
        container=CONTAINER_CHECKPOINTS,
        not_with=("eval_only", "chat", "prompt"),
    )
    resume: str = _f(
        "auto",
        "auto: continue from the newest complete checkpoint; never: start fresh",
        choices=("auto", "never"),
        not_with=("eval_only", "chat", "prompt"),
    )
    checkpoint_every: int = _f(
        1000,
        "write a training checkpoint every N steps (0: only on SIGTERM/end)",
        lo=0,
        not_with=("eval_only", "chat", "prompt"),
    )
    checkpoint_minutes: float = _f(
        0.0,
        "also every N minutes (0: off; 30 on SageMaker, where no SIGTERM reaches us)",
        lo=0.0,
        sagemaker=30.0,
        not_with=("eval_only", "chat", "prompt"),
    )
    async_checkpoint: bool = _f(
        True,
        "write checkpoints in the background (training waits only for the copy off the GPU)",
        not_with=("eval_only", "chat", "prompt"),
    )
    keep_checkpoints: int = _f(2, "complete checkpoints to keep", lo=1, not_with=("eval_only", "chat", "prompt"))
    overwrite: bool = _f(
        False, OVERWRITE + "; the same inputs continue their run without it", not_with=("chat", "prompt")
    )
    tensorboard: bool = _f(
        False,
        "TensorBoard event files too, in OUT/tensorboard (on SageMaker synced to S3)",
        not_with=("chat", "prompt"),
    )

    def __post_init__(self) -> None:
        check_values(self)


@dataclass
class TrainConfig(LoopFlags):
    phase: int = _f(
        2,
        "1: train embeddings only (new vocabulary adapts); 2: train everything",
        choices=(1, 2),
        not_with=("eval_only",),
    )
    preset: str = _f(
        "tiny", "model shape when there is no --base-model", choices=("tiny", "llama3.2-1b"), not_with=("base_model",)
    )
    base_model: str | None = _f(None, "Hugging Face model dir to start from", channel="base_model")
    base_tokenizer: str | None = _f(
        None,
        "the base model's tokenizer dir (phase 1: vocabulary transfer)",
        channel="base_tokenizer",
        needs=("base_model",),
        not_with=("eval_only",),
    )
    tokenizer: str | None = _f(None, "our tokenizer dir (tokenize.py train)", channel="tokenizer")
    data: str | None = _f(None, "token shards dir (tokenize.py encode)", channel="data")
    out: str | None = _f(
        None, "final HF-format model and metrics.jsonl (default runs/phaseN)", container=CONTAINER_MODEL
    )
    steps: int | None = _f(
        None,
        f"optimizer steps (default: phase 1 {PHASE_1.steps}, phase 2 {PHASE_2.steps})",
        lo=1,
        hi=MAX_STEPS,
        not_with=("eval_only",),
    )
    lr: float | None = _f(
        None,
        f"peak learning rate (default: phase 1 {PHASE_1.lr}, phase 2 {PHASE_2.lr})",
        gt=0.0,
        hi=1e6,
        not_with=("eval_only",),
    )
    min_lr_ratio: float = _f(0.1, "cosine decays to lr * this", lo=0.0, hi=1.0, not_with=("eval_only",))
    warmup: int | None = _f(None, "linear warmup steps (default 5%% of --steps)", lo=0, not_with=("eval_only",))
    weight_decay: float = _f(0.1, "AdamW weight decay (not on norm weights)", lo=0.0, not_with=("eval_only",))
    beta1: float = _f(0.9, "AdamW beta1", lo=0.0, hi=1.0)
    beta2: float = _f(0.95, "AdamW beta2", lo=0.0, hi=1.0)
    grad_clip: float = _f(1.0, "max global grad norm (0 disables)", lo=0.0, not_with=("eval_only",))
    seq_len: int | None = _f(None, "tokens per sequence (default: 2048, or the model's context if shorter)", lo=2)
    micro_batch: int | None = _f(
        None,
        "sequences per GPU per forward (default: the largest <= 14 that divides the global batch's share of each GPU)",
        lo=1,
    )
    global_batch: int = _f(224, "sequences per optimizer step (gradient accumulation fills the gap)", lo=1, hi=1 << 20)
    eval_every: int = _f(500, "evaluate val BPB every N steps (0: only at the end)", lo=0, not_with=("eval_only",))
    eval_batches: int | None = _f(None, "cap on val micro-batches per evaluation (default: the whole val split)", lo=1)
    log_every: int = _f(10, "print a metrics line every N steps", lo=1)
    eval_only: bool = _f(False, "only evaluate BPB of --base-model with --tokenizer on --eval-text or val split")
    eval_text: list[str] | None = _f(None, "raw text files for BPB (default: the val split's documents)", nargs="+")
    device: str = _f("auto", "where to train", choices=("auto", "cpu", "cuda"))
    seed: int = _f(0, "seed for init and the data order", lo=0, hi=2**32 - 1)
    liger: bool = _f(True, "Liger fused kernels on CUDA (RMSNorm, RoPE, SwiGLU, fused linear CE)")
    compile: bool = _f(False, "torch.compile each transformer block")
    ac: str = _f("none", "activation checkpointing", choices=("none", "full", "selective"))
    replicate: int = _f(1, "HSDP: N copies of the model, each sharded over processes / N (one host)", lo=1)
    fp8: str = _f(
        "none",
        "float8 matmuls in the blocks' linears, rowwise only the large ones (torchao; CUDA 8.9+, with --compile)",
        choices=("none", "tensorwise", "rowwise"),
    )
    fp8_all_gather: str = _f(
        "auto",
        "FSDP2 gathers float8 weights (tensorwise): auto = on with several processes, off with one",
        choices=("auto", "true", "false"),
    )
    fp8_fast_accum: bool = _f(
        False, "the backward's float8 GEMMs accumulate fast too, as the forward's do (faster; bench/RESULTS.md)"
    )
    export_dtype: str = _f(
        "float32",
        "dtype of the exported safetensors (bfloat16 halves the size)",
        choices=("float32", "bfloat16"),
        not_with=("eval_only",),
    )

    def __post_init__(self) -> None:
        check_values(self)
        if self.steps and self.warmup and self.warmup > self.steps:  # the lr would never reach its peak
            raise ValueError(f"--warmup {self.warmup} is longer than --steps {self.steps}")
        if self.eval_only and self.tensorboard and not self.out:  # its records would go to no file at all
            raise ValueError("--tensorboard with --eval-only needs --out, the directory its event files go to")


@dataclass(frozen=True)
class TrainPlan:
    """One train.py run, made once from the flags and the number of processes (train.py's resolve), never changed.
    Where a flag's default depends on the phase, the model or the processes, read the plan's field, not `flags`."""

    flags: TrainConfig  # as the user gave them
    out: str  # the exported model and metrics.jsonl
    checkpoint_dir: str  # each phase saves into a folder of its own in here
    steps: int
    lr: float
    warmup: int
    seq_len: int
    micro_batch: int
    fp8_all_gather: bool  # FSDP2 gathers float8 weights (--fp8-all-gather auto is on with several processes)
    embeddings_only: bool  # phase 1 freezes the backbone, so the new vocabulary adapts to it
    transfer_vocab: bool  # our vocabulary's embedding rows start from the base model's rows


# ---------------------------------------------------------------- finetune.py


TRY = ("chat", "prompt")  # the flags of finetune.py that try a model instead of training one


@dataclass
class FinetuneConfig(LoopFlags):
    model: str | None = _f(None, "HF-format Llama directory (the CPT export)", channel="model")
    tokenizer: str | None = _f(None, "directory with tokenizer.json (default: --model)", channel="tokenizer")
    data: str | None = _f(
        None,
        "chat JSONL file, or a directory: train*.jsonl / *.jsonl train, val*.jsonl / *_val.jsonl validate",
        channel="data",
        not_with=TRY,
    )
    val_data: str | None = _f(
        None,
        "val chat JSONL file or directory of them (default: val files in --data, else a --val-fraction split)",
        channel="val_data",
        not_with=TRY,
    )
    val_fraction: float = _f(
        0.05, "held out of --data when there is no val file", lo=0.0, hi=0.5, not_with=(*TRY, "val_data")
    )
    out: str = _f("runs/finetune", "adapter (and merged/) here", container=CONTAINER_MODEL, not_with=TRY)
    on_bad_line: str = _f("fail", "malformed JSONL lines", choices=("fail", "skip"), not_with=TRY)
    last_turn_only: bool = _f(False, "train only the final assistant turn of each conversation", not_with=TRY)
    lora_r: int = _f(64, "LoRA rank", lo=1, not_with=TRY)
    lora_alpha: float = _f(
        28.0, "LoRA scaling = alpha / r (0 would train an adapter that does nothing)", gt=0.0, not_with=TRY
    )
    lora_dropout: float = _f(0.05, "dropout on the adapter's input", lo=0.0, hi=0.99, not_with=TRY)
    targets: str = _f(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "comma-separated projections", not_with=TRY
    )
    max_seq_len: int = _f(1024, "tokens per conversation (longer ones are truncated)", lo=2)
    packing: bool = _f(
        True,
        "pack each step's conversations into rows of --max-seq-len tokens, attention kept within each "
        "conversation (the same loss as one padded conversation a row, without computing the padding)",
    )
    max_tokens_per_forward: int | None = _f(
        None,
        "packed: tokens per forward, per process (default: --micro-batch x --max-seq-len, the most a padded "
        "micro-batch can hold); lower it to cap activation memory at the cost of more forwards a step",
        lo=1,
        needs=("packing",),
    )
    steps: int | None = _f(None, "optimizer steps (default: --epochs over the data)", lo=1, hi=MAX_STEPS, not_with=TRY)
    epochs: float = _f(1.0, "passes over the data when --steps is not given", gt=0.0, not_with=(*TRY, "steps"))
    lr: float = _f(2e-4, "peak learning rate", gt=0.0, hi=1e6, not_with=TRY)
    min_lr_ratio: float = _f(0.1, "cosine decays to lr * this", lo=0.0, hi=1.0, not_with=TRY)
    warmup: int = _f(10, "linear warm-up steps", lo=0, not_with=TRY)
    weight_decay: float = _f(0.0, "AdamW weight decay", lo=0.0, not_with=TRY)
    grad_clip: float = _f(1.0, "max global grad norm (0 disables)", lo=0.0, not_with=TRY)
    micro_batch: int | None = _f(
        None,
        "conversations per forward, per process, padded (default: the largest <= 4 that "
        "divides each process's share of --global-batch); packed, it sets --max-tokens-per-forward's default",
        lo=1,
    )
    global_batch: int = _f(16, "conversations per step, all processes", lo=1, hi=1 << 20, not_with=TRY)
    eval_every: int = _f(50, "val loss every N steps", lo=1, not_with=TRY)
    log_every: int = _f(10, "print a metrics line every N steps", lo=1)
    seed: int = _f(0, "seed for the adapter init, dropout and the data order", lo=0, hi=2**32 - 1)
    merge: bool = _f(False, "also export base+adapter merged, as a HF model in OUT/merged", not_with=TRY)
    device: str = _f("auto", "where to train", choices=("auto", "cpu", "cuda"))
    liger: bool = _f(True, "Liger's fused kernels on CUDA")
    compile: bool = _f(False, "torch.compile each block")
    ac: str = _f("none", "activation checkpointing", choices=("none", "full", "selective"))
    replicate: int = _f(1, "HSDP: N copies of the model, each sharded over processes / N (one host)", lo=1)
    chat: bool = _f(False, "no training: interactive chat on stdin with --model (+ --adapter)")
    prompt: str | None = _f(None, "no training: one user message, print the reply and exit")
    adapter: str | None = _f(None, "adapter dir for --chat/--prompt", needs=TRY)
    system: str | None = _f(None, "system prompt for --chat/--prompt", needs=TRY)
    max_new_tokens: int = _f(256, "reply length cap for --chat/--prompt", lo=1, needs=TRY)
    temperature: float = _f(0.7, "sampling temperature (0: greedy)", lo=0.0, needs=TRY)
    top_p: float = _f(0.9, "nucleus sampling mass", lo=1e-9, hi=1.0, needs=TRY)


# ---------------------------------------------------------------- tokenize.py (one config per subcommand)


@dataclass
class CorpusConfig:
    corpus: list[str] | None = _f(
        None,
        ".txt/.jsonl files (or .gz/.zst of them), .parquet, dirs (default: the demo corpus)",
        nargs="+",
        channel="corpus",
    )
    doc_sep: str = _f("line", ".txt: a document a line, or blank-line separated", choices=("line", "blank"))
    text_field: str = _f("text", ".jsonl field / .parquet column holding the text")
    errors: str = _f("strict", "invalid UTF-8: fail, or replace with U+FFFD", choices=("strict", "replace"))
    progress: bool = _f(True, "progress bars")

    def __post_init__(self) -> None:
        check_values(self)


@dataclass
class TokenizeTrainConfig(CorpusConfig):
    vocab_size: int = _f(100_000, "ids incl. bytes and specials", lo=272)
    min_frequency: int = _f(2, "least count of a pair to merge", lo=1)
    max_token_length: int | None = _f(None, "longest token in characters (default: no limit)", lo=1)
    model_max_length: int | None = _f(None, "model_max_length in tokenizer_config.json", lo=1)
    out: str | None = _f(None, "tokenizer directory to write", container=CONTAINER_MODEL)
    overwrite: bool = _f(False, OVERWRITE)


@dataclass
class TokenizeReportConfig(CorpusConfig):
    tokenizer: str | None = _f(None, "our tokenizer dir (or tokenizer.json)", channel="tokenizer")
    baseline: str | None = _f(
        None, "a baseline tokenizer.json or the dir holding it (the base model's)", channel="baseline"
    )
    json: str | None = _f(
        None, "write the JSON report to this file instead of printing it", container=f"{CONTAINER_MODEL}/report.json"
    )
    overwrite: bool = _f(False, "replace an existing --json file", needs=("json",))


@dataclass
class TokenizeEncodeConfig(CorpusConfig):
    tokenizer: str | None = _f(None, "tokenizer dir (or tokenizer.json)", channel="tokenizer")
    val_corpus: list[str] | None = _f(
        None, "a separate val corpus (then --val-fraction is unused)", nargs="+", channel="val_corpus"
    )
    val_fraction: float = _f(0.01, "val share of documents, by text hash", lo=0.0, hi=0.5, not_with=("val_corpus",))
    shard_tokens: int = _f(100_000_000, "tokens per .bin file", lo=1024)
    batch_mb: int | None = _f(None, "MB of text per encode_batch call; memory grows ~30x it (default: CPUs/4)", lo=1)
    out: str | None = _f(None, "shard directory to write", container=CONTAINER_MODEL)
    overwrite: bool = _f(False, OVERWRITE)


@dataclass
class TokenizeCleanConfig(CorpusConfig):
    out: str | None = _f(None, "directory for clean-*.jsonl.gz and clean_report.json", container=CONTAINER_MODEL)
    overwrite: bool = _f(False, OVERWRITE)
    normalize: bool = _f(True, "NFC, control characters out, single spaces, stripped lines")
    lang: str = _f("az", "keep Azerbaijani (Latin script) by py3langid, or keep every language", choices=("az", "none"))
    lang_threshold: float = _f(
        0.5, "least py3langid probability of az to keep a document", lo=0.0, hi=1.0, not_with=("lang=none",)
    )
    quality: bool = _f(True, "Gopher/C4-style rules: length, word length, letters, symbols, repetition")
    min_words: int = _f(5, "fewest whitespace words a document keeps (Gopher: 50)", lo=0, not_with=("quality=False",))
    max_words: int = _f(100_000, "most whitespace words a document keeps", lo=1, not_with=("quality=False",))
    dedup: str = _f(
        "near", "exact: identical normalised text; near: also MinHash LSH", choices=("none", "exact", "near")
    )
    near_threshold: float = _f(
        0.7,
        "estimated Jaccard (character 5-grams) that makes a near-duplicate",
        lo=0.05,
        hi=1.0,
        not_with=("dedup=none", "dedup=exact"),
    )
    dedup_memory_mb: int = _f(
        512, "RAM of the dedup indexes; past it they spill to OUT (a temp folder), with the same verdicts", lo=64
    )
    workers: int | None = _f(None, "processes for normalise/lang/quality/hashing (default: CPUs)", lo=1)
    shard_mb: int = _f(256, "MB of text per clean-*.jsonl.gz file", lo=1)
    samples: int = _f(5, "removed documents kept per reason in clean_report.json, for a human to check", lo=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quality and self.min_words > self.max_words:
            raise ValueError(
                f"--min-words {self.min_words} is above --max-words {self.max_words}: no document would stay"
            )


TOKENIZE_CONFIGS = {
    "clean": TokenizeCleanConfig,
    "train": TokenizeTrainConfig,
    "report": TokenizeReportConfig,
    "encode": TokenizeEncodeConfig,
}
