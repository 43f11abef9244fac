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
bytes a kept document for `exact` and ~500 for `near` (a 16-bit signature, 20 band keys), held in sorted
numpy runs (KeyTable); measured, the whole process tree grows by ~0.7 KB per kept document (bench/RESULTS.md),
so 10 M kept documents need ~7 GB. Everything else is bounded by the batch window.

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
import unicodedata
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

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
KEY_BUFFER = 1 << 16  # keys a KeyTable holds in a dict before sorting them into a run (~6 MB)

_NEWLINES = re.compile(r"\r\n?")
_INVISIBLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u00ad\u200b-\u200d\u2060\ufeff]")
_SPACES = re.compile(r"[ \t\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]+")
_BLANKS = re.compile(r"\n{3,}")
_LETTER = re.compile(r"[^\W\d_]")
_LATIN = re.compile(r"[A-Za-z\u00c0-\u024f\u0259\u018f\u1e00-\u1eff]")  # incl. ə/Ə (IPA block)
_NOT_WORD = re.compile(r"[\W_]+")
_CODE = re.compile(r"[{}]")


@dataclass(frozen=True)
class Rules:
    """Which steps run and their thresholds (tokenize.py's CleanConfig fills it from the flags)."""

    normalize: bool = True
    lang: str = "az"  # or "none"
    lang_threshold: float = 0.5
    quality: bool = True
    min_words: int = 5
    max_words: int = 100_000
    dedup: str = "near"  # none | exact | near (near includes exact)
    near_threshold: float = 0.7


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


class KeyTable:
    """uint64 key -> the value first stored for it: a dict of recent keys, then sorted numpy runs (an LSM tree).

    12 bytes a key once frozen, where a Python dict spends ~100. `frozen()` looks a whole batch of keys up in the
    runs at once; keys added since the last `freeze()` are in `recent`. Runs of similar size are merged, so a
    lookup searches O(log n) runs and each key is re-sorted O(log n) times.
    """

    def __init__(self, buffer: int | None = None):
        self.recent: dict[int, int] = {}
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted keys, values), oldest first
        self.buffer = buffer or KEY_BUFFER

    def __len__(self) -> int:
        return len(self.recent) + sum(len(k) for k, _ in self.runs)

    def frozen(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key in the runs, -1 where it has none (the oldest run's value wins)."""
        out = np.full(len(keys), -1, dtype=np.int64)
        for k, v in self.runs:
            i = np.minimum(np.searchsorted(k, keys), len(k) - 1)
            hit = (k[i] == keys) & (out < 0)
            out[hit] = v[i[hit]]
        return out

    def freeze(self) -> None:
        """Between batches: once `recent` is full, sort it into a run and merge runs of similar size."""
        if len(self.recent) < self.buffer:
            return
        keys = np.fromiter(self.recent.keys(), dtype=np.uint64, count=len(self.recent))
        values = np.fromiter(self.recent.values(), dtype=np.uint32, count=len(self.recent))
        order = np.argsort(keys, kind="stable")
        self.runs.append((keys[order], values[order]))
        self.recent = {}
        while len(self.runs) > 1 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            (k1, v1), (k2, v2) = self.runs[-2], self.runs.pop()
            keys, values = np.concatenate([k1, k2]), np.concatenate([v1, v2])
            order = np.argsort(keys, kind="stable")  # stable: of equal keys the older run's comes first
            keys, values = keys[order], values[order]
            first = np.concatenate([[True], keys[1:] != keys[:-1]])
            self.runs[-1] = (keys[first], values[first])


class NearIndex:
    """MinHash signatures of the kept documents and their band keys: an earlier near-duplicate, or index this one.

    Per kept document: 120 signature values stored as their low 16 bits (240 bytes; two different values agree
    by chance once in 65,536, which moves the estimate by < 0.0001) and 20 band keys (240 bytes).
    """

    BLOCK = 1 << 16  # signatures in fixed blocks: growing never copies what is stored

    def __init__(self, threshold: float):
        self.threshold, self.n = threshold, 0
        self.bands = KeyTable()
        self.blocks: list[np.ndarray] = []

    def candidates(self, bands: np.ndarray) -> np.ndarray:
        """(n, BANDS) band keys of a batch -> (n, BANDS) kept documents in the frozen runs sharing each (-1: none)."""
        return self.bands.frozen(bands.reshape(-1)).reshape(bands.shape)

    def match_or_add(self, sig: np.ndarray, keys: np.ndarray, frozen: np.ndarray) -> tuple[int, float] | None:
        """(kept document number, estimated Jaccard) of a near-duplicate; None (and indexed) when there is none."""
        keys = keys.tolist()
        found = [j for j in frozen.tolist() if j >= 0] + [self.bands.recent[k] for k in keys if k in self.bands.recent]
        low = (sig & 0xFFFF).astype(np.uint16)
        for j in dict.fromkeys(found):
            sim = float(np.count_nonzero(self.blocks[j // self.BLOCK][j % self.BLOCK] == low)) / NUM_PERM
            if sim >= self.threshold:
                return j, sim
        if self.n % self.BLOCK == 0:
            self.blocks.append(np.empty((self.BLOCK, NUM_PERM), dtype=np.uint16))
        self.blocks[-1][self.n % self.BLOCK] = low
        for k in keys:
            self.bands.recent.setdefault(k, self.n)
        self.n += 1
        return None


class ShardWriter:
    """clean-00000.jsonl.gz, ...: a new shard past `shard_bytes` of text; `where(i)` names kept document i."""

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


def _batches(documents: Iterable[str], max_docs: int = 512, max_chars: int = 1 << 20) -> Iterator[list[str]]:
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


def clean_documents(documents: Iterable[str], rules: Rules, workers: int = 1) -> Iterator[Decision]:
    """The pipeline: one Decision per input document, in input order (identical for any `workers`).

    Raises what the input iterator raises (a CorpusError for a bad line).
    """
    if rules.dedup not in ("none", "exact", "near") or rules.lang not in ("az", "none"):
        raise ValueError(f"dedup must be none|exact|near and lang az|none, got {rules.dedup!r}, {rules.lang!r}")
    exact = KeyTable()
    index = NearIndex(rules.near_threshold) if rules.dedup == "near" else None
    for res in _processed(_batches(documents), Worker(rules), workers):
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
        exact.freeze()
        if index is not None:
            index.bands.freeze()


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
    tally, writer = _Tally(rules, samples), ShardWriter(out_dir, shard_bytes)
    try:
        for d in clean_documents(documents, rules, workers):
            if d.step == "near":  # name the kept document it duplicates, for a human to compare
                d.detail = {
                    "similar_to": writer.where(d.detail["kept"]),
                    "similarity": round(d.detail["similarity"], 3),
                }
            tally.count(d.raw_bytes, d.text, d.step, d.reason, **d.detail)
            if d.step is None:
                writer.write(d.text)
    finally:
        writer.close()
    return {**tally.report(), "rules": asdict(rules), "files": writer.files}
