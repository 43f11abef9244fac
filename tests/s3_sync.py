"""SageMaker's checkpoint sync, modelled: one S3 prefix, every host's CheckpointConfig.LocalPath synced to it alone.

    prefix = S3Prefix(tmp_path / "s3")                  # stands for CheckpointConfig.S3Uri
    host1, host2 = prefix.host("algo-1", dir1), prefix.host("algo-2", dir2)
    host1.restore(); host2.restore()                    # job start: each host gets the whole prefix
    ...                                                 # the job writes and deletes under dir1, dir2
    host2.sync(only=lambda key: "rng" in key)           # host 2 uploads part of what it has
    host1.sync()                                        # host 1 uploads its files and its deletions
    assert "step-00000002/.metadata" in prefix.keys()

The prefix is a local directory: each S3 object is a file whose path is the key under the prefix, and an
object appears whole or not at all (a PUT is atomic: written beside the prefix, then renamed in). Nothing
runs in the background: a test calls `sync` (or `apply`) between the events it wants, so the order of the
hosts' uploads and deletions is the test's choice, adversarial ones included. `sm_container.replay_job`
restores every host's LocalPath from a prefix before the hosts start and hands these objects to triggers.

What is modelled, and where it comes from (AWS's pages paraphrased, not quoted):

1. At job start every host gets the whole prefix. The SageMaker developer guide's "Checkpoints in Amazon
   SageMaker AI" (model-checkpoints.html) says the checkpoints already in S3 are written into the container
   when the job starts; "Resume training from a checkpoint" (model-checkpoints-resume.html) says they are
   restored to the local path of each instance of the new job; "Managed Spot Training"
   (model-managed-spot-training.html) says a restarted job gets S3's copy back in its local path. -> `restore`.
2. Nothing is downloaded later: model-checkpoints.html says checkpoints added to the S3 folder after the job
   started are not copied into the container. A host never sees another host's files during a job. -> only
   `restore` writes into LocalPath.
3. Each host uploads what it writes, during training (model-checkpoints.html). The prefix is one S3
   location for all instances, with no per-host part (CheckpointConfig has only S3Uri and LocalPath,
   API_CheckpointConfig), so each host's agent writes the same keys, independently. When, in which order and
   how long after the write is not documented; uploads are asynchronous and can lag or stall
   (aws/sagemaker-python-sdk#3062, checkpoints that stopped reaching S3 mid-job). -> `sync` uploads new and
   changed files, in the order and with the subset and the cut-off (`limit`) the test gives.
4. Local deletions propagate: model-checkpoints.html says a checkpoint deleted in the container is deleted
   in the S3 folder too. A host deletes only what it had itself (restored at start or uploaded since): it
   cannot know the other hosts' files. A delete removes the key whatever its current object is, even one
   another host uploaded since (S3 DeleteObject has no condition). -> `sync` deletes the keys of known files
   that are gone locally. A rename is a new key plus a deletion.
5. Files written after a host's last upload are lost when the instance goes away: the pages promise only
   S3's copy at a restart (1.), and say nothing of a final upload at a spot interruption (StopTrainingJob's
   SIGTERM and 120 s grace, API_StopTrainingJob, are for a stop request, not for an interruption). -> the
   test simply stops calling `sync` for that host; a new job's `restore` sees only the prefix.
6. Temporary files the agent ignores: no developer-guide page names one, but AWS's own containers rely on
   the suffix `.sagemaker-ignore`. The XGBoost container writes each checkpoint into the checkpoint dir as a
   temporary file with TEMP_FILE_SUFFIX = ".sagemaker-ignore" and renames it into place
   (aws/sagemaker-xgboost-container, src/sagemaker_xgboost_container/checkpointing.py, SaveCheckpoint), and
   SageMaker Debugger keeps temp files in a `.sagemaker-ignore` directory that, its comment says, the service
   does not upload (awslabs/sagemaker-debugger, smdebug/trials/profiler_trial.py). -> a path with any
   component ending in IGNORE_SUFFIX is never uploaded (nor, never having been known, deleted).
7. Upload markers: the same XGBoost module says SageMaker creates `<file>.sagemaker-uploading` in the local
   dir while it uploads a file and `<file>.sagemaker-uploaded` once done (smdebug's tests instead say the
   file is renamed to `<file>.sagemaker-uploaded`, tests/core/test_state_store.py), and the guide's
   model-parallel troubleshooting page (distributed-troubleshooting-model-parallel.html) shows a job failing
   on a vanished `/opt/ml/checkpoints/metadata.json.sagemaker-uploading`. When the markers go away is not
   documented. -> with `markers=True`, `sync` leaves `<file>.sagemaker-uploaded` beside each uploaded file (a
   program that lists its checkpoint dir sees them); marker files are never uploaded. Off by default.

Not modelled: multipart uploads seen half done (an S3 object is whole or absent), S3 versioning, and the
agent re-uploading unchanged bytes (a file counts as changed when its size or sha256 differ).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

IGNORE_SUFFIX = ".sagemaker-ignore"
UPLOADING_SUFFIX = ".sagemaker-uploading"
UPLOADED_SUFFIX = ".sagemaker-uploaded"


@dataclass(frozen=True)
class Op:
    """One action of a host's sync agent on the prefix: upload a local file to `key`, or delete `key`."""

    kind: Literal["put", "delete"]
    key: str  # the path under LocalPath, which is also the key under the prefix

    def __str__(self) -> str:
        return f"{self.kind} {self.key}"


