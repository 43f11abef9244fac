"""Encode throughput of our `encode` step vs raw `Tokenizer.encode_batch` on the same text, and peak RSS.

    python bench/encode_throughput.py                     # demo corpus x10, a vocab-8000 tokenizer
    python bench/encode_throughput.py --scale 30 --tokenizer runs/tokenizer

The corpus is data/az/*.txt repeated `--scale` times in one file. Timings are the best of
`--repeats` runs, interleaved, in this process: raw `encode_batch` / `encode_batch_fast` get the
documents already in memory as one list; ours (`shards.write_shards`) reads the file, NFC-normalises,
splits by hash, encodes and writes shards. Peak RSS is measured on `python tokenize.py encode` in a
child process at 1x and at `--scale`x: bounded memory means it does not grow with the corpus.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a file: `python bench/encode_throughput.py` from anywhere

from minilm_az import shards  # noqa: E402
from minilm_az import tokenizer as tk  # noqa: E402
from minilm_az.prep import readers  # noqa: E402


def make_corpus(path: str, scale: int) -> int:
    files = sorted(glob.glob(os.path.join(ROOT, "data", "az", "*.txt")))
    with open(path, "wb") as out:
        for _ in range(scale):
            for f in files:
                with open(f, "rb") as src:
                    shutil.copyfileobj(src, out)
    return os.path.getsize(path)


def peak_rss_mb(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in MB, wall seconds) of a child process (run in a fresh grandparent-free shell)."""
    probe = (
        "import resource, subprocess, sys, time; t = time.time(); subprocess.run(sys.argv[1:], check=True, "
        "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, "
        "time.time() - t)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], cwd=ROOT, capture_output=True, text=True, check=True)
    rss, secs = out.stdout.split()
    return float(rss), float(secs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=int, default=10, help="copies of the demo corpus (default 10)")
    p.add_argument("--tokenizer", help="tokenizer dir (default: train a vocab-8000 one on the demo train split)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-mb", type=int, default=max(1, (os.cpu_count() or 1) // 4), help="as tokenize.py encode")
    args = p.parse_args()

    work = tempfile.mkdtemp(prefix="bench-encode-")
    try:
        tok_dir = args.tokenizer
        if tok_dir is None:
            tok_dir = os.path.join(work, "tok")
            train = [os.path.join(ROOT, "data", "az", f) for f in ("mediawiki.txt", "kde.txt", "django.txt")]
            tk.write_tokenizer_files(
                tk.train_tokenizer(readers.iter_documents(train), args.vocab_size, progress=False), tok_dir
            )
        tok = tk.load_tokenizer(tok_dir)
        corpus = os.path.join(work, f"demo_x{args.scale}.txt")
        nbytes = make_corpus(corpus, args.scale)
        small = os.path.join(work, "demo_x1.txt")
        make_corpus(small, 1)
        texts = list(readers.iter_documents([corpus]))
        print(
            f"corpus: demo x{args.scale} = {nbytes / 1e6:.2f} MB, {len(texts)} documents; "
            f"tokenizer vocab {tok.get_vocab_size()}; {os.cpu_count()} CPUs, "
            f"RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'unset')}"
        )

        def raw_encode_batch():
            return sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))

        def raw_encode_batch_fast():
            return sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))

        def ours():
            out = os.path.join(work, "shards")
            shutil.rmtree(out, ignore_errors=True)
            index = shards.write_shards(
                readers.iter_documents([corpus]),
                out,
                encode=functools.partial(tk.encode_plain, tok),
                vocab_size=tok.get_vocab_size(),
                eos_id=tok.token_to_id(tk.EOS),
                tokenizer_hash=tk.tokenizer_hash(tok_dir),
                val_fraction=0.01,
                batch_bytes=args.batch_mb << 20,
            )
            return sum(s["tokens"] - s["documents"] for s in index["splits"].values())  # EOS excluded

        methods = {
            "raw encode_batch (in memory)": raw_encode_batch,
            "raw encode_batch_fast (in memory)": raw_encode_batch_fast,
            "ours: write_shards (file -> shards)": ours,
        }
        best = dict.fromkeys(methods, float("inf"))
        cpu = dict.fromkeys(methods, float("inf"))
        tokens = {}
        for _ in range(args.repeats):
            for name, fn in methods.items():  # interleaved, so load from other processes hits all alike
                t, c = time.perf_counter(), time.process_time()
                tokens[name] = fn()
                best[name] = min(best[name], time.perf_counter() - t)
                cpu[name] = min(cpu[name], time.process_time() - c)
        assert len(set(tokens.values())) == 1, f"methods disagree on the token count: {tokens}"

        base = best["raw encode_batch (in memory)"]
        cpu_base = cpu["raw encode_batch (in memory)"]
        head = ["tokens", "wall s", "MB/s", "Mtok/s", "vs raw", "cpu s", "vs raw"]
        print(f"\n{'method':<38}" + "".join(f"{h:>9}" for h in head))
        for name, secs in best.items():
            n, c = tokens[name], cpu[name]
            cells = [n, f"{secs:.3f}", f"{nbytes / 1e6 / secs:.2f}", f"{n / 1e6 / secs:.3f}", f"{base / secs:.2f}"]
            cells += [f"{c:.2f}", f"{cpu_base / c:.2f}"]
            print(f"{name:<38}" + "".join(f"{x:>9}" for x in cells))
        print("(vs raw: raw encode_batch time / this time, > 1 is faster; cpu s: all threads of this process)")

        print(f"\n{'tokenize.py encode (child process)':<38} {'corpus MB':>10} {'peak RSS MB':>12} {'seconds':>8}")
        for path, label in ((small, "x1"), (corpus, f"x{args.scale}")):
            out = os.path.join(work, f"cli_{label}")
            cmd = [sys.executable, "tokenize.py", "encode", "--tokenizer", tok_dir, "--corpus", path]
            cmd += ["--out", out, "--no-progress", "--batch-mb", str(args.batch_mb)]
            rss, secs = peak_rss_mb(cmd)
            print(f"{'demo ' + label:<38} {os.path.getsize(path) / 1e6:>10.2f} {rss:>12.1f} {secs:>8.2f}")
        self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"(this process, which holds all {len(texts)} documents and their encodings: peak RSS {self_rss:.0f} MB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
