"""Per-step communication of the 1B recipe on 2 hosts x 8 GPUs: FSDP2 over 16 ranks against HSDP (2 x 8).

    .venv/bin/python bench/comms_model.py                      # the recipe: 1B, seq 2048, global batch 224
    .venv/bin/python bench/comms_model.py --json /tmp/comms.json

A model, not a measurement: nothing runs on a GPU. The parameters come from a meta-device model of the preset
(`minilm_az.model.meta_model`, vocab as the preset has it unless --vocab), grouped as `parallel.apply_fsdp`
wraps them: one FSDP group per block, the root holding the (tied) embedding and the final norm.

Per micro-batch, FSDP2 all-gathers each group's bf16 parameters (MixedPrecisionPolicy param_dtype=bf16) in
the forward and again in the backward, except the last block (reshard_after_forward=False keeps it). The root
is resharded too: apply_fsdp passes reshard_after_forward=True explicitly, and FSDP2 honours that for the root
(counted on CPU with torch 2.13 by wrapping torch.distributed's collectives around a 2-process gloo run of the
tiny preset: 4 blocks give 9 all-gathers per micro-batch, 2 of them the root's; on a 2 x 2 mesh also 5
reduce-scatters and 5 all-reduces each the size of a reduce-scatter's output).
At each gradient sync, every group with trainable parameters reduce-scatters fp32 gradients
(reduce_dtype=fp32); HSDP then all-reduces each GPU's fp32 gradient shard with its peer on the other host.
Without sync-once, every micro-batch syncs; with `set_requires_gradient_sync(False)` on the non-final ones,
only the last does (counted the same way: no reduce-scatter in the first of 2 micro-batches).

Volumes (ring algorithms; S is the whole unsharded tensor's bytes, n the ranks in the group):
- all-gather and reduce-scatter: each rank sends (n-1)/n * S and receives as much;
- all-reduce: each rank sends 2(n-1)/n * S and receives as much.
FSDP over 16 ranks on 2 hosts, assumed: a flat ring (NCCL's algorithm for all-gather / reduce-scatter between
nodes; its tree algorithm serves all-reduce only). It crosses the node boundary on 2 of its 16 edges, one each
way, so each host sends (n-1)/n * S over EFA per collective, and 7 of each host's 8 ring edges are NVLink. With
several NCCL channels the crossing GPU differs per channel, so the EFA load spreads over the host's NICs: it is
modelled per host. No algorithm can send less than (m-1)/m * S per host for m hosts (each host must receive the
other host's half): the "bound" column, which a hierarchical all-gather would reach. The ring sends ~2x that.
HSDP's all-gather and reduce-scatter stay inside a host (8 ranks, NVLink only); its all-reduce (2 ranks, one
per host, S/8 each) is all EFA: 2(2-1)/2 * S/8 per GPU, which is also the bound for an all-reduce.

Times: NVLink at half its quoted bidirectional rate each way, EFA per host each way, both at nominal rates
(--efa-efficiency scales EFA down for a sensitivity; NCCL's achieved rates are unmeasured). The communication
floor is the busier link: max(NVLink bytes per GPU / NVLink rate, EFA bytes per host / EFA rate). Some of it
cannot hide under compute: each micro-batch's first all-gathers (root, block 0), the root's re-gather at the
start of its backward, and at a sync the last reduce-scatters (+ all-reduces) of block 0 and the root. So the
overlapped step floor is max(compute + exposed, communication floor); without overlap it is compute plus every
collective in turn. Compute is a tokens/s per GPU for a phase-2 step at vocab 100,352 (p5: the recipe's H100
figure; p4d: bench/RESULTS.md's H200 row scaled by the A100/H100 bf16 peaks), scaled by the model's training
FLOPs per token at this vocab (and in phase 1, without the frozen blocks' weight-gradient GEMMs).
Prints the tables; --json writes every row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minilm_az.model import ModelConfig, get_preset, meta_model  # noqa: E402

GB = 1e9
BF16, FP32 = 2, 4
PHASE1_TRAINABLE = ("model.embed_tokens.weight", "lm_head.weight")  # as train.py freezes the backbone

# bench/RESULTS.md, "Training throughput on one H200", run A, ours_liger at micro-batch 14 (train.py's default
# path: Liger, no --compile): 68,907 tokens/s, i.e. 0.416 s a step. Measured at vocab 100,352.
H200_TOKENS_S = 68_907
MEASURED_VOCAB = 100_352
# The recipe's own H100 figure with Liger, quoted and not measured here. It is above our H200 row, so it gives
# the shorter compute step: the harder case for hiding communication.
H100_TOKENS_S = 78_319
# No A100 was measured: the H200 row scaled by the dense bf16 tensor-core peaks (312 vs 989 TFLOP/s).
A100_TOKENS_S = H200_TOKENS_S * 312 / 989


@dataclass(frozen=True)
class Platform:
    name: str
    gpu: str
    efa_gbit_s: float  # per host, each way
    nvlink_gbyte_s: float  # per GPU, both directions together (the quoted figure)
    tokens_s: float  # compute rate per GPU, a phase-2 step at vocab 100,352
    compute_source: str
    efa_efficiency: float = 1.0  # the share of the nominal EFA rate achieved (unmeasured; 1 gives the floor)

    @property
    def efa_bytes_s(self) -> float:
        return self.efa_gbit_s / 8 * GB * self.efa_efficiency

    @property
    def nvlink_bytes_s(self) -> float:
        return self.nvlink_gbyte_s / 2 * GB  # ring traffic is one way per link at a time


PLATFORMS = (
    Platform("p4d", "A100", 400, 600, A100_TOKENS_S, "H200 row x 312/989 (estimate)"),
    Platform("p5", "H100", 3200, 900, H100_TOKENS_S, "recipe's H100 figure"),
)


@dataclass(frozen=True)
class Group:
    """One `fully_shard` unit: its parameters' shapes, which of them train, and whether the backward re-gathers."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    trainable: tuple[bool, ...]
    regather: bool

    def numel(self, n: int, trainable_only: bool = False) -> int:
        # FSDP2 shards dim 0 and pads it to a multiple of the group size: the padding travels too.
        return sum(
            math.ceil(s[0] / n) * n * math.prod(s[1:])
            for s, t in zip(self.shapes, self.trainable)
            if t or not trainable_only
        )


