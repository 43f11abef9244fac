"""The on-disk token-shard format: write, index, memmap read.

A shard directory holds flat little-endian `.bin` files of token ids (uint16 when the vocabulary
fits, else uint32) and an `index.json`:

    {"format": 1, "dtype": "uint16", "vocab_size": 8000, "tokenizer_hash": "<sha256>", "eos_id": 1,
     "splits": {"train": {"tokens": ..., "documents": ..., "bytes": ...,
                          "max_id": ..., "shards": [{"file": "train_00000.bin", "tokens": ..., "max_id": ...}]},
                "val": {...}}, ...}

A split is the concatenation of its shards in order (documents may cross shard boundaries). Each
document is its tokens followed by exactly one `eos_id`; document text is encoded with special-token
matching off, so `eos_id` occurs nowhere else and splitting a split at `eos_id` gives back its
documents in order (`TokenStream.documents()`). `bytes` is the UTF-8 size of the documents' text
after NFC normalisation (what the tokenizer sees); the EOS separators count as tokens, 0 bytes.
BPB over a whole split is `nll_bits / bytes`; over a window, sum per-token byte lengths instead
(`tokenizer.token_byte_lengths`). `max_id` is the largest token id in a shard (in a split: over its shards).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import threading
import unicodedata
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from minilm_az.outputs import atomic_write_json, content_sha256, file_sha256, read_json

FORMAT = 1
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB (uint16) / 400 MB (uint32) files


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def split_of(text: str, val_fraction: float) -> str:
    """'val' for a deterministic `val_fraction` of documents, by a hash of their (NFC) text.

    Identical documents always land in the same split, so exact duplicates never leak across.
    """
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return "val" if h < val_fraction * 2**64 else "train"


# --- write -------------------------------------------------------------------------------------------


class ShardWriter:
    """Appends token arrays to rolling `<split>_NNNNN.bin` files; `close()` writes `index.json`."""

    def __init__(
        self,
        out_dir: str,
        vocab_size: int,
        eos_id: int,
        tokenizer_hash: str,
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
        meta: dict | None = None,
    ):
        if os.path.isdir(out_dir) and os.listdir(out_dir):
            raise FileExistsError(f"shard output directory is not empty: {out_dir}")
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.shard_tokens = out_dir, shard_tokens
        self.dtype = np.dtype(dtype_for(vocab_size)).newbyteorder("<")
        splits = {s: {"tokens": 0, "documents": 0, "bytes": 0, "max_id": 0, "shards": []} for s in SPLITS}
        header = dict(format=FORMAT, dtype=dtype_for(vocab_size), vocab_size=vocab_size, tokenizer_hash=tokenizer_hash)
        self.index = {**header, "eos_id": eos_id, "splits": splits, **(meta or {})}
        self._files: dict[str, object] = {}

    def add(self, split: str, ids: np.ndarray, documents: int, nbytes: int) -> None:
        """Append `ids` (whole documents, EOS included) to `split`, counting their documents and bytes."""
        info = self.index["splits"][split]
        info["documents"] += documents
        info["bytes"] += nbytes
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        while ids.size:
            shards = info["shards"]
            if not shards or shards[-1]["tokens"] >= self.shard_tokens:
                self._roll(split)
            room = self.shard_tokens - shards[-1]["tokens"]
            head, ids = ids[:room], ids[room:]
            self._files[split].write(head.tobytes())
            shards[-1]["tokens"] += int(head.size)
            shards[-1]["max_id"] = max(shards[-1]["max_id"], int(head.max()))
            info["tokens"] += int(head.size)
            info["max_id"] = max(info["max_id"], shards[-1]["max_id"])

    def _roll(self, split: str) -> None:
        if split in self._files:
            self._files[split].close()
        shards = self.index["splits"][split]["shards"]
        name = f"{split}_{len(shards):05d}.bin"
        self._files[split] = open(os.path.join(self.out_dir, name), "wb")
        shards.append({"file": name, "tokens": 0, "max_id": 0})

    def close(self) -> dict:
        """Close the shard files and write index.json (last, so its presence means complete)."""
        for file in self._files.values():
            file.close()
        self._files.clear()
        atomic_write_json(os.path.join(self.out_dir, "index.json"), self.index)
        return self.index


def write_shards(
    documents: Iterable[str],
    out_dir: str,
    encode: Callable[[list[str]], list[list[int]]],
    vocab_size: int,
    eos_id: int,
    tokenizer_hash: str,
    val_documents: Iterable[str] | None = None,
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    batch_bytes: int = 1 << 20,
    meta: dict | None = None,
) -> dict:
    """Encode documents into a shard directory and return its index.

    `encode` batch-encodes plain text (e.g. `functools.partial(tokenizer.encode_plain, tok)`; it
    should release the GIL, as `encode_batch` does, so reading the next batch overlaps encoding).
    Documents are NFC-normalised, then split by `split_of(text, val_fraction)`, unless
    `val_documents` is given: then `documents` all go to train and `val_documents` to val. Memory
    is bounded by `batch_bytes` of text (a few batches in flight; the encodings of one batch take
    ~30x its text), whatever the corpus size.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_documents is None:
        tagged = ((None, d) for d in documents)
    else:
        tagged = itertools.chain((("train", d) for d in documents), (("val", d) for d in val_documents))
    writer = ShardWriter(out_dir, vocab_size, eos_id, tokenizer_hash, shard_tokens, meta)
    for split, texts, nbytes in _prefetch(_batches(tagged, val_fraction, batch_bytes)):
        encoded = encode(texts)
        for doc_ids in encoded:
            doc_ids.append(eos_id)
        count = sum(len(doc_ids) for doc_ids in encoded)
        flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=writer.dtype, count=count)
        writer.add(split, flat, len(texts), nbytes)
    return writer.close()


