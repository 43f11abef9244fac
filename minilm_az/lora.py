"""LoRA: a trainable low-rank update beside a frozen Linear, injected by name, saved in PEFT's format.

`LoRALinear` keeps the frozen base matrix as its own `weight` (so the state-dict name stays Hugging
Face's `...q_proj.weight`) and adds `lora_A` (r, in; kaiming-uniform) and `lora_B` (out, r; zeros, so
the model is unchanged at step 0):

    y = x W^T + (alpha / r) · dropout(x) A^T B^T

In training with dropout on, the adapter branch saves x and a seed, not dropout(x) and its mask: backward
draws the mask again (`_DropoutLoRA`), so adapters sharing an input save it once.
Inject on the meta model before FSDP sharding (base and adapters then live in the same FSDP unit),
materialise, load the base weights, then `reset_lora_parameters`. Adapters are written as PEFT's
`adapter_config.json` + `adapter_model.safetensors` (keys `base_model.model.<module>.lora_A.weight`),
so `peft.PeftModel.from_pretrained` loads them over the exported base.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from minilm_az.hf import model_fingerprint, open_safetensors
from minilm_az.outputs import read_json, staged_output
from minilm_az.parallel import copy_into, full_tensor

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_STAGE = "lora-adapter"  # the stage name save_adapter records in the output marker
_BASE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "head_dim_override")


class AdapterError(ValueError):
    """An adapter directory that does not fit the model (other base, other rank) or is unreadable."""


class LoRALinear(nn.Module):
    """A frozen bias-free Linear plus `scaling · B A` on dropout of its input."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if base.bias is not None:
            raise ValueError("LoRALinear wraps bias-free Linear layers only (Llama has no biases)")
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.weight = base.weight
        self.weight.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, device=w.device, dtype=w.dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if w.device.type != "meta":
            self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self, seed: int | None = None) -> None:
        """A ~ kaiming-uniform(a=√5) as PEFT and nn.Linear do (bound 1/√in), B = 0.

        Drawn whole from a seeded generator and sharded afterwards, so every process count gives the same A.
        """
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        full = torch.empty(self.lora_A.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
        copy_into(self.lora_A, full.to(self.lora_A.device))
        self.lora_B.zero_()

    def delta_weight(self) -> torch.Tensor:
        """scaling · B A, the (out, in) update that `merge_lora` folds into the weight."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        p = getattr(self.lora_dropout, "p", 0.0)
        # fp32 adapters compute in the input's dtype (bf16 on GPU): a no-op under FSDP's mixed precision, which
        # already gathers them in bf16, and the only cast needed without FSDP (one process, bf16 base).
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        # Compiled (--compile), Inductor fuses the dropout into its neighbours and draws the mask in-graph;
        # _DropoutLoRA's seeded generator is eager-only (Dynamo cannot trace torch.Generator).
        if self.training and p > 0 and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return y + _DropoutLoRA.apply(x, a, b, p, self.scaling, draw_seed())
        return y + self.scaling * F.linear(F.linear(self.lora_dropout(x), a), b)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, alpha={self.alpha}"


def draw_seed() -> int:
    """A dropout seed from torch's default generator (so torch.manual_seed and checkpoint recompute replay it)."""
    return int(torch.randint(0, 2**62, (1,)))


def keep_mask(x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """Dropout's keep mask for `x` (True with probability 1 - p), the same every time for the same seed."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    return torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1 - p, generator=gen)


class _DropoutLoRA(torch.autograd.Function):
    """`scaling · B A dropout(x)`, saving x and a seed where autograd would save dropout(x) and its mask.

    Backward draws the mask again from the seed. The adapters beside one input (q/k/v, gate/up) then save
    that input once, and no adapter saves a mask: about a third less activation memory per token with
    dropout on (the default). Dropout itself is unchanged: a Bernoulli(1 - p) mask, kept values scaled by 1/(1-p).
    """

    @staticmethod
    def forward(ctx, x, a, b, p: float, scaling: float, seed: int):
        dropped = x * keep_mask(x, p, seed) * (1 / (1 - p))
        h = F.linear(dropped, a)  # (..., r): small, saved for B's gradient
        ctx.save_for_backward(x, a, b, h)
        ctx.p, ctx.scaling, ctx.seed = p, scaling, seed
        return F.linear(h, b) * scaling

    @staticmethod
    def backward(ctx, grad):
        x, a, b, h = ctx.saved_tensors
        keep = keep_mask(x, ctx.p, ctx.seed)
        g = (grad * ctx.scaling).flatten(0, -2)  # (N, out)
        gh = g @ b  # (N, r)
        dropped = (x * keep * (1 / (1 - ctx.p))).flatten(0, -2)
        ga = (gh.T @ dropped).to(a.dtype) if ctx.needs_input_grad[1] else None
        gb = (g.T @ h.flatten(0, -2)).to(b.dtype) if ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            gx = ((gh @ a).view(x.shape) * keep * (1 / (1 - ctx.p))).to(x.dtype)
        return gx, ga, gb, None, None, None


# ---------------------------------------------------------------- injection and parameter helpers


def apply_lora(
    model: nn.Module, r: int = 64, alpha: float = 28, dropout: float = 0.05, targets: Iterable[str] = TARGETS
) -> list[str]:
    """Replace every Linear whose attribute name is in `targets` by a LoRALinear; freeze the rest.

    Returns the replaced module names. Raises if a target matches nothing (a typo would otherwise train nothing).
    """
    targets = tuple(targets)
    if not targets:
        raise ValueError("apply_lora: no target modules given")
    replaced, hit = [], set()
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                # New modules start in train mode: follow the layer replaced, so an eval model stays eval.
                setattr(module, child_name, LoRALinear(child, r, alpha, dropout).train(child.training))
                replaced.append(f"{name}.{child_name}" if name else child_name)
                hit.add(child_name)
    unmatched = [t for t in targets if t not in hit]
    if unmatched:
        raise ValueError(f"apply_lora: target(s) {unmatched} match no nn.Linear in the model")
    mark_only_lora_trainable(model)
    model.lora_config = {"r": r, "alpha": alpha, "dropout": dropout, "targets": list(targets)}
    return replaced


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield name, m


def mark_only_lora_trainable(model: nn.Module) -> None:
    """requires_grad on lora_A/lora_B only; every other parameter is frozen."""
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (what the optimiser gets)."""
    return [p for n, p in model.named_parameters() if "lora_" in n]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; shared (tied) tensors counted once; works on meta models."""
    params = list(model.parameters())  # parameters() yields a tied (shared) tensor only once.
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Hold every frozen (non-adapter) parameter in `dtype`; adapters and buffers (RoPE) stay as they are.

    Call on the meta model before sharding: a frozen base needs no fp32 master copy (it gets no update), and
    in its compute dtype no per-step cast either. In place, so tied weights stay one Parameter.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.data = p.data.to(dtype)


def reset_lora_parameters(model: nn.Module, seed: int = 0) -> None:
    """Initialise every adapter (after `materialize`), each from its own seed, whatever the sharding."""
    for i, (_, m) in enumerate(lora_modules(model)):
        m.reset_lora_parameters(seed * 1_000_003 + i)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and put a plain nn.Linear back (for a merged HF export)."""
    for name, m in list(lora_modules(model)):
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        with torch.no_grad():
            lin = nn.Linear(m.in_features, m.out_features, bias=False, device=m.weight.device, dtype=m.weight.dtype)
            lin.weight.copy_(m.weight + m.delta_weight().to(m.weight.dtype))
        setattr(parent, name.rsplit(".", 1)[-1], lin)
    for p in model.parameters():
        p.requires_grad_(True)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


# ---------------------------------------------------------------- PEFT-format adapters


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT-named full adapter tensors. On a sharded model every rank must call it (it gathers)."""
    out = {}
    for name, m in lora_modules(model):
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = full_tensor(m.lora_A.detach())
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = full_tensor(m.lora_B.detach())
    return out


def _base_fingerprint(model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
    return {k: d[k] for k in _BASE_FIELDS if k in d}


def save_adapter(
    model: nn.Module, path: str, base_model_name_or_path: str | None = None, is_writer: bool = True, identity: str = ""
) -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors` (PEFT's format) into `path`, atomically.

    The base's shape and `identity` (by content) are in the safetensors metadata (PEFT's config takes no field of
    ours), so `load_adapter` can refuse another base.
    """
    lc = getattr(model, "lora_config", None)
    if lc is None:
        raise ValueError("save_adapter: the model has no LoRA adapters (call apply_lora first)")
    tensors = lora_state_dict(model)  # every rank: gathering is collective
    if not is_writer:
        return
    tensors = {k: v.to(device="cpu", dtype=torch.float32).contiguous() for k, v in tensors.items()}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lc["r"],
        "lora_alpha": lc["alpha"],
        "lora_dropout": lc["dropout"],
        "target_modules": sorted(lc["targets"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "revision": None,
    }
    # Staged inside `path` and moved in (the .json config after the weights), so `path` may be a mount point.
    with staged_output(path, stage=ADAPTER_STAGE) as tmp:
        save_file(
            tensors,
            os.path.join(tmp, WEIGHTS_FILE),
            metadata={"format": "pt", "minilm_az.base": json.dumps({**_base_fingerprint(model), "identity": identity})},
        )
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)


def read_adapter_config(path: str) -> dict:
    f = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(f):
        raise AdapterError(f"{path}: no {CONFIG_FILE} (expected a PEFT LoRA adapter directory)")
    cfg = read_json(f, AdapterError)
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{f}: peft_type is {cfg.get('peft_type')!r}, only LORA adapters are supported")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in cfg:
            raise AdapterError(f"{f}: missing field {key!r}")
    if isinstance(cfg["r"], bool) or not isinstance(cfg["r"], int) or cfg["r"] < 1:
        raise AdapterError(f"{f}: field 'r' must be an integer >= 1, got {cfg['r']!r}")
    alpha = cfg["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha == 0:
        raise AdapterError(f"{f}: field 'lora_alpha' must be a number other than 0 (a no-op), got {alpha!r}")
    targets = cfg["target_modules"]
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise AdapterError(f"{f}: field 'target_modules' must be a list of module names, got {targets!r}")
    if cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("bias", "none") != "none":
        raise AdapterError(f"{f}: DoRA, rsLoRA and LoRA biases are not supported")
    return cfg


def _check_base(model: nn.Module, meta: dict, wfile: str, base: str | None, trained_on: str | None) -> None:
    """Refuse an adapter whose metadata (PEFT's files have none) names another base: shape, or content given `base`."""
    if "minilm_az.base" not in meta:
        return
    try:
        theirs = json.loads(meta["minilm_az.base"])
    except json.JSONDecodeError:
        theirs = None
    if not isinstance(theirs, dict):
        raise AdapterError(f"{wfile}: corrupt 'minilm_az.base' metadata {meta['minilm_az.base'][:60]!r}")
    ours = _base_fingerprint(model)
    diff = {k: (theirs[k], ours[k]) for k in theirs if k in ours and theirs[k] != ours[k]}
    if diff:
        raise AdapterError(f"{wfile}: adapter was trained on a different base model (adapter vs this model: {diff})")
    if base and not theirs.get("identity"):  # saved before identities were recorded: its shape is all there is
        print(f"warning: {wfile} records no identity of its base; only the shape of {base} is checked", file=sys.stderr)
    elif base and theirs["identity"] != (now := model_fingerprint(base)):
        raise AdapterError(
            f"{os.path.dirname(wfile)}: adapter trained on {trained_on} ({str(theirs['identity'])[:12]}), "
            f"not on {base} ({now[:12]}): the same shape, other weights; apply it to the model it was trained on"
        )


def load_adapter(model: nn.Module, path: str, dropout: float | None = None, base: str | None = None) -> list[str]:
    """Inject LoRA as the adapter's config says and load its tensors; returns the module names.

    Raises AdapterError naming the file when the adapter was made for another base (given `base`, its dir: by content).
    """
    cfg = read_adapter_config(path)
    wfile = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wfile):
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
    targets = cfg["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    with open_safetensors(wfile, AdapterError, "retrain or re-download the adapter") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    _check_base(model, meta, wfile, base, cfg.get("base_model_name_or_path"))
    if not hasattr(model, "lora_config"):
        try:
            apply_lora(
                model,
                r=cfg["r"],
                alpha=cfg["lora_alpha"],
                dropout=cfg.get("lora_dropout", 0.0) if dropout is None else dropout,
                targets=targets,
            )
        except ValueError as e:
            raise AdapterError(f"{path}: {e} (adapter for a different architecture?)") from None
    modules = dict(lora_modules(model))
    seen = set()
    for key, t in tensors.items():
        mod, _, part = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
        if part not in ("lora_A", "lora_B") or not key.endswith(".weight"):
            raise AdapterError(f"{wfile}: unexpected tensor {key!r} (not a LoRA A/B weight)")
        if mod not in modules:
            raise AdapterError(
                f"{wfile}: tensor {key!r} targets module {mod!r}, which this model does not have "
                "(adapter for a different base model?)"
            )
        p = getattr(modules[mod], part)
        if tuple(t.shape) != tuple(p.shape):
            raise AdapterError(
                f"{wfile}: tensor {key!r} has shape {tuple(t.shape)}, this model expects "
                f"{tuple(p.shape)} (adapter for a different base model or rank?)"
            )
        if not torch.isfinite(t).all():  # A diverged fine-tune would reply with nothing, or crash.
            raise AdapterError(f"{wfile}: tensor {key!r} holds NaN or inf values; retrain the adapter")
        with torch.no_grad():
            copy_into(p, t.to(device=p.device, dtype=torch.float32))
        seen.add((mod, part))
    missing = [f"{m}.{part}" for m in modules for part in ("lora_A", "lora_B") if (m, part) not in seen]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise AdapterError(f"{wfile}: missing adapter tensor(s) {', '.join(missing[:4])}{more}")
    return list(modules)
