"""Output directories: who may write one (claim), and writes that are safe when it is a mount point (staged_output).

One ownership rule for every writer (claim): a stage writes into a new directory, or one the marker file
`minilm-az-output.json` says it owns; the same run continues there, an earlier output is replaced only with
--overwrite (removing only files the marker lists, once the new run's first output exists), anything else is
refused. A lock held for the run stops a second.

    {"owner": {"stage": "train.py", "run": "<digest of its inputs>", "time": "2025-01-01T00:00:00Z"},
     "outputs": [{"stage": "hf-model", "files": ["config.json", "model.safetensors"], "time": "...", "complete": true}]}

A rename across file systems fails (EXDEV) and a mount point (SageMaker's /opt/ml/model) cannot be removed or
renamed (EBUSY), so files are written into a staging dir *inside* the target, then moved in one by one (plain
renames), and the record of each output (a model and its tokenizer are two) is written last.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import IO

from safetensors import SafetensorError

MARKER = "minilm-az-output.json"
STAGING_PREFIX = ".staging-"
STAGING_MARK = ".mark"  # STAGING_PREFIX...X.mark beside each staging dir: a user's ".staging-backup" has none
LOCK = ".minilm-az.lock.sagemaker-ignore"  # SageMaker's sync never uploads it: a lock belongs to one host


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


CHUNK = 64 << 20  # content_sha256 hashes a file in pieces of this size, several at once


def _chunk_sha256(path: str, start: int) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = CHUNK
        while left and (block := f.read(min(left, 8 << 20))):
            digest.update(block)  # hashlib lets go of the GIL on large blocks, so the threads hash in parallel
            left -= len(block)
    return digest.digest()


def content_sha256(path: str) -> str:
    """A digest of every byte of `path`: sha256 over the sha256 of each 64 MiB piece, the pieces hashed on every CPU
    core at once. What a resume compares, so a file changed anywhere (not only at its ends) is a different input."""
    size = os.path.getsize(path)
    workers = max(1, min(16, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        pieces = pool.map(functools.partial(_chunk_sha256, path), range(0, max(size, 1), CHUNK))
        return hashlib.sha256(f"{size}:".encode() + b"".join(pieces)).hexdigest()


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


def shown(path: str) -> str:
    """`path` as it can be printed: a name that is not UTF-8 (os gives it as surrogates) with its bytes escaped."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def describe(path: str) -> str:
    """What is at `path`, in words an error line can say: a dangling link, a FIFO, a device, a directory, a file."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"a symlink to {shown(os.readlink(path))}, which does not exist"
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"unreadable ({e.strerror})" if os.path.lexists(path) else "not there"
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a file"),
        (stat.S_ISFIFO, "a FIFO (a named pipe, or a shell's <(...)), which can be read only once"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a file or directory"


def same_file(a: str, b: str) -> bool:
    """Whether `a` and `b` are one file or directory: compared as files (links followed, hard links and bind
    mounts too), not as strings; a path that does not exist yet is compared by its resolved name."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_not_input(out: str, inputs: dict[str, str | None]) -> None:
    """Refuse an --out that is one of the run's inputs, or holds one, or lies inside one, compared as files
    (`inputs`: flag -> path). A symlink or a second name for an input would otherwise be replaced by the output."""
    for flag, path in inputs.items():
        if not path:
            continue
        if same_file(out, path):
            raise OutputError(
                f"--out {shown(out)} is {flag} {shown(path)} (one directory): the output would replace it"
            )
        if os.path.exists(path) and inside(out, path):
            raise OutputError(f"--out {shown(out)} holds {flag} {shown(path)}: the output would replace it")
        if os.path.isdir(path) and inside(path, out):
            raise OutputError(f"--out {shown(out)} is inside {flag} {shown(path)}: the output would change it")


# ---------------------------------------------------------------- the marker