def _batches(tagged: Iterable[tuple[str | None, str]], val_fraction: float, batch_bytes: int):
    """Yield (split, texts, utf8_bytes) batches of NFC documents, about `batch_bytes` of text each."""
    texts: dict[str, list[str]] = {split: [] for split in SPLITS}
    nbytes = dict.fromkeys(SPLITS, 0)
    for split, text in tagged:
        text = unicodedata.normalize("NFC", text)
        split = split or split_of(text, val_fraction)
        texts[split].append(text)
        nbytes[split] += len(text.encode("utf-8"))
        if nbytes[split] >= batch_bytes:
            yield split, texts[split], nbytes[split]
            texts[split], nbytes[split] = [], 0
    for split in SPLITS:
        if texts[split]:
            yield split, texts[split], nbytes[split]


def _prefetch(items: Iterator, depth: int = 2) -> Iterator:
    """Run a generator in a background thread, `depth` items ahead. Its errors are raised here."""
    ahead: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ahead.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False  # the consumer has stopped reading

    def work():
        try:
            for item in items:
                if not put((None, item)):
                    return
            put((None, done))
        except BaseException as e:  # raised again in the consumer
            put((e, None))

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    try:
        while True:
            error, item = ahead.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        worker.join(timeout=5)


# --- read --------------------------------------------------------------------------------------------


class ShardIndexError(ValueError):
    """index.json does not describe its shard directory (the message names the file and the field)."""


