"""A demo run directory -> `report.md` and PNG plots: `python -m demo.report runs/demo` (`make report`).

Reads only files the runner and the stages wrote, never their logs: `demo.json` (the runner: config,
each stage's command and seconds), `tokenizer_report.json` (tokenize.py report --json), the shard
dirs (index.json, and the tokens themselves for the reference scores), each training stage's
`metrics.jsonl` and `samples.jsonl`. A record a stage did not write shows as "–". Plots are drawn by
demo/plots.py with matplotlib (the `report` extra); without it the report has its tables only, and says so.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, field

import numpy as np

SEED_NOISE = 0.02  # a relative BPB gap below which one seed per run cannot tell two runs apart (a judgement)
CPT = ("base", "phase1", "phase2", "control")  # the pretraining stages, in the order they ran
LABELS = {
    "base": "base ({base} tokenizer)",
    "phase1": "phase 1: embeddings",
    "phase2": "phase 2: everything",
    "control": "control: random init",
}


# ---------------------------------------------------------------- reading the run


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


@dataclass
class Shards:
    """A shard dir's split sizes and the two no-model reference scores on its val split, in bits per byte."""

    train: dict
    val: dict
    vocab_size: int
    uniform_bpb: float | None  # every id equally likely: a model that knows nothing
    unigram_bpb: float | None  # the train split's token frequencies (add-0.5), no context

    def bytes_per_token(self, split: str = "train") -> float | None:
        s = self.train if split == "train" else self.val
        return s["bytes"] / s["tokens"] if s.get("tokens") else None


def read_shards(path: str) -> Shards | None:
    from minilm_az.shards import TokenStream  # the shard format's reader

    index = read_json(os.path.join(path, "index.json"))
    if not index:
        return None
    train, val = index["splits"].get("train", {}), index["splits"].get("val", {})
    uniform = unigram = None
    if val.get("tokens") and val.get("bytes"):
        t, v = TokenStream(path, "train"), TokenStream(path, "val")
        t, v = t.get(0, t.num_tokens), v.get(0, v.num_tokens)
        counts = np.bincount(t, minlength=int(max(t.max(), v.max())) + 1) + 0.5
        unigram = float(-np.log2(counts[v] / counts.sum()).sum() / val["bytes"])
        uniform = len(v) * math.log2(index["vocab_size"]) / val["bytes"]
    return Shards(train, val, index["vocab_size"], uniform, unigram)


