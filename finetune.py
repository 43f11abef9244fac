"""Stage 3: LoRA chat fine-tuning of a Hugging Face-format Llama, with the loss on the assistant's tokens only.

    python finetune.py --model runs/phase2 --data data/chat/az_chat.jsonl \\
        --val-data data/chat/az_chat_val.jsonl --out runs/sft --merge
    torchrun --nproc_per_node 8 finetune.py --model runs/phase2 --data data/chat --lora-r 64   # FSDP2
    python finetune.py --model runs/phase2 --adapter runs/sft --chat          # talk to the result

Reads top to bottom: flags, data (each conversation to ids + assistant-only labels), the model (meta -> LoRA -> FSDP2
-> materialise -> base weights -> adapter init), one step, the loop (accumulation, masked-token-mean loss, eval, log,
checkpoints), then the PEFT adapter and, with --merge, OUT/merged. `--chat` / `--prompt` try a model instead.
"""

from __future__ import annotations

import minilm_az  # noqa: F401  # isort: skip (first: it checks the working directory, which torch needs)
import dataclasses
import math
import os
import sys
import time

import torch

from minilm_az import checkpoint, hf, lora, parallel
from minilm_az import tokenizer as tk
from minilm_az.bpb import rank_batches
from minilm_az.chat import ChatFormatError, collate, micro_batches
from minilm_az.config import FinetuneConfig
from minilm_az.hf import load_pretrained, load_weights_into, read_config, save_pretrained, saved_dtype
from minilm_az.kernels import select_ops
from minilm_az.launch.flags import make_parser, parse_config, tensorboard_dir
from minilm_az.logs import MetricLogger, Progress, print_error
from minilm_az.model import IGNORE, materialize, meta_model
from minilm_az.optim import cosine_lr, set_lr
from minilm_az.outputs import atomic_write_json, check_not_input, describe, file_sha256, own_subdir, remove_output
from minilm_az.prep.chat_data import chat_files, encode_all, read_chat_files
from minilm_az.tokenizer import BOS, EOS, EOT, PAD, copy_tokenizer_files

MERGED_MARK = "merged_from_adapter.json"  # in OUT/merged: this model already holds an adapter


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    p = make_parser(FinetuneConfig, "finetune.py", __doc__)
    try:  # an empty value, a flag that does nothing in this mode: one line naming the flag (config.check_values)
        cfg = parse_config(FinetuneConfig, p, argv)
    except ValueError as e:
        p.error(str(e))
    if not cfg.model:
        p.error("--model is required (the HF-format base model directory)")
    cfg.tokenizer = cfg.tokenizer or cfg.model
    cfg.checkpoint_dir = cfg.checkpoint_dir or os.path.join(cfg.out, "checkpoints")
    if cfg.chat or cfg.prompt:
        if not os.path.isdir(cfg.model):
            p.error(f"--model {cfg.model}: {describe(cfg.model)}, where a model directory belongs")
        if cfg.adapter and os.path.isfile(os.path.join(cfg.model, MERGED_MARK)):
            p.error(f"--model {cfg.model} is a merged model (it holds an adapter already): drop --adapter")
        return cfg
    if not cfg.data:
        p.error("--data is required (a chat JSONL file or a directory of them)")
    try:  # compared as files: a symlink or a second name of an input is that input
        inputs = {"--model": cfg.model, "--tokenizer": cfg.tokenizer, "--data": cfg.data, "--val-data": cfg.val_data}
        check_not_input(cfg.out, inputs)
        world = parallel.env_number("WORLD_SIZE", 1, lo=1)
        cfg.micro_batch, _ = parallel.split_batch(cfg.global_batch, world, cfg.micro_batch, largest=4)
        parallel.check_replicate(cfg.replicate, world)
    except ValueError as e:
        p.error(str(e))
    return cfg


# ---------------------------------------------------------------- data


