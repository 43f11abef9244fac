"""The demo as CI runs it: the stages and root scripts of `make demo`, with a few steps each (demo.run.QUICK).

One run backs the end-to-end tests here; each checks what a reader of the report is told. The report's
wording and plots are also checked on hand-made records, without a run.
"""

import json
import math
import os
import re
import shlex
import shutil
import sys
from collections import Counter

import numpy as np
import pytest

from demo import plots, report
from demo import run as demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def last_eval(run, stage):
    return [r for r in read_jsonl(os.path.join(run, stage, "metrics.jsonl")) if r["kind"] == "eval"][-1]


@pytest.fixture(scope="module")
def run(quick_demo):
    return quick_demo  # conftest's one quick run, which the README's test reads too


# ---------------------------------------------------------------- the quick demo, end to end


@pytest.mark.slow
def test_demo_writes_the_report_with_its_plots(run):
    text = read(os.path.join(run, "report.md"))
    for section in (
        "## 1. Tokenizer",
        "## 2. Pretraining",
        "## 3. Bits per byte",
        "## 4. Chat fine-tune",
        "### Samples",
        "stand-in",
        "## Commands",
    ):
        assert section in text
    pytest.importorskip("matplotlib")
    for png in ("fertility.png", "loss.png", "bpb.png", "throughput.png"):
        assert os.path.getsize(os.path.join(run, png)) > 10_000, png
        assert f"]({png})" in text


@pytest.mark.slow
def test_phase2_bits_per_byte_beat_the_base_model_on_the_same_bytes(run):
    evals = {s: last_eval(run, s) for s in ("base", "phase1", "phase2")}
    base_val = json.loads(read(os.path.join(run, "shards_baseline", "index.json")))["splits"]["val"]
    our_val = json.loads(read(os.path.join(run, "shards", "index.json")))["splits"]["val"]
    assert base_val["bytes"] == our_val["bytes"] and base_val["tokens"] > our_val["tokens"]
    assert evals["phase2"]["val_bpb"] < evals["base"]["val_bpb"]
    assert evals["phase2"]["val_bpb"] <= evals["phase1"]["val_bpb"]
    assert f"{evals['phase2']['val_bpb']:.3f} (phase 2)" in read(os.path.join(run, "report.md"))


@pytest.mark.slow
def test_the_control_trains_from_random_init_for_both_phases_steps_and_has_its_row(run):
    control = read_jsonl(os.path.join(run, "control", "metrics.jsonl"))
    assert [r["step"] for r in control if r["kind"] == "train"][-1] == demo.QUICK.phase1_steps + demo.QUICK.phase2_steps
    argv = next(s["argv"] for s in json.loads(read(os.path.join(run, "demo.json")))["stages"] if s["name"] == "control")
    assert "--base-model" not in argv and argv[argv.index("--data") + 1] == os.path.join(run, "shards")
    assert argv[argv.index("--lr") + 1] == str(demo.QUICK.phase2_lr)  # phase 2's schedule, over both phases' steps
    bpb = last_eval(run, "control")["val_bpb"]
    text = read(os.path.join(run, "report.md"))
    assert re.search(rf"\| control: random init \|[^\n]*\| {bpb:.3f} \|", text)
    assert f"the control {bpb:.3f}" in text


def unigram_floor(shards_dir):
    """Bits per byte of the val split under add-0.5 train-split frequencies, computed here independently."""
    index = json.loads(read(os.path.join(shards_dir, "index.json")))
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    tokens = {
        s: np.concatenate(
            [np.fromfile(os.path.join(shards_dir, f["file"]), dtype) for f in index["splits"][s]["shards"]]
        )
        for s in ("train", "val")
    }
    counts = Counter(tokens["train"].tolist())
    total = len(tokens["train"]) + 0.5 * (int(max(tokens["train"].max(), tokens["val"].max())) + 1)
    bits = -sum(math.log2((counts[t] + 0.5) / total) for t in tokens["val"].tolist())
    return bits / index["splits"]["val"]["bytes"]


@pytest.mark.slow
def test_every_pretraining_stage_is_commented_against_its_unigram_floor(run):
    text = read(os.path.join(run, "report.md"))
    floors = {
        "shards": unigram_floor(os.path.join(run, "shards")),
        "shards_baseline": unigram_floor(os.path.join(run, "shards_baseline")),
    }
    for stage, label in (
        ("base", "base (Llama-3 tokenizer)"),
        ("phase1", "phase 1: embeddings"),
        ("phase2", "phase 2: everything"),
        ("control", "control: random init"),
    ):
        bpb, floor = last_eval(run, stage)["val_bpb"], floors["shards_baseline" if stage == "base" else "shards"]
        line = next(ln for ln in text.splitlines() if ln.startswith(f"- **{label}**: {bpb:.3f}"))
        assert f"unigram floor ({floor:.3f})" in line, line
        assert ("**above**" in line) == (bpb > floor), line


