"""Reading a corpus: plain and compressed text, JSON lines and Parquet, streamed one document at a time.

Corpus files: `.txt` holds one document a line (`doc_sep="line"`) or blank-line separated documents
(`doc_sep="blank"`); `.jsonl` holds one JSON object a line with a `text` field, and so must `.json` (a .json
file whose first line is not an object is refused by name); either may be gzipped (`.gz`) or
zstandard-compressed (`.zst`, as OSCAR ships `.jsonl.zst`); `.parquet` (FineWeb-2, CulturaX) holds the text in a
string column (`text`), read one row group at a time, nulls skipped; a directory stands for the corpus files
under it, and its other files are named in one warning line on stderr. Whitespace-only documents are skipped.
Compressed files are read to their end-of-stream marker, so a truncated one is an error, not a shorter corpus.
Files are streamed, never read whole.

Plain and gzipped text needs only the standard library. `.zst` needs zstandard and `.parquet` needs pyarrow:
both come with the `prep` extra (`pip install -e '.[prep]'`), and a file that needs one without it is one
CorpusError that names the extra.
"""

from __future__ import annotations

import gzip
import importlib
import io
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

from minilm_az.outputs import MARKER, describe, shown

CORPUS_SUFFIXES = (".txt", ".jsonl", ".json", ".txt.gz", ".jsonl.gz", ".txt.zst", ".jsonl.zst", ".parquet")
JSON_LINES = (".jsonl", ".json", ".jsonl.gz", ".jsonl.zst")
# What tokenize.py clean writes beside its corpus files: its report and the output marker, no corpus text.
OWN_FILES = ("clean_report.json", MARKER)


class CorpusError(ValueError):
    """A corpus path or file a user gave is unusable (missing, not UTF-8, malformed line, empty)."""


def need_extra(module: str, path: str) -> ModuleType:
    """Import a reader's optional library, or raise one line that names the file and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CorpusError(
            f"{shown(path)}: reading it needs {module}, which is in the prep extra: pip install -e '.[prep]'"
        ) from None


def _zstd_error() -> type[Exception]:
    """zstandard's error class when it is installed; a class nothing raises otherwise (no .zst was opened)."""
    try:
        import zstandard
    except ImportError:
        return CorpusError
    return zstandard.ZstdError


def _unlistable(e: OSError) -> None:
    # os.walk passes over a directory it cannot list; a corpus directory that cannot be listed is an error.
    raise CorpusError(f"{shown(e.filename)}: cannot list the corpus directory ({e.strerror})")


def corpus_files(paths: Iterable[str]) -> list[str]:
    """Expand corpus paths (files and directories, searched recursively) into a sorted file list.

    A directory's files of no corpus kind are named in one warning line on stderr, not skipped silently (hidden
    files and folders, and tokenize.py clean's own report and marker, are left out without a word).
    """
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found, skipped = [], []
            for root, dirs, names in os.walk(p, onerror=_unlistable):
                if names and not os.access(root, os.X_OK):  # its names list, but no file in it opens: not "no corpus"
                    raise CorpusError(f"{shown(root)}: permission denied: without search (x) permission no file opens")
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(n for n in names if not n.startswith(".") and n not in OWN_FILES):
                    if name.endswith(CORPUS_SUFFIXES) and os.path.isfile(os.path.join(root, name)):  # no pipes
                        found.append(os.path.join(root, name))
                    else:
                        skipped.append(os.path.join(root, name))
            if skipped:
                names = ", ".join(shown(os.path.relpath(f, p)) for f in skipped[:10]) + (
                    " ..." if len(skipped) > 10 else ""
                )
                print(f"warning: {p}: skipped {len(skipped)} files that are not corpus files: {names}", file=sys.stderr)
            if not found:
                raise CorpusError(f"no corpus files ({', '.join(CORPUS_SUFFIXES)}) under directory {shown(p)}")
            files += found
        elif os.path.isfile(p):
            if not p.endswith(CORPUS_SUFFIXES):
                raise CorpusError(f"{shown(p)}: unsupported corpus file (expected {', '.join(CORPUS_SUFFIXES)})")
            files.append(p)
        elif os.path.lexists(p):  # /dev/null, a FIFO or a shell's <(...), a dangling link: it exists, so say what
            raise CorpusError(f"{shown(p)} is {describe(p)}, not a corpus file; give a file or a directory of them")
        else:
            raise CorpusError(f"corpus path not found: {shown(p)}")
    if not files:
        raise CorpusError("no corpus paths given")
    for path in files:
        if path.endswith(".json"):
            _check_json_lines(path)
    return list(dict.fromkeys(files))


