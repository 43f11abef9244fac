"""Our Llama (the Llama 3.x family), in the order data flows: config, norm, RoPE, attention, MLP, block, model.

Module names follow Hugging Face's `LlamaForCausalLM` (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`,
`model.norm`, `lm_head`, ...) so checkpoints and PEFT adapters load with no renaming table. There is no
distributed code here: `parallel.py` shards the model from outside. Build on the meta device and call
`init_weights()` after materialising, so FSDP can shard before any memory is allocated.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import flex_attention as flex

from minilm_az.kernels import TORCH_OPS, Ops
from minilm_az.parallel import copy_into

IGNORE = -100  # the target the loss skips: padding, and every chat token that is not the assistant's

# The attention mask of one forward, built once in `Llama.hidden_states` and shared by every layer. None is
# plain causal attention, a boolean tensor (True: attend) goes to SDPA, a flex BlockMask goes to flex attention.
Mask = torch.Tensor | flex.BlockMask | None


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 8192
    vocab_size: int = 128256
    rope_theta: float = 500000.0
    # Llama-3 RoPE frequency scaling; rope_factor None means plain RoPE.
    rope_factor: float | None = 32.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq_len: int = 131072
    head_dim_override: int | None = None  # HF `head_dim` when it is not dim // n_heads

    def __post_init__(self):
        if self.dim % self.n_heads and self.head_dim_override is None:
            raise ValueError(f"ModelConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:  # RoPE rotates pairs of dimensions.
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} is odd (RoPE needs pairs of dimensions)")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    def with_vocab(self, vocab_size: int) -> ModelConfig:
        return replace(self, vocab_size=vocab_size)

    def num_params(self, embedding: bool = True) -> int:
        """Parameter count computed from the shape (no model needed); tied head counted once."""
        hd, kv = self.head_dim, self.n_kv_heads
        attn = self.dim * self.n_heads * hd * 2 + self.dim * kv * hd * 2
        block = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        n = self.n_layers * block + self.dim
        if embedding:
            n += self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N_non-embedding + 6·dim·vocab (head) + 12·layers·dim·seq (attention)."""
        attention = 12 * self.n_layers * self.dim * seq_len
        return 6 * self.num_params(embedding=False) + 6 * self.dim * self.vocab_size + attention

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # A few million parameters: CPU tests and the demo (vocab is set from the tokenizer).
    "tiny": ModelConfig(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        vocab_size=8192,
        rope_theta=10000.0,
        rope_factor=None,
        max_seq_len=1024,
    ),
    "llama3.2-1b": ModelConfig(),
}