@pytest.mark.slow
def test_the_report_states_the_eval_window_and_every_step0_bpb(run):
    text = read(os.path.join(run, "report.md"))
    assert f"windows of **{demo.QUICK.seq_len} tokens**" in text
    assert "depends on the window length" in text
    for stage in ("base", "phase1", "phase2", "control"):
        evals = [r for r in read_jsonl(os.path.join(run, stage, "metrics.jsonl")) if r["kind"] == "eval"]
        assert evals[0]["step"] == 0, stage  # train.py scores the model before its first update
        bpb_section = text[text.index("## 3. Bits per byte") :]
        label = report.LABELS[stage].format(base="Llama-3")
        row = next(ln for ln in bpb_section.splitlines() if ln.startswith(f"| {label} |"))
        assert row.split(" | ")[1] == f"{evals[0]['val_bpb']:.3f}", row


@pytest.mark.slow
def test_logged_and_reported_commands_are_shell_quoted_and_round_trip(run):
    meta = json.loads(read(os.path.join(run, "demo.json")))
    text = read(os.path.join(run, "report.md"))
    for stage in meta["stages"]:
        assert read(os.path.join(run, stage["log"])).splitlines()[0] == "$ " + stage["command"]
        assert f"$ {stage['command']}\n" in text
        assert len(shlex.split(stage["command"])) == len(stage["argv"]), stage["command"]  # one word per argument
    words = shlex.split(next(s["command"] for s in meta["stages"] if s["name"] == "sample1"))
    assert words[words.index("--prompt") + 1] == demo.QUICK.prompts[0]  # a prompt with spaces stays one argument


@pytest.mark.slow
def test_the_report_is_the_same_without_the_logs(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("logs", "*.png", "report.md"))
    assert read(report.write_report(str(copy))) == read(os.path.join(run, "report.md"))


@pytest.mark.slow
def test_our_tokenizer_needs_fewer_tokens_per_word_than_the_baseline(run):
    rows = json.loads(read(os.path.join(run, "tokenizer_report.json")))["corpora"]["all"]
    assert rows["ours"]["tokens_per_word"] < rows["baseline"]["tokens_per_word"]
    assert rows["ours"]["vocab_size"] == demo.QUICK.vocab_size and rows["baseline"]["vocab_size"] > 100_000


@pytest.mark.slow
def test_finetune_leaves_an_adapter_and_replies(run):
    assert os.path.isfile(os.path.join(run, "finetune", "adapter_model.safetensors"))
    samples = read_jsonl(os.path.join(run, "samples.jsonl"))
    assert [s["prompt"] for s in samples] == list(demo.QUICK.prompts)
    assert all(s["reply"] and not s["reply"].startswith("#") for s in samples)  # stdout only, no stderr banner
    assert [s["seed"] for s in samples] == [demo.QUICK.seed + i for i in range(len(samples))]  # a seed per prompt
    report = read(os.path.join(run, "report.md"))
    assert f"**assistant (seed {demo.QUICK.seed}):**" in report and "replies can look alike" in report
    assert f"LoRA r={demo.QUICK.ft_r}, alpha={float(demo.QUICK.ft_alpha)} on q_proj" in read(
        os.path.join(run, "report.md")
    )


@pytest.mark.slow
def test_the_report_gives_the_vocab_transfer_counts_phase1_logged(run):
    rec = next(r for r in read_jsonl(os.path.join(run, "phase1", "metrics.jsonl")) if r["kind"] == "vocab_transfer")
    line = next(ln for ln in read(os.path.join(run, "report.md")).splitlines() if ln.startswith("The transfer, as"))
    assert rec["copied"] + rec["averaged"] + rec["special_mean"] == demo.QUICK.vocab_size
    assert f"{rec['copied']:,} copied" in line and f"{rec['averaged']:,} the mean" in line, line


@pytest.mark.slow
def test_each_stage_keeps_its_export_but_not_its_resume_checkpoint(run):
    for stage in ("base", "phase1", "phase2", "control"):
        assert os.path.isfile(os.path.join(run, stage, "model.safetensors")), stage
        assert not os.path.exists(os.path.join(run, stage, "checkpoints")), stage


@pytest.mark.slow
def test_torchrun_leaves_nothing_in_the_temp_dir_and_only_a_failures_files_in_logs(run):
    # torchrun's per-job folders went to the system's temp dir, empty, and stayed there (audit 5): --log-dir in
    # logs/ instead, whose empty folders the demo removes after each stage.
    left = os.listdir(os.path.join(os.path.dirname(run), "tmp"))
    assert not [n for n in left if n.startswith("torchelastic_")], left
    assert not [n for n in os.listdir(os.path.join(run, "logs")) if n.endswith(".torchrun")]
    with open(os.path.join(run, demo.MARKER), encoding="utf-8") as f:
        commands = [s["command"] for s in json.load(f)["stages"] if "torch.distributed.run" in s["command"]]
    assert len(commands) == 5 and all(f"--log-dir {run}/logs/" in c for c in commands), commands


