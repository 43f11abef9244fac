"""Raw dumps -> a deduplicated, Azerbaijani-only corpus: the engine of `tokenize.py clean`.

Steps, in this order; each can be switched off and each is counted (documents and UTF-8 bytes in and out):

1. `normalize`: NFC, CR/LF -> LF, control and zero-width characters dropped, runs of spaces/tabs -> one space,
   lines stripped, at most one blank line in a row. A document left empty is removed.
2. `lang`: py3langid (its naive-Bayes model ships inside the package: nothing is downloaded) must name `az`
   with a normalised probability >= `lang_threshold`, and at least half the letters must be Latin script
   (Azerbaijani is also written in Cyrillic; we keep the Latin). bench/RESULTS.md has the accuracy on
   Azerbaijani vs Turkish, Russian and English lines that picked the threshold.
3. `quality`: Gopher's document rules (Rae et al. 2021, the thresholds datatrove uses) with three changes
   for Azerbaijani: the mean word length may reach 13 characters, not 10 (agglutinative: a suffix chain
   makes long words; the mean is 6.8 on data/az against 5.3 for the English of data/lid, and 10 x 6.8/5.3 is
   13); the minimum length is `min_words` (default 5, not 50: the bundled corpus is one sentence a document;
   raise it for web dumps); the n-gram repetition rules apply from 50 words (Gopher's own minimum; on a
   one-sentence document one repeated word pair is already 20 % of the text). The stop-word rule is left
   out: `lang` already asks for Azerbaijani. C4's "lorem ipsum" and curly-brace (code) rules are in.
4. `exact`: a 64-bit blake2b of the normalised text; the first copy is kept.
5. `near`: MinHash LSH; a document whose estimated Jaccard similarity to an earlier kept one is >=
   `near_threshold` is removed (see NUM_PERM for the parameters and why).

Workers (a multiprocessing pool) run steps 1-3 and compute the hash and MinHash signature of what survives, a
window of batches at a time; the main process keeps the input order (the output is identical for any number
of workers), the two indexes and the writer. The indexes are the only state that grows with the input: 12
bytes a kept document for `exact`, ~480 for `near` (a 16-bit signature, 20 band keys). They stay within
`dedup_memory_mb` of RAM however large the input: the keys are LSM trees of sorted runs (KeyTable) whose
large runs spill to files in a temp folder (inside the output dir; removed at the end), found through a
Bloom filter and a fence of every 1,024th key in RAM; old signatures spill to one file. Where they live
changes no verdict (tests/test_clean.py), only speed; bench/RESULTS.md has the memory at several input
sizes. Everything else is bounded by the batch window.

Output (`out_dir`): `clean-00000.jsonl.gz`, ... one `{"text": ...}` a line in input order (`tokenize.py
train/encode --corpus DIR` read them as they are); tokenize.py adds clean_report.json, what `clean_corpus`
returns: documents and bytes into and out of each step, the removals by reason, a few samples of each.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import tempfile
import unicodedata
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from minilm_az.config import TokenizeCleanConfig

STEPS = ("normalize", "lang", "quality", "exact", "near")

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

LID_CHARS = 5000  # language ID reads the first 5,000 characters: cost bounded per document
MEAN_WORD_LEN = (3.0, 13.0)
NGRAM_RULES_FROM = 50  # words
MIN_ALPHA_WORDS = 0.8  # share of words with a letter
MAX_SYMBOL_WORDS = 0.1  # '#' and ellipses per word
MAX_BULLET_LINES, MAX_ELLIPSIS_LINES = 0.9, 0.3
MAX_DUP_LINES, MAX_DUP_LINE_CHARS = 0.3, 0.2
TOP_NGRAM_CHARS = ((2, 0.20), (3, 0.18), (4, 0.16))
DUP_NGRAM_CHARS = ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))
SAMPLE_CHARS = 300
BATCH_DOCS = 512  # documents a worker's batch holds at most
KEY_BUFFER = 1 << 16  # most keys a KeyTable holds in its dict before sorting them into a run (~6 MB)
DICT_ENTRY = 100  # bytes a key costs in that dict (its slot and two ints), measured with tracemalloc: 62-89
BLOOM_BITS = 16  # the Bloom filter grows (2x) while it holds more than 1 key per this many bits: ~0.5 % false
FENCE = 1024  # records per block of a spilled run, at least: RAM keeps one key a block, a lookup reads one
MERGE_CHUNK = 1 << 16  # records read at a time when runs are merged on disk (768 KB), at most
RECORD = np.dtype([("key", "<u8"), ("value", "<u4")])  # a spilled run's entry: 12 bytes

_NEWLINES = re.compile(r"\r\n?")
_INVISIBLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u00ad\u200b-\u200d\u2060\ufeff]")
_SPACES = re.compile(r"[ \t\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]+")
_BLANKS = re.compile(r"\n{3,}")
_LETTER = re.compile(r"[^\W\d_]")
_LATIN = re.compile(r"[A-Za-z\u00c0-\u024f\u0259\u018f\u1e00-\u1eff]")  # incl. ə/Ə (IPA block)
_NOT_WORD = re.compile(r"[\W_]+")
_CODE = re.compile(r"[{}]")


_FLAG = {f.name: f.default for f in fields(TokenizeCleanConfig)}  # one home for the defaults: the flags


@dataclass(frozen=True)
class Rules:
    """Which steps run and their thresholds: `tokenize.py clean`'s flags of the same names (their help says
    what each does), with the same defaults."""

    normalize: bool = _FLAG["normalize"]
    lang: str = _FLAG["lang"]  # az | none
    lang_threshold: float = _FLAG["lang_threshold"]
    quality: bool = _FLAG["quality"]
    min_words: int = _FLAG["min_words"]
    max_words: int = _FLAG["max_words"]
    dedup: str = _FLAG["dedup"]  # none | exact | near (near includes exact)
    near_threshold: float = _FLAG["near_threshold"]
    dedup_memory_mb: float = _FLAG["dedup_memory_mb"]  # RAM of the dedup indexes; changes no verdict, only speed


# ---------------------------------------------------------------- per document (in the workers)


def normalize(text: str) -> str:
    """NFC, one kind of line break, no control/zero-width characters, single spaces, stripped lines."""
    text = _INVISIBLE.sub("", unicodedata.normalize("NFC", _NEWLINES.sub("\n", text)))
    return _BLANKS.sub("\n\n", "\n".join(_SPACES.sub(" ", line).strip() for line in text.split("\n"))).strip()


def language(identifier, text: str, threshold: float) -> str | None:
    """None when `text` is Azerbaijani in Latin script, else why not ("tr 0.98", "not Latin script")."""
    letters = len(_LETTER.findall(text))
    if letters and len(_LATIN.findall(text)) < 0.5 * letters:
        return "not Latin script"
    lang, prob = identifier.classify(text[:LID_CHARS])
    return None if lang == "az" and prob >= threshold else f"{lang} {prob:.2f}"


def _top_ngram_chars(words: list[str], n: int) -> int:
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    if not grams:
        return 0
    gram, count = grams.most_common(1)[0]
    return sum(map(len, gram)) * count


def _dup_ngram_chars(words: list[str], n: int) -> int:
    seen, dup, i = set(), 0, 0
    while i <= len(words) - n:  # Gopher: characters inside repeated n-grams, each counted once
        gram = tuple(words[i : i + n])
        if gram in seen:
            dup, i = dup + sum(map(len, gram)), i + n
        else:
            seen.add(gram)
            i += 1
    return dup


def quality(text: str, rules: Rules) -> str | None:
    """None when `text` passes the Gopher/C4-style rules (module docstring), else the rule it fails."""
    words = text.split()
    if len(words) < rules.min_words:
        return "too few words"
    if len(words) > rules.max_words:
        return "too many words"
    mean = sum(map(len, words)) / len(words)
    if not MEAN_WORD_LEN[0] <= mean <= MEAN_WORD_LEN[1]:
        return "mean word length"
    if sum(bool(_LETTER.search(w)) for w in words) < MIN_ALPHA_WORDS * len(words):
        return "words without letters"
    if max(text.count("#"), text.count("...") + text.count("…")) > MAX_SYMBOL_WORDS * len(words):
        return "symbols per word"
    if "lorem ipsum" in text.lower() or _CODE.search(text):
        return "boilerplate or code"
    lines = text.split("\n")
    if sum(ln.startswith(("•", "-", "*")) for ln in lines) > MAX_BULLET_LINES * len(lines):
        return "bullet lines"
    if sum(ln.endswith(("...", "…")) for ln in lines) > MAX_ELLIPSIS_LINES * len(lines):
        return "ellipsis lines"
    counts = Counter(ln for ln in lines if ln)
    dup_lines = sum(c - 1 for c in counts.values())
    if dup_lines > MAX_DUP_LINES * len(lines):
        return "repeated lines"
    if sum(len(ln) * (c - 1) for ln, c in counts.items()) > MAX_DUP_LINE_CHARS * len(text):
        return "repeated line characters"
    if len(words) < NGRAM_RULES_FROM:
        return None
    for n, frac in TOP_NGRAM_CHARS:
        if _top_ngram_chars(words, n) > frac * len(text):
            return f"top {n}-gram"
    for n, frac in DUP_NGRAM_CHARS:
        if _dup_ngram_chars(words, n) > frac * len(text):
            return f"repeated {n}-grams"
    return None


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


class Worker:
    """Steps 1-3 and the dedup hashes of one batch; built once in the parent, shared by the pool's processes."""

    def __init__(self, rules: Rules):
        self.rules, self.identifier = rules, None
        if rules.lang == "az":
            from py3langid.langid import MODEL_FILE, LanguageIdentifier

            self.identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)

    def __call__(self, batch: list[str]) -> dict:
        """Per document: raw bytes, normalised text, (step, reason, detail) or None; hashes of the survivors."""
        r, docs, kept = self.rules, [], []
        for raw in batch:
            text = normalize(raw) if r.normalize else raw
            why = None if text else ("normalize", "empty after normalisation", "")
            if why is None and self.identifier is not None:
                detail = language(self.identifier, text, r.lang_threshold)
                why = ("lang", "not Azerbaijani", detail) if detail else None
            if why is None and r.quality:
                rule = quality(text, r)
                why = ("quality", rule, "") if rule else None
            if why is None:
                kept.append(text)
            docs.append((len(raw.encode("utf-8")), text, why))
        keys = [exact_key(t) for t in kept] if r.dedup != "none" else []
        sigs = np.stack([minhash(t) for t in kept]) if r.dedup == "near" and kept else None
        return {"docs": docs, "keys": keys, "sigs": sigs, "bands": band_keys(sigs) if sigs is not None else None}