@dataclass
class Stage:
    """One training stage: its metrics.jsonl records, grouped by kind."""

    name: str
    label: str
    records: list[dict]
    shards: Shards | None = None

    def all(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    def last(self, kind: str) -> dict:
        """The newest record of a kind; {} when the stage wrote none (an older script, say)."""
        recs = self.all(kind)
        return recs[-1] if recs else {}

    @property
    def evals(self) -> list[dict]:
        return [e for e in self.all("eval") if "val_bpb" in e or "val_loss" in e]

    def val_bpb(self, step: int | None = None) -> float | None:
        """The val BPB at `step` (default: the last eval)."""
        ev = [e for e in self.evals if "val_bpb" in e and (step is None or e["step"] == step)]
        return ev[-1]["val_bpb"] if ev else None

    def throughput(self) -> float | None:
        """Mean training tokens/s, leaving out the first log window (allocator and thread warm-up)."""
        tps = [x["tokens_per_s"] for x in self.all("train") if x.get("tokens_per_s")]
        tps = tps[1:] if len(tps) > 2 else tps
        return sum(tps) / len(tps) if tps else None

    def train_bpb(self) -> tuple[list[int], list[float]]:
        """Train loss (nats/token) as bits per byte, with the train split's average bytes per token."""
        bpt = self.shards.bytes_per_token() if self.shards else None
        if not bpt:
            return [], []
        train = self.all("train")
        return [x["step"] for x in train], [x["loss"] / math.log(2) / bpt for x in train]


@dataclass
class Run:
    path: str
    meta: dict
    base_name: str
    fertility: dict | None
    stages: dict[str, Stage] = field(default_factory=dict)
    finetune: Stage | None = None
    samples: list[dict] = field(default_factory=list)

    @property
    def cfg(self) -> dict:
        return self.meta.get("config", {})

    @property
    def val_label(self) -> str:
        n = self.cfg.get("val_lines")
        return "firefox.txt" + (f", first {n} lines" if n else "")

    def bpb(self, name: str, step: int | None = None) -> float | None:
        return self.stages[name].val_bpb(step) if name in self.stages else None


def load_run(path: str) -> Run:
    """Everything the report shows, gathered from the run directory."""
    meta = read_json(os.path.join(path, "demo.json")) or {}
    r = Run(
        path,
        meta,
        (meta.get("baseline") or "baseline").split(" (")[0],
        read_json(os.path.join(path, "tokenizer_report.json")),
        samples=read_jsonl(os.path.join(path, "samples.jsonl")),
    )
    shards = {d: read_shards(os.path.join(path, d)) for d in ("shards", "shards_baseline")}
    for name in CPT:
        recs = read_jsonl(os.path.join(path, name, "metrics.jsonl"))
        if recs:
            r.stages[name] = Stage(
                name,
                LABELS[name].format(base=r.base_name),
                recs,
                shards["shards_baseline" if name == "base" else "shards"],
            )
    ft = read_jsonl(os.path.join(path, "finetune", "metrics.jsonl"))
    if ft:
        r.finetune = Stage("finetune", "LoRA chat fine-tune", ft)
    return r


# ---------------------------------------------------------------- words from numbers


def _f(v, fmt=".3f", none="–"):
    return none if v is None else format(v, fmt)


def _n(v) -> str:
    return f"{v:,}" if isinstance(v, int) else "–"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]


def against_floors(bpb: float, s: Shards) -> str:
    """Where a val BPB sits between the two no-model references of its tokenizer, in words."""
    uni, flat = s.unigram_bpb, s.uniform_bpb
    if bpb > flat:
        return (
            f"{bpb - uni:.3f} **above** the unigram floor ({uni:.3f}) and even {bpb - flat:.3f} above the uniform "
            f"guess ({flat:.3f}): worse than knowing nothing"
        )
    if bpb > uni:
        return (
            f"{bpb - uni:.3f} **above** the unigram floor ({uni:.3f}): it predicts the val text worse than the "
            f"train text's token frequencies alone, though {flat - bpb:.3f} better than a uniform guess"
        )
    return f"{uni - bpb:.3f} below the unigram floor ({uni:.3f}): it uses the context"


def eval_window(r: Run) -> int | None:
    """The window (tokens) BPB was measured in: the eval record's, else the run's flags, else the demo's config."""
    for s in r.stages.values():
        for rec in (s.evals[-1] if s.evals else {}, s.last("config")):
            for key in ("window", "seq_len"):
                if rec.get(key):
                    return int(rec[key])
    return r.cfg.get("seq_len")


def steps_of(s: Stage) -> int | None:
    train = s.all("train")
    return train[-1]["step"] if train else s.last("config").get("steps")


# ---------------------------------------------------------------- sections


def section_summary(r: Run) -> list[str]:
    out = []
    fa = r.fertility["corpora"]["all"] if r.fertility else None
    if fa:
        ours, base = fa["ours"], fa["baseline"]
        fewer = 1 - ours["tokens_per_word"] / base["tokens_per_word"]
        out.append(
            f"our {ours['vocab_size']:,}-id tokenizer needs **{ours['tokens_per_word']:.2f} tokens per word** "
            f"on held-out text against {base['tokens_per_word']:.2f} for {r.base_name}'s "
            f"{base['vocab_size']:,}-id one ({100 * fewer:.0f}% fewer tokens)"
        )
    b0, b1, b2, bc = (r.bpb(n) for n in CPT)
    if b0 and b2:
        out.append(f"validation bits per byte went **{b0:.3f} (base) → {_f(b1)} (phase 1) → {b2:.3f} (phase 2)**")
    if b2 and bc:
        verdict = (
            f"the transfer buys {bc - b2:.3f}" if b2 < bc else f"the transfer does not pay here ({b2 - bc:.3f} worse)"
        )
        out.append(f"the control (random init, the same steps and data) reaches {bc:.3f}, so {verdict}")
    return ["In short: " + "; ".join(out) + ".", ""] if out else []


