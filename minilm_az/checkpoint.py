"""Training checkpoints (DCP) on one disk or on S3, manifests, `resume`, and the loop's `RunControl`.

A save is written with `torch.distributed.checkpoint` into a staging dir, each rank then writes a manifest of its
files (sizes, sha256), and the dir is renamed into place (`Checkpointer`, synchronous or in the background);
on S3 every rank's objects, then a commit object (`S3Checkpointer`);
`Checkpointer.resume` loads the newest checkpoint whose every manifest is present and matches, agreed by all
ranks; `RunControl` decides when the loop saves and stops. Nothing in a checkpoint is unpickled freely: DCP's
`.metadata` admits only DCP's own classes, everything else loads with weights_only=True. Model weights in and
out of Hugging Face directories live in hf.py.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
import math
import os
import pickle
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load, save, save_file

from minilm_az import outputs, s3
from minilm_az.logs import MetricLogger
from minilm_az.outputs import atomic_write_json, file_sha256, read_json
from minilm_az.parallel import Process, agree, all_reduce_sum, env_number


class CheckpointError(ValueError):
    """A training checkpoint that cannot be written, read or continued; the message names the file."""


# ---------------------------------------------------------------- training checkpoints (DCP)
#
# ckpt_dir/step-00001000-3fa9c2d1/   .metadata and train_state.json (rank 0), and per rank R: __R_0.distcp (DCP),
#                                    rng-0000R.safetensors, and manifest-0000R.json listing R's files
# ckpt_dir/step-00001000-3fa9c2d1.sagemaker-ignore/   the same save while it is written
#
# The dir is one disk every rank sees: one host's, or a file system all hosts share (several hosts with disks of
# their own are refused at start; they checkpoint to s3://). Rank 0 renames a save into place once every rank's
# write returned, so a step dir is whole when it exists, and the manifests (sizes, sha256) still catch what
# happens to files afterwards: a copy that stopped short, a flipped byte. A save never reuses a dir name (the
# step and a token drawn once per run), so a resumed run's new attempt at a step never meets an old one's files.
# The staging suffix is the one SageMaker's checkpoint sync skips, so that a job whose own estimator syncs this dir
# uploads finished saves only; nothing here depends on that sync.

_STEP_DIR = re.compile(r"step-(\d+)(-\w+)?")  # what this version writes, and anything else named like it
# The names this code makes: pruning removes only these, never a name a user gave a checkpoint (step-...-best).
OURS = re.compile(r"step-(\d{8})-[0-9a-f]{8}")
STAGING = ".sagemaker-ignore"
MANIFEST = "manifest-{:05d}.json"


# DCP's `.metadata` is a pickle, so a file planted in a checkpoint dir could run code when read. These are
# the only globals a model + optimizer checkpoint's metadata holds (found by tracing find_class on real
# saves, FSDP2 and plain); every torch dtype is allowed too. Anything else is refused before it is called.
_DCP_CLASSES = "Metadata MetadataIndex StorageMeta TensorProperties TensorStorageMetadata ChunkStorageMetadata"
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in _DCP_CLASSES.split()),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),  # the save's checkpoint_id (3.13 moved the class)
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, name: str):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.name}: refused to unpickle {module}.{name}: not DCP checkpoint metadata "
            f"(a tampered or foreign file)"
        )


def read_metadata(path: str):
    """DCP's Metadata of a checkpoint dir, unpickled with only DCP's own classes allowed."""
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f, file).load()
    except CheckpointError:
        raise
    except Exception as e:  # a truncated pickle fails in many ways
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {e})") from None


def _rank_files(path: str | None, rank: int) -> list[str]:
    """The files `rank` wrote into checkpoint dir `path`: its DCP data and RNG, and rank 0's metadata and state
    (path None: the ones every rank writes, whatever DCP's data files are)."""
    names = [n for n in os.listdir(path) if re.fullmatch(rf"__{rank}_\d+\.distcp", n)] if path else []
    return sorted(names + [f"rng-{rank:05d}.safetensors"] + ([".metadata", "train_state.json"] if rank == 0 else []))


def _write_manifest(path: str, step: int, rank: int, world: int) -> None:
    files = {}
    for name in _rank_files(path, rank):
        file = os.path.join(path, name)
        files[name] = {"size": os.path.getsize(file), "sha256": file_sha256(file)}
    atomic_write_json(os.path.join(path, MANIFEST.format(rank)), {"step": step, "world_size": world, "files": files})


def _read_manifests(path: str) -> tuple[list[tuple[str, dict]], str | None]:
    """Every file that the manifests of checkpoint dir `path` list, with what it must be; or what is missing."""
    listed, rank, world = [], 0, 1
    while rank < world:
        name = MANIFEST.format(rank)
        if not os.path.isfile(os.path.join(path, name)):
            return [], f"{name} is missing (rank {rank}'s files: a save or a sync that did not finish)"
        try:
            with open(os.path.join(path, name)) as fh:
                m = json.load(fh)
            world, files = (world if rank else int(m["world_size"])), m["files"].items()
            typed = all(isinstance(f["size"], int) and isinstance(f["sha256"], str) for _, f in files)
            names = {os.path.basename(n) for n, _ in files}  # a name is a file of this dir, nothing else
            if m["world_size"] != world or not typed or not set(_rank_files(None, rank)) <= names:
                return [], f"{name} is not a manifest of this checkpoint's rank {rank}"
        except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
            return [], f"{name} is unreadable ({type(e).__name__})"
        listed += sorted((os.path.basename(n), f) for n, f in files)
        rank += 1
    return listed, None


def check(path: str, share: int = 0, shares: int = 1) -> str | None:
    """None if checkpoint dir `path` is complete, else what is missing or wrong, naming the file.

    Complete: every rank's manifest is present and each file it lists has its size and sha256. Of the files, this
    call reads every `shares`-th from `share` on: the local ranks of a host split the reading of its disk.
    """
    listed, missing = _read_manifests(path)
    if missing:
        return missing
    for i, (name, want) in enumerate(listed):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        try:
            if i % shares == share and (os.path.getsize(file), file_sha256(file)) != (want["size"], want["sha256"]):
                return f"{name} does not match its manifest (size or sha256): a damaged or partly synced file"
        except OSError as e:
            return f"{name} is unreadable ({e.strerror})"
    try:  # every data file that loading reads must be one the manifests vouch for
        unlisted = {i.relative_path for i in read_metadata(path).storage_data.values()} - {n for n, _ in listed}
    except CheckpointError as e:
        return str(e).removeprefix(f"{path}/")
    return f"{sorted(unlisted)[0]} is read by .metadata but no manifest lists it" if unlisted else None


def step_dirs(ckpt_dir: str) -> list[str]:
    """Names of the checkpoint dirs in ckpt_dir (not staging ones), newest step first."""
    if not os.path.isdir(ckpt_dir):
        return []
    names = [d for d in os.listdir(ckpt_dir) if _STEP_DIR.fullmatch(d)]
    return sorted(names, key=lambda d: (int(_STEP_DIR.fullmatch(d).group(1)), d), reverse=True)


def _write_rank_files(tmp: str, step: int, train_state: dict, rank: int) -> None:
    # RNG of this rank, and (rank 0) the run's state: both of the moment the model state is snapshotted.
    rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
    save_file(rng, os.path.join(tmp, f"rng-{rank:05d}.safetensors"))
    os.chmod(os.path.join(tmp, f"rng-{rank:05d}.safetensors"), 0o644)  # safetensors writes 0600; DCP's files are 0644
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        atomic_write_json(os.path.join(tmp, "train_state.json"), {**train_state, "step": step, "world_size": world})


# The files a save writes into its dir (DCP's data and metadata, with their temporary names, and ours).
_SAVED = re.compile(
    r"__\d+_\d+\.distcp|rng-\d{5}\.safetensors|(__\d+)?\.metadata(\.tmp)?|train_state\.json|manifest-\d{5}\.json"
    r"|\.(train_state\.json|manifest-\d{5}\.json)\.\w+\.tmp"
)


def _prune(ckpt_dir: str, kept: list[str]) -> None:
    """Remove every checkpoint dir but `kept`, and the staging dirs of saves that never finished.

    The others are older than --keep-checkpoints, incomplete (a save or sync that never finished: nothing can
    complete it now), or another run's that this one did not continue or replaces (--overwrite). Only the files a
    save writes go: a dir that holds anything else keeps it, renamed NAME.kept so that no resume takes it for one.
    """
    for name in os.listdir(ckpt_dir):
        if (OURS.fullmatch(name) and name not in kept) or (name.startswith("step-") and name.endswith(STAGING)):
            path = os.path.join(ckpt_dir, name)
            try:
                for file in os.listdir(path):
                    if _SAVED.fullmatch(file) and not os.path.isdir(os.path.join(path, file)):
                        os.remove(os.path.join(path, file))
                if os.listdir(path):
                    os.rename(path, f"{path}.kept")
                else:
                    os.rmdir(path)
            except OSError:  # what stays is pruned by the next save's finalize; the run goes on
                pass


def _inner(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (else `e`)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return e


def _one_line(e: BaseException) -> str:
    """A short reason for a failure; DCP wraps each rank's exception in a CheckpointException."""
    e = _inner(e)
    text = str(e).strip()
    if "Weights only load failed" in text:  # torch's advice (load with weights_only=False) is what must not happen
        reason = text.split("WeightsUnpickler error:")[-1].strip().splitlines()
        return f"a data item is corrupt or not plain data, refused by weights_only=True ({reason[0] if reason else ''})"
    lines = text.splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


class Checkpointer:
    """Training checkpoints of one run: write a save (sync, or in the background), publish it, keep `keep`.

    With `async_save` the model and optimizer state are copied to CPU memory inside save() (on CUDA into
    pinned buffers made at the first save and reused after), and DCP writes that copy from a background
    thread while training goes on; its collectives run on a gloo group of their own, never on the training
    job's NCCL. A write is published (manifests written, renamed into place, older ones pruned) only by
    finalize(), which every rank calls at the same step. Building one is collective.
    """

    def __init__(self, ckpt_dir: str, proc: Process, keep: int = 2, async_save: bool = True):
        self.ckpt_dir, self.proc, self.keep, self.async_save = ckpt_dir, proc, keep, async_save
        self.local_ranks = env_number("LOCAL_WORLD_SIZE", 1, lo=1)  # the processes that share this host's disk
        self.kept: list[str] = []  # complete checkpoints of this run (the one resumed, then the saved), oldest first
        self._pending = None  # (step, name, future or None)
        self._group = self._writer = None
        self._error: str | None = None  # why this rank's pending write failed, once it has
        if async_save or dist.is_initialized():  # a CPU group for the error flags too: NCCL takes no CPU tensors
            self._group = dist.new_group(backend="gloo")
        token = [secrets.token_hex(4)]  # one per run: with the step, a name no earlier save attempt can have had
        if dist.is_initialized() and proc.world_size > 1:
            dist.broadcast_object_list(token, src=0)
        self.token = token[0]

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self._group)

    def save(self, step: int, model, optimizer, train_state: dict) -> None:
        """Start writing step's checkpoint; returns once the state is copied off the device (async) or written
        and published (sync). A previous pending save is finalized first. Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        self.finalize()  # one write in flight at most: the staging buffers are reused
        name = f"step-{step:08d}-{self.token}"
        tmp = os.path.join(self.ckpt_dir, name + STAGING)
        if self.proc.local_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, exist_ok=True)
        self._barrier()
        # Frozen weights (phase 1's backbone, a fine-tune's base) are rebuilt from their inputs at resume, which
        # the train state's fingerprints pin: a checkpoint holds only what trains.
        model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
        state = {"model": model_sd, "optim": optim_sd}
        error = None
        try:
            _write_rank_files(tmp, step, train_state, self.proc.rank)
        except Exception as e:  # a full disk shows here first (safetensors' error is not an OSError)
            error = _one_line(e)
        if error := _first_error(error):  # every rank learns of it: none goes on into DCP's collectives alone
            raise self._not_written(step, error)
        if self.async_save:
            writer, group = self._async_writer(tmp), self._group
            fut = dcp.async_save(self._staged(state), checkpoint_id=tmp, storage_writer=writer, process_group=group)
            fut = getattr(fut, "upload_completion", fut)
            # The manifest's sha256 reads every file back (~1 s a GB): in a thread of its own too, since hashlib
            # lets go of the GIL, so that training does not wait for it.
            manifest = threading.Thread(target=self._manifest_after, args=(fut, tmp, step), daemon=True)
            manifest.start()
            self._pending = (step, name, manifest)
        else:
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                dcp.save(state, checkpoint_id=tmp)
            except (Exception, CheckpointException) as e:  # DCP gathers every rank's error: all raise alike
                if isinstance(_inner(e), KeyboardInterrupt):  # Ctrl-C, which DCP wraps too: not a write failure
                    raise KeyboardInterrupt from None
                raise self._not_written(step, _one_line(e)) from None
            self._pending = (step, name, None)
            self.finalize()

    def _async_writer(self, tmp: str):
        """One DCP writer for the run: it also stages (copies the state to CPU) and keeps the pinned copy.

        Not DCP's DefaultStager: in torch 2.11 it clears itself after each stage and the next save fails,
        and SageMaker's torch 2.8 may lack it; FileSystemWriter(cache_staged_state_dict) is in all of them.
        """
        from torch.distributed.checkpoint import FileSystemWriter

        if self._writer is None:
            self._writer = FileSystemWriter(tmp, cache_staged_state_dict=torch.cuda.is_available())
        return self._writer  # async_save points it at this save's checkpoint_id

    def _staged(self, state: dict) -> dict:
        # Without CUDA the writer's staging may hand back the very CPU tensors training goes on updating
        # (torch versions differ), so the snapshot is taken here.
        return state if torch.cuda.is_available() else copy.deepcopy(state)

    def pending_done(self) -> bool:
        """Local and non-blocking: no save pending, or this rank's part of it (its files and manifest) is written."""
        return self._pending is None or self._pending[2] is None or not self._pending[2].is_alive()

    def finalize(self) -> str | None:
        """Collective: wait for the pending write on every rank, then publish it: each rank's manifest, the rename
        into place (once per disk), the pruning of what it supersedes.

        Returns its path, or None when nothing was pending (then it costs nothing and talks to no rank).
        Raises CheckpointError on every rank if any rank's write failed; nothing older is pruned then.
        """
        if self._pending is None:
            return None
        step, name, fut = self._pending
        self._pending = None
        tmp, final = os.path.join(self.ckpt_dir, name + STAGING), os.path.join(self.ckpt_dir, name)
        if fut is None:  # sync; a failed write raised in save() already, on every rank (DCP gathers errors)
            self._manifest_after(None, tmp, step)
        else:
            fut.join()
        error = self._error
        self._error = None
        flag = torch.tensor([error is not None], dtype=torch.int32)
        if dist.is_initialized():  # every rank learns of a failure anywhere, so all take the same path
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if flag.item():
            raise self._not_written(step, error or "failed on another rank")
        # Now complete on every rank: rank 0 renames it into place on the one disk they all see, and prunes.
        self.kept = [*self.kept, name][-self.keep :]
        if self.proc.rank == 0:
            os.replace(tmp, final)
            _prune(self.ckpt_dir, self.kept)
        self._barrier()
        return final

    def _not_written(self, step: int, reason: str) -> CheckpointError:
        # A full disk shows up as torch's "unexpected pos" or an ENOSPC deep in DCP: the free space says which.
        free = shutil.disk_usage(self.ckpt_dir).free / 2**30
        return CheckpointError(
            f"{self.ckpt_dir}: checkpoint of step {step} was not written ({reason}; {free:.1f} GiB free on its disk); "
            f"the last complete one is {self.last() or 'none yet'}"
        )

    def last(self) -> str | None:
        """The path of this run's newest complete checkpoint (resumed or saved), if any."""
        return os.path.join(self.ckpt_dir, self.kept[-1]) if self.kept else None

    def _manifest_after(self, write, tmp: str, step: int) -> None:
        """Wait for DCP's `write` (a future; None: done), then write this rank's manifest; any failure to _error."""
        try:
            if write is not None:
                write.result()
            _write_manifest(tmp, step, self.proc.rank, self.proc.world_size)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._error = _one_line(e)

    def close(self) -> None:
        """Finalize a pending save (collective), then release the pinned copy and the gloo group."""
        self.finalize()
        self._writer = None  # frees the pinned copy
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
            self._group = None

    def resume(self, model, optimizer, must_match: dict, may_change: dict, warn, steps: int) -> tuple[int, dict | None]:
        """Load the newest checkpoint that is complete on every host and loads; (step, train_state), or (0, None)
        when ckpt_dir holds none at all.

        Collective. Every rank checks its share of its own disk's files against the manifests, and a checkpoint
        counts only if no rank found a problem; one that does not count, or does not load, gives a warning naming
        the file and the one before it is tried. When checkpoint dirs exist but none can be resumed, that is an
        error, never a silent start from step 0 (--resume never starts fresh). A checkpoint saved with another
        value of a `must_match` key (model shape, phase) raises; changed `may_change` keys (seed, batch) give one
        warning line. `warn(line)` is called on rank 0 only.
        """
        rank = self.proc.rank
        names = _agreed(step_dirs(self.ckpt_dir), self.ckpt_dir, self.proc)
        skipped = []
        for i, name in enumerate(names):
            path = os.path.join(self.ckpt_dir, name)
            error = _first_error(check(path, self.proc.local_rank, self.local_ranks))
            if error is None:
                saved = _on_rank0(functools.partial(read_train_state, path), rank)
                error = _step_problem(name, saved)  # the same on every rank: rank 0 read it for all
            if error is None:
                changed = _check_state(path, saved, must_match, may_change)
                if int(saved["step"]) > steps:  # its export would be a later model than the one asked for
                    msg = f"at step {saved['step']}, past --steps {steps}; use --resume never --overwrite"
                    raise CheckpointError(f"{path}: {msg}")
                try:
                    load_train_checkpoint(path, model, optimizer, rank)
                except CheckpointError as e:
                    error = str(e).removeprefix(f"{path}: ")
                except Exception as e:  # a corrupt RNG file, a rank's own failure
                    error = _one_line(e)
                error = _first_error(error)
            if error is None:
                if changed and rank == 0:
                    warn(f"warning: resuming from {path} with changed {', '.join(changed)}")
                self.kept = names[i : i + self.keep][::-1]
                return int(saved["step"]), saved
            skipped.append(f"{name}: {error}")
            if rank == 0:
                warn(f"warning: {path} cannot be resumed ({error}); trying the one before it")
        if skipped:  # the model may be partly overwritten by failed loads, and a silent restart loses the run
            more = f" (and {len(skipped) - 1} older)" if len(skipped) > 1 else ""
            raise CheckpointError(
                f"{self.ckpt_dir}: no checkpoint can be resumed: {skipped[0]}{more}; nothing was deleted; restore "
                f"the missing files, or start fresh with --resume never --overwrite"
            )
        return 0, None

    def start(self, model, optimizer, must: dict, may: dict, log, steps: int, fresh: bool, overwrite: bool, out) -> int:
        """The step this run starts from (a checkpoint's, or 0); a finished `out` with none to continue from is refused
        without --overwrite. The log's file opens after every refusal: a refused run writes no line to it."""
        step = self._fresh(overwrite) if fresh else self.resume(model, optimizer, must, may, log.info, steps)[0]
        if not fresh and not step:
            mine = out if self.proc.is_main else None
            agree(lambda: outputs.check_finished(mine, overwrite, self.ckpt_dir), self.proc)
        log.open()
        return step

    def _fresh(self, overwrite: bool) -> int:
        """Replace an earlier run's checkpoints with --overwrite (once this run's first save is complete); refused
        without (its first save would prune them)."""
        names = _agreed(step_dirs(self.ckpt_dir), self.ckpt_dir, self.proc)
        if names and not overwrite:
            raise CheckpointError(
                f"{self.ckpt_dir} holds an earlier run's checkpoints ({names[0]}): --overwrite replaces them"
            )
        return 0  # the first save's finalize prunes them: a run stopped before it leaves them whole


# ---------------------------------------------------------------- checkpoints on S3
#
# s3://BUCKET/PREFIX/step-00001000-3fa9c2d1/   .metadata (DCP's coordinator, after every rank's data), __R_0.distcp
#                                               and rng-0000R.safetensors per rank R, train_state.json (rank 0),
#                                               and last commit.json (rank 0): the object that makes it a checkpoint
#
# Every rank writes its own objects straight to S3 (s3torchconnector's DCP writer); no host's disk holds a copy that
# must reach S3 later. A PUT is atomic and S3 reads after writes and lists consistently, so once commit.json exists,
# every host sees the same complete checkpoint. It is written only after every rank's writes returned, and it
# lists each object with its size, so a resume checks the listing against it before loading anything.

COMMIT = "commit.json"


def phase_dir(ckpt_dir: str, phase: int) -> str:
    """ckpt_dir/phaseN, where train.py's phase saves. A link there is refused: no flag named it, and the saves and
    their prunes would go wherever it points (another run's dir, the shards)."""
    path = os.path.join(ckpt_dir, f"phase{phase}")
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symlink to {os.path.realpath(path)}; a run never writes through a link")
    return path


def open_checkpoints(ckpt_dir: str, proc: Process, keep: int = 2, async_save: bool = True) -> Checkpointer:
    """The Checkpointer for `ckpt_dir`: a local (or shared) directory, or an s3:// prefix. Collective."""
    return (
        S3Checkpointer(ckpt_dir, proc, keep, async_save)
        if s3.is_s3(ckpt_dir)
        else Checkpointer(ckpt_dir, proc, keep, async_save)
    )


def _rng_bytes() -> bytes:
    rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
    return save(rng)


def _s3_metadata(store: s3.Store, path: str):
    """DCP's Metadata of checkpoint `path` on S3, unpickled with only DCP's own classes allowed."""
    key = f"{store.where.key(path.removeprefix(store.uri).strip('/'))}/.metadata"
    try:
        return _MetadataUnpickler(io.BytesIO(store.get(key)), f"s3://{store.where.bucket}/{key}").load()
    except CheckpointError:
        raise
    except Exception as e:  # a missing or truncated object fails in many ways
        raise CheckpointError(f"s3://{store.where.bucket}/{key}: unreadable ({_one_line(e)})") from None


class S3Checkpointer(Checkpointer):
    """Checkpoints under an s3:// prefix: each rank writes its part, rank 0 commits once all have, a resume reads
    the newest committed one straight from S3. The loop sees the same interface as the local Checkpointer's."""

    def __init__(self, ckpt_dir: str, proc: Process, keep: int = 2, async_save: bool = True):
        self.store = s3.Store(ckpt_dir)
        super().__init__(self.store.uri, proc, keep, async_save)
        self.seen: set[str] = set()  # the folders under the prefix when this run started (resume or _fresh)
        self.replaced: set[str] = set()  # an earlier run's checkpoints this one replaces (--overwrite)

    def _key(self, name: str, file: str = "") -> str:
        return self.store.where.key(name, file)

    def _listing(self) -> dict[str, dict[str, tuple[int, str]]]:
        """name -> {file: (size, ETag)} of every step-* folder under the prefix (one LIST, paginated)."""
        found: dict[str, dict[str, tuple[int, str]]] = {}
        base = self.store.where.key() + "/" if self.store.where.key() else ""
        for key, object_info in self.store.list(base).items():
            parts = key[len(base) :].split("/")
            if len(parts) == 2 and _STEP_DIR.fullmatch(parts[0]):
                found.setdefault(parts[0], {})[parts[1]] = object_info
        return found

    def save(self, step: int, model, optimizer, train_state: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        self.finalize()
        name = f"step-{step:08d}-{self.token}"
        model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
        state = {"model": model_sd, "optim": optim_sd}
        # The RNG and the run's state of the moment the model state is snapshotted; uploaded after DCP's objects.
        extra = {f"rng-{self.proc.rank:05d}.safetensors": _rng_bytes()}
        if self.proc.rank == 0:
            world = self.proc.world_size
            extra["train_state.json"] = json.dumps({**train_state, "step": step, "world_size": world}).encode()
        uri = f"{self.ckpt_dir}/{name}"
        if self.async_save:
            if self._writer is None:
                self._writer = self.store.writer(uri, cache_staged_state_dict=torch.cuda.is_available())
            fut = dcp.async_save(
                self._staged(state), checkpoint_id=uri, storage_writer=self._writer, process_group=self._group
            )
            fut = getattr(fut, "upload_completion", fut)
            upload = threading.Thread(target=self._upload_after, args=(fut, name, extra), daemon=True)
            upload.start()
            self._pending = (step, name, upload)
        else:
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                dcp.save(state, checkpoint_id=uri, storage_writer=self.store.writer(uri))
            except (Exception, CheckpointException) as e:
                if isinstance(_inner(e), KeyboardInterrupt):
                    raise KeyboardInterrupt from None
                raise self._not_written(step, _one_line(e)) from None
            self._upload_after(None, name, extra)
            self._pending = (step, name, None)
            self.finalize()

    def _upload_after(self, write, name: str, extra: dict[str, bytes]) -> None:
        """Wait for DCP's `write` (None: done), then put this rank's RNG (and rank 0's train state); failures to
        _error."""
        try:
            if write is not None:
                write.result()
            for file, data in extra.items():
                self.store.put(self._key(name, file), data)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._error = _one_line(e)

    def finalize(self) -> str | None:
        """Collective: wait for every rank's part of the pending save, then rank 0 commits it (a listing of its
        objects, written last) and prunes what the commit supersedes. Raises on every rank if any part failed:
        no commit is written then, and nothing is pruned."""
        if self._pending is None:
            return None
        step, name, thread = self._pending
        self._pending = None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        error = _first_error_in(error, self._group)  # every rank learns of a failure anywhere
        if error is None:
            commit_error = None
            if self.proc.rank == 0:
                try:
                    listing = self._listing()
                    # S3 has no lock that a killed run would let go of. A commit that is neither this run's nor
                    # was there at its start is another live run's, whose checkpoints this one's prune would
                    # delete (a killed run's uploads may still land late, but never with a commit after them).
                    new = [n for n in sorted(listing) if n not in self.seen and not n.endswith(f"-{self.token}")]
                    other = [n for n in new if COMMIT in listing[n]]
                    if other:
                        raise CheckpointError(
                            f"another run writes under this prefix ({other[0]} appeared since this "
                            "one started): one prefix takes one run at a time"
                        )
                    objects = listing.get(name, {})
                    objects.pop(COMMIT, None)
                    missing = self._expected(self.proc.world_size) - set(objects)
                    if missing:  # S3 lists what it holds: a commit must never name an object it lacks
                        raise CheckpointError(f"{sorted(missing)[0]} is not in S3's listing")
                    sizes, etags = ({f: info[i] for f, info in objects.items()} for i in (0, 1))
                    commit = {"step": step, "world_size": self.proc.world_size, "objects": sizes, "etags": etags}
                    self.store.put(self._key(name, COMMIT), json.dumps(commit, sort_keys=True).encode())
                except Exception as e:  # the client's S3Exception, after its own retries
                    commit_error = str(e) if isinstance(e, CheckpointError) else f"{COMMIT}: {_one_line(e)}"
            error = _first_error_in(commit_error, self._group)
        if error:
            raise self._not_written(step, error)
        self.kept = [*self.kept, name][-self.keep :]
        if self.proc.rank == 0:
            self._prune()
        self._barrier()
        return f"{self.ckpt_dir}/{name}"

    @staticmethod
    def _expected(world_size: int) -> set[str]:
        """The objects a save on `world_size` ranks writes besides DCP's data: each rank's RNG, the state, .metadata."""
        return {".metadata", "train_state.json", *(f"rng-{r:05d}.safetensors" for r in range(world_size))}

    def _prune(self, keep: list[str] | None = None) -> None:
        """Delete this code's checkpoints that the newest commit supersedes: committed ones older than the kept,
        and leftovers of saves that never committed, older than the newest commit. A user's names stay. Each
        checkpoint loses its commit first, so that one half deleted reads as uncommitted, never as complete."""
        kept = self.kept if keep is None else keep
        newest = max((int(OURS.fullmatch(n).group(1)) for n in kept if OURS.fullmatch(n)), default=None)
        for name, files in sorted(self._listing().items()):
            match = OURS.fullmatch(name)
            if not match or name in kept:
                continue
            if newest is not None and int(match.group(1)) > newest and name not in self.replaced:
                continue
            for file in sorted(files, key=lambda f: f != COMMIT):
                try:
                    self.store.delete(self._key(name, file))
                except Exception:  # a leftover that stays is pruned by the next commit; the run goes on
                    break

    def _not_written(self, step: int, reason: str) -> CheckpointError:
        return CheckpointError(
            f"{self.ckpt_dir}: checkpoint of step {step} was not written ({reason}); the last committed one is "
            f"{self.last() or 'none yet'}"
        )

    def last(self) -> str | None:
        return f"{self.ckpt_dir}/{self.kept[-1]}" if self.kept else None

    def pending_done(self) -> bool:
        return self._pending is None or self._pending[2] is None or not self._pending[2].is_alive()

    def resume(self, model, optimizer, must_match: dict, may_change: dict, warn, steps: int) -> tuple[int, dict | None]:
        """Load the newest committed checkpoint under the prefix; (step, train_state), or (0, None) when the prefix
        holds no checkpoint objects at all. Every rank lists the prefix itself and all must see the same; an
        uncommitted or unloadable checkpoint gives a warning naming it and the one before it is tried; objects but
        nothing that loads is an error (exit 2), and nothing is deleted."""
        rank = self.proc.rank
        listing = self._listing()
        self.seen = set(listing)
        view = [(n, COMMIT in files) for n, files in listing.items()]
        view = sorted(view, key=lambda v: (int(_STEP_DIR.fullmatch(v[0]).group(1)), v[0]), reverse=True)
        names = _agreed([f"{n}{'' if c else ' (uncommitted)'}" for n, c in view], self.ckpt_dir, self.proc)
        skipped = []
        for i, (name, committed) in enumerate(view):
            path = f"{self.ckpt_dir}/{name}"
            if not committed:
                skipped.append(f"{name}: no {COMMIT} (a save that did not finish)")
                if rank == 0:
                    warn(f"warning: {path} is not committed (a save that did not finish); skipped")
                continue
            error = None
            try:
                commit = json.loads(self.store.get(self._key(name, COMMIT)))
                held = listing[name]  # an object written again after its commit has another ETag, whatever its size
                # every object a save of its world size writes must be there, not only those the commit lists
                absent = sorted(self._expected(commit["world_size"]) - set(commit["objects"]))
                absent += [f for f, size in commit["objects"].items() if held.get(f, (None,))[0] != size]
                absent += [f for f, etag in commit["etags"].items() if held.get(f, (0, None))[1] != etag]
                if absent:
                    raise CheckpointError(
                        f"{absent[0]}, for {COMMIT}, is missing or not as committed in S3 (another size or ETag: "
                        "written again, or copied, which gives new ETags; resume from the prefix it was saved to)"
                    )
                saved = json.loads(self.store.get(self._key(name, "train_state.json")))
                if problem := _step_problem(name, saved) or _step_problem(name, commit, COMMIT):
                    raise CheckpointError(problem)
            except (CheckpointError, ValueError, KeyError, TypeError, AttributeError) as e:
                error = str(e) if isinstance(e, CheckpointError) else f"{COMMIT} or train_state.json: {_one_line(e)}"
            except Exception as e:  # the client's S3Exception
                error = _one_line(e)
            error = _first_error(error)
            if error is None:
                changed = _check_state(path, saved, must_match, may_change)
                if int(saved["step"]) > steps:
                    msg = f"at step {saved['step']}, past --steps {steps}; use --resume never --overwrite"
                    raise CheckpointError(f"{path}: {msg}")
                try:
                    load_train_checkpoint(path, model, optimizer, rank, self.store)
                except CheckpointError as e:
                    error = str(e).removeprefix(f"{path}: ")
                except Exception as e:
                    error = _one_line(e)
                error = _first_error(error)
            if error is None:
                if changed and rank == 0:
                    warn(f"warning: resuming from {path} with changed {', '.join(changed)}")
                committed_names = [n for n, c in view[i:] if c]
                self.kept = committed_names[: self.keep][::-1]
                return int(saved["step"]), saved
            skipped.append(f"{name}: {error}")
            if rank == 0:
                warn(f"warning: {path} cannot be resumed ({error}); trying the one before it")
        if names:
            more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
            raise CheckpointError(
                f"{self.ckpt_dir}: no checkpoint can be resumed: {skipped[0]}{more}; nothing was deleted; "
                f"start fresh with --resume never --overwrite"
            )
        return 0, None

    def _fresh(self, overwrite: bool) -> int:
        names = _agreed(sorted(self._listing()), self.ckpt_dir, self.proc)
        self.seen = set(names)
        if names and not overwrite:
            raise CheckpointError(
                f"{self.ckpt_dir} holds an earlier run's checkpoints ({names[-1]}): --overwrite replaces them"
            )
        self.replaced = {n for n in names if OURS.fullmatch(n)}  # pruned by the first commit, whatever their steps
        return 0


def _first_error_in(error: str | None, group) -> str | None:
    """The first rank's error over `group` (the Checkpointer's gloo group, or the world)."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e), None)


def claim_run(out: str | None, ckpt_dir: str, stage: str, flags, must: dict, proc: Process, log) -> bool:
    """The writer rank takes --out for this run and locks its checkpoint dir (outputs.claim's rule; the locks are
    held until the process ends). Collective. Returns whether this run starts fresh (then Checkpointer.start)."""
    run = hashlib.sha256(json.dumps(must, sort_keys=True).encode()).hexdigest()[:16]
    # A checkpoint dir the user did not name lies under --out: errors about it name the flag the user gave.
    flag = "--checkpoint-dir" if getattr(flags, "checkpoint_dir", None) else "--out"
    logs = ("metrics.jsonl", "tensorboard")
    on_s3 = s3.is_s3(ckpt_dir)

    def take() -> bool:
        if out is None:  # an --eval-only that writes no file
            return True
        above = None if on_s3 or outputs.inside(out, ckpt_dir) else outputs.output_above(ckpt_dir)
        if above:  # another run's output, a model, shards: their files are not this run's to prune
            raise outputs.OutputError(f"{flag} {ckpt_dir} is inside {above}, an output this run does not own")
        for path, kind in ((log.jsonl, "a file"), (log.tensorboard, "a directory")):  # before the claim removes any
            if path and (found := outputs.describe(path)) not in (kind, "not there"):  # file: said as what it is
                raise outputs.OutputError(f"{outputs.shown(path)} is {found}, expected {kind} for the run's log")
        _, replacing = outputs.claim(out, stage, flags.overwrite, run, logs, flags.resume == "auto")
        if not on_s3 and os.path.realpath(ckpt_dir) != os.path.realpath(out):  # inside --out too: another run may
            outputs.lock_dir(ckpt_dir, flag)  # name it
        return replacing

    replacing = agree(take if proc.is_main else lambda: False, proc)  # the writer holds the locks; then every
    if out is not None and on_s3:  # rank proves it can write, list, read and delete under the prefix
        agree(lambda: s3.Store(ckpt_dir).probe(f"{socket.gethostname()}-{proc.rank}"), proc)
    elif out is not None:
        agree(lambda: outputs.check_writable(ckpt_dir, flag), proc)  # host's own disk must take saves
        _check_shared(ckpt_dir, proc)
    return flags.resume == "never" or bool(_on_rank0(lambda: replacing, proc.rank))


def _check_shared(ckpt_dir: str, proc: Process) -> None:
    """On several hosts a local checkpoint dir must be one file system they all see (FSx, EFS, NFS): rank 0 writes
    a file there and every rank must see it. Each host's report counts, not rank 0's alone."""
    if proc.world_size == 1:
        return
    hosts = [None] * proc.world_size
    dist.all_gather_object(hosts, os.environ.get("SM_CURRENT_HOST") or socket.gethostname())
    if len(set(hosts)) == 1:
        return
    token = [secrets.token_hex(8)]
    dist.broadcast_object_list(token, src=0)
    mark = os.path.join(ckpt_dir, f".shared-{token[0]}")
    if proc.rank == 0:
        open(mark, "w").close()
    dist.barrier()

    def sees() -> None:
        if not os.path.exists(mark):
            raise CheckpointError(
                f"--checkpoint-dir {ckpt_dir} is not shared between the job's {len(set(hosts))} hosts (this host does "
                f"not see rank 0's files): give every host one place, s3://BUCKET/PREFIX or a shared file system"
            )

    try:
        agree(sees, proc)
    finally:
        dist.barrier()
        if proc.rank == 0:
            os.remove(mark)


# ---------------------------------------------------------------- run control: when the loop saves and stops


class RunControl:
    """When the training loop saves and stops, decided alike on every rank (each calls every method at the same
    step). It owns the stop signal, the clock and the unpublished save; the Checkpointer alone knows the disk."""

    def __init__(self, checkpointer: Checkpointer, proc: Process, state: dict, every: int, minutes: float, log):
        self.checkpointer = checkpointer
        self.proc = proc
        self.state = state  # the model, the optimizer and the train_state that Checkpointer.save writes
        self.every = every  # save every N steps (0 turns this off)
        self.seconds = minutes * 60  # and every N seconds of rank 0's clock (0 turns this off)
        self.log: MetricLogger = log
        self.received: int | None = None  # the signal that reached this rank
        self.stopping = self.clock_due = self.writing = False  # what agree() learned from every rank
        self.pending: int | None = None  # the step of a save that is not published yet
        self.step = 0  # the last step the loop finished
        self.last_save = time.monotonic()
        # Under plain torchrun a spot interruption is a SIGTERM. The handler only takes note; the loop acts.
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "received", signum))
        signal.signal(signal.SIGINT, self._interrupt)
        self.interrupted = False

    def _interrupt(self, signum, frame) -> None:
        # Ctrl-C stops the loop after this step: a save already written is published, none is started. A second
        # Ctrl-C stops at once; the save being written then stays a staging dir, which the next run removes.
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        if self.proc.is_main:
            # A step can take a minute, so say at once that the stop was heard. os.write, not print: a handler that
            # interrupts a print to the same stream would make a reentrant call into its buffer.
            # It starts a line of its own even when the signal lands between a line's text and its newline.
            note = f"\nstop requested: finishing step {self.step + 1}, then stopping (Ctrl-C again stops at once)\n"
            os.write(sys.stdout.fileno(), note.encode())

    def agree(self, loss: float, grad_norm: float, step: int) -> float:
        """The step's loss averaged over ranks, in one all-reduce with the stop signal, rank 0's clock and whether
        a rank still writes a save. Raises before a non-finite update, naming the last good checkpoint."""
        clock = self.proc.is_main and 0 < self.seconds <= time.monotonic() - self.last_save
        flags = [loss, self.received is not None, clock, not self.checkpointer.pending_done()]
        flags.append(self.received == signal.SIGINT)
        loss_sum, stopping, clock, writing, ctrl_c = all_reduce_sum([float(f) for f in flags], self.proc.device)
        self.stopping, self.clock_due, self.writing, self.interrupted = stopping > 0, clock > 0, writing > 0, ctrl_c > 0
        loss = loss_sum / self.proc.world_size
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # every rank sees the same values
            self.close()  # a save still being written is finished first, because it is the last good one
            last = self.checkpointer.last() or "none"
            msg = f"loss {loss} / grad norm {grad_norm} at step {step}: stopped before the update"
            raise FloatingPointError(f"{msg}; last good checkpoint: {last}")
        return loss

    def save(self, step: int, last_step: bool = False) -> None:
        """Save after `step` if due: the last step, a stop signal, the clock, or every N steps. A save written in
        the background is published once no rank still writes it."""
        stop = self.stopping and not self.interrupted  # Ctrl-C saves nothing new
        due = last_step or stop or self.clock_due or (self.every > 0 and step % self.every == 0)
        if self.pending is not None and (due or not self.writing):
            self._publish()  # a due save first waits for the one before, so one write at most is in flight
        if due:
            self.checkpointer.save(step, **self.state)
            self.pending = step
            self.last_save = time.monotonic()
        if self.stopping and not self.interrupted:
            number = self.received or int(signal.SIGTERM)  # the ranks the signal did not reach name SIGTERM
            self.log.info(f"stopped by signal {number} at step {step}; resume with --resume auto")
        self.step = step

    def close(self) -> None:
        """Publish the save still being written, then release the Checkpointer. After Ctrl-C: KeyboardInterrupt."""
        if self.pending is not None:
            self._publish()
        self.checkpointer.close()
        if self.interrupted:
            last = self.checkpointer.last() or "none"
            raise KeyboardInterrupt(f"interrupted after step {self.step}; newest checkpoint: {last} (--resume auto)")

    def _publish(self) -> None:
        self.log.log("checkpoint", step=self.pending, dir=self.checkpointer.finalize())
        self.pending = None


def _dcp_load(state: dict, path: str, store=None) -> None:
    """dcp.load with nothing unpickled freely: metadata through _MetadataUnpickler, and the non-tensor items
    (optimizer hyper-parameters) with weights_only=True (DCP's own planner uses weights_only=False). With an
    s3.Store, `path` is an s3:// URI that each rank reads its own part of, through s3torchconnector."""
    # DCP takes seconds to import and only training needs it: hence the imports and classes in here.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    # Here, not only inside DCP, whose wrapping would bury the one-line reason.
    metadata = read_metadata(path) if store is None else _s3_metadata(store, path)

    class SafeReader(dcp.FileSystemReader if store is None else store.reader_class()):
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())
    except CheckpointException as e:  # DCP's: every rank's traceback in one message (and a BaseException)
        raise CheckpointError(f"{path}: {_one_line(e)}") from None


def load_train_checkpoint(path: str, model, optimizer, rank: int, store=None) -> None:
    """Restore model + optimizer shards (any world size: DCP reshards) and this rank's RNG. What the run was
    (step, inputs) is `read_train_state(path)`, which `resume` reads first, to refuse another run's checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    # As saved: what trains. Not strict, since the frozen weights are not in the state (they come from the base at
    # build time); DCP's load has already required every tensor of the state.
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    _dcp_load(state, path, store)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    if store is not None:
        key = f"{store.where.key(path.removeprefix(store.uri).strip('/'))}/rng-{rank:05d}.safetensors"
        if key in store.list(key):  # absent when resuming on more ranks than saved: fresh RNG for those
            _set_rng(load(store.get(key)))
        return
    rng_file = os.path.join(path, f"rng-{rank:05d}.safetensors")
    if os.path.isfile(rng_file):  # absent when resuming on more ranks than saved: fresh RNG for those
        with safe_open(rng_file, "pt") as f:
            _set_rng({k: f.get_tensor(k) for k in f.keys()})


def _set_rng(rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available() and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])


# ---------------------------------------------------------------- resume: the one call train.py makes


def _on_rank0(fn, rank: int):
    """fn() run on rank 0, its result (or its CheckpointError) handed to every rank, so all take one path."""
    box = [None]
    if rank == 0:
        try:
            box = [("ok", fn())]
        except CheckpointError as e:
            box = [("error", str(e))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def _agreed(names: list[str], where: str, proc: Process) -> list[str]:
    """The checkpoint names every rank sees in `where`; a disagreement is an error, never one rank's view.

    "Nothing to resume" decided on one rank's disk alone was a silent start from step 0 when that rank's host had
    an empty dir and another host the checkpoints (and that host's prune then removed them).
    """
    views = [names]
    if dist.is_initialized() and proc.world_size > 1:
        views = [None] * proc.world_size
        dist.all_gather_object(views, names)
    for rank, view in enumerate(views):
        if view != views[0]:
            shown = lambda v: v[0] if v else "none"  # noqa: E731
            raise CheckpointError(
                f"{where}: the ranks see different checkpoints (rank 0 sees {len(views[0])}, newest "
                f"{shown(views[0])}; rank {rank} sees {len(view)}, newest {shown(view)}): on several hosts "
                f"checkpoints need a place every host sees (s3://BUCKET/PREFIX, or a shared file system)"
            )
    return views[0]


def _first_error(error: str | None) -> str | None:
    """The first rank's error (None if no rank had one), known to every rank."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _shown(saved, new):
    """(saved, new) as an error message shows them: for dicts only the entries that differ."""
    if isinstance(saved, dict) and isinstance(new, dict):
        keys = [k for k in {**saved, **new} if saved.get(k) != new.get(k)]
        return {k: saved.get(k) for k in keys}, {k: new.get(k) for k in keys}
    return saved, new


def _step_problem(name: str, saved, file: str = "train_state.json") -> str | None:
    """What is wrong with a checkpoint's `file` (its train_state.json, or commit.json) as the record of the step its
    folder is named for; None if nothing. A folder renamed to a newer step would otherwise resume older weights as
    newer and let the prune remove the checkpoints that really are newer."""
    step = saved.get("step") if isinstance(saved, dict) else None
    if type(step) is not int or step != int(_STEP_DIR.fullmatch(name).group(1)):
        return f"{file} records step {step!r}, not the step its folder {name} is named for"
    return None


def _check_state(path: str, saved: dict, must_match: dict, may_change: dict) -> list[str]:
    """Raise on a must_match key the checkpoint was saved with another value of; return may_change diffs."""
    for key, new in must_match.items():
        new = json.loads(json.dumps(new))  # as train_state.json would hold it (tuples become lists)
        if key in saved and saved[key] != new:  # a key an older checkpoint lacks is no error
            old, new = _shown(saved[key], new)
            raise CheckpointError(
                f"{path}: checkpoint was made with {key}={old!r}, this run has {new!r}; "
                f"use another --checkpoint-dir, or --resume never --overwrite to replace it"
            )
    may = {key: json.loads(json.dumps(new)) for key, new in may_change.items()}
    return [f"{key}={saved[key]!r}->{new!r}" for key, new in may.items() if key in saved and saved[key] != new]


def read_train_state(path: str) -> dict:
    return read_json(os.path.join(path, "train_state.json"), CheckpointError)  # its manifest vouched for it
