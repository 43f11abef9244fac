"""GPU path: Liger's fused ops against our torch ops, and a sharded model with and without them.

Marked `gpu`: skipped without CUDA (see conftest.py); run on a GPU with `pytest -m gpu tests/test_gpu.py`.
"""

import os

import pytest
import torch

from minilm_az import kernels
from minilm_az.model import ModelConfig, materialize, meta_model

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def liger():
    pytest.importorskip("liger_kernel")
    ops = kernels.select_ops(DEV, liger=True)
    assert ops.name == "liger"
    return ops


@pytest.fixture(scope="module")
def group():
    from minilm_az import parallel

    os.environ.setdefault("MASTER_PORT", "29611")
    return parallel.setup("cuda")


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    out = fn(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum(
        (o.float() * torch.randn_like(o.float(), generator=torch.Generator(DEV).manual_seed(9))).sum() for o in outs
    )
    loss.backward()
    return outs, [x.grad for x in xs if x.grad is not None]


def _close(a, b, **tol):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.float(), y.float(), **(tol or BF16))


def test_liger_rms_norm_matches_torch(liger):
    x = torch.randn(4, 256, 2048, device=DEV, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(2048, device=DEV, dtype=torch.bfloat16)
    (a, ga), (b, gb) = (
        _grads(lambda x, w: liger.rms_norm(x, w, 1e-5), x, w),
        _grads(lambda x, w: kernels.rms_norm(x, w, 1e-5), x, w),
    )
    _close(a, b)
    _close(ga[:1], gb[:1])
    torch.testing.assert_close(ga[1].float(), gb[1].float(), atol=1.0, rtol=2e-2)  # a sum over 1024 rows


def test_liger_swiglu_matches_torch(liger):
    g = torch.randn(4, 256, 8192, device=DEV, dtype=torch.bfloat16)
    u = torch.randn(4, 256, 8192, device=DEV, dtype=torch.bfloat16)
    (a, ga), (b, gb) = _grads(liger.swiglu, g, u), _grads(kernels.swiglu, g, u)
    _close(a, b)
    _close(ga, gb)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_liger_flce_matches_chunked_torch(liger, reduction):
    h = torch.randn(2048, 2048, device=DEV, dtype=torch.bfloat16)
    w = 0.02 * torch.randn(100_352, 2048, device=DEV, dtype=torch.bfloat16)
    t = torch.randint(0, 100_352, (2048,), device=DEV)
    t[::7] = -100
    (a, ga), (b, gb) = (
        _grads(lambda h, w: liger.linear_cross_entropy(h, w, t, reduction=reduction), h, w),
        _grads(lambda h, w: kernels.chunked_linear_cross_entropy(h, w, t, reduction=reduction), h, w),
    )
    torch.testing.assert_close(a[0].float(), b[0].float(), rtol=1e-3, atol=1e-2)
    for x, y in zip(ga, gb, strict=True):  # relative to the gradient's own scale
        assert (x.float() - y.float()).norm() / y.float().norm() < 2e-2


TINY = ModelConfig(
    dim=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=768,
    vocab_size=4096,
    rope_theta=500000.0,
    rope_factor=32.0,
    tie_embeddings=True,
    max_seq_len=512,
)


def _sharded(ops, seed=0):
    from minilm_az import parallel

    m = meta_model(TINY, ops)
    parallel.parallelize(m, mixed_precision=True)
    return materialize(m, DEV, seed=seed)


def test_fsdp_liger_flce_tied_loss_and_head_grad_match_unfused(liger, group):
    x = torch.randint(0, TINY.vocab_size, (4, 257), device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    res = {}
    for ops in (liger, kernels.TORCH_OPS):
        m = _sharded(ops)
        assert m.lm_head.weight is m.model.embed_tokens.weight
        loss = m(x[:, :-1], targets=x[:, 1:])
        loss.backward()
        res[ops.name] = (float(loss), m.model.embed_tokens.weight.grad.full_tensor().float())
    (l1, g1), (l2, g2) = res["liger"], res["torch"]
    assert abs(l1 - l2) < 2e-2 * abs(l2)
    assert (g1 - g2).norm() / g2.norm() < 3e-2


def test_training_steps_with_and_without_liger_reach_same_loss(liger, group):
    x = torch.randint(0, TINY.vocab_size, (8, 129), device=DEV, generator=torch.Generator(DEV).manual_seed(2))
    x = torch.cat([x, x.flip(1)])  # something learnable: a few sequences, seen repeatedly
    curves = {}
    for ops in (liger, kernels.TORCH_OPS):
        m = _sharded(ops)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, fused=True)
        losses = []
        for _ in range(20):
            loss = m(x[:, :-1], targets=x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        curves[ops.name] = losses
    a, b = curves["liger"], curves["torch"]
    assert a[-1] < a[0] - 1.0  # it learns
    assert abs(a[-1] - b[-1]) < 0.05 * b[0]


def test_liger_rope_matches_torch(liger):
    # In the layout the model gives it: (B, T, H, hd) projections viewed as (B, H, T, hd); forward and grads.
    from minilm_az.model import rope_inv_freq

    t = torch.arange(512, device=DEV, dtype=torch.float32)
    f = torch.outer(t, rope_inv_freq(ModelConfig(), DEV))
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    q = torch.randn(2, 512, 32, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 512, 8, 64, device=DEV, dtype=torch.bfloat16)
    (a, ga), (b, gb) = (
        _grads(lambda q, k: liger.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin), q, k),
        _grads(lambda q, k: kernels.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin), q, k),
    )
    _close(a, b)
    _close(ga, gb)


