"""Training checkpoints (DCP): atomic saves, the `latest` pointer, `resume`, and the loop's `RunControl`.

Checkpoints are written with `torch.distributed.checkpoint` into `step-N.tmp`, renamed into place, then
pointed at by `latest` (`Checkpointer`, synchronous or in the background); `resume` loads the newest
complete one that loads, falling back to older ones; `RunControl` decides when the loop saves and stops.
Nothing in a checkpoint is unpickled freely: DCP's `.metadata` admits only DCP's own classes, everything
else loads with weights_only=True. Model weights in and out of Hugging Face directories live in hf.py.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import signal
import time

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from minilm_az.logs import MetricLogger
from minilm_az.outputs import atomic_write_json, atomic_write_text
from minilm_az.parallel import Process, all_reduce_sum


class CheckpointError(ValueError):
    """A training checkpoint that cannot be written, read or continued; the message names the file."""


# ---------------------------------------------------------------- training checkpoints (DCP)
#
# ckpt_dir/step-00001000/   .metadata, __<rank>_0.distcp (DCP), rng-<rank>.safetensors, train_state.json
# ckpt_dir/latest           "step-00001000"
#
# Every rank writes into step-N.tmp; once all are done, local rank 0 of each host renames it to step-N
# (per-host disks, as on SageMaker, each get their own rename) and points `latest` at it, so a crash at
# any point leaves the previous checkpoint complete and named by `latest`.

_STEP_DIR = re.compile(r"step-(\d+)")


def _step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step-{step:08d}")


# DCP's `.metadata` is a pickle, so a file planted in a checkpoint dir could run code when read. These are
# the only globals a model + optimizer checkpoint's metadata holds (found by tracing find_class on real
# saves, FSDP2 and plain); every torch dtype is allowed too. Anything else is refused before it is called.
_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in [
            *("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata"),
            *("ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"),
        ]
    ),
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


def _load_metadata(path: str):
    """DCP's Metadata of checkpoint dir `path`. Raises CheckpointError on a refused global, else pickle's errors."""
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        return _MetadataUnpickler(f, file).load()


def read_metadata(path: str):
    """DCP's Metadata of a checkpoint dir, unpickled with only DCP's own classes allowed."""
    try:
        return _load_metadata(path)
    except CheckpointError:
        raise
    except Exception as e:  # a truncated pickle fails in many ways
        raise CheckpointError(f"{os.path.join(path, '.metadata')}: unreadable ({type(e).__name__}: {e})") from None


def _data_files_present(path: str, metadata) -> bool:
    """Every file the metadata names exists and is long enough for the byte ranges read from it."""
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        if os.path.basename(info.relative_path) != info.relative_path:
            raise CheckpointError(
                f"{path}/.metadata: names a data file outside the checkpoint ({info.relative_path!r})"
            )
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in need.items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file) or os.path.getsize(file) < size:
            return False
    return True


def is_complete(path: str) -> bool:
    """All of a checkpoint is here: its state, every rank's RNG file, DCP's metadata and all the data it names.

    On several hosts each one syncs its own disk to S3, so `latest` can arrive before another host's
    shards do, or a shard only partly; such a checkpoint does not count. Raises CheckpointError when the
    metadata holds anything but DCP's own classes (it is never silently skipped).
    """
    state_file = os.path.join(path, "train_state.json")
    if not (os.path.isfile(state_file) and os.path.isfile(os.path.join(path, ".metadata"))):
        return False
    try:
        with open(state_file) as fh:
            world = int(json.load(fh).get("world_size", 1))
    except (OSError, ValueError):
        return False
    if not all(os.path.isfile(os.path.join(path, f"rng-{r:05d}.safetensors")) for r in range(world)):
        return False
    try:
        metadata = _load_metadata(path)
    except CheckpointError:
        raise
    except Exception:  # truncated or half-synced
        return False
    return _data_files_present(path, metadata)


def _step_of(name: str) -> int:
    return int(_STEP_DIR.fullmatch(name).group(1))


def _step_dirs(ckpt_dir: str) -> list[str]:
    """Names of the finished step dirs (not .tmp), newest step first."""
    return sorted((d for d in os.listdir(ckpt_dir) if _STEP_DIR.fullmatch(d)), key=_step_of, reverse=True)


def _read_pointer(pointer: str) -> str:
    """The step dir name `latest` holds. Anything else (binary, a path, another file copied over it) is refused:
    which checkpoint it meant cannot be known, and guessing could resume the wrong one."""
    try:
        with open(pointer, "rb") as fh:
            raw = fh.read(256)
    except OSError as e:
        raise CheckpointError(f"{pointer}: unreadable checkpoint pointer ({e.strerror})") from None
    try:
        target = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        target = None
    if target is None or not _STEP_DIR.fullmatch(target):
        raise CheckpointError(
            f"{pointer}: not a checkpoint pointer (expected a name like step-00001000, got "
            f"{raw[:40]!r}); delete it to resume from the newest complete checkpoint, or use "
            f"--resume never"
        )
    return target


def complete_checkpoints(ckpt_dir: str | None) -> list[str]:
    """Complete checkpoints of ckpt_dir, newest first: the one `latest` names, then the others by step."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return []
    names = _step_dirs(ckpt_dir)
    pointer = os.path.join(ckpt_dir, "latest")
    if os.path.isfile(pointer):
        target = _read_pointer(pointer)
        if target in names:
            names = [target] + [n for n in names if n != target]
    return [os.path.join(ckpt_dir, n) for n in names if is_complete(os.path.join(ckpt_dir, n))]