def _marker(out_dir: str) -> dict:
    path = os.path.join(out_dir, MARKER)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            marker = json.load(f)
        if not isinstance(marker, dict):
            raise ValueError("not a JSON object")
        owner, records = marker.get("owner", {}), marker.get("outputs", [])
        if not (isinstance(owner, dict) and isinstance(records, list) and all(isinstance(r, dict) for r in records)):
            raise ValueError("its owner is not an object, or its outputs not a list of objects")
        for names in [owner.get("files", []), *(r.get("files", []) for r in records)]:
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"a file list is not a list of names: {json.dumps(names)[:60]}")
    except (OSError, ValueError) as e:
        raise OutputError(f"{path}: unreadable output marker ({e}); remove it by hand") from None
    return marker


def _read_marker(out_dir: str) -> list[dict]:
    records = _marker(out_dir).get("outputs", [])
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("files"), list)]


def _write_marker(out_dir: str, records: list[dict], owner: dict | None = None) -> None:
    owner = owner or _marker(out_dir).get("owner")
    if records or owner:
        atomic_write_json(os.path.join(out_dir, MARKER), {**({"owner": owner} if owner else {}), "outputs": records})
    elif os.path.exists(os.path.join(out_dir, MARKER)):
        os.remove(os.path.join(out_dir, MARKER))


def inside(root: str, path: str) -> bool:
    """Whether `path` resolves (symlinks followed) inside `root`. Every path read from a file must: a marker, an
    index or an adapter is data on disk, and a name in it may not reach, or remove, a file elsewhere."""
    root = os.path.realpath(root)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def _remove_files(out_dir: str, files: Iterable[str]) -> list[str]:
    removed = []
    for rel in files:
        path = os.path.join(out_dir, rel)
        if os.path.isabs(rel) or ".." in rel.split("/") or not inside(out_dir, os.path.dirname(path)):
            continue  # a name that leads out of out_dir, by `..` or through a link: never followed
        if not (os.path.isfile(path) or os.path.islink(path)):
            continue  # the file itself may be a link: removing a link leaves its target alone
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


class OutputError(ValueError):
    """A directory this run may not write, said in one line before any work."""


def lock_dir(path: str, flag: str) -> IO:
    """Create `path` if needed and hold an exclusive lock on it until the process ends; a second holder is refused.

    flock, not a pid file: the kernel drops the lock when its process dies, even by SIGKILL, so a killed run never
    leaves a stale lock behind for its restart. Taking it also proves, before hours of work, that `path` is writable.
    """
    created, lock = not os.path.exists(path), os.path.join(path, LOCK)
    if os.path.lexists(path) and not os.path.isdir(path):  # a file, a dangling link: say what, not "File exists"
        raise OutputError(f"{flag} {shown(path)} is {describe(path)}, where a directory belongs")
    if os.path.lexists(lock) and (os.path.islink(lock) or not os.path.isfile(lock)):
        # Opened through a link, the lock would create (or truncate) its target, wherever that is.
        raise OutputError(f"{shown(lock)} is {describe(lock)}, where the run's lock file goes; remove it")
    try:
        os.makedirs(path, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        handle = os.fdopen(os.open(lock, flags, 0o666), "a")
    except OSError as e:
        raise OSError(f"{flag} {shown(path)}: cannot write there ({e.strerror})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(handle.fileno()).st_ino != os.stat(lock).st_ino:  # its holder removed it as we opened it
            raise BlockingIOError
    except (BlockingIOError, FileNotFoundError):
        handle.close()
        raise OutputError(
            f"{flag} {shown(path)}: another run is writing there now; wait for it, or choose another"
        ) from None
    atexit.register(_unlock, path, handle, created)
    return handle


def check_writable(path: str, flag: str) -> None:
    """Raise OSError, naming `flag`, if `path` cannot be written (ranks that hold no lock, before hours of work)."""
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, f".write-test-{os.getpid()}"), "w") as probe:
            os.remove(probe.name)
    except OSError as e:
        raise OSError(f"{flag} {path}: cannot write there ({e.strerror})") from None


