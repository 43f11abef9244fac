"""Stage 2: continued pretraining of our Llama on token shards, under torchrun with FSDP2.

    torchrun --nproc_per_node 8 train.py --phase 1 --base-model BASE --base-tokenizer BASE \\
        --tokenizer TOK --data SHARDS --out PHASE1        # embeddings only, the new vocabulary adapts
    torchrun --nproc_per_node 8 train.py --phase 2 --base-model PHASE1 --tokenizer TOK \\
        --data SHARDS --out PHASE2                        # everything trains
    python train.py --eval-only --base-model M --tokenizer M --eval-text FILE    # bits per byte

Reads top to bottom: the flags become a run plan, then the model, evaluation, one step, and `train`, the loop.
"""

from __future__ import annotations

import minilm_az  # noqa: F401  # isort: skip (first: it checks the working directory, which torch needs)
import dataclasses
import math
import os
import sys
import time
import unicodedata

import numpy as np
import torch

from minilm_az import bpb, checkpoint, parallel, shards
from minilm_az import tokenizer as tk
from minilm_az.config import PHASE_1, PHASE_2, TrainConfig, TrainPlan
from minilm_az.data import BatchStream
from minilm_az.hf import load_weights_into, model_fingerprint, read_config, read_tensor, save_pretrained
from minilm_az.kernels import select_ops
from minilm_az.launch.flags import make_parser, parse_config, tensorboard_dir
from minilm_az.logs import MetricLogger, Progress, print_error, throughput, ticker
from minilm_az.model import get_preset, materialize, meta_model
from minilm_az.optim import adamw, cosine_lr, set_lr
from minilm_az.outputs import check_not_input, describe
from minilm_az.prep import readers
from minilm_az.shards import TokenStream, check_tokenizer, load_index
from minilm_az.transfer import transfer_embedding


class UsageError(ValueError):
    """A problem with the flags or inputs, reported as one line without a traceback."""


# ---------------------------------------------------------------- flags and the run plan


