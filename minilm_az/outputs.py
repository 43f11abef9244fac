"""Output directories that are safe to write when the target is its own mount point (SageMaker's /opt/ml/model).

A rename across file systems fails (EXDEV) and a mount point cannot be removed or renamed (EBUSY), so
the usual "write a sibling temp dir, swap it in" breaks there. Instead every stage writes into a
staging dir *inside* the target, then moves the files in one by one (same file system: plain renames)
and never renames or removes the target itself:

    with staged_output(out, stage="hf-model") as tmp:   # out/.staging-XXXX
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
    # out/model.safetensors, out/minilm-az-output.json

The marker file `minilm-az-output.json`, written last, says which stage wrote which files:

    {"outputs": [{"stage": "hf-model", "files": ["config.json", "model.safetensors"],
                  "time": "2025-01-01T00:00:00Z", "complete": true}]}

Several stages may share a directory (a model and its tokenizer); each has its own record. Only files
a record lists are ever removed (a stale file of the previous output of the same stage), so a directory
holding other artifacts is never emptied.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

MARKER = "minilm-az-output.json"
STAGING_PREFIX = ".staging-"


# ---------------------------------------------------------------- single files


def _fsync(path: str) -> None:
    # Also used on directories, because a rename survives a power cut only once its directory is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read the umask is to set it, so set it back at once
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `path` so a reader sees the old file or the whole new one (temp file, fsync, rename)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the output is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync(parent)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str, obj, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object in `path`. Anything else (bad JSON, bad UTF-8, a list) raises `error` with the path."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


# ---------------------------------------------------------------- the marker


def _read_marker(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, MARKER)
    if not os.path.isfile(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f).get("outputs", [])
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: unreadable output marker ({e}); remove it by hand") from None
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("files"), list)]


def _write_marker(out_dir: str, records: list[dict]) -> None:
    if records:
        atomic_write_json(os.path.join(out_dir, MARKER), {"outputs": records})
    elif os.path.exists(os.path.join(out_dir, MARKER)):
        os.remove(os.path.join(out_dir, MARKER))


def written_by(out_dir: str, stage: str | None = None) -> dict | None:
    """The marker record of `stage` in `out_dir` ({"stage", "files", "time", "complete"}), or None.

    With no stage: the most recently written record. `complete` is False when a process died while
    moving that output's files in (the directory then mixes old and new files).
    """
    records = _read_marker(out_dir)
    if stage is not None:
        records = [r for r in records if r.get("stage") == stage]
    return records[-1] if records else None


def _safe_relpath(rel: str) -> bool:
    # A marker is data on disk, so it must never name a file outside its directory.
    return bool(rel) and not os.path.isabs(rel) and ".." not in rel.split("/")


def _remove_files(out_dir: str, files: Iterable[str]) -> list[str]:
    removed = []
    for rel in files:
        path = os.path.join(out_dir, rel)
        if not _safe_relpath(rel) or not (os.path.isfile(path) or os.path.islink(path)):
            continue
        os.remove(path)
        removed.append(rel)
        parent = os.path.dirname(rel)
        while parent:  # prune subdirectories this left empty, never out_dir itself
            try:
                os.rmdir(os.path.join(out_dir, parent))
            except OSError:
                break
            parent = os.path.dirname(parent)
    return removed


def check_writable(path: str, flag: str) -> None:
    """Raise OSError, naming `flag`, if `path` cannot be written. Call it before hours of training."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as e:
        raise OSError(e.errno, f"{flag} {path}: cannot write there ({e.strerror})") from None


# ---------------------------------------------------------------- staged directories


def _remove_leftover_staging(out_dir: str) -> None:
    # A process killed inside staged_output leaves its staging dir behind. Nothing else uses these names.
    if os.path.isdir(out_dir):
        for name in os.listdir(out_dir):
            if name.startswith(STAGING_PREFIX):
                shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def _staged_files(stage_dir: str) -> list[str]:
    """The '/'-separated relative paths of the files under stage_dir, data first and .json files last.

    Files are moved in this order, so a descriptor (config.json, index.json, adapter_config.json) that
    names data files only appears once they are in place.
    """
    files = []
    for root, _, names in os.walk(stage_dir):
        for name in names:
            files.append(os.path.relpath(os.path.join(root, name), stage_dir).replace(os.sep, "/"))
    return sorted(files, key=lambda f: (f.endswith(".json"), f))


def _check_no_conflicts(out_dir: str, files: list[str]) -> None:
    # Check before anything moves, because a failure halfway through would leave a mixed directory.
    for rel in files:
        if rel == MARKER:
            raise ValueError(f"staged_output: a stage may not write the marker file {MARKER} itself")
        target = os.path.join(out_dir, rel)
        if os.path.isdir(target):
            raise IsADirectoryError(f"{target} is a directory; the new output has a file there")
        parent = os.path.dirname(rel)
        while parent:
            path = os.path.join(out_dir, parent)
            if os.path.exists(path) and not os.path.isdir(path):
                raise NotADirectoryError(f"{path} is a file; the new output has a directory there")
            parent = os.path.dirname(parent)


def _move_in(stage_dir: str, out_dir: str, files: list[str]) -> None:
    """Rename each staged file into out_dir (same file system), creating subdirectories as needed."""
    for rel in files:
        _fsync(os.path.join(stage_dir, rel))
    dirs = {out_dir}
    for rel in files:
        dst = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(os.path.join(stage_dir, rel), dst)
        dirs.add(os.path.dirname(dst))
    for d in dirs:
        _fsync(d)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@contextmanager
def staged_output(out_dir: str, stage: str = "", replaces: Iterable[str] = ()) -> Iterator[str]:
    """Yield a staging dir inside `out_dir`; on success move its files into `out_dir` and record them.

    On an exception inside the block the staging dir is removed and `out_dir` is left as it was.
    Files of the previous output of the same `stage` that the new one lacks are removed (the marker
    listed them); `replaces` names files removed even without a record (another layout of the same
    output, e.g. model.safetensors when writing a sharded export).
    """
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    _remove_leftover_staging(out_dir)
    stage_dir = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir)
    try:
        yield stage_dir
        files = _staged_files(stage_dir)
        _check_no_conflicts(out_dir, files)
        _commit(out_dir, stage_dir, files, stage, replaces)
    except BaseException:
        shutil.rmtree(stage_dir, ignore_errors=True)
        if created and not os.listdir(out_dir):  # we made out_dir, so a failed first write removes it
            os.rmdir(out_dir)
        raise
    finally:
        shutil.rmtree(stage_dir, ignore_errors=True)


def _commit(out_dir: str, stage_dir: str, files: list[str], stage: str, replaces: Iterable[str]) -> None:
    records = _read_marker(out_dir)
    previous = [f for r in records if r.get("stage") == stage for f in r["files"]]
    others = [r for r in records if r.get("stage") != stage]
    for record in others:  # a file this output now owns is no longer another stage's to remove
        record["files"] = [f for f in record["files"] if f not in files]
    stale = [f for f in dict.fromkeys([*previous, *replaces]) if f not in files]
    # Until the moves are done, the record lists the old and new files and says it is incomplete.
    # So a process killed halfway leaves a directory that a reader can recognise.
    pending = {"stage": stage, "files": sorted(set(files) | set(previous)), "time": _now(), "complete": False}
    _write_marker(out_dir, [*others, pending])
    _move_in(stage_dir, out_dir, files)
    _remove_files(out_dir, stale)
    _write_marker(out_dir, [*others, {"stage": stage, "files": files, "time": _now(), "complete": True}])