def fsdp_groups(cfg: ModelConfig, phase: int) -> list[Group]:
    """The groups apply_fsdp makes, root first (it is gathered first), from a meta model's parameters."""
    model = meta_model(cfg)
    by_group: dict[str, list] = {}
    for name, p in model.named_parameters():  # a tied head is the embedding's Parameter, listed once
        parts = name.split(".")
        key = parts[2] if name.startswith("model.layers.") else "root"
        train = phase == 2 or name in PHASE1_TRAINABLE
        by_group.setdefault(key, []).append((tuple(p.shape), train))
    last = str(cfg.n_layers - 1)
    return [
        Group(
            key if key == "root" else f"block {key}",
            tuple(s for s, _ in ps),
            tuple(t for _, t in ps),
            regather=key != last,
        )
        for key, ps in by_group.items()
    ]


@dataclass(frozen=True)
class Layout:
    name: str
    shard: int  # ranks a parameter is sharded over
    replicate: int  # copies of each shard (HSDP), one per host


@dataclass
class Traffic:
    """Bytes one way: per GPU over NVLink, per host over EFA (ring), and the least any algorithm sends per host."""

    nvlink: float = 0.0
    efa: float = 0.0
    efa_bound: float = 0.0

    def __add__(self, o: Traffic) -> Traffic:
        return Traffic(self.nvlink + o.nvlink, self.efa + o.efa, self.efa_bound + o.efa_bound)

    def seconds(self, pf: Platform) -> float:
        """Both links run at once, so a collective takes as long as its busier link (ring EFA bytes)."""
        return max(self.nvlink / pf.nvlink_bytes_s, self.efa / pf.efa_bytes_s)