def resolve(flags: TrainConfig, world: int) -> TrainPlan:
    """The run plan: defaults that depend on the phase, the model and the processes; flag errors before any work."""
    if flags.phase == 1 and not flags.eval_only and not (flags.base_model and flags.base_tokenizer):
        raise UsageError("--phase 1 trains a base model's embeddings: it needs --base-model and --base-tokenizer")
    recipe = PHASE_1 if flags.phase == 1 else PHASE_2
    out = flags.out or os.path.join("runs", f"phase{flags.phase}")
    base = need_dir(flags.base_model, "--base-model", "a Hugging Face model directory") if flags.base_model else None
    context = read_config(base).max_seq_len if base else get_preset(flags.preset).max_seq_len
    seq_len = flags.seq_len or min(2048, context)
    if seq_len > context:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's context of {context} tokens")
    micro_batch, _ = parallel.split_batch(flags.global_batch, world, flags.micro_batch, largest=14)
    parallel.check_replicate(flags.replicate, world)
    fp8_all_gather = parallel.check_fp8(
        flags.fp8, flags.fp8_all_gather, flags.compile, flags.device, world, flags.fp8_fast_accum
    )
    if not flags.eval_only:  # compared as files: a symlink or a second name of an input is that input
        inputs = ("base_model", "base_tokenizer", "tokenizer", "data")
        check_not_input(out, {f"--{name.replace('_', '-')}": getattr(flags, name) for name in inputs})
    steps = flags.steps or recipe.steps
    return TrainPlan(
        flags=flags,
        out=out,
        checkpoint_dir=flags.checkpoint_dir or os.path.join(out, "checkpoints"),
        steps=steps,
        lr=recipe.lr if flags.lr is None else flags.lr,
        warmup=max(1, steps // 20) if flags.warmup is None else flags.warmup,
        seq_len=seq_len,
        micro_batch=micro_batch,
        fp8_all_gather=fp8_all_gather,
        embeddings_only=recipe.embeddings_only and not flags.eval_only,  # evaluation takes the model as it is
        transfer_vocab=bool(flags.base_model and flags.base_tokenizer) and not flags.eval_only,
    )


def need_dir(path: str | None, flag: str, what: str) -> str:
    if not path or not os.path.isdir(path):
        it = f"{describe(path)}, where a directory belongs" if path and os.path.lexists(path) else "no such directory"
        raise UsageError(f"{flag} {path}: {it} ({what})" if path else f"{flag} is required ({what})")
    return path


def embedding_rows(plan: TrainPlan, n_tok: int) -> int:
    """Rows of the model's embedding: the base's (phase 2 from a model), else our vocabulary padded to 64."""
    flags, base = plan.flags, plan.flags.base_model
    if base and not plan.transfer_vocab:  # the model already speaks this tokenizer
        tk.check_model_tokenizer(base, flags.tokenizer, "--tokenizer")
        vocab = read_config(base).vocab_size
        if vocab < n_tok:
            hint = "is it its own?" if flags.eval_only else "pass --base-tokenizer to transfer the vocabulary (phase 1)"
            raise UsageError(f"the tokenizer has {n_tok} ids but {base} only {vocab} embedding rows: {hint}")
        return vocab
    if base:
        tk.check_model_tokenizer(base, flags.base_tokenizer, "--base-tokenizer")
    return math.ceil(n_tok / 64) * 64  # new embedding rows: a GPU-friendly multiple


# ---------------------------------------------------------------- model


def build(plan: TrainPlan, proc: parallel.Process, vocab_size: int, log: MetricLogger, tok=None):
    """Meta model -> freeze for the phase -> AC/compile/FSDP2 -> materialise -> load (or init) weights."""
    flags = plan.flags
    overrides = {}
    if flags.base_model:
        mcfg = read_config(flags.base_model)
        if plan.transfer_vocab:  # our vocabulary's rows from the base's rows (transfer.py)
            base_tok = tk.load_tokenizer(flags.base_tokenizer)
            heads = ["model.embed_tokens.weight"] + ([] if mcfg.tie_embeddings else ["lm_head.weight"])
            for name in heads:
                rows, stats = transfer_embedding(read_tensor(flags.base_model, name), base_tok, tok, vocab_size)
                log.log("vocab_transfer", tensor=name, **dataclasses.asdict(stats), new_vocab=vocab_size)
                overrides[name] = rows
            mcfg = mcfg.with_vocab(vocab_size)
    else:
        mcfg = get_preset(flags.preset, vocab_size)
    model = meta_model(mcfg, select_ops(proc.device, flags.liger, flags.compile))
    if plan.embeddings_only:  # the backbone is frozen: only embeddings (and an untied head) get grads and state
        for name, p in model.named_parameters():
            p.requires_grad_(name in ("model.embed_tokens.weight", "lm_head.weight"))
    fp8 = dict(fp8=flags.fp8, fp8_all_gather=plan.fp8_all_gather, fp8_fast_accum=flags.fp8_fast_accum)
    cuda, replicate = proc.device.type == "cuda", flags.replicate
    parallel.parallelize(model, mixed_precision=cuda, ac=flags.ac, compile=flags.compile, replicate=replicate, **fp8)
    materialize(model, proc.device, seed=flags.seed, init=not flags.base_model)
    if flags.base_model:
        load_weights_into(model, flags.base_model, overrides)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accum = flags.global_batch // (plan.micro_batch * proc.world_size)
    log.log("model", params=mcfg.num_params(), trainable=trainable, world=proc.world_size, micro_batch=plan.micro_batch)
    log.log("batch", accum=accum, tokens_per_step=flags.global_batch * plan.seq_len, ops=model.ops.name, fp8=flags.fp8)
    return model


# ---------------------------------------------------------------- evaluation


def eval_tokens(plan: TrainPlan, tok) -> np.ndarray:
    """The stream to score: --eval-text documents (NFC once, then encoded), else the val split of --data."""
    eos = tk.eos_id(tok)
    flags = plan.flags
    if flags.eval_text:
        docs = [unicodedata.normalize("NFC", t) for t in readers.iter_documents(readers.corpus_files(flags.eval_text))]
        return bpb.doc_stream(tk.encode_plain(tok, docs), eos)
    val = TokenStream(flags.data, "val")
    if val.num_tokens == 0:
        raise UsageError(f"{flags.data}: the val split is empty; pass --eval-text or re-encode with a val split")
    return np.concatenate([[eos], val.get(0, val.num_tokens)])


def evaluate(model, tokens: np.ndarray, token_bytes: np.ndarray, plan: TrainPlan, proc, log, step: int) -> dict:
    """Val loss and bits per byte: bytes are those of exactly the targets scored (see bpb.py)."""
    cap = plan.flags.eval_batches * plan.micro_batch if plan.flags.eval_batches else None
    tick = ticker(log, "eval_progress", step=step)
    shares = bpb.total_nll(
        model, tokens, plan.seq_len, plan.micro_batch, proc.device, proc.rank, proc.world_size, cap, token_bytes, tick
    )
    nll, count, n_bytes = parallel.all_reduce_sum(list(shares), proc.device)
    bits = bpb.bits_per_byte(nll, n_bytes)
    return dict(
        val_loss=nll / max(count, 1), val_bpb=bits, val_tokens=int(count), val_bytes=int(n_bytes), window=plan.seq_len
    )


def eval_only(plan: TrainPlan, proc: parallel.Process, log: MetricLogger) -> None:
    """Bits per byte of --base-model as it is (the plan transfers no vocabulary and freezes nothing)."""
    need_dir(plan.flags.base_model, "--base-model", "the model to evaluate")
    tok = tk.load_tokenizer(need_dir(plan.flags.tokenizer, "--tokenizer", "the model's own tokenizer"))
    must = {"model": model_fingerprint(plan.flags.base_model), "text": plan.flags.eval_text}
    checkpoint.claim_run(plan.flags.out, plan.out, "train.py --eval-only", plan.flags, must, proc, log)
    log.open(output=("eval",))  # nothing refuses an evaluation after its claim; its line is its output
    model = build(plan, proc, embedding_rows(plan, tok.get_vocab_size(with_added_tokens=True)), log)
    log.log("eval", step=0, **evaluate(model, eval_tokens(plan, tok), tk.token_byte_lengths(tok), plan, proc, log, 0))


# ---------------------------------------------------------------- training


def train_step(model, optimizer, stream: BatchStream, step: int, params: list, plan: TrainPlan, proc):
    """Forward and backward over this rank's micro-batches of `step`; returns (mean loss here, grad norm)."""
    set_lr(optimizer, cosine_lr(step, plan.lr, plan.warmup, plan.steps, plan.flags.min_lr_ratio))
    loss_sum = torch.zeros((), device=proc.device)
    for i, (x, y) in enumerate(stream.micro_batches(step, proc.device)):
        parallel.sync_gradients(model, i == stream.accum_steps - 1)  # one reduce-scatter a step, after the last
        loss = model(x, targets=y) / stream.accum_steps
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, plan.flags.grad_clip or float("inf"))
    return float(loss_sum), float(parallel.full_tensor(grad_norm))