def get_preset(name: str, vocab_size: int | None = None) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    cfg = PRESETS[name]
    return cfg.with_vocab(vocab_size) if vocab_size else cfg


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim/2,), with Llama-3's smooth low/high-frequency rescaling."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
    if cfg.rope_factor is None:
        return inv_freq.float()
    factor, old = cfg.rope_factor, cfg.rope_original_max_seq_len
    lo, hi = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, blended, scaled).float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: Ops = TORCH_OPS):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class KVCache:
    """Per-layer key/value buffers for generation: (B, n_kv_heads, max_len, head_dim)."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor):
        T = k.shape[2]
        if pos + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked for {pos + T}")
        self.k[layer][:, :, pos : pos + T] = k
        self.v[layer][:, :, pos : pos + T] = v
        return self.k[layer][:, :, : pos + T], self.v[layer][:, :, : pos + T]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: Ops = TORCH_OPS):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.layer_idx, self.ops = layer_idx, ops
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, mask: Mask = None, cache: KVCache | None = None, pos: int = 0):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.ops.apply_rope(q, k, cos, sin)
        if cache is not None:  # the new tokens attend to the cached ones too
            k, v = cache.update(self.layer_idx, pos, k, v)
        gqa = self.n_kv_heads != self.n_heads
        if isinstance(mask, flex.BlockMask):
            y = flex_attention()(q, k, v, block_mask=mask, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS):
        super().__init__()
        self.ops = ops
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(self.ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops: Ops = TORCH_OPS):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.self_attn = Attention(cfg, layer_idx, ops)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(self, x, cos, sin, mask: Mask = None, cache: KVCache | None = None, pos: int = 0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `LlamaModel`: embeddings, blocks, final norm (the `model.` prefix of every weight)."""

    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        # Keys "0".."N-1" give each weight Hugging Face's name (`model.layers.3.mlp...`), as a ModuleList would.
        # parallel.py and the tests find a block by its key, so a switch to a ModuleList must change them too.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, ops) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops = TORCH_OPS):
        super().__init__()
        self.config, self.ops = cfg, ops
        self.model = Backbone(cfg, ops)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def tie_weights(self) -> None:
        # `to_empty()` makes new Parameters one by one, which unties a shared weight: call again after it.
        if self.config.tie_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = 0) -> None:
        """Random init after `to_empty()`: N(0, std) matrices, output projections scaled by depth, unit norms.

        Each parameter is drawn whole from its own generator (seed + its index) and a sharded (DTensor)
        parameter keeps only its shard, so the weights are the same whatever the number of processes.
        """
        self.inv_freq.copy_(rope_inv_freq(self.config, device=self.inv_freq.device))
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for i, (name, p) in enumerate(self.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            gen = torch.Generator(device=p.device).manual_seed((seed or 0) * 1_000_003 + i)
            full = torch.empty(p.shape, device=p.device, dtype=torch.float32).normal_(0.0, s, generator=gen)
            copy_into(p, full)  # the same numbers on any world size: each rank keeps its shard

    def rope(self, T: int, pos: int = 0, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, head_dim) for positions pos..pos+T-1, or (B, T, head_dim) for given (B, T) positions."""
        if positions is None:
            t = torch.arange(pos, pos + T, device=self.inv_freq.device, dtype=torch.float32)
        else:
            t = positions.to(torch.float32)
        freqs = t[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)  # HF's rotate-half layout
        return emb.cos(), emb.sin()

    def hidden_states(
        self, input_ids: torch.Tensor, cache: KVCache | None = None, pos: int = 0, doc_ids: torch.Tensor | None = None
    ):
        """Final-norm hidden states (B, T, dim). With `doc_ids` (B, T), packed rows: see `forward`."""
        T = input_ids.shape[1]
        if pos + T > self.config.max_seq_len:
            raise ValueError(f"sequence of {pos + T} tokens exceeds max_seq_len={self.config.max_seq_len}")
        if doc_ids is not None and cache is not None:
            raise ValueError("packed rows (doc_ids) are for training; generation takes one conversation a row")
        x = self.model.embed_tokens(input_ids)
        if doc_ids is not None:  # Packed rows. A token sees only its own document, whose positions start at 0.
            cos, sin = self.rope(T, positions=doc_positions(doc_ids))
            mask = doc_mask(doc_ids)
        elif cache is not None and pos > 0:  # Generation. A new token sees the cached ones and itself.
            cos, sin = self.rope(T, pos)
            mask = torch.ones(T, pos + T, dtype=torch.bool, device=x.device).tril(diagonal=pos)
        else:  # One sequence a row. SDPA's causal attention needs no mask.
            cos, sin = self.rope(T, pos)
            mask = None
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.model.layers.values():
            x = block(x, cos, sin, mask, cache, pos)
        return self.model.norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        pos: int = 0,
        reduction: str = "mean",
        doc_ids: torch.Tensor | None = None,
    ):
        """Logits (B, T, V), or the loss when `targets` (already shifted, IGNORE skipped) is given.

        The loss goes through `ops.linear_cross_entropy`, which never materialises the full logits.
        `reduction="sum"` returns the summed NLL in nats (for bits-per-byte). `doc_ids` (B, T) makes each
        row a pack of documents: a token attends only to earlier tokens of its own document (same id, one
        contiguous run), and RoPE positions restart at 0 at each document's first token. Generation passes
        a `cache` instead, and `pos`, the position of the first token of `input_ids`.
        """
        h = self.hidden_states(input_ids, cache, pos, doc_ids)
        if targets is None:
            return self.lm_head(h)
        return self.ops.linear_cross_entropy(
            h.flatten(0, 1), self.lm_head.weight, targets.flatten(), reduction=reduction, ignore_index=IGNORE
        )


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids, each document one contiguous run -> each token's position inside its document."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(dim=1).values


def doc_mask(doc_ids: torch.Tensor):
    """The block-diagonal causal mask of packed rows: query q sees key k iff same document and k <= q.

    On CUDA a flex-attention BlockMask (blocks wholly outside every document are skipped, so a row costs
    what its documents cost); elsewhere a (B, 1, T, T) boolean mask for SDPA.
    """
    if not doc_ids.is_cuda:
        return doc_mask_dense(doc_ids)

    def same_doc_causal(b, h, q, k):
        return (doc_ids[b, q] == doc_ids[b, k]) & (k <= q)

    B, T = doc_ids.shape
    return flex.create_block_mask(same_doc_causal, B, None, T, T, device=doc_ids.device)


def doc_mask_dense(doc_ids: torch.Tensor) -> torch.Tensor:
    """The same mask as a (B, 1, T, T) boolean tensor (True: attend), what SDPA takes."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


@functools.cache
def flex_attention():
    """flex_attention compiled once (uncompiled it runs a slow reference that materialises the scores)."""
    return torch.compile(flex.flex_attention)


def meta_model(cfg: ModelConfig, ops: Ops = TORCH_OPS) -> Llama:
    """The model with no storage: shard it (parallel.py) or `materialize` it."""
    with torch.device("meta"):
        return Llama(cfg, ops)


def materialize(model: Llama, device: str | torch.device, seed: int | None = 0, init: bool = True) -> Llama:
    """Allocate a meta (or sharded-meta) model on `device`; random init unless weights will be loaded."""
    model.to_empty(device=device)
    model.tie_weights()
    if init:
        model.init_weights(seed=seed)
    else:
        model.inv_freq.copy_(rope_inv_freq(model.config, device=model.inv_freq.device))
    return model


def build_model(
    cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = 0, init: bool = True, ops: Ops = TORCH_OPS
) -> Llama:
    """Build on the meta device, then materialise on `device` (randomly initialised unless `init=False`)."""
    return materialize(meta_model(cfg, ops), device, seed, init)
