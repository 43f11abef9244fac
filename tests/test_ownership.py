"""One ownership rule for every writer (minilm_az/outputs.py:claim), the lock held for a run, write errors as one
line, and Ctrl-C in train.py: the unit-level cases. The end-to-end rows (each script given a directory it does
not own, a locked one, a marker entry through a link) are in tests/test_bad_inputs.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import prefork  # tests/prefork.py (pytest puts this folder on sys.path too)
import pytest
import torch
from safetensors.torch import save_file

from minilm_az.checkpoint import check, step_dirs
from minilm_az.outputs import LOCK, MARKER, OutputError, claim, lock_dir, replace_earlier, staged_output

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, text="x"):
    with open(path, "w") as f:
        f.write(text)


def test_a_new_dir_is_taken_and_the_same_run_continues_without_overwrite(tmp_path):
    out = str(tmp_path / "out")
    lock, replacing = claim(out, "train.py", False, run="r1")
    assert not replacing and json.load(open(os.path.join(out, MARKER)))["owner"]["run"] == "r1"
    _write(os.path.join(out, "metrics.jsonl"))
    lock.close()
    lock, replacing = claim(out, "train.py", False, run="r1")  # the same inputs: --resume auto continues
    assert not replacing and os.path.exists(os.path.join(out, "metrics.jsonl"))
    lock.close()
    with pytest.raises(OutputError, match="from other inputs"):
        claim(out, "train.py", False, run="r2")
    with pytest.raises(OutputError, match="pass --overwrite"):  # the same run, but asked to start fresh
        claim(out, "train.py", False, run="r1", resume=False)


def test_overwrite_removes_only_what_the_marker_lists(tmp_path):
    out = str(tmp_path / "out")
    # A run that writes its logs and exits: at exit its owner entry lists the files it wrote, not their folders.
    run = (
        "import os, sys; from minilm_az.outputs import claim; out = sys.argv[1]; "
        "claim(out, 'train.py', False, run='r1', run_files=('metrics.jsonl', 'tensorboard')); "
        "os.makedirs(os.path.join(out, 'tensorboard')); "
        "[open(os.path.join(out, n), 'w').write('x') for n in ('metrics.jsonl', 'tensorboard/events')]"
    )
    subprocess.run([sys.executable, "-c", run, out], cwd=ROOT, check=True)
    owner = json.load(open(os.path.join(out, MARKER)))["owner"]
    assert owner["files"] == ["metrics.jsonl", "tensorboard/events"], owner
    _write(os.path.join(out, "notes.txt"))  # owned dir, a file no record lists: it stays
    _write(os.path.join(out, "tensorboard", "mine"))  # beside the run's events: the user's, it stays
    marker = open(os.path.join(out, MARKER)).read()
    lock, replacing = claim(out, "train.py", True, run="r2", run_files=("metrics.jsonl", "tensorboard"))
    # Nothing goes before the new run's first output exists: a run stopped before it leaves the earlier one whole.
    assert replacing and os.path.exists(os.path.join(out, "metrics.jsonl"))
    assert open(os.path.join(out, MARKER)).read() == marker
    replace_earlier(out)
    lock.close()
    assert sorted(os.listdir(out)) == sorted([LOCK, MARKER, "notes.txt", "tensorboard"])
    assert os.listdir(os.path.join(out, "tensorboard")) == ["mine"]
    assert json.load(open(os.path.join(out, MARKER)))["owner"]["run"] == "r2"


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_dir_of_another_stage_or_of_nobody_is_refused_even_with_overwrite(tmp_path, overwrite):
    foreign = tmp_path / "download"
    foreign.mkdir()
    _write(foreign / "config.json", "{}")
    with pytest.raises(OutputError, match="holds files no minilm-az stage wrote \\(config.json\\)"):
        claim(str(foreign), "train.py", overwrite, run="r")
    assert os.listdir(foreign) == ["config.json"]  # a refusal creates nothing, not even the lock file
    tok = str(tmp_path / "tok")
    with staged_output(tok, stage="tokenize train") as tmp:
        _write(os.path.join(tmp, "tokenizer.json"))
    lock, _ = claim(tok, "tokenize train", True)  # its own stage may replace it
    lock.close()
    with pytest.raises(OutputError, match="holds the output of `tokenize train`"):
        claim(tok, "finetune.py", overwrite, run="r")


def test_a_dir_holding_only_a_marker_counts_as_empty_but_a_users_dotfile_does_not(tmp_path):
    out = str(tmp_path / "out")
    claim(out, "finetune.py", False, run="r1")[0].close()  # a run that stopped before it wrote anything
    lock, replacing = claim(out, "train.py", False, run="other")
    lock.close()
    assert not replacing and json.load(open(os.path.join(out, MARKER)))["owner"]["stage"] == "finetune.py"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    _write(os.path.join(theirs, ".hidden"))  # a hidden file is someone's file all the same (issue 38)
    with pytest.raises(OutputError, match=r"holds files no minilm-az stage wrote \(\.hidden\)"):
        claim(str(theirs), "train.py", False, run="r2")
    assert os.listdir(theirs) == [".hidden"]


def test_the_lock_refuses_a_second_holder_and_is_gone_with_the_process(tmp_path):
    path = str(tmp_path / "ckpt")
    held = lock_dir(path, "--checkpoint-dir")
    code = f"from minilm_az.outputs import lock_dir; lock_dir({path!r}, '--checkpoint-dir')"
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert other.returncode != 0 and "another run is writing there now" in other.stderr
    held.close()
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_a_write_error_is_one_line_with_the_path_and_the_free_space(tmp_path):
    from safetensors import SafetensorError

    out = str(tmp_path / "out")
    with pytest.raises(OSError) as e, staged_output(out, stage="hf-model"):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
    text = str(e.value)  # safetensors' Rust text gives way to the OS's words for its errno
    assert text.startswith(f"{out}: cannot write the output (No space left on device; ") and "B free there" in text
    assert "\n" not in text and not os.path.exists(out)  # the failed first write left nothing
    with pytest.raises(OSError, match=r": cannot write the output \(No space left on device; [\d.]+ [GM]iB free"):
        with staged_output(out, stage="hf-model") as tmp:
            save_file({"w": torch.zeros(2)}, os.path.join(tmp, "model.safetensors"))
            raise OSError(28, "No space left on device")


def test_ctrl_c_publishes_the_written_checkpoint_and_exits_130_in_one_line(
    tmp_path, small_tokenizer_dir, container_shards_dir
):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        "--phase",
        "2",
        "--tokenizer",
        small_tokenizer_dir,
        "--data",
        container_shards_dir,
    ]
    cmd += ["--steps", "100000", "--seq-len", "32", "--global-batch", "2", "--eval-batches", "1"]
    cmd += ["--checkpoint-every", "4", "--log-every", "1", "--device", "cpu", "--out", str(out)]

    def ctrl_c(pid: int) -> None:  # half a second after the first save: inside a later step
        time.sleep(0.5)
        os.kill(pid, signal.SIGINT)

    proc = prefork.run(cmd, str(ROOT), prefork.PLAIN_ENV, 240, "\ncheckpoint step=4 ", ctrl_c)
    stdout, err = proc.stdout, proc.stderr
    assert proc.returncode == 130, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: interrupted after step "), err
    assert "Traceback" not in err + stdout
    assert re.search(r"^stop requested: finishing step \d+, then stopping", stdout, re.M), stdout[-2000:]
    ckpt = out / "checkpoints" / "phase2"
    names = step_dirs(str(ckpt))
    assert names and names[0] in lines[0] and check(str(ckpt / names[0])) is None
    assert not [n for n in os.listdir(ckpt) if n.endswith(".sagemaker-ignore")]  # no save was left half-written


def test_weights_are_written_readable_by_others_like_every_other_file(tmp_path):
    old = os.umask(0o022)
    try:
        with staged_output(str(tmp_path / "m"), stage="hf-model") as tmp:
            save_file({"w": torch.zeros(2)}, os.path.join(tmp, "model.safetensors"))  # safetensors makes it 0600
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "m" / "model.safetensors").st_mode & 0o777 == 0o644


def test_a_demo_rerun_removes_only_what_its_demo_json_lists(tmp_path):
    from demo import run as demo

    run, outside = tmp_path / "demo", tmp_path / "outside"
    (run / "tokenizer").mkdir(parents=True)
    outside.mkdir()
    _write(outside / "victim.txt")
    _write(run / "notes.md", "mine")  # added by a person after the demo ran
    (run / demo.MARKER).write_text(json.dumps({"entries": ["tokenizer", "../outside", demo.MARKER]}))
    demo.prepare_run_dir(str(run))
    # An older demo.json's entries name top-level entries: only plain files among them are taken as written (a
    # directory's name says nothing of what a person put inside it), and never one outside the run.
    assert sorted(os.listdir(run)) == ["logs", "notes.md", "tokenizer"] and os.listdir(outside) == ["victim.txt"]


def _tmpfs_works() -> bool:
    try:
        probe = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', "/tmp"])
    except OSError:
        return False
    return os.geteuid() == 0 and probe.returncode == 0


@pytest.mark.skipif(not _tmpfs_works(), reason="needs root and `unshare -m` to mount a small tmpfs")
def test_a_full_disk_at_export_is_one_line_with_the_path_and_the_free_space(
    tmp_path, small_tokenizer_dir, container_shards_dir
):
    # --out is a 256 KiB tmpfs (in a mount namespace of the command's own): the metrics fit, the weights do not.
    out = tmp_path / "full"
    out.mkdir()
    cmd = [sys.executable, "train.py", "--phase", "2", "--tokenizer", small_tokenizer_dir, "--data"]
    cmd += [container_shards_dir, "--steps", "2", "--seq-len", "32", "--global-batch", "2", "--eval-batches", "1"]
    cmd += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--device", "cpu", "--out", str(out / "model")]
    script = 'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"'
    p = subprocess.run(["unshare", "-m", "sh", "-c", script, str(out), *cmd], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith(f"train.py: error: {out / 'model'}: cannot write the output (")
    assert re.search(r"\(No space left on device; [\d.]+ [KMG]?i?B free there\)$", lines[0]), lines[0]
    assert check(str(tmp_path / "ckpt" / "phase2" / step_dirs(str(tmp_path / "ckpt" / "phase2"))[0])) is None


@pytest.mark.parametrize("entry", ["..", ".", "tensorboard/..", "tensorboard/../..", "/"])
def test_an_owner_entry_never_removes_out_dir_itself_or_anything_above_it(tmp_path, entry):
    out = str(tmp_path / "p" / "run")
    claim(out, "train.py", False, run="r1")[0].close()
    os.makedirs(os.path.join(out, "tensorboard"))
    _write(os.path.join(out, "notes.txt"))
    _write(tmp_path / "p" / "victim.txt")
    marker = json.load(open(os.path.join(out, MARKER)))
    marker["owner"]["files"] = [entry]
    json.dump(marker, open(os.path.join(out, MARKER), "w"))
    lock, _ = claim(out, "train.py", True, run="r2")  # --overwrite from other inputs: only what is listed goes
    replace_earlier(out)
    lock.close()
    assert os.path.exists(os.path.join(out, "notes.txt")) and os.path.exists(tmp_path / "p" / "victim.txt")


@pytest.mark.parametrize(
    "owner, outputs",
    [
        ('"train.py"', "[]"),
        ('{"stage": "train.py", "files": [1, null]}', "[]"),
        ("[]", "[]"),
        ('{"stage": "train.py", "files": "notes"}', "[]"),  # a string would be read letter by letter
        ('{"stage": "train.py"}', "5"),
        ('{"stage": "train.py"}', '[{"stage": "hf-model", "files": [1, "model.safetensors"]}]'),
    ],
)
def test_a_malformed_owner_record_is_one_error_naming_the_marker(tmp_path, owner, outputs):
    out = tmp_path / "run"
    out.mkdir()
    (out / MARKER).write_text(f'{{"owner": {owner}, "outputs": {outputs}}}')
    with pytest.raises(OutputError, match=f"{out / MARKER}: unreadable output marker"):
        claim(str(out), "train.py", True, run="r")


def _train(out, *extra, tok, data):
    cmd = [sys.executable, "train.py", "--phase", "2", "--tokenizer", tok, "--data", data, "--steps", "1"]
    cmd += ["--seq-len", "32", "--global-batch", "2", "--eval-batches", "1", "--device", "cpu", "--out", str(out)]
    return prefork.run([*cmd, *extra], str(ROOT), prefork.PLAIN_ENV, timeout=300)


def test_a_checkpoint_dir_inside_another_output_or_locked_by_another_run_is_refused(
    tmp_path, small_tokenizer_dir, container_shards_dir
):
    tok, data = small_tokenizer_dir, container_shards_dir
    model = tmp_path / "model"  # a stage's output: its marker says so
    with staged_output(str(model), stage="hf-model") as tmp:
        _write(os.path.join(tmp, "config.json"), "{}")
    p = _train(tmp_path / "b", "--checkpoint-dir", str(model / "ckpt"), tok=tok, data=data)
    assert p.returncode == 2 and f"--checkpoint-dir {model / 'ckpt'} is inside {model}" in p.stderr, p.stderr
    assert sorted(os.listdir(model)) == ["config.json", MARKER] and not (tmp_path / "b").exists()
    held = lock_dir(str(tmp_path / "a" / "checkpoints"), "--checkpoint-dir")  # run a, still running
    p = _train(tmp_path / "c", "--checkpoint-dir", str(tmp_path / "a" / "checkpoints"), tok=tok, data=data)
    held.close()
    assert p.returncode == 2 and "another run is writing there now" in p.stderr, p.stderr


def test_tokenize_refuses_an_out_inside_its_corpus_dir_and_a_report_inside_an_output(tmp_path, small_tokenizer_dir):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write(corpus / "a.txt", "Salam dünya.\nBu bir cümlədir.\n" * 50)
    tok = [sys.executable, "tokenize.py", "train", "--vocab-size", "300", "--no-progress", "--corpus", str(corpus)]
    p = prefork.run([*tok, "--out", str(corpus / "tok")], str(ROOT), prefork.PLAIN_ENV, timeout=300)
    assert p.returncode == 2 and "is inside the corpus directory" in p.stderr and os.listdir(corpus) == ["a.txt"]
    rep = [sys.executable, "tokenize.py", "report", "--tokenizer", small_tokenizer_dir, "--corpus", str(corpus)]
    model = tmp_path / "model"
    with staged_output(str(model), stage="hf-model") as tmp:
        _write(os.path.join(tmp, "config.json"), "{}")
    rep += ["--no-progress", "--json", str(model / "r.json")]
    p = prefork.run(rep, str(ROOT), prefork.PLAIN_ENV, timeout=300)
    assert p.returncode == 2 and f"is inside {model}, a stage's output" in p.stderr, p.stderr
    assert sorted(os.listdir(model)) == ["config.json", MARKER]


def test_a_listed_log_dir_holding_another_output_stays_and_no_output_nests_in_another(tmp_path):
    out = str(tmp_path / "run")
    claim(out, "train.py", False, run="r1", run_files=("tensorboard",))[0].close()
    with pytest.raises(OutputError, match=f"is inside {tmp_path / 'run'}, the output of another run or stage"):
        claim(os.path.join(out, "tensorboard"), "tokenize train", False)
    with staged_output(os.path.join(out, "tensorboard"), stage="tokenize train") as tmp:  # put there by hand
        _write(os.path.join(tmp, "tokenizer.json"))
    claim(out, "train.py", True, run="r2", run_files=("tensorboard",))[0].close()
    assert os.path.isfile(os.path.join(out, "tensorboard", "tokenizer.json"))


def test_merge_never_writes_into_a_merged_dir_it_did_not_make(tmp_path):
    from minilm_az.outputs import own_subdir

    out = tmp_path / "sft"
    (out / "merged").mkdir(parents=True)
    _write(out / "merged" / "config.json", "{}")  # another model someone put there
    with pytest.raises(OutputError, match="merged exists and is not an output of this stage"):
        own_subdir(str(out), "merged", "merged_from_adapter.json")
    (tmp_path / "victim").mkdir()
    os.rename(out / "merged", tmp_path / "victim" / "m")
    os.symlink(tmp_path / "victim" / "m", out / "merged")
    with pytest.raises(OutputError, match="is not an output of this stage"):
        own_subdir(str(out), "merged", "merged_from_adapter.json")
    os.remove(out / "merged")
    assert own_subdir(str(out), "merged", "merged_from_adapter.json") == str(out / "merged")
