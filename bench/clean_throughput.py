"""`tokenize.py clean` on a planted set: duplicate recall/precision, language ID, throughput and peak memory,
against datatrove running the equivalent steps on the same input and cores in the same run.

    python bench/clean_throughput.py                      # the full planted set, 2 workers
    python bench/clean_throughput.py --scale 8 --workers 2 --no-peer
    python bench/clean_throughput.py --scale 128 --engines ours-nolid --dedup-memory-mb 64   # index spilled

The planted set (`planted_set`, also what tests/test_clean.py uses at a small size): real Azerbaijani
documents (2-5 random lines of data/az joined), 10 % exact duplicates (half verbatim, half with whitespace
noise that normalisation removes), 10 % near duplicates (5 % of the words deleted, replaced or swapped, at
least one), and English, Turkish and Russian documents from data/lid built the same way. A duplicate always
comes after its original. `--scale K` builds K independent groupings (more documents) for throughput and
memory; recall and precision are always measured on the scale-1 set, where the labels are the truth.

Each engine runs in its own process (peak memory: the summed PSS of it and its children, sampled); datatrove gets
its LocalPipelineExecutor with `--workers` tasks and workers. Its language filter needs a fastText model
download, so datatrove runs without LID, and ours is timed both with and without it. `--dedup-memory-mb` is
our dedup indexes' RAM budget (past it they spill to disk); scale it against the input to see memory stay flat.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

AZ_FILES = [os.path.join(ROOT, "data", "az", f) for f in ("mediawiki.txt", "kde.txt", "firefox.txt", "django.txt")]
FOREIGN = {lang: os.path.join(ROOT, "data", "lid", f"{lang}.txt") for lang in ("en", "tr", "ru")}


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip()]


def _group(lines: list[str], rng: random.Random, lo: int = 2, hi: int = 5) -> list[str]:
    lines, docs, i = lines[:], [], 0
    rng.shuffle(lines)
    while i < len(lines):
        k = rng.randint(lo, hi)
        docs.append("\n".join(lines[i : i + k]))
        i += k
    return docs


def _whitespace_noise(text: str, rng: random.Random) -> str:
    words = text.replace("\n", " \n ").split(" ")
    noisy = " ".join(w + ("  " if rng.random() < 0.2 else "") for w in words)
    return "  " + noisy.replace("\n", "\r\n") + " \t"


def _near(text: str, rng: random.Random, vocab: list[str], rate: float = 0.05) -> str:
    lines = [ln.split(" ") for ln in text.split("\n")]
    slots = [(i, j) for i, ln in enumerate(lines) for j in range(len(ln))]
    for i, j in rng.sample(slots, max(1, round(rate * len(slots)))):
        op = rng.choice(("delete", "replace", "swap"))
        if op == "delete" and len(lines[i]) > 1:
            lines[i][j] = ""
        elif op == "swap" and j + 1 < len(lines[i]):
            lines[i][j], lines[i][j + 1] = lines[i][j + 1], lines[i][j]
        else:
            lines[i][j] = rng.choice(vocab)
    return "\n".join(" ".join(w for w in ln if w) for ln in lines)


def planted_set(
    n_unique: int | None = None, n_foreign: int | None = None, seed: int = 0, scale: int = 1
) -> list[tuple[str, str, int]]:
    """[(text, label, original)]: label unique|exact|near|en|tr|ru; `original` indexes the list (-1: none)."""
    rng = random.Random(seed)
    az_lines = [ln for f in AZ_FILES for ln in _lines(f)]
    unique = [d for _ in range(scale) for d in _group(az_lines, rng)]
    unique = unique[:n_unique] if n_unique else unique
    vocab = sorted({w for d in unique for w in d.split()})
    docs = [(d, "unique", -1) for d in unique]
    for lang, path in FOREIGN.items():
        foreign = _group(_lines(path), rng)
        docs += [(d, lang, -1) for d in foreign[: n_foreign or round(0.1 * len(unique))]]
    rng.shuffle(docs)
    keyed = [(float(i), d) for i, d in enumerate(docs)]  # a duplicate's key is after its original's: sorted below
    originals = rng.sample([i for i, d in enumerate(docs) if d[1] == "unique"], 2 * round(0.1 * len(unique)))
    for k, i in enumerate(originals):
        text, label = docs[i][0], "exact" if k % 2 else "near"
        dup = (_whitespace_noise(text, rng) if k % 4 == 3 else text) if label == "exact" else _near(text, rng, vocab)
        keyed.append((rng.uniform(i, len(docs)), (dup, label, i)))
    keyed.sort(key=lambda kd: kd[0])
    where = {old: new for new, (old, _) in enumerate(keyed) if old == int(old)}  # original index -> final index
    return [(t, label, where[float(orig)] if orig >= 0 else -1) for _, (t, label, orig) in keyed]


def scores(docs: list[tuple[str, str, int]], steps: list[str | None]) -> dict[str, float]:
    """The issue's numbers from per-document outcomes (`steps[i]`: the step that removed document i, or None)."""
    kept = [s is None for s in steps]
    by = lambda label: [i for i, d in enumerate(docs) if d[1] == label]  # noqa: E731
    # a near duplicate counts when its original was kept and it reached the dedup steps itself
    near = [i for i in by("near") if kept[docs[i][2]] and steps[i] in (None, "exact", "near")]
    removed_near = [i for i, s in enumerate(steps) if s == "near"]
    exact, foreign = by("exact"), by("en") + by("tr") + by("ru")
    return {
        "exact_removed": sum(not kept[i] for i in exact) / max(len(exact), 1),
        "near_recall": sum(steps[i] in ("exact", "near") for i in near) / max(len(near), 1),
        "near_precision": sum(docs[i][1] == "near" for i in removed_near) / max(len(removed_near), 1),
        "foreign_removed": sum(not kept[i] for i in foreign) / max(len(foreign), 1),
        "unique_kept": sum(kept[i] for i in by("unique")) / max(len(by("unique")), 1),
        "counts": dict(Counter(d[1] for d in docs)),
    }


