"""Everything distributed, in one place: process group, activation checkpointing, compile, FSDP2.

The model file applies none of it (it borrows `copy_into` only, so its init is the same on any world
size). The order follows torchtitan: build on meta, float8 linears, activation checkpointing, then per-block
`torch.compile`, then `fully_shard` each block and the root, then materialise (allocate only the local
shards) and load or initialise the weights.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from minilm_az.logs import print_error

T = TypeVar("T")

# A collective that waits longer than this fails the job (on NCCL torch's watchdog kills the rank): the only sign of a
# peer that froze or was cut off with its connections open. Three minutes end the job within five on the other hosts
# (the replay's host took 4 s more to exit; a minute is left for it) and exceed a healthy job's longest wait: under two
# for the slowest rank's part of a 14 GB synchronous checkpoint (1B, fp32 Adam) at 128 MiB/s (compile, eval: seconds).
COLLECTIVE_TIMEOUT_S = 180


@dataclass(frozen=True)
class Process:
    """This process's place in the job: its rank among all processes, how many there are, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_number(name: str, default: float, kind: type = int, lo: float = 0, hi: float = 2**31 - 1) -> float:
    """The environment variable `name` as a number up to `hi` (a C int: torch and OpenMP take no more): an int >=
    `lo`, or a float > `lo`; `default` when unset. Anything else, empty too, is one ValueError naming the variable."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw.strip())
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not lo <= value <= hi or (kind is float and value == lo):
        what = f"a whole number from {lo:g} to {hi:,}" if kind is int else f"a number of seconds > {lo:g}, <= {hi:,}"
        raise ValueError(f"environment variable {name}={raw!r} is not {what}; set it so, or unset it")
    return value


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA device is visible")
    return torch.device(device)


def setup(device: str = "auto", timeout_s: float | None = None) -> Process:
    """Join the torchrun process group (or make a one-process group), bind this rank's GPU.

    Every group of the job fails a collective that waits longer than `timeout_s` (default: the environment's
    MINILM_AZ_COLLECTIVE_TIMEOUT_S, else COLLECTIVE_TIMEOUT_S), and a rank that loses a peer says so in one line.
    A group is made even for one process, so training is one code path: FSDP2 over a mesh of any size.
    """
    # Every variable is read and checked before anything starts, so a bad one is a line naming it.
    world = env_number("WORLD_SIZE", 1, lo=1)
    rank, local_rank = env_number("RANK", 0), env_number("LOCAL_RANK", 0)
    if rank >= world:
        raise ValueError(f"environment variable RANK={rank} is not below WORLD_SIZE={world}")
    threads = env_number("OMP_NUM_THREADS", 1, lo=1)  # "4,2" (OpenMP's nested form) is not one count
    seconds = timeout_s or env_number("MINILM_AZ_COLLECTIVE_TIMEOUT_S", COLLECTIVE_TIMEOUT_S, float)
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(threads)  # 1 thread/process is fastest here
    if not dist.is_initialized():
        timeout = timedelta(seconds=seconds)
        # Groups made later with no timeout (HSDP's mesh, the Checkpointer's) take these, not 30 min (gloo), 10 (NCCL).
        dist.distributed_c10d.default_pg_timeout = dist.distributed_c10d.default_pg_nccl_timeout = timeout
        # A lone process (no torchrun) rendezvous in memory: no port to pick, nothing to collide with.
        store = dist.HashStore() if world == 1 and "MASTER_ADDR" not in os.environ else None
        backend, device_id = ("nccl", dev) if dev.type == "cuda" else ("gloo", None)
        dist.init_process_group(backend, rank=rank, world_size=world, store=store, timeout=timeout, device_id=device_id)
        sys.excepthook = functools.partial(_lost_peer, sys.excepthook, rank, seconds) if world > 1 else sys.excepthook
    return Process(rank, world, local_rank, dev)


def _lost_peer(previous: Callable, rank: int, seconds: float, kind: type, error: BaseException, tb) -> None:
    """sys.excepthook: one line, and no traceback, when the ranks' communication failed (a peer froze or ended);
    any other error keeps its traceback (a bug, which its frames locate)."""
    if not (isinstance(error, dist.DistError) or "/gloo/" in str(error)):
        previous(kind, error, tb)
    else:
        raw = str(error).strip().rsplit("\n", 1)[-1].split("] ", 1)[-1].split(". ")[0]  # no gloo source path or advice
        host = os.environ.get("SM_CURRENT_HOST") or socket.gethostname()
        lost = f"lost another rank, whose host ended or stopped answering for {seconds:g} s (see the hosts' logs)"
        print_error(os.path.basename(sys.argv[0]), f"rank {rank} on {host} {lost}: {raw}")


def finish() -> None:
    """After the last collective, on success only (a rank that raised must not wait here for the others).

    No rank may reach interpreter shutdown while gloo's worker threads still hold a finished collective:
    dropping its tensors needs the GIL, and a thread that asks for it during shutdown aborts the process
    (SIGABRT after an export that succeeded: a failed SageMaker job, ~1 run in 6 on CPU). The barrier and the
    pause (the GIL released) let every worker let go first.
    """
    if dist.is_initialized():
        dist.barrier()
        time.sleep(0.1)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(0.1)  # also after an error, which skips finish(): gloo's threads let go before shutdown


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (every rank must call this); a plain tensor as it is."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    # With float8 all-gather a weight is torchao's wrapper subclass: the plain high-precision tensor is inside.
    return t._tensor if type(t).__name__ == "WeightWithDynamicFloat8CastTensor" else t


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into a parameter: into this rank's shard when the parameter is a DTensor."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements)
        param.to_local().copy_(full.to_local())
    else:
        param.copy_(full)


def split_batch(global_batch: int, world_size: int, micro_batch: int | None, largest: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for `global_batch` sequences over `world_size` processes.

    Without an explicit micro-batch, the largest divisor of each process's share up to `largest` is taken,
    so the defaults work on 1, 2, 4, 8 or 16 GPUs alike.
    """
    if global_batch % world_size:
        raise ValueError(f"--global-batch {global_batch} does not split over {world_size} processes")
    share = global_batch // world_size
    if micro_batch is None:
        micro_batch = max(m for m in range(1, min(largest, share) + 1) if share % m == 0)
    if share % micro_batch:
        raise ValueError(
            f"--global-batch {global_batch} is not a multiple of --micro-batch x processes "
            f"= {micro_batch} x {world_size}"
        )
    return micro_batch, share // micro_batch


