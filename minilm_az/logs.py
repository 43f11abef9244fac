"""Plain `key=value` log lines (what SageMaker metric regexes read) and a metrics.jsonl beside them.

One line per logged step, e.g.

    train step=120 loss=3.4172 lr=0.002400 grad_norm=0.812 tokens_per_s=71234 ...

The first word names the stream (`train`, `eval`, `finetune`, ...); every other word is `key=value`
with no spaces in the value, so a regex like `\\bloss=([0-9.eE+-]+)` picks one metric out.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Any, TextIO


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.4e}"
        return f"{v:.6g}" if abs(v) < 1 else f"{v:.4f}".rstrip("0").rstrip(".")
    return str(v).replace(" ", "_")


def format_line(stream: str, **metrics: Any) -> str:
    """`stream k1=v1 k2=v2 ...`, values formatted compactly, None values left out."""
    parts = [stream] + [f"{k}={_fmt(v)}" for k, v in metrics.items() if v is not None]
    return " ".join(parts)


def eta(done: int, total: int, elapsed_s: float) -> str:
    """Remaining time as h:mm:ss from the mean rate so far."""
    if done <= 0 or total <= done:
        return "0:00:00"
    left_s = elapsed_s / done * (total - done)
    h, rem = divmod(int(left_s), 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Progress:
    """Decides when a training loop prints its line: after the first step, every `every` steps, at the
    last step, and at least every `seconds`. `flush` gives the window's mean values, steps/s and the ETA."""

    def __init__(self, total: int, start: int = 0, every: int = 10, seconds: float = 30.0):
        self.total, self.start, self.every, self.seconds = total, start, every, seconds
        self.busy = 0.0  # seconds spent in steps since `start`, for the ETA
        self.window = 0.0  # the same, since the last flush
        self.steps = 0  # steps since the last flush
        self.sums: dict[str, float] = {}
        self.last = time.monotonic()

    def add(self, seconds: float, **values: float) -> None:
        """Record one step: its time (evals and checkpoints left out) and the values to average."""
        self.busy += seconds
        self.window += seconds
        self.steps += 1
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def due(self, done: int) -> bool:
        by_step = done == self.start + 1 or done % self.every == 0 or done == self.total
        return by_step or time.monotonic() - self.last >= self.seconds

    def flush(self, done: int) -> dict[str, Any]:
        out = {k: v / max(self.steps, 1) for k, v in self.sums.items()}
        out["steps_per_s"] = self.steps / max(self.window, 1e-9)
        out["eta"] = eta(done - self.start, self.total - self.start, self.busy)
        self.window = 0.0
        self.steps = 0
        self.sums = {}
        self.last = time.monotonic()
        return out


PEAK_FLOPS = 989e12  # dense bf16 of an H100/H200 SXM, the MFU denominator


def throughput(tokens_per_s: float, world: int, flops_per_token: float, device) -> dict[str, Any]:
    """tokens/s (all processes and per GPU), MFU on CUDA, and this process's peak memory in GiB."""
    import torch

    mfu = None
    if device.type == "cuda":
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        mfu = round(100 * flops_per_token * tokens_per_s / world / PEAK_FLOPS, 2)
    else:
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    return {
        "tokens_per_s": round(tokens_per_s),
        "tokens_per_s_per_gpu": round(tokens_per_s / world, 1),
        "mfu": mfu,
        "peak_mem_gib": round(peak_gib, 2),
    }


def ticker(log: MetricLogger, stream: str, seconds: float = 30.0, **fixed: Any):
    """A `progress(done, total)` callback for long loops (evaluation) that logs a line every `seconds`."""
    t0 = last = time.monotonic()

    def progress(done: int, total: int) -> None:
        nonlocal last
        if time.monotonic() - last >= seconds and done < total:
            last = time.monotonic()
            log.log(stream, **fixed, done=done, total=total, eta=eta(done, total, last - t0))

    return progress


def print_error(prog: str, error: BaseException) -> None:
    """Print `prog: error: message` on stderr, once on each host: under torchrun only local rank 0 prints.

    Each host has a log of its own on SageMaker, so every host says why the job stopped.
    """
    if os.environ.get("LOCAL_RANK", "0") in ("", "0"):
        print(f"{prog}: error: {error}", file=sys.stderr)


class MetricLogger:
    """Prints key=value lines (rank 0 only) and appends them to `metrics.jsonl`, which a resume extends."""

    def __init__(self, jsonl_path: str | None, enabled: bool = True, stream: TextIO | None = None):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.file = None
        if enabled and jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self.file = open(jsonl_path, "a", encoding="utf-8")

    def log(self, stream: str, **metrics: Any) -> None:
        if not self.enabled:
            return
        print(format_line(stream, **metrics), file=self.stream, flush=True)
        if self.file is not None:
            record = {"kind": stream, "time": round(time.time(), 3)}
            record.update({k: v for k, v in metrics.items() if v is not None})
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def info(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=self.stream, flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