def latest_checkpoint(ckpt_dir: str | None) -> str | None:
    """The newest complete checkpoint: the one `latest` names, else the highest complete step dir."""
    done = complete_checkpoints(ckpt_dir)
    return done[0] if done else None


def _write_rank_files(tmp: str, step: int, train_state: dict, rank: int) -> None:
    # RNG of this rank, and (rank 0) the run's state: both of the moment the model state is snapshotted.
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, os.path.join(tmp, f"rng-{rank:05d}.safetensors"))
    if rank == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        atomic_write_json(os.path.join(tmp, "train_state.json"), {**train_state, "step": step, "world_size": world})


def _prune(ckpt_dir: str, final: str, keep: int) -> None:
    """Keep `final` and the keep-1 checkpoints before it; drop leftovers of killed saves.

    Step dirs newer than `final` are from a run this one did not continue (a checkpoint that failed to
    load, or --resume never): left in place they would be taken for this run's latest.
    """
    step = _step_of(os.path.basename(final))
    older = [n for n in _step_dirs(ckpt_dir) if _step_of(n) < step]
    drop = older[max(keep - 1, 0) :] + [n for n in _step_dirs(ckpt_dir) if _step_of(n) > step]
    drop += [n for n in os.listdir(ckpt_dir) if n.startswith("step-") and n.endswith((".tmp", ".old"))]
    for n in drop:
        shutil.rmtree(os.path.join(ckpt_dir, n), ignore_errors=True)


