"""Deduplication for `tokenize.py clean`: hashes of a document and the indexes that remember them.

`exact_key` and `minhash` turn a document into keys; `KeyTable` (exact) and `NearIndex` (MinHash LSH) remember
the keys of kept documents. The indexes are the only state of `clean` that grows with the input, so they stay
within a RAM budget: the keys are LSM trees of sorted runs whose large runs spill to files in a temp folder
(SpillDir), found through a Bloom filter and a fence of every 1,024th key kept in RAM. Where a key lives
changes no verdict, only speed (tests/test_clean.py checks that).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections import deque
from collections.abc import Iterator

import numpy as np

# MinHash LSH. Shingles are character 5-grams of the lowercased text with punctuation removed, not word
# n-grams: Azerbaijani is agglutinative, so a changed suffix ("kitab" -> "kitablar") breaks every word n-gram
# holding that word but only a few character ones, and documents here can be one short sentence (a word
# 5-gram set of a 7-word line has 3 members). 120 permutations in 20 bands of 6 rows: a pair with Jaccard
# similarity s becomes a candidate with probability 1 - (1 - s^6)^20 (0.92 at s=0.7, 0.998 at 0.8, 0.27 at
# 0.5, 0.014 at 0.3), and every candidate is then verified on all 120 values (estimate's std <= 0.046), so a chance band
# collision costs one comparison, never a removal. Each document is checked against at most 20 candidates.
SHINGLE = 5
BANDS, ROWS = 20, 6
NUM_PERM = BANDS * ROWS
_MAX_SHINGLES = 8192  # signature computed in chunks of this many shingles: bounded memory for huge documents
_rng = np.random.default_rng(20240601)  # fixed: signatures must agree across processes and runs
_PERM_A = _rng.integers(1, 2**63, NUM_PERM, dtype=np.uint64) | np.uint64(1)
_PERM_B = _rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64)
_BAND_MUL = _rng.integers(1, 2**63, ROWS, dtype=np.uint64) | np.uint64(1)

BATCH_DOCS = 512  # documents a worker's batch holds at most
KEY_BUFFER = 1 << 16  # most keys a KeyTable holds in its dict before sorting them into a run (~6 MB)
DICT_ENTRY = 100  # bytes a key costs in that dict (its slot and two ints), measured with tracemalloc: 62-89
BLOOM_BITS = 16  # the Bloom filter grows (2x) while it holds more than 1 key per this many bits: ~0.5 % false
FENCE = 1024  # records per block of a spilled run, at least: RAM keeps one key a block, a lookup reads one
MERGE_CHUNK = 1 << 16  # records read at a time when runs are merged on disk (768 KB), at most
RECORD = np.dtype([("key", "<u8"), ("value", "<u4")])  # a spilled run's entry: 12 bytes

_NOT_WORD = re.compile(r"[\W_]+")


def exact_key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def minhash(text: str) -> np.ndarray:
    """The (NUM_PERM,) uint32 MinHash signature of the character 5-gram set of `text`."""
    s = _NOT_WORD.sub(" ", text.lower()).strip()
    cps = np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    n = max(len(cps) - SHINGLE + 1, 1)
    h = np.zeros(n, dtype=np.uint64)
    for j in range(min(SHINGLE, len(cps))):  # polynomial hash of each 5-gram, wrapping mod 2^64
        h = h * np.uint64(1_000_003) + cps[j : j + n]
    h = np.unique(h)
    h ^= h >> np.uint64(31)  # mix before the multiply-shift permutations
    h *= np.uint64(0x9E3779B97F4A7C15)
    sig = np.full(NUM_PERM, np.iinfo(np.uint32).max, dtype=np.uint32)
    for i in range(0, len(h), _MAX_SHINGLES):
        part = h[i : i + _MAX_SHINGLES, None] * _PERM_A[None, :] + _PERM_B[None, :]
        sig = np.minimum(sig, (part >> np.uint64(32)).astype(np.uint32).min(axis=0))
    return sig


def band_keys(sigs: np.ndarray) -> np.ndarray:
    """(n, NUM_PERM) signatures -> (n, BANDS) uint64 keys, one per band (a collision is only verified)."""
    rows = sigs.reshape(len(sigs), BANDS, ROWS).astype(np.uint64)
    return (rows * _BAND_MUL).sum(axis=2) + np.arange(BANDS, dtype=np.uint64)


class SpillDir:
    """A temp folder for the spilled parts of the dedup indexes: made on first use inside `parent` (the output
    dir; None: the system's temp dir), removed by `remove()`. A run that never spills creates nothing."""

    def __init__(self, parent: str | None = None):
        self.parent, self.path, self.files = parent, None, 0

    def new_file(self, kind: str) -> str:
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="dedup-spill-", dir=self.parent)
        self.files += 1
        return os.path.join(self.path, f"{kind}-{self.files:06d}.bin")

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