def section_setup(r: Run) -> list[str]:
    cfg, meta = r.cfg, r.meta
    base = r.stages.get("base")
    out = [
        "## What ran",
        "",
        f"Train text: {', '.join(os.path.basename(f) for f in meta.get('train_files', []))} of `data/az`; "
        f"validation text: {r.val_label} (another source, held out from the tokenizer and every model). "
        f"CPU, {cfg.get('procs', '?')} processes under torchrun (FSDP2 on gloo), one thread each; "
        f"{meta.get('cpus', '?')} CPUs seen; total {_f(meta.get('seconds'), '.0f')} s.",
        "",
    ]
    if base:
        ratio = (
            r.stages["phase2"].throughput() / base.throughput()
            if "phase2" in r.stages and base.throughput() and r.stages["phase2"].throughput()
            else None
        )
        vocab = base.shards.vocab_size if base.shards else None
        out += [
            "**The base model is a stand-in.** The real recipe starts from an English-centric pretrained model "
            "(Llama 3.2 1B) with its own tokenizer. A CPU demo can neither train nor load that, so `base` is a "
            f"tiny Llama trained here from random init for {_n(steps_of(base))} steps with {r.base_name}'s "
            f"tokenizer on the same train text. Its {_n(vocab)}-row embedding makes a training token "
            f"{_f(ratio, '.0f', 'many')} times dearer on CPU than our tokenizer's, so it gets few steps: it plays "
            "a model that knows a little of the language through a tokenizer that fits it badly, and its BPB is "
            "not what a real base model scores.",
            "",
        ]
    if meta.get("stages"):
        out += _table(
            ["stage", "what", "seconds"], [[s["name"], s["title"], _f(s["seconds"], ".0f")] for s in meta["stages"]]
        )
    return out


def section_clean(r: Run) -> list[str]:
    """What `tokenize.py clean` removed from the train text, step by step, with one example per reason."""
    rep = read_json(os.path.join(r.path, "clean", "clean_report.json"))
    if not rep:
        return []
    rows = []
    for s in rep["steps"]:
        removed = ", ".join(f"{why} {n:,}" for why, n in sorted(s["removed"].items(), key=lambda kv: -kv[1]))
        cells = [_n(s["documents_in"]), _n(s["documents_out"]), _n(s["bytes_in"]), _n(s["bytes_out"])]
        rows.append([s["step"] if s["enabled"] else f"{s['step']} (off)", *cells, removed or "–"])
    gone = 1 - rep["documents_out"] / max(rep["documents_in"], 1)
    out = [
        "## 0. Clean",
        "",
        f"`tokenize.py clean` kept {rep['documents_out']:,} of {rep['documents_in']:,} train documents "
        f"({gone:.1%} removed, {rep['bytes_out']:,} of {rep['bytes_in']:,} bytes); the tokenizer and both shard "
        "sets are made from what it kept. The held-out firefox text is not cleaned (BPB is measured on it as it is).",
        "",
        *_table(["step", "docs in", "docs out", "bytes in", "bytes out", "removed (reason, documents)"], rows),
        "One removed document per reason (the first few of each are in `clean/clean_report.json`):",
        "",
    ]
    for reason, samples in rep.get("samples", {}).items():
        text = " ".join(samples[0]["text"].split())
        text = text if len(text) <= 120 else text[:117] + "..."
        extra = {k: v for k, v in samples[0].items() if k != "text"}
        note = f" ({', '.join(f'{k} {v}' for k, v in extra.items())})" if extra else ""
        out.append(f"- {reason}{note}: “{text}”")
    return out + [""]


