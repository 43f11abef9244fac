"""Packed fine-tuning steps: the same loss and LoRA gradients as padded ones, conversations that never see
each other, RoPE positions that restart, truncation as before, and the choice logged."""

import json
import os
import sys

import prefork  # tests/prefork.py (pytest puts this folder on sys.path too)
import pytest
import torch

import finetune  # the root script (pytest puts the repo root on sys.path)
from minilm_az import lora, parallel
from minilm_az.chat import encode_chat, micro_batches, pack_rows
from minilm_az.config import FinetuneConfig
from minilm_az.hf import save_pretrained
from minilm_az.logs import MetricLogger
from minilm_az.model import IGNORE, build_model, doc_positions, get_preset
from minilm_az.prep.chat_data import read_chat_jsonl
from minilm_az.tokenizer import PAD, copy_tokenizer_files, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "data/chat/az_chat.jsonl")
CPU = parallel.Process(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return load_tokenizer(small_tokenizer_dir)


@pytest.fixture(scope="module")
def convs(tok):
    """The first 16 demo conversations, encoded (with every assistant turn trained)."""
    return [encode_chat(m, tok, max_len=128) for m in read_chat_jsonl(TRAIN)[0][:16]]


def _lora_model(vocab: int, device="cpu"):
    """A tiny random Llama with r=4 adapters whose B is non-zero, so A gets a gradient too."""
    model = build_model(get_preset("tiny", vocab_size=vocab), device=device, seed=0)
    lora.apply_lora(model, r=4, alpha=8, dropout=0.0)
    lora.reset_lora_parameters(model, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in lora.lora_modules(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.02)
    return model


def test_packed_step_has_the_padded_loss_and_lora_gradients(tok, convs):
    cfg = FinetuneConfig(micro_batch=2, lora_r=4, lora_dropout=0.0, grad_clip=0.0)
    pad_id = tok.token_to_id(PAD)
    results = {}
    # padded; packed into rows of max_len, into longer rows, and into forwards of at most 128 tokens
    for row_len, budget in ((None, None), (128, None), (300, None), (128, 128)):
        model = _lora_model(tok.get_vocab_size())
        params = lora.lora_parameters(model)
        cfg.max_tokens_per_forward = budget
        loss, gn, n_tokens = finetune.train_step(model, convs, params, cfg, CPU, pad_id, row_len)
        results[row_len, budget] = loss, gn, n_tokens, [p.grad.clone() for p in params]
    n_micro = len(micro_batches(convs, 0, 1, 2, pad_id, "cpu", 128))
    assert 1 < n_micro < len(convs) // 2  # packing did pack, into more than one micro-batch
    loss0, gn0, tokens0, grads0 = results[None, None]
    for key in ((128, None), (300, None), (128, 128)):
        loss, gn, n_tokens, grads = results[key]
        assert n_tokens == tokens0
        assert abs(loss - loss0) <= 1e-5 * max(1.0, abs(loss0)), (row_len, loss, loss0)
        assert abs(gn - gn0) <= 1e-5 * max(1.0, gn0)
        for a, b in zip(grads, grads0):
            assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
    assert all(g.abs().max() > 0 for g in grads0)  # every adapter's A and B trained


def test_a_conversation_never_attends_to_another(tok, convs):
    model = _lora_model(tok.get_vocab_size()).eval()
    (a, _), (b, _) = convs[0], convs[1]
    na, nb = len(a) - 1, len(b) - 1
    row_len = na + nb + 7  # a, then b, then 7 padding tokens
    x = torch.full((1, row_len), tok.token_to_id(PAD))
    x[0, :na], x[0, na : na + nb] = torch.tensor(a[:-1]), torch.tensor(b[:-1])
    doc = torch.tensor([[0] * na + [1] * nb + [2] * 7])
    with torch.no_grad():
        packed = model(x, doc_ids=doc)
        alone_a, alone_b = model(torch.tensor([a[:-1]])), model(torch.tensor([b[:-1]]))
        x2 = x.clone()
        x2[0, :na] = torch.randint(0, tok.get_vocab_size(), (na,), generator=torch.Generator().manual_seed(2))
        perturbed = model(x2, doc_ids=doc)
    # b's logits do not move when a's tokens change, and are b's own logits when alone (so are a's)
    assert torch.equal(perturbed[0, na : na + nb], packed[0, na : na + nb])
    assert (perturbed[0, :na] - packed[0, :na]).abs().max() > 1e-3
    assert (packed[0, na : na + nb] - alone_b[0]).abs().max() <= 1e-5
    assert (packed[0, :na] - alone_a[0]).abs().max() <= 1e-5
    assert torch.isfinite(packed).all()  # the padding sees itself: no empty softmax row, no NaN


def test_rope_positions_restart_at_each_conversation():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 1, 1]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 1]])
    assert torch.equal(doc_positions(doc), want)
    model = build_model(get_preset("tiny", vocab_size=64), seed=0)
    seen = []
    rope = model.rope
    model.rope = lambda T, pos=0, positions=None: seen.append(positions) or rope(T, pos, positions)
    with torch.no_grad():
        model(torch.zeros_like(doc), doc_ids=doc)
    assert torch.equal(seen[0], want)
    cos, _ = rope(9, positions=want)
    assert torch.equal(cos[0, 3], rope(9)[0][0])  # the second conversation's first token is at position 0