def load_index(data_dir: str) -> dict:
    """Read `<data_dir>/index.json`, checked against the format: field types, shard files inside `data_dir` (symlinks
    followed) of the size their tokens take, ids below `vocab_size`, split totals; any fault is one ShardIndexError."""
    path = os.path.join(data_dir, "index.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no index.json in {data_dir}: not token shards from `tokenize.py encode`")
    index, root = read_json(path), os.path.realpath(data_dir)

    def need(ok: bool, field: str, value: object, why: str) -> None:
        if not ok:
            raise ShardIndexError(f"{path}: {field} {json.dumps(value)[:80]} {why}")

    def count(value: object) -> bool:
        return type(value) is int and value >= 0  # a JSON integer: Python's bool is an int, JSON's true is not

    fmt, dtype, vocab, eos = (index.get(key) for key in ("format", "dtype", "vocab_size", "eos_id"))
    need(count(fmt) and fmt == FORMAT, "format", fmt, f"is not a supported shard format (expected {FORMAT})")
    need(dtype in ("uint16", "uint32"), "dtype", dtype, 'is not "uint16" or "uint32"')
    need(count(vocab) and vocab <= np.iinfo(dtype).max + 1, "vocab_size", vocab, f"is not a count that {dtype} holds")
    below, little = f"is not a token id below vocab_size {vocab}", np.dtype(dtype).newbyteorder("<")
    need(count(eos) and eos < vocab, "eos_id", eos, below)
    need(isinstance(index.get("tokenizer_hash"), str), "tokenizer_hash", index.get("tokenizer_hash"), "is not a string")
    need(isinstance(index.get("splits"), dict), "splits", index.get("splits"), "is not an object")
    seen: set = set()  # a shard listed twice (or in both splits) would train twice, or score training data
    for name, split in index["splits"].items():
        at = f"splits.{name}"
        ok = isinstance(split, dict) and isinstance(split.get("shards"), list)
        ok = ok and count(split.get("documents")) and count(split.get("bytes"))
        need(ok, at, split, "is not an object with a shards list and counts of documents and bytes")
        for i, shard in enumerate(split["shards"]):
            on = f"{at}.shards[{i}]"
            ok = isinstance(shard, dict) and isinstance(shard.get("file"), str) and count(shard.get("tokens"))
            need(ok, on, shard, "is not an object with a file name and a token count")
            file = os.path.realpath(os.path.join(data_dir, shard["file"]))
            need(file.startswith(root + os.sep), f"{on}.file", shard["file"], f"points outside {data_dir}")
            inode = (os.stat(file).st_dev, os.stat(file).st_ino) if os.path.isfile(file) else file  # links, hard too
            need(inode not in seen, f"{on}.file", shard["file"], "is listed twice")
            seen.add(inode)
            want = shard["tokens"] * little.itemsize
            got = f"{os.path.getsize(file)} bytes" if os.path.isfile(file) else "missing"
            need(got == f"{want} bytes", f"{on}.file", shard["file"], f"is {got}, not {want} bytes")
            if "max_id" not in shard:  # An older index.json. Reading the shard once is cheap next to training on it.
                shard["max_id"] = int(np.memmap(file, little, mode="r").max()) if want else 0
            need(count(shard["max_id"]) and shard["max_id"] < vocab, f"{on}.max_id", shard["max_id"], below)
        tokens = sum(shard["tokens"] for shard in split["shards"])
        need(split.get("tokens") == tokens, f"{at}.tokens", split.get("tokens"), f"is not its shards' total {tokens}")
        top = max((shard["max_id"] for shard in split["shards"]), default=0)
        need(split.setdefault("max_id", top) == top, f"{at}.max_id", split["max_id"], f"is not its shards' max {top}")
    return index


def check_tokenizer(index: dict, tokenizer_hash: str, vocab_size: int | None = None) -> None:
    """Raise ValueError unless the shards were written with this tokenizer: its hash, a vocabulary holding every id."""
    if index["tokenizer_hash"] != tokenizer_hash:
        raise ValueError(
            f"token shards were written with tokenizer {index['tokenizer_hash'][:12]}..., "
            f"not this one ({tokenizer_hash[:12]}...); re-run `tokenize.py encode` with it"
        )
    if vocab_size is not None and vocab_size < index["vocab_size"]:
        raise ValueError(f"vocab size {vocab_size} is smaller than the shards' {index['vocab_size']}")


