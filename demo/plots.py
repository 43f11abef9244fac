"""The demo report's PNGs, from a loaded run (demo/report.py's `Run`): fertility, loss, bpb, throughput."""

from __future__ import annotations

import os

COLORS = {
    "base": "#8c8c8c",
    "phase1": "#6baed6",
    "phase2": "#08519c",
    "control": "#d62728",
    "finetune": "#e6550d",
    "ours": "#08519c",
    "baseline": "#8c8c8c",
}


def _plt():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "font.size": 10,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "figure.dpi": 110,
        }
    )
    return plt


def draw_all(r) -> dict[str, str] | None:
    """Draw every plot the run has data for into the run dir; {key: file name}, or None without matplotlib."""
    plt = _plt()
    if plt is None:
        return None
    cpt = list(r.stages.values())
    todo = {
        "fertility": (plot_fertility, r.fertility),
        "loss": (plot_losses, cpt or r.finetune),
        "bpb": (plot_bpb, any(s.val_bpb() is not None for s in cpt)),
        "throughput": (plot_throughput, any(s.throughput() for s in cpt)),
    }
    drawn = {}
    for key, (fn, has_data) in todo.items():
        if has_data:
            fig = fn(plt, r)
            fig.tight_layout()
            fig.savefig(os.path.join(r.path, f"{key}.png"))
            plt.close(fig)
            drawn[key] = f"{key}.png"
    return drawn


def _bar_labels(ax, bars, fmt, inside: bool = False):
    for b in bars:
        h = b.get_height()
        if inside:  # in the bar's middle, clear of reference lines drawn across the top
            ax.annotate(
                fmt(h),
                (b.get_x() + b.get_width() / 2, h / 2),
                ha="center",
                va="center",
                fontsize=11,
                color="white",
                fontweight="bold",
            )
        else:
            ax.annotate(
                fmt(h),
                (b.get_x() + b.get_width() / 2, h),
                ha="center",
                va="bottom",
                fontsize=9,
                xytext=(0, 2),
                textcoords="offset points",
            )


def _wrap(label: str) -> str:
    return label.replace(": ", ":\n").replace(" (", "\n(")


def plot_fertility(plt, r):
    rows = r.fertility["corpora"]["all"]
    names = [("baseline", r.base_name), ("ours", "ours")]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for ax, key, title, unit in (
        (axes[0], "tokens_per_word", "fertility (lower is better)", "tokens per word"),
        (axes[1], "bytes_per_token", "token length (higher is better)", "bytes per token"),
    ):
        labels = [f"{lab}\n{rows[n]['vocab_size']:,} ids" for n, lab in names]
        bars = ax.bar(labels, [rows[n][key] for n, _ in names], color=[COLORS[n] for n, _ in names], width=0.55)
        _bar_labels(ax, bars, lambda v: f"{v:.2f}")
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.grid(axis="x", visible=False)
        ax.set_ylim(0, max(rows[n][key] for n, _ in names) * 1.18)
    fig.suptitle(f"Tokenizers on held-out Azerbaijani text ({r.val_label})")
    return fig


def _curves(ax, s, color: str, offset: int = 0, label: str = "") -> None:
    """One stage's train BPB (a line) and val BPB (points, step 0 included), `offset` steps to the right."""
    steps, bpb = s.train_bpb()
    ax.plot([x + offset for x in steps], bpb, color=color, lw=1.4, label=f"{label}train".strip())
    ev = [e for e in s.evals if "val_bpb" in e]
    ax.plot(
        [e["step"] + offset for e in ev],
        [e["val_bpb"] for e in ev],
        "o--",
        color=color,
        mec="black",
        mew=0.6,
        ms=4.5,
        lw=0.8,
        label=f"{label}val".strip(),
    )


def _floors(ax, shards) -> None:
    if shards and shards.unigram_bpb:
        ax.axhline(shards.unigram_bpb, color="black", ls=":", lw=1.2, label=f"unigram floor {shards.unigram_bpb:.2f}")


