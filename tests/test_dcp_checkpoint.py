"""Training checkpoints (DCP): integrity, safe unpickling, resume with fallback, async save, kill during a write."""

import errno
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from minilm_az import parallel
from minilm_az.checkpoint import (
    Checkpointer,
    CheckpointError,
    complete_checkpoints,
    is_complete,
    latest_checkpoint,
    load_train_checkpoint,
    read_train_state,
    resume,
)
from minilm_az.model import ModelConfig, materialize, meta_model

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=64)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = {"model": CFG.to_dict(), "phase": 2, "seed": 0, "global_batch": 8}


@pytest.fixture
def group():
    """A one-process gloo group, as parallel.setup makes for a lone process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def save_train_checkpoint(d, step, model, opt, state, rank, local_rank, keep=2):
    Checkpointer(d, rank, local_rank, keep, async_save=False).save(step, model, opt, state)
    return os.path.join(d, f"step-{step:08d}")


def make(seed: int = 0, steps: int = 1):
    """The tiny model as train.py builds it (meta -> FSDP2 -> materialise) plus AdamW with state."""
    model = meta_model(CFG)
    parallel.parallelize(model, mixed_precision=False)
    materialize(model, "cpu", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for _ in range(steps):
        train_step(model, opt, seed)
    return model, opt


def train_step(model, opt, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 320, (2, 16), generator=g), torch.randint(0, 320, (2, 16), generator=g)
    model(x, targets=y).backward()
    opt.step()
    opt.zero_grad()


def tensors(model, opt) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, gathered whole and copied."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": v for k, v in msd.items()}
    for name, st in osd["state"].items():
        out.update({f"optim.{name}.{k}": v for k, v in st.items()})
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in out.items()
        if isinstance(v, torch.Tensor)
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def distcp(path: str) -> str:
    return os.path.join(path, "__0_0.distcp")


def test_async_save_round_trips_the_state_of_the_moment_it_was_called(group, tmp_path):
    model, opt = make(seed=1)
    ck = Checkpointer(str(tmp_path), rank=0, local_rank=0, async_save=True)
    want = tensors(model, opt)
    ck.save(1, model, opt, STATE)
    train_step(model, opt, seed=5)  # training goes on while the write runs: the snapshot must not see it
    deadline = time.time() + 60
    while not ck.pending_done() and time.time() < deadline:
        time.sleep(0.01)
    path = ck.finalize()
    assert path == str(tmp_path / "step-00000001") and latest_checkpoint(str(tmp_path)) == path
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "rng-00000.safetensors", "train_state.json"]
    assert ck.finalize() is None and ck.pending_done()
    ck.save(2, model, opt, STATE)  # the same writer (and, on CUDA, its pinned copy) serves the next save
    second = ck.finalize()
    assert second.endswith("step-00000002") and is_complete(second) and is_complete(path)
    ck.close()
    fresh, fresh_opt = make(seed=2)
    load_train_checkpoint(path, fresh, fresh_opt, 0)  # step 1 is kept (keep=2)
    state = read_train_state(path)
    assert state["step"] == 1 and state["world_size"] == 1
    assert_same(tensors(fresh, fresh_opt), want)


def test_sync_save_keeps_the_newest_and_clears_leftovers(group, tmp_path):
    model, opt = make()
    (tmp_path / "step-00000009.tmp").mkdir()  # a killed save
    for step in (1, 2, 3):
        assert save_train_checkpoint(str(tmp_path), step, model, opt, STATE, 0, 0, keep=2).endswith(f"{step:08d}")
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000002", "step-00000003"]
    save_train_checkpoint(str(tmp_path), 3, model, opt, STATE, 0, 0, keep=2)  # the same step again
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000002", "step-00000003"]
    assert (tmp_path / "latest").read_text() == "step-00000003"


def test_truncated_or_missing_shard_is_incomplete_and_resume_takes_the_previous(group, tmp_path):
    model, opt = make(seed=1)
    save_train_checkpoint(str(tmp_path), 1, model, opt, STATE, 0, 0, keep=3)
    want = tensors(model, opt)
    train_step(model, opt)
    newest = save_train_checkpoint(str(tmp_path), 2, model, opt, STATE, 0, 0, keep=3)
    assert is_complete(newest)
    size = os.path.getsize(distcp(newest))
    with open(distcp(newest), "r+b") as f:  # a partial S3 sync
        f.truncate(size - 1)
    assert not is_complete(newest) and latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-00000001")
    warnings = []
    fresh, fresh_opt = make(seed=3)
    step, state = resume(str(tmp_path), fresh, fresh_opt, 0, {"model": CFG.to_dict()}, {}, warnings.append)
    assert step == 1 and state["step"] == 1
    assert warnings == [f"warning: {newest} is incomplete (a save or a sync that did not finish); skipped"]
    assert_same(tensors(fresh, fresh_opt), want)
    os.remove(distcp(newest))
    assert not is_complete(newest)


def test_a_newest_checkpoint_that_fails_to_load_warns_once_and_the_previous_is_used(group, tmp_path):
    model, opt = make(seed=1)
    save_train_checkpoint(str(tmp_path), 1, model, opt, STATE, 0, 0, keep=3)
    want = tensors(model, opt)
    train_step(model, opt)
    newest = save_train_checkpoint(str(tmp_path), 2, model, opt, STATE, 0, 0, keep=3)
    size = os.path.getsize(distcp(newest))
    with open(distcp(newest), "wb") as f:  # right size, wrong bytes: only loading can tell
        f.write(os.urandom(size))
    assert is_complete(newest)
    warnings = []
    fresh, fresh_opt = make(seed=3)
    step, _ = resume(str(tmp_path), fresh, fresh_opt, 0, {"model": CFG.to_dict()}, {}, warnings.append)
    assert step == 1 and len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"warning: {newest} could not be loaded (")
    assert warnings[0].endswith("; trying the previous checkpoint")
    assert_same(tensors(fresh, fresh_opt), want)


def test_resume_refuses_another_model_and_warns_about_a_changed_seed(group, tmp_path):
    model, opt = make()
    save_train_checkpoint(str(tmp_path), 4, model, opt, STATE, 0, 0)
    other = {**CFG.to_dict(), "n_layers": 3}
    with pytest.raises(CheckpointError) as e:
        resume(str(tmp_path), model, opt, 0, {"model": other}, {}, print)
    assert str(e.value) == (
        f"{tmp_path}/step-00000004: checkpoint was made with model={{'n_layers': 2}}, this run "
        f"has {{'n_layers': 3}}; use --resume never or another --checkpoint-dir"
    )
    warnings = []
    step, _ = resume(
        str(tmp_path),
        model,
        opt,
        0,
        {"model": CFG.to_dict(), "tokenizer_hash": "abc"},
        {"seed": 7, "global_batch": 8},
        warnings.append,
    )  # keys an old checkpoint lacks: fine
    assert step == 4 and warnings == [f"warning: resuming from {tmp_path}/step-00000004 with changed seed=0->7"]
    assert resume(str(tmp_path / "none"), model, opt, 0, {}, {}, print) == (0, None)


class Payload:
    """Unpickling this runs a shell command: what a planted checkpoint file would do."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def test_a_planted_metadata_pickle_is_refused_and_never_runs(group, tmp_path):
    model, opt = make()
    good = save_train_checkpoint(str(tmp_path), 1, model, opt, STATE, 0, 0, keep=3)
    bad = save_train_checkpoint(str(tmp_path), 2, model, opt, STATE, 0, 0, keep=3)
    sentinel = tmp_path / "pwned"
    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(Payload(str(sentinel)), f)
    with pytest.raises(CheckpointError) as e:
        is_complete(bad)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{bad}/.metadata: refused to unpickle ")
    assert "system" in str(e.value)
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        load_train_checkpoint(bad, model, opt, 0)
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        resume(str(tmp_path), model, opt, 0, {}, {}, print)
    assert not sentinel.exists()
    load_train_checkpoint(good, model, opt, 0)  # a real checkpoint still loads
    assert read_train_state(good)["step"] == 1