def check_replicate(replicate: int, world_size: int) -> None:
    """HSDP keeps `replicate` copies of the sharded model, so the processes must split into that many groups."""
    if world_size % replicate:
        raise ValueError(f"--replicate {replicate} must divide the number of processes ({world_size})")


def agree(check: Callable[[], T], proc: Process) -> T:
    """Run `check` on every rank. If it raised a ValueError or OSError anywhere, every rank raises one.

    A problem that only one host has (a missing channel, a checkpoint dir it cannot write) would otherwise
    stop that host while the others wait in the next collective, and their logs would show only a lost peer.
    When every rank found the same problem the message is the plain one; otherwise it names the rank and host.
    """
    try:
        result, error = check(), None
    except (ValueError, OSError) as e:
        result, error = None, e
    if proc.world_size == 1:
        if error is not None:
            raise error
        return result
    reports: list = [None] * proc.world_size
    host = os.environ.get("SM_CURRENT_HOST") or socket.gethostname()
    dist.all_gather_object(reports, (str(error) if error else None, host))
    failed = [(rank, message, where) for rank, (message, where) in enumerate(reports) if message]
    if not failed:
        return result
    if error is not None and len(failed) == proc.world_size and {m for _, m, _ in failed} == {str(error)}:
        raise error
    rank, message, where = failed[0]
    more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
    raise ValueError(f"rank {rank} on {where}{more}: {message}")


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats over ranks (in float64, so NLL sums for BPB stay exact enough)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def _save_matmuls_policy():
    # Selective AC: keep what is expensive to recompute (matmuls, attention), recompute the elementwise rest.
    ops = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]
    attention = [f"_scaled_dot_product_{kind}_attention" for kind in ("flash", "efficient", "cudnn")]
    ops += [getattr(torch.ops.aten, name).default for name in attention if hasattr(torch.ops.aten, name)]
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_ac(model: nn.Module, mode: str) -> None:
    """Activation checkpointing per block: `full` recomputes the whole block in backward, `selective`
    keeps matmul and attention outputs and recomputes only the cheap elementwise ops.

    The block's forward is wrapped in place (no wrapper module), so parameter names stay Hugging Face's.
    """
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"--ac must be none, full or selective, got {mode!r}")
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    selective = functools.partial(create_selective_checkpoint_contexts, _save_matmuls_policy())
    context_fn = selective if mode == "selective" else None
    for block in model.model.layers.values():
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            kw = {"context_fn": context_fn} if context_fn else {}
            return checkpoint(_inner, *args, use_reentrant=False, preserve_rng_state=False, **kw, **kwargs)

        block.forward = forward


