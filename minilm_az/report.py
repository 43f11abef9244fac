"""A demo run directory -> `report.md` and PNG plots: `python -m minilm_az.report runs/demo`.

Reads what the stages left behind (minilm_az/demo.py lays it out): `demo.json` (config, stage timings),
`tokenizer_report.json` (tokenize.py report), `shards*/index.json`, the `metrics.jsonl` of `base`,
`phase1`, `phase2` and `finetune`, `samples.jsonl` and the stage logs. Plots need matplotlib (the
`report` extra); without it the report is written with its tables only, and says so.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

CPT_STAGES = (  # (dir, label, shards dir of its tokenizer); {base} is the baseline tokenizer's name
    ("base", "base ({base} tokenizer)", "shards_baseline"),
    ("phase1", "phase 1: embeddings", "shards"),
    ("phase2", "phase 2: everything", "shards"),
)
COLORS = {"base": "#8c8c8c", "phase1": "#6baed6", "phase2": "#08519c", "finetune": "#e6550d",
          "ours": "#08519c", "baseline": "#8c8c8c"}


def read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def kv_lines(path: str, stream: str) -> list[dict]:
    """The `stream key=value ...` lines of a log, as dicts of strings."""
    out = []
    if os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                words = line.split()
                if words and words[0] == stream:
                    out.append(dict(w.split("=", 1) for w in words[1:] if "=" in w))
    return out


def split_stats(shards_dir: str, split: str = "train") -> dict | None:
    index = read_json(os.path.join(shards_dir, "index.json"))
    return index["splits"][split] if index else None


def unigram_bpb(shards_dir: str) -> float | None:
    """BPB on the val split of a model that knows only the train split's token frequencies (add-0.5)."""
    from minilm_az.shards import TokenStream
    if not os.path.isfile(os.path.join(shards_dir, "index.json")):
        return None
    train, val = TokenStream(shards_dir, "train"), TokenStream(shards_dir, "val")
    if val.num_tokens == 0:
        return None
    t, v = train.get(0, train.num_tokens), val.get(0, val.num_tokens)
    counts = np.bincount(t, minlength=int(max(t.max(), v.max())) + 1) + 0.5
    nll = -np.log(counts[v] / counts.sum()).sum()
    return float(nll / (math.log(2) * val.num_bytes))


def load_run(run: str) -> dict:
    """Everything the report shows, gathered from the run directory."""
    meta = read_json(os.path.join(run, "demo.json")) or {}
    r = {"run": run, "meta": meta, "fertility": read_json(os.path.join(run, "tokenizer_report.json")),
         "stages": {}, "samples": read_jsonl(os.path.join(run, "samples.jsonl"))}
    logs = {s["name"]: os.path.join(run, s["log"]) for s in meta.get("stages", []) if s.get("log")}
    r["base_name"] = (meta.get("baseline") or "baseline").split(" (")[0]
    n_lines = meta.get("config", {}).get("val_lines")
    r["val_label"] = "firefox.txt" + (f", first {n_lines} lines" if n_lines else "")
    for name, label, shards in CPT_STAGES:
        recs = read_jsonl(os.path.join(run, name, "metrics.jsonl"))
        if not recs:
            continue
        train = split_stats(os.path.join(run, shards)) or {}
        bytes_per_token = train.get("bytes", 0) / max(train.get("tokens", 0), 1) or None
        cfg = (kv_lines(logs.get(name, ""), "config") or [{}])[-1]
        r["stages"][name] = {
            "label": label.format(base=r["base_name"]),
            "train": [x for x in recs if x["kind"] == "train"],
            "eval": [x for x in recs if x["kind"] == "eval"],
            "bytes_per_token": bytes_per_token,
            "params": int(cfg["params"]) if "params" in cfg else None,
            "trainable": int(cfg["trainable"]) if "trainable" in cfg else None,
            "tokens_per_step": int(cfg["tokens_per_step"]) if "tokens_per_step" in cfg else None,
            "train_tokens": train.get("tokens"),
            "vocab_size": (read_json(os.path.join(run, name, "config.json")) or {}).get("vocab_size"),
            "unigram_bpb": unigram_bpb(os.path.join(run, shards)) if name != "phase1" else None,
        }
    ft = read_jsonl(os.path.join(run, "finetune", "metrics.jsonl"))
    if ft:
        r["stages"]["finetune"] = {
            "label": "LoRA chat fine-tune",
            "train": [x for x in ft if x["kind"] == "finetune"],
            "eval": [x for x in ft if x["kind"] == "eval"],
            "model": next((x for x in ft if x["kind"] == "model"), {}),
            "data": next((x for x in ft if x["kind"] == "data"), {}),
        }
    return r


