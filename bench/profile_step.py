"""Where one training step's GPU time goes: `torch.profiler` over a few steps, kernels grouped by kind.

    python bench/profile_step.py --micro-batch 14            # ours (Liger, eager), the 1B shape, seq 2048
    python bench/profile_step.py --compile                   # per-block compile with Liger FLCE
    python bench/profile_step.py --compile --fp8 tensorwise  # + float8 linears in the blocks (torchao)

Prints one table: GPU milliseconds per step for matmuls, attention (forward/backward), the fused
cross-entropy, norms/RoPE/SwiGLU, FSDP copies/casts, the optimizer, everything else; and the
step's wall time, so idle GPU time (launch gaps) shows as the difference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train_throughput import build_ours  # noqa: E402
from minilm_az import parallel  # noqa: E402
from minilm_az.model import get_preset  # noqa: E402

KINDS = [  # (kind, substrings of a kernel name), first match wins
    ("attention backward", ("flash_bwd", "attn_bwd", "fmha_bwd", "_bwd_kernel", "sdpa_sm90_flash_bprop")),
    ("attention forward", ("flash_fwd", "attn_fwd", "fmha_fwd", "_fwd_kernel", "sdpa_sm90_flash_fprop")),
    ("cross-entropy (FLCE)", ("cross_entropy", "liger_cross", "_ce_", "element_mul")),
    # Inductor names a fused kernel after its ops: a float8 cast fused with a norm carries both, so casts first.
    ("float8 casts and amax", ("float8", "fp8", "amax", "abs_max", "clamp_max_clamp_min")),
    ("rmsnorm (+ residual add)", ("rms_norm", "rsqrt")),
    ("rope", ("rope", "neg")),
    ("swiglu", ("swiglu", "silu", "sigmoid")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("fsdp copy/cast", ("chunk_cat", "split_with_sizes", "all_gather", "reduce_scatter", "copy_kernel", "nccl")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90", "xmma", "cublas", "wgmma")),
]


def kind_of(name: str) -> str:
    n = name.lower()
    for kind, keys in KINDS:
        if any(k in n for k in keys):
            return kind
    return "other (elementwise, reductions)"


def kernel_times(prof, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """GPU milliseconds per step of a finished `torch.profiler.profile`, by kind and by kernel name."""
    per_kind: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        # Kernels only: user annotations such as "Optimizer.step#AdamW.step" would count their kernels twice.
        if us and e.device_type.name == "CUDA" and "#" not in e.key:
            per_kind[kind_of(e.key)] += us / 1000 / steps
            top[e.key] += us / 1000 / steps
    return per_kind, top


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batch", type=int, default=14)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=100_352)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fp8", default="none", choices=["none", "tensorwise", "rowwise"])
    args = p.parse_args()
    d = parallel.setup("cuda")
    cfg = get_preset("llama3.2-1b", args.vocab)
    _, step = build_ours(cfg, d.device, True, args.compile, "none", fp8=args.fp8)
    x = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq + 1), device=d.device)
    for _ in range(3):
        step(x[:, :-1], x[:, 1:])
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            step(x[:, :-1], x[:, 1:])
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.steps
    per_kind, top = kernel_times(prof, args.steps)
    gpu = sum(per_kind.values())
    flops = cfg.flops_per_token(args.seq) * args.micro_batch * args.seq
    print(
        f"micro-batch {args.micro_batch}, seq {args.seq}, compile={args.compile}, fp8={args.fp8}: "
        f"step wall {wall * 1e3:.1f} ms, "
        f"GPU busy {gpu:.1f} ms, {flops / wall / 1e12:.0f} TFLOP/s model FLOPs"
    )
    print(f"{'kind':34s} {'ms/step':>8s} {'share':>6s}")
    for k, ms in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"{k:34s} {ms:8.1f} {100 * ms / wall / 1e3:5.1f}%")
    print(f"{'idle (wall - GPU busy)':34s} {wall * 1e3 - gpu:8.1f} {100 * (1 - gpu / wall / 1e3):5.1f}%")
    print("\ntop kernels:")
    for name, ms in sorted(top.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {ms:7.1f} ms  {kind_of(name):22s} {name[:90]}")
    parallel.finish()
    parallel.teardown()


if __name__ == "__main__":
    main()