def load_inputs(plan: TrainPlan, proc: parallel.Process):
    """Our tokenizer (checked against the shards), the training batches, and the val tokens with bytes per id."""
    flags = plan.flags
    tok = tk.load_tokenizer(need_dir(flags.tokenizer, "--tokenizer", "our tokenizer directory, from tokenize.py train"))
    index = load_index(need_dir(flags.data, "--data", "token shards, from tokenize.py encode"))
    check_tokenizer(index, tk.tokenizer_hash(flags.tokenizer), tok.get_vocab_size(with_added_tokens=True))
    sizes = (plan.seq_len, flags.global_batch, plan.micro_batch, proc.rank, proc.world_size, flags.seed)
    stream = BatchStream(TokenStream(flags.data, "train"), *sizes)
    return tok, stream, (eval_tokens(plan, tok), tk.token_byte_lengths(tok))


def run_identity(plan: TrainPlan) -> tuple[dict, dict]:
    """What makes a run this run (its --out and checkpoints are continued only with the same; they fix the model's
    shape too), and what may change with a warning."""
    flags = plan.flags
    data, tokenizer = shards.content_id(flags.data), tk.tokenizer_hash(flags.tokenizer)  # by content, every byte
    must = dict(phase=flags.phase, data=data, tokenizer=tokenizer, preset=None if flags.base_model else flags.preset)
    must["base_model"] = model_fingerprint(flags.base_model)
    return must, dict(seed=flags.seed, global_batch=flags.global_batch, seq_len=plan.seq_len, lr=plan.lr)