def output_above(path: str) -> str | None:
    """The nearest directory at or above `path` whose marker says it is a stage's output, if any."""
    d = os.path.realpath(path)
    while not os.path.isfile(os.path.join(d, MARKER)):
        if os.path.dirname(d) == d:
            return None
        d = os.path.dirname(d)
    return d


def own_subdir(out_dir: str, name: str, mark: str) -> str:
    """out_dir/name for an output of this stage's own: new, or holding `mark`, the file it writes there last."""
    path = os.path.join(out_dir, name)
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(os.path.join(path, mark))):
        raise OutputError(f"{path} exists and is not an output of this stage (it has no {mark}); move it away")
    return path


def remove_output(path: str, mark: str) -> None:
    """Remove what a stage wrote in `path`, known by `mark` (own_subdir's): the files its marker lists, then the
    marker and the mark, last, so a stop halfway leaves no whole model. A file no record lists stays, and its dir."""
    if os.path.islink(path) or not os.path.isfile(os.path.join(path, mark)):
        return
    _remove_leftover_staging(path)
    _remove_files(path, [*(f for record in _read_marker(path) for f in record["files"]), MARKER, mark])
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _unlock(path: str, handle: IO, created: bool) -> None:
    # At exit the lock file goes, so a directory holds only what was written; a directory this run made and wrote
    # nothing into goes too (a refused or failed first run leaves nothing behind).
    with contextlib.suppress(OSError):
        if not handle.closed:
            os.remove(os.path.join(path, LOCK))
        if created and set(os.listdir(path)) <= {MARKER} and not _read_marker(path):
            shutil.rmtree(path)
    handle.close()


def _owner_problem(out_dir: str, stage: str, overwrite: bool, run: str | None, resume: bool) -> tuple[str | None, bool]:
    """(why `stage` may not write out_dir, or None; whether an earlier output of the same stage will be replaced)."""
    if not os.path.lexists(out_dir):
        return None, False
    if not os.path.isdir(out_dir):  # a file, a dangling link, a FIFO: said as what it is
        return f"is {describe(out_dir)}, where a directory belongs", False
    # A marker alone is a run that stopped before it wrote anything; the lock and a staging dir are ours. Any other
    # name counts, hidden or not: a directory holding only a user's dot files is not empty.
    ours = {MARKER, LOCK}
    entries = sorted(e for e in os.listdir(out_dir) if e not in ours and not _is_staging(os.path.join(out_dir, e)))
    if not entries:
        return None, False
    records = _read_marker(out_dir)  # a dir written before owners were recorded: its newest output's stage
    owner = _marker(out_dir).get("owner") or ({k: records[-1].get(k) for k in ("stage", "time")} if records else {})
    if not owner:
        more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
        return f"holds files no minilm-az stage wrote ({', '.join(entries[:3])}{more}); choose a new directory", False
    if owner.get("stage") != stage:
        return f"holds the output of `{owner.get('stage')}` ({owner.get('time')}); choose a new directory", False
    if resume and run is not None and owner.get("run") == run:  # the same run, which --resume auto continues
        return None, False
    if overwrite:
        return None, True
    other = " from other inputs" if run is not None and resume else ""
    return f"holds an earlier `{stage}`'s output{other} ({owner.get('time')}); pass --overwrite to replace it", False