def apply_compile(model: nn.Module) -> None:
    """`torch.compile` each block in place (blocks are alike, so one compiled graph serves all);
    the loss stays outside, so Liger's fused linear cross-entropy is never traced."""
    # Each block graph is specialised on what varies between calls: the first block's input needs no grad
    # in LoRA (frozen embeddings) while the others' do, train vs eval, grad on/off, new lengths. Together
    # that passes Dynamo's default of 8 graphs per function, which fullgraph makes an error.
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 64))
    for block in model.model.layers.values():
        block.compile(fullgraph=True)


def check_fp8(recipe: str, all_gather: str, compile: bool, device: str, world: int, fast_accum: bool = False) -> bool:
    """Refuse --fp8 where it cannot run; returns whether FSDP2 gathers float8 weights (--fp8-all-gather).

    Float8 matmuls need a GPU with float8 tensor cores (compute capability 8.9+) and torchao, and
    `--compile`: uncompiled, the casts to float8 are separate kernels that cost more than the matmuls save.
    """
    if recipe == "none":
        if fast_accum:
            raise ValueError("--fp8-fast-accum needs --fp8 tensorwise or rowwise")
        return False
    device = resolve_device(device)
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if cap is None or cap < (8, 9):
        where = f"a GPU of compute capability {cap[0]}.{cap[1]}" if cap else f"device {device.type}"
        raise ValueError(
            f"--fp8 {recipe} needs a CUDA GPU with float8 matmuls (L4, L40S, H100, H200...); this is {where}"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"--fp8 {recipe} needs torchao: pip install 'minilm-az[gpu]'")
    if not compile:
        raise ValueError(f"--fp8 {recipe} needs --compile (eager float8 casts cost more than the float8 matmuls save)")
    if all_gather == "true" and recipe != "tensorwise":
        raise ValueError("--fp8-all-gather true needs --fp8 tensorwise (torchao gathers only tensorwise weights)")
    if all_gather == "auto":  # slower on one GPU (bench/RESULTS.md); it halves the all-gather bytes on several
        return recipe == "tensorwise" and world > 1
    return all_gather == "true"


def fp8_pays(recipe: str, linear: nn.Linear) -> bool:
    """Whether a float8 GEMM beats bf16 for this weight shape. Float8 tensor cores need every dim to be a
    multiple of 16. Tensorwise: every such linear of a block. torchao's per-linear thresholds would keep the
    1B's k_proj/v_proj (2048 -> 512) in bf16, but inside a compiled block q/k/v share one cast of their input,
    and converting them measured faster and smaller (bench/RESULTS.md). Rowwise: its per-row scales cost more,
    so only large GEMMs repay them (torchao's H100 thresholds; at 1B that is gate_proj and up_proj)."""
    n, k = linear.weight.shape  # out, in
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return True
    return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)