def final_bpb(stage: dict | None) -> float | None:
    evals = [e for e in (stage or {}).get("eval", []) if "val_bpb" in e]
    return evals[-1]["val_bpb"] if evals else None


def throughput(stage: dict) -> float | None:
    """Mean training tokens/s, leaving out the first log window (allocator and thread warm-up)."""
    tps = [x["tokens_per_s"] for x in stage["train"] if x.get("tokens_per_s")]
    tps = tps[1:] if len(tps) > 2 else tps
    return sum(tps) / len(tps) if tps else None


def train_bpb(stage: dict) -> tuple[list[int], list[float]]:
    """Train loss (nats/token) as bits per byte, with the train split's average bytes per token."""
    bpt = stage.get("bytes_per_token")
    if not bpt:
        return [], []
    return [x["step"] for x in stage["train"]], [x["loss"] / math.log(2) / bpt for x in stage["train"]]


# ---------------------------------------------------------------- plots

def _plt():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 10, "axes.spines.top": False, "axes.spines.right": False,
                         "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": 110})
    return plt


def _bar_labels(ax, bars, fmt, inside: bool = False):
    for b in bars:
        h = b.get_height()
        if inside:  # in the bar's middle, clear of reference lines drawn across the top
            ax.annotate(fmt(h), (b.get_x() + b.get_width() / 2, h / 2), ha="center", va="center", fontsize=11,
                        color="white", fontweight="bold")
        else:
            ax.annotate(fmt(h), (b.get_x() + b.get_width() / 2, h), ha="center", va="bottom", fontsize=9,
                        xytext=(0, 2), textcoords="offset points")


