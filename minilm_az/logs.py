"""Plain `key=value` log lines (what SageMaker metric regexes read) and a metrics.jsonl beside them.

One line per logged step, e.g.

    train step=120 loss=3.4172 lr=0.002400 grad_norm=0.812 tokens_per_s=71234 ...

The first word names the stream (`train`, `eval`, `finetune`, ...); every other word is `key=value`
with no spaces in the value, so a regex like `\\bloss=([0-9.eE+-]+)` picks one metric out.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from typing import Any, TextIO


def _fmt(v: Any) -> str:
    if isinstance(v, bool | int):
        return str(v).lower()  # true/false
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.4e}"
        return f"{v:.6g}" if abs(v) < 1 else f"{v:.4f}".rstrip("0").rstrip(".")
    return str(v).replace(" ", "_")


def format_line(stream: str, **metrics: Any) -> str:
    """`stream k1=v1 k2=v2 ...`, values formatted compactly, None values left out."""
    return " ".join([stream] + [f"{k}={_fmt(v)}" for k, v in metrics.items() if v is not None])


def eta(done: int, total: int, elapsed_s: float) -> str:
    """Remaining time as h:mm:ss from the mean rate so far."""
    if done <= 0 or total <= done:
        return "0:00:00"
    h, rem = divmod(int(elapsed_s / done * (total - done)), 3600)  # what is left, at the mean rate so far
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


class Progress:
    """Decides when a training loop prints its line: after the first step, every `every` steps, at the
    last step, and at least every `seconds`. `flush` gives the window's mean values, steps/s and the ETA."""

    def __init__(self, total: int, start: int = 0, every: int = 10, seconds: float = 30.0, device="cpu", note=None):
        self.total, self.start, self.every, self.seconds = total, start, every, seconds
        self.device, self.note = device, note  # where the loop runs; where long_plan's line goes (flush calls it)
        self.busy = 0.0  # seconds spent in steps since `start`, for the ETA
        self.window = 0.0  # the same, since the last flush
        self.steps = 0  # steps since the last flush
        self.sums: dict[str, float] = {}
        self.last = time.monotonic()
        self.step_s = 0.0  # the mean step time of the last flushed window
        self.judged = False  # whether long_plan has looked at a window yet

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
        self.step_s = self.window / max(self.steps, 1)
        self.window, self.steps, self.sums, self.last = 0.0, 0, {}, time.monotonic()
        if self.note and (line := self.long_plan(done, self.device)):
            self.note(line)
        return out

    # A plan whose measured steps put its end further out than this is more likely sizes meant for other hardware
    # (the 1B recipe started on a laptop's CPU) than a job someone means to wait for: one line says so.
    LONG_PLAN_S = 12 * 3600

    def long_plan(self, done: int, device: str) -> str | None:
        """Once, after the first window that counts: a line when the rest of the plan, at that window's step time,
        would take more than LONG_PLAN_S. On CUDA the first step holds compilation and warm-up, so the second
        window decides there; on a CPU the first step is already typical."""
        if self.judged or (device == "cuda" and done == self.start + 1):
            return None
        self.judged = True
        left = self.step_s * (self.total - done)
        if left < self.LONG_PLAN_S:
            return None
        return (
            f"plan: {self.total - done:,} more steps at {self.step_s:.1f} s a step on {device} is about "
            f"{left / 3600:,.0f} h; the work comes from the model (--preset or --base-model), --steps, --seq-len and "
            "--global-batch (the README's CPU block trains the demo's tiny models with --steps 10 --seq-len 128 "
            "--global-batch 4); Ctrl-C stops after this step"
        )


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
    per_gpu, peak_mem_gib = round(tokens_per_s / world, 1), round(peak_gib, 2)
    return dict(tokens_per_s=round(tokens_per_s), tokens_per_s_per_gpu=per_gpu, mfu=mfu, peak_mem_gib=peak_mem_gib)


def ticker(log: MetricLogger, stream: str, seconds: float = 30.0, **fixed: Any):
    """A `progress(done, total)` callback for long loops (evaluation) that logs a line every `seconds`."""
    t0 = last = time.monotonic()

    def progress(done: int, total: int) -> None:
        nonlocal last
        if time.monotonic() - last >= seconds and done < total:
            last = time.monotonic()
            log.log(stream, **fixed, done=done, total=total, eta=eta(done, total, last - t0))

    return progress


