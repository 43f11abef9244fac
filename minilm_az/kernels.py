"""The four ops a fused kernel can replace: RMSNorm, RoPE, SwiGLU, linear + cross-entropy.

`Ops` bundles one implementation of each; `select_ops(device, liger)` picks once, at model build.
On CUDA with liger-kernel installed that is Liger's Triton kernels; everywhere else plain torch,
with a chunked linear cross-entropy so the CPU path does not hold (N, vocab) fp32 logits either.
liger-kernel imports on a CPU-only machine but its kernels fail there, so the choice is by device,
never by catching errors.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 and cast back before the weight, as HF's LlamaRMSNorm does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q (B, H, T, hd), k (B, Hkv, T, hd); cos/sin (T, hd), or (B, T, hd) for packed rows, HF's rotate-half layout."""
    if cos.dim() == 3:  # one position per (row, token): broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _ChunkedLinearCE(torch.autograd.Function):
    """Cross-entropy of `h @ w.T` computed `chunk` rows at a time, gradients formed in the forward.

    Only one (chunk, vocab) block of logits exists at a time; backward just scales the stored
    gradients, so the (N, vocab) logits and their softmax are never held (the trick of Liger's FLCE).
    """

    @staticmethod
    def forward(ctx, h, w, targets, ignore_index: int, reduction: str, chunk: int, grad_enabled: bool):
        n = h.shape[0]
        valid = targets != ignore_index
        n_valid = int(valid.sum())
        # Grad mode is always off inside forward, so the caller says whether gradients are wanted at all.
        # Each gradient only if wanted: a frozen head (LoRA) needs no (vocab, dim) fp32 buffer, nor its matmuls.
        need_h, need_w = (grad_enabled and ctx.needs_input_grad[i] for i in (0, 1))
        need_grad = need_h or need_w
        scale = 1.0 / max(n_valid, 1) if reduction == "mean" else 1.0
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        for s in range(0, n, chunk):
            hc, tc = h[s : s + chunk], targets[s : s + chunk]
            logits = (hc @ w.T).float()  # (c, V)
            safe_t = tc.clamp_min(0)
            picked = logits.gather(1, safe_t[:, None]).squeeze(1)
            # The log-sum-exp and the softmax from one exp, in place: on a CPU each (c, V) temporary costs as
            # much as its arithmetic (torch.logsumexp then torch.softmax took 4x as long at a 128k vocabulary).
            peak = logits.amax(dim=-1, keepdim=True)
            exps = logits.sub_(peak).exp_()
            sums = exps.sum(dim=-1, keepdim=True)
            nll = (peak + sums.log()).squeeze(1) - picked
            vc = tc != ignore_index
            total += torch.where(vc, nll, 0.0).sum()
            if need_grad:
                g = exps.div_(sums)  # the softmax
                g[torch.arange(len(tc), device=g.device), safe_t] -= 1.0
                g *= (vc.float() * scale)[:, None]
                g = g.to(h.dtype)
                if need_h:
                    grad_h[s : s + chunk] = g @ w
                if need_w:
                    grad_w += (g.T @ hc).float()
        ctx.save_for_backward(grad_h, grad_w.to(w.dtype) if need_w else None)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out if grad_h is not None else None
        gw = grad_w * grad_out if grad_w is not None else None
        return gh, gw, None, None, None, None, None


def chunked_linear_cross_entropy(
    h: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "mean",
    ignore_index: int = -100,
    chunk: int = 2048,
) -> torch.Tensor:
    """CE(h @ w.T, targets) as F.cross_entropy gives it (same default ignore_index): the mean, or the sum (nats)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return _ChunkedLinearCE.apply(h, w, targets, ignore_index, reduction, chunk, torch.is_grad_enabled())


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    apply_rope: Callable
    swiglu: Callable
    linear_cross_entropy: Callable


TORCH_OPS = Ops("torch", rms_norm, apply_rope, swiglu, chunked_linear_cross_entropy)


# Liger's fused cross-entropy walks the tokens in chunks and adds each chunk's head gradient into an fp32
# (vocab, dim) buffer, which a GEMM epilogue reads and writes whole: at vocab 100k that is 0.8 GB of traffic a
# chunk. Liger's own sizing (1) gives 28 chunks of 2,048 rows at 57k tokens; 4 gives 7 chunks of 8,192 rows,
# a 1.6 GB bf16 logits block at a time, and measured 0.9 % (bf16) and 1.1 % (float8) more tokens/s at the 1B
# shape, mb 28, for 0.4 GiB more peak (bench/RESULTS.md, issue 39). The number of chunks changes only the
# order of the fp32 sums. 0 leaves Liger's own sizing.
FLCE_CHUNK_MEM = 4


def _takes(fn: Callable, name: str = "chunk_mem_const") -> bool:
    import inspect

    return name in inspect.signature(fn).parameters


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _liger_ops() -> Ops:
    from liger_kernel.transformers.functional import (
        liger_fused_linear_cross_entropy,
        liger_rms_norm,
        liger_rope,
        liger_swiglu,
    )

    def l_rms_norm(x, weight, eps):
        return liger_rms_norm(x, weight, eps, 0.0, "llama", False)

    def l_rope(q, k, cos, sin):
        # Liger takes q (B, H, T, hd), k (B, Hkv, T, hd) and (1 or B, T, hd) cos/sin in HF's layout.
        if cos.dim() == 2:
            cos, sin = cos[None], sin[None]
        return liger_rope(q, k, cos, sin)

    # Liger sizes its chunks of rows so that one chunk's logits hold about `chunk_mem_const` times the input's
    # bytes; older releases have no such argument and keep their fixed sizing.
    sizing = {"chunk_mem_const": FLCE_CHUNK_MEM} if FLCE_CHUNK_MEM and _takes(liger_fused_linear_cross_entropy) else {}

    def l_flce(h, w, targets, reduction="mean", ignore_index=-100):
        # fp32 accumulation of the head gradient: bf16 sums over 100k rows x many chunks drift.
        return liger_fused_linear_cross_entropy(
            h, w, targets, ignore_index=ignore_index, reduction=reduction, accum_dtype=torch.float32, **sizing
        )

    return Ops("liger", l_rms_norm, l_rope, liger_swiglu, l_flce)


def select_ops(device: str | torch.device, liger: bool = True, compile: bool = False) -> Ops:
    """Liger's kernels on CUDA when requested and installed, else plain torch.

    With `compile`, the blocks' norm/RoPE/SwiGLU stay torch ops (Inductor fuses them with their
    neighbours, which opaque Triton kernels prevent) and only Liger's fused linear cross-entropy is kept.
    """
    if liger and torch.device(device).type == "cuda" and liger_available():
        ops = _liger_ops()
        if compile:
            return Ops("torch+liger_flce", rms_norm, apply_rope, swiglu, ops.linear_cross_entropy)
        return ops
    return TORCH_OPS
