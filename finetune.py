"""Stage 3: LoRA chat fine-tuning of a Hugging Face-format Llama, with the loss on the assistant's tokens only.

    python finetune.py --model runs/cpt/export --data data/chat/az_chat.jsonl \\
        --val-data data/chat/az_chat_val.jsonl --out runs/sft --merge
    torchrun --nproc_per_node 8 finetune.py ...          # FSDP2 over the GPUs of one host
    python finetune.py --model runs/cpt/export --adapter runs/sft --chat     # talk to the result

Reads top to bottom: flags, data (render every conversation to ids + assistant-only labels), model
(meta -> LoRA -> FSDP2 -> materialise -> base weights -> adapter init), the loop (global batch by
gradient accumulation, masked-token-mean loss, eval, log), then the PEFT adapter and, with --merge,
a merged HF model in `<out>/merged`. On SageMaker the channels and model dir are the defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from minilm_az.chat import ChatFormatError, NothingToTrain, encode_chat, read_chat_jsonl
from minilm_az.checkpoint import CheckpointError, load_pretrained, load_weights_into, read_config, save_pretrained
from minilm_az.config import str2bool
from minilm_az.kernels import select_ops
from minilm_az.logs import MetricLogger, eta
from minilm_az.lora import (
    TARGETS,
    AdapterError,
    apply_lora,
    count_parameters,
    load_adapter,
    lora_parameters,
    merge_lora,
    reset_lora_parameters,
    save_adapter,
)
from minilm_az.model import materialize, meta_model
from minilm_az.parallel import all_reduce_sum, parallelize, resolve_device, setup, teardown
from minilm_az.tokenizer import BOS, EOS, EOT, PAD, copy_tokenizer_files, load_tokenizer


def add_bool(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    """`--name`, `--name true|false` (SageMaker passes strings) and `--no-name`."""
    dest = name.replace("-", "_")
    p.add_argument(f"--{name}", dest=dest, type=str2bool, nargs="?", const=True, default=default, help=help)
    p.add_argument(f"--no-{name}", dest=dest, action="store_false", help=argparse.SUPPRESS)


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(description="LoRA chat fine-tuning (assistant-only loss) of a HF-format Llama.")
    g = p.add_argument_group("data and model")
    g.add_argument("--model", default=env.get("SM_CHANNEL_BASE_MODEL") or env.get("SM_CHANNEL_MODEL"),
                   help="HF-format Llama directory (the CPT export)")
    g.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: --model)")
    g.add_argument("--data", default=env.get("SM_CHANNEL_DATA"),
                   help="chat JSONL file, or a directory holding train.jsonl / *.jsonl (+ val.jsonl)")
    g.add_argument("--val-data", default=None, help="val JSONL (default: a val*.jsonl beside --data, else a split)")
    g.add_argument("--val-fraction", type=float, default=0.05, help="held out of --data when there is no val file")
    g.add_argument("--out", default=env.get("SM_MODEL_DIR", "runs/finetune"), help="adapter (and merged/) here")
    g.add_argument("--on-bad-line", choices=("fail", "skip"), default="fail", help="malformed JSONL lines")
    add_bool(g, "last-turn-only", False, "train only the final assistant turn of each conversation")
    g = p.add_argument_group("LoRA (defaults: the recipe)")
    # --lora-r etc. are aliases: under torchrun a bare `--r` is taken for an abbreviation of --rdzv-*.
    g.add_argument("--r", "--lora-r", dest="r", type=int, default=64, help="rank")
    g.add_argument("--alpha", "--lora-alpha", dest="alpha", type=float, default=28, help="scaling = alpha / r")
    g.add_argument("--dropout", "--lora-dropout", dest="dropout", type=float, default=0.05)
    g.add_argument("--targets", default=",".join(TARGETS), help="comma-separated projection names")
    g.add_argument("--max-seq-len", type=int, default=1024)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the data)")
    g.add_argument("--epochs", type=float, default=1.0)
    g.add_argument("--lr", type=float, default=2e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    g.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--micro-batch", type=int, default=4, help="conversations per forward, per process")
    g.add_argument("--global-batch", type=int, default=16, help="conversations per step, all processes")
    g.add_argument("--eval-every", type=int, default=50)
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--seed", type=int, default=0)
    add_bool(g, "merge", False, "also export base+adapter merged, as a HF model in <out>/merged")
    g = p.add_argument_group("hardware")
    g.add_argument("--device", default="auto", help="auto, cuda or cpu")
    add_bool(g, "liger", True, "Liger's fused kernels on CUDA")
    add_bool(g, "compile", False, "torch.compile each block")
    g.add_argument("--ac", choices=("none", "full", "selective"), default="none", help="activation checkpointing")
    g = p.add_argument_group("try the model (no training)")
    add_bool(g, "chat", False, "interactive chat on stdin with --model (+ --adapter)")
    g.add_argument("--prompt", default=None, help="one user message: print the reply and exit")
    g.add_argument("--adapter", default=None, help="adapter dir for --chat/--prompt (default: --out if it has one)")
    g.add_argument("--system", default=None, help="system prompt for --chat/--prompt")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.9)
    args = p.parse_args(argv)
    if not args.model:
        p.error("--model is required (or set SM_CHANNEL_BASE_MODEL / SM_CHANNEL_MODEL)")
    if not (args.chat or args.prompt) and not args.data:
        p.error("--data is required (or set SM_CHANNEL_DATA)")
    for name in ("r", "micro_batch", "global_batch", "max_seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# ---------------------------------------------------------------- data

def data_files(args) -> tuple[list[str], str | None]:
    """Train files and the val file from --data / --val-data (a file, or a directory of .jsonl)."""
    if os.path.isdir(args.data):
        names = sorted(f for f in os.listdir(args.data) if f.endswith(".jsonl"))
        val = [f for f in names if f.startswith(("val", "valid")) or "_val" in f]
        train = ["train.jsonl"] if "train.jsonl" in names else [f for f in names if f not in val]
        if not train:
            raise FileNotFoundError(f"no train .jsonl files in {args.data}")
        val_file = args.val_data or (os.path.join(args.data, val[0]) if val else None)
        return [os.path.join(args.data, f) for f in train], val_file
    if not os.path.isfile(args.data):
        raise FileNotFoundError(f"chat data not found: {args.data}")
    return [args.data], args.val_data


def encode_all(convs, tok, max_len, last_turn_only) -> tuple[list, int]:
    out, dropped = [], 0
    for messages in convs:
        try:
            out.append(encode_chat(messages, tok, max_len=max_len, last_turn_only=last_turn_only))
        except NothingToTrain:
            dropped += 1
    return out, dropped


def collate(examples, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift (inputs = ids[:-1], targets = labels[1:]) and right-pad: pad id in, -100 out."""
    T = max(len(ids) - 1 for ids, _ in examples)
    x = torch.full((len(examples), T), pad_id, dtype=torch.long)
    y = torch.full((len(examples), T), -100, dtype=torch.long)
    for i, (ids, labels) in enumerate(examples):
        n = len(ids) - 1
        x[i, :n] = torch.tensor(ids[:-1])
        y[i, :n] = torch.tensor(labels[1:])
    return x.to(device), y.to(device)


