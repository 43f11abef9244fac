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
    left = elapsed_s / done * (total - done)
    h, rem = divmod(int(left), 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class MetricLogger:
    """Prints key=value lines (rank 0 only) and appends the same records to `metrics.jsonl`.

    The jsonl file is opened in append mode so a resumed run continues the same file.
    """

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
