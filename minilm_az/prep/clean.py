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
import json
import multiprocessing as mp
import os
import re
import unicodedata
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from minilm_az.config import TokenizeCleanConfig
from minilm_az.prep.dedup import BATCH_DOCS, KeyTable, NearIndex, SpillDir, band_keys, exact_key, minhash
from minilm_az.prep.readers import need_extra

STEPS = ("normalize", "lang", "quality", "exact", "near")


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

_NEWLINES = re.compile(r"\r\n?")
_INVISIBLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u00ad\u200b-\u200d\u2060\ufeff]")
_SPACES = re.compile(r"[ \t\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]+")
_BLANKS = re.compile(r"\n{3,}")
_LETTER = re.compile(r"[^\W\d_]")
_LATIN = re.compile(r"[A-Za-z\u00c0-\u024f\u0259\u018f\u1e00-\u1eff]")  # incl. ə/Ə (IPA block)
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


class Worker:
    """Steps 1-3 and the dedup hashes of one batch; built once in the parent, shared by the pool's processes."""

    def __init__(self, rules: Rules):
        self.rules, self.identifier = rules, None
        if rules.lang == "az":
            need_extra("py3langid", "--lang az")
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