def batch_order(n: int, step: int, global_batch: int, seed: int) -> list[int]:
    """Example indices of one step's global batch: a fresh seeded permutation per epoch, read in order."""
    idx, start = [], step * global_batch
    while len(idx) < global_batch:
        epoch, offset = divmod(start + len(idx), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        idx += perm[offset: offset + global_batch - len(idx)]
    return idx


def lr_at(step: int, args, total: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(total - args.warmup, 1)
    lo = args.lr * args.min_lr_ratio
    return lo + 0.5 * (args.lr - lo) * (1 + math.cos(math.pi * min(t, 1.0)))


# ---------------------------------------------------------------- eval

@torch.no_grad()
def evaluate(model, val, args, d, pad_id) -> float:
    """Masked (assistant-token) mean NLL over the val set, split over ranks, every rank running the same forwards."""
    model.eval()
    per_call = args.micro_batch * d.world_size
    nll, n = 0.0, 0
    for b in range(math.ceil(len(val) / per_call)):
        s = b * per_call + d.rank * args.micro_batch
        chunk = val[s: s + args.micro_batch]
        if not chunk:  # FSDP needs every rank in every forward: a dummy with no targets
            chunk = [([pad_id, pad_id], [-100, -100])]
        x, y = collate(chunk, pad_id, d.device)
        nll += float(model(x, targets=y, reduction="sum"))
        n += int((y != -100).sum())
    model.train()
    total_nll, total_n = all_reduce_sum([nll, n], d.device)
    return total_nll / max(total_n, 1)


# ---------------------------------------------------------------- try the model

def talk(args) -> None:
    """--prompt / --chat: the base model, with an adapter when given, answering on stdout."""
    from minilm_az.generate import generate
    dev = resolve_device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    tok = load_tokenizer(args.tokenizer or args.model)
    model = load_pretrained(args.model, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    adapter = args.adapter
    if adapter is None and args.out and os.path.isfile(os.path.join(args.out, "adapter_config.json")):
        adapter = args.out
    if adapter:
        load_adapter(model, adapter, dropout=0.0)
        model.to(next(model.parameters()).dtype)
    print(f"# model {args.model}" + (f" + adapter {adapter}" if adapter else " (no adapter)"), file=sys.stderr)
    history = [{"role": "system", "content": args.system}] if args.system else []
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.prompt:
        print(generate(model, tok, history + [{"role": "user", "content": args.prompt}], **kw))
        return
    interactive = sys.stdin.isatty()
    if interactive:
        print("# type a message; /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        reply = generate(model, tok, history, **kw)
        print(reply, flush=True)
        history.append({"role": "assistant", "content": reply or " "})


# ---------------------------------------------------------------- train

def base_dtype(model_dir: str) -> torch.dtype:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    return getattr(torch, str(hf.get("torch_dtype") or hf.get("dtype") or "float32"), torch.float32)


def train(args) -> None:
    d = setup(args.device)
    try:
        _train(args, d)
    finally:
        teardown()


def _train(args, d) -> None:
    per_step = args.micro_batch * d.world_size
    if args.global_batch % per_step:
        raise ValueError(f"--global-batch {args.global_batch} is not a multiple of --micro-batch x processes "
                         f"= {args.micro_batch} x {d.world_size}")
    accum = args.global_batch // per_step
    torch.manual_seed(args.seed * 1000 + d.rank)  # dropout masks differ per rank
    log = MetricLogger(os.path.join(args.out, "metrics.jsonl"), enabled=d.is_main)

    # Data: every rank renders everything (small), so each knows the whole global batch and its token count.
    tok = load_tokenizer(args.tokenizer or args.model)
    cfg = read_config(args.model)
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens but {args.model} has vocab_size="
                         f"{cfg.vocab_size}: not the tokenizer this model was trained with")
    max_len = min(args.max_seq_len, cfg.max_seq_len)
    train_files, val_file = data_files(args)
    convs, skipped = [], []
    for f in train_files:
        c, s = read_chat_jsonl(f, args.on_bad_line)
        convs += c
        skipped += s
    val_convs = []
    if val_file:
        val_convs, s = read_chat_jsonl(val_file, args.on_bad_line)
        skipped += s
    elif args.val_fraction > 0 and len(convs) >= 20:
        perm = torch.randperm(len(convs), generator=torch.Generator().manual_seed(args.seed)).tolist()
        n_val = max(1, int(len(convs) * args.val_fraction))
        val_convs = [convs[i] for i in perm[:n_val]]
        convs = [convs[i] for i in perm[n_val:]]
    for msg in skipped[:5]:
        log.info(f"skipped bad line: {msg}")
    examples, dropped = encode_all(convs, tok, max_len, args.last_turn_only)
    val, val_dropped = encode_all(val_convs, tok, max_len, args.last_turn_only)
    if not examples:
        raise ChatFormatError(f"no trainable conversation left in {', '.join(train_files)}")
    pad_id = tok.token_to_id(PAD) or 0
    steps = args.steps or max(1, math.ceil(args.epochs * len(examples) / args.global_batch))
    log.log("data", train=len(examples), val=len(val), skipped_bad_lines=len(skipped),
            dropped_truncated=dropped + val_dropped, max_len=max_len,
            train_tokens=sum(len(i) for i, _ in examples),
            target_tokens=sum(sum(x != -100 for x in lab) for _, lab in examples))

    # Model: LoRA on the meta model, shard, allocate, load the base, then initialise the adapters.
    cuda = d.device.type == "cuda"
    model = meta_model(cfg, select_ops(d.device, args.liger, compile=args.compile))
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    apply_lora(model, r=args.r, alpha=args.alpha, dropout=args.dropout, targets=targets)
    trainable, total = count_parameters(model)
    log.log("model", params=total, trainable=trainable, trainable_pct=round(100 * trainable / total, 3),
            r=args.r, alpha=args.alpha, dropout=args.dropout, targets=",".join(targets), world=d.world_size,
            device=d.device.type, ops=model.ops.name)
    parallelize(model, mixed_precision=cuda, ac=args.ac, compile=args.compile)
    materialize(model, d.device, init=False)
    load_weights_into(model, args.model)
    reset_lora_parameters(model, seed=args.seed)
    model.train()
    params = lora_parameters(model)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay,
                            fused=cuda or None)

    if val:
        log.log("eval", step=0, val_loss=evaluate(model, val, args, d, pad_id))
    t0 = time.time()
    for step in range(steps):
        t_step = time.time()
        lr = lr_at(step, args, steps)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = [examples[i] for i in batch_order(len(examples), step, args.global_batch, args.seed)]
        n_targets = sum(sum(x != -100 for x in lab[1:]) for _, lab in batch)
        n_tokens = sum(len(ids) - 1 for ids, _ in batch)
        nll = 0.0
        for k in range(accum):
            s = (k * d.world_size + d.rank) * args.micro_batch
            x, y = collate(batch[s: s + args.micro_batch], pad_id, d.device)
            loss_sum = model(x, targets=y, reduction="sum")
            # FSDP averages gradients over ranks: scaling by world size makes the step the mean over
            # every target token of the global batch, however it is split.
            (loss_sum * (d.world_size / n_targets)).backward()
            nll += float(loss_sum.detach())
        gn = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
        gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % args.log_every == 0 or done == steps or step == 0:
            loss = all_reduce_sum([nll], d.device)[0] / n_targets
            dt = time.time() - t_step
            log.log("finetune", step=done, loss=loss, lr=lr, grad_norm=gn, tokens_per_s=round(n_tokens / dt),
                    step_s=round(dt, 3), progress=f"{done}/{steps}", eta=eta(done, steps, time.time() - t0))
        if val and (done % args.eval_every == 0 or done == steps):
            log.log("eval", step=done, val_loss=evaluate(model, val, args, d, pad_id))

    # Adapter (every rank gathers, rank 0 writes), tokenizer beside it, then the optional merged model.
    save_adapter(model, args.out, base_model_name_or_path=os.path.abspath(args.model), is_writer=d.is_main)
    if d.is_main:
        copy_tokenizer_files(args.tokenizer or args.model, args.out)
        with open(os.path.join(args.out, "finetune_args.json"), "w", encoding="utf-8") as f:
            json.dump(vars(args), f, indent=2)
        log.info(f"saved adapter to {args.out} ({trainable} parameters) in {time.time() - t0:.1f} s")
        if args.merge:
            merged_dir = os.path.join(args.out, "merged")
            base = load_pretrained(args.model)
            load_adapter(base, args.out)
            merge_lora(base)
            ids = {"bos_id": tok.token_to_id(BOS), "eos_id": [tok.token_to_id(EOT), tok.token_to_id(EOS)],
                   "pad_id": pad_id}
            save_pretrained(base, merged_dir, dtype=base_dtype(args.model), token_ids=ids)
            copy_tokenizer_files(args.tokenizer or args.model, merged_dir)
            log.info(f"saved merged model to {merged_dir}")
    if dist.is_initialized() and d.world_size > 1:
        dist.barrier()
    log.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.chat or args.prompt:
            talk(args)
        else:
            train(args)
    except (ChatFormatError, CheckpointError, AdapterError, FileNotFoundError, ValueError) as e:
        print(f"finetune.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