# ---------------------------------------------------------------- no run needed


def test_a_rerun_replaces_a_demo_dir_but_not_anything_else(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a demo run"):
        demo.prepare_run_dir(str(mine))
    old = tmp_path / "old"
    old.mkdir()
    (old / demo.MARKER).write_text('{"entries": ["stale.txt", "demo.json"]}')
    (old / "stale.txt").write_text("")
    demo.prepare_run_dir(str(old))
    assert sorted(os.listdir(old)) == ["logs"]
    for text in ("{}", "{not json", "[1, 2]", '{"entries": "notes.txt"}'):  # what it wrote is not said: left alone
        (old / demo.MARKER).write_text(text)
        with pytest.raises(SystemExit, match="does not list what the demo wrote"):
            demo.prepare_run_dir(str(old))
        assert sorted(os.listdir(old)) == [demo.MARKER, "logs"]
    assert (mine / "notes.txt").read_text() == "keep me"


def test_a_silent_stage_still_puts_a_line_on_the_console_and_eval_progress_is_shown(tmp_path, capsys, monkeypatch):
    # A stage that prints nothing the console shows for a while (a long eval, a model being built) still gets a
    # line from the runner, with the newest log line; eval_progress lines go to the console as they come.
    monkeypatch.setattr(demo.Runner, "QUIET_S", 0.5)
    (tmp_path / "logs").mkdir()
    code = (
        "import time; print('model params=1', flush=True); print('a line only the log shows', flush=True); "
        "time.sleep(3); print('eval_progress step=0 done=1 total=2 eta=0:00:01', flush=True)"
    )
    demo.Runner(str(tmp_path), verbose=False)("quiet", "a stage that says little", [sys.executable, "-c", code])
    out = capsys.readouterr().out
    assert "    model params=1\n" in out
    assert re.search(r"^    \.\.\. quiet running for \d+ s; log: a line only the log shows$", out, re.M), out
    assert "    eval_progress step=0 done=1 total=2" in out
    assert "a line only the log shows" in open(tmp_path / "logs" / "01_quiet.log", encoding="utf-8").read()


def test_a_shell_line_quotes_spaces_and_shortens_repo_paths():
    line = demo.shell_line(["python3", os.path.join(ROOT, "train.py"), "--prompt", "Çay necə?", "/elsewhere/x"])
    assert line == "python3 train.py --prompt 'Çay necə?' /elsewhere/x"


def test_floor_wording_follows_the_numbers():
    s = report.Shards({}, {}, 8000, uniform_bpb=2.6, unigram_bpb=2.35)
    assert "0.350 **above** the unigram floor (2.350) and even 0.100 above the uniform" in report.against_floors(2.7, s)
    between = report.against_floors(2.447, s)
    assert "0.097 **above** the unigram floor (2.350)" in between and "0.153 better than a uniform" in between
    assert report.against_floors(2.1, s).startswith("0.250 below the unigram floor (2.350)")


def test_loss_plot_titles_units_and_step0_points(tmp_path):
    plt = plots._plt()
    if plt is None:
        pytest.skip("needs matplotlib")
    shards = report.Shards({"tokens": 100, "bytes": 500}, {"tokens": 10, "bytes": 50}, 8000, 2.6, 2.35)
    recs = [
        {"kind": "eval", "step": 0, "val_bpb": 2.6},
        {"kind": "train", "step": 5, "loss": 7.0},
        {"kind": "eval", "step": 5, "val_bpb": 2.4},
    ]
    r = report.Run(
        str(tmp_path),
        {},
        "Llama-3",
        None,
        stages={n: report.Stage(n, report.LABELS[n], recs, shards) for n in ("base", "phase1", "control")},
        finetune=report.Stage(
            "finetune",
            "LoRA",
            [{"kind": "finetune", "step": 1, "loss": 7.9}, {"kind": "eval", "step": 0, "val_loss": 8.0}],
        ),
    )
    fig = plots.plot_losses(plt, r)
    axes = fig.axes
    assert [a.get_title() for a in axes] == [
        "base: Llama-3 tokenizer, random init",
        "our tokenizer: transfer (phase 1 → 2) vs control",
        "LoRA chat fine-tune",
    ]
    assert all(a.get_xlabel().startswith("optimizer step") for a in axes)
    assert "bits per byte" in axes[0].get_ylabel() and "nats per assistant token" in axes[2].get_ylabel()
    for ax in axes:
        vals = [ln for ln in ax.get_lines() if ln.get_label().endswith("val")]
        assert vals and all(0 in list(ln.get_xdata()) for ln in vals), ax.get_title()
    plt.close(fig)
