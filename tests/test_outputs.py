"""Output directories written through outputs.staged_output: safe on a mount point, all-or-nothing, no stale files."""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minilm_az import hf, lora
from minilm_az.hf import HF_STAGE, load_pretrained, save_pretrained
from minilm_az.lora import ADAPTER_STAGE, apply_lora, load_adapter, save_adapter
from minilm_az.model import ModelConfig, build_model
from minilm_az.outputs import (
    MARKER,
    OutputError,
    atomic_write_json,
    atomic_write_text,
    staged_output,
)

CFG = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=64, tie_embeddings=False
)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def mount(tmp_path, monkeypatch):
    """A directory that behaves like its own mount point: renames across its boundary fail with EXDEV,
    renaming or removing the directory itself fails with EBUSY."""
    out = tmp_path / "model"
    out.mkdir()
    root = os.path.realpath(out)

    def inside(p) -> bool:
        rp = os.path.realpath(os.fspath(p))
        return rp == root or rp.startswith(root + os.sep)

    def guard_rename(real):
        def rename(src, dst, *args, **kwargs):
            if kwargs.get("src_dir_fd") is None and kwargs.get("dst_dir_fd") is None:
                if root in (os.path.realpath(os.fspath(src)), os.path.realpath(os.fspath(dst))):
                    raise OSError(errno.EBUSY, "Device or resource busy (simulated mount point)", os.fspath(src))
                if inside(src) != inside(dst):
                    raise OSError(errno.EXDEV, "Invalid cross-device link (simulated mount point)", os.fspath(src))
            return real(src, dst, *args, **kwargs)

        return rename

    real_rmdir, real_rmtree = os.rmdir, shutil.rmtree

    def rmdir(path, *args, **kwargs):
        if kwargs.get("dir_fd") is None and os.path.realpath(os.fspath(path)) == root:
            raise OSError(errno.EBUSY, "Device or resource busy (simulated mount point)", os.fspath(path))
        return real_rmdir(path, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        if os.path.realpath(os.fspath(path)) == root:
            raise OSError(errno.EBUSY, "Device or resource busy (simulated mount point)", os.fspath(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "replace", guard_rename(os.replace))
    monkeypatch.setattr(os, "rename", guard_rename(os.rename))
    monkeypatch.setattr(os, "rmdir", rmdir)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return str(out)


def written_by(out_dir, stage=None):
    """The newest record of `stage` (any stage: None) in out_dir's marker, as a reader of the directory finds it;
    `complete` is False when a process died while moving that output's files in."""
    path = os.path.join(out_dir, MARKER)
    records = json.load(open(path))["outputs"] if os.path.exists(path) else []
    records = [r for r in records if stage is None or r["stage"] == stage]
    return records[-1] if records else None


def snapshot(path) -> dict[str, bytes]:
    """Every file under path, by relative path, with its bytes."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def _lora_model(seed=0):
    model = build_model(CFG, seed=seed)
    apply_lora(model, r=4, alpha=8, dropout=0.0)
    with torch.no_grad():  # lora_B starts at zero: make the adapter visible in the weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return model


def test_the_mount_fixture_refuses_what_the_old_writers_did(mount, tmp_path):
    (tmp_path / "sibling").write_text("x")
    with pytest.raises(OSError) as e:
        os.replace(tmp_path / "sibling", os.path.join(mount, "sibling"))
    assert e.value.errno == errno.EXDEV
    with pytest.raises(OSError) as e:
        os.rmdir(mount)
    assert e.value.errno == errno.EBUSY


def test_staged_output_moves_files_and_subdirs_into_a_mount_point(mount):
    inode = os.stat(mount).st_ino
    with staged_output(mount, stage="demo") as tmp:
        assert os.path.dirname(tmp) == mount and os.path.basename(tmp).startswith(".staging-")
        open(os.path.join(tmp, "a.bin"), "wb").write(b"a")
        os.makedirs(os.path.join(tmp, "sub", "deep"))
        open(os.path.join(tmp, "sub", "deep", "b.txt"), "w").write("b")
    assert snapshot(mount).keys() == {"a.bin", os.path.join("sub", "deep", "b.txt"), MARKER}
    assert os.stat(mount).st_ino == inode  # the directory itself was never replaced
    rec = written_by(mount, "demo")
    assert rec["files"] == ["a.bin", "sub/deep/b.txt"] and rec["complete"] and rec["stage"] == "demo"
    assert written_by(mount) == rec and written_by(mount, "other") is None


def test_save_pretrained_and_save_adapter_into_a_mount_point(mount, tmp_path):
    model = build_model(CFG, seed=1)
    for shard_bytes in (2**30, 60_000):  # single file, then sharded
        save_pretrained(model, mount, max_shard_bytes=shard_bytes)
        back = load_pretrained(mount)
        for (n, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
            assert torch.equal(a, b), n
    adapted = _lora_model(seed=2)
    save_adapter(adapted, mount)
    fresh = build_model(CFG, seed=2)
    load_adapter(fresh, mount)
    ids = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh.eval()(ids), adapted.eval()(ids))
    assert {written_by(mount, HF_STAGE)["stage"], written_by(mount, ADAPTER_STAGE)["stage"]} == {
        HF_STAGE,
        ADAPTER_STAGE,
    }
    assert not [f for f in os.listdir(mount) if f.startswith(".staging-")]


def test_exception_inside_the_block_leaves_the_previous_output_byte_identical(mount):
    with staged_output(mount, stage="demo") as tmp:
        open(os.path.join(tmp, "a.bin"), "wb").write(b"old")
    before = snapshot(mount)
    with pytest.raises(RuntimeError, match="boom"):
        with staged_output(mount, stage="demo") as tmp:
            open(os.path.join(tmp, "a.bin"), "wb").write(b"new")
            open(os.path.join(tmp, "b.bin"), "wb").write(b"new")
            raise RuntimeError("boom")
    assert snapshot(mount) == before and sorted(os.listdir(mount)) == ["a.bin", MARKER]


def _enospc_after_writing():
    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    return save_file


def test_disk_full_during_export_leaves_the_previous_export(mount, monkeypatch):
    save_pretrained(build_model(CFG, seed=1), mount)
    save_adapter(_lora_model(seed=1), mount)
    before = snapshot(mount)
    monkeypatch.setattr(hf, "save_file", _enospc_after_writing())
    monkeypatch.setattr(lora, "save_file", _enospc_after_writing())
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(build_model(CFG, seed=2), mount, max_shard_bytes=60_000)
    with pytest.raises(OSError, match="No space left"):
        save_adapter(_lora_model(seed=2), mount)
    assert snapshot(mount) == before


def test_sharded_export_replacing_a_single_file_leaves_no_stale_weights(mount):
    model = build_model(CFG, seed=1)
    open(os.path.join(mount, "metrics.jsonl"), "w").write("{}\n")  # another artifact: never touched
    save_pretrained(model, mount)
    save_pretrained(model, mount, max_shard_bytes=60_000)
    files = set(os.listdir(mount))
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    assert "metrics.jsonl" in files
    save_pretrained(model, mount)
    assert sorted(os.listdir(mount)) == ["config.json", "metrics.jsonl", MARKER, "model.safetensors"]


def test_weights_no_record_lists_are_never_removed_and_an_index_a_reader_would_load_is_refused(tmp_path):
    """A file of a weight layout's name that no run recorded writing is a user's (issue 38): an export removes only
    the files its marker lists, never a name's pattern; an index beside it would be loaded instead of the export."""
    out = tmp_path / "hf"
    out.mkdir()
    theirs = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "README.md")
    for f in (*theirs, "model.safetensors.index.json"):
        (out / f).write_text("from another tool")
    with pytest.raises(OutputError, match="model.safetensors.index.json: no minilm-az output recorded writing it"):
        save_pretrained(build_model(CFG, seed=1), str(out))
    assert sorted(os.listdir(out)) == sorted([*theirs, "model.safetensors.index.json"])
    os.remove(out / "model.safetensors.index.json")
    save_pretrained(build_model(CFG, seed=1), str(out))
    assert sorted(os.listdir(out)) == sorted([*theirs, "config.json", MARKER, "model.safetensors"])
    assert all((out / f).read_text() == "from another tool" for f in theirs)
    (out / "tokenizer.json").write_text("mine")  # a name the next output writes, which no record lists: refused
    with pytest.raises(OutputError, match="tokenizer.json: no minilm-az output recorded writing it, and the new"):
        with staged_output(str(out), stage="tokenizer") as tmp:
            (Path(tmp) / "tokenizer.json").write_text("{}")
    assert (out / "tokenizer.json").read_text() == "mine"


def test_only_files_the_previous_record_listed_are_removed(tmp_path):
    out = str(tmp_path / "o")
    with staged_output(out, stage="s") as tmp:
        for f in ("x", "y"):
            open(os.path.join(tmp, f), "w").write(f)
    with staged_output(out, stage="other") as tmp:
        open(os.path.join(tmp, "t"), "w").write("t")
    open(os.path.join(out, "z"), "w").write("not ours")
    with staged_output(out, stage="s") as tmp:
        open(os.path.join(tmp, "x"), "w").write("x2")
    assert sorted(os.listdir(out)) == [MARKER, "t", "x", "z"]
    assert written_by(out, "other")["files"] == ["t"] and written_by(out, "s")["files"] == ["x"]


def test_leftover_staging_dirs_are_removed_at_the_next_write_and_look_alikes_stay(tmp_path):
    from minilm_az.outputs import STAGING_MARK

    out = tmp_path / "o"
    (out / ".staging-killed" / "sub").mkdir(parents=True)
    (out / f".staging-killed{STAGING_MARK}").write_bytes(b"")  # staged_output's own pair, left by a killed process
    (out / ".staging-killed" / "sub" / "partial.bin").write_bytes(b"...")
    (out / ".staging-backup").mkdir()  # a user's, named like one: no mark inside
    (out / ".staging-backup" / "important.txt").write_text("mine")
    with staged_output(str(out), stage="s") as tmp:
        open(os.path.join(tmp, "f"), "w").write("f")
    assert sorted(os.listdir(out)) == [".staging-backup", "f", MARKER]
    assert (out / ".staging-backup" / "important.txt").read_text() == "mine"


def test_a_process_dying_while_moving_leaves_an_incomplete_record(tmp_path, monkeypatch):
    from minilm_az import outputs

    out = str(tmp_path / "o")
    with staged_output(out, stage="s") as tmp:
        open(os.path.join(tmp, "old"), "w").write("old")

    def die_halfway(stage_dir, out_dir, files):
        os.replace(os.path.join(stage_dir, files[0]), os.path.join(out_dir, files[0]))
        raise KeyboardInterrupt  # stands for the SIGKILL a test cannot survive

    monkeypatch.setattr(outputs, "_move_in", die_halfway)
    with pytest.raises(KeyboardInterrupt):
        with staged_output(out, stage="s") as tmp:
            for f in ("a", "b"):
                open(os.path.join(tmp, f), "w").write(f)
    rec = written_by(out, "s")
    assert rec["complete"] is False and rec["files"] == ["a", "b", "old"]


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = str(tmp_path / "latest")
    atomic_write_text(path, "step-1")
    assert open(path).read() == "step-1" and os.stat(path).st_mode & 0o777 != 0o600

    def fail(src, dst):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        atomic_write_text(path, "step-2")
    assert open(path).read() == "step-1" and os.listdir(tmp_path) == ["latest"]


def _can_mount() -> bool:
    if not shutil.which("unshare"):
        return False
    import tempfile

    d = tempfile.mkdtemp()
    try:
        r = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", f"mount -t tmpfs none {d}"], capture_output=True
        )
    finally:
        os.rmdir(d)
    return r.returncode == 0


