"""Training checkpoints (DCP): manifests, names never reused, safe unpickling, resume with fallback, async save,
kill during a write, two hosts on a shared dir."""

import errno
import json
import os
import pickle
import shutil
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
    STAGING,
    Checkpointer,
    CheckpointError,
    check,
    load_train_checkpoint,
    read_metadata,
    read_train_state,
    step_dirs,
)
from minilm_az.model import ModelConfig, materialize, meta_model
from minilm_az.outputs import file_sha256

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=64)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = {"model": CFG.to_dict(), "phase": 2, "seed": 0, "global_batch": 8}


@pytest.fixture
def group():
    """A one-process gloo group, as parallel.setup makes for a lone process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


PROC = parallel.Process(0, 1, 0, torch.device("cpu"))


RUNS: dict[str, Checkpointer] = {}  # one run per checkpoint dir: a second run would prune the first one's saves


def save_train_checkpoint(d, step, model, opt, state=STATE, keep=2) -> str:
    """A save by the run that writes into d (synchronous); the new dir's path."""
    ck = RUNS.setdefault(str(d), Checkpointer(str(d), PROC, keep, async_save=False))
    ck.keep = keep
    ck.save(step, model, opt, state)
    return ck.last()


def resume(d, model, opt, must, may, warn):
    return Checkpointer(str(d), PROC, async_save=False).resume(model, opt, must, may, warn, steps=100)


def latest_checkpoint(d: str) -> str | None:
    """The newest complete checkpoint in d, as this one process sees it."""
    return next((os.path.join(d, n) for n in step_dirs(d) if check(os.path.join(d, n)) is None), None)


def names(d) -> list[str]:
    """The checkpoint dirs' steps, oldest first, and whatever else is in d."""
    return sorted(n[: len("step-00000001")] if n.startswith("step-") else n for n in os.listdir(d))


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
    ck = Checkpointer(str(tmp_path), PROC, async_save=True)
    want = tensors(model, opt)
    ck.save(1, model, opt, STATE)
    train_step(model, opt, seed=5)  # training goes on while the write runs: the snapshot must not see it
    deadline = time.time() + 60
    while not ck.pending_done() and time.time() < deadline:
        time.sleep(0.01)
    path = ck.finalize()
    assert path == str(tmp_path / f"step-00000001-{ck.token}") and latest_checkpoint(str(tmp_path)) == path
    files = [".metadata", "__0_0.distcp", "manifest-00000.json", "rng-00000.safetensors", "train_state.json"]
    assert sorted(os.listdir(path)) == files
    manifest = json.loads(open(os.path.join(path, "manifest-00000.json")).read())
    assert manifest["world_size"] == 1 and sorted(manifest["files"]) == sorted(set(files) - {"manifest-00000.json"})
    assert ck.finalize() is None and ck.pending_done()
    ck.save(2, model, opt, STATE)  # the same writer (and, on CUDA, its pinned copy) serves the next save
    second = ck.finalize()
    assert second.endswith(f"step-00000002-{ck.token}") and check(second) is None and check(path) is None
    ck.close()
    fresh, fresh_opt = make(seed=2)
    load_train_checkpoint(path, fresh, fresh_opt, 0)  # step 1 is kept (keep=2)
    state = read_train_state(path)
    assert state["step"] == 1 and state["world_size"] == 1
    assert_same(tensors(fresh, fresh_opt), want)


def test_sync_save_keeps_the_newest_and_clears_leftovers(group, tmp_path):
    model, opt = make()
    (tmp_path / f"step-00000009-0badc0de{STAGING}").mkdir()  # a killed save
    ck = Checkpointer(str(tmp_path), PROC, keep=2, async_save=False)
    for step in (1, 2, 3):
        ck.save(step, model, opt, STATE)
        assert ck.last().endswith(f"step-{step:08d}-{ck.token}")
    assert names(tmp_path) == ["step-00000002", "step-00000003"]


def test_a_save_never_reuses_a_name_and_the_run_resumed_prunes_the_other_attempt(group, tmp_path):
    """Two runs saving the same step (the second resumed from an older one) write two names: on SageMaker one
    host's deletion of the first attempt's files can then never remove another host's upload of the second."""
    model, opt = make()
    first = save_train_checkpoint(tmp_path, 1, model, opt)
    lost = save_train_checkpoint(tmp_path, 2, model, opt, keep=3)
    os.remove(os.path.join(lost, "manifest-00000.json"))  # this attempt never reached S3 whole
    ck = Checkpointer(str(tmp_path), PROC, keep=3, async_save=False)
    warnings = []
    assert ck.resume(model, opt, {}, {}, warnings.append, 100)[0] == 1 and ck.last() == first
    assert warnings == [
        f"warning: {lost} cannot be resumed (manifest-00000.json is missing (rank 0's files: a save or a sync that "
        "did not finish)); trying the one before it"
    ]
    ck.save(2, model, opt, STATE)
    again = ck.last()
    assert again != lost and os.path.basename(again).startswith("step-00000002-")
    assert step_dirs(str(tmp_path)) == [os.path.basename(again), os.path.basename(first)]  # the lost attempt pruned