def test_rows_hold_whole_conversations_and_every_rank_runs_as_many_micro_batches(tok, convs):
    lengths = [len(ids) - 1 for ids, _ in convs]
    rows = pack_rows(lengths, 200)
    assert sorted(i for r in rows for i in r) == list(range(len(convs)))
    assert all(sum(lengths[i] for i in r) <= 200 for r in rows)
    with pytest.raises(ValueError, match="does not fit a row"):
        pack_rows([201], 200)
    pad_id = tok.token_to_id(PAD)
    # 3 rows of one long conversation each, then one row of the 3 short ones; one row a micro-batch
    long = (list(range(3, 203)), [IGNORE] * 100 + list(range(103, 203)))
    short = (list(range(3, 64)), [IGNORE] * 30 + list(range(33, 64)))
    step = [long, short, long, short, long, short]
    one = micro_batches(step, 0, 1, 1, pad_id, "cpu", 201)
    two = [micro_batches(step, r, 2, 1, pad_id, "cpu", 201) for r in (0, 1)]
    assert len(one) == 4 and all(torch.equal(one[k][0], two[k % 2][k // 2][0]) for k in range(4))  # same cut
    three = [micro_batches(step, r, 3, 1, pad_id, "cpu", 201) for r in (0, 1, 2)]
    assert [len(m) for m in three] == [2, 2, 2]  # ranks 1 and 2 hold 1 row each but run 2 micro-batches
    assert (three[1][1][1] == IGNORE).all() and (three[2][1][1] == IGNORE).all()  # the extra ones train nothing
    targets = sum(int((y != IGNORE).sum()) for mbs in three for _, y, _ in mbs)
    assert targets == sum(sum(t != IGNORE for t in lab[1:]) for _, lab in step)


def test_a_token_budget_caps_each_forward_and_keeps_every_conversation(tok, convs):
    pad_id, lengths = tok.token_to_id(PAD), [len(ids) - 1 for ids, _ in convs]
    real = sum(lengths)
    default = micro_batches(convs, 0, 1, 4, pad_id, "cpu", 128)  # budget 4 x 128
    assert sum(x.numel() for x, _, _ in default) < real * 1.15  # even rows, cut to the longest: little padding
    for budget in (128, 256, 300, 1000):
        mbs = micro_batches(convs, 0, 1, 4, pad_id, "cpu", 128, max_tokens=budget)
        assert all(x.numel() <= max(budget, max(lengths)) for x, _, _ in mbs)
        assert sum(int((x != pad_id).sum()) for x, _, _ in mbs) == real  # every token of every conversation
        assert sum(int((y != IGNORE).sum()) for _, y, _ in mbs) == sum(
            sum(t != IGNORE for t in lab[1:]) for _, lab in convs
        )
    assert len(micro_batches(convs, 0, 1, 4, pad_id, "cpu", 128, max_tokens=128)) >= real / 128
    assert len(micro_batches(convs, 0, 1, 4, pad_id, "cpu", 1024, max_tokens=4096)) == 1  # one forward when it fits


@pytest.fixture(scope="module")
def base(tmp_path_factory, small_tokenizer_dir):
    d = str(tmp_path_factory.mktemp("base"))
    copy_tokenizer_files(small_tokenizer_dir, d)
    save_pretrained(build_model(get_preset("tiny", vocab_size=load_tokenizer(d).get_vocab_size()), seed=0), d)
    return d


def _finetune(base, out, *extra):
    args = ["--model", base, "--data", TRAIN, "--val-fraction", "0", "--out", out, "--steps", "3"]
    args += ["--global-batch", "8", "--micro-batch", "2", "--lora-r", "4", "--lora-dropout", "0", "--lr", "3e-3"]
    args += ["--warmup", "1", "--log-every", "1", "--max-seq-len", "64", "--device", "cpu", *extra]
    r = prefork.run([sys.executable, "finetune.py", *args], ROOT, prefork.PLAIN_ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_finetune_packs_by_default_logs_it_and_trains_like_padded(base, tmp_path):
    """--max-seq-len 64 truncates many demo conversations: each still lands whole (as truncated) in a row."""
    packed, padded = _finetune(base, str(tmp_path / "p")), _finetune(base, str(tmp_path / "u"), "--packing", "false")
    config = {r["kind"]: r for r in packed}["config"]
    assert config["packing"] is True and {r["kind"]: r for r in padded}["config"]["packing"] is False
    data = [{k: v for k, v in r.items() if k != "time"} for run in (packed, padded) for r in run if r["kind"] == "data"]
    assert data[0] == data[1] and data[0]["max_len"] == 64 and data[0]["dropped_truncated"] > 0
    losses = [[r["loss"] for r in run if r["kind"] == "finetune"] for run in (packed, padded)]
    assert len(losses[0]) == 3
    assert max(abs(a - b) for a, b in zip(*losses)) <= 1e-5


@pytest.mark.gpu
def test_flex_attention_on_cuda_matches_the_cpu_mask(tok, convs):
    """The CUDA path (a flex BlockMask) against the CPU path (an SDPA boolean mask), fp32 both."""
    x, y, doc = micro_batches(convs[:5], 0, 1, 2, 0, "cpu", 256)[0]
    model = _lora_model(tok.get_vocab_size()).eval()
    with torch.no_grad():
        want = model(x, doc_ids=doc)
        got = model.cuda()(x.cuda(), doc_ids=doc.cuda()).cpu()
    real = y != IGNORE
    assert (got[real] - want[real]).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.gpu
def test_finetune_on_one_gpu_has_no_fsdp_and_follows_the_cpu_run(base, tmp_path):
    """One CUDA process: no FSDP (a bf16 base, fp32 adapters computing in bf16); packed, its losses follow the
    fp32 CPU run's to bf16 rounding and the adapter it writes is fp32."""
    from safetensors.torch import load_file

    gpu, cpu = _finetune(base, str(tmp_path / "g"), "--device", "cuda"), _finetune(base, str(tmp_path / "c"))
    losses = [[r["loss"] for r in run if r["kind"] == "finetune"] for run in (gpu, cpu)]
    assert len(losses[0]) == 3
    assert max(abs(a - b) / b for a, b in zip(*losses)) <= 0.02, losses
    weights = load_file(str(tmp_path / "g" / "adapter_model.safetensors"))
    assert weights and {w.dtype for w in weights.values()} == {torch.float32}

    fc = FinetuneConfig(model=base, lora_r=4, lora_dropout=0.05, device="cuda", compile=False, micro_batch=2)
    model = finetune.build(fc, parallel.Process(0, 1, 0, torch.device("cuda")), MetricLogger(None))
    kinds = {("lora" if "lora_" in n else "base", p.dtype, type(p.data).__name__) for n, p in model.named_parameters()}
    assert kinds == {("lora", torch.float32, "Tensor"), ("base", torch.bfloat16, "Tensor")}