def section_tokenizer(r: Run, img) -> list[str]:
    if not r.fertility:
        return []
    fa = r.fertility["corpora"]["all"]
    rows = [
        [
            r.base_name if n == "baseline" else "ours",
            f"{fa[n]['vocab_size']:,}",
            f"{fa[n]['tokens']:,}",
            f"{fa[n]['tokens_per_word']:.3f}",
            f"{fa[n]['bytes_per_token']:.3f}",
            f"{fa[n]['chars_per_token']:.3f}",
        ]
        for n in ("baseline", "ours")
    ]
    ratio = fa["ours"]["tokens_per_word"] / fa["baseline"]["tokens_per_word"]
    return (
        [
            "## 1. Tokenizer",
            "",
            "Fertility is tokens per whitespace-separated word: fewer tokens per word mean shorter sequences, more "
            "text per context window and per FLOP.",
            "",
        ]
        + _table(["tokenizer", "vocab", "tokens", "tokens/word", "bytes/token", "chars/token"], rows)
        + [
            f"On {fa['ours']['words']:,} words, {fa['ours']['bytes']:,} bytes of held-out text. "
            f"Fertility ours / baseline: **{ratio:.3f}**.",
            "",
        ]
        + img("fertility", "fertility")
    )


def _transfer_counts(s: Stage) -> str:
    """The vocabulary transfer's counts from its `vocab_transfer` records, as a sentence."""
    words = {
        "copied": "copied from the base",
        "averaged": "the mean of the base rows of their pieces",
        "special_mean": "at the mean row (specials the base lacks)",
    }
    parts = []
    for rec in s.all("vocab_transfer"):
        counts = ", ".join(f"{rec[k]:,} {w}" for k, w in words.items() if isinstance(rec.get(k), int))
        if counts:
            base = f" from the base's {rec['base_vocab']:,}" if isinstance(rec.get("base_vocab"), int) else ""
            parts.append(f"`{rec.get('tensor', 'embedding')}`, {_n(rec.get('new_vocab'))} rows{base}: {counts}")
    return "The transfer, as phase 1 logged it: " + "; ".join(parts) + "." if parts else ""


def section_pretraining(r: Run, img) -> list[str]:
    cpt = [r.stages[n] for n in CPT if n in r.stages]
    if not cpt:
        return []
    cfg = r.cfg
    lr = {n: s.last("config").get("lr", "–") for n, s in r.stages.items()}  # each run's own flags
    out = [
        "## 2. Pretraining: base, the two phases, and a control",
        "",
        "Phase 1 maps the base model's embeddings onto our vocabulary (a token the base vocabulary also has is "
        "copied; a new one is the mean of the base tokens it splits into) and trains only the embeddings; phase 2 "
        f"trains everything. The control trains the same model shape from random init with our tokenizer for "
        f"phase 1 + phase 2's {_n(cfg.get('control_steps'))} steps on the same data, every weight from the first "
        f"step: what the model reaches without the transfer. Peak learning rates: phase 1 {lr.get('phase1', '–')}, "
        f"phase 2 {lr.get('phase2', '–')}, control {lr.get('control', '–')}, each a warmup then a cosine over "
        "its own steps.",
        "",
    ]
    counts = _transfer_counts(r.stages["phase1"]) if "phase1" in r.stages else ""
    out += [counts, ""] if counts else []
    out += [
        "Train loss is drawn in bits per byte (loss in nats per token ÷ ln 2 ÷ the train text's bytes per token), "
        "so the panels share a unit despite the two tokenizers; val points at step 0 are the models before their "
        "first update.",
        "",
    ] + img("loss", "loss curves")
    rows = []
    for s in cpt:
        m, tps = s.last("model"), s.throughput()
        train = s.all("train")
        tokens_per_step = m.get("tokens_per_step") or cfg.get("global_batch", 0) * cfg.get("seq_len", 0)
        steps = train[-1]["step"] if train else None
        epochs = steps * tokens_per_step / s.shards.train["tokens"] if steps and s.shards else None
        bpt = s.shards.bytes_per_token() if s.shards else None
        rows.append(
            [
                s.label,
                _n(m.get("params")),
                _n(m.get("trainable")),
                _n(steps),
                _f(epochs, ".2f"),
                _f(train[-1]["loss"] if train else None),
                _f(s.val_bpb()),
                _f(tps, ",.0f"),
                _f(tps * bpt / 1e3 if tps and bpt else None, ",.1f"),
            ]
        )
    out += _table(
        [
            "stage",
            "params",
            "trainable",
            "steps",
            "epochs of train text",
            "last train loss (nats/token)",
            "val BPB",
            "tokens/s",
            "KB of text/s",
        ],
        rows,
    )
    return out + _train_vs_val(cpt)