def apply_fp8(model: nn.Module, recipe: str, all_gather: bool, fast_accum: bool = False) -> None:
    """Swap the blocks' `nn.Linear`s that `fp8_pays` picks for torchao's `Float8Linear` (same `weight`, so the
    same names, checkpoints and export); the head and embeddings stay bf16.

    `all_gather` (tensorwise only) makes FSDP2 gather weights already cast to float8: half the all-gather
    bytes, for a scale computed once per step (`fp8_scale_hook`). It pays with several GPUs; on one it cost
    1-2 % (bench/RESULTS.md).

    `fast_accum`: torchao accumulates the forward's GEMM in the tensor cores' fast (lower-precision) mode but
    the two backward GEMMs with periodic promotion to fp32, which costs them speed; this makes all three fast.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import Float8GemmConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    if fast_accum:
        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    convert_to_float8_training(
        model.model.layers,
        config=config,
        module_filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fp8_pays(recipe, m),
    )


def fp8_scale_hook(model: nn.Module, optimizer: torch.optim.Optimizer, on: bool) -> None:
    """With float8 all-gather (`on`): after each optimizer step, compute every weight's float8 scale in one go
    (one all-reduce of all amaxes), instead of one small all-reduce per weight in the next forward."""
    if not on:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


def apply_fsdp(model: nn.Module, mixed_precision: bool, reshard_after_forward: bool = True, replicate: int = 1) -> None:
    """FSDP2: `fully_shard` each block, then the root (embeddings, final norm, head).

    On GPU the compute copy of the weights is bf16, cast once per all-gather, with gradients reduced
    in fp32; on CPU (gloo, tests) everything stays fp32.

    With `replicate` N > 1 (HSDP) the mesh is (N, world / N): a shard group is world / N consecutive ranks, one
    host under torchrun, so all-gathers and reduce-scatters stay in a host and one gradient all-reduce crosses hosts.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else {}
    mp = MixedPrecisionPolicy(**bf16)
    mesh = None  # FSDP2's default, all ranks in one shard group
    if replicate > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        shape = (replicate, dist.get_world_size() // replicate)
        mesh = init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard"))
    blocks = list(model.model.layers.values())
    for i, block in enumerate(blocks):
        # The last block is resharded right away by the root's backward anyway; keeping it saves a gather.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def sync_gradients(model: nn.Module, sync: bool) -> None:
    """Turn FSDP's gradient reduction on or off for the next backward. Off, the gradients add up in a full-size fp32
    buffer until a backward with it on reduces them once. On one process that buffer would only cost memory."""
    if hasattr(model, "set_requires_gradient_sync") and dist.get_world_size() > 1:
        model.set_requires_gradient_sync(sync)


def parallelize(
    model: nn.Module,
    *,
    mixed_precision: bool,
    ac: str = "none",
    compile: bool = False,
    fp8: str = "none",
    fp8_all_gather: bool = False,
    fp8_fast_accum: bool = False,
    shard: bool = True,
    reshard_after_forward: bool = True,
    replicate: int = 1,
) -> nn.Module:
    """Apply float8 linears, activation checkpointing, compile and FSDP2 to a (meta-device) model, in that order.

    `shard=False` leaves FSDP out: for a model whose trainable weights cast themselves to the compute dtype
    (LoRA on a frozen bf16 base, on one process), FSDP would only add its hooks and per-parameter copies.
    """
    if fp8 != "none":
        apply_fp8(model, fp8, fp8_all_gather, fp8_fast_accum)
    apply_ac(model, ac)
    if compile:
        apply_compile(model)
    if shard:
        apply_fsdp(model, mixed_precision, reshard_after_forward, replicate)
    return model