def _check_json_lines(path: str) -> None:
    """Refuse a .json file before any work unless its first line is a JSON object; the reader checks every line.

    A .json file is as often one pretty-printed object or an array as JSON lines: refused here, it is named at
    once rather than after the files before it have been read.
    """
    with open(path, "rb") as f:
        line = f.readline(1 << 20)
        while line and not line.strip():
            line = f.readline(1 << 20)
    if not line or len(line) == 1 << 20:  # empty (the corpus-is-empty check names it), or one long line
        return
    try:
        ok = isinstance(json.loads(line.decode("utf-8-sig")), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise CorpusError(
            f"{shown(path)}: a .json corpus file must be JSON lines (one object with a text field a line), and its "
            "first line is not one; convert it, or move it out of the corpus"
        )


def iter_documents(
    files: Iterable[str],
    doc_sep: str = "line",
    errors: str = "strict",
    text_field: str = "text",
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[str]:
    """Stream the documents of corpus files (see the module docstring for the formats).

    `errors="strict"` raises CorpusError naming the file and byte offset (of the decompressed
    stream for .gz) of invalid UTF-8; `"replace"` substitutes U+FFFD. `on_bytes(n)` is called with
    the on-disk bytes consumed, for a progress bar. A corpus without documents raises CorpusError.
    """
    if doc_sep not in ("line", "blank"):
        raise ValueError(f"doc_sep must be 'line' or 'blank', got {doc_sep!r}")
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors must be 'strict' or 'replace', got {errors!r}")
    files, n = list(files), 0
    for path in files:
        for doc in _file_documents(path, doc_sep, errors, text_field, on_bytes):
            n += 1
            yield doc
    if n == 0:
        raise CorpusError(f"corpus is empty: no documents in {', '.join(files) or '(no files)'}")


def _file_documents(path, doc_sep, errors, text_field, on_bytes) -> Iterator[str]:
    if path.endswith(".parquet"):
        yield from _parquet_documents(path, text_field, on_bytes)
        return
    jsonl = path.endswith(JSON_LINES)
    with open(path, "rb") as raw:
        stream = _decompressed(raw, path)
        offset, reported, paragraph = 0, 0, []
        try:
            for lineno, line in enumerate(stream, 1):
                try:
                    text = line.decode("utf-8", errors)
                except UnicodeDecodeError as e:
                    raise CorpusError(
                        f"{shown(path)}: not valid UTF-8 at byte offset {offset + e.start} (line {lineno}); "
                        "fix the file or decode with errors='replace' (--errors replace)"
                    ) from None
                if lineno == 1 and text.startswith("\ufeff"):
                    text = text[1:]
                offset += len(line)
                if on_bytes is not None and lineno % 1024 == 0:
                    pos = raw.tell()
                    on_bytes(pos - reported)
                    reported = pos
                text = text.rstrip("\r\n")
                if jsonl:
                    doc = _jsonl_text(text, path, lineno, text_field)
                elif doc_sep == "line":
                    doc = text
                else:
                    if text.strip():
                        paragraph.append(text)
                        continue
                    doc, paragraph = "\n".join(paragraph), []
                if doc and not doc.isspace():
                    yield doc
            if paragraph:
                yield "\n".join(paragraph)
        except (EOFError, gzip.BadGzipFile, OSError, zlib.error, _zstd_error()) as e:  # zlib: bad deflate
            raise CorpusError(f"{shown(path)}: cannot read ({e}); is it a complete, uncorrupted file?") from None
        if on_bytes is not None:
            on_bytes(raw.tell() - reported)


def _decompressed(raw, path: str):
    """The byte stream of a corpus file: gunzipped for .gz, zstd-decoded for .zst (line iteration on either)."""
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(raw, need_extra("zstandard", path)))
    return raw


class _ZstdFrames(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame, ending in EOFError if the last frame is cut short.

    zstandard's own `stream_reader` ends quietly inside a truncated frame, so a file copied halfway would read as
    a shorter corpus. Here each frame has its own decompressor, whose `eof` says whether the frame was complete.
    A file of several concatenated frames (what zstd's streaming writers make) reads whole.
    """

    def __init__(self, raw, zstandard: ModuleType):
        self.raw = raw
        self.zstd = zstandard.ZstdDecompressor()
        self.frame = self.zstd.decompressobj()
        self.in_frame = False  # True while a frame has begun and not yet ended
        self.out = b""  # the last decompressed bytes; self.pos of them have been read
        self.pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.pos == len(self.out):
            data = self.raw.read(1 << 17)
            if not data:
                if self.in_frame:
                    raise EOFError("the file ends inside a zstd frame: it is truncated")
                return 0
            self.out, self.pos = self._decompress(data), 0
        n = min(len(buffer), len(self.out) - self.pos)
        buffer[:n] = memoryview(self.out)[self.pos : self.pos + n]
        self.pos += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            out.append(self.frame.decompress(data))
            self.in_frame = not self.frame.eof
            if self.in_frame:
                break  # the frame continues in the next read
            data = self.frame.unused_data  # the next frame's start, if any
            self.frame = self.zstd.decompressobj()
        return b"".join(out)


def _parquet_documents(path: str, text_field: str, on_bytes) -> Iterator[str]:
    # Imported here, not at the top: pyarrow is in the `prep` extra, and its import takes 0.2 s.
    pa = need_extra("pyarrow", path)
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{shown(path)}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise CorpusError(
            f"{shown(path)}: no column {text_field!r} (columns: {', '.join(schema.names)}); see --text-field"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CorpusError(f"{shown(path)}: column {text_field!r} holds {kind}, not strings")
    size, groups, reported = os.path.getsize(path), pf.num_row_groups, 0
    for g in range(groups):  # one row group in memory at a time, only the text column
        try:
            column = pf.read_row_group(g, columns=[text_field]).column(0)
        except (pa.ArrowException, OSError) as e:
            raise CorpusError(f"{shown(path)}: cannot read row group {g} ({e}); is it a complete file?") from None
        for doc in column.to_pylist():
            if doc and not doc.isspace():
                yield doc
        if on_bytes is not None:
            on_bytes(size * (g + 1) // groups - reported)
            reported = size * (g + 1) // groups


def _jsonl_text(line: str, path: str, lineno: int, field: str) -> str | None:
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise CorpusError(f"{shown(path)}:{lineno}: malformed JSON line ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
        got = type(obj.get(field)).__name__ if isinstance(obj, dict) and field in obj else "none"
        raise CorpusError(f"{shown(path)}:{lineno}: expected an object with a string {field!r} field (got {got})")
    return obj[field]


def corpus_bytes(files: Iterable[str]) -> int:
    """On-disk size of the corpus files (the total of a progress bar fed by `on_bytes`)."""
    return sum(os.path.getsize(f) for f in files)