def _train_vs_val(cpt: list[Stage]) -> list[str]:
    """Which stages end with train BPB below val BPB, and why that may be, from their numbers."""
    below, epochs = [], []
    for s in cpt:
        steps, bpb = s.train_bpb()
        if bpb and s.val_bpb() is not None and bpb[-1] < s.val_bpb():
            below.append(s.name)
        tokens_per_step = s.last("model").get("tokens_per_step")
        if steps and tokens_per_step and s.shards:
            epochs.append(steps[-1] * tokens_per_step / s.shards.train["tokens"])
    if not below:
        return []
    who = "every stage" if len(below) == len(cpt) else ", ".join(below)
    reread = f"; the longest stage read the train text {max(epochs):.1f} times" if epochs and max(epochs) > 1 else ""
    return [
        f"The last train BPB sits below val for {who}: the val text is another source (Firefox's "
        f"strings, not KDE's or MediaWiki's){reread}.",
        "",
    ]


def section_bpb(r: Run, img) -> list[str]:
    cpt = [r.stages[n] for n in CPT if n in r.stages and r.stages[n].val_bpb() is not None]
    if not cpt:
        return []
    out = [
        "## 3. Bits per byte before and after",
        "",
        "Each model is scored with its own tokenizer on the same validation bytes; bits per byte divides the total "
        "loss by the byte count, so it compares models whatever their tokenizers. Two references need no model: "
        "a **uniform** guess over the vocabulary, and the **unigram floor**, the train text's token frequencies "
        "alone (a model that ignores context). A good tokenizer lowers both; a trained model has to go below the "
        "floor to show it uses the context.",
        "",
    ] + img("bpb", "bits per byte")
    rows = []
    for s in cpt:
        ev, sh = s.evals[-1], s.shards
        rows.append(
            [
                s.label,
                _f(s.val_bpb(0)),
                _f(s.val_bpb()),
                _f(sh.unigram_bpb if sh else None),
                _f(s.val_bpb() - sh.unigram_bpb if sh and sh.unigram_bpb else None, "+.3f"),
                _f(ev.get("val_loss")),
                _n(ev.get("val_tokens")),
            ]
        )
    out += _table(
        [
            "model",
            "val BPB at step 0",
            "val BPB at the end",
            "unigram floor",
            "end − floor",
            "val loss (nats/token)",
            "tokens scored",
        ],
        rows,
    )
    out += [
        f"- **{s.label}**: {s.val_bpb():.3f}, " + against_floors(s.val_bpb(), s.shards) + "."
        for s in cpt
        if s.shards and s.shards.unigram_bpb
    ] + [""]
    return out + _phase_story(r) + _control_story(r) + _window_note(r)


def _phase_story(r: Run) -> list[str]:
    """What each phase did to val BPB, from its step-0 and last evals and the floor of our tokens."""
    p1, p2 = r.stages.get("phase1"), r.stages.get("phase2")
    if not (p1 and p1.shards and p1.shards.unigram_bpb and p1.val_bpb() is not None):
        return []
    uni, start, end = p1.shards.unigram_bpb, p1.val_bpb(0), p1.val_bpb()
    out = []
    if start is not None:
        out.append(
            f"The transfer alone (phase 1 at step 0, before any update) scores {start:.3f}, "
            f"{against_floors(start, p1.shards)}; {_n(steps_of(p1))} steps on the embeddings take it to "
            f"{end:.3f} ({end - start:+.3f})."
        )
    side = "still above" if end > uni else "below"
    out.append(f"Phase 1 ends {side} the unigram floor of our tokens ({uni:.3f}).")
    if p2 and p2.val_bpb() is not None:
        e2 = p2.val_bpb()
        out.append(
            f"Phase 2, every weight training, moves it by {e2 - end:+.3f} to {e2:.3f}, "
            + ("below the floor." if e2 < uni else "and it is still above the floor.")
        )
    return [" ".join(out), ""]