def _publish(ckpt_dir: str, tmp: str, final: str, keep: int) -> None:
    """step-N.tmp -> step-N, `latest` -> step-N, prune. Run by one process per disk."""
    if os.path.isdir(final):  # the same step saved again (after resuming from it): never a moment with neither
        shutil.rmtree(final + ".old", ignore_errors=True)
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    atomic_write_text(os.path.join(ckpt_dir, "latest"), os.path.basename(final))
    _prune(ckpt_dir, final, keep)


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
    """Training checkpoints of one run: write step-N (sync, or in the background), publish it, keep `keep`.

    With `async_save` the model and optimizer state are copied to CPU memory inside save() (on CUDA into
    pinned buffers made at the first save and reused after), and DCP writes that copy from a background
    thread while training goes on; its collectives run on a gloo group of their own, never on the training
    job's NCCL. A write is published (renamed, `latest` updated) only by finalize(), which every rank calls
    at the same step.
    """

    def __init__(self, ckpt_dir: str, rank: int, local_rank: int, keep: int = 2, async_save: bool = True):
        self.ckpt_dir, self.rank, self.local_rank, self.keep = ckpt_dir, rank, local_rank, keep
        self.async_save = async_save
        self._pending = None  # (step, future or None)
        self._group = self._writer = None
        if async_save:
            self._group = dist.new_group(backend="gloo")  # collective: every rank builds its Checkpointer together

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self._group)

    def save(self, step: int, model, optimizer, train_state: dict) -> None:
        """Start writing step's checkpoint; returns once the state is copied off the device (async) or written
        and published (sync). A previous pending save is finalized first. Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.finalize()  # one write in flight at most: the staging buffers are reused
        tmp = _step_dir(self.ckpt_dir, step) + ".tmp"
        if self.local_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, exist_ok=True)
        self._barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        error = None
        try:
            _write_rank_files(tmp, step, train_state, self.rank)
        except Exception as e:  # a full disk shows here first (safetensors' error is not an OSError)
            error = _one_line(e)
        if error := _first_error(error):  # every rank learns of it: none goes on into DCP's collectives alone
            raise self._not_written(step, error)
        if self.async_save:
            fut = dcp.async_save(
                self._staged(state),
                checkpoint_id=tmp,
                storage_writer=self._async_writer(tmp),
                process_group=self._group,
            )
            self._pending = (step, getattr(fut, "upload_completion", fut))
        else:
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                dcp.save(state, checkpoint_id=tmp)
            except (Exception, CheckpointException) as e:  # DCP gathers every rank's error: all raise alike
                if isinstance(_inner(e), KeyboardInterrupt):  # Ctrl-C, which DCP wraps too: not a write failure
                    raise KeyboardInterrupt from None
                raise self._not_written(step, _one_line(e)) from None
            self._pending = (step, None)
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
        """Local and non-blocking: no save pending, or this rank's part of its write has finished."""
        return self._pending is None or self._pending[1] is None or self._pending[1].done()

    def finalize(self) -> str | None:
        """Collective: wait for the pending write on every rank, publish it (step-N, `latest`, prune).

        Returns its path, or None when nothing was pending (then it costs nothing and talks to no rank).
        Raises CheckpointError on every rank if any rank's write failed; `latest` then still names the previous one.
        """
        if self._pending is None:
            return None
        step, fut = self._pending
        self._pending = None
        error, failed = None, False
        if fut is not None:  # async; a sync save raised in save() already, on every rank (DCP gathers errors)
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                fut.result()
            except (Exception, CheckpointException) as e:  # DCP's own is a BaseException
                error = _one_line(e)
            flag = torch.tensor([error is not None], dtype=torch.int32)
            if dist.is_initialized():  # every rank learns of a failure anywhere, so all take the same path
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            failed = bool(flag.item())
        if failed:
            raise self._not_written(step, error or "failed on another rank")
        final = _step_dir(self.ckpt_dir, step)
        tmp = final + ".tmp"
        # One rename per disk: rank 0, and local rank 0 of any host whose disk lacks rank 0's .metadata
        # (per-host disks). On a shared disk the others see .metadata (or the dir already renamed) and wait.
        if (
            self.local_rank == 0
            and os.path.isdir(tmp)
            and (self.rank == 0 or not os.path.isfile(os.path.join(tmp, ".metadata")))
        ):
            _publish(self.ckpt_dir, tmp, final, self.keep)
        self._barrier()
        return final

    def _not_written(self, step: int, reason: str) -> CheckpointError:
        # A full disk shows up as torch's "unexpected pos" or an ENOSPC deep in DCP: the free space says which.
        free = shutil.disk_usage(self.ckpt_dir).free / 2**30
        return CheckpointError(
            f"{_step_dir(self.ckpt_dir, step)}.tmp: checkpoint of step {step} was not written ({reason}; "
            f"{free:.1f} GiB free on its disk); `latest` still names the previous one"
        )

    def close(self) -> None:
        """Finalize a pending save (collective), then release the pinned copy and the gloo group."""
        self.finalize()
        self._writer = None  # frees the pinned copy
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
            self._group = None


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
        self.last_save = time.monotonic()
        # Under plain torchrun a spot interruption is a SIGTERM. The handler only takes note; the loop acts.
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "received", signum))

    def agree(self, loss: float, grad_norm: float, step: int) -> float:
        """The step's loss averaged over ranks, in one all-reduce with the stop signal, rank 0's clock and whether
        a rank still writes a save. Raises before a non-finite update, naming the last good checkpoint."""
        clock = self.proc.is_main and 0 < self.seconds <= time.monotonic() - self.last_save
        flags = [loss, self.received is not None, clock, not self.checkpointer.pending_done()]
        loss_sum, stopping, clock, writing = all_reduce_sum([float(f) for f in flags], self.proc.device)
        self.stopping, self.clock_due, self.writing = stopping > 0, clock > 0, writing > 0
        loss = loss_sum / self.proc.world_size
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # every rank sees the same values
            self.close()  # a save still being written is finished first, because it is the last good one
            last = latest_checkpoint(self.checkpointer.ckpt_dir) or "none"
            msg = f"loss {loss} / grad norm {grad_norm} at step {step}: stopped before the update"
            raise FloatingPointError(f"{msg}; last good checkpoint: {last}")
        return loss

    def save(self, step: int, last_step: bool = False) -> None:
        """Save after `step` if due: the last step, a stop signal, the clock, or every N steps. A save written in
        the background is published once no rank still writes it."""
        due = last_step or self.stopping or self.clock_due or (self.every > 0 and step % self.every == 0)
        if self.pending is not None and (due or not self.writing):
            self._publish()  # a due save first waits for the one before, so one write at most is in flight
        if due:
            self.checkpointer.save(step, **self.state)
            self.pending = step
            self.last_save = time.monotonic()
        if self.stopping:
            number = self.received or int(signal.SIGTERM)  # the ranks the signal did not reach name SIGTERM
            self.log.info(f"stopped by signal {number} at step {step}; resume with --resume auto")

    def close(self) -> None:
        """Publish the save still being written, then release the Checkpointer."""
        if self.pending is not None:
            self._publish()
        self.checkpointer.close()

    def _publish(self) -> None:
        self.log.log("checkpoint", step=self.pending, dir=self.checkpointer.finalize())
        self.pending = None


