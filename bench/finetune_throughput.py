"""LoRA fine-tuning throughput of ours (packed, padded) against Hugging Face + peft (+ Liger), one run, one GPU.

    python bench/finetune_throughput.py --warm-all --out bench/results/finetune_throughput_h200.json  # H200: ~5 min
    python bench/finetune_throughput.py --preset tiny --device cpu --quick                  # smoke test

Every row trains the same steps: a random-init model (the 1B preset, vocab = an 8,000-id tokenizer trained
here on data/az, rounded up to 64), LoRA r=64, alpha 28, dropout 0.05 on all 7 projections, 16 conversations
a step in micro-batches of 4 (conversations, or packed rows of --max-seq-len tokens), AdamW (fused) + grad
clip 1.0, `--warmup` untimed then `--steps` timed steps over the same seeded batch order (with `--warm-all`,
the timed steps also run once untimed first, so no shape meets a compiler while timed). Two sets: `short`,
the demo chat set (data/chat); `long`, multi-turn conversations made of 4-14 of its conversations' turns
(truncated at --max-seq-len as finetune.py does). Throughput counts real tokens only: every row gets the
same conversations, so the same real tokens per step, whatever it pads.

- ours_packed / ours_padded: finetune.py's own `build` steps (LoRA on the meta model, frozen base cast to
  bf16, fp32 adapters computing in bf16; no FSDP on one process) and its `train_step`, `--packing` on / off;
  ours_packed_capped (short set): `--max-tokens-per-forward --cap-tokens` (1,024), the memory-capped setting;
  ours_*_compile (CUDA): `--compile`, each block through torch.compile (fewer, fused kernel launches);
  ours_packed_capped_compile: both, on the short set and on the long one with --cap-tokens-long (3,072 of
  the micro-batch's 4,096), the row that trades a little speed for memory there;
  ours_*_compile_fsdp (long set): the same in FSDP2 over the one GPU, as finetune.py did before 2026-12-04;
- peer_padded: `transformers.LlamaForCausalLM` in bf16 + `peft.get_peft_model` (fp32 adapters), bf16
  autocast, SDPA, `apply_liger_kernel_to_llama()` when liger-kernel is installed; right-padded micro-batches
  with an attention mask, as the HF Trainer's default collator gives;
- peer_packed: the same model fed by `transformers.DataCollatorWithFlattening`, the padding-free collator
  TRL uses (one row of the micro-batch's conversations back to back, `position_ids` restarting, the first
  label of each -100, no attention mask: transformers builds the block-diagonal SDPA mask from the positions);
- peer_padded_last: peer_padded once more after every other row of the set (its ratio should read ~1.00).

Also: the packed and padded first-step loss with dropout off (equal but for bf16 rounding), and the peak
memory of the 1B with our 100k vocabulary at r=64, max_seq_len 1024 (the A10G/g5 case, 24 GB).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import glob
import importlib.util
import json
import os
import platform
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from minilm_az import lora, parallel  # noqa: E402
from minilm_az.chat import encode_chat  # noqa: E402
from minilm_az.config import FinetuneConfig  # noqa: E402
from minilm_az.hf import config_to_hf  # noqa: E402
from minilm_az.kernels import liger_available, select_ops  # noqa: E402
from minilm_az.model import IGNORE, get_preset, materialize, meta_model  # noqa: E402
from minilm_az.prep.chat_data import read_chat_jsonl  # noqa: E402
from minilm_az.tokenizer import PAD, train_tokenizer  # noqa: E402

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


import finetune  # noqa: E402  the root script (ROOT is on sys.path above)


def make_sets(tok, max_len: int, n_long: int, seed: int = 0) -> dict[str, list]:
    """`short`: data/chat as it is; `long`: multi-turn conversations stitched from its turns."""
    convs = read_chat_jsonl(os.path.join(ROOT, "data/chat/az_chat.jsonl"))[0]
    rng = random.Random(seed)
    long = []
    for _ in range(n_long):
        parts = rng.sample(convs, rng.randint(4, 14))
        system = [m for m in parts[0] if m["role"] == "system"]
        long.append(system + [m for c in parts for m in c if m["role"] != "system"])
    return {
        "short": [encode_chat(m, tok, max_len=max_len) for m in convs],
        "long": [encode_chat(m, tok, max_len=max_len) for m in long],
    }


def build_ours(mcfg, fc: FinetuneConfig, proc: parallel.Process, shard: bool | None = None):
    """finetune.build's steps, with a random base instead of loaded weights (`shard`: FSDP2 even on one GPU)."""
    model = meta_model(mcfg, select_ops(proc.device, fc.liger, compile=fc.compile))
    lora.apply_lora(model, r=fc.lora_r, alpha=fc.lora_alpha, dropout=fc.lora_dropout, targets=TARGETS.split(","))
    if proc.device.type == "cuda":
        lora.cast_frozen(model, torch.bfloat16)
    parallel.parallelize(
        model,
        mixed_precision=proc.device.type == "cuda",
        ac=fc.ac,
        compile=fc.compile,
        shard=proc.world_size > 1 if shard is None else shard,
    )
    materialize(model, proc.device, seed=0)
    lora.reset_lora_parameters(model, seed=0)
    params = lora.lora_parameters(model)
    dtypes = sorted({f"{'lora' if 'lora_' in n else 'base'}:{p.dtype}" for n, p in model.named_parameters()})
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=proc.device.type == "cuda")

    def step(batch, row_len, pad_id):
        loss, _, _ = finetune.train_step(model, batch, params, fc, proc, pad_id, row_len)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step, dtypes


