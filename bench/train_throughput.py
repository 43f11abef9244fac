"""Training throughput of our engine against Hugging Face transformers + Liger, in one run, on one GPU.

    python bench/train_throughput.py --out bench/results.json            # the full table (H200: ~8 min)
    python bench/train_throughput.py --preset tiny --device cpu --quick  # a smoke test of the script

Every row runs the same work: the 1B shape (vocab 100k), seq 2048, bf16 compute, AdamW, grad clip 1.0,
random tokens, `--warmup` untimed steps then `--steps` timed ones. Ours is the real training path
(meta build -> `parallel.parallelize` (FSDP2, bf16 compute weights cast once per step) -> materialise);
the peer is `transformers.LlamaForCausalLM` in fp32 with bf16 autocast and
`liger_kernel.transformers.apply_liger_kernel_to_llama()`. Ratios are against the peer's best row.

The `ours_fp8_*` rows (CUDA, torchao) are `--compile --liger` with `train.py --fp8`: tensorwise or rowwise
scales, `_all_gather` = float8 all-gather with scales precomputed after each step, `_cudnn` = SDPA's cuDNN
attention instead of flash attention, `_ac_full` = with full activation checkpointing, `_cdt` = Inductor's
coordinate-descent tuning of its kernels, `_autotune` = that + max-autotune (Triton GEMM templates tried too),
`_keep_gathered` = FSDP keeps the bf16 weights gathered from forward to backward (reshard_after_forward=False),
`_fast_accum` = `--fp8-fast-accum` (the backward's float8 GEMMs accumulate in the fast mode too).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minilm_az import kernels, parallel  # noqa: E402
from minilm_az.hf import config_to_hf  # noqa: E402
from minilm_az.kernels import select_ops  # noqa: E402
from minilm_az.model import get_preset, materialize, meta_model  # noqa: E402

PEAK = 989e12
FLCE_DEFAULT = kernels.FLCE_CHUNK_MEM
SEQ = 2048  # the sequence length of this run (main sets it); FlexAttention's causal mask is built for it


def matmul_peak(device) -> float:
    """bf16 8192^3 matmul FLOP/s measured here (the achievable ceiling for MFU)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t)