def _dcp_load(state: dict, path: str) -> None:
    """dcp.load with nothing unpickled freely: metadata through _MetadataUnpickler, and the non-tensor items
    (optimizer hyper-parameters) with weights_only=True (DCP's own planner uses weights_only=False)."""
    # DCP takes seconds to import and only training needs it: hence the imports and classes in here.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(path)
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


def load_train_checkpoint(path: str, model, optimizer, rank: int) -> None:
    """Restore model + optimizer shards (any world size: DCP reshards) and this rank's RNG. What the run was
    (step, inputs) is `read_train_state(path)`, which `resume` reads first, to refuse another run's checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    _dcp_load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = os.path.join(path, f"rng-{rank:05d}.safetensors")
    if os.path.isfile(rng_file):  # absent when resuming on more ranks than saved: fresh RNG for those
        with safe_open(rng_file, "pt") as f:
            torch.set_rng_state(f.get_tensor("cpu"))
            if torch.cuda.is_available() and "cuda" in f.keys():
                torch.cuda.set_rng_state(f.get_tensor("cuda"))


# ---------------------------------------------------------------- resume: the one call train.py makes


def _on_rank0(fn, rank: int):
    """fn() run on rank 0, its result (or its CheckpointError) handed to every rank, so all take one path.

    Several hosts may see different files (each syncs its own disk); rank 0's view decides.
    """
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


def _first_error(error: str | None) -> str | None:
    """The first rank's load error (None if every rank loaded), known to every rank."""
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


def _check_state(path: str, saved: dict, must_match: dict, may_change: dict) -> list[str]:
    """Raise on a must_match key the checkpoint was saved with another value of; return may_change diffs."""
    for key, new in must_match.items():
        new = json.loads(json.dumps(new))  # as train_state.json would hold it (tuples become lists)
        if key in saved and saved[key] != new:  # a key an older checkpoint lacks is no error
            old, new = _shown(saved[key], new)
            raise CheckpointError(
                f"{path}: checkpoint was made with {key}={old!r}, this run has {new!r}; "
                f"use --resume never or another --checkpoint-dir"
            )
    changed = []
    for key, new in may_change.items():
        new = json.loads(json.dumps(new))
        if key in saved and saved[key] != new:
            changed.append(f"{key}={saved[key]!r}->{new!r}")
    return changed


def read_train_state(path: str) -> dict:
    try:
        with open(os.path.join(path, "train_state.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/train_state.json: unreadable ({e})") from None


def _newer_incomplete(ckpt_dir: str, complete: list[str]) -> list[str]:
    """Finished step dirs newer than the newest complete checkpoint that are not complete themselves."""
    if not os.path.isdir(ckpt_dir):
        return []
    names = _step_dirs(ckpt_dir)
    newest = os.path.basename(complete[0]) if complete else None
    newer = names[: names.index(newest)] if newest in names else names
    return [os.path.join(ckpt_dir, n) for n in newer if os.path.join(ckpt_dir, n) not in complete]


def resume(
    ckpt_dir: str, model, optimizer, rank: int, must_match: dict, may_change: dict, warn
) -> tuple[int, dict | None]:
    """Load the newest loadable complete checkpoint of ckpt_dir; (step, train_state), or (0, None) if none.

    Collective. A checkpoint saved with another value of a `must_match` key (model shape, phase) raises
    CheckpointError; changed `may_change` keys (seed, batch) give one warning line. A checkpoint that
    fails to load gives a warning and the previous one is tried. `warn(line)` is called on rank 0 only.
    """
    candidates = _on_rank0(lambda: complete_checkpoints(ckpt_dir), rank)
    if rank == 0:
        for path in _newer_incomplete(ckpt_dir, candidates):
            warn(f"warning: {path} is incomplete (a save or a sync that did not finish); skipped")
    for path in candidates:
        saved = _on_rank0(functools.partial(read_train_state, path), rank)
        changed = _check_state(path, saved, must_match, may_change)
        error = None
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
            return int(saved["step"]), saved
        if rank == 0:
            warn(f"warning: {path} could not be loaded ({error}); trying the previous checkpoint")
    if candidates:  # the model may be partly overwritten by the failed loads: never train on from there
        raise CheckpointError(
            f"{ckpt_dir}: no checkpoint could be loaded (tried {len(candidates)}); "
            f"use --resume never or another --checkpoint-dir"
        )
    return 0, None


# ---------------------------------------------------------------- identities (what a resume must agree on)


def model_fingerprint(model_dir: str | None) -> str | None:
    """A cheap identity of a HF model dir: config.json, and each weight file's size, first and last MiB."""
    if not model_dir:
        return None
    h = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        if name == "config.json" or name.endswith(".safetensors"):
            path = os.path.join(model_dir, name)
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                h.update(f"{name}:{size}".encode() + f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read())
    return h.hexdigest()
