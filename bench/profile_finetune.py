"""Where one LoRA fine-tuning step's GPU time goes, ours against HF + peft (+ Liger), on finetune_throughput's sets.

    python bench/profile_finetune.py --set long        # H200: ~3 min
    python bench/profile_finetune.py --set long --only ours_padded,peer_padded

Each variant: `--warmup` untimed steps, then `--steps` steps under `torch.profiler`; prints the step's wall
time, GPU-busy time (idle = launch gaps and host syncs), GPU time by kernel kind (bench/profile_step's
groups) and the top kernels. Variants beyond finetune_throughput's rows isolate one cause each:
`_nodrop` (LoRA dropout 0), `_compile` (--compile: each block through torch.compile).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import finetune  # noqa: E402
from bench.finetune_throughput import build_ours, build_peer, make_sets  # noqa: E402
from bench.profile_step import kernel_times  # noqa: E402
from minilm_az import parallel  # noqa: E402
from minilm_az.config import FinetuneConfig  # noqa: E402
from minilm_az.kernels import liger_available  # noqa: E402
from minilm_az.model import get_preset  # noqa: E402
from minilm_az.tokenizer import PAD, train_tokenizer  # noqa: E402


def profile_variant(name, step, batches, layout, pad_id, warmup: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    for b in batches:  # every timed shape seen once first
        step(b, layout, pad_id)
    torch.cuda.synchronize()
    timed = batches[warmup:]
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for b in timed:
            step(b, layout, pad_id)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / len(timed)
    per_kind, top = kernel_times(prof, len(timed))
    gpu = sum(per_kind.values())
    print(f"\n== {name}: step wall {wall * 1e3:.1f} ms, GPU busy {gpu:.1f} ms ({100 * gpu / wall / 1e3:.0f} %)")
    for k, ms in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"   {k:34s} {ms:8.1f} ms")
    print("   top kernels:")
    for k, ms in sorted(top.items(), key=lambda kv: -kv[1])[:12]:
        print(f"     {ms:7.1f} ms  {k[:100]}")
    cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    print("   top host ops (self CPU ms/step):")
    for e in cpu:
        print(f"     {e.self_cpu_time_total / 1000 / len(timed):7.1f} ms  x{e.count // len(timed):<5d} {e.key[:80]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", default="long", choices=("short", "long"))
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", default=None)
    args = p.parse_args()
    d = parallel.setup("cuda")
    lines = [ln.strip() for f in sorted(glob.glob(os.path.join(ROOT, "data/az/*.txt"))) for ln in open(f) if ln.strip()]
    tok = train_tokenizer(lines, 8000, progress=False)
    pad_id = tok.token_to_id(PAD)
    mcfg = get_preset("llama3.2-1b", -(-tok.get_vocab_size() // 64) * 64)
    max_len = min(args.max_seq_len, mcfg.max_seq_len)
    examples = make_sets(tok, max_len, 160)[args.set]
    liger = liger_available()
    fc = FinetuneConfig(lora_r=64, lora_alpha=28.0, lora_dropout=0.05, micro_batch=4, global_batch=16, liger=liger)
    nodrop = dataclasses.replace(fc, lora_dropout=0.0)
    comp = dataclasses.replace(fc, compile=True)
    plan = [
        ("peer_padded", lambda: build_peer(mcfg, fc, d.device, liger), False),
        ("ours_padded", lambda: build_ours(mcfg, fc, d), None),
        ("ours_packed", lambda: build_ours(mcfg, fc, d), max_len),
        ("ours_padded_nodrop", lambda: build_ours(mcfg, nodrop, d), None),
        ("ours_padded_compile", lambda: build_ours(mcfg, comp, d), None),
        ("ours_packed_compile", lambda: build_ours(mcfg, comp, d), max_len),
    ]
    if args.only:
        plan = [r for r in plan if r[0] in args.only.split(",")]
    n = len(examples)
    batches = [
        [examples[i] for i in finetune.batch_order(n, s, fc.global_batch, 0)] for s in range(args.warmup + args.steps)
    ]
    for name, builder, layout in plan:
        model = step = None
        try:
            model, step, _ = builder()
            profile_variant(name, step, batches, layout, pad_id, args.warmup)
        except Exception as e:  # one broken variant must not cost the run
            print(f"\n== {name}: {type(e).__name__}: {str(e)[:300]}")
        finally:
            del model, step
            gc.collect()
            torch.cuda.empty_cache()
    parallel.finish()
    parallel.teardown()


if __name__ == "__main__":
    main()