def set_attention(kind: str) -> None:
    """Which attention kernel the blocks get (run_row restores the defaults after each row).

    `default` leaves SDPA's own choice (on Hopper with torch 2.11 that is cuDNN's fused attention), `flash` and
    `cudnn` allow only that SDPA backend, `flex` routes the model's causal SDPA call to FlexAttention with a
    causal BlockMask (Inductor generates its Triton kernels inside the compiled block).
    """
    if kind in ("flash", "cudnn"):
        torch.backends.cuda.enable_flash_sdp(kind == "flash")
        torch.backends.cuda.enable_cudnn_sdp(kind == "cudnn")
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    elif kind == "flex":
        from torch.nn.attention import flex_attention as flex

        masks: dict = {}

        def flex_sdpa(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **_):
            if attn_mask is not None or not is_causal:
                return SDPA(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
            # The mask is built before the first step (`prepare`), so the compiled block only reads it.
            return flex.flex_attention(q, k, v, block_mask=masks[q.shape[-2]], enable_gqa=enable_gqa)

        def causal(b, h, q, kv):
            return kv <= q

        def prepare(seq: int, device) -> None:
            masks[seq] = flex.create_block_mask(causal, None, None, seq, seq, device=device)

        flex_sdpa.prepare = prepare
        torch.nn.functional.scaled_dot_product_attention = flex_sdpa
    elif kind != "default":
        raise ValueError(f"unknown attention {kind!r}")


SDPA = torch.nn.functional.scaled_dot_product_attention  # the real one, restored by run_row


def reset_attention() -> None:
    torch.nn.functional.scaled_dot_product_attention = SDPA
    for enable in ("flash", "mem_efficient", "cudnn", "math"):
        getattr(torch.backends.cuda, f"enable_{enable}_sdp")(True)


def build_ours(
    cfg,
    device,
    liger: bool,
    compile: bool,
    ac: str,
    liger_blocks: bool = False,
    fp8: str = "none",
    attention: str = "default",
    flce_chunk_mem: int | None = None,
    optimizer: str = "fused",
    whole: bool = False,
    head: str = "flce",
    **fp8_opts,
):
    """Our model and step. Levers (each a row's suffix): `attention` (set_attention), `flce_chunk_mem` (Liger's
    FLCE chunk sizing, kernels.FLCE_CHUNK_MEM), `optimizer` (AdamW fused, foreach, or `compiled`: clip + AdamW
    in one torch.compile), `whole` (the trunk, embedding to final norm, compiled as one function instead of
    each block; the head's fused cross-entropy stays outside, as per block), `head` (`flce`: Liger's fused linear
    cross-entropy; `logits` or `fp8`: see `full_logits_loss`)."""
    # Read when the ops are selected, just below; None keeps the library's default.
    kernels.FLCE_CHUNK_MEM = FLCE_DEFAULT if flce_chunk_mem is None else flce_chunk_mem
    # liger_blocks: Liger's norm/RoPE/SwiGLU inside the compiled blocks too (select_ops keeps torch ops there)
    ops = select_ops(device, liger, compile and not liger_blocks)
    model = meta_model(cfg, ops)
    set_attention(attention)
    if attention == "flex":
        torch.nn.functional.scaled_dot_product_attention.prepare(SEQ, device)
    ag = fp8_opts.get("all_gather", False)
    reshard = not fp8_opts.get("keep_gathered")  # keep_gathered: the bf16 weights stay gathered for backward
    parallel.parallelize(
        model,
        mixed_precision=device.type == "cuda",
        ac=ac,
        compile=compile and not whole,
        fp8=fp8,
        fp8_all_gather=ag,
        fp8_fast_accum=bool(fp8_opts.get("fast_accum")),
        reshard_after_forward=reshard,
    )
    if fp8_opts.get("cudnn"):  # SDPA's cuDNN attention instead of flash (run_row resets it)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    if fp8_opts.get("cdt") or fp8_opts.get("autotune"):  # Inductor's tuning searches (run_row resets them)
        import torch._inductor.config as inductor

        inductor.coordinate_descent_tuning, inductor.max_autotune = True, bool(fp8_opts.get("autotune"))
    materialize(model, device, seed=0)
    if whole and compile:  # one graph from the token ids to the final norm (FSDP's hooks may split it)
        model.hidden_states = torch.compile(model.hidden_states)
    if head != "flce":
        model.ops = dataclasses.replace(model.ops, linear_cross_entropy=full_logits_loss(cfg, head == "fp8", compile))
    return model, train_step(model, lambda x, y: model(x, targets=y), device, ag, optimizer)


def full_logits_loss(cfg, fp8: bool, compile: bool, emulate: bool = False):
    """The loss as torchtitan computes it: the whole (tokens, vocab) logits, then a compiled cross-entropy, instead
    of Liger's fused kernel that never holds them. With `fp8` the head's three GEMMs (logits, the input's gradient,
    the weight's) run in float8 with torchao's tensorwise scaling, the blocks' recipe (torchtitan keeps its head in
    bf16). It takes the weight it is called with, the tied weight FSDP has gathered for this step, so the float8
    matmul is called directly rather than through a Float8Linear module that would hold the sharded parameter."""
    import torch.nn.functional as F

    mm = None
    if fp8:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=emulate)
        layout = Float8Linear(cfg.dim, cfg.vocab_size, bias=False, config=config, device="meta")  # its GEMM configs
        mm = lambda h, w: matmul_with_hp_or_float8_args.apply(h, w.t(), layout.linear_mm_config, config)  # noqa: E731

    def loss(h, w, targets, reduction="mean", ignore_index=-100):
        logits = mm(h, w) if mm else h @ w.t()
        return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction=reduction)

    return torch.compile(loss) if compile else loss