def claim(out_dir: str, stage: str, overwrite: bool, run: str | None = None, run_files=(), resume=True) -> tuple:
    """Take out_dir for `stage` under the one ownership rule every writer follows: (the held lock, replacing).

    A stage writes only into a directory that is new (or empty), or that the marker says this stage owns. There the
    same run (train/finetune: `run`, a digest of its inputs, is equal, and it may `resume`) continues; an earlier
    output is replaced only with --overwrite, which removes only files the marker lists (`run_files`, a run's logs,
    once this run's first output exists: replace_earlier; outputs as the new ones move in). Anything else is refused,
    --overwrite or not: files the marker does not list may be another model's, and nothing here may remove them.
    """
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", out_dir):  # never a local directory named "s3:"
        raise OutputError(
            f"--out {shown(out_dir)}: a URL; outputs are local directories (a SageMaker job uploads its model dir; "
            "only --checkpoint-dir may be s3://BUCKET/PREFIX)"
        )
    problem, _ = _owner_problem(out_dir, stage, overwrite, run, resume)  # before the lock: a refusal creates nothing
    if above := output_above(os.path.dirname(os.path.realpath(out_dir))):  # where it is, through links
        problem = f"is inside {above}, the output of another run or stage; choose a directory outside it"
    if problem:
        raise OutputError(f"--out {shown(out_dir)}: {problem}")
    lock = lock_dir(out_dir, "--out")
    problem, replacing = _owner_problem(out_dir, stage, overwrite, run, resume)  # again, now no other run can write
    if problem:
        lock.close()
        raise OutputError(f"--out {shown(out_dir)}: {problem}")
    for name in run_files:  # the run writes them itself: through a link it would write where the link points
        if os.path.islink(os.path.join(out_dir, name)):
            lock.close()
            where = shown(os.readlink(os.path.join(out_dir, name)))
            raise OutputError(
                f"--out {shown(out_dir)}: {name} is a symlink to {where}; a run never writes through a link: remove it"
            )
    marker = _marker(out_dir)
    # Until this run ends, its entry names what it may write; at exit it names the files it did write.
    owner = dict(stage=stage, run=run, time=_now(), files=list(run_files))
    _unshare_appended(out_dir, run_files)
    before = _files_under(out_dir, run_files)
    if replacing:  # the earlier run's files and entry stay until this run's first output exists (replace_earlier)
        _REPLACING[os.path.realpath(out_dir)] = (marker.get("owner", {}).get("files", []), owner, run_files, before)
    elif not marker.get("owner"):
        _write_marker(out_dir, marker.get("outputs", []), owner)
    atexit.register(_record_run_files, out_dir, run_files, before, lock)
    return lock, replacing


# Out dirs (resolved) whose earlier run this process replaces, once its first output exists -> (the earlier run's
# files, the new owner entry, the log names, what is under them now). Kept here, not returned: checkpoint.claim_run
# takes the claim, and the run's log, which writes that output's line, asks.
_REPLACING: dict[str, tuple] = {}


def replacing(out_dir: str) -> bool:
    """Whether this process replaces the earlier run in out_dir (--overwrite) and its first output is not there yet."""
    return os.path.realpath(out_dir) in _REPLACING


def replace_earlier(out_dir: str) -> None:
    """Remove the files the earlier run in out_dir recorded writing, and make this run its owner: called once this
    run's first output (a checkpoint, the export, an evaluation's line) exists, so a run stopped before it (Ctrl-C,
    a kill) leaves the earlier one whole. Only the first call of a replacing run does anything."""
    if (pending := _REPLACING.pop(os.path.realpath(out_dir), None)) is None:
        return
    old, owner, names, before = pending
    # Only files the earlier run recorded writing: never a whole directory, never a name's pattern.
    _remove_files(out_dir, [name for name in old if name not in (".", "..")])
    _write_marker(out_dir, _marker(out_dir).get("outputs", []), {**owner, "time": _now()})
    before.clear()  # what is left under the log's names is not this run's: at exit it is not recorded as written
    before.update(_files_under(out_dir, names))