MOUNTED = textwrap.dedent("""
    import errno, os, sys, torch
    from minilm_az.hf import load_pretrained, save_pretrained
    from minilm_az.lora import apply_lora, save_adapter, load_adapter
    from minilm_az.model import ModelConfig, build_model
    out, outside = sys.argv[1], sys.argv[2]
    assert os.stat(out).st_dev != os.stat(outside).st_dev, "not a mount point"
    try:
        os.rmdir(out)
    except OSError as e:
        assert e.errno == errno.EBUSY, e
    open(os.path.join(outside, "f"), "w").close()
    try:
        os.replace(os.path.join(outside, "f"), os.path.join(out, "f"))
        raise SystemExit("a rename across the mount worked: the test would prove nothing")
    except OSError as e:
        assert e.errno == errno.EXDEV, e
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=64)
    model = build_model(cfg, seed=1)
    save_pretrained(model, out, max_shard_bytes=60_000)
    save_pretrained(model, out)
    back = load_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
    apply_lora(model, r=4, alpha=8)
    save_adapter(model, out)
    load_adapter(build_model(cfg, seed=1), out)
    print(sorted(os.listdir(out)))
""")


@pytest.mark.skipif(not _can_mount(), reason="unshare -m / mount -t tmpfs not permitted here")
def test_export_into_a_real_tmpfs_mount_point(tmp_path):
    out = tmp_path / "opt_ml_model"
    out.mkdir()
    script = tmp_path / "mounted.py"
    script.write_text(MOUNTED)
    cmd = f"mount -t tmpfs none {out} && {sys.executable} {script} {out} {tmp_path}"
    r = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model.safetensors" in r.stdout and "adapter_model.safetensors" in r.stdout
    assert MARKER in r.stdout and "model.safetensors.index.json" not in r.stdout
    assert os.listdir(out) == []  # the tmpfs lived only in the child's mount namespace


def test_a_marker_naming_a_path_outside_its_directory_removes_nothing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (tmp_path / "outside.txt").write_text("keep me")
    atomic_write_json(str(out / MARKER), {"outputs": [{"stage": "evil", "files": ["../outside.txt"]}]})
    with staged_output(str(out), stage="evil") as tmp:
        open(os.path.join(tmp, "f"), "w").write("f")
    assert (tmp_path / "outside.txt").read_text() == "keep me"