def test_a_planted_optimizer_value_loads_weights_only_and_never_runs(group, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = make()
    good = save_train_checkpoint(str(tmp_path), 1, model, opt, STATE, 0, 0, keep=3)
    bad = save_train_checkpoint(str(tmp_path), 2, model, opt, STATE, 0, 0, keep=3)
    sentinel = tmp_path / "pwned"
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["lr"] = Payload(str(sentinel))  # a non-tensor item: DCP pickles it whole
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=bad)
    with pytest.raises(CheckpointError, match="refused by weights_only=True"):
        load_train_checkpoint(bad, model, opt, 0)
    assert not sentinel.exists()
    warnings = []
    assert resume(str(tmp_path), model, opt, 0, {}, {}, warnings.append)[0] == 1 and len(warnings) == 1
    assert not sentinel.exists()
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=bad)  # DCP's own loader: the payload runs
    assert sentinel.exists() and good


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_write_raises_one_error_and_keeps_latest(group, tmp_path, monkeypatch, async_save):
    from torch.distributed.checkpoint import FileSystemWriter

    model, opt = make()
    ck = Checkpointer(str(tmp_path), 0, 0, async_save=async_save)
    ck.save(1, model, opt, STATE)
    ck.finalize()
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000001")

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    # async: the write fails in the background and finalize() reports it; sync: save() itself raises. Either
    # way a CheckpointError (a ValueError, which train.py prints as one line), never DCP's BaseException.
    err = r"step-00000002.tmp: checkpoint of step 2 was not written .*No space.* GiB free on its disk"
    with pytest.raises(CheckpointError, match=err):
        ck.save(2, model, opt, STATE)
        ck.finalize()
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000001")
    monkeypatch.undo()
    ck.save(3, model, opt, STATE)
    ck.close()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001", "step-00000003"]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_full_disk_at_the_rank_files_is_the_same_one_error(group, tmp_path, monkeypatch, async_save):
    from safetensors import SafetensorError

    from minilm_az import checkpoint

    model, opt = make()
    ck = Checkpointer(str(tmp_path), 0, 0, async_save=async_save)

    def full(*args, **kwargs):  # what safetensors raises when the disk is full: neither OSError nor ValueError
        raise SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(CheckpointError, match=r"step-00000001.tmp: checkpoint of step 1 was not written .*No space"):
        ck.save(1, model, opt, STATE)
    monkeypatch.undo()
    ck.save(2, model, opt, STATE)  # the next save, with room again, goes through
    ck.close()
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000002")


