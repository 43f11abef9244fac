"""Stage 2: continued pretraining of our Llama on token shards, under torchrun with FSDP2.

    torchrun --nproc_per_node 8 train.py --phase 1 --base-model BASE --base-tokenizer BASE \
        --tokenizer TOK --data SHARDS --out PHASE1        # embeddings only, new vocabulary adapts
    torchrun --nproc_per_node 8 train.py --phase 2 --base-model PHASE1 --tokenizer TOK \
        --data SHARDS --out PHASE2                        # everything trains

Reads top to bottom: flags and their defaults, the model (vocabulary transfer in phase 1), the
optimizer and schedule, resume, the loop (step, log, eval, checkpoint), the export.
`python train.py --eval-only --base-model M --tokenizer T --eval-text FILE` measures bits per byte.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import sys
import time
import unicodedata

import numpy as np
import torch

from minilm_az import bpb, parallel
from minilm_az.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_train_checkpoint,
    load_weights_into,
    read_config,
    read_tensor,
    save_pretrained,
    save_train_checkpoint,
)
from minilm_az.config import PHASE_DEFAULTS, TrainConfig, add_dataclass_args, env_default, from_args, in_sagemaker
from minilm_az.data import BatchStream
from minilm_az.kernels import select_ops
from minilm_az.logs import MetricLogger, eta
from minilm_az.model import get_preset, materialize, meta_model
from minilm_az.shards import TokenStream, check_tokenizer, load_index
from minilm_az.tokenizer import (
    EOS,
    copy_tokenizer_files,
    corpus_files,
    encode_plain,
    iter_documents,
    load_tokenizer,
    tokenizer_hash,
)
from minilm_az.transfer import transfer_embedding

PEAK_FLOPS = 989e12  # dense bf16 of an H100/H200 SXM, the MFU denominator


class UsageError(Exception):
    """A problem with the flags or inputs, reported as one line without a traceback."""


def parse_args(argv=None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_dataclass_args(p, TrainConfig)
    cfg = from_args(TrainConfig, p.parse_args(argv))
    # SageMaker's channels and model dir are the defaults for paths; the phase gives lr and steps.
    cfg.base_model = cfg.base_model or env_default("SM_CHANNEL_BASE_MODEL")
    cfg.base_tokenizer = cfg.base_tokenizer or env_default("SM_CHANNEL_BASE_TOKENIZER")
    cfg.tokenizer = cfg.tokenizer or env_default("SM_CHANNEL_TOKENIZER")
    cfg.data = cfg.data or env_default("SM_CHANNEL_DATA")
    cfg.out = cfg.out or env_default("SM_MODEL_DIR") or os.path.join("runs", f"phase{cfg.phase}")
    if not cfg.checkpoint_dir:
        cfg.checkpoint_dir = "/opt/ml/checkpoints" if in_sagemaker() else os.path.join(cfg.out, "checkpoints")
    cfg.steps = cfg.steps if cfg.steps is not None else PHASE_DEFAULTS[cfg.phase]["steps"]
    cfg.lr = cfg.lr if cfg.lr is not None else PHASE_DEFAULTS[cfg.phase]["lr"]
    cfg.warmup = cfg.warmup if cfg.warmup is not None else max(1, cfg.steps // 20)
    return cfg


def need_dir(path: str | None, flag: str, what: str) -> str:
    if not path:
        raise UsageError(f"{flag} is required ({what})")
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: no such directory ({what})")
    return path


def eos_id_of(tok) -> int:
    for t in (EOS, "<|endoftext|>", "</s>"):
        if tok.token_to_id(t) is not None:
            return tok.token_to_id(t)
    raise UsageError("the tokenizer has no end-of-text token (<|end_of_text|>, <|endoftext|> or </s>)")


# ---------------------------------------------------------------- model

def build(cfg: TrainConfig, d: parallel.Dist, vocab_size: int, log: MetricLogger, tok=None):
    """Meta model -> freeze for the phase -> AC/compile/FSDP2 -> materialise -> load (or init) weights."""
    overrides = {}
    if cfg.base_model:
        need_dir(cfg.base_model, "--base-model", "a Hugging Face model directory")
        mcfg = read_config(cfg.base_model)
        if cfg.base_tokenizer:
            base_tok = load_tokenizer(cfg.base_tokenizer)
            rows, stats = transfer_embedding(read_tensor(cfg.base_model, "model.embed_tokens.weight"), base_tok,
                                             tok, vocab_size)
            log.info(f"vocab_transfer embed_tokens {stats} base_vocab={mcfg.vocab_size} new_vocab={vocab_size}")
            overrides["model.embed_tokens.weight"] = rows
            if not mcfg.tie_embeddings:
                head, hstats = transfer_embedding(read_tensor(cfg.base_model, "lm_head.weight"), base_tok, tok,
                                                  vocab_size)
                log.info(f"vocab_transfer lm_head {hstats}")
                overrides["lm_head.weight"] = head
            mcfg = mcfg.with_vocab(vocab_size)
    else:
        mcfg = get_preset(cfg.preset, vocab_size)
    if cfg.seq_len > mcfg.max_seq_len:
        raise UsageError(f"--seq-len {cfg.seq_len} exceeds the model's context of {mcfg.max_seq_len} tokens")

    model = meta_model(mcfg, select_ops(d.device, cfg.liger, cfg.compile))
    if cfg.phase == 1:  # the backbone is frozen: only embeddings (and an untied head) get grads and state
        for name, p in model.named_parameters():
            p.requires_grad_(name in ("model.embed_tokens.weight", "lm_head.weight"))
    parallel.parallelize(model, mixed_precision=d.device.type == "cuda", ac=cfg.ac, compile=cfg.compile)
    materialize(model, d.device, seed=cfg.seed, init=not cfg.base_model)
    if cfg.base_model:
        load_weights_into(model, cfg.base_model, overrides)
    return model


def make_optimizer(model, cfg: TrainConfig, cuda: bool) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith("norm.weight") else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=cuda, foreach=not cuda)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine down to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


# ---------------------------------------------------------------- evaluation

def eval_tokens(cfg: TrainConfig, tok) -> tuple[np.ndarray, int]:
    """The stream to score and its UTF-8 bytes: --eval-text documents, else the val split of --data."""
    eos = eos_id_of(tok)
    if cfg.eval_text:
        docs = list(iter_documents(corpus_files(cfg.eval_text)))
        # Bytes of the NFC text, as the shards count them (our tokenizer normalises to NFC anyway).
        n_bytes = sum(len(unicodedata.normalize("NFC", t).encode("utf-8")) for t in docs)
        return bpb.doc_stream(encode_plain(tok, docs), eos), n_bytes
    val = TokenStream(cfg.data, "val")
    if val.num_tokens == 0:
        raise UsageError(f"{cfg.data}: the val split is empty; pass --eval-text or re-encode with a val split")
    return np.concatenate([[eos], val.get(0, val.num_tokens)]), val.num_bytes


def evaluate(model, tokens: np.ndarray, n_bytes: int, cfg: TrainConfig, d: parallel.Dist) -> dict:
    nll, count = bpb.total_nll(model, tokens, cfg.seq_len, cfg.micro_batch, d.device, d.rank, d.world_size,
                               cfg.eval_batches)
    nll, count = parallel.all_reduce_sum([nll, count], d.device)
    # A capped evaluation scores a prefix: its bytes are taken in proportion to the tokens scored.
    scored_bytes = n_bytes * count / (len(tokens) - 1)
    return {"val_loss": nll / max(count, 1), "val_bpb": bpb.bits_per_byte(nll, scored_bytes),
            "val_tokens": int(count)}


def eval_only(cfg: TrainConfig, d: parallel.Dist, log: MetricLogger) -> None:
    need_dir(cfg.base_model, "--base-model", "the model to evaluate")
    if not cfg.tokenizer:
        raise UsageError("--eval-only needs --tokenizer (the model's own tokenizer)")
    tok = load_tokenizer(cfg.tokenizer)
    tokens, n_bytes = eval_tokens(cfg, tok)
    vocab = read_config(cfg.base_model).vocab_size
    if tok.get_vocab_size(with_added_tokens=True) > vocab:
        raise UsageError(f"the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids but {cfg.base_model} "
                         f"only {vocab} embedding rows: is --tokenizer the model's own?")
    cfg.phase, cfg.base_tokenizer = 2, None  # evaluate the model as it is: no vocabulary transfer
    model = build(cfg, d, vocab, log)
    log.log("eval", step=0, **evaluate(model, tokens, n_bytes, cfg, d), bytes=n_bytes)


# ---------------------------------------------------------------- training

def main(argv=None) -> None:
    cfg = parse_args(argv)
    d = parallel.setup(cfg.device)
    log = MetricLogger(os.path.join(cfg.out, "metrics.jsonl"), enabled=d.is_main)
    try:
        if cfg.eval_only:
            return eval_only(cfg, d, log)
        train(cfg, d, log)
    finally:
        log.close()
        parallel.teardown()


def train(cfg: TrainConfig, d: parallel.Dist, log: MetricLogger) -> None:
    cuda = d.device.type == "cuda"
    tok_dir = need_dir(cfg.tokenizer, "--tokenizer", "our tokenizer directory, from tokenize.py train")
    data_dir = need_dir(cfg.data, "--data", "token shards, from tokenize.py encode")
    tok = load_tokenizer(tok_dir)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    check_tokenizer(load_index(data_dir), tokenizer_hash(tok_dir), n_tok)
    if cfg.base_model and not cfg.base_tokenizer:  # the model already speaks this tokenizer (phase 2)
        vocab = read_config(need_dir(cfg.base_model, "--base-model", "a Hugging Face model directory")).vocab_size
        if vocab < n_tok:
            raise UsageError(f"the tokenizer has {n_tok} ids but {cfg.base_model} only {vocab} embedding rows: "
                             f"pass --base-tokenizer to transfer the vocabulary (phase 1)")
    else:
        vocab = math.ceil(n_tok / 64) * 64  # new embedding rows: pad to a GPU-friendly multiple
    train_stream = BatchStream(TokenStream(data_dir, "train"), cfg.seq_len, cfg.global_batch, cfg.micro_batch,
                               d.rank, d.world_size, cfg.seed)
    val_tokens, val_bytes = eval_tokens(cfg, tok)

    model = build(cfg, d, vocab, log, tok)
    mcfg = model.config
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizer = make_optimizer(model, cfg, cuda)
    log.info(f"config phase={cfg.phase} params={mcfg.num_params()} trainable={n_train} world={d.world_size} "
             f"accum={train_stream.accum_steps} tokens_per_step={cfg.global_batch * cfg.seq_len} "
             f"ops={model.ops.name} device={d.device.type}")

    ckpt_dir = os.path.join(cfg.checkpoint_dir, f"phase{cfg.phase}")
    start = 0
    resume_from = latest_checkpoint(ckpt_dir) if cfg.resume == "auto" else None
    if resume_from:
        # Checked before loading: DCP would fail on the first mismatched tensor with a traceback.
        with open(os.path.join(resume_from, "train_state.json")) as fh:
            saved = json.load(fh)
        saved_model = saved.get("model")
        changed = [k for k in ("seed", "global_batch", "seq_len") if k in saved and saved[k] != getattr(cfg, k)]
        if changed:  # allowed (a deliberate change), but the data order then differs from the saved run's
            diff = ", ".join(f"{k}={saved[k]}->{getattr(cfg, k)}" for k in changed)
            log.info(f"warning: resuming with changed {diff}: the batches differ from those the saved run would see")
        if saved_model != mcfg.to_dict():
            raise UsageError(f"{resume_from}: checkpoint is of another model shape; use --resume never "
                             f"or another --checkpoint-dir")
        state = load_train_checkpoint(resume_from, model, optimizer, d.rank)
        start = state["step"]
        log.info(f"resume from={resume_from} step={start}")

    stop = {"signal": None}  # SIGTERM (a spot interruption) checkpoints after the current step and exits

    def on_term(signum, frame):
        stop["signal"] = signum
    signal.signal(signal.SIGTERM, on_term)

    def checkpoint(step: int):
        save_train_checkpoint(ckpt_dir, step, model, optimizer,
                              {"model": mcfg.to_dict(), "phase": cfg.phase, "seed": cfg.seed,
                               "global_batch": cfg.global_batch, "seq_len": cfg.seq_len},
                              d.rank, d.local_rank, cfg.keep_checkpoints)
        log.info(f"checkpoint step={step} dir={ckpt_dir}")

    params = [p for p in model.parameters() if p.requires_grad]
    flops_tok = mcfg.flops_per_token(cfg.seq_len)
    tokens_per_step = cfg.global_batch * cfg.seq_len
    # tokens/s and ETA count training steps only (not evals or checkpoints)
    t_train, t_window, loss_acc, n_acc = 0.0, 0.0, 0.0, 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model.train()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        step_loss = torch.zeros((), device=d.device)
        for x, y in train_stream.micro_batches(step, d.device):
            loss = model(x, targets=y) / train_stream.accum_steps
            loss.backward()
            step_loss += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        # The stop flag rides on the loss all-reduce, so a signal that reached only some ranks stops them all
        # after this same step (a rank alone in the checkpoint's collectives would hang the job).
        step_loss, stopping = parallel.all_reduce_sum([float(step_loss), float(stop["signal"] is not None)], d.device)
        step_loss /= d.world_size
        if not math.isfinite(step_loss) or not math.isfinite(float(grad_norm)):
            last = latest_checkpoint(ckpt_dir)
            raise FloatingPointError(f"loss {step_loss} / grad norm {float(grad_norm)} at step {step + 1}: stopped "
                                     f"before the update; last good checkpoint: {last or 'none'}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0  # the loss all-reduce above synchronises the GPU
        t_train, t_window = t_train + dt, t_window + dt
        loss_acc, n_acc = loss_acc + step_loss, n_acc + 1
        done = step + 1

        if done % cfg.log_every == 0 or done == cfg.steps:
            tps = tokens_per_step * n_acc / t_window
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else \
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            log.log("train", step=done, loss=loss_acc / n_acc, lr=lr, grad_norm=round(float(grad_norm), 4),
                    tokens_per_s=round(tps), tokens_per_s_per_gpu=round(tps / d.world_size, 1),
                    mfu=round(100 * flops_tok * tps / d.world_size / PEAK_FLOPS, 2) if cuda else None,
                    peak_mem_gib=round(peak, 2), eta=eta(done - start, cfg.steps - start, t_train))
            t_window, loss_acc, n_acc = 0.0, 0.0, 0
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
            log.log("eval", step=done, **evaluate(model, val_tokens, val_bytes, cfg, d))
        saved = (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps
        if saved:
            checkpoint(done)
        if stopping:
            if not saved:
                checkpoint(done)
            log.info(f"stopped by signal {stop['signal'] or int(signal.SIGTERM)} at step {done}; "
                     f"resume with --resume auto")
            return

    eos = eos_id_of(tok)
    save_pretrained(model, cfg.out, dtype=getattr(torch, cfg.export_dtype), is_writer=d.is_main,
                    token_ids={"bos_id": tok.token_to_id("<|begin_of_text|>"), "eos_id": eos})
    if d.is_main:
        copy_tokenizer_files(tok_dir, cfg.out)
    log.info(f"export dir={cfg.out} dtype={cfg.export_dtype}")


if __name__ == "__main__":
    try:
        main()
    except (UsageError, CheckpointError, FileNotFoundError, ValueError, FloatingPointError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
