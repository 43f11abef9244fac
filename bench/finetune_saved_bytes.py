"""What a fine-tuning step keeps for backward: bytes autograd saves per forward, ours (packed, padded) vs peft.

    python bench/finetune_saved_bytes.py            # CPU, ~30 s
    python bench/finetune_saved_bytes.py --preset tiny --max-seq-len 1024 --out bench/results/finetune_saved_bytes.json

Activation memory is what autograd saves between a forward and its backward; the peak of a step is the
largest forward's. On the CPU, fp32, the same first step of the short set of bench/finetune_throughput.py
(16 demo conversations, micro-batch 4, LoRA r=8 on all 7 projections, dropout 0.05), every tensor passed
to `torch.autograd.graph.saved_tensors_hooks` is counted once by storage (weights excluded), labelled by the
innermost module running. Rows: ours packed (the default token budget, and capped at --cap-tokens), ours
padded, `transformers.LlamaForCausalLM` + `peft` padded and padding-free, and ours packed with the LoRA
dropout left to autograd (`F.dropout`, as before `lora._DropoutLoRA`). Prints per row the forwards, the largest
forward's tokens (padding included) and saved MiB, and the blocks' saved bytes per token per layer, split
into the LoRA branches and the rest; the loss head is apart (peer: full logits, ours: chunked).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import finetune_throughput as ft  # noqa: E402

import finetune  # noqa: E402  the root script
from minilm_az import lora  # noqa: E402
from minilm_az.chat import micro_batches  # noqa: E402
from minilm_az.hf import config_to_hf  # noqa: E402
from minilm_az.model import build_model, get_preset  # noqa: E402
from minilm_az.tokenizer import PAD, train_tokenizer  # noqa: E402

_running: list[str] = []  # labels of the modules whose forward is running, innermost last


def _label_modules(model) -> None:
    """Each module's label: its name inside a block (`self_attn.q_proj.lora_A`), or `head` outside the blocks."""
    for name, m in model.named_modules():
        inner = re.sub(r".*layers\.\d+\.?", "", name).replace(".default", "").replace(".base_layer", "")
        m._saved_label = (inner or "block") if re.search(r"layers\.\d+", name) else "head"


def _push(m, args):
    _running.append(getattr(m, "_saved_label", "head"))


def _pop(m, args, out):
    _running.pop()


class SavedBytes:
    """A pack hook that records each saved storage once: nbytes and the module that saved it."""

    def __init__(self, model):
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, tuple[int, str]] = {}

    def pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.weights and st.data_ptr() not in self.seen:
            self.seen[st.data_ptr()] = (st.nbytes(), _running[-1] if _running else "head")
        return t


def measure(model, forwards) -> list[dict]:
    """Forward + backward of each (kwargs, loss fn); what each forward saved, by label."""
    _label_modules(model)
    out = []
    for n_tokens, call in forwards:
        c = SavedBytes(model)
        hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(_push),
            torch.nn.modules.module.register_module_forward_hook(_pop),
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(c.pack, lambda t: t):
                loss = call()
        finally:
            for h in hooks:
                h.remove()
        loss.backward()
        by = collections.defaultdict(int)
        for nbytes, label in c.seen.values():
            by[label] += nbytes
        out.append({"tokens": n_tokens, "saved": dict(by)})
    return out


def ours(mcfg, batch, pad_id, row_len, budget, r, dropout, plain_dropout=False):
    model = build_model(mcfg, seed=0)
    lora.apply_lora(model, r=r, alpha=2 * r, dropout=dropout)
    lora.reset_lora_parameters(model, seed=0)
    mbs = micro_batches(batch, 0, 1, 4, pad_id, "cpu", row_len, budget)
    calls = [
        (x.numel(), lambda x=x, y=y, doc=doc: model(x, targets=y, reduction="sum", doc_ids=doc)) for x, y, doc in mbs
    ]
    if not plain_dropout:
        return measure(model, calls)
    real = lora._DropoutLoRA.apply
    lora._DropoutLoRA.apply = lambda x, a, b, p, s, seed: s * F.linear(F.linear(F.dropout(x, p, True), a), b)
    try:
        return measure(model, calls)
    finally:
        lora._DropoutLoRA.apply = real