def _control_story(r: Run) -> list[str]:
    """The transferred model against the control at the same steps: what the transfer buys."""
    p1, p2, c = (r.stages.get(n) for n in ("phase1", "phase2", "control"))
    if not (p2 and c and p2.val_bpb() is not None and c.val_bpb() is not None):
        return []
    e2, ec = p2.val_bpb(), c.val_bpb()
    gap = abs(ec - e2) / max(ec, e2)
    out = [
        f"**What the transfer buys.** After {_n(steps_of(c))} steps on the same data, the transferred model "
        f"(phase 1 → phase 2) scores {e2:.3f} and the control {ec:.3f}: "
        + (
            f"the transfer is {ec - e2:.3f} bits per byte ({100 * gap:.1f}%) better."
            if e2 < ec
            else f"the control is {e2 - ec:.3f} bits per byte ({100 * gap:.1f}%) better, so at this scale the transfer "
            "does not pay."
        )
    ]
    if gap < SEED_NOISE:
        out.append(f"Each is one run of one seed: a gap under {100 * SEED_NOISE:.0f}% may not survive another seed.")
    at = steps_of(p1) if p1 else None
    c_at = c.val_bpb(at) if at else None
    if c_at is not None and p1.val_bpb() is not None:
        lead = "the control leads" if c_at < p1.val_bpb() else "phase 1 leads"
        out.append(
            f"After phase 1's {at} steps (embeddings only) {lead}: control {c_at:.3f}, phase 1 {p1.val_bpb():.3f}."
        )
    base = r.stages.get("base")
    if base:
        out.append(
            f"The transferred model also had the base's {_n(steps_of(base))} steps (on {r.base_name}'s "
            "tokens) behind it; a real base model brings far more."
        )
    return [" ".join(out), ""]


def _window_note(r: Run) -> list[str]:
    n = eval_window(r)
    if not n:
        return []
    ours, base = (r.stages.get(k) for k in ("phase2", "base"))
    reach = [
        f"{n * s.shards.bytes_per_token('val'):.0f} bytes of val text with {who}"
        for s, who in ((ours, "our tokens"), (base, f"{r.base_name}'s"))
        if s and s.shards and s.shards.bytes_per_token("val")
    ]
    same = " (the training sequence length)" if n == r.cfg.get("seq_len") else ""
    return [
        f"**The eval window.** BPB is measured on consecutive windows of **{n} tokens** of the val stream{same}: "
        "a token is predicted from at most the tokens before it in its window, so BPB depends on the window "
        "length. A longer window gives more context only up to the length the model was trained at; past it the "
        "positions are new to the model and BPB can rise (the demo's models, trained at 128, score a little higher "
        "at 1,024). Compare these numbers only with numbers measured in the same window. "
        f"{n} tokens span "
        + " and ".join(reach or ["–"])
        + " (on average): at one window length, a tokenizer with longer tokens also gives its model more context.",
        "",
    ]


def section_throughput(r: Run, img) -> list[str]:
    p2, base = r.stages.get("phase2"), r.stages.get("base")
    out = img("throughput", "throughput")
    if p2 and base and p2.throughput() and base.throughput() and p2.shards and base.shards:
        ratio = (p2.throughput() * p2.shards.bytes_per_token()) / (base.throughput() * base.shards.bytes_per_token())
        out += [
            f"Per second of CPU, phase 2 reads {ratio:.0f}x as much text as the base model: its tokens are "
            f"longer and its {p2.shards.vocab_size:,}-row embedding is cheap next to a "
            f"{base.shards.vocab_size:,}-row one.",
            "",
        ]
    return out