@dataclass(frozen=True)
class Change:
    """An operation that reached the prefix, and whose agent sent it (the prefix keeps them in order)."""

    host: str
    op: Op

    def __str__(self) -> str:
        return f"{self.host}: {self.op}"


def ignored(key: str) -> bool:
    """Whether the agent never uploads this path: a component ending in .sagemaker-ignore, or its own markers."""
    parts = key.split("/")
    return any(p.endswith(IGNORE_SUFFIX) for p in parts) or parts[-1].endswith((UPLOADING_SUFFIX, UPLOADED_SUFFIX))


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _walk(root: Path) -> list[str]:
    """Files under root as relative keys, sorted (empty directories are not objects).

    The job may rename or delete while this walks (a sync step can run mid-save): what vanishes is skipped.
    """
    found = []
    for d, _, files in os.walk(root):
        found += [(Path(d) / f).relative_to(root).as_posix() for f in files if os.path.isfile(os.path.join(d, f))]
    return sorted(found)


class S3Prefix:
    """s3://bucket/prefix/ of CheckpointConfig.S3Uri, as a local directory, with the log of what changed it."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # A PUT is staged beside the prefix, then renamed in, so no reader sees half an object.
        self._staging = self.root.parent / f".{self.root.name}.staging"
        self._staging.mkdir(exist_ok=True)
        self._lock = threading.Lock()  # triggers may sync from the replay's monitor while the test reads
        self.log: list[Change] = []

    def keys(self) -> list[str]:
        return _walk(self.root)

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def digest(self, key: str) -> tuple[int, str] | None:
        p = self.root / key
        return _digest(p) if p.is_file() else None

    def put(self, key: str, source: Path, host: str) -> tuple[int, str]:
        """Upload `source` as `key`: the bytes it has now, whole. Returns their (size, sha256)."""
        staged = self._staging / uuid.uuid4().hex
        shutil.copyfile(source, staged)
        digest = _digest(staged)  # what was sent, even if the file changes on
        with self._lock:
            dest = self.root / key
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged, dest)
            self.log.append(Change(host, Op("put", key)))
        return digest

    def delete(self, key: str, host: str) -> None:
        with self._lock:
            p = self.root / key
            if p.is_file():
                p.unlink()
                # S3 has no directories: drop the ones this left empty, so keys() and the tree agree.
                d = p.parent
                while d != self.root and not any(d.iterdir()):
                    d.rmdir()
                    d = d.parent
            self.log.append(Change(host, Op("delete", key)))

    def host(self, name: str, local: str | Path, *, markers: bool = False) -> HostSync:
        """The sync agent of instance `name`, whose CheckpointConfig.LocalPath is `local` (seen from here)."""
        return HostSync(self, Path(local), name, markers=markers)

    def changes(self, host: str | None = None) -> list[str]:
        """The log as lines ("algo-2: delete step-00000002/.metadata"), of one host or all."""
        return [str(c) for c in self.log if host is None or c.host == host]


class HostSync:
    """One instance's checkpoint agent: restores the prefix at job start, then uploads files and deletions."""

    def __init__(self, prefix: S3Prefix, local: Path, name: str, *, markers: bool = False) -> None:
        self.prefix, self.local, self.name, self.markers = prefix, local, name, markers
        # What this agent believes the prefix holds of its files: key -> (size, sha256) when restored or uploaded.
        self.known: dict[str, tuple[int, str]] = {}

    def restore(self) -> list[str]:
        """Job start: every object of the prefix into LocalPath (empty, as a new instance's volume is)."""
        if self.local.exists() and any(self.local.iterdir()):
            raise ValueError(f"{self.local}: a new instance's checkpoint dir is empty; this one is not")
        self.local.mkdir(parents=True, exist_ok=True)
        keys = self.prefix.keys()
        for key in keys:
            dest = self.local / key
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.prefix.root / key, dest)
            self.known[key] = _digest(dest)
        return keys

    def pending(self) -> list[Op]:
        """What the agent would do now: uploads of new or changed files, then deletions of vanished ones."""
        digests = {}
        for key in _walk(self.local):
            if not ignored(key):
                try:
                    digests[key] = _digest(self.local / key)
                except FileNotFoundError:  # renamed or deleted by the job since the walk
                    pass
        puts = [Op("put", k) for k in sorted(digests) if self.known.get(k) != digests[k]]
        deletes = [Op("delete", k) for k in sorted(set(self.known) - set(digests))]
        return puts + deletes

    def apply(self, ops: Iterable[Op]) -> list[Op]:
        """Carry out `ops` in the order given (any order a test wants); returns those that reached the prefix.

        An upload reads the file as it is now (a file written since `pending` goes up as it is now; one deleted
        since is skipped); a deletion of a file that is back locally is skipped.
        """
        done: list[Op] = []
        for op in ops:
            path = self.local / op.key
            if op.kind == "put":
                if not path.is_file() or ignored(op.key):
                    continue
                if self.markers:
                    Path(f"{path}{UPLOADING_SUFFIX}").touch()
                try:
                    digest = self.prefix.put(op.key, path, self.name)
                except FileNotFoundError:  # gone since it was listed: the upload fails, nothing changes
                    continue
                self.known[op.key] = digest
                if self.markers:
                    Path(f"{path}{UPLOADING_SUFFIX}").unlink(missing_ok=True)
                    Path(f"{path}{UPLOADED_SUFFIX}").touch()
            else:
                if path.is_file():
                    continue
                self.prefix.delete(op.key, self.name)
                self.known.pop(op.key, None)
            done.append(op)
        return done

    def sync(
        self,
        *,
        only: Callable[[str], bool] | Iterable[str] | None = None,
        deletions: bool = True,
        limit: int | None = None,
    ) -> list[Op]:
        """One upload pass: `pending()` (only the keys `only` selects; no deletions if `deletions` is False),
        cut off after `limit` operations (an instance lost in the middle of its uploads)."""
        ops = self.pending()
        if only is not None:
            keep = only if callable(only) else set(only).__contains__
            ops = [op for op in ops if keep(op.key)]
        if not deletions:
            ops = [op for op in ops if op.kind == "put"]
        return self.apply(ops[:limit] if limit is not None else ops)


__all__ = ["IGNORE_SUFFIX", "UPLOADED_SUFFIX", "UPLOADING_SUFFIX", "Change", "HostSync", "Op", "S3Prefix", "ignored"]