class _Bloom:
    """A blocked Bloom filter of uint64 keys: each key sets 4 bits of one 64-bit word, so a test is one memory
    access. Its size is fixed (KeyTable rebuilds a larger one while its budget allows): past ~6 bits a key its
    false-positive rate rises, so more keys are looked up on disk; the answers stay exact."""

    _WORD = np.uint64(0x9E3779B97F4A7C15)  # two odd multipliers: the keys are hashes, mixed once more here
    _BITS = np.uint64(0xC2B2AE3D27D4EB4F)

    def __init__(self, nbytes: int):
        self.words = np.zeros(max(nbytes // 8, 1), dtype=np.uint64)  # zero pages: RAM is taken as bits are set

    def _where(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        word = ((keys * self._WORD) >> np.uint64(32)) * np.uint64(len(self.words)) >> np.uint64(32)
        g, one, mask = keys * self._BITS, np.uint64(1), np.zeros(len(keys), dtype=np.uint64)
        for shift in (58, 52, 46, 40):  # four 6-bit fields of the product's well-mixed high bits
            mask |= one << ((g >> np.uint64(shift)) & np.uint64(63))
        return word, mask

    def add(self, keys: np.ndarray) -> None:
        for s in range(0, len(keys), 1 << 14):  # in slices: the temporaries stay ~0.5 MB
            word, mask = self._where(keys[s : s + (1 << 14)])
            np.bitwise_or.at(self.words, word, mask)

    def may_hold(self, keys: np.ndarray) -> np.ndarray:
        word, mask = self._where(keys)
        return (self.words[word] & mask) == mask

    @property
    def nbytes(self) -> int:
        return self.words.nbytes


class _RamRun:
    """A sorted run in RAM: keys and their values, two arrays (searchsorted wants contiguous keys)."""

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        self.keys, self.values = keys, values

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def ram_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def lookup(self, q: np.ndarray) -> np.ndarray:
        i = np.minimum(np.searchsorted(self.keys, q), len(self.keys) - 1)
        return np.where(self.keys[i] == q, self.values[i].astype(np.int64), -1)  # int64: -1 is no uint32

    def chunks(self, size: int) -> Iterator[np.ndarray]:
        for s in range(0, len(self.keys), size):
            part = np.empty(min(size, len(self.keys) - s), dtype=RECORD)
            part["key"], part["value"] = self.keys[s : s + size], self.values[s : s + size]
            yield part

    def remove(self) -> None:
        pass


class _DiskRun:
    """A sorted run in a file of RECORDs; RAM holds its fence, the first key of every `block` records, so a
    lookup reads one block (12 KB at the smallest block) with one pread. pread, not np.memmap: pages read
    stay in the OS page cache, which the kernel frees at will, instead of in this process's mapped memory."""

    def __init__(self, path: str, n: int, block: int, fence: np.ndarray):
        self.path, self.n, self.block, self.fence = path, n, block, fence
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.n

    @property
    def ram_bytes(self) -> int:
        return self.fence.nbytes

    def read(self, start: int, count: int) -> np.ndarray:
        size = RECORD.itemsize
        return np.frombuffer(os.pread(self.fd, min(count, self.n - start) * size, start * size), dtype=RECORD)

    def lookup(self, q: np.ndarray) -> np.ndarray:
        out = np.full(len(q), -1, dtype=np.int64)
        block = np.searchsorted(self.fence, q, side="right") - 1  # -1: below the run's first key
        order = np.argsort(block, kind="stable")
        bounds = np.flatnonzero(np.diff(block[order])) + 1
        for sel in np.split(order, bounds):  # the queries that fall in one block: one read
            if block[sel[0]] < 0:
                continue
            part = self.read(int(block[sel[0]]) * self.block, self.block)
            keys = part["key"].copy()
            i = np.minimum(np.searchsorted(keys, q[sel]), len(keys) - 1)
            hit = keys[i] == q[sel]
            out[sel[hit]] = part["value"][i[hit]]
        return out

    def chunks(self, size: int) -> Iterator[np.ndarray]:
        for s in range(0, self.n, size):
            yield self.read(s, size)

    def remove(self) -> None:
        os.close(self.fd)
        os.remove(self.path)


def _merge_sorted(older: Iterator[np.ndarray], newer: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """Two streams of sorted RECORD chunks (each key once per stream) -> one, in bounded memory; of a key in
    both streams the older one's record is kept."""
    empty = np.empty(0, dtype=RECORD)
    a, b = next(older, empty), next(newer, empty)
    while len(a) or len(b):
        # up to the smaller of the two chunks' last keys nothing smaller can come from either stream
        edge = min(x["key"][-1] for x in (a, b) if len(x))
        ia, ib = (int(np.searchsorted(x["key"], edge, side="right")) for x in (a, b))
        part = np.concatenate([a[:ia], b[:ib]])
        part = part[np.argsort(part["key"], kind="stable")]  # stable: the older record first
        yield part[np.concatenate([[True], part["key"][1:] != part["key"][:-1]])]
        a, b = a[ia:], b[ib:]
        a = a if len(a) else next(older, empty)
        b = b if len(b) else next(newer, empty)


class KeyTable:
    """uint64 key -> the value first stored for it, within `budget` bytes of RAM however many keys it holds.

    An LSM tree: keys added since the last `freeze()` are in the dict `recent` (for the caller to read and
    write directly); `freeze()` sorts them into a run and merges runs of similar size, so a lookup searches
    O(log n) runs and a key is rewritten O(log n) times. A run larger than `run_bytes` lives on disk
    (_DiskRun, in `spill`) and its keys are added to one Bloom filter shared by the disk runs: `frozen()`
    looks a batch up in the RAM runs at once, and on disk only the keys the filter may hold.

    The budget: first `recent`, KEY_BUFFER keys plus one batch's (it freezes between batches; fixed, so that
    the budget changes no verdict: NearIndex's candidates depend on when runs freeze); of the rest 1/3 for
    the RAM runs (those newer than the newest disk run are each more than twice the next, so they add up to
    < 2 * run_bytes, and merging two in RAM needs ~4x the result for a moment), 7/12 for the Bloom filter,
    1/12 for the fences (the block grows to keep them in it).
    """

    def __init__(self, budget: int, spill: SpillDir | None = None, batch_keys: int = 0):
        self.recent: dict[int, int] = {}
        self.runs: list[_RamRun | _DiskRun] = []  # oldest (and largest) first
        self.spill, self.buffer = spill or SpillDir(), KEY_BUFFER
        rest = max(budget - (self.buffer + batch_keys) * DICT_ENTRY, 0)
        self.run_bytes = rest // 3 // 6
        # a merge on disk holds ~9 chunks at once (two inputs, their concatenation, its sort): ~2 * run_bytes
        self.chunk = int(min(MERGE_CHUNK, max(FENCE, self.run_bytes // (4 * RECORD.itemsize))))
        self.bloom_bytes, self.fence_bytes = rest * 7 // 12 // 8 * 8, max(rest // 12, 1)  # whole words
        self.bloom: _Bloom | None = None

    def __len__(self) -> int:
        return len(self.recent) + sum(len(r) for r in self.runs)

    @property
    def ram_bytes(self) -> int:
        """What it holds in RAM: `recent` (DICT_ENTRY a key), the RAM runs, the fences, the Bloom filter."""
        bloom = self.bloom.nbytes if self.bloom is not None else 0
        return len(self.recent) * DICT_ENTRY + sum(r.ram_bytes for r in self.runs) + bloom

    @property
    def disk_bytes(self) -> int:
        return sum(len(r) * RECORD.itemsize for r in self.runs if isinstance(r, _DiskRun))

    def frozen(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key in the runs, -1 where it has none (the oldest run's value wins)."""
        out = np.full(len(keys), -1, dtype=np.int64)
        maybe = None
        for run in self.runs:
            todo = out < 0
            if isinstance(run, _DiskRun):
                maybe = self.bloom.may_hold(keys) if maybe is None else maybe
                todo &= maybe
            idx = np.flatnonzero(todo)
            if len(idx):
                out[idx] = run.lookup(keys[idx])
        return out

    def freeze(self) -> None:
        """Between batches: once `recent` is full, sort it into a run and merge runs of similar size."""
        if len(self.recent) < self.buffer:
            return
        keys = np.fromiter(self.recent.keys(), dtype=np.uint64, count=len(self.recent))
        values = np.fromiter(self.recent.values(), dtype=np.uint32, count=len(self.recent))
        self.recent = {}
        order = np.argsort(keys)
        run = _RamRun(keys[order], values[order])
        self.runs.append(run if run.ram_bytes <= self.run_bytes else self._to_disk(run))
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            newer, older = self.runs.pop(), self.runs.pop()
            self.runs.append(self._merged(older, newer))

    def _merged(self, older: _RamRun | _DiskRun, newer: _RamRun | _DiskRun) -> _RamRun | _DiskRun:
        if isinstance(older, _RamRun) and isinstance(newer, _RamRun):
            if (len(older) + len(newer)) * RECORD.itemsize <= self.run_bytes:
                keys, values = np.concatenate([older.keys, newer.keys]), np.concatenate([older.values, newer.values])
                order = np.argsort(keys, kind="stable")  # stable: of equal keys the older run's comes first
                keys, values = keys[order], values[order]
                first = np.concatenate([[True], keys[1:] != keys[:-1]])
                return _RamRun(keys[first], values[first])
        return self._to_disk(older, newer)

    def _to_disk(self, older: _RamRun | _DiskRun, newer: _RamRun | _DiskRun | None = None) -> _DiskRun:
        """Write `older` (merged with `newer`) as one disk run, chunk by chunk; the inputs are then removed."""
        ins = [r for r in (older, newer) if r is not None]
        ram = [r for r in ins if isinstance(r, _RamRun)]
        self._grow_bloom([r for r in self.runs + ins if isinstance(r, _DiskRun)], sum(len(r) for r in ram))
        for r in ram:  # a disk run's keys are in the filter already
            self.bloom.add(r.keys)
        block, keys = FENCE, len(self) + sum(len(r) for r in ins)  # the inputs are out of self.runs
        while keys * 8 // block > self.fence_bytes:
            block *= 2
        chunk = max(block, self.chunk)
        path, n, fence = self.spill.new_file("keys"), 0, []
        with open(path, "wb") as f:
            for part in _merge_sorted(ins[0].chunks(chunk), ins[1].chunks(chunk) if newer is not None else iter(())):
                fence.append(part["key"][(-n) % block :: block].copy())  # the records at multiples of `block`
                part.tofile(f)
                n += len(part)
        for r in ins:
            r.remove()
        return _DiskRun(path, n, block, np.concatenate(fence))

    def _grow_bloom(self, disk: list[_DiskRun], keys: int) -> None:
        """A filter with room for `keys` more than `disk` holds: rebuilt twice as large from the disk runs (a
        sequential read, each time the keys double) while it is under its share of the budget."""
        held = sum(len(r) for r in disk) + keys
        if self.bloom is not None and min(self.bloom_bytes, held * BLOOM_BITS // 8) <= self.bloom.nbytes:
            return
        self.bloom = None  # the old one goes first: never both in RAM
        self.bloom = _Bloom(min(self.bloom_bytes, held * BLOOM_BITS // 4))
        for r in disk:
            for part in r.chunks(self.chunk):
                self.bloom.add(part["key"])

    def close(self) -> None:
        for r in self.runs:
            r.remove()
        self.runs = []


class Signatures:
    """The kept documents' signatures (low 16 bits), by number: the newest blocks in RAM within `budget`,
    older ones appended to one file and read back 240 bytes at a time (only a band collision reads one)."""

    def __init__(self, budget: int, spill: SpillDir):
        row = NUM_PERM * 2
        self.rows = int(np.clip(budget // 2 // row, 16, 4096))  # a block: at least two fit in the budget
        self.ram_blocks = max(1, budget // (self.rows * row))
        self.blocks: deque[np.ndarray] = deque()
        self.first, self.n, self.spill, self.file = 0, 0, spill, None  # blocks[0] is block number `first`

    @property
    def ram_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def __getitem__(self, j: int) -> np.ndarray:
        b = j // self.rows
        if b >= self.first:
            return self.blocks[b - self.first][j % self.rows]
        row = NUM_PERM * 2
        return np.frombuffer(os.pread(self.file.fileno(), row, j * row), dtype=np.uint16)

    def append(self, low: np.ndarray) -> None:
        if self.n % self.rows == 0:
            if len(self.blocks) >= self.ram_blocks:
                self._spill_oldest()
            self.blocks.append(np.empty((self.rows, NUM_PERM), dtype=np.uint16))
        self.blocks[-1][self.n % self.rows] = low
        self.n += 1

    def _spill_oldest(self) -> None:
        if self.file is None:
            self.file = open(self.spill.new_file("signatures"), "w+b")
        self.file.write(self.blocks.popleft().tobytes())
        self.file.flush()  # before any pread of it
        self.first += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class NearIndex:
    """MinHash signatures of the kept documents and their band keys: an earlier near-duplicate, or index this one.

    Per kept document: 120 signature values stored as their low 16 bits (240 bytes; two different values agree
    by chance once in 65,536, which moves the estimate by < 0.0001) and 20 band keys (12 bytes each in a run).
    A document is compared with, per band, the first kept document with its key in the frozen runs and the
    first since the last freeze: the same wherever the runs are, so spilling changes no verdict.
    The budget: 5/7 to the band keys, 2/7 to the signatures (their RAM part only saves a pread a candidate).
    """

    def __init__(self, threshold: float, budget: int, spill: SpillDir | None = None):
        self.threshold, self.n = threshold, 0
        spill = spill or SpillDir()
        self.bands = KeyTable(budget * 5 // 7, spill, batch_keys=BATCH_DOCS * BANDS)
        self.sigs = Signatures(budget * 2 // 7, spill)

    @property
    def ram_bytes(self) -> int:
        return self.bands.ram_bytes + self.sigs.ram_bytes

    def candidates(self, bands: np.ndarray) -> np.ndarray:
        """(n, BANDS) band keys of a batch -> (n, BANDS) kept documents in the frozen runs sharing each (-1: none)."""
        return self.bands.frozen(bands.reshape(-1)).reshape(bands.shape)

    def match_or_add(self, sig: np.ndarray, keys: np.ndarray, frozen: np.ndarray) -> tuple[int, float] | None:
        """(kept document number, estimated Jaccard) of a near-duplicate; None (and indexed) when there is none."""
        keys, recent = keys.tolist(), self.bands.recent
        found = [j for j in frozen.tolist() if j >= 0] + [recent[k] for k in keys if k in recent]
        low = (sig & 0xFFFF).astype(np.uint16)
        for j in dict.fromkeys(found):
            sim = float(np.count_nonzero(self.sigs[j] == low)) / NUM_PERM
            if sim >= self.threshold:
                return j, sim
        self.sigs.append(low)
        for k in keys:  # also a key the runs hold: until the next freeze merges it away, a second candidate
            recent.setdefault(k, self.n)
        self.n += 1
        return None

    def close(self) -> None:
        self.bands.close()
        self.sigs.close()