def content_id(data_dir: str) -> str:
    """The identity of a shard directory by content: index.json and every byte of each shard it lists.

    A resume compares it, so a shard rewritten in place under an unchanged index.json is a different input. It costs
    one read of the shards (outputs.content_sha256, on every core: about 2-6 s per 2.5 GB measured here)."""
    index = load_index(data_dir)
    h = hashlib.sha256(f"index.json:{file_sha256(os.path.join(data_dir, 'index.json'))}".encode())
    for name in sorted(index["splits"]):
        for shard in index["splits"][name]["shards"]:
            h.update(f"{shard['file']}:{content_sha256(os.path.join(data_dir, shard['file']))}".encode())
    return h.hexdigest()


class TokenStream:
    """One split of a shard directory as one long int64 token sequence, read through memmaps.

    Shards are opened lazily (after a DataLoader fork, say) and never loaded whole.
    """

    def __init__(self, data_dir: str, split: str = "train"):
        self.index = load_index(data_dir)  # checked: every shard file is inside data_dir and holds its tokens
        if split not in self.index["splits"]:
            raise ValueError(f"{data_dir}: no split {split!r} (has {sorted(self.index['splits'])})")
        self.split, self.data_dir = split, data_dir
        self.eos_id = self.index["eos_id"]
        self.vocab_size = self.index["vocab_size"]  # every id read is checked against it (get)
        self.dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        info = self.index["splits"][split]
        self._shards = [shard for shard in info["shards"] if shard["tokens"] > 0]
        self._ends = np.cumsum([shard["tokens"] for shard in self._shards], dtype=np.int64)
        self.num_tokens = int(self._ends[-1]) if len(self._ends) else 0
        self.num_documents = info["documents"]
        self.num_bytes = info["bytes"]
        self._maps: list[np.memmap | None] = [None] * len(self._shards)

    def _map(self, i: int) -> np.memmap:
        if self._maps[i] is None:
            path = os.path.join(self.data_dir, self._shards[i]["file"])
            self._maps[i] = np.memmap(path, self.dtype, mode="r")
        return self._maps[i]

    def get(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as a new int64 array, read across shard boundaries."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) is outside the {self.num_tokens} {self.split} tokens")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self._ends, start, side="right"))  # the shard that holds `start`
        filled = 0
        while filled < length:
            pos = start + filled  # the position in the split
            offset = pos - (int(self._ends[shard - 1]) if shard else 0)  # the position in the shard
            take = min(length - filled, int(self._ends[shard]) - pos)
            out[filled : filled + take] = self._map(shard)[offset : offset + take]
            self._check_ids(out[filled : filled + take], shard, offset)
            filled += take
            shard += 1
        return out

    def _check_ids(self, ids: np.ndarray, shard: int, offset: int) -> None:
        # index.json's max_id vouches for the shard as it was written; a shard changed since (random bytes, another
        # dtype, another tokenizer's ids) shows here, as it is read. A max over a window costs nothing next to a step.
        if len(ids) and (top := int(ids.max())) >= self.vocab_size:
            at = offset + int(np.argmax(ids >= self.vocab_size))
            path = os.path.join(self.data_dir, self._shards[shard]["file"])
            raise ShardIndexError(
                f"{path}: token {at} is id {top}, not below the vocabulary's {self.vocab_size} (index.json): the shard "
                "changed since it was written, or holds another dtype; re-run `tokenize.py encode`"
            )

    def documents(self, chunk_tokens: int = 1 << 22) -> Iterator[tuple[int, int]]:
        """Yield each document's (start, end) token span, in order, without its EOS."""
        doc_start = 0
        for chunk_start in range(0, self.num_tokens, chunk_tokens):
            chunk = self.get(chunk_start, min(chunk_tokens, self.num_tokens - chunk_start))
            for eos_pos in np.flatnonzero(chunk == self.eos_id):
                end = chunk_start + int(eos_pos)
                yield doc_start, end
                doc_start = end + 1
