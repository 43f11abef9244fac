"""The suite's commands leave the checkout as it was (issue 31): a command writes where its flags say, and a
command stopped by a bad input writes nothing at all.

Each case runs one root-script command, from the repository root as the suite's tests do, in a fresh copy of
the checkout made into a git repository of its own. Afterwards `git status --porcelain --ignored` there must
show nothing: the ignored files count too, because runs/ is ignored, so a plain `git status` never showed the
runs/phase2/metrics.jsonl that `train.py --eval-only` used to leave. The copy keeps the test exact while other
work goes on in the real checkout, and it catches a write relative to the working directory or to the script
alike.

A case marked xfail leaves files behind today; its reason names the fix, and strict=True makes the case fail
once the fix lands, so that its mark is removed.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**{k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}, "OMP_NUM_THREADS": "1"}
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", "-c", "commit.gpgsign=false"]

# name: (the command's words after the interpreter, its exit status, the xfail reason while the bug is there).
# {model}, {tok}, {shards} and {away} are filled in: a tiny model, a tokenizer, shards and a folder outside the copy.
CASES = {
    "train_with_out_elsewhere": (
        ["train.py", "--phase", "2", "--preset", "tiny", "--tokenizer", "{tok}", "--data", "{shards}", "--steps", "1"]
        + ["--seq-len", "64", "--global-batch", "2", "--device", "cpu", "--out", "{away}/trained"],
        0,
        None,
    ),
    "tokenize_report": (["tokenize.py", "report", "--tokenizer", "{tok}", "--corpus", "data/az/django.txt"], 0, None),
    "tokenize_encode_elsewhere": (
        ["tokenize.py", "encode", "--tokenizer", "{tok}", "--corpus", "data/az/django.txt", "--out", "{away}/shards"],
        0,
        None,
    ),
    "finetune_prompt": (
        ["finetune.py", "--model", "{model}", "--prompt", "Salam!", "--max-new-tokens", "4", "--device", "cpu"],
        0,
        None,
    ),
    "eval_only_without_out": (
        ["train.py", "--eval-only", "--base-model", "{model}", "--tokenizer", "{model}", "--seq-len", "64"]
        + ["--eval-text", "data/az/django.txt", "--device", "cpu"],
        0,
        None,  # it wrote runs/phase2/metrics.jsonl under the working directory until --eval-only wrote only to --out
    ),
    "train_with_a_missing_data_dir": (
        ["train.py", "--phase", "2", "--preset", "tiny", "--tokenizer", "{tok}", "--data", "{away}/no-such-shards"]
        + ["--device", "cpu", "--out", "runs/bad"],
        2,
        None,  # it left runs/bad/metrics.jsonl until metrics.jsonl was made at the first record, after the checks
    ),
    "finetune_with_text_for_chat_data": (
        ["finetune.py", "--model", "{model}", "--data", "data/az/kde.txt", "--steps", "1", "--device", "cpu"]
        + ["--out", "runs/bad-sft"],
        2,
        None,  # it left runs/bad-sft/metrics.jsonl until finetune.py logged its config after reading the data
    ),
}


def copy_checkout(dst: Path) -> Path:
    """The checkout's files as git sees them (tracked, and untracked ones it does not ignore) in a new repository,
    committed, so that `git status` there shows exactly what a command adds or changes."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree has nothing to copy
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    for args in (["-c", "init.defaultBranch=main", "init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "copy"]):
        subprocess.run(GIT + args, cwd=dst, capture_output=True, check=True)
    return dst


def leftovers(repo: Path) -> list[str]:
    """`git status --porcelain --ignored` of the copy, bytecode caches aside (importing tokenize.py as the
    `tokenize` module caches it, as in any checkout)."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in status.splitlines() if "__pycache__/" not in line]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, small_tokenizer_dir, container_shards_dir) -> dict:
    """A tiny model trained from a scratch folder (two steps), with the conftest's tokenizer and shards."""
    scratch = tmp_path_factory.mktemp("clean_checkout_inputs")
    model = scratch / "model"
    argv = ["train.py", "--phase", "2", "--preset", "tiny", "--tokenizer", small_tokenizer_dir]
    argv += ["--data", container_shards_dir, "--steps", "2", "--seq-len", "64", "--global-batch", "2"]
    argv += ["--device", "cpu", "--checkpoint-every", "0", "--out", str(model)]
    r = subprocess.run(
        [sys.executable, str(ROOT / argv[0]), *argv[1:]],
        cwd=scratch,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {"model": str(model), "tok": small_tokenizer_dir, "shards": container_shards_dir}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else name
        for name, (_, _, reason) in CASES.items()
    ],
)
def test_a_command_run_from_the_repo_root_leaves_git_status_clean(name, inputs, tmp_path):
    words, status, _ = CASES[name]
    repo = copy_checkout(tmp_path / "checkout")
    away = tmp_path / "away"  # outside the copy: where a case's --out may point
    away.mkdir()
    argv = [w.format(away=away, **inputs) for w in words]
    r = subprocess.run(
        [sys.executable, *argv],
        cwd=repo,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == status, f"exit {r.returncode}, not {status}:\n" + r.stdout[-2000:] + r.stderr[-2000:]
    left = leftovers(repo)
    assert left == [], f"`{' '.join(argv)}` left files in the checkout: {left}"