def load_data(cfg: FinetuneConfig, tok, max_len: int, log: MetricLogger) -> tuple[list, list]:
    """Train and val examples; without val files, a seeded --val-fraction of the training conversations."""
    train_files, val_files = chat_files(cfg.data, cfg.val_data)
    convs, skipped = read_chat_files(train_files, cfg.on_bad_line)
    val_convs, val_skipped = read_chat_files(val_files, cfg.on_bad_line)
    held_out = 0
    if not val_files and cfg.val_fraction > 0 and len(convs) >= 20:
        perm = torch.randperm(len(convs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        held_out = max(1, int(len(convs) * cfg.val_fraction))
        val_convs, convs = [convs[i] for i in perm[:held_out]], [convs[i] for i in perm[held_out:]]
    for msg in (skipped + val_skipped)[:5]:
        log.info(f"skipped bad line: {msg}")
    examples, dropped = encode_all(convs, tok, max_len, cfg.last_turn_only)
    val, val_dropped = encode_all(val_convs, tok, max_len, cfg.last_turn_only)
    if not examples:
        raise ChatFormatError(f"no trainable conversation left in {', '.join(train_files)}")
    # The files used, by name (a data dir's layout is a choice worth seeing), and what became of every line.
    log.log("data_files", train=",".join(train_files), val=",".join(val_files) or None, held_out=held_out or None)
    targets = sum(sum(x != IGNORE for x in lab) for _, lab in examples)
    bad, drop = len(skipped + val_skipped), dropped + val_dropped
    log.log("data", train=len(examples), val=len(val), skipped_bad_lines=bad, dropped_truncated=drop, max_len=max_len)
    log.log("data_tokens", train_tokens=sum(len(i) for i, _ in examples), target_tokens=targets)
    return examples, val


def batch_order(n: int, step: int, global_batch: int, seed: int) -> list[int]:
    """Example indices of one step's global batch: a fresh seeded permutation per epoch, read in order."""
    idx, start = [], step * global_batch
    while len(idx) < global_batch:
        epoch, offset = divmod(start + len(idx), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        idx += perm[offset : offset + global_batch - len(idx)]
    return idx


# ---------------------------------------------------------------- model, eval, step, the loop


def build(cfg: FinetuneConfig, proc: parallel.Process, log: MetricLogger):
    """LoRA on the meta model, shard, allocate, load the base, then initialise the adapters."""
    model = meta_model(read_config(cfg.model), select_ops(proc.device, cfg.liger, compile=cfg.compile))
    targets = [t.strip() for t in cfg.targets.split(",") if t.strip()]
    lora.apply_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=targets)
    if proc.device.type == "cuda":  # the frozen base is held in bf16, its compute dtype; adapters stay fp32
        lora.cast_frozen(model, torch.bfloat16)
    trainable, total = lora.count_parameters(model)
    pct = dict(trainable_pct=round(100 * trainable / total, 3), targets=cfg.targets, ops=model.ops.name)
    log.log("model", params=total, trainable=trainable, **pct)
    row_len = min(cfg.max_seq_len, model.config.max_seq_len)
    packed = dict(tokens_per_forward=cfg.max_tokens_per_forward or cfg.micro_batch * row_len) if cfg.packing else {}
    log.log("batch", world=proc.world_size, micro_batch=cfg.micro_batch, global_batch=cfg.global_batch, **packed)
    sharding = dict(shard=proc.world_size > 1, replicate=cfg.replicate)  # one process: no FSDP (see parallelize)
    parallel.parallelize(model, mixed_precision=proc.device.type == "cuda", ac=cfg.ac, compile=cfg.compile, **sharding)
    materialize(model, proc.device, init=False)
    load_weights_into(model, cfg.model)
    lora.reset_lora_parameters(model, seed=cfg.seed)
    return model.train()


@torch.no_grad()
def evaluate(model, val: list, cfg: FinetuneConfig, proc: parallel.Process, pad_id: int) -> float:
    """Masked (assistant-token) mean NLL over the val set, split over ranks, every rank running the same forwards."""
    model.eval()
    no_target = ([pad_id, pad_id], [IGNORE, IGNORE])  # fills a rank's last micro-batch when the val set runs out
    nll, n = 0.0, 0
    for chunk in rank_batches(val, cfg.micro_batch, proc.rank, proc.world_size, filler=no_target):
        x, y = collate(chunk, pad_id, proc.device)
        nll += float(model(x, targets=y, reduction="sum"))
        n += int((y != IGNORE).sum())
    model.train()
    total_nll, total_n = parallel.all_reduce_sum([nll, n], proc.device)
    return total_nll / max(total_n, 1)


def train_step(model, batch: list, params: list, cfg: FinetuneConfig, proc, pad_id: int, row_len: int | None = None):
    """Forward/backward of this rank's micro-batches (packed into rows of up to `row_len` tokens if given,
    at most --max-tokens-per-forward a forward); returns (the step's mean target NLL, grad norm, tokens)."""
    n_targets = sum(sum(x != IGNORE for x in lab[1:]) for _, lab in batch)
    nll, budget = 0.0, cfg.max_tokens_per_forward
    mine = micro_batches(batch, proc.rank, proc.world_size, cfg.micro_batch, pad_id, proc.device, row_len, budget)
    for i, (x, y, doc_ids) in enumerate(mine):
        parallel.sync_gradients(model, i == len(mine) - 1)  # every rank has as many; the last one reduces
        loss_sum = model(x, targets=y, reduction="sum", doc_ids=doc_ids)
        # FSDP averages gradients over ranks: scaling by world size makes the step the mean over every target
        # token of the global batch, however it is split.
        (loss_sum * (proc.world_size / n_targets)).backward()
        nll += float(loss_sum.detach())
    gn = float(parallel.full_tensor(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))))
    return parallel.all_reduce_sum([nll], proc.device)[0] / n_targets, gn, sum(len(ids) - 1 for ids, _ in batch)


