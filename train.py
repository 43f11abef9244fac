"""Stage 2: continued pretraining of our Llama on token shards, under torchrun with FSDP2.

    torchrun --nproc_per_node 8 train.py --phase 1 --base-model BASE --base-tokenizer BASE \\
        --tokenizer TOK --data SHARDS --out PHASE1        # embeddings only, the new vocabulary adapts
    torchrun --nproc_per_node 8 train.py --phase 2 --base-model PHASE1 --tokenizer TOK \\
        --data SHARDS --out PHASE2                        # everything trains
    python train.py --eval-only --base-model M --tokenizer M --eval-text FILE    # bits per byte

Reads top to bottom: flags and input checks, the model, evaluation, one step, `train` (resume, loop, export).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
import unicodedata

import numpy as np
import torch

from minilm_az import bpb, checkpoint, parallel
from minilm_az import tokenizer as tk
from minilm_az.config import PHASE_DEFAULTS, TrainConfig
from minilm_az.data import BatchStream
from minilm_az.hf import load_weights_into, read_config, read_tensor, save_pretrained
from minilm_az.kernels import select_ops
from minilm_az.launch.flags import in_sagemaker, make_parser, parse_config
from minilm_az.logs import MetricLogger, Progress, print_error, throughput, ticker
from minilm_az.model import get_preset, materialize, meta_model
from minilm_az.optim import adamw, cosine_lr, set_lr
from minilm_az.outputs import check_writable, file_sha256
from minilm_az.prep import readers
from minilm_az.shards import TokenStream, check_tokenizer, load_index
from minilm_az.transfer import transfer_embedding


class UsageError(ValueError):
    """A problem with the flags or inputs, reported as one line without a traceback."""


# ---------------------------------------------------------------- flags


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = make_parser(TrainConfig, "train.py", __doc__)
    cfg = parse_config(TrainConfig, p, argv)
    try:
        resolve(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    except ValueError as e:  # UsageError and CheckpointError are ValueErrors
        p.error(str(e))
    return cfg


def resolve(cfg: TrainConfig, world: int) -> None:
    """Defaults that depend on the phase, the model and the number of processes; flag errors before any work."""
    if cfg.phase == 1 and not cfg.eval_only and not (cfg.base_model and cfg.base_tokenizer):
        raise UsageError("--phase 1 trains a base model's embeddings: it needs --base-model and --base-tokenizer")
    cfg.out = cfg.out or os.path.join("runs", f"phase{cfg.phase}")
    cfg.checkpoint_dir = cfg.checkpoint_dir or os.path.join(cfg.out, "checkpoints")
    cfg.steps = cfg.steps or PHASE_DEFAULTS[cfg.phase]["steps"]
    cfg.lr = cfg.lr if cfg.lr is not None else PHASE_DEFAULTS[cfg.phase]["lr"]
    cfg.warmup = cfg.warmup if cfg.warmup is not None else max(1, cfg.steps // 20)
    if cfg.checkpoint_minutes is None:  # on SageMaker a spot interruption sends no SIGTERM we could act on
        cfg.checkpoint_minutes = 30.0 if in_sagemaker() else 0.0
    base = need_dir(cfg.base_model, "--base-model", "a Hugging Face model directory") if cfg.base_model else None
    context = read_config(base).max_seq_len if base else get_preset(cfg.preset).max_seq_len
    cfg.seq_len = cfg.seq_len or min(2048, context)
    if cfg.seq_len > context:
        raise UsageError(f"--seq-len {cfg.seq_len} exceeds the model's context of {context} tokens")
    cfg.micro_batch, _ = parallel.split_batch(cfg.global_batch, world, cfg.micro_batch, largest=14)
    cfg.fp8_all_gather = parallel.check_fp8(
        cfg.fp8, cfg.fp8_all_gather, cfg.compile, cfg.device, world, cfg.fp8_fast_accum
    )
    for name in ("base_model", "base_tokenizer", "tokenizer", "data"):
        path = getattr(cfg, name)
        if not cfg.eval_only and path and os.path.abspath(path) == os.path.abspath(cfg.out):
            raise UsageError(f"--out {cfg.out} is also --{name.replace('_', '-')}: the export would overwrite it")


def need_dir(path: str | None, flag: str, what: str) -> str:
    if not path or not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: no such directory ({what})" if path else f"{flag} is required ({what})")
    return path


def embedding_rows(cfg: TrainConfig, n_tok: int) -> int:
    """Rows of the model's embedding: the base's (phase 2 from a model), else our vocabulary padded to 64."""
    if cfg.base_model and not cfg.base_tokenizer:  # the model already speaks this tokenizer
        tk.check_model_tokenizer(cfg.base_model, cfg.tokenizer, "--tokenizer")
        vocab = read_config(cfg.base_model).vocab_size
        if vocab < n_tok:
            hint = "is it its own?" if cfg.eval_only else "pass --base-tokenizer to transfer the vocabulary (phase 1)"
            raise UsageError(f"the tokenizer has {n_tok} ids but {cfg.base_model} only {vocab} embedding rows: {hint}")
        return vocab
    if cfg.base_model:
        tk.check_model_tokenizer(cfg.base_model, cfg.base_tokenizer, "--base-tokenizer")
    return math.ceil(n_tok / 64) * 64  # new embedding rows: a GPU-friendly multiple


# ---------------------------------------------------------------- model


def build(cfg: TrainConfig, proc: parallel.Process, vocab_size: int, log: MetricLogger, tok=None):
    """Meta model -> freeze for the phase -> AC/compile/FSDP2 -> materialise -> load (or init) weights."""
    overrides = {}
    if cfg.base_model:
        mcfg = read_config(cfg.base_model)
        if cfg.base_tokenizer:  # phase 1: our vocabulary's rows from the base's rows (transfer.py)
            base_tok = tk.load_tokenizer(cfg.base_tokenizer)
            heads = ["model.embed_tokens.weight"] + ([] if mcfg.tie_embeddings else ["lm_head.weight"])
            for name in heads:
                base_rows = read_tensor(cfg.base_model, name)
                rows, stats = transfer_embedding(base_rows, base_tok, tok, vocab_size)
                log.log("vocab_transfer", tensor=name, **dataclasses.asdict(stats), new_vocab=vocab_size)
                overrides[name] = rows
            mcfg = mcfg.with_vocab(vocab_size)
    else:
        mcfg = get_preset(cfg.preset, vocab_size)
    model = meta_model(mcfg, select_ops(proc.device, cfg.liger, cfg.compile))
    if cfg.phase == 1:  # the backbone is frozen: only embeddings (and an untied head) get grads and state
        for name, p in model.named_parameters():
            p.requires_grad_(name in ("model.embed_tokens.weight", "lm_head.weight"))
    fp8 = dict(fp8=cfg.fp8, fp8_all_gather=cfg.fp8_all_gather == "true", fp8_fast_accum=cfg.fp8_fast_accum)
    parallel.parallelize(model, mixed_precision=proc.device.type == "cuda", ac=cfg.ac, compile=cfg.compile, **fp8)
    materialize(model, proc.device, seed=cfg.seed, init=not cfg.base_model)
    if cfg.base_model:
        load_weights_into(model, cfg.base_model, overrides)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accum = cfg.global_batch // (cfg.micro_batch * proc.world_size)
    log.log("model", params=mcfg.num_params(), trainable=trainable, world=proc.world_size, micro_batch=cfg.micro_batch)
    log.log("batch", accum=accum, tokens_per_step=cfg.global_batch * cfg.seq_len, ops=model.ops.name, fp8=cfg.fp8)
    return model


# ---------------------------------------------------------------- evaluation


def eval_tokens(cfg: TrainConfig, tok) -> np.ndarray:
    """The stream to score: --eval-text documents (NFC once, then encoded), else the val split of --data."""
    eos = tk.eos_id(tok)
    if cfg.eval_text:
        docs = [unicodedata.normalize("NFC", t) for t in readers.iter_documents(readers.corpus_files(cfg.eval_text))]
        return bpb.doc_stream(tk.encode_plain(tok, docs), eos)
    val = TokenStream(cfg.data, "val")
    if val.num_tokens == 0:
        raise UsageError(f"{cfg.data}: the val split is empty; pass --eval-text or re-encode with a val split")
    return np.concatenate([[eos], val.get(0, val.num_tokens)])


def evaluate(model, tokens: np.ndarray, token_bytes: np.ndarray, cfg: TrainConfig, proc, log, step: int) -> dict:
    """Val loss and bits per byte: bytes are those of exactly the targets scored (see bpb.py)."""
    cap = cfg.eval_batches * cfg.micro_batch if cfg.eval_batches else None
    tick = ticker(log, "eval_progress", step=step)
    shares = bpb.total_nll(
        model, tokens, cfg.seq_len, cfg.micro_batch, proc.device, proc.rank, proc.world_size, cap, token_bytes, tick
    )
    nll, count, n_bytes = parallel.all_reduce_sum(list(shares), proc.device)
    bits = bpb.bits_per_byte(nll, n_bytes)
    return dict(
        val_loss=nll / max(count, 1), val_bpb=bits, val_tokens=int(count), val_bytes=int(n_bytes), window=cfg.seq_len
    )


def eval_only(cfg: TrainConfig, proc: parallel.Process, log: MetricLogger) -> None:
    need_dir(cfg.base_model, "--base-model", "the model to evaluate")
    tok = tk.load_tokenizer(need_dir(cfg.tokenizer, "--tokenizer", "the model's own tokenizer"))
    cfg.phase, cfg.base_tokenizer = 2, None  # evaluate the model as it is: no vocabulary transfer
    model = build(cfg, proc, embedding_rows(cfg, tok.get_vocab_size(with_added_tokens=True)), log)
    log.log("eval", step=0, **evaluate(model, eval_tokens(cfg, tok), tk.token_byte_lengths(tok), cfg, proc, log, 0))


# ---------------------------------------------------------------- training


def train_step(model, optimizer, stream: BatchStream, step: int, params: list, cfg: TrainConfig, proc):
    """Forward and backward over this rank's micro-batches of `step`; returns (mean loss here, grad norm)."""
    set_lr(optimizer, cosine_lr(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
    loss_sum = torch.zeros((), device=proc.device)
    for x, y in stream.micro_batches(step, proc.device):
        loss = model(x, targets=y) / stream.accum_steps
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
    return float(loss_sum), float(parallel.full_tensor(grad_norm))


def load_inputs(cfg: TrainConfig, proc: parallel.Process):
    """Our tokenizer (checked against the shards), the training batches, and the val tokens with bytes per id."""
    tok = tk.load_tokenizer(need_dir(cfg.tokenizer, "--tokenizer", "our tokenizer directory, from tokenize.py train"))
    index = load_index(need_dir(cfg.data, "--data", "token shards, from tokenize.py encode"))
    check_tokenizer(index, tk.tokenizer_hash(cfg.tokenizer), tok.get_vocab_size(with_added_tokens=True))
    check_writable(cfg.checkpoint_dir, "--checkpoint-dir")
    train = TokenStream(cfg.data, "train")
    stream = BatchStream(train, cfg.seq_len, cfg.global_batch, cfg.micro_batch, proc.rank, proc.world_size, cfg.seed)
    return tok, stream, (eval_tokens(cfg, tok), tk.token_byte_lengths(tok))


def run_identity(cfg: TrainConfig, model) -> tuple[dict, dict]:
    """What a checkpoint must agree on to be continued (else --resume never), and what may change with a warning."""
    data = file_sha256(os.path.join(cfg.data, "index.json"))
    must = dict(model=model.config.to_dict(), phase=cfg.phase, data=data, tokenizer=tk.tokenizer_hash(cfg.tokenizer))
    must["base_model"] = checkpoint.model_fingerprint(cfg.base_model)
    return must, {"seed": cfg.seed, "global_batch": cfg.global_batch, "seq_len": cfg.seq_len}


def train(cfg: TrainConfig, proc: parallel.Process, log: MetricLogger) -> None:
    tok, stream, val = load_inputs(cfg, proc)
    model = build(cfg, proc, embedding_rows(cfg, tok.get_vocab_size(with_added_tokens=True)), log, tok)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(model, cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay, proc.device.type == "cuda")
    parallel.fp8_scale_hook(model, optimizer, on=cfg.fp8_all_gather == "true")
    must, may = run_identity(cfg, model)
    ckpt_dir = os.path.join(cfg.checkpoint_dir, f"phase{cfg.phase}")
    ckpt = checkpoint.Checkpointer(ckpt_dir, proc.rank, proc.local_rank, cfg.keep_checkpoints, cfg.async_checkpoint)
    start = 0
    if cfg.resume == "auto":  # the newest complete checkpoint made from these same inputs
        start, _ = checkpoint.resume(ckpt_dir, model, optimizer, proc.rank, must, may, log.info)
    if start:
        log.log("resume", **{"from": os.path.join(ckpt_dir, f"step-{start:08d}")}, step=start)
    else:
        log.log("eval", step=0, **evaluate(model, *val, cfg, proc, log, 0))
    stop, meter = sigterm_flag(), Progress(cfg.steps, start, every=cfg.log_every)
    last_save, pending, stopping = time.monotonic(), None, 0.0  # pending: a checkpoint still being written
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        loss, grad_norm = train_step(model, optimizer, stream, step, params, cfg, proc)
        # One all-reduce carries the loss and three flags, so every rank decides alike after this step: a SIGTERM
        # that reached only some ranks, rank 0's checkpoint clock, and how many ranks are still writing one.
        clock = proc.is_main and 0 < cfg.checkpoint_minutes * 60 <= time.monotonic() - last_save
        flags = [loss, float(stop[0] is not None), float(clock), float(not ckpt.pending_done())]
        loss, stopping, clock, writing = parallel.all_reduce_sum(flags, proc.device)
        loss, done = loss / proc.world_size, step + 1
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # all ranks see the same reduced values
            ckpt.close()  # a checkpoint still being written is finished first: it is the last good one
            last = checkpoint.latest_checkpoint(ckpt_dir) or "none"
            msg = f"loss {loss} / grad norm {grad_norm} at step {done}: stopped before the update"
            raise FloatingPointError(f"{msg}; last good checkpoint: {last}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if pending and not writing:  # every rank has written it: rename it into place, point `latest` at it
            log.log("checkpoint", step=pending, dir=ckpt.finalize())
            pending = None
        meter.add(time.perf_counter() - t0, loss=loss)
        if meter.due(done):
            w, lr = meter.flush(done), optimizer.param_groups[0]["lr"]
            tps = cfg.global_batch * cfg.seq_len * w["steps_per_s"]
            speed = throughput(tps, proc.world_size, model.config.flops_per_token(cfg.seq_len), proc.device)
            log.log("train", step=done, loss=w["loss"], lr=lr, grad_norm=round(grad_norm, 4), **speed, eta=w["eta"])
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            log.log("eval", step=done, **evaluate(model, *val, cfg, proc, log, done))
        if stopping or clock or done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
            ckpt.save(done, model, optimizer, {**must, **may})
            last_save, pending = time.monotonic(), done
        if stopping:
            log.info(f"stopped by signal {stop[0] or int(signal.SIGTERM)} at step {done}; resume with --resume auto")
            break
    if pending:
        log.log("checkpoint", step=pending, dir=ckpt.finalize())
    ckpt.close()
    if not stopping:
        export(model, cfg, tok, proc, log)


def sigterm_flag() -> list:
    """SIGTERM (a spot interruption under plain torchrun) sets flag[0]: checkpoint after this step and exit."""
    flag = [None]
    signal.signal(signal.SIGTERM, lambda signum, frame: flag.__setitem__(0, signum))
    return flag


def export(model, cfg: TrainConfig, tok, proc: parallel.Process, log: MetricLogger) -> None:
    """The Hugging Face model dir: config.json, safetensors, and our tokenizer's files beside them."""
    ids, dtype = {"bos_id": tok.token_to_id(tk.BOS), "eos_id": tk.eos_id(tok)}, getattr(torch, cfg.export_dtype)
    save_pretrained(model, cfg.out, dtype, token_ids=ids, is_writer=proc.is_main)
    if proc.is_main:
        tk.copy_tokenizer_files(cfg.tokenizer, cfg.out)
    log.log("export", dir=cfg.out, dtype=cfg.export_dtype)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    proc = parallel.setup(cfg.device)
    log = MetricLogger(os.path.join(cfg.out, "metrics.jsonl"), enabled=proc.is_main)
    log.log("config", **dataclasses.asdict(cfg))
    try:
        eval_only(cfg, proc, log) if cfg.eval_only else train(cfg, proc, log)
        parallel.finish()
    finally:
        log.close()
        parallel.teardown()


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FloatingPointError, OSError) as e:  # UsageError, CheckpointError, a full disk...
        print_error("train.py", e)
        sys.exit(2)