def lid_table(thresholds=(0.1, 0.2, 0.3, 0.5, 0.7, 0.9)) -> None:
    """Share of real lines clean.language() keeps (as Azerbaijani) per language and py3langid threshold, and
    what a letter prior would add: keep also when the model's top language is Turkish and the text has ə."""
    from minilm_az.prep import clean

    ident = clean.Worker(clean.Rules()).identifier
    sets = {"az": [ln for f in AZ_FILES for ln in _lines(f)]} | {k: _lines(p) for k, p in FOREIGN.items()}
    print("| lines | n | " + " | ".join(f"kept at {t}" for t in thresholds) + " | kept at 0.5, + ə prior |")
    print("|---|---|" + "---|" * (len(thresholds) + 1))
    for lang, lines in sets.items():
        top = [ident.classify(t) for t in lines]
        cells = [np.mean([lab == "az" and p >= t for lab, p in top]) for t in thresholds]
        prior = np.mean(
            [(lab == "az" and p >= 0.5) or (lab == "tr" and "ə" in t.lower()) for (lab, p), t in zip(top, lines)]
        )
        print(f"| {lang} | {len(lines)} | " + " | ".join(f"{c:.4f}" for c in cells) + f" | {prior:.4f} |")


# ---------------------------------------------------------------- the runs (each in a child process)


def run_ours(inp: str, out: str, workers: int, lang: str, memory_mb: float) -> None:
    from minilm_az.prep import clean, readers

    rules = clean.Rules(lang=lang, dedup_memory_mb=memory_mb)
    os.makedirs(out, exist_ok=True)
    clean.clean_corpus(readers.iter_documents([inp]), out, rules, workers)


def run_datatrove(inp: str, out: str, workers: int) -> None:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.pipeline.filters import GopherQualityFilter, GopherRepetitionFilter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.typeshelper import Languages

    az = Languages.north_azerbaijani__latn  # datatrove's spaCy "az" word tokenizer (FineWeb-2's azj_Latn)
    # sha1: datatrove 0.10's xxhash call passes str, which xxhash >= 3.6 refuses; same 20 x 6 bands as ours
    cfg = MinhashConfig(hash_config=HashConfig(precision=64, hash_fc="sha1"), num_buckets=20, hashes_per_bucket=6)
    shards = os.path.join(out, "in")
    os.makedirs(shards)
    with open(inp, encoding="utf-8") as f:  # datatrove parallelises over files: one per task
        lines = f.readlines()
    for t in range(workers):
        with open(os.path.join(shards, f"{t:03d}.jsonl"), "w", encoding="utf-8") as g:
            g.writelines(lines[t::workers])
    j = lambda *p: os.path.join(out, *p)  # noqa: E731
    reader = JsonlReader(shards)
    filters = [
        GopherRepetitionFilter(language=az),
        GopherQualityFilter(min_doc_words=5, max_avg_word_length=13, min_stop_words=0, language=az),
    ]
    stages = [
        [
            reader,
            *filters,
            JsonlWriter(j("filtered")),  # the survivors, read again by the last stage (a writer passes them on)
            MinhashDedupSignature(output_folder=j("sigs"), config=cfg, language=az),
        ],
        [MinhashDedupBuckets(input_folder=j("sigs"), output_folder=j("buckets"), config=cfg)],
        [MinhashDedupCluster(input_folder=j("buckets"), output_folder=j("remove_ids"), config=cfg)],
        [JsonlReader(j("filtered")), MinhashDedupFilter(input_folder=j("remove_ids")), JsonlWriter(j("out"))],
    ]
    tasks = [workers, cfg.num_buckets, 1, workers]
    for k, (pipeline, n) in enumerate(zip(stages, tasks)):
        LocalPipelineExecutor(pipeline, tasks=n, workers=workers, logging_dir=j(f"logs{k}")).run()