def train_step(model, loss_fn, device, fp8_all_gather: bool = False, optimizer: str = "fused"):
    """One optimizer step as both sides take it: loss, backward, clip to 1.0, AdamW (fused on CUDA).

    `optimizer="compiled"`: the clip and a foreach AdamW traced by one torch.compile, so Inductor writes
    the update's kernels (and may fold the clip's scaling into them) instead of the fused AdamW kernel."""
    fused = device.type == "cuda" and optimizer == "fused"
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused, foreach=not fused
    )
    parallel.fp8_scale_hook(model, opt, on=fp8_all_gather)
    params = list(model.parameters())

    def update():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    if optimizer == "compiled":
        update = torch.compile(update)

    def step(x, y):
        loss = loss_fn(x, y)
        loss.backward()
        update()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def build_peer(cfg, device, ac: bool, liger: bool = True):
    import transformers

    if liger and device.type == "cuda":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    hf_cfg = {
        k: v
        for k, v in config_to_hf(cfg, torch.float32).items()
        if k not in ("architectures", "model_type", "torch_dtype")
    }
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg, attn_implementation="sdpa")).to(device)
    if ac:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.config.use_cache = False
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def loss_fn(x, y):
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            return hf(input_ids=x, labels=y, use_cache=False).loss  # labels are shifted inside

    return hf, train_step(hf, loss_fn, device)


