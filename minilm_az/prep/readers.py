"""Reading a corpus: plain and compressed text, JSON lines and Parquet, streamed one document at a time.

Corpus files: `.txt` holds one document a line (`doc_sep="line"`) or blank-line separated
documents (`doc_sep="blank"`); `.jsonl` holds one JSON object a line with a `text` field; either may
be gzipped (`.gz`) or zstandard-compressed (`.zst`, as OSCAR ships `.jsonl.zst`); `.parquet` (FineWeb-2,
CulturaX) holds the text in a string column (`text`), read one row group at a time, nulls skipped; a
directory stands for the corpus files under it. Whitespace-only documents are skipped. Files are
streamed, never read whole.

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
import zlib
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

CORPUS_SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz", ".txt.zst", ".jsonl.zst", ".parquet")


class CorpusError(ValueError):
    """A corpus path or file a user gave is unusable (missing, not UTF-8, malformed line, empty)."""


def need_extra(module: str, path: str) -> ModuleType:
    """Import a reader's optional library, or raise one line that names the file and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CorpusError(
            f"{path}: reading it needs {module}, which is in the prep extra: pip install -e '.[prep]'"
        ) from None


def _zstd_error() -> type[Exception]:
    """zstandard's error class when it is installed; a class nothing raises otherwise (no .zst was opened)."""
    try:
        import zstandard
    except ImportError:
        return CorpusError
    return zstandard.ZstdError


def corpus_files(paths: Iterable[str]) -> list[str]:
    """Expand corpus paths (files and directories, searched recursively) into a sorted file list."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(root, n) for n in sorted(names) if n.endswith(CORPUS_SUFFIXES)]
            if not found:
                raise CorpusError(f"no corpus files ({', '.join(CORPUS_SUFFIXES)}) under directory {p}")
            files += found
        elif os.path.isfile(p):
            if not p.endswith(CORPUS_SUFFIXES):
                raise CorpusError(f"{p}: unsupported corpus file (expected {', '.join(CORPUS_SUFFIXES)})")
            files.append(p)
        else:
            raise CorpusError(f"corpus path not found: {p}")
    if not files:
        raise CorpusError("no corpus paths given")
    return list(dict.fromkeys(files))


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
    jsonl = path.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst"))
    with open(path, "rb") as raw:
        stream = _decompressed(raw, path)
        offset, reported, paragraph = 0, 0, []
        try:
            for lineno, line in enumerate(stream, 1):
                try:
                    text = line.decode("utf-8", errors)
                except UnicodeDecodeError as e:
                    raise CorpusError(
                        f"{path}: not valid UTF-8 at byte offset {offset + e.start} (line {lineno}); "
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
            raise CorpusError(f"{path}: cannot read ({e}); is it a complete, uncorrupted file?") from None
        if on_bytes is not None:
            on_bytes(raw.tell() - reported)


def _decompressed(raw, path: str):
    """The byte stream of a corpus file: gunzipped for .gz, zstd-decoded for .zst (line iteration on either)."""
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if path.endswith(".zst"):
        # read_across_frames: a file made of several concatenated frames (zstd's streaming writers) reads whole
        zstandard = need_extra("zstandard", path)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
    return raw


def _parquet_documents(path: str, text_field: str, on_bytes) -> Iterator[str]:
    # Imported here, not at the top: pyarrow is in the `prep` extra, and its import takes 0.2 s.
    pa = need_extra("pyarrow", path)
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise CorpusError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); see --text-field")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CorpusError(f"{path}: column {text_field!r} holds {kind}, not strings")
    size, groups, reported = os.path.getsize(path), pf.num_row_groups, 0
    for g in range(groups):  # one row group in memory at a time, only the text column
        try:
            column = pf.read_row_group(g, columns=[text_field]).column(0)
        except (pa.ArrowException, OSError) as e:
            raise CorpusError(f"{path}: cannot read row group {g} ({e}); is it a complete file?") from None
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
        raise CorpusError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
        got = type(obj.get(field)).__name__ if isinstance(obj, dict) and field in obj else "none"
        raise CorpusError(f"{path}:{lineno}: expected an object with a string {field!r} field (got {got})")
    return obj[field]


def corpus_bytes(files: Iterable[str]) -> int:
    """On-disk size of the corpus files (the total of a progress bar fed by `on_bytes`)."""
    return sum(os.path.getsize(f) for f in files)