def test_a_flipped_bit_in_a_shard_skips_that_checkpoint_naming_the_file(group, tmp_path):
    model, opt = make(seed=1)
    older = save_train_checkpoint(tmp_path, 1, model, opt, keep=3)
    want = tensors(model, opt)
    train_step(model, opt)
    newest = save_train_checkpoint(tmp_path, 2, model, opt, keep=3)
    assert check(newest) is None and latest_checkpoint(str(tmp_path)) == newest
    with open(distcp(newest), "r+b") as f:  # one bit, same size: only the sha256 can tell
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 1]))
    reason = "__0_0.distcp does not match its manifest (size or sha256): a damaged or partly synced file"
    assert check(newest) == reason and latest_checkpoint(str(tmp_path)) == older
    warnings = []
    fresh, fresh_opt = make(seed=3)
    step, state = resume(tmp_path, fresh, fresh_opt, {"model": CFG.to_dict()}, {}, warnings.append)
    assert step == 1 and state["step"] == 1
    assert warnings == [f"warning: {newest} cannot be resumed ({reason}); trying the one before it"]
    assert_same(tensors(fresh, fresh_opt), want)


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_truncated_or_missing_shard_is_incomplete_and_resume_takes_the_previous(group, tmp_path, damage):
    model, opt = make(seed=1)
    save_train_checkpoint(tmp_path, 1, model, opt, keep=3)
    train_step(model, opt)
    newest = save_train_checkpoint(tmp_path, 2, model, opt, keep=3)
    if damage == "truncate":  # a partial S3 sync
        with open(distcp(newest), "r+b") as f:
            f.truncate(os.path.getsize(distcp(newest)) - 1)
    else:
        os.remove(distcp(newest))
    assert check(newest) == (
        "__0_0.distcp is missing"
        if damage == "remove"
        else "__0_0.distcp does not match its manifest (size or sha256): a damaged or partly synced file"
    )
    assert resume(tmp_path, *make(seed=3), {"model": CFG.to_dict()}, {}, lambda line: None)[0] == 1


def test_step_dirs_that_all_fail_are_one_error_and_nothing_is_deleted(group, tmp_path):
    model, opt = make()
    older = save_train_checkpoint(tmp_path, 1, model, opt, keep=3)
    newer = save_train_checkpoint(tmp_path, 2, model, opt, keep=3)
    os.remove(os.path.join(older, "rng-00000.safetensors"))
    os.remove(os.path.join(newer, "manifest-00000.json"))
    before = sorted(os.path.relpath(os.path.join(r, f), tmp_path) for r, _, fs in os.walk(tmp_path) for f in fs)
    with pytest.raises(CheckpointError) as e:
        resume(tmp_path, model, opt, {}, {}, lambda line: None)
    assert str(e.value) == (
        f"{tmp_path}: no checkpoint can be resumed: {os.path.basename(newer)}: manifest-00000.json is missing "
        "(rank 0's files: a save or a sync that did not finish) (and 1 older); nothing was deleted; restore the "
        "missing files, or start fresh with --resume never --overwrite"
    )
    after = sorted(os.path.relpath(os.path.join(r, f), tmp_path) for r, _, fs in os.walk(tmp_path) for f in fs)
    assert after == before


def test_a_newest_checkpoint_that_fails_to_load_warns_once_and_the_previous_is_used(group, tmp_path):
    model, opt = make(seed=1)
    save_train_checkpoint(tmp_path, 1, model, opt, keep=3)
    want = tensors(model, opt)
    train_step(model, opt)
    newest = save_train_checkpoint(tmp_path, 2, model, opt, keep=3)
    os.remove(os.path.join(newest, "rng-00000.safetensors"))  # a file the manifest lists, yet loading decides
    with open(os.path.join(newest, "rng-00000.safetensors"), "wb") as f:
        f.write(b"not safetensors")
    manifest = os.path.join(newest, "manifest-00000.json")
    m = json.loads(open(manifest).read())
    m["files"]["rng-00000.safetensors"] = {"size": 15, "sha256": file_sha256(f.name)}
    open(manifest, "w").write(json.dumps(m))
    assert check(newest) is None
    warnings = []
    fresh, fresh_opt = make(seed=3)
    step, _ = resume(tmp_path, fresh, fresh_opt, {"model": CFG.to_dict()}, {}, warnings.append)
    assert step == 1 and len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"warning: {newest} cannot be resumed (")
    assert warnings[0].endswith("; trying the one before it")
    assert_same(tensors(fresh, fresh_opt), want)