def train(plan: TrainPlan, proc: parallel.Process, log: MetricLogger) -> None:
    """Inputs, model, resume; then each step trains, logs, evaluates and checkpoints; then the export."""
    flags = plan.flags
    tok, stream, val = parallel.agree(lambda: load_inputs(plan, proc), proc)
    must, may = run_identity(plan)  # then --out is this run's, and a second run into it is refused
    fresh = checkpoint.claim_run(plan.out, plan.checkpoint_dir, "train.py", flags, must, proc, log)
    record = dataclasses.asdict(plan)
    log.log("config", **{**record.pop("flags"), **record})  # the flags, with the values this run resolved
    model = build(plan, proc, embedding_rows(plan, tok.get_vocab_size(with_added_tokens=True)), log, tok)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(model, plan.lr, (flags.beta1, flags.beta2), flags.weight_decay, proc.device.type == "cuda")
    parallel.fp8_scale_hook(model, optimizer, on=plan.fp8_all_gather)
    must["model"] = model.config.to_dict()
    ckpt_dir = checkpoint.phase_dir(plan.checkpoint_dir, flags.phase)
    ckpt = checkpoint.open_checkpoints(ckpt_dir, proc, flags.keep_checkpoints, flags.async_checkpoint)
    state = dict(model=model, optimizer=optimizer, train_state={**must, **may})  # what each checkpoint holds
    control = checkpoint.RunControl(ckpt, proc, state, flags.checkpoint_every, flags.checkpoint_minutes, log)
    start = ckpt.start(model, optimizer, must, may, log, plan.steps, fresh, flags.overwrite, plan.out)
    if start:
        log.log("resume", **{"from": ckpt.last()}, step=start)
    else:
        log.log("eval", step=0, **evaluate(model, *val, plan, proc, log, 0))
    meter = Progress(plan.steps, start, every=flags.log_every, device=proc.device.type, note=log.info)
    for step in range(start, plan.steps):
        started = time.perf_counter()
        loss, grad_norm = train_step(model, optimizer, stream, step, params, plan, proc)
        done = step + 1
        loss = control.agree(loss, grad_norm, done)  # all ranks agree on the loss, and on whether to save or stop
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        meter.add(time.perf_counter() - started, loss=loss)
        if meter.due(done):
            stats = meter.flush(done)  # the mean loss, the steps per second and the ETA since the last line
            tokens_per_s, flops = flags.global_batch * plan.seq_len * stats["steps_per_s"], model.config.flops_per_token
            speed = throughput(tokens_per_s, proc.world_size, flops(plan.seq_len), proc.device)
            lr = optimizer.param_groups[0]["lr"]
            log.log(
                "train", step=done, loss=stats["loss"], lr=lr, grad_norm=round(grad_norm, 4), **speed, eta=stats["eta"]
            )
        if (flags.eval_every and done % flags.eval_every == 0) or done == plan.steps:
            log.log("eval", step=done, **evaluate(model, *val, plan, proc, log, done))
        control.save(done, last_step=done == plan.steps)
        if control.stopping:  # after a stop signal the checkpoint is written, and the resumed run exports
            break
    control.close()
    if not control.stopping:
        export(model, plan, tok, proc, log)


def export(model, plan: TrainPlan, tok, proc: parallel.Process, log: MetricLogger) -> None:
    """The Hugging Face model dir: config.json, safetensors, and our tokenizer's files beside them."""
    ids, dtype = {"bos_id": tok.token_to_id(tk.BOS), "eos_id": tk.eos_id(tok)}, getattr(torch, plan.flags.export_dtype)
    parallel.agree(lambda: tk.check_unchanged(plan.flags.tokenizer, tok), proc)  # before any file: every host's own
    save_pretrained(model, plan.out, dtype, token_ids=ids, is_writer=proc.is_main)
    if proc.is_main:
        tk.copy_tokenizer_files(plan.flags.tokenizer, plan.out, same_as=tok)
    log.log("export", dir=plan.out, dtype=plan.flags.export_dtype)


def main(argv: list[str] | None = None) -> None:
    flags = parse_config(TrainConfig, make_parser(TrainConfig, "train.py", __doc__), argv)
    proc = parallel.setup(flags.device)
    try:
        # The paths are checked on every host, and a problem on one host stops them all with its reason.
        plan = parallel.agree(lambda: resolve(flags, proc.world_size), proc)
        jsonl = None if flags.eval_only and not flags.out else os.path.join(plan.out, "metrics.jsonl")
        log = MetricLogger(jsonl, enabled=proc.is_main, tensorboard=tensorboard_dir(flags.tensorboard, plan.out))
        try:
            eval_only(plan, proc, log) if plan.flags.eval_only else train(plan, proc, log)
            parallel.finish()
        finally:
            log.close()
    finally:
        parallel.teardown()


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FloatingPointError, OSError, KeyboardInterrupt) as e:  # UsageError, CheckpointError, Ctrl-C...
        print_error("train.py", str(e) or "interrupted")  # after Ctrl-C, RunControl's line says where it stopped
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 2)
