"""Does float8 train like bf16? The same train.py runs, same seed and data, with --fp8 none and tensorwise.

    python bench/fp8_convergence.py --out-dir /tmp/fp8conv      # H200: ~6 min (1B, 300 steps each)
    python bench/fp8_convergence.py --preset tiny --steps 20 --quick   # a smoke test of the script (CPU: bf16 only)

Real text: --corpus (default data/az, the embedded corpus; bench/man_corpus.sh makes a larger one that 300 steps
read less than once) through tokenize.py train (8k vocab) and encode; then train.py --phase 2
from random init (the 1B shape) for --steps steps, `--compile`, logging every step, once per --fp8 value; then
phase 1 (embeddings only, vocabulary transfer from the bf16 phase-2 model to a second tokenizer) likewise.
Prints the windowed mean losses, their relative difference, the final val BPB of each run, and writes the
curves as JSON (and a PNG overlay where matplotlib is installed) to --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str) -> None:
    t = time.time()
    print("+", " ".join(args), flush=True)
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    print(f"  done in {time.time() - t:.0f} s", flush=True)


def metrics(out: str) -> tuple[list[float], dict]:
    """(loss per step, last eval record) from a run's metrics.jsonl."""
    losses, last_eval = {}, {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "train":
                losses[r["step"]] = r["loss"]
            elif r.get("kind") == "eval":
                last_eval = r
    return [losses[s] for s in sorted(losses)], last_eval


def window_means(curve: list[float], width: int) -> list[float]:
    return [sum(curve[i : i + width]) / len(curve[i : i + width]) for i in range(0, len(curve), width)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="/tmp/fp8_convergence")
    p.add_argument(
        "--corpus", default="data/az", help="text to train on; data/az is ~150k tokens (300 steps of 8 rows see it 16x)"
    )
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--phase1-steps", type=int, default=150, help="0: phase 2 only")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--window", type=int, default=50, help="steps per window of the mean-loss table")
    p.add_argument("--quick", action="store_true", help="bf16 only, no compile: checks the script on CPU")
    p.add_argument("--fast-accum", action="store_true", help="a third run: tensorwise with --fp8-fast-accum")
    p.add_argument("--no-bf16", action="store_true", help="no bf16 run: the others against plain tensorwise")
    args = p.parse_args()
    if args.no_bf16 and args.phase1_steps:  # phase 1 starts from the bf16 phase-2 model
        p.error("--no-bf16 needs --phase1-steps 0")
    o = lambda *parts: os.path.join(args.out_dir, *parts)  # noqa: E731
    os.makedirs(args.out_dir, exist_ok=True)
    tokenizers = [("tok", 8000, "shards"), ("tok2", 6000, "shards2")][: 2 if args.phase1_steps else 1]
    for tok, vocab, shards in tokenizers:  # the second is phase 1's new vocabulary
        corpus = ["--corpus", args.corpus, "--no-progress"]
        if not os.path.isfile(o(tok, "tokenizer.json")):
            run("tokenize.py", "train", *corpus, "--vocab-size", str(vocab), "--out", o(tok))
        if not os.path.isfile(o(shards, "index.json")):
            run("tokenize.py", "encode", *corpus, "--tokenizer", o(tok), "--out", o(shards))
    # run name -> train.py's float8 flags
    recipes = {"none": ["--fp8", "none"], "tensorwise": ["--fp8", "tensorwise"]}
    if args.fast_accum:
        recipes["tensorwise_fast"] = ["--fp8", "tensorwise", "--fp8-fast-accum"]
    if args.quick:
        recipes = {"none": recipes["none"]}
    elif args.no_bf16:
        del recipes["none"]
    ref_run = next(iter(recipes))  # the run the others are compared with
    common = ["--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len), "--log-every", "1"]
    common += ["--seed", "0", "--export-dtype", "bfloat16", "--async-checkpoint", "false"]
    common += [] if args.quick else ["--compile"]
    results = {}
    phases = (2, 1) if args.phase1_steps else (2,)  # --phase1-steps 0: phase 2 only
    for phase in phases:
        for recipe, fp8_flags in recipes.items():
            out = o(f"phase{phase}_{recipe}")
            if phase == 2:
                flags = [
                    "--preset",
                    args.preset,
                    "--tokenizer",
                    o("tok"),
                    "--data",
                    o("shards"),
                    "--steps",
                    str(args.steps),
                ]
            else:  # embeddings only, starting from the bf16 phase-2 model, transferred to the second tokenizer
                base = o("phase2_none")
                flags = [
                    "--base-model",
                    base,
                    "--base-tokenizer",
                    base,
                    "--tokenizer",
                    o("tok2"),
                    "--data",
                    o("shards2"),
                ]
                flags += ["--steps", str(args.phase1_steps)]
            if not os.path.isfile(os.path.join(out, "config.json")):
                run("train.py", "--phase", str(phase), *flags, *common, *fp8_flags, "--out", out)
                # a 1B run's final checkpoint (weights + AdamW state) is ~15 GB; only the export is read again
                shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
            curve, ev = metrics(out)
            results[f"phase{phase}_{recipe}"] = {
                "loss": curve,
                "val_bpb": ev.get("val_bpb"),
                "val_loss": ev.get("val_loss"),
            }
    print(f"\n{'run':22s} " + " ".join(f"{'w' + str(i):>7s}" for i in range(args.steps // args.window)) + "  val_bpb")
    for name, r in results.items():
        w = window_means(r["loss"], args.window)
        print(f"{name:22s} " + " ".join(f"{v:7.4f}" for v in w) + f"  {r['val_bpb']:.4f}")
    for phase in phases:
        ref = results.get(f"phase{phase}_{ref_run}")
        for recipe in [r for r in recipes if r != ref_run]:
            fp8 = results.get(f"phase{phase}_{recipe}")
            a, b = window_means(ref["loss"], args.window)[-1], window_means(fp8["loss"], args.window)[-1]
            print(
                f"phase {phase} {recipe}: final-window mean loss {ref_run} {a:.4f}, {recipe} {b:.4f} "
                f"({recipe}/{ref_run} - 1 = {100 * (b / a - 1):+.2f} %); "
                f"val BPB {ref['val_bpb']:.4f} vs {fp8['val_bpb']:.4f}"
            )
    with open(o("fp8_convergence.json"), "w") as f:
        json.dump({"argv": sys.argv, "window": args.window, "runs": results}, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for recipe in recipes:
            r = results[f"phase{phase}_{recipe}"]
            ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=" ".join(recipes[recipe]), lw=0.8)
        ax.set(title=f"phase {phase}", xlabel="step", ylabel="train loss", yscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(o("fp8_convergence.png"), dpi=110)


if __name__ == "__main__":
    main()