def section_finetune(r: Run) -> list[str]:
    ft = r.finetune
    if not ft:
        return []
    m, d, ev, train = ft.last("model"), ft.last("data"), ft.evals, ft.all("finetune")
    flags = ft.last("config")  # the LoRA shape is in the run's flags; older scripts put it in the model record
    r_ = flags.get("lora_r", m.get("lora_r", m.get("r", "–")))
    alpha = flags.get("lora_alpha", m.get("lora_alpha", m.get("alpha", "–")))
    val = (
        f"Val loss {ev[0]['val_loss']:.3f} (step {ev[0]['step']}) → {ev[-1]['val_loss']:.3f} nats per assistant "
        f"token over {train[-1]['step'] if train else 0} steps."
        if len(ev) >= 2
        else ""
    )
    return [
        "## 4. Chat fine-tune (LoRA)",
        "",
        f"LoRA r={r_}, alpha={alpha} on {m.get('targets', '–').replace(',', ', ')}: {_n(m.get('trainable'))} "
        f"trainable of {_n(m.get('params'))} parameters ({m.get('trainable_pct', '–')}%). {_n(d.get('train'))} "
        f"train and {_n(d.get('val'))} val conversations of `data/chat`; the loss is on the assistant's tokens "
        f"only (its panel in the loss plot is in nats per assistant token, not BPB). {val}",
        "",
    ]


def section_samples(r: Run) -> list[str]:
    if not r.samples:
        return []
    out = [
        "### Samples",
        "",
        "From the phase 2 model with the adapter (`finetune.py --adapter ... --prompt`). A model of a few million "
        "parameters trained for minutes on half a megabyte does not answer questions: these show the pipeline end "
        "to end (chat template, adapter, sampling), not fluency. Its replies can look alike for different prompts: "
        "it puts most of its probability on the corpus's most frequent tokens whatever it is asked "
        "(tests/test_finetune.py checks that two prompts do give different next-token distributions).",
        "",
    ]
    for s in r.samples:
        seed = f" (seed {s['seed']})" if "seed" in s else ""
        out += [f"**user:** {s['prompt']}", "", f"**assistant{seed}:** " + (s["reply"] or "*(empty)*"), ""]
    return out


def section_commands(r: Run) -> list[str]:
    stages = r.meta.get("stages", [])
    if not stages:
        return []
    lines = [s["command"] if isinstance(s["command"], str) else shlex.join(s["command"]) for s in stages]
    return (
        ["## Commands", "", "Run from the repository root (their logs are in `logs/`):", "", "```"]
        + [f"$ {c}" for c in lines]
        + ["```", ""]
    )


# ---------------------------------------------------------------- the report


def write_report(run: str) -> str:
    """Write `run/report.md` and its PNGs; returns the report's path."""
    from demo import plots

    r = load_run(run)
    drawn = plots.draw_all(r)  # None without matplotlib
    no_plots, drawn = drawn is None, drawn or {}

    def img(key: str, alt: str) -> list[str]:
        return [f"![{alt}]({drawn[key]})", ""] if key in drawn else []

    lines = [f"# minilm-az demo: `{r.meta.get('name', os.path.basename(run))}`", ""] + section_summary(r)
    if no_plots:
        lines += [
            "> matplotlib is not installed, so this report has no plots: `pip install -e '.[report]'` and "
            f"`python -m demo.report {run}` to add them.",
            "",
        ]
    for section in (
        section_setup(r),
        section_clean(r),
        section_tokenizer(r, img),
        section_pretraining(r, img),
        section_bpb(r, img),
        section_throughput(r, img),
        section_finetune(r),
        section_samples(r),
        section_commands(r),
    ):
        lines += section
    path = os.path.join(run, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print("usage: python -m demo.report RUN_DIR", file=sys.stderr)
        sys.exit(2)
    print(write_report(sys.argv[1]))