def load_inputs(cfg: FinetuneConfig, log: MetricLogger) -> tuple:
    """The tokenizer (checked against the model), the longest conversation, and the encoded conversations."""
    if not os.path.isdir(cfg.model):
        raise ValueError(f"--model {cfg.model}: {describe(cfg.model)}, where a model directory belongs")
    tok, mcfg = tk.model_tokenizer(cfg.model, cfg.tokenizer, "--tokenizer"), read_config(cfg.model)
    if tok.get_vocab_size() > mcfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens but {cfg.model} only {mcfg.vocab_size} rows")
    max_len = min(cfg.max_seq_len, mcfg.max_seq_len)
    data = load_data(cfg, tok, max_len, log)
    log.log("config", **dataclasses.asdict(cfg))  # held until Checkpointer.start: a refused run writes no line
    return tok, max_len, *data


def run_identity(cfg: FinetuneConfig) -> tuple[dict, dict]:
    """What a checkpoint must agree on to be continued (else --resume never), and what may change with a warning."""
    train_files, val_files = chat_files(cfg.data, cfg.val_data)
    must = dict(model=hf.model_fingerprint(cfg.model), data=[file_sha256(f) for f in train_files + val_files])
    must["tokenizer"] = tk.tokenizer_hash(cfg.tokenizer)  # the adapter's ids are this tokenizer's, not the --model's
    must.update({k: getattr(cfg, k) for k in ("lora_r", "lora_alpha", "targets", "max_seq_len", "last_turn_only")})
    return must, {"seed": cfg.seed, "global_batch": cfg.global_batch}


def train(cfg: FinetuneConfig, proc: parallel.Process, log: MetricLogger) -> None:
    torch.manual_seed(cfg.seed * 1000 + proc.rank)  # dropout masks differ per rank
    tok, max_len, examples, val = parallel.agree(lambda: load_inputs(cfg, log), proc)  # one host's problem stops all
    must, may = run_identity(cfg)  # then --out is this run's, and a second run into it is refused
    fresh = checkpoint.claim_run(cfg.out, cfg.checkpoint_dir, "finetune.py", cfg, must, proc, log)
    pad_id = tok.token_to_id(PAD) or 0
    steps = cfg.steps or max(1, math.ceil(cfg.epochs * len(examples) / cfg.global_batch))
    model = build(cfg, proc, log)
    params = lora.lora_parameters(model)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=proc.device.type == "cuda" or None)
    ckpt = checkpoint.open_checkpoints(cfg.checkpoint_dir, proc, cfg.keep_checkpoints, cfg.async_checkpoint)
    state = dict(model=model, optimizer=opt, train_state={**must, **may})  # the adapter, its optimizer, the RNG
    control = checkpoint.RunControl(ckpt, proc, state, cfg.checkpoint_every, cfg.checkpoint_minutes, log)
    start = ckpt.start(model, opt, must, may, log, steps, fresh, cfg.overwrite, cfg.out)
    if start:
        log.log("resume", **{"from": ckpt.last()}, step=start)
    elif val:
        log.log("eval", step=0, val_loss=evaluate(model, val, cfg, proc, pad_id))
    meter, t0 = Progress(steps, start, every=cfg.log_every, device=proc.device.type, note=log.info), time.time()
    for step in range(start, steps):
        t_step = time.perf_counter()
        lr = cosine_lr(step, cfg.lr, cfg.warmup, steps, cfg.min_lr_ratio)
        set_lr(opt, lr)
        batch = [examples[i] for i in batch_order(len(examples), step, cfg.global_batch, cfg.seed)]
        loss, gn, n_tokens = train_step(model, batch, params, cfg, proc, pad_id, max_len if cfg.packing else None)
        done = step + 1
        loss = control.agree(loss, gn, done)  # raises before a non-finite update; agrees on saving and stopping
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.add(dt := time.perf_counter() - t_step, loss=loss)
        if meter.due(done):
            w, tps = meter.flush(done), round(n_tokens / dt)
            log.log("finetune", step=done, loss=w["loss"], lr=lr, grad_norm=gn, tokens_per_s=tps, eta=w["eta"])
        if val and (done % cfg.eval_every == 0 or done == steps):
            log.log("eval", step=done, val_loss=evaluate(model, val, cfg, proc, pad_id))
        control.save(done, last_step=done == steps)
        if control.stopping:  # after a stop signal the checkpoint is written, and the resumed run exports
            break
    control.close()
    if not control.stopping:
        save(model, cfg, tok, proc, log, time.time() - t0, must["model"])