def peer(mcfg, batch, pad_id, packed, r, dropout):
    import peft
    import transformers

    hf_cfg = {k: v for k, v in config_to_hf(mcfg, torch.float32).items() if k not in ("architectures", "model_type")}
    hf_cfg.pop("torch_dtype", None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg, attn_implementation="sdpa"))
    hf.config.use_cache = False
    lc = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=ft.TARGETS.split(","))
    model = peft.get_peft_model(hf, lc)
    kws = [ft.peer_inputs(batch[s : s + 4], packed, pad_id, torch.device("cpu")) for s in range(0, len(batch), 4)]
    return measure(model, [(kw["input_ids"].numel(), lambda kw=kw: model(**kw, use_cache=False).loss) for kw in kws])


def summary(name: str, res: list[dict], n_layers: int) -> dict:
    big = max(res, key=lambda f: sum(f["saved"].values()))
    blocks = {k: v for k, v in big["saved"].items() if k != "head"}
    lora_b = sum(v for k, v in blocks.items() if "lora" in k or k.endswith("_proj"))
    per = lambda v: v / big["tokens"] / n_layers  # noqa: E731
    return {
        "variant": name,
        "forwards": len(res),
        "largest_forward_tokens": big["tokens"],
        "largest_forward_saved_mib": sum(big["saved"].values()) / 2**20,
        "blocks_bytes_per_token_layer": per(sum(blocks.values())),
        "lora_bytes_per_token_layer": per(lora_b),
        "other_block_bytes_per_token_layer": per(sum(blocks.values()) - lora_b),
        "head_bytes_per_token": (sum(big["saved"].values()) - sum(blocks.values())) / big["tokens"],
        "by_label_bytes_per_token_layer": {k: per(v) for k, v in sorted(blocks.items(), key=lambda kv: -kv[1])},
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--cap-tokens", type=int, default=1024)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/finetune_saved_bytes.json"))
    args = p.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    lines = [ln.strip() for f in sorted(glob.glob(os.path.join(ROOT, "data/az/*.txt"))) for ln in open(f) if ln.strip()]
    tok = train_tokenizer(lines, 8000, progress=False)
    pad_id = tok.token_to_id(PAD)
    mcfg = get_preset(args.preset, -(-tok.get_vocab_size() // 64) * 64)
    short = ft.make_sets(tok, args.max_seq_len, 0)["short"]
    batch = [short[i] for i in finetune.batch_order(len(short), 0, 16, 0)]
    L, r, dp = args.max_seq_len, args.lora_r, args.dropout
    rows = [
        summary("ours_packed", ours(mcfg, batch, pad_id, L, None, r, dp), mcfg.n_layers),
        summary("ours_packed_capped", ours(mcfg, batch, pad_id, L, args.cap_tokens, r, dp), mcfg.n_layers),
        summary("ours_padded", ours(mcfg, batch, pad_id, None, None, r, dp), mcfg.n_layers),
        summary("peer_padded", peer(mcfg, batch, pad_id, False, r, dp), mcfg.n_layers),
        summary("peer_packed", peer(mcfg, batch, pad_id, True, r, dp), mcfg.n_layers),
        summary("ours_packed_autograd_dropout", ours(mcfg, batch, pad_id, L, None, r, dp, True), mcfg.n_layers),
    ]
    print(
        f"preset {args.preset} (dim {mcfg.dim}, ffn {mcfg.ffn_dim}, {mcfg.n_layers} layers), fp32, r={r}, dropout {dp}"
    )
    print(
        f"{'variant':30s} {'fwd':>3s} {'max tok':>7s} {'MiB':>7s} {'blocks B/tok/layer':>18s} {'lora':>6s} {'rest':>6s}"
    )
    for w in rows:
        print(
            f"{w['variant']:30s} {w['forwards']:3d} {w['largest_forward_tokens']:7d} "
            f"{w['largest_forward_saved_mib']:7.2f} {w['blocks_bytes_per_token_layer']:18.0f} "
            f"{w['lora_bytes_per_token_layer']:6.0f} {w['other_block_bytes_per_token_layer']:6.0f}"
        )
    for w in rows:
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(w["by_label_bytes_per_token_layer"].items())[:6])
        print(f"  {w['variant']}: {top}")
    meta = {
        "preset": args.preset,
        "dim": mcfg.dim,
        "ffn_dim": mcfg.ffn_dim,
        "n_layers": mcfg.n_layers,
        "argv": sys.argv,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": {**meta, "lora_r": r, "dropout": dp, "torch": torch.__version__}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