def plot_fertility(plt, fert: dict, base_name: str, val_label: str, path: str) -> None:
    rows = fert["corpora"]["all"]
    names = [("baseline", base_name), ("ours", "ours")]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for ax, key, title in ((axes[0], "tokens_per_word", "tokens per word (lower is better)"),
                           (axes[1], "bytes_per_token", "bytes per token (higher is better)")):
        labels = [f"{lab}\n{rows[n]['vocab_size']:,} ids" for n, lab in names]
        bars = ax.bar(labels, [rows[n][key] for n, _ in names], color=[COLORS[n] for n, _ in names], width=0.55)
        _bar_labels(ax, bars, lambda v: f"{v:.2f}")
        ax.set_title(title)
        ax.grid(axis="x", visible=False)
        ax.set_ylim(0, max(rows[n][key] for n, _ in names) * 1.18)
    fig.suptitle(f"Tokenizer fertility on held-out Azerbaijani text ({val_label})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_losses(plt, r: dict, path: str) -> None:
    cpt = [(n, r["stages"][n]) for n, _, _ in CPT_STAGES if n in r["stages"]]
    ft = r["stages"].get("finetune")
    n = len(cpt) + (1 if ft else 0)
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n, 3.7), squeeze=False)
    axes = axes[0]
    ours_y = []  # phase 1 and 2 share a scale; the base's random-init start would flatten them
    for ax, (name, s) in zip(axes, cpt):
        steps, bpb = train_bpb(s)
        ax.plot(steps, bpb, color=COLORS[name], lw=1.5, label="train (from the loss)")
        ev = [e for e in s["eval"] if "val_bpb" in e]
        ax.plot([e["step"] for e in ev], [e["val_bpb"] for e in ev], "o--", color="black", ms=4, lw=0.8,
                label="val (measured)")
        floor = r["stages"].get("base" if name == "base" else "phase2", {}).get("unigram_bpb")
        if floor:
            ax.axhline(floor, color="#999999", ls=":", lw=1.2, label="val, unigram frequencies")
        if name != "base":
            ours_y += bpb + [e["val_bpb"] for e in ev] + ([floor] if floor else [])
        ax.set_title(s["label"])
        ax.set_xlabel("optimizer step")
    if cpt:
        axes[0].set_ylabel("bits per byte")
        axes[0].legend(fontsize=8)
        if ours_y:
            for ax, (name, _) in zip(axes, cpt):
                if name != "base":
                    ax.set_ylim(min(ours_y) - 0.15, max(ours_y) + 0.15)
    if ft:
        ax = axes[-1]
        ax.plot([x["step"] for x in ft["train"]], [x["loss"] for x in ft["train"]], color=COLORS["finetune"],
                lw=1.5, label="train")
        ax.plot([e["step"] for e in ft["eval"]], [e["val_loss"] for e in ft["eval"]], "o--", color="black",
                ms=4, lw=0.8, label="val")
        ax.set_title(ft["label"])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("nats per assistant token")
        ax.legend(fontsize=8)
    fig.suptitle("Loss per stage, in bits per byte of text (the phases share one scale)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bpb(plt, r: dict, path: str) -> None:
    rows = [(n, s) for n, s in r["stages"].items() if n != "finetune" and final_bpb(s) is not None]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    labels = [s["label"].replace(": ", ":\n").replace(" (", "\n(") for _, s in rows]
    bars = ax.bar(labels, [final_bpb(s) for _, s in rows], color=[COLORS[n] for n, _ in rows], width=0.55)
    _bar_labels(ax, bars, lambda v: f"{v:.3f}", inside=True)
    for name, style, who in (("base", ":", f"{r['base_name']} tokens"), ("phase2", "--", "our tokens")):
        u = r["stages"].get(name, {}).get("unigram_bpb")
        if u:
            ax.axhline(u, color=COLORS[name], ls=style, lw=1.2, label=f"unigram frequencies of {who}: {u:.2f}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right", title="no model, for reference", title_fontsize=8)
    ax.set_ylabel("bits per byte (lower is better)")
    ax.set_title(f"Validation bits per byte on {r['val_label']}\n(the same bytes for every model)", fontsize=10)
    ax.grid(axis="x", visible=False)
    ax.set_ylim(0, max(b.get_height() for b in bars) * 1.35 if rows else 1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_throughput(plt, r: dict, path: str) -> None:
    rows = [(n, s) for n, s in r["stages"].items() if n != "finetune" and throughput(s)]
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.4))
    labels = [s["label"].replace(": ", ":\n").replace(" (", "\n(") for _, s in rows]
    colors = [COLORS[n] for n, _ in rows]
    bars = axes[0].bar(labels, [throughput(s) for _, s in rows], color=colors, width=0.55)
    _bar_labels(axes[0], bars, lambda v: f"{v:,.0f}")
    axes[0].set_title("training tokens per second")
    bars = axes[1].bar(labels, [throughput(s) * s["bytes_per_token"] / 1e3 for _, s in rows], color=colors,
                       width=0.55)
    _bar_labels(axes[1], bars, lambda v: f"{v:,.1f}")
    axes[1].set_title("training text per second (KB)")
    for ax in axes:
        ax.grid(axis="x", visible=False)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    procs = r["meta"].get("config", {}).get("procs", "?")
    fig.suptitle(f"Throughput on CPU ({procs} processes, 1 thread each)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------- markdown

def _vocab(stage: dict | None) -> str:
    v = (stage or {}).get("vocab_size")
    return f"{round(v / 1000)}k" if v else "large"


def _cost_ratio(st: dict) -> str:
    """How many times the base's training tokens/s fall short of phase 2's, as measured."""
    b, p = throughput(st["base"]) if "base" in st else None, throughput(st["phase2"]) if "phase2" in st else None
    return f"{p / b:.0f}x" if b and p else "far"

def _f(v, fmt=".3f", none="–"):
    return none if v is None else format(v, fmt)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def write_report(run: str) -> str:
    """Write `run/report.md` and its PNGs; returns the report's path."""
    r = load_run(run)
    meta, st, fert = r["meta"], r["stages"], r["fertility"]
    cfg = meta.get("config", {})
    base_name = r["base_name"]
    plt = _plt()
    plots = {}
    if plt is not None:
        for key, fn, ok in (("fertility", lambda p: plot_fertility(plt, fert, base_name, r["val_label"], p), fert),
                            ("loss", lambda p: plot_losses(plt, r, p), st),
                            ("bpb", lambda p: plot_bpb(plt, r, p), any(final_bpb(s) for s in st.values())),
                            ("throughput", lambda p: plot_throughput(plt, r, p), st)):
            if ok:
                fn(os.path.join(run, f"{key}.png"))
                plots[key] = f"{key}.png"

    def img(key, alt):
        return [f"![{alt}]({plots[key]})", ""] if key in plots else []

    L = [f"# minilm-az demo: `{meta.get('name', os.path.basename(run))}`", ""]
    fa = fert["corpora"]["all"] if fert else None
    b_base, b1, b2 = (final_bpb(st.get(n)) for n in ("base", "phase1", "phase2"))
    summary = []
    if fa:
        summary.append(f"our {fa['ours']['vocab_size']:,}-id tokenizer needs **{fa['ours']['tokens_per_word']:.2f} "
                       f"tokens per word** on held-out text against {fa['baseline']['tokens_per_word']:.2f} for "
                       f"{base_name}'s {fa['baseline']['vocab_size']:,}-id one "
                       f"({100 * (1 - fa['ours']['tokens_per_word'] / fa['baseline']['tokens_per_word']):.0f}% "
                       f"fewer tokens)")
    if b_base and b2:
        summary.append(f"validation bits per byte went **{b_base:.3f} (base) → {_f(b1)} (phase 1) → {b2:.3f} "
                       f"(phase 2)**")
    if summary:
        L += ["In short: " + "; ".join(summary) + ".", ""]
    if plt is None:
        L += ["> matplotlib is not installed, so this report has no plots: `pip install -e '.[report]'` and "
              f"`python -m minilm_az.report {run}` to add them.", ""]
    L += ["## What ran", "",
          f"Train text: {', '.join(os.path.basename(f) for f in meta.get('train_files', []))} of `data/az`; "
          f"validation text: {r['val_label']} (another source, held out from the tokenizer and every model). "
          f"CPU, {cfg.get('procs', '?')} processes under torchrun (FSDP2 on gloo), one thread each; "
          f"{meta.get('cpus', '?')} CPUs seen; total {_f(meta.get('seconds'), '.0f')} s.", "",
          "**The base model is a stand-in.** The real recipe starts from an English-centric pretrained model "
          "(Llama 3.2 1B) with its own tokenizer. A CPU demo can neither train nor load that, so `base` is a "
          f"tiny Llama trained here from random init for {cfg.get('base_steps', '?')} steps with {base_name}'s "
          f"tokenizer on the same train text. Its {_vocab(st.get('base'))}-row embedding makes each token "
          f"{_cost_ratio(st)} dearer on CPU than our tokenizer's, so it gets few steps: it plays the role of a model "
          "that knows a little of the language through a tokenizer that fits it badly. Its BPB is not what a "
          "real base model scores, and phase 2 trains for longer than it did.", ""]
    if meta.get("stages"):
        L += _table(["stage", "what", "seconds"], [[s["name"], s["title"], _f(s["seconds"], ".0f")]
                                                    for s in meta["stages"]]) + [""]

    if fa:
        L += ["## 1. Tokenizer", "",
              "Fertility is tokens per whitespace-separated word: fewer tokens per word mean shorter sequences, "
              "more text per context window and per FLOP.", ""]
        L += _table(["tokenizer", "vocab", "tokens", "tokens/word", "bytes/token", "chars/token"],
                    [[base_name if n == "baseline" else "ours", f"{fa[n]['vocab_size']:,}", f"{fa[n]['tokens']:,}",
                      f"{fa[n]['tokens_per_word']:.3f}", f"{fa[n]['bytes_per_token']:.3f}",
                      f"{fa[n]['chars_per_token']:.3f}"] for n in ("baseline", "ours")])
        ratio = fa["ours"]["tokens_per_word"] / fa["baseline"]["tokens_per_word"]
        L += ["", f"On {fa['ours']['words']:,} words, {fa['ours']['bytes']:,} bytes of held-out text. "
              f"Fertility ours / baseline: **{ratio:.3f}**.", ""] + img("fertility", "fertility")

    cpt = [n for n, _, _ in CPT_STAGES if n in st]
    if cpt:
        L += ["## 2. Pretraining: base, then the two phases", "",
              "Phase 1 maps the base model's embeddings onto our vocabulary (a token the base vocabulary also has "
              "is copied; a new one is the mean of the base tokens it splits into) and trains only the embeddings; "
              "phase 2 trains everything. Train loss is drawn in bits per byte (loss in nats per token ÷ ln 2 ÷ the "
              "train text's bytes per token), so the panels are on one scale despite the two tokenizers.", ""]
        L += img("loss", "loss curves")
        rows = []
        for n in cpt:
            s = st[n]
            tps = throughput(s)
            tr = s["train"][-1] if s["train"] else {}
            epochs = tr.get("step", 0) * (s["tokens_per_step"] or 0) / s["train_tokens"] if s["train_tokens"] else None
            rows.append([s["label"], f"{s['params']:,}" if s["params"] else "–",
                         f"{s['trainable']:,}" if s["trainable"] else "–", tr.get("step", "–"),
                         _f(epochs, ".2f"), _f(tr.get("loss")), _f(final_bpb(s)), _f(tps, ",.0f"),
                         _f(tps * s["bytes_per_token"] / 1e3 if tps and s["bytes_per_token"] else None, ",.1f")])
        L += _table(["stage", "params", "trainable", "steps", "epochs of train text", "last train loss (nats/token)",
                     "val BPB", "tokens/s", "KB of text/s"], rows) + [""]
        L += ["Train loss sits below val: the val text is another source (Firefox's strings, not KDE's or "
              "MediaWiki's), and the phases read the train text more than once.", ""]

        L += ["## 3. Bits per byte before and after", "",
              "Each model is scored with its own tokenizer on the same validation bytes; bits per byte divides the "
              "total loss by the byte count, so it compares models whatever their tokenizers. The dashed lines are "
              "what the token frequencies of the train text alone score (a model that ignores context): a good "
              "tokenizer lowers that floor, training has to go below it.", ""]
        L += img("bpb", "bits per byte")
        rows = [[st[n]["label"], _f(final_bpb(st[n])), _f(st[n]["eval"][-1].get("val_loss") if st[n]["eval"] else None),
                 f"{st[n]['eval'][-1].get('val_tokens', 0):,}" if st[n]["eval"] else "–"] for n in cpt]
        L += _table(["model", "val BPB", "val loss (nats/token)", "tokens scored"], rows) + [""]
        for n, who in (("base", f"{base_name}'s tokens"), ("phase2", "our tokens")):
            if st.get(n, {}).get("unigram_bpb"):
                L.append(f"- unigram reference, {who}: {st[n]['unigram_bpb']:.3f} bits per byte")
        if b_base and b2:
            L.append(f"- phase 2 against the base: {b2:.3f} vs {b_base:.3f} bits per byte "
                     f"({100 * (1 - b2 / b_base):.0f}% lower)")
            u_base, u_ours = st["base"].get("unigram_bpb"), st["phase2"].get("unigram_bpb")
            if u_base and u_ours:
                L += ["", f"How to read it: of the {b_base - b2:.2f} bits per byte between base and phase 2, "
                      f"{u_base - u_ours:.2f} is the floor moving (our tokens are longer, so even their frequencies "
                      f"predict the text better), and the rest is the models: the base ends {b_base - u_base:+.2f} "
                      f"from its floor, phase 2 {b2 - u_ours:+.2f} from its (below it: it uses the context)."]
        L += [""] + img("throughput", "throughput")
        if "base" in st and "phase2" in st and throughput(st["base"]) and throughput(st["phase2"]):
            ratio = (throughput(st["phase2"]) * st["phase2"]["bytes_per_token"]) / \
                (throughput(st["base"]) * st["base"]["bytes_per_token"])
            L += [f"Per second of CPU, phase 2 reads {ratio:.0f}x as much text as the base model: its tokens are "
                  "longer and its 8k-row embedding is cheap next to a 128k-row one.", ""]

    ft = st.get("finetune")
    if ft:
        m, d = ft["model"], ft["data"]
        ev = ft["eval"]
        L += ["## 4. Chat fine-tune (LoRA)", "",
              f"LoRA r={m.get('r')}, alpha={m.get('alpha')} on {m.get('targets', '').replace(',', ', ')}: "
              f"{m.get('trainable', 0):,} trainable of {m.get('params', 0):,} parameters "
              f"({m.get('trainable_pct')}%). {d.get('train')} train and {d.get('val')} val conversations of "
              "`data/chat`; the loss is on the assistant's tokens only. "
              + (f"Val loss {ev[0]['val_loss']:.3f} → {ev[-1]['val_loss']:.3f} nats per assistant token over "
                 f"{ft['train'][-1]['step'] if ft['train'] else 0} steps." if len(ev) >= 2 else ""), ""]
    if r["samples"]:
        L += ["### Samples", "",
              "From the phase 2 model with the adapter (`finetune.py --prompt`). A model of a few million "
              "parameters trained for minutes on half a megabyte does not answer questions: these show the "
              "pipeline end to end (chat template, adapter, sampling), not fluency.", ""]
        for s in r["samples"]:
            L += [f"**user:** {s['prompt']}", "", "**assistant:** " + (s["reply"] or "*(empty)*"), ""]

    if meta.get("stages"):
        L += ["## Commands", "", "Run from the repository root (logs in `logs/`):", "", "```"]
        L += [" ".join(_short(a, run) for a in s["command"]) for s in meta["stages"] if s.get("command")]
        L += ["```", ""]
    path = os.path.join(run, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(L))
    return path


def _short(arg: str, run: str) -> str:
    """Paths as a reader would type them: relative to the repository root, python for sys.executable."""
    if arg == sys.executable:
        return "python"
    if os.path.isabs(arg):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rel = os.path.relpath(arg, root)
        return rel if not rel.startswith("..") else arg
    return f'"{arg}"' if " " in arg else arg


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print("usage: python -m minilm_az.report RUN_DIR", file=sys.stderr)
        sys.exit(2)
    print(write_report(sys.argv[1]))