def _files_under(out_dir: str, names: Iterable[str]) -> dict[str, tuple[int, int]]:
    """{relative path: (device, inode)} of the plain files at or under each of `names` in out_dir."""
    found = {}
    for name in names:
        top = os.path.join(out_dir, name)
        if os.path.isfile(top) and not os.path.islink(top):
            found[name] = (os.stat(top).st_dev, os.stat(top).st_ino)
        elif os.path.isdir(top) and not os.path.islink(top):
            for root, _, files in os.walk(top):
                for file in files:
                    path = os.path.join(root, file)
                    if os.path.isfile(path) and not os.path.islink(path):
                        rel = os.path.relpath(path, out_dir).replace(os.sep, "/")
                        found[rel] = (os.stat(path).st_dev, os.stat(path).st_ino)
    return found


def _record_run_files(out_dir: str, names: Iterable[str], before: dict, lock: IO) -> None:
    # At exit the owner entry lists the files this run wrote under its log names (and those an earlier process
    # of the same run recorded), so a later --overwrite removes exactly them: a file a user put beside them stays.
    with contextlib.suppress(OSError, OutputError):
        if lock.closed or replacing(out_dir):  # given back (a refusal), or it never replaced the earlier run
            return
        marker = _marker(out_dir)
        owner = marker.get("owner")
        if not owner:
            return
        now = _files_under(out_dir, names)
        earlier = [f for f in owner.get("files", []) if f in before]  # recorded by an earlier process of this run
        written = [f for f, inode in now.items() if before.get(f) != inode]
        files = sorted(set(earlier) | set(written))
        if files != owner.get("files"):
            _write_marker(out_dir, marker.get("outputs", []), {**owner, "files": files})


def _unshare_appended(out_dir: str, names: Iterable[str]) -> None:
    """Give each file this run appends to (its metrics.jsonl) an inode of its own: a directory copied with hard links
    (`cp -al`) shares it with its twin, and an append through one name would change the other's file too."""
    for name in names:
        path = os.path.join(out_dir, name)
        if os.path.isfile(path) and not os.path.islink(path) and os.stat(path).st_nlink > 1:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out_dir)
            os.close(fd)
            shutil.copy2(path, tmp)
            os.replace(tmp, path)


def check_finished(out_dir: str | None, overwrite: bool, checkpoint_dir: str) -> None:
    """Refuse to train again, without --overwrite, a run whose output is finished and that has no checkpoint to
    continue from (its checkpoints were removed to free disk): the same run continues only from a checkpoint."""
    if out_dir is None or overwrite:
        return
    done = [r for r in _read_marker(out_dir) if r.get("complete")]
    if done:
        raise OutputError(
            f"--out {shown(out_dir)} holds this run's finished output ({done[-1].get('time')}) and "
            f"{shown(checkpoint_dir)} no checkpoint to continue from: pass --overwrite to train it again from step 0, "
            "or choose a new --out"
        )


# ---------------------------------------------------------------- staged directories


def _is_staging(path: str) -> bool:
    """Whether `path` is a staging dir staged_output made, or its mark: the pair, never a name alone."""
    if not os.path.basename(path).startswith(STAGING_PREFIX) or os.path.islink(path):
        return False
    if path.endswith(STAGING_MARK):
        return os.path.isfile(path) and os.path.isdir(path[: -len(STAGING_MARK)])
    return os.path.isdir(path) and os.path.isfile(path + STAGING_MARK)


def _remove_leftover_staging(out_dir: str) -> None:
    # A process killed inside staged_output leaves its staging dir behind, marked as one; a dir named like it that
    # holds no mark is someone else's.
    if os.path.isdir(out_dir):
        for name in os.listdir(out_dir):
            path = os.path.join(out_dir, name)
            if not path.endswith(STAGING_MARK) and _is_staging(path):
                shutil.rmtree(path, ignore_errors=True)
                os.remove(path + STAGING_MARK)


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