def test_resume_refuses_another_model_and_warns_about_a_changed_seed(group, tmp_path):
    model, opt = make()
    path = save_train_checkpoint(tmp_path, 4, model, opt)
    other = {**CFG.to_dict(), "n_layers": 3}
    with pytest.raises(CheckpointError) as e:
        resume(tmp_path, model, opt, {"model": other}, {}, print)
    assert str(e.value) == (
        f"{path}: checkpoint was made with model={{'n_layers': 2}}, this run "
        f"has {{'n_layers': 3}}; use another --checkpoint-dir, or --resume never --overwrite to replace it"
    )
    warnings = []
    step, _ = resume(
        tmp_path,
        model,
        opt,
        {"model": CFG.to_dict(), "tokenizer_hash": "abc"},
        {"seed": 7, "global_batch": 8},
        warnings.append,
    )  # keys an old checkpoint lacks: fine
    assert step == 4 and warnings == [f"warning: resuming from {path} with changed seed=0->7"]
    assert resume(tmp_path / "none", model, opt, {}, {}, print) == (0, None)


class Payload:
    """Unpickling this runs a shell command: what a planted checkpoint file would do."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def test_a_planted_metadata_pickle_is_refused_and_never_runs(group, tmp_path):
    model, opt = make()
    good = save_train_checkpoint(tmp_path, 1, model, opt, keep=3)
    bad = save_train_checkpoint(tmp_path, 2, model, opt, keep=3)
    sentinel = tmp_path / "pwned"
    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(Payload(str(sentinel)), f)
    assert check(bad).startswith(".metadata does not match its manifest")  # checked without unpickling it
    with pytest.raises(CheckpointError) as e:
        load_train_checkpoint(bad, model, opt, 0)  # and were its manifest rewritten too, loading refuses it
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{bad}/.metadata: refused to unpickle ")
    assert "system" in str(e.value)
    warnings = []
    assert resume(tmp_path, model, opt, {}, {}, warnings.append)[0] == 1 and len(warnings) == 1
    assert not sentinel.exists()
    load_train_checkpoint(good, model, opt, 0)  # a real checkpoint still loads
    assert read_train_state(good)["step"] == 1


def test_a_planted_optimizer_value_loads_weights_only_and_never_runs(group, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = make()
    good = save_train_checkpoint(tmp_path, 1, model, opt, keep=3)
    bad = save_train_checkpoint(tmp_path, 2, model, opt, keep=3)
    sentinel = tmp_path / "pwned"
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["lr"] = Payload(str(sentinel))  # a non-tensor item: DCP pickles it whole
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=bad)
    with pytest.raises(CheckpointError, match="refused by weights_only=True"):
        load_train_checkpoint(bad, model, opt, 0)
    assert not sentinel.exists()
    warnings = []
    assert resume(tmp_path, model, opt, {}, {}, warnings.append)[0] == 1 and len(warnings) == 1
    assert not sentinel.exists()
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=bad)  # DCP's own loader: the payload runs
    assert sentinel.exists() and good


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_write_raises_one_error_and_keeps_the_last_one(group, tmp_path, monkeypatch, async_save):
    from torch.distributed.checkpoint import FileSystemWriter

    model, opt = make()
    ck = Checkpointer(str(tmp_path), PROC, async_save=async_save)
    ck.save(1, model, opt, STATE)
    first = ck.finalize() or ck.last()
    assert latest_checkpoint(str(tmp_path)) == first

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    # async: the write fails in the background and finalize() reports it; sync: save() itself raises. Either
    # way a CheckpointError (a ValueError, which train.py prints as one line), never DCP's BaseException.
    err = f"{tmp_path}: checkpoint of step 2 was not written .*No space.* GiB free on its disk.*the last complete one"
    with pytest.raises(CheckpointError, match=f"{err} is {first}$"):
        ck.save(2, model, opt, STATE)
        ck.finalize()
    assert latest_checkpoint(str(tmp_path)) == first
    monkeypatch.undo()
    ck.save(3, model, opt, STATE)
    ck.close()
    assert names(tmp_path) == ["step-00000001", "step-00000003"]  # the failed save's staging dir is gone too


@pytest.mark.parametrize("async_save", [True, False])
def test_a_full_disk_at_the_rank_files_is_the_same_one_error(group, tmp_path, monkeypatch, async_save):
    from safetensors import SafetensorError

    from minilm_az import checkpoint

    model, opt = make()
    ck = Checkpointer(str(tmp_path), PROC, async_save=async_save)

    def full(*args, **kwargs):  # what safetensors raises when the disk is full: neither OSError nor ValueError
        raise SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(CheckpointError, match=r": checkpoint of step 1 was not written .*No space"):
        ck.save(1, model, opt, STATE)
    monkeypatch.undo()
    ck.save(2, model, opt, STATE)  # the next save, with room again, goes through
    ck.close()
    assert latest_checkpoint(str(tmp_path)) == ck.last() and ck.last().endswith(f"step-00000002-{ck.token}")


KILLED = textwrap.dedent("""
    import os, sys, threading, time, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_dcp_checkpoint import STATE, make, train_step
    from minilm_az.checkpoint import Checkpointer
    from minilm_az.parallel import Process
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, opt = make(seed=1)
    ck = Checkpointer(sys.argv[1], Process(0, 1, 0, torch.device("cpu")), async_save=True)
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