def _tree_pss_mb(pid: int) -> float:
    """Proportional set size of `pid` and its descendants (PSS: pages a fork shares count once, not per process)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def timed(argv: list[str]) -> tuple[float, float]:
    """(seconds, peak memory in MB: the process tree's summed PSS, sampled every 20 ms) of this file as a child."""
    t = time.time()
    p = subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = 0.0
    while p.poll() is None:
        peak = max(peak, _tree_pss_mb(p.pid))
        time.sleep(0.02)
    if p.returncode != 0:
        raise SystemExit(f"bench: {argv[1]} failed (exit {p.returncode}); rerun: python {__file__} {' '.join(argv)}")
    return time.time() - t, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=int, default=1, help="independent groupings of data/az (more documents)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-peer", action="store_true", help="skip datatrove")
    p.add_argument("--engines", default="ours,ours-nolid,datatrove", help="comma-separated: which to time")
    p.add_argument("--dedup-memory-mb", type=float, default=512, help="ours: the dedup indexes' RAM budget")
    p.add_argument("--lid", action="store_true", help="only the language-ID table on the real lines")
    p.add_argument("--run", nargs=5, help=argparse.SUPPRESS)  # child: ENGINE INPUT OUT WORKERS MB
    args = p.parse_args()
    if args.run:
        engine, inp, out, workers, mb = args.run
        if engine == "datatrove":
            run_datatrove(inp, out, int(workers))
        else:
            run_ours(inp, out, int(workers), "az" if engine == "ours" else "none", float(mb))
        return
    if args.lid:
        return lid_table()
    from minilm_az.prep import clean

    # recall/precision on the set (scale 1): with several groupings of the same lines, "unique"
    # documents share lines, so some are real near duplicates of each other and the labels stop being truth
    planted = planted_set()
    rules = clean.Rules(dedup_memory_mb=args.dedup_memory_mb)
    steps = [d.step for d in clean.clean_documents((t for t, _, _ in planted), rules, args.workers)]
    print(json.dumps(scores(planted, steps), indent=1))
    docs = planted_set(scale=args.scale)
    tmp = tempfile.mkdtemp(prefix="clean-bench-")
    inp = os.path.join(tmp, "planted.jsonl")
    with open(inp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t, _, _ in docs)
    rows = []
    engines = [e for e in args.engines.split(",") if not (args.no_peer and e == "datatrove")]
    for engine in engines:
        out = os.path.join(tmp, engine)
        seconds, mb = timed(["--run", engine, inp, out, str(args.workers), str(args.dedup_memory_mb)])
        rows.append((engine, len(docs) / seconds, mb, seconds, _count_out(out)))
    base = rows[0]
    print(
        f"\n{len(docs)} documents ({os.path.getsize(inp) / 1e6:.1f} MB), {args.workers} workers, "
        f"{os.cpu_count()} CPUs, ours' dedup budget {args.dedup_memory_mb:g} MB"
    )
    print("| engine | docs/s | peak PSS MB | seconds | docs out | docs/s vs ours | memory vs ours |")
    print("|---|---|---|---|---|---|---|")
    for name, rate, mb, sec, n in rows:
        print(f"| {name} | {rate:,.0f} | {mb:,.0f} | {sec:.1f} | {n} | {rate / base[1]:.2f} | {mb / base[2]:.2f} |")


def _count_out(out: str) -> int:
    n = 0
    for root, _, names in os.walk(out):
        for name in names:
            if (name.startswith("clean-") or os.path.basename(root) == "out") and ".jsonl" in name:
                with gzip.open(os.path.join(root, name), "rt") as f:
                    n += sum(1 for _ in f)
    return n


if __name__ == "__main__":
    main()