def print_error(prog: str, error: BaseException | str) -> None:
    """Print `prog: error: message` on stderr, once on each host: under torchrun only local rank 0 prints.

    Each host has a log of its own on SageMaker, so every host says why the job stopped. There the line is also the
    job's failure reason: the containers write none when one is there, and theirs would not hold it (only a fixed text).
    """
    line = f"{prog}: error: {error}"
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's summary, the log's last lines, shows it
        with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    if prints_errors():
        print(line, file=sys.stderr)
        if out := os.environ.get("SM_OUTPUT_DIR"):  # SageMaker's /opt/ml/output; the first line written stays
            with contextlib.suppress(OSError), open(os.path.join(out, "failure"), "x", encoding="utf-8") as f:
                f.write(line + "\n")


def prints_errors() -> bool:
    """Local rank 0 of a torchrun job prints error lines for its host; a process alone always does (LOCAL_RANK set by
    hand, or not a number, hid why it stopped)."""
    rank = os.environ.get("LOCAL_RANK", "0")
    return not rank.isdigit() or int(rank) == 0 or os.environ.get("WORLD_SIZE", "1") in ("", "1")


class MetricLogger:
    """Prints key=value lines (rank 0 only) and appends them to `metrics.jsonl`, which a resume extends. With a
    `tensorboard` dir, the numbers of each record that has a step are also TensorBoard scalars, `KIND/KEY`.
    Records are held in memory until open(), which the run calls once its output dir is its own and no check can
    refuse it (Checkpointer.start): a refused run writes no line, and none lands in a directory not the run's."""

    def __init__(self, jsonl: str | None, enabled: bool = True, stream: TextIO | None = None, tensorboard=None):
        self.enabled, self.stream, self.jsonl, self.tensorboard = enabled, stream or sys.stdout, jsonl, tensorboard
        self.file = self.writer = None
        self.held: list[str] | None = []  # the records before open()
        self.until: tuple[str, ...] = ()  # the kinds of record that say the run's first output exists

    def open(self, output: tuple[str, ...] = ("checkpoint", "export")) -> None:
        """Write the held records and the next ones. A run that replaces an earlier one's output (--overwrite) holds
        them on until a record of an `output` kind: then its first output exists, and the earlier run's files (its
        metrics.jsonl too) go (outputs.replace_earlier). Stopped before that, it leaves the earlier run whole."""
        from minilm_az import outputs  # outputs imports nothing from here; kept local anyway

        if self.jsonl and outputs.replacing(os.path.dirname(os.path.abspath(self.jsonl))):
            self.until = output
        else:
            self._release()

    def _release(self) -> None:
        held, self.held = self.held or [], None
        for record in held:
            self._write(record)
            fields = json.loads(record)  # a held record's numbers reach TensorBoard now, like the rest
            self._scalars(fields.pop("kind"), {k: v for k, v in fields.items() if k != "time"})

    def _write(self, record: str) -> None:
        try:
            if self.jsonl and self.file is None:  # made at the first record, in a directory the run owns
                os.makedirs(os.path.dirname(os.path.abspath(self.jsonl)), exist_ok=True)
                self.file = open(self.jsonl, "a", encoding="utf-8")
            if self.file is not None:
                self.file.write(record)
                self.file.flush()
        except OSError as e:  # a full disk, no permission: the path, the reason and the free space in one line
            from minilm_az.outputs import write_error

            raise write_error(self.jsonl, e) from None

    def _scalars(self, stream: str, metrics: dict[str, Any]) -> None:
        if not (self.tensorboard and isinstance(metrics.get("step"), int)):
            return
        if self.writer is None:  # the tensorboard extra: the flags refuse --tensorboard without it
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.tensorboard, flush_secs=30)
        for key, value in metrics.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"{stream}/{key}", value, metrics["step"])

    def log(self, stream: str, **metrics: Any) -> None:
        if not self.enabled:
            return
        print(format_line(stream, **metrics), file=self.stream, flush=True)
        kept = {k: v for k, v in metrics.items() if v is not None}
        record = json.dumps({"kind": stream, "time": round(time.time(), 3), **kept}) + "\n"
        if self.held is None:
            self._write(record)
            self._scalars(stream, metrics)
            return
        self.held.append(record)
        if stream in self.until:  # the first output of a run that replaces an earlier one: now the earlier one goes
            from minilm_az import outputs

            outputs.replace_earlier(os.path.dirname(os.path.abspath(self.jsonl)))
            self._release()

    def info(self, msg: str) -> None:
        if self.enabled:
            print(msg, file=self.stream, flush=True)

    def close(self) -> None:
        for f in (self.file, self.writer):
            if f is not None:
                f.close()
        self.file = self.writer = None
