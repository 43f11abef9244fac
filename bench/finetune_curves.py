"""Loss curves of packed vs padded LoRA fine-tuning: finetune.py run twice, same seed, `--packing` on and off.

    python bench/finetune_curves.py                       # CPU, 2 cores: 14.5 min measured (300 steps, 4 runs)
    python bench/finetune_curves.py --steps 20 --window 5  # a quick look

Runs the real root script on the demo chat set (data/chat: az_chat.jsonl trains, az_chat_val.jsonl validates)
from runs/demo/phase2 when `make demo` left it, else from a tiny random model made here (the tiny preset, a
2,000-id tokenizer trained on data/az). The demo's fine-tune settings (r=16, alpha 32, lr 2e-3, max_seq_len
256), --log-every 1, two processes at a time with one thread each. Each pair runs at the default LoRA dropout
(0.05) and at dropout 0: a packed step holds the same conversations as a padded one, so the loss is the same
function of the adapters; what can differ is only float rounding and, with dropout on, the dropout masks
(drawn per tensor, so a token gets another mask in a packed row than in a padded one). Writes both curves
(train loss every step, val loss every --eval-every) to bench/results/finetune_curves.json and prints the
windowed mean train losses and their relative difference.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DEMO_MODEL = os.path.join(ROOT, "runs/demo/phase2")


def tiny_base(out: str) -> str:
    """A random tiny-preset model and its tokenizer in `out` (when there is no demo model)."""
    from minilm_az.hf import save_pretrained
    from minilm_az.model import build_model, get_preset
    from minilm_az.tokenizer import train_tokenizer, write_tokenizer_files

    lines = [ln.strip() for f in sorted(glob.glob(os.path.join(ROOT, "data/az/*.txt"))) for ln in open(f) if ln.strip()]
    tok = train_tokenizer(lines, 2000, progress=False)
    write_tokenizer_files(tok, out)
    save_pretrained(build_model(get_preset("tiny", vocab_size=tok.get_vocab_size()), seed=0), out)
    return out


def run(model: str, out: str, packing: bool, dropout: float, args) -> subprocess.Popen:
    chat = os.path.join(ROOT, "data/chat")
    cmd = [sys.executable, os.path.join(ROOT, "finetune.py"), "--model", model, "--out", out, "--device", "cpu"]
    cmd += ["--data", os.path.join(chat, "az_chat.jsonl"), "--val-data", os.path.join(chat, "az_chat_val.jsonl")]
    cmd += ["--steps", str(args.steps), "--lora-r", "16", "--lora-alpha", "32", "--lr", "2e-3", "--warmup", "30"]
    cmd += ["--max-seq-len", "256", "--log-every", "1", "--eval-every", str(args.eval_every), "--seed", "0"]
    cmd += ["--lora-dropout", str(dropout), "--packing", str(packing).lower()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def curves(out: str) -> dict:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    train = [r["loss"] for r in recs if r["kind"] == "finetune"]
    val = {r["step"]: r["val_loss"] for r in recs if r["kind"] == "eval"}
    return {"train_loss": train, "val_loss": val}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--window", type=int, default=25, help="steps per windowed mean in the table")
    p.add_argument("--model", default=None, help="base model dir (default: runs/demo/phase2, else a tiny one)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/finetune_curves.json"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="ft_curves_")
    model = args.model or (DEMO_MODEL if os.path.isdir(DEMO_MODEL) else tiny_base(os.path.join(tmp, "base")))
    result = {"model": model, "steps": args.steps, "argv": sys.argv, "runs": {}}
    t0 = time.time()
    for dropout in (0.05, 0.0):  # a pair at a time, side by side on one thread each
        jobs = {
            pk: run(model, os.path.join(tmp, f"d{dropout}_{pk}"), pk == "packed", dropout, args)
            for pk in ("packed", "padded")
        }
        for pk, job in jobs.items():
            _, err = job.communicate()
            if job.returncode:
                sys.exit(f"finetune.py ({pk}, dropout {dropout}) failed:\n{err[-3000:]}")
        result["runs"][f"dropout={dropout}"] = {pk: curves(os.path.join(tmp, f"d{dropout}_{pk}")) for pk in jobs}
    result["seconds"] = round(time.time() - t0, 1)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"model {model}, {args.steps} steps, {result['seconds']} s; train loss, mean of each {args.window} steps")
    print(f"{'dropout':>7s} {'steps':>9s} {'packed':>9s} {'padded':>9s} {'rel diff':>9s} {'max |step diff|':>15s}")
    for key, pair in result["runs"].items():
        a, b = pair["packed"]["train_loss"], pair["padded"]["train_loss"]
        for s in range(0, len(a), args.window):
            wa, wb = a[s : s + args.window], b[s : s + args.window]
            ma, mb = sum(wa) / len(wa), sum(wb) / len(wb)
            step_diff = max(abs(x - y) for x, y in zip(wa, wb))
            print(
                f"{key[8:]:>7s} {s + 1:4d}-{s + len(wa):<4d} {ma:9.4f} {mb:9.4f} {(ma - mb) / mb:9.1e} "
                f"{step_diff:15.1e}"
            )
        va, vb = pair["packed"]["val_loss"], pair["padded"]["val_loss"]
        vals = "  ".join(f"{s}: {va[s]:.4f}/{vb[s]:.4f}" for s in va)
        print(f"{key[8:]:>7s} val loss packed/padded at step {vals}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
