"""finetune.py end to end, as a user runs it: adapter loaded by peft, --merge loaded by transformers,
torchrun on 2 processes equal to 1, bad input refused with the file named, and --prompt."""

import json
import os
import signal
import sys

import prefork  # tests/prefork.py (pytest puts this folder on sys.path too)
import pytest
import torch

import finetune  # the root script (pytest puts the repo root on sys.path)
from minilm_az.generate import generate
from minilm_az.hf import load_pretrained, save_pretrained
from minilm_az.lora import load_adapter
from minilm_az.model import ModelConfig, build_model, get_preset
from minilm_az.tokenizer import copy_tokenizer_files, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN, VAL = os.path.join(ROOT, "data/chat/az_chat.jsonl"), os.path.join(ROOT, "data/chat/az_chat_val.jsonl")
ARGS = [
    "--data",
    TRAIN,
    "--val-data",
    VAL,
    "--steps",
    "4",
    "--global-batch",
    "8",
    "--micro-batch",
    "2",
    "--lora-r",
    "8",
    "--lora-dropout",
    "0",
    "--lr",
    "3e-3",
    "--warmup",
    "1",
    "--log-every",
    "1",
    "--eval-every",
    "2",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def _run(cmd, env=ENV):
    """`cmd` to its end, as a fork of an interpreter that imported torch once where it is `python finetune.py ...`
    (tests/prefork.py), else (torchrun) as a subprocess."""
    r = prefork.run(cmd, ROOT, env, 240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def _records(out, kind):
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="module")
def base(tmp_path_factory, small_tokenizer_dir):
    """A tiny random Llama saved with save_pretrained, with a 600-token tokenizer beside it."""
    d = str(tmp_path_factory.mktemp("base"))
    copy_tokenizer_files(small_tokenizer_dir, d)
    tok = load_tokenizer(d)
    save_pretrained(build_model(get_preset("tiny", vocab_size=tok.get_vocab_size()), seed=0), d)
    return d


@pytest.fixture(scope="module")
def run1(base, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft1"))
    _run([sys.executable, "finetune.py", "--model", base, "--out", out, "--merge", "true", *ARGS])
    return out


def _ids(V):
    return torch.randint(0, V, (2, 21), generator=torch.Generator().manual_seed(3))


def test_adapter_loads_in_peft_with_our_logits(base, run1):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(run1))
    assert json.load(open(os.path.join(run1, "adapter_config.json")))["r"] == 8
    ours = load_pretrained(base).eval()
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        before = ours(ids)
        load_adapter(ours, run1)
        ours.eval()
        after = ours(ids)
        pm = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), run1).eval()
        theirs = pm(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-4  # training moved B off zero
    assert (after - theirs).abs().max() <= 1e-5


def test_merged_export_loads_in_transformers_with_adapter_logits(base, run1):
    transformers = pytest.importorskip("transformers")
    ours = load_pretrained(base)
    load_adapter(ours, run1)
    ours.eval()
    merged = transformers.LlamaForCausalLM.from_pretrained(os.path.join(run1, "merged")).eval()
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - ours(ids)).abs().max() <= 1e-5
    assert os.path.isfile(os.path.join(run1, "merged", "tokenizer.json"))