def plot_losses(plt, r):
    """Base | our tokenizer (phase 1 → phase 2, and the control) | LoRA, each with its own title, axes and unit."""
    st = r.stages
    panels = [
        p
        for p, ok in (
            ("base", "base" in st),
            ("ours", any(n in st for n in ("phase1", "phase2", "control"))),
            ("lora", r.finetune is not None),
        )
        if ok
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.0), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "base":
            _curves(ax, st["base"], COLORS["base"])
            _floors(ax, st["base"].shards)
            ax.set_title(f"base: {r.base_name} tokenizer, random init")
        elif panel == "ours":
            p1 = st.get("phase1")
            p1_steps = p1.all("train")[-1]["step"] if p1 and p1.all("train") else 0
            for name, offset, label in (
                ("phase1", 0, "phase 1 "),
                ("phase2", p1_steps, "phase 2 "),
                ("control", 0, "control "),
            ):
                if name in st:
                    _curves(ax, st[name], COLORS[name], offset, label)
            if p1_steps and "phase2" in st:
                ax.axvline(p1_steps, color="#bbbbbb", lw=0.8)
            _floors(ax, next((st[n].shards for n in ("phase2", "phase1", "control") if n in st), None))
            ax.set_title("our tokenizer: transfer (phase 1 → 2) vs control")
        else:
            ft = r.finetune
            train = ft.all("finetune")
            ax.plot(
                [x["step"] for x in train], [x["loss"] for x in train], color=COLORS["finetune"], lw=1.4, label="train"
            )
            ax.plot(
                [e["step"] for e in ft.evals],
                [e["val_loss"] for e in ft.evals],
                "o--",
                color=COLORS["finetune"],
                mec="black",
                mew=0.6,
                ms=4.5,
                lw=0.8,
                label="val",
            )
            ax.set_title("LoRA chat fine-tune")
            ax.set_ylabel("loss (nats per assistant token)")
        if panel != "lora":
            ax.set_ylabel("bits per byte (train: from the loss)")
        ax.set_xlabel("optimizer step" + (" (with our tokenizer)" if panel == "ours" else ""))
        ax.legend(fontsize=7)
    fig.suptitle("Loss per stage: val points at step 0 are the models before any update")
    return fig


def plot_bpb(plt, r):
    rows = [s for s in r.stages.values() if s.val_bpb() is not None]
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    bars = ax.bar(
        [_wrap(s.label) for s in rows], [s.val_bpb() for s in rows], color=[COLORS[s.name] for s in rows], width=0.55
    )
    _bar_labels(ax, bars, lambda v: f"{v:.3f}", inside=True)
    for name, style, who in (("base", ":", f"{r.base_name} tokens"), ("phase2", "--", "our tokens")):
        sh = r.stages[name].shards if name in r.stages else None
        if sh and sh.unigram_bpb:
            ax.axhline(
                sh.unigram_bpb,
                color=COLORS[name],
                ls=style,
                lw=1.2,
                label=f"unigram floor of {who}: {sh.unigram_bpb:.2f}",
            )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right", title="no model, for reference", title_fontsize=8)
    ax.set_ylabel("val bits per byte (lower is better)")
    ax.set_title(f"Validation bits per byte on {r.val_label}\n(the same bytes for every model)", fontsize=10)
    ax.grid(axis="x", visible=False)
    ax.set_ylim(0, max(b.get_height() for b in bars) * 1.35)
    return fig


def plot_throughput(plt, r):
    rows = [s for s in r.stages.values() if s.throughput() and s.shards]
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6))
    labels, colors = [_wrap(s.label) for s in rows], [COLORS[s.name] for s in rows]
    for ax, values, title, unit, fmt in (
        (axes[0], [s.throughput() for s in rows], "training tokens per second", "tokens/s", "{:,.0f}"),
        (
            axes[1],
            [s.throughput() * s.shards.bytes_per_token() / 1e3 for s in rows],
            "training text per second",
            "KB/s",
            "{:,.1f}",
        ),
    ):
        bars = ax.bar(labels, values, color=colors, width=0.55)
        _bar_labels(ax, bars, fmt.format)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.grid(axis="x", visible=False)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    fig.suptitle(f"Throughput on CPU ({r.cfg.get('procs', '?')} processes, 1 thread each)")
    return fig