def ring(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather or reduce-scatter of `size` bytes over n ranks."""
    return (n - 1) / n * size


def gather_or_scatter(size: float, layout: Layout, gpus: int) -> Traffic:
    per_gpu = ring(size, layout.shard)
    if layout.shard <= gpus:  # the whole ring inside one host
        return Traffic(nvlink=per_gpu)
    hosts = layout.shard // gpus
    # A flat ring leaves each host by one of its `gpus` edges: that edge carries what every edge carries.
    return Traffic(nvlink=per_gpu * (gpus - 1) / gpus, efa=per_gpu, efa_bound=ring(size, hosts))


def all_reduce(shard_bytes: float, layout: Layout, gpus: int) -> Traffic:
    """HSDP's all-reduce of each GPU's gradient shard with its peers on the other hosts (all EFA)."""
    r = layout.replicate
    per_host = gpus * 2 * (r - 1) / r * shard_bytes
    return Traffic(efa=per_host, efa_bound=per_host)  # 2(r-1)/r of a host's data is also the least possible


@dataclass(frozen=True)
class Batch:
    micro_batch: int
    accum: int
    sync_once: bool

    @property
    def label(self) -> str:
        if self.accum == 1:
            return f"{self.micro_batch}x1"
        return f"{self.micro_batch}x{self.accum} {'sync once' if self.sync_once else 'sync each'}"


def step_collectives(groups: list[Group], layout: Layout, batch: Batch, gpus: int) -> list[tuple[Traffic, bool]]:
    """Every collective of one optimizer step as (traffic, exposed): all-gathers, then a sync's reductions."""
    out: list[tuple[Traffic, bool]] = []
    root, first = groups[0], groups[1]
    for k in range(batch.accum):
        for g in groups:
            ag = gather_or_scatter(g.numel(layout.shard) * BF16, layout, gpus)
            # Forward start (root, block 0) and the root's re-gather before any backward compute are exposed.
            out.append((ag, g is root or g is first))
            if g.regather:
                out.append((ag, g is root))
        if batch.sync_once and k < batch.accum - 1:
            continue
        for g in groups:
            grad = g.numel(layout.shard, trainable_only=True) * FP32
            if not grad:
                continue
            tail = g is root or g is first  # the last reductions of the backward: nothing left to hide them
            out.append((gather_or_scatter(grad, layout, gpus), tail))
            if layout.replicate > 1:
                out.append((all_reduce(grad / layout.shard, layout, gpus), tail))
    return out


def total(items: list) -> Traffic:
    return sum((t for t, _ in items), Traffic())


def flops_per_token(cfg: ModelConfig, seq: int, phase: int) -> float:
    """model.py's training FLOPs per token; phase 1 skips the frozen blocks' weight-gradient GEMMs (2N of 6N)."""
    full = cfg.flops_per_token(seq)
    return full if phase == 2 else full - 2 * cfg.num_params(embedding=False)


def compute_seconds(cfg: ModelConfig, seq: int, tokens: int, phase: int, pf: Platform) -> float:
    # The measured rate is for a phase-2 step at vocab 100,352: scale by FLOPs to this vocab and phase.
    measured = cfg.with_vocab(MEASURED_VOCAB).flops_per_token(seq)
    return tokens / pf.tokens_s * flops_per_token(cfg, seq, phase) / measured


def sizes(groups: list[Group], lay: Layout, batch: Batch) -> dict[str, float]:
    """The summed S of the step's collectives: whole-tensor bytes; the all-reduce's S is one GPU's shard."""
    syncs = 1 if batch.sync_once else batch.accum
    ag = sum(g.numel(lay.shard) * BF16 * batch.accum * (1 + g.regather) for g in groups)
    rs = sum(g.numel(lay.shard, trainable_only=True) * FP32 * syncs for g in groups)
    ar = rs / lay.shard if lay.replicate > 1 else 0.0
    return {"ag_bf16_gb": ag / GB, "rs_fp32_gb": rs / GB, "ar_fp32_gb": ar / GB}


def times(every: list, cfg: ModelConfig, seq: int, tokens: int, phase: int, pf: Platform) -> dict:
    t = total(every)
    nvlink_s, efa_s, efa_bound_s = t.nvlink / pf.nvlink_bytes_s, t.efa / pf.efa_bytes_s, t.efa_bound / pf.efa_bytes_s
    comm_s = max(nvlink_s, efa_s)
    exposed_s = sum(c.seconds(pf) for c, exposed in every if exposed)
    serial_s = sum(c.seconds(pf) for c, _ in every)
    compute_s = compute_seconds(cfg, seq, tokens, phase, pf)
    ms = {
        "nvlink": nvlink_s,
        "efa": efa_s,
        "efa_bound": efa_bound_s,
        "comm": comm_s,
        "exposed": exposed_s,
        "compute": compute_s,
        "step_no_overlap": compute_s + serial_s,
        "step_overlap": max(compute_s + exposed_s, comm_s),
    }
    return {f"{k}_ms": 1e3 * v for k, v in ms.items()} | {"comm_over_compute": comm_s / compute_s}


def batches(share: int, micro_batches: list[int]) -> list[Batch]:
    out = [Batch(share, 1, True)]
    for mb in micro_batches:
        if mb < share and share % mb == 0:
            out += [Batch(mb, share // mb, False), Batch(mb, share // mb, True)]
    return out


def model_rows(cfg: ModelConfig, args, platforms: list[Platform]) -> tuple[list[dict], list[dict]]:
    gpus, world = args.gpus_per_node, args.gpus_per_node * args.nodes
    layouts = (Layout("fsdp", world, 1), Layout("hsdp", gpus, args.nodes))
    share = args.global_batch // world
    tokens = share * args.seq_len
    byte_rows, time_rows = [], []
    for phase in (2, 1):
        groups = fsdp_groups(cfg, phase)
        for batch in batches(share, args.micro_batches):
            for lay in layouts:
                every = step_collectives(groups, lay, batch, gpus)
                t = total(every)
                key = {"phase": phase, "batch": batch.label, "layout": lay.name}
                byte_rows.append(
                    key
                    | sizes(groups, lay, batch)
                    | {"nvlink_gb_per_gpu": t.nvlink / GB, "efa_gb_per_host": t.efa / GB}
                    | {"efa_bound_gb_per_host": t.efa_bound / GB, "collectives": len(every)}
                )
                for pf in platforms:
                    time_rows.append({"platform": pf.name} | key | times(every, cfg, args.seq_len, tokens, phase, pf))
    return byte_rows, time_rows


def print_bytes(rows: list[dict]) -> None:
    print("GB per optimizer step (1 GB = 1e9 B). S: the summed whole-tensor bytes of each kind of collective")
    print("(all-reduce: one GPU's gradient shard). Sent per GPU / host one way; received is the same.")
    print("ring all-gather/reduce-scatter: (n-1)/n*S per rank; all-reduce: 2(n-1)/n*S per rank")
    print(
        f"{'phase':>5} {'batch':<16} {'layout':<6} {'AG S bf16':>9} {'RS S fp32':>9} {'AR S fp32':>9} "
        f"{'NVLink/GPU':>10} {'EFA/host ring':>13} {'EFA/host bound':>14}"
    )
    for r in rows:
        print(
            f"{r['phase']:>5} {r['batch']:<16} {r['layout']:<6} {r['ag_bf16_gb']:>9.2f} {r['rs_fp32_gb']:>9.2f} "
            f"{r['ar_fp32_gb']:>9.2f} {r['nvlink_gb_per_gpu']:>10.2f} {r['efa_gb_per_host']:>13.2f} "
            f"{r['efa_bound_gb_per_host']:>14.2f}"
        )


def print_times(rows: list[dict], platforms: list[Platform]) -> None:
    print("\nms per optimizer step at the link rates below. comm = max(NVLink, EFA ring); overlapped step =")
    print("max(compute + exposed, comm); no overlap = compute + every collective in turn.")
    for pf in platforms:
        print(
            f"{pf.name}: {pf.gpu}, EFA {pf.efa_gbit_s:,.0f} Gb/s per host x {pf.efa_efficiency:g} "
            f"({pf.efa_bytes_s / GB:.0f} GB/s each way), "
            f"NVLink {pf.nvlink_gbyte_s:.0f} GB/s per GPU ({pf.nvlink_bytes_s / GB:.0f} GB/s each way), "
            f"compute {pf.tokens_s:,.0f} tokens/s/GPU ({pf.compute_source})"
        )
    print(
        f"{'pf':<4} {'phase':>5} {'batch':<16} {'layout':<6} {'NVLink':>7} {'EFA ring':>8} {'EFA bound':>9} "
        f"{'comm':>7} {'exposed':>7} {'compute':>7} {'no overlap':>10} {'overlapped':>10} {'comm/compute':>12}"
    )
    for r in rows:
        print(
            f"{r['platform']:<4} {r['phase']:>5} {r['batch']:<16} {r['layout']:<6} {r['nvlink_ms']:>7.1f} "
            f"{r['efa_ms']:>8.1f} {r['efa_bound_ms']:>9.1f} {r['comm_ms']:>7.1f} {r['exposed_ms']:>7.1f} "
            f"{r['compute_ms']:>7.1f} {r['step_no_overlap_ms']:>10.1f} {r['step_overlap_ms']:>10.1f} "
            f"{r['comm_over_compute']:>12.2f}"
        )


def verdicts(time_rows: list[dict], byte_rows: list[dict], platforms: list[Platform], batch: str) -> list[str]:
    """Per platform and phase, at the recipe's batch: the layout with the lower overlapped floor (a tie within 1%)."""
    out = []
    for pf in platforms:
        for phase in (1, 2):
            r = {
                x["layout"]: x for x in time_rows if (x["platform"], x["phase"], x["batch"]) == (pf.name, phase, batch)
            }
            b = {x["layout"]: x for x in byte_rows if (x["phase"], x["batch"]) == (phase, batch)}
            f, h = r["fsdp"]["step_overlap_ms"], r["hsdp"]["step_overlap_ms"]
            best = "tie within 1%" if abs(f - h) < 0.01 * min(f, h) else ("fsdp" if f < h else "hsdp")
            out.append(
                f"{pf.name} phase {phase}, {batch}: {best} (overlapped floor fsdp {f:.0f} / hsdp {h:.0f} ms; "
                f"no overlap {r['fsdp']['step_no_overlap_ms']:.0f} / {r['hsdp']['step_no_overlap_ms']:.0f} ms; "
                f"comm/compute {r['fsdp']['comm_over_compute']:.2f} / {r['hsdp']['comm_over_compute']:.2f}; "
                f"EFA GB/host {b['fsdp']['efa_gb_per_host']:.2f} / {b['hsdp']['efa_gb_per_host']:.2f})"
            )
    return out


def memory_notes(cfg: ModelConfig, args) -> list[str]:
    """What HSDP and sync-once cost in memory: the price of the bytes they save."""
    n, world = cfg.num_params(), args.gpus_per_node * args.nodes
    train = {2: n, 1: sum(g.numel(1, True) for g in fsdp_groups(cfg, 1))}
    notes = []
    for phase in (2, 1):
        # fp32 parameters for all, fp32 gradient and AdamW's two moments for the trainable ones.
        state = n * FP32 + train[phase] * 3 * FP32
        notes.append(
            f"phase {phase}: {train[phase]:,} trainable of {n:,} parameters; sharded state per GPU "
            f"{state / world / GB:.2f} GB (fsdp) vs {state / args.gpus_per_node / GB:.2f} GB (hsdp); "
            f"sync-once holds unsharded fp32 gradients: {train[phase] * FP32 / GB:.2f} GB per GPU"
        )
    return notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--vocab", type=int, default=None, help="embedding rows (default: the preset's)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=224)
    ap.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[7])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument(
        "--efa-efficiency", type=float, default=1.0, help="share of the nominal EFA rate achieved (sensitivity)"
    )
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()

    cfg = get_preset(args.preset, args.vocab)
    share = args.global_batch // (args.nodes * args.gpus_per_node)
    print(
        f"{args.preset}: {cfg.num_params():,} parameters (tied head: {cfg.tie_embeddings}), vocab {cfg.vocab_size:,},"
        f" {cfg.n_layers} blocks; seq {args.seq_len}, global batch {args.global_batch} = {share} per GPU on "
        f"{args.nodes} x {args.gpus_per_node} GPUs"
    )
    measured = cfg.with_vocab(MEASURED_VOCAB).flops_per_token(args.seq_len)
    f2, f1 = (flops_per_token(cfg, args.seq_len, phase) for phase in (2, 1))
    print(
        f"compute scaled by training FLOPs per token: {f2 / 1e9:.2f} G (phase 2), {f1 / 1e9:.2f} G (phase 1) vs "
        f"{measured / 1e9:.2f} G where the rates were measured (vocab {MEASURED_VOCAB:,}): "
        f"x{f2 / measured:.3f}, x{f1 / measured:.3f}"
    )
    platforms = [replace(pf, efa_efficiency=args.efa_efficiency) for pf in PLATFORMS]
    byte_rows, time_rows = model_rows(cfg, args, platforms)
    print_bytes(byte_rows)
    print_times(time_rows, platforms)
    lines = verdicts(time_rows, byte_rows, platforms, f"{share}x1") + memory_notes(cfg, args)
    print()
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "bytes": byte_rows, "times": time_rows, "notes": lines}, f, indent=2)


if __name__ == "__main__":
    main()