KILLED = textwrap.dedent("""
    import os, sys, threading, time, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_dcp_checkpoint import STATE, make, train_step
    from minilm_az.checkpoint import Checkpointer
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, opt = make(seed=1)
    ck = Checkpointer(sys.argv[1], 0, 0, async_save=True)
    ck.save(1, model, opt, STATE)
    ck.finalize()
    fsync = os.fsync
    def slow_fsync(fd):  # DCP syncs its files from the writer thread: hold it there
        if threading.current_thread() is not threading.main_thread():
            time.sleep(60)
        fsync(fd)
    os.fsync = slow_fsync
    train_step(model, opt)
    ck.save(2, model, opt, STATE)
    print("writing", flush=True)
    time.sleep(60)
""")


def test_sigkill_during_an_async_write_leaves_the_previous_checkpoint_latest(group, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED.format(tests=os.path.dirname(os.path.abspath(__file__))))
    ckpt = tmp_path / "ckpt"
    p = subprocess.Popen(
        [sys.executable, str(script), str(ckpt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:
        line = p.stdout.readline()
        assert line == "writing\n", p.stderr.read()
        assert (ckpt / "step-00000002.tmp").is_dir()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert latest_checkpoint(str(ckpt)) == str(ckpt / "step-00000001") and is_complete(str(ckpt / "step-00000001"))
    assert complete_checkpoints(str(ckpt)) == [str(ckpt / "step-00000001")]
    model, opt = make(seed=4)
    assert resume(str(ckpt), model, opt, 0, {"model": CFG.to_dict()}, {}, print)[0] == 1
    save_train_checkpoint(str(ckpt), 2, model, opt, STATE, 0, 0)  # the next save clears the killed one's dir
    assert sorted(os.listdir(ckpt)) == ["latest", "step-00000001", "step-00000002"]


TWO_RANKS = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_dcp_checkpoint import STATE, make, tensors, train_step
    from minilm_az.checkpoint import Checkpointer
    rank, store, ckpt_dir, snapshot = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    model, opt = make(seed=1)
    want = tensors(model, opt)  # gathers: every rank
    if rank == 0:
        torch.save(want, snapshot)
    ck = Checkpointer(ckpt_dir, rank, local_rank=0, async_save=True)  # local rank 0 of its own host
    ck.save(1, model, opt, STATE)
    train_step(model, opt)
    print(ck.finalize())
    ck.close()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("disks", ["shared", "per-host"])
def test_two_ranks_on_two_hosts_async_save_then_resume_on_one(group, tmp_path, disks):
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS.format(tests=os.path.dirname(os.path.abspath(__file__))))
    dirs = [tmp_path / "host0", tmp_path / ("host0" if disks == "shared" else "host1")]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "store"), str(dirs[r]), str(tmp_path / "want.pt")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    step1 = tmp_path / "host0" / "step-00000001"
    if disks == "per-host":  # each host renamed its own part; only their union (an S3 sync) is complete
        assert not is_complete(str(step1))
        assert sorted(os.listdir(dirs[1])) == ["latest", "step-00000001"]
        for f in os.listdir(dirs[1] / "step-00000001"):
            os.replace(dirs[1] / "step-00000001" / f, step1 / f)
    assert sorted(os.listdir(step1)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "rng-00000.safetensors",
        "rng-00001.safetensors",
        "train_state.json",
    ]
    model, opt = make(seed=3)
    assert resume(str(tmp_path / "host0"), model, opt, 0, {"model": CFG.to_dict()}, {}, print)[0] == 1
    assert_same(tensors(model, opt), torch.load(tmp_path / "want.pt"))
