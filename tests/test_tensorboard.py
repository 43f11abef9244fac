"""--tensorboard: event files beside metrics.jsonl, written from the same records, and a one-line refusal when the
tensorboard extra is missing (the launcher's side, TensorBoardOutputConfig, is in test_sagemaker*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import prefork  # tests/prefork.py (pytest puts this folder on sys.path too)
import pytest
from conftest import BLOCKER

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TRAIN = "--phase 2 --preset tiny --steps 4 --seq-len 32 --micro-batch 1 --global-batch 2 --eval-every 2 --log-every 1"


def test_the_scalars_are_the_metrics_jsonl_records(tmp_path, container_shards_dir, small_tokenizer_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    argv = [*TRAIN.split(), "--no-liger", "--data", container_shards_dir, "--tokenizer", small_tokenizer_dir]
    argv = [sys.executable, "train.py", *argv, "--out", str(out), "--tensorboard"]
    r = prefork.run(argv, str(ROOT), prefork.PLAIN_ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # loss, lr, grad norm, tokens/s and memory of every train line; BPB and loss of every evaluation
    keys = {"train": ["loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gib"], "eval": ["val_bpb", "val_loss"]}
    for kind, names in keys.items():
        for key in names:
            want = {rec["step"]: rec[key] for rec in records if rec["kind"] == kind and key in rec}
            got = {e.step: e.value for e in events.Scalars(f"{kind}/{key}")}
            assert want and got.keys() == want.keys(), (kind, key, got, want)
            for step, value in want.items():  # TensorBoard keeps float32
                assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-6), (kind, key, step)
    assert [s for s in events.Tags()["scalars"] if s.startswith("eval/")] and sorted(keys["train"]) <= sorted(
        s.split("/")[1] for s in events.Tags()["scalars"] if s.startswith("train/")
    )


@pytest.mark.parametrize("script", ["train.py", "finetune.py"])
def test_without_the_extra_it_is_one_line_naming_it_before_any_work(tmp_path, script):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.replace("('pyarrow', 'zstandard', 'py3langid')", "('tensorboard',)"))
    out = tmp_path / "out"
    args = ["--data", "x", "--out", str(out), "--tensorboard"] + (["--model", "m"] if script == "finetune.py" else [])
    r = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env={**ENV, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--tensorboard needs the tensorboard package" in r.stderr and "pip install -e '.[tensorboard]'" in r.stderr
    assert not out.exists()