def save(model, cfg: FinetuneConfig, tok, proc: parallel.Process, log: MetricLogger, seconds: float, base_id: str):
    """The adapter (every rank gathers, rank 0 writes; its base recorded by content), its tokenizer, then --merge's."""
    base = dict(base_model_name_or_path=os.path.abspath(cfg.model), identity=base_id)
    parallel.agree(lambda: tk.check_unchanged(cfg.tokenizer, tok), proc)  # before any file: every host's own copy
    if proc.is_main:  # the merged model of the adapter this one replaces must never stand beside it
        remove_output(os.path.join(cfg.out, "merged"), MERGED_MARK)
    lora.save_adapter(model, cfg.out, **base, is_writer=proc.is_main)
    if proc.is_main:
        copy_tokenizer_files(cfg.tokenizer, cfg.out, same_as=tok)
        atomic_write_json(os.path.join(cfg.out, "finetune_args.json"), dataclasses.asdict(cfg))
        log.log("export", dir=cfg.out, seconds=round(seconds, 1))
        if cfg.merge:
            merged = own_subdir(cfg.out, "merged", MERGED_MARK)  # never another model put there, or a link
            base = load_pretrained(cfg.model)
            lora.load_adapter(base, cfg.out)
            lora.merge_lora(base)
            eos = [tok.token_to_id(EOT), tok.token_to_id(EOS)]
            ids = {"bos_id": tok.token_to_id(BOS), "eos_id": eos, "pad_id": tok.token_to_id(PAD)}
            save_pretrained(base, merged, dtype=saved_dtype(cfg.model), token_ids=ids)  # the base's size
            copy_tokenizer_files(cfg.tokenizer, merged, same_as=tok)
            atomic_write_json(os.path.join(merged, MERGED_MARK), {"adapter": os.path.abspath(cfg.out)})
            log.log("export", dir=merged, merged=True)
    if proc.world_size > 1:
        torch.distributed.barrier()


def try_model(cfg: FinetuneConfig) -> None:
    """--prompt / --chat: the model, with the adapter --adapter names (and no other), answering on stdout."""
    from minilm_az.generate import generate, talk

    dev = parallel.resolve_device(cfg.device)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    tok = tk.model_tokenizer(cfg.model, cfg.tokenizer, "--tokenizer")
    model = load_pretrained(cfg.model, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if cfg.adapter:
        lora.load_adapter(model, cfg.adapter, dropout=0.0, base=cfg.model)  # refused on another base
        model.to(next(model.parameters()).dtype)
    print(f"# model {cfg.model}" + (f" + adapter {cfg.adapter}" if cfg.adapter else " (no adapter)"), file=sys.stderr)
    kw = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed)
    if cfg.prompt:
        system = [{"role": "system", "content": cfg.system}] if cfg.system else []
        print(generate(model, tok, system + [{"role": "user", "content": cfg.prompt}], **kw))
    else:
        talk(model, tok, cfg.system, sys.stdin, sys.stdout, sys.stderr, **kw)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        if cfg.chat or cfg.prompt:
            try_model(cfg)
            return 0
        proc = parallel.setup(cfg.device)
        jsonl, tensorboard = os.path.join(cfg.out, "metrics.jsonl"), tensorboard_dir(cfg.tensorboard, cfg.out)
        log = MetricLogger(jsonl, enabled=proc.is_main, tensorboard=tensorboard)
        try:
            train(cfg, proc, log)
            parallel.finish()
        finally:
            log.close()
            parallel.teardown()
    except (ValueError, FloatingPointError, OSError, KeyboardInterrupt) as e:  # ChatFormatError, ..., Ctrl-C
        print_error("finetune.py", str(e) or "interrupted")  # after Ctrl-C, RunControl's line says where it stopped
        return 130 if isinstance(e, KeyboardInterrupt) else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