_worker: Worker | None = None  # the pool's processes: set once by _init (multiprocessing needs a module name)


def _init(worker: Worker) -> None:
    global _worker
    _worker = worker


def _run(batch: list[str]) -> dict:
    return _worker(batch)


# ---------------------------------------------------------------- the main process


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


class CleanWriter:
    """The cleaned text as clean-00000.jsonl.gz, ... (not token shards: those are shards.ShardWriter's).

    A new file past `shard_bytes` of text; `where(i)` names kept document i."""

    def __init__(self, out_dir: str, shard_bytes: int):
        self.out_dir, self.shard_bytes = out_dir, shard_bytes
        self.files: list[str] = []
        self.starts: list[int] = []
        self.f, self.size, self.n = None, 0, 0

    def write(self, text: str) -> None:
        if self.f is None or self.size >= self.shard_bytes:
            self.close()
            self.files.append(f"clean-{len(self.files):05d}.jsonl.gz")
            self.starts.append(self.n)
            # level 6 (zlib's default), not gzip's 9: a third of the time for 2-3 % more bytes
            self.f = gzip.open(os.path.join(self.out_dir, self.files[-1]), "wt", encoding="utf-8", compresslevel=6)
            self.size = 0
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        self.f.write(line)
        self.size += len(line)
        self.n += 1

    def where(self, i: int) -> str:
        shard = int(np.searchsorted(self.starts, i, side="right")) - 1
        return f"{self.files[shard]}:{i - self.starts[shard] + 1}"

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def _batches(documents: Iterable[str], max_docs: int = BATCH_DOCS, max_chars: int = 1 << 20) -> Iterator[list[str]]:
    batch, chars = [], 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _processed(batches: Iterator[list[str]], worker: Worker, workers: int) -> Iterator[dict]:
    """Results in input order; at most 2 batches per worker in flight, so memory does not grow with the input."""
    if workers <= 1:
        yield from map(worker, batches)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
    with ctx.Pool(workers, initializer=_init, initargs=(worker,)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_run, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Tally:
    """Documents and bytes into and out of each step, the removal reasons and a few samples of each."""

    def __init__(self, rules: Rules, samples: int):
        on = {
            "normalize": rules.normalize,
            "lang": rules.lang != "none",
            "quality": rules.quality,
            "exact": rules.dedup != "none",
            "near": rules.dedup == "near",
        }
        self.steps = {s: {"enabled": on[s], "documents_in": 0, "documents_out": 0, "bytes_in": 0, "bytes_out": 0,
                          "removed": Counter()} for s in STEPS}  # fmt: skip
        self.samples: dict[str, list[dict]] = {}
        self.per_reason = samples

    def count(self, raw_bytes: int, text: str, removed_at: str | None, reason: str = "", **sample) -> None:
        n = len(text.encode("utf-8"))
        for step in STEPS:
            s = self.steps[step]
            s["documents_in"] += 1
            s["bytes_in"] += raw_bytes if step == "normalize" else n
            if step == removed_at:
                s["removed"][reason] += 1
                key = f"{step}: {reason}"
                if len(self.samples.setdefault(key, [])) < self.per_reason:
                    self.samples[key].append({"text": text[:SAMPLE_CHARS], **sample})
                return
            s["documents_out"] += 1
            s["bytes_out"] += n

    def report(self) -> dict:
        steps = [{"step": k, **v, "removed": dict(v["removed"])} for k, v in self.steps.items()]
        first, last = self.steps["normalize"], self.steps["near"]
        totals = {"documents_in": first["documents_in"], "bytes_in": first["bytes_in"]}
        totals |= {"documents_out": last["documents_out"], "bytes_out": last["bytes_out"]}
        return {**totals, "steps": steps, "samples": self.samples}


@dataclass
class Decision:
    """What became of one input document: `step` None means kept (`text` is what is written)."""

    raw_bytes: int
    text: str
    step: str | None = None
    reason: str = ""
    detail: dict = field(default_factory=dict)


def clean_documents(
    documents: Iterable[str], rules: Rules, workers: int = 1, spill_parent: str | None = None
) -> Iterator[Decision]:
    """The pipeline: one Decision per input document, in input order (identical for any `workers`).

    The dedup indexes hold at most `rules.dedup_memory_mb` of RAM and spill the rest to a temp folder inside
    `spill_parent` (None: the system's temp dir), removed when the generator ends or is closed.
    Raises what the input iterator raises (a CorpusError for a bad line).
    """
    if rules.dedup not in ("none", "exact", "near") or rules.lang not in ("az", "none"):
        raise ValueError(f"dedup must be none|exact|near and lang az|none, got {rules.dedup!r}, {rules.lang!r}")
    budget, spill = int(rules.dedup_memory_mb * (1 << 20)), SpillDir(spill_parent)
    near = rules.dedup == "near"
    exact = KeyTable(budget // 8 if near else budget, spill, batch_keys=BATCH_DOCS)  # 1 key a document, not 20
    index = NearIndex(rules.near_threshold, budget - budget // 8, spill) if near else None
    try:
        for res in _processed(_batches(documents), Worker(rules), workers):
            yield from _decide(res, exact, index)
            exact.freeze()
            if index is not None:
                index.bands.freeze()
    finally:
        exact.close()
        if index is not None:
            index.close()
        spill.remove()


def _decide(res: dict, exact: KeyTable, index: NearIndex | None) -> Iterator[Decision]:
    """The Decisions of one worker batch, in order, with the dedup verdicts against (and into) the indexes."""
    keys = np.array(res["keys"], dtype=np.uint64)
    seen = exact.frozen(keys) >= 0  # the whole batch against the frozen runs at once
    frozen = index.candidates(res["bands"]) if index is not None and res["bands"] is not None else None
    k = 0  # the survivors of steps 1-3 have their hashes in res["keys"], res["sigs"], in order
    for raw_bytes, text, why in res["docs"]:
        if why is not None:
            yield Decision(raw_bytes, text, why[0], why[1], {"detail": why[2]} if why[2] else {})
            continue
        i, k = k, k + 1
        if len(keys):
            if seen[i] or res["keys"][i] in exact.recent:
                yield Decision(raw_bytes, text, "exact", "exact duplicate")
                continue
            exact.recent[res["keys"][i]] = 0
        match = index.match_or_add(res["sigs"][i], res["bands"][i], frozen[i]) if index is not None else None
        if match is not None:
            yield Decision(raw_bytes, text, "near", "near duplicate", {"kept": match[0], "similarity": match[1]})
            continue
        yield Decision(raw_bytes, text)


def clean_corpus(
    documents: Iterable[str],
    out_dir: str,
    rules: Rules,
    workers: int = 1,
    shard_bytes: int = 256 << 20,
    samples: int = 5,
) -> dict:
    """Clean `documents` into `out_dir`'s clean-*.jsonl.gz; returns the report (counts per step, samples).

    A failure raises with the shards half-written: the caller writes into a staging dir (outputs.staged_output).
    """
    os.makedirs(out_dir, exist_ok=True)
    tally, writer = _Tally(rules, samples), CleanWriter(out_dir, shard_bytes)
    decisions = clean_documents(documents, rules, workers, spill_parent=out_dir)
    try:
        for d in decisions:
            if d.step == "near":  # name the kept document it duplicates, for a human to compare
                d.detail = {
                    "similar_to": writer.where(d.detail["kept"]),
                    "similarity": round(d.detail["similarity"], 3),
                }
            tally.count(d.raw_bytes, d.text, d.step, d.reason, **d.detail)
            if d.step is None:
                writer.write(d.text)
    finally:
        decisions.close()  # removes the dedup spill folder now, also on a failure
        writer.close()
    return {**tally.report(), "rules": asdict(rules), "files": writer.files}