def test_log_has_loss_lr_throughput_and_val_loss_falls(run1):
    train = _records(run1, "finetune")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 and "eta" in r for r in train)
    evals = _records(run1, "eval")
    assert [r["step"] for r in evals] == [0, 2, 4] and evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_torchrun_two_processes_equal_one(base, run1, tmp_path):
    out = str(tmp_path / "sft2")
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "finetune.py",
            "--model",
            base,
            "--out",
            out,
            *ARGS,
        ]
    )
    one, two = _records(run1, "finetune"), _records(out, "finetune")
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a, b)
    assert abs(_records(run1, "eval")[-1]["val_loss"] - _records(out, "eval")[-1]["val_loss"]) < 1e-4
    from safetensors.torch import load_file

    wa, wb = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (run1, out))
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_bad_data_names_file_and_line_or_is_skipped(base, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    good = open(TRAIN, encoding="utf-8").readline()
    bad.write_text(good * 10 + '{"messages": [{"role": "robot", "content": "salam"}]}\n', encoding="utf-8")
    common = [
        "--model",
        base,
        "--data",
        str(bad),
        "--val-fraction",
        "0",
        "--steps",
        "1",
        "--global-batch",
        "2",
        "--micro-batch",
        "2",
        "--lora-r",
        "2",
        "--out",
        str(tmp_path / "o"),
    ]
    assert finetune.main(common) == 2
    assert "bad.jsonl:11: message 0: unknown role 'robot'" in capsys.readouterr().err
    assert finetune.main(common + ["--on-bad-line", "skip"]) == 0
    assert "skipped_bad_lines=1" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a flag error comes from the parser, before any work
        finetune.main(common + ["--global-batch", "3"])
    assert e.value.code == 2
    assert "not a multiple of --micro-batch" in capsys.readouterr().err


def test_adapter_for_another_base_is_refused(base, run1, tmp_path, capsys):
    other = str(tmp_path / "other")
    cfg = ModelConfig(
        **{**get_preset("tiny", vocab_size=load_tokenizer(base).get_vocab_size()).to_dict(), "ffn_dim": 256}
    )
    save_pretrained(build_model(cfg), other)
    copy_tokenizer_files(base, other)  # the same tokenizer: what differs is the model the adapter was made on
    assert finetune.main(["--model", other, "--adapter", run1, "--prompt", "Salam"]) == 2
    assert "different base model" in capsys.readouterr().err


def test_prompt_mode_replies_like_generate(base, run1, capsys):
    assert (
        finetune.main(
            ["--model", base, "--adapter", run1, "--prompt", "Salam!", "--max-new-tokens", "6", "--temperature", "0"]
        )
        == 0
    )
    reply = capsys.readouterr().out.rstrip("\n")
    model = load_pretrained(base)
    load_adapter(model, run1)
    want = generate(model, load_tokenizer(base), [{"role": "user", "content": "Salam!"}], 6, temperature=0)
    assert reply == want


def test_flags_accept_sagemaker_strings_and_channels(monkeypatch, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.setenv("SM_CHANNEL_MODEL", str(model))
    monkeypatch.setenv("SM_CHANNEL_DATA", "/opt/ml/input/data/data")
    monkeypatch.setenv("SM_CHANNEL_VAL_DATA", "/opt/ml/input/data/val_data")
    monkeypatch.setenv("SM_MODEL_DIR", "/opt/ml/model")
    a = finetune.parse_args(["--merge", "false", "--liger", "True", "--last-turn-only", "--no-compile"])
    assert (a.model, a.data, a.val_data, a.out) == (
        str(model),
        "/opt/ml/input/data/data",
        "/opt/ml/input/data/val_data",
        "/opt/ml/model",
    )
    assert a.merge is False and a.liger is True and a.last_turn_only is True and a.compile is False
    assert (a.lora_r, a.lora_alpha, a.lora_dropout, a.max_seq_len) == (64, 28, 0.05, 1024)
    with pytest.raises(SystemExit):
        finetune.parse_args(["--merge", "maybe"])


def test_data_directory_layout_is_explicit_and_every_match_is_used(tmp_path):
    from minilm_az.prep.chat_data import chat_files

    d = tmp_path / "d"
    d.mkdir()
    for name in ("train_a.jsonl", "train_b.jsonl", "val1.jsonl", "val2.jsonl", "part_b_values.jsonl", "notes.txt"):
        (d / name).write_text("")
    train, val = chat_files(str(d), None)
    assert train == [str(d / "train_a.jsonl"), str(d / "train_b.jsonl")]  # train* wins over other *.jsonl
    assert val == [str(d / "val1.jsonl"), str(d / "val2.jsonl")]  # every val file; "_values" is not one
    (d / "train_a.jsonl").unlink()
    (d / "train_b.jsonl").unlink()
    (d / "az_chat_val.jsonl").write_text("")
    train, val = chat_files(str(d), None)
    assert train == [str(d / "part_b_values.jsonl")]
    assert val == [str(d / "az_chat_val.jsonl"), str(d / "val1.jsonl"), str(d / "val2.jsonl")]
    v = tmp_path / "v"  # a --val-data directory (a SageMaker channel): all of its .jsonl validate
    v.mkdir()
    (v / "anything.jsonl").write_text("")
    assert chat_files(str(d), str(v))[1] == [str(v / "anything.jsonl")]
    with pytest.raises(FileNotFoundError, match="chat data not found"):
        chat_files(str(tmp_path / "x.jsonl"), None)


def test_a_killed_finetune_resumes_to_the_same_adapter_from_a_local_dir_and_from_s3(base, tmp_path):
    """A spot interruption: SIGKILL once step 5 is logged, then the same command (--resume auto, the default). The
    adapter equals an uninterrupted run's, with dropout on (each rank's RNG is in the checkpoint): with the
    checkpoints beside the output, and with `--checkpoint-dir s3://…` on a local S3 server (issue 37)."""
    from safetensors.torch import load_file

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from s3_server import S3Server

    args = [*ARGS, "--steps", "8", "--lora-dropout", "0.1", "--checkpoint-every", "2", "--eval-every", "4"]
    whole = str(tmp_path / "whole")
    _run([sys.executable, "finetune.py", "--model", base, "--out", whole, *args])
    s3 = S3Server.start(tmp_path / "s3server")
    try:
        s3.make_bucket("finetune-ckpt")
        env = {**ENV, **s3.env()}
        for where, extra in (("local", []), ("s3", ["--checkpoint-dir", "s3://finetune-ckpt/run/"])):
            out = str(tmp_path / f"killed-{where}")
            cmd = [sys.executable, "finetune.py", "--model", base, "--out", out, *args, *extra]
            # SIGKILL once step 5 is logged (a line of its own: stdout's first line is never a step's)
            k = prefork.run(cmd, ROOT, env, 240, "\nfinetune step=5 ", lambda pid: os.kill(pid, signal.SIGKILL))
            assert k.returncode == -signal.SIGKILL, (where, k.returncode, k.stdout[-2000:], k.stderr[-2000:])
            assert not os.path.exists(os.path.join(out, "adapter_model.safetensors")), where
            if where == "s3":
                keys = s3.keys("finetune-ckpt", "run/")
                assert any(k.endswith("commit.json") for k in keys), keys  # the kill left a committed checkpoint
            r = _run(cmd, env)
            resumed = int(r.stdout.split("resume from=")[1].split(" step=")[1].split()[0])
            assert resumed in (2, 4), r.stdout  # step 4's save is published by the time step 5 ends, or step 2's is
            assert [s["step"] for s in _records(out, "finetune")][-8 + resumed :] == list(range(resumed + 1, 9))
            for a, b in zip(_records(whole, "finetune")[resumed:], _records(out, "finetune")[-8 + resumed :]):
                assert abs(a["loss"] - b["loss"]) <= 1e-6, (where, a, b)
            wa, wb = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (whole, out))
            assert wa.keys() == wb.keys() and max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6, where
    finally:
        s3.stop()


def test_two_prompts_reach_the_model_as_different_next_token_distributions(base, run1, monkeypatch, capsys):
    """`--prompt`'s own path (try_model: the adapter loaded, the chat template, generation): the first forward of two
    different prompts gives two different next-token distributions. A tiny model's replies can still look alike
    (it puts its mass on the corpus's most frequent tokens), but not because the prompt was lost on the way."""
    from minilm_az import generate as gen

    real, seen = gen.generate_ids, []

    def spy(model, prompt, *args, **kwargs):
        with torch.no_grad():
            seen.append((prompt, torch.softmax(model(torch.tensor([prompt]))[0, -1].float(), -1)))
        return real(model, prompt, *args, **kwargs)

    monkeypatch.setattr(gen, "generate_ids", spy)
    for prompt in ("Salam! Necəsən?", "Bakı haqqında nə bilirsən?"):
        argv = ["--model", base, "--adapter", run1, "--prompt", prompt, "--max-new-tokens", "3", "--device", "cpu"]
        assert finetune.main(argv) == 0
    (ids_a, p), (ids_b, q) = seen
    assert ids_a != ids_b and ids_a[-4:] == ids_b[-4:]  # the same template around different user text
    assert 0.5 * (p - q).abs().sum().item() > 1e-3, "the two prompts gave the same next-token distribution"