def test_model_logits_with_liger_match_torch_ops(liger):
    from minilm_az.model import build_model

    x = torch.randint(0, TINY.vocab_size, (2, 200), device=DEV)
    ref = build_model(TINY, DEV, seed=3).to(torch.bfloat16)
    fused = build_model(TINY, DEV, seed=3, ops=liger).to(torch.bfloat16)
    with torch.no_grad():
        a, b = fused(x).float(), ref(x).float()
    assert (a - b).abs().max() < 0.1 * b.abs().max()


def test_liger_flce_chunk_sizing_changes_only_the_sum_order(monkeypatch):
    """kernels.FLCE_CHUNK_MEM (fewer, larger chunks of rows) gives Liger's loss and gradients at its own sizing."""
    pytest.importorskip("liger_kernel")
    h = torch.randn(8192, 2048, device=DEV, dtype=torch.bfloat16)
    w = 0.02 * torch.randn(100_352, 2048, device=DEV, dtype=torch.bfloat16)
    t = torch.randint(0, 100_352, (8192,), device=DEV)
    t[::5] = -100
    results = []
    for sizing in (0, 4):
        monkeypatch.setattr(kernels, "FLCE_CHUNK_MEM", sizing)
        ops = kernels.select_ops(DEV, liger=True)
        results.append(_grads(lambda h, w, ops=ops: ops.linear_cross_entropy(h, w, t), h, w))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-4)
    for x, y in zip(ga, gb, strict=True):
        assert (x.float() - y.float()).norm() / y.float().norm() < 1e-2


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpoint_saves_and_resumes_on_cuda(group, tmp_path, async_save):
    # On CUDA the training job's default group is NCCL, which takes no CPU tensors: the Checkpointer's own
    # collectives (error flags, barriers) must run on its gloo group in a sync save as in an async one.
    from minilm_az.checkpoint import open_checkpoints

    x = torch.randint(0, TINY.vocab_size, (4, 65), device=DEV, generator=torch.Generator(DEV).manual_seed(3))
    m = _sharded(kernels.TORCH_OPS)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    for _ in range(2):
        m(x[:, :-1], targets=x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    ck = open_checkpoints(str(tmp_path), group, keep=2, async_save=async_save)
    ck.save(2, m, opt, {"steps": 2})
    ck.close()
    m2 = _sharded(kernels.TORCH_OPS, seed=1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3, fused=True)
    ck2 = open_checkpoints(str(tmp_path), group, keep=2, async_save=async_save)
    step, _ = ck2.resume(m2, opt2, {}, {}, print, steps=10)
    ck2.close()
    assert step == 2
    for (name, a), b in zip(m.state_dict().items(), m2.state_dict().values(), strict=True):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), atol=0, rtol=0, msg=name)