def build_peer(mcfg, fc: FinetuneConfig, device, liger: bool):
    import peft
    import transformers

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    hf_cfg = {
        k: v
        for k, v in config_to_hf(mcfg, torch.bfloat16).items()
        if k not in ("architectures", "model_type", "torch_dtype")
    }
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)  # the same random base and adapters for both peer rows, so their check losses compare
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg, attn_implementation="sdpa"))
    hf = hf.to(device=device, dtype=dtype)
    hf.config.use_cache = False
    lc = peft.LoraConfig(
        r=fc.lora_r, lora_alpha=fc.lora_alpha, lora_dropout=fc.lora_dropout, target_modules=TARGETS.split(",")
    )
    model = peft.get_peft_model(hf, lc)  # adapters in fp32 (autocast_adapter_dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = sorted({f"{'lora' if 'lora_' in n else 'base'}:{p.dtype}" for n, p in model.named_parameters()})
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=cuda)

    def step(batch, packed, pad_id):
        n_targets = sum(sum(t != IGNORE for t in lab[1:]) for _, lab in batch)
        for s in range(0, len(batch), fc.micro_batch):
            kw = peer_inputs(batch[s : s + fc.micro_batch], packed, pad_id, device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                out = model(**kw, use_cache=False)  # mean over this micro-batch's targets
            n = sum(sum(t != IGNORE for t in lab[1:]) for _, lab in batch[s : s + fc.micro_batch])
            (out.loss * (n / n_targets)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss)

    return model, step, dtypes


def layout_counts(batch, name, layout, fc, pad_id) -> tuple[int, int]:
    """(forwards, tokens computed) of one step in this row's layout, padding included."""
    if name.startswith("ours"):
        mbs = finetune.micro_batches(batch, 0, 1, fc.micro_batch, pad_id, "cpu", layout, fc.max_tokens_per_forward)
        return len(mbs), sum(x.numel() for x, _, _ in mbs)
    kws = [
        peer_inputs(batch[s : s + fc.micro_batch], layout, pad_id, "cpu") for s in range(0, len(batch), fc.micro_batch)
    ]
    return len(kws), sum(kw["input_ids"].numel() for kw in kws)


def peer_inputs(examples, packed: bool, pad_id: int, device) -> dict:
    """HF inputs: right-padded with an attention mask, or one padding-free row with restarting position_ids."""
    if packed:  # labels: the first of each conversation -100, so no target crosses a boundary
        from transformers import DataCollatorWithFlattening

        kw = DataCollatorWithFlattening()([{"input_ids": e, "labels": lab} for e, lab in examples])
        return {k: kw[k].to(device) for k in ("input_ids", "labels", "position_ids")}
    T = max(len(e) for e, _ in examples)
    x = torch.full((len(examples), T), pad_id)
    y = torch.full((len(examples), T), IGNORE)
    mask = torch.zeros((len(examples), T), dtype=torch.long)
    for i, (e, lab) in enumerate(examples):
        x[i, : len(e)], y[i, : len(e)], mask[i, : len(e)] = torch.tensor(e), torch.tensor(lab), 1
    return {"input_ids": x.to(device), "labels": y.to(device), "attention_mask": mask.to(device)}


def run_row(name, builder, examples, layout, fc, args, device, pad_id) -> dict:
    row = {"variant": name, "set": args.set_name}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = step = None
    try:
        model, step, dtypes = builder()
        row["dtypes"] = dtypes
        n = len(examples)
        batches = [
            [examples[i] for i in finetune.batch_order(n, s, fc.global_batch, 0)]
            for s in range(args.warmup + args.steps)
        ]
        if args.check_loss:  # dropout off, no update: the first step's loss, to compare across layouts
            model.eval()
            row["check_loss"] = first_loss(name, model, batches[0], layout, fc, pad_id, device)
            model.train()
        for b in batches[: args.warmup] + (batches[args.warmup :] if args.warm_all else []):
            step(b, layout, pad_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for b in batches[args.warmup :]:
            loss = step(b, layout, pad_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / args.steps
        real = sum(len(ids) - 1 for b in batches[args.warmup :] for ids, _ in b) / args.steps
        row.update(step_s=dt, real_tokens_per_step=real, real_tokens_per_s=real / dt, loss=float(loss))
        counts = [layout_counts(b, name, layout, fc, pad_id) for b in batches[args.warmup :]]
        row.update(forwards_per_step=sum(f for f, _ in counts) / args.steps)
        row.update(computed_tokens_per_step=sum(t for _, t in counts) / args.steps)
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.cuda.OutOfMemoryError:
        row.update(oom=True)
    except Exception as e:  # one broken row must not cost the run: record it and go on
        row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        del model, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def first_loss(name, model, batch, layout, fc, pad_id, device) -> float:
    if name.startswith("ours"):
        params = lora.lora_parameters(model)
        proc = parallel.Process(0, 1, 0, device)
        loss = finetune.train_step(model, batch, params, fc, proc, pad_id, layout)[0]
        for p in params:
            p.grad = None
        return loss
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(batch), fc.micro_batch):
            kw = peer_inputs(batch[s : s + fc.micro_batch], layout, pad_id, device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model(**kw, use_cache=False)
            k = int((kw["labels"][:, 1:] != IGNORE).sum())
            nll, n = nll + float(out.loss) * k, n + k
    return nll / n


@contextlib.contextmanager
def sdpa_mask_on_cuda():
    """model.doc_mask's CPU path (a dense boolean mask for SDPA) on CUDA too: the fallback if flex fails."""
    from minilm_az import model as m

    flex = m.doc_mask
    m.doc_mask = lambda doc: m.doc_mask_dense(doc)
    try:
        yield
    finally:
        m.doc_mask = flex


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--n-long", type=int, default=160)
    p.add_argument("--memory-vocab", type=int, default=100_352, help="vocab of the 1B memory case (0: skip it)")
    p.add_argument("--cap-tokens", type=int, default=1024, help="--max-tokens-per-forward of the capped row")
    p.add_argument("--cap-tokens-long", type=int, default=3072, help="the same, of the long set's capped row")
    p.add_argument(
        "--warm-all",
        action="store_true",
        help="an untimed pass over the timed steps first, so no shape is first seen (and JIT-compiled) while timed",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs")
    p.add_argument("--only", default=None, help="comma-separated variant names to run")
    p.add_argument("--out", default="bench/results/finetune_throughput.json")
    args = p.parse_args()
    proc = parallel.setup(args.device)
    device, cuda = proc.device, proc.device.type == "cuda"
    if args.quick:
        args.warmup, args.steps, args.n_long, args.max_seq_len, args.memory_vocab = 1, 2, 32, 256, 0
        args.cap_tokens = args.cap_tokens_long = 256
    lines = [ln.strip() for f in sorted(glob.glob(os.path.join(ROOT, "data/az/*.txt"))) for ln in open(f) if ln.strip()]
    tok = train_tokenizer(lines, 8000, progress=False)
    pad_id = tok.token_to_id(PAD)
    mcfg = get_preset(args.preset, -(-tok.get_vocab_size() // 64) * 64)
    max_len = min(args.max_seq_len, mcfg.max_seq_len)
    sets = make_sets(tok, max_len, args.n_long)
    liger = cuda and liger_available()
    fc = FinetuneConfig(lora_r=64, lora_alpha=28.0, lora_dropout=0.05, micro_batch=4, global_batch=16, liger=liger)
    if args.quick:
        fc.lora_r = 8
    capped = dataclasses.replace(fc, max_tokens_per_forward=args.cap_tokens)
    compiled = dataclasses.replace(fc, compile=True)
    capped_c = dataclasses.replace(capped, compile=True)
    cap_long = dataclasses.replace(capped_c, max_tokens_per_forward=args.cap_tokens_long)
    gpu_sets = ("short", "long") if cuda else ()  # compiled rows: CUDA only (CPU Inductor is slow to build)
    plan = [  # (variant, builder, layout, config, sets); the peer first, so no compiled row runs before it
        ("peer_padded", lambda: build_peer(mcfg, fc, device, liger), False, fc, ("short", "long")),
        ("peer_packed", lambda: build_peer(mcfg, fc, device, liger), True, fc, ("short", "long")),
        ("ours_packed", lambda: build_ours(mcfg, fc, proc), max_len, fc, ("short", "long")),
        ("ours_packed_capped", lambda: build_ours(mcfg, capped, proc), max_len, capped, ("short",)),
        ("ours_padded", lambda: build_ours(mcfg, fc, proc), None, fc, ("short", "long")),
        ("ours_packed_compile", lambda: build_ours(mcfg, compiled, proc), max_len, compiled, gpu_sets),
        ("ours_padded_compile", lambda: build_ours(mcfg, compiled, proc), None, compiled, gpu_sets),
        ("ours_packed_capped_compile", lambda: build_ours(mcfg, capped_c, proc), max_len, capped_c, gpu_sets[:1]),
        ("ours_packed_capped_compile", lambda: build_ours(mcfg, cap_long, proc), max_len, cap_long, gpu_sets[1:]),
        ("ours_packed_compile_fsdp", lambda: build_ours(mcfg, compiled, proc, True), max_len, compiled, gpu_sets[1:]),
        ("ours_padded_compile_fsdp", lambda: build_ours(mcfg, compiled, proc, True), None, compiled, gpu_sets[1:]),
        # the peer again, last: a check that the rows before it (compiled ones) did not slow the GPU down
        ("peer_padded_last", lambda: build_peer(mcfg, fc, device, liger), False, fc, ("short", "long")),
    ]
    if args.only:
        plan = [r for r in plan if r[0] in set(args.only.split(","))]
    rows = []
    for set_name, examples in sets.items():
        args.set_name, args.check_loss = set_name, True
        for name, builder, layout, cfg, on in plan:
            if set_name not in on:
                continue
            rows.append(run_row(name, builder, examples, layout, cfg, args, device, pad_id))
            if name == "ours_packed" and "error" in rows[-1] and cuda:  # flex failed: the SDPA-mask path instead
                with sdpa_mask_on_cuda():
                    rows.append(run_row(name + "_sdpa", builder, examples, layout, cfg, args, device, pad_id))
    if args.memory_vocab:  # the 1B with our 100k vocabulary, r=64, max_seq_len 1024, the long set
        big = get_preset(args.preset, args.memory_vocab)
        args.set_name, args.check_loss = "long", False
        for name, layout in (("ours_packed_1b_100k", max_len), ("ours_padded_1b_100k", None)):
            rows.append(
                run_row(name, lambda: build_ours(big, fc, proc), sets["long"], layout, fc, args, device, pad_id)
            )
    report(rows, sets, args, liger, mcfg, max_len)
    parallel.finish()
    parallel.teardown()


def report(rows, sets, args, liger, mcfg, max_len):
    cuda = torch.cuda.is_available() and args.device != "cpu"
    head = f"{'set':6s} {'variant':22s} {'step s':>7s} {'real tok/s':>10s} {'vs peer_padded':>14s} {'peak GiB':>8s}"
    print(f"\n{head} {'fwd/step':>8s} {'computed tok':>12s}")
    for r in rows:
        peer = next((q for q in rows if q["set"] == r["set"] and q["variant"] == "peer_padded"), {})
        if "real_tokens_per_s" not in r:
            print(f"{r['set']:6s} {r['variant']:22s} {r.get('error') or 'OOM'}")
            continue
        ratio = r["real_tokens_per_s"] / peer["real_tokens_per_s"] if "real_tokens_per_s" in peer else float("nan")
        print(
            f"{r['set']:6s} {r['variant']:22s} {r['step_s']:7.3f} {r['real_tokens_per_s']:10.0f} {ratio:14.2f} "
            f"{r.get('peak_gib', float('nan')):8.2f} {r['forwards_per_step']:8.2f} "
            f"{r['computed_tokens_per_step']:12.0f}"
        )
    for r in rows:
        if "check_loss" in r:
            print(f"check_loss {r['set']} {r['variant']} {r['check_loss']:.5f}")
    import transformers

    meta = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "preset": args.preset,
        "vocab": mcfg.vocab_size,
        "max_seq_len": max_len,
        "sets": {
            k: {"conversations": len(v), "mean_tokens": sum(len(i) for i, _ in v) / len(v)} for k, v in sets.items()
        },
        "argv": sys.argv,
    }
    for mod in ("peft", "liger_kernel"):
        if importlib.util.find_spec(mod):
            meta[mod] = getattr(__import__(mod), "__version__", "installed")
    meta["peer_liger"] = liger
    print(json.dumps(meta))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