def _check_no_conflicts(out_dir: str, files: list[str], replaces: Iterable[str]) -> None:
    # Check before anything moves, because a failure halfway through would leave a mixed directory. A file no record
    # lists is a user's: never replaced, and never left beside the output when a reader would load it instead.
    recorded = {f for r in _read_marker(out_dir) for f in r["files"]}
    for rel in [*files, *(f for f in replaces if f not in files)]:
        if rel == MARKER:
            raise ValueError(f"staged_output: a stage may not write the marker file {MARKER} itself")
        target = os.path.join(out_dir, rel)
        if not inside(out_dir, os.path.dirname(target)):
            raise OutputError(f"{os.path.dirname(target)} leads outside {out_dir} (a link); the output goes in there")
        if os.path.isdir(target):
            raise IsADirectoryError(f"{target} is a directory; the new output has a file there")
        if os.path.lexists(target) and rel not in recorded:
            why = "the new output has a file of that name" if rel in files else "a reader would load it, not the output"
            raise OutputError(f"{shown(target)}: no minilm-az output recorded writing it, and {why}; move it away")
        parent = os.path.dirname(rel)
        while parent:
            path = os.path.join(out_dir, parent)
            if os.path.exists(path) and not os.path.isdir(path):
                raise NotADirectoryError(f"{path} is a file; the new output has a directory there")
            parent = os.path.dirname(parent)


def _move_in(stage_dir: str, out_dir: str, files: list[str]) -> None:
    """Rename each staged file into out_dir (same file system), creating subdirectories as needed."""
    for rel in files:  # readable by others like any file (safetensors writes 0600), and on disk before the renames
        os.chmod(os.path.join(stage_dir, rel), 0o666 & ~_umask())
        _fsync(os.path.join(stage_dir, rel))
    dirs = {out_dir}
    for rel in files:
        dst = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(os.path.join(stage_dir, rel), dst)
        dirs.add(os.path.dirname(dst))
    for d in dirs:
        _fsync(d)


def write_error(path: str, e: BaseException) -> OSError:
    """A failed write as one line: the path, the reason and the free space there (so a full disk says so)."""
    where = path
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where) or "."
    free = shutil.disk_usage(where).free
    code = re.search(r"os error (\d+)|code: (\d+)", str(e))  # safetensors' Rust text: its errno, said as the OS says
    text = os.strerror(int(code[1] or code[2])) if code else (str(e).splitlines() or [type(e).__name__])[0]
    reason = getattr(e, "strerror", None) or text
    space = f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"
    return OSError(f"{path}: cannot write the output ({reason}; {space} free there)")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@contextmanager
def staged_output(out_dir: str, stage: str = "", replaces: Iterable[str] = ()) -> Iterator[str]:
    """Yield a staging dir inside `out_dir`; on success move its files into `out_dir` and record them.

    On an exception inside the block the staging dir is removed and `out_dir` is left as it was.
    Files of the previous output of the same `stage` that the new one lacks are removed (the marker
    listed them); `replaces` names another layout of the same output (model.safetensors beside a sharded
    export): removed where a record lists it, refused where none does (a reader would load it instead).
    """
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    _remove_leftover_staging(out_dir)
    # The mark first, then the dir of its name: a staging dir without its mark is never taken for one of ours.
    fd, mark = tempfile.mkstemp(prefix=STAGING_PREFIX, suffix=STAGING_MARK, dir=out_dir)
    os.close(fd)
    stage_dir = mark[: -len(STAGING_MARK)]
    os.mkdir(stage_dir)
    try:
        yield stage_dir
        files = _staged_files(stage_dir)
        _check_no_conflicts(out_dir, files, replaces)
        _commit(out_dir, stage_dir, files, stage, replaces)
    except BaseException as e:
        shutil.rmtree(stage_dir, ignore_errors=True)
        os.remove(mark)
        if created and not os.listdir(out_dir):  # we made out_dir, so a failed first write removes it
            os.rmdir(out_dir)
        if isinstance(e, (OSError, SafetensorError)):  # a full disk, a read-only mount: one line, with the space
            raise write_error(out_dir, e) from None
        raise
    finally:
        shutil.rmtree(stage_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(mark)


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
    replace_earlier(out_dir)  # an output of this run exists now: the run it replaces has had its time