def profile_steps(step, inp, tgt, steps: int = 2) -> dict:
    """GPU time per step by kernel family (bench/profile_step.py's table) over `steps` more steps of a timed row."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_step import kernel_times

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step(inp, tgt)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    per_kind, top = kernel_times(prof, steps)
    busy = sum(per_kind.values())
    kinds = dict(sorted(per_kind.items(), key=lambda kv: -kv[1]))
    kinds["idle (wall - GPU busy)"] = wall * 1e3 - busy
    ranked = sorted(top.items(), key=lambda kv: -kv[1])[:20]
    return {"wall_ms": wall * 1e3, "busy_ms": busy, "kinds_ms": kinds, "top_kernels_ms": dict(ranked)}


# Levers a row name can add to a base with "+" (e.g. `ours_fp8_tensorwise+flce0+kg`), as build_ours options.
LEVERS = {
    "flash": {"attention": "flash"},
    "cudnn": {"attention": "cudnn"},
    "flex": {"attention": "flex"},
    "flce0": {"flce_chunk_mem": 0},  # Liger's own chunk sizing (the default before issue 39)
    "flce4": {"flce_chunk_mem": 4},
    "flce8": {"flce_chunk_mem": 8},
    "foreach": {"optimizer": "foreach"},
    "copt": {"optimizer": "compiled"},  # clip + AdamW in one torch.compile (train_step)
    "whole": {"whole": True},  # the trunk compiled as one function instead of each block
    "kg": {"keep_gathered": True},
    "cdt": {"cdt": True},
    "fa": {"fast_accum": True},
    "logits": {"head": "logits"},  # the full logits and a compiled cross-entropy (torchtitan's loss), bf16
    "fp8logits": {"head": "fp8"},  # the same with the head's GEMMs in float8 (full_logits_loss)
}
BASES = {"ours_liger_compile": {}, "ours_fp8_tensorwise": {"fp8": "tensorwise"}}


def lever_builder(name: str, cfg, device, cuda: bool):
    """The builder of a `base+lever+...` row: BASES' options, then each lever's (a ValueError names a bad one)."""
    base, *levers = name.split("+")
    if base not in BASES or not all(lever in LEVERS for lever in levers):
        raise ValueError(f"unknown row {name!r}: a base of {sorted(BASES)} and levers of {sorted(LEVERS)}")
    keys = [key for lever in levers for key in LEVERS[lever]]
    if len(keys) != len(set(keys)):  # only the last would run, under a name that says both
        raise ValueError(f"{name!r}: two of its levers set the same option")
    if "head" in keys and "flce_chunk_mem" in keys:
        raise ValueError(f"{name!r}: +flce* sizes Liger's fused loss, which +logits / +fp8logits replace")
    opts = dict(BASES[base])
    for lever in levers:
        opts.update(LEVERS[lever])
    return lambda: build_ours(cfg, device, True, cuda, "none", **opts)


def run_row(name, builder, cfg, mb, seq, device, warmup, steps, profile: bool = False) -> dict:
    row = {"variant": name, "micro_batch": mb}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = step = None
    try:
        model, step = builder()
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, cfg.vocab_size, (mb, seq + 1), generator=g).to(device)
        inp, tgt = x[:, :-1], x[:, 1:]
        labels = x[:, :-1]  # the peer shifts labels itself: same targets as ours
        peer = name.startswith("peer")
        for _ in range(warmup):
            step(inp, labels if peer else tgt)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            loss = step(inp, labels if peer else tgt)
        float(loss)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / steps
        row.update(
            tokens_per_s=mb * seq / dt,
            step_s=dt,
            loss=float(loss),
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
        )
        if profile and device.type == "cuda":
            row["profile"] = profile_steps(step, inp, labels if peer else tgt)
    except torch.cuda.OutOfMemoryError:
        row.update(tokens_per_s=None, oom=True)
    except Exception as e:  # noqa: BLE001 - a lever that fails to build or run is a row that says why
        import traceback

        traceback.print_exc()
        row.update(tokens_per_s=None, error=f"{type(e).__name__}: {e}"[:400])
    finally:
        reset_attention()
        import torch._inductor.config as inductor

        inductor.coordinate_descent_tuning = inductor.max_autotune = False
        del model, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--vocab", type=int, default=100_352)  # 100k, padded to a multiple of 128
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--device", default="auto")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="tiny shapes, few rows: checks the script runs")
    p.add_argument("--only", default=None, help="comma-separated variant names to run")
    p.add_argument("--sizes", default=None, help="comma-separated micro-batch sizes to keep (default: all)")
    p.add_argument("--profile", default=None, help="NAME@MB,...: profile 2 more steps of these rows (kernel families)")
    p.add_argument("--out", default="bench/train_throughput.json")
    args = p.parse_args()
    global SEQ
    d = parallel.setup(args.device)
    device = d.device
    cfg = get_preset(args.preset, args.vocab)
    seq = SEQ = min(args.seq, cfg.max_seq_len)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    mbs = [1, 2] if args.quick else [1, 2, 4, 8, 14]
    big = [] if args.quick else [16, 20, 24, 28, 32]
    peer_liger = cuda
    one = [2] if args.quick else [14]
    plan = [  # (name, builder(mb) -> (model, step), micro-batches)
        ("peer_hf_liger", lambda: build_peer(cfg, device, ac=False, liger=peer_liger), mbs + big),
        ("peer_hf_liger_ac", lambda: build_peer(cfg, device, ac=True, liger=peer_liger), one),
        ("ours_torch", lambda: build_ours(cfg, device, False, False, "none"), [8, 14] if not args.quick else [2]),
        ("ours_liger", lambda: build_ours(cfg, device, True, False, "none"), [8, 14] if not args.quick else [2]),
        ("ours_liger_compile", lambda: build_ours(cfg, device, True, cuda, "none"), mbs + big),
        ("ours_ligerblocks_compile", lambda: build_ours(cfg, device, True, cuda, "none", liger_blocks=True), one),
        ("ours_torch_compile", lambda: build_ours(cfg, device, False, cuda, "none"), one),
        (
            "ours_liger_compile_ac_selective",
            lambda: build_ours(cfg, device, True, cuda, "selective"),
            [14, 20] if not args.quick else [2],
        ),
        (
            "ours_liger_compile_ac_full",
            lambda: build_ours(cfg, device, True, cuda, "full"),
            [14, 32] if not args.quick else [2],
        ),
    ]
    fp8_rows = [  # (recipe, ac, build_ours options, micro-batches): CUDA only (torchao, float8 tensor cores)
        ("tensorwise", "none", {}, [14, 28, 32]),
        ("rowwise", "none", {}, [14, 28]),
        ("tensorwise", "none", {"all_gather": True}, [14, 28]),
        ("tensorwise", "none", {"cudnn": True}, [14, 28]),
        ("tensorwise", "full", {}, [14, 32]),
        ("tensorwise", "full", {"all_gather": True}, [14]),
        ("tensorwise", "none", {"cdt": True}, [28, 32]),  # Inductor's coordinate-descent tuning of its kernels
        ("tensorwise", "none", {"keep_gathered": True}, [28, 32]),  # FSDP reshard_after_forward=False
        ("tensorwise", "none", {"cdt": True, "keep_gathered": True}, [28, 32]),
        ("tensorwise", "none", {"autotune": True}, [28]),  # + max-autotune (Triton GEMM templates tried)
        ("tensorwise", "none", {"fast_accum": True}, [14, 28, 32]),  # the backward's GEMMs accumulate fast too
        ("tensorwise", "none", {"fast_accum": True, "cdt": True, "keep_gathered": True}, [28, 32]),
        ("rowwise", "none", {"fast_accum": True}, [14, 28]),
        ("tensorwise", "full", {"fast_accum": True}, [14]),
    ]
    for recipe, ac, opts, sizes in fp8_rows if cuda else []:
        name = f"ours_fp8_{recipe}" + "".join(f"_{k}" for k in opts) + ("_ac_full" if ac == "full" else "")
        build = lambda r=recipe, a=ac, o=opts: build_ours(cfg, device, True, cuda, a, fp8=r, **o)  # noqa: E731
        plan.append((name, build, sizes))
    if args.only:  # the rows named, in the order named; `base+lever+...` names are built from LEVERS
        named = dict((r[0], r) for r in plan)
        plan = []
        for entry in args.only.split(","):
            name, _, only_sizes = entry.partition("@")  # NAME@14:28 keeps those micro-batches of the row
            if name in named:
                row = named[name]
            elif "+" in name:
                row = (name, lever_builder(name, cfg, device, cuda), mbs + big)
            else:
                continue
            if only_sizes:
                row = (row[0], row[1], [int(v) for v in only_sizes.split(":")])
            plan.append(row)
    if args.sizes:
        keep_sizes = {int(v) for v in args.sizes.split(",")}
        plan = [(n, b, [m for m in sizes if m in keep_sizes]) for n, b, sizes in plan]
    profile = {tuple(v.rsplit("@", 1)) for v in (args.profile or "").split(",") if "@" in v}
    peak_meas = matmul_peak(device)
    flops_tok = cfg.flops_per_token(seq)
    rows = []
    for name, builder, sizes in plan:
        for mb in sizes:
            prof = (name, str(mb)) in profile
            row = run_row(name, builder, cfg, mb, seq, device, args.warmup, args.steps, prof)
            if row.get("tokens_per_s"):
                row["mfu_989"] = 100 * flops_tok * row["tokens_per_s"] / PEAK
                row["mfu_measured"] = 100 * flops_tok * row["tokens_per_s"] / peak_meas if cuda else float("nan")
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row.get("oom"):
                break
    peer_best = max(
        (r["tokens_per_s"] for r in rows if r["variant"].startswith("peer") and r.get("tokens_per_s")), default=None
    )
    print(
        f"\n{'variant':34s} {'mb':>3s} {'tokens/s':>9s} {'vs peer':>7s} {'MFU%989':>7s} {'MFU%meas':>8s} "
        f"{'peak GiB':>8s}"
    )
    for r in rows:
        if not r.get("tokens_per_s"):
            print(f"{r['variant']:34s} {r['micro_batch']:3d} {'OOM' if r.get('oom') else 'error':>9s}")
            continue
        ratio = r["tokens_per_s"] / peer_best if peer_best else float("nan")
        print(
            f"{r['variant']:34s} {r['micro_batch']:3d} {r['tokens_per_s']:9.0f} {ratio:7.2f} "
            f"{r['mfu_989']:7.1f} {r['mfu_measured']:8.1f} {r['peak_gib']:8.1f}"
        )
    import transformers

    meta = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "matmul_peak_tflops": peak_meas / 1e12,
        "flops_per_token": flops_tok,
        "seq": seq,
        "vocab": cfg.vocab_size,
        "argv": sys.argv,
    }
    from importlib.metadata import PackageNotFoundError, version

    for lib in ("liger-kernel", "torchao"):
        try:
            meta[lib.replace("-", "_")] = version(lib)
        except PackageNotFoundError:
            pass
    print(json.dumps(meta))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    parallel.finish()
    parallel.teardown()


if __name__ == "__main__":
    main()