def test_sigkill_during_an_async_write_leaves_the_previous_checkpoint_the_newest(group, tmp_path):
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
        (staging,) = ckpt.glob(f"step-00000002-*{STAGING}")  # a name SageMaker's agent never uploads
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    first = str(ckpt / f"{staging.name[: -len(STAGING)].replace('-00000002-', '-00000001-')}")
    assert step_dirs(str(ckpt)) == [os.path.basename(first)] and latest_checkpoint(str(ckpt)) == first
    model, opt = make(seed=4)
    ck = Checkpointer(str(ckpt), PROC, async_save=False)
    assert ck.resume(model, opt, {"model": CFG.to_dict()}, {}, print, 100)[0] == 1
    ck.save(2, model, opt, STATE)  # the next save clears the killed one's dir
    assert names(ckpt) == ["step-00000001", "step-00000002"] and not staging.exists()


TWO_RANKS = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_dcp_checkpoint import STATE, make, tensors, train_step
    from minilm_az.checkpoint import Checkpointer
    from minilm_az.parallel import Process
    rank, store, ckpt_dir, snapshot = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    model, opt = make(seed=1)
    want = tensors(model, opt)  # gathers: every rank
    if rank == 0:
        torch.save(want, snapshot)
    ck = Checkpointer(ckpt_dir, Process(rank, 2, 0, torch.device("cpu")), async_save=True)  # a host each
    ck.save(1, model, opt, STATE)
    train_step(model, opt)
    print(ck.finalize())
    ck.close()
    dist.destroy_process_group()
""")


def test_two_ranks_on_two_hosts_async_save_then_resume_on_one(group, tmp_path):
    # Two hosts on one shared dir (several hosts with disks of their own are refused at start: test_s3_checkpoint).
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS.format(tests=os.path.dirname(os.path.abspath(__file__))))
    dirs = [tmp_path / "host0", tmp_path / "host0"]
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
    (name,) = step_dirs(str(dirs[0]))
    step1 = dirs[0] / name
    assert [out.strip() for out, _ in outs] == [str(dirs[0] / name), str(dirs[1] / name)]  # what finalize returned
    assert sorted(os.listdir(step1)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest-00000.json",
        "manifest-00001.json",
        "rng-00000.safetensors",
        "rng-00001.safetensors",
        "train_state.json",
    ]
    assert check(str(step1)) is None
    model, opt = make(seed=3)
    assert resume(dirs[0], model, opt, {"model": CFG.to_dict()}, {}, print)[0] == 1
    assert_same(tensors(model, opt), torch.load(tmp_path / "want.pt"))


def test_frozen_weights_are_not_saved_and_the_trainable_ones_resume(group, tmp_path):
    """Phase 1 and a fine-tune freeze most weights: the checkpoint holds what trains, and loads without the rest."""
    model, opt = make(seed=1)
    for name, p in model.named_parameters():
        p.requires_grad_("embed_tokens" in name)
    path = save_train_checkpoint(tmp_path, 1, model, opt)
    saved = {k for k in read_metadata(path).state_dict_metadata if k.startswith("model.")}
    assert "model.model.embed_tokens.weight" in saved  # and the head, which is the same tensor (tied)
    assert saved <= {"model.model.embed_tokens.weight", "model.lm_head.weight"}
    want = tensors(model, opt)["model.model.embed_tokens.weight"]
    fresh, fresh_opt = make(seed=2)
    for name, p in fresh.named_parameters():
        p.requires_grad_("embed_tokens" in name)
    assert resume(tmp_path, fresh, fresh_opt, {}, {}, print)[0] == 1
    assert torch.equal(tensors(fresh, fresh_opt)["model.model.embed_tokens.weight"], want)


def _manifest(path: str) -> tuple[str, dict]:
    file = os.path.join(path, "manifest-00000.json")
    return file, json.loads(open(file).read())


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("unlisted data", "__0_0.distcp is read by .metadata but no manifest lists it"),
        ("no rng", "manifest-00000.json is not a manifest of this checkpoint's rank 0"),
        ("infinite world", "manifest-00000.json is unreadable (OverflowError)"),
        ("deep json", "manifest-00000.json is unreadable (RecursionError)"),
        ("unreadable file", "rng-00000.safetensors is unreadable"),
    ],
)
def test_a_manifest_that_cannot_vouch_for_the_checkpoint_skips_it(group, tmp_path, monkeypatch, damage, reason):
    model, opt = make()
    save_train_checkpoint(tmp_path, 1, model, opt, keep=3)
    newest = save_train_checkpoint(tmp_path, 2, model, opt, keep=3)
    file, m = _manifest(newest)
    if damage == "unlisted data":  # then a changed data file would go unseen
        del m["files"]["__0_0.distcp"]
    elif damage == "no rng":
        del m["files"]["rng-00000.safetensors"]
    if damage == "infinite world":
        open(file, "w").write(json.dumps(m).replace('"world_size": 1', '"world_size": 1e400'))
    elif damage == "deep json":
        open(file, "w").write("[" * 100_000 + "]" * 100_000)
    else:
        open(file, "w").write(json.dumps(m))
    if damage == "unreadable file":  # a bad sector: reading fails with EIO (root reads past any chmod)
        from minilm_az import checkpoint

        def sha256(file):
            if file.startswith(newest) and file.endswith("rng-00000.safetensors"):
                raise OSError(errno.EIO, "Input/output error")
            return file_sha256(file)

        monkeypatch.setattr(checkpoint, "file_sha256", sha256)
    got = check(newest)
    assert got is not None and got.startswith(reason), got
    assert resume(tmp_path, model, opt, {}, {}, lambda line: None)[0] == 1


def test_dirs_named_like_checkpoints_of_another_format_are_not_ignored(group, tmp_path):
    """A step dir without manifests (an older version's, a copy by hand) is never passed over silently."""
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "train_state.json").write_text("{}")
    model, opt = make()
    with pytest.raises(CheckpointError, match="no checkpoint can be resumed: step-00000004: manifest-00000.json is"):
        resume(tmp_path, model, opt, {}, {}, lambda line: None)
    assert step_dirs(str(tmp_path)) == ["step-00000004"]


def test_a_checkpoint_past_the_runs_steps_is_refused(group, tmp_path):
    model, opt = make()
    path = save_train_checkpoint(tmp_path, 8, model, opt)
    with pytest.raises(CheckpointError, match=f"^{path}: at step 8, past --steps 4; use --resume never --overwrite$"):
        Checkpointer(str(tmp_path), PROC, async_save=False).resume(model, opt, {}, {}, print, steps=4)


def test_a_checkpoint_dir_renamed_to_a_newer_step_is_skipped_with_a_warning_and_nothing_deleted(group, tmp_path):
    """A copy of step 1 renamed to step 7 (its manifests intact, so it checks as complete) records step 1 in its
    train_state.json: resuming it would take step 1's weights for step 7's and prune the real step 2."""
    model, opt = make(seed=1)
    first = save_train_checkpoint(tmp_path, 1, model, opt, keep=3)
    train_step(model, opt)
    save_train_checkpoint(tmp_path, 2, model, opt, keep=3)
    want = tensors(model, opt)
    renamed = os.path.join(tmp_path, os.path.basename(first).replace("step-00000001", "step-00000007"))
    shutil.copytree(first, renamed)
    assert check(renamed) is None
    before = sorted(os.listdir(tmp_path))
    warnings = []
    fresh, fresh_opt = make(seed=3)
    step, saved = resume(tmp_path, fresh, fresh_opt, {"model": CFG.to_dict()}, {}, warnings.append)
    assert (step, saved["step"], len(warnings)) == (2, 2, 1), warnings
    assert warnings[0] == (
        f"warning: {renamed} cannot be resumed (train_state.json records step 1, not the step its folder "
        f"{os.path.basename(renamed)} is named for); trying the one before it"
    )
    assert_same(tensors(fresh, fresh_opt), want)
    assert sorted(os.listdir(tmp_path)) == before
