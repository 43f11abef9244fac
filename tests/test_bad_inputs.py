"""Guardrails, proven row by row: no data loss, no silent wrong result, one-line errors.

ONE TABLE (`ROWS`): each row is a bad input given the way a user gives it (`python tokenize.py ...`,
`python train.py ...`, `torchrun ... train.py ...`, `python finetune.py ...`,
`python -m minilm_az.launch.sagemaker ...`),
the exit code it must end with, a fragment of the one error line (it names the file, line or flag), and
the files that must come through byte-identical. Every error row asserts:

- the exit code (2 for our errors; torchrun itself exits 1 when a child fails, so its rows also check that
  every rank exited 2);
- exactly ONE line on stderr starting `<prog>: error:` (for the launcher: stderr is that one line and stdout is
  empty), containing the fragment;
- no "Traceback" anywhere (torchrun's own report of a failed child, a traceback of the launcher, is left out);
- the protected files unchanged (hashed before, compared after) and the paths that must not appear absent.

Rows that must succeed (`code=0`) assert no error line, no traceback and their own check (`check`).

Fixtures are tiny (a 400-id tokenizer on kde.txt, a 2-step `--preset tiny` model, a 1-step rank-2 adapter)
and built once per module; the rows' commands then run in parallel in one module fixture (`results`), and
each parametrized test only checks its own row's outcome, so a failure names its row. Running a subset
(`-k resume`) runs only those rows' commands. The `python X.py` commands (rows and fixtures) run in forks of
one interpreter that imported torch once (tests/prefork.py): each is still its own process with its own argv,
environment, exit code, stdout and stderr, without paying `import torch` again; torchrun, `-m` and the
read-only rows run as plain subprocesses.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import gzip
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import pytest
from prefork import Prefork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data")
KDE, DJANGO, FIREFOX = (os.path.join(DATA, "az", f) for f in ("kde.txt", "django.txt", "firefox.txt"))
CHAT = os.path.join(DATA, "chat", "az_chat.jsonl")
WORKERS = max(2, min(4, os.cpu_count() or 2))
ROW_TIMEOUT = int(os.environ.get("BAD_INPUTS_ROW_TIMEOUT", 300))  # seconds per command

# What a model-training row adds so it costs seconds: one val batch per evaluation.
SMALL = "--steps 2 --seq-len 32 --global-batch 2 --eval-batches 1"
SMALL_FT = "--steps 1 --lora-r 2 --global-batch 2"


# ---------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    cmd: str  # as typed by a user, with {placeholders} for the fixtures' paths and the row's own ({W}, {X}, ...)
    code: int = 2
    fragment: str = ""  # must be in the one error line (formatted like cmd)
    protect: tuple[str, ...] = ()  # files/dirs (formatted) that must be byte-identical afterwards
    absent: tuple[str, ...] = ()  # paths (formatted) that must not exist afterwards
    prep: Callable | None = None  # prep(fx, w) -> extra placeholders: the row's own inputs, built in its dir
    check: Callable | None = None  # check(result) for rows that must succeed (or extra checks)
    fast: bool = False  # a parser error: refused before any work (no log line, seconds)
    readonly: str | None = None  # a dir (formatted) that is read-only while the command runs
    launcher: bool = False  # the SageMaker launcher: fake credentials, stdout must stay empty


# --- row inputs (each row gets its own directory W; inputs a removed guard could damage are copies)


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst) if os.path.isdir(src) else shutil.copyfile(src, dst)
    return dst


def model_copy(fx, w):
    return {"X": _copy(fx["M"], os.path.join(w, "model"))}


def adapter_copy(fx, w):
    return {"X": _copy(fx["A"], os.path.join(w, "adapter"))}


def tokenizer_copy(fx, w):
    return {"X": _copy(fx["T"], os.path.join(w, "tok"))}


def existing_report(fx, w):
    path = os.path.join(w, "report.json")
    with open(path, "w") as f:
        f.write('{"mine": "a report I want to keep"}\n')
    return {"X": path}


def run_copy(fx, w):
    """A copy of a run that checkpointed every step (--checkpoint-every 1 --steps 2), to be re-run into."""
    return {"X": _copy(fx["RUN"], os.path.join(w, "run"))}


def checkpoints_copy(fx, w):
    """The run's checkpoints alone, in a checkpoint dir of their own (SageMaker's /opt/ml/checkpoints)."""
    return {"C": _copy(os.path.join(fx["RUN"], "checkpoints"), os.path.join(w, "ckpt"))}


def other_base(fx, w):
    """The run's checkpoints, and a base model that differs from its base by one weight (same shape, tokenizer)."""
    out = checkpoints_copy(fx, w)
    mb = _copy(fx["M"], os.path.join(w, "model_b"))
    with open(os.path.join(mb, "model.safetensors"), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        last = f.read(4)
        f.seek(-4, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]) + last[1:])
    return {**out, "MB": mb}


def no_complete_checkpoint(fx, w):
    """The run above, with every checkpoint lacking a manifest: a sync that never finished."""
    out = run_copy(fx, w)
    for manifest in glob.glob(os.path.join(out["X"], "checkpoints", "phase2", "step-*", "manifest-00000.json")):
        os.remove(manifest)
    return out


def corrupt_model(fx, w):
    out = model_copy(fx, w)
    weights = os.path.join(out["X"], "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)  # a download or copy that stopped halfway
    return out


def corrupt_adapter(fx, w):
    out = adapter_copy(fx, w)
    weights = os.path.join(out["X"], "adapter_model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    return out


def string_config(fx, w):
    out = model_copy(fx, w)
    path = os.path.join(out["X"], "config.json")
    with open(path) as f:
        hf = json.load(f)
    hf["hidden_size"] = str(hf["hidden_size"])  # "hidden_size": "128", as a hand edit or a YAML round trip leaves it
    with open(path, "w") as f:
        json.dump(hf, f, indent=2)
    return out


def corrupt_gz(fx, w):
    with open(KDE, "rb") as f:
        packed = gzip.compress(f.read())
    path = os.path.join(w, "corpus.txt.gz")
    with open(path, "wb") as f:  # a valid gzip header, then garbage where the deflate stream should be
        f.write(packed[:20] + bytes((i * 151 + 7) % 256 for i in range(4000)))
    return {"X": path}


BAD_LINE = 5


def bad_utf8_chat(fx, w):
    """The chat set with line 5 holding invalid UTF-8 (earlier lines hold multi-byte Azerbaijani text)."""
    with open(CHAT, "rb") as f:
        lines = f.read().splitlines(keepends=True)[:40]
    bad = b'{"messages": [{"role": "user", "content": "Salam \xff\xfe"}, {"role": "assistant", "content": "x"}]}\n'
    lines.insert(BAD_LINE - 1, bad)
    path = os.path.join(w, "chat.jsonl")
    with open(path, "wb") as f:
        f.writelines(lines)
    return {"X": path}


def chat_dir(fx, w):
    """A --data directory: part_a / part_b_values / values train, val1 and val2 validate."""
    with open(CHAT, encoding="utf-8") as f:
        lines = f.readlines()
    with open(os.path.join(DATA, "chat", "az_chat_val.jsonl"), encoding="utf-8") as f:
        val = f.readlines()
    d = os.path.join(w, "chat")
    os.makedirs(d)
    for name, part in (
        ("part_a", lines[:40]),
        ("part_b_values", lines[40:60]),
        ("values", lines[60:70]),
        ("val1", val[:4]),
        ("val2", val[4:8]),
    ):
        with open(os.path.join(d, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(part)
    return {"X": d}


def empty_dir(fx, w):
    d = os.path.join(w, "ro")
    os.makedirs(d)
    return {"RO": d}


# --- checks of rows that must succeed


def _records(path: str, kind: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r.get("kind") == kind]


def _data_files(metrics: str) -> tuple[list[str], list[str]]:
    """(train files, val files) as the run logged them: a `data_files` record, or the `data` record's *_files."""
    for kind, train, val in (("data_files", "train", "val"), ("data", "train_files", "val_files")):
        recs = [r for r in _records(metrics, kind) if train in r]
        if recs:
            return recs[-1][train].split(","), (recs[-1].get(val) or "").split(",")
    raise AssertionError(f"{metrics}: no record names the data files")


def check_layout(r):
    metrics = os.path.join(r.paths["W"], "out", "metrics.jsonl")
    train, val = _data_files(metrics)
    d = r.paths["X"]
    assert val == [f"{d}/val1.jsonl", f"{d}/val2.jsonl"], val
    assert train == [f"{d}/part_a.jsonl", f"{d}/part_b_values.jsonl", f"{d}/values.jsonl"], train
    data = _records(metrics, "data")[-1]
    assert data["val"] == 8 and data["train"] == 70, data


def check_skipped(r):
    data = _records(os.path.join(r.paths["W"], "out", "metrics.jsonl"), "data")[-1]
    assert data["skipped_bad_lines"] == 1, data
    assert f"{r.paths['X']}:{BAD_LINE}:" in r.stdout  # the skipped line is named, on its own line number
    assert os.path.isfile(os.path.join(r.paths["W"], "out", "adapter_model.safetensors"))


def check_fresh_run(r):
    assert "export dir=" in r.stdout and "resume from=" not in r.stdout, r.stdout[-2000:]


def check_started_nothing(r):
    assert "train step=" not in r.stdout, "a read-only --checkpoint-dir must be found before training starts"


def check_no_adapter(r):
    assert "finetune step=1" in r.stdout, "the row must diverge after training started, not fail before"


def check_ranks_exit_2(r):
    """torchrun's report: the first rank to fail exited 2 (our error); the others 2 or SIGTERM (torchrun stops them)."""
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", r.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, f"ranks exited {codes}, expected 2 (or -15)"


TR = f"python train.py --phase 2 --tokenizer {{T}} --data {{S}} {SMALL}"
FT = f"python finetune.py --model {{M}} --data {{CHAT}} {SMALL_FT}"
LAUNCH = (
    "python -m minilm_az.launch.sagemaker train --phase 2 --data s3://b/shards/ --tokenizer s3://b/tok/ "
    "--instance-type ml.g5.xlarge"
)


def mdl_config_with(fx, w, **fields):
    """A copy of the base model with these config.json fields set."""
    out = model_copy(fx, w)
    path = os.path.join(out["X"], "config.json")
    with open(path) as f:
        hf = json.load(f)
    with open(path, "w") as f:
        json.dump({**hf, **fields}, f, indent=2)
    return out


def mdl_mistral_config(fx, w):
    """What a Mistral config says that a Llama's does not: it evaluated as a Llama (no sliding window)."""
    return mdl_config_with(fx, w, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)


def mdl_gelu_config(fx, w):
    return mdl_config_with(fx, w, hidden_act="gelu")


def mdl_int8_config(fx, w):
    """torch_dtype int8: --merge wrote the merged model in it, every weight rounded to zero, with exit 0."""
    return mdl_config_with(fx, w, torch_dtype="int8")


def mdl_shard_outside(fx, w):
    """A model whose index sends its only shard to ../outside/: a file the model dir does not hold."""
    from safetensors import safe_open

    out = model_copy(fx, w)
    os.makedirs(os.path.join(w, "outside"))
    outside = os.path.join(w, "outside", "model.safetensors")
    os.replace(os.path.join(out["X"], "model.safetensors"), outside)
    with safe_open(outside, "pt") as f:
        weight_map = {name: "../outside/model.safetensors" for name in f.keys()}
    with open(os.path.join(out["X"], "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return {**out, "O": outside}


def mdl_nan_adapter(fx, w):
    """The adapter with one NaN (a fine-tune that diverged): it answered "" at temperature 0, a traceback sampling."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = adapter_copy(fx, w)
    weights = os.path.join(out["X"], "adapter_model.safetensors")
    with safe_open(weights, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors[sorted(tensors)[-1]][0, 0] = float("nan")
    save_file(tensors, weights, metadata=meta)
    return out


def mdl_check_no_training(r):
    assert "finetune step=" not in r.stdout, "an unusable --merge dtype must be found before training starts"


def own_foreign_model(fx, w):
    """A model dir no minilm-az stage wrote (a download: config.json and weights, no marker)."""
    out = model_copy(fx, w)
    os.remove(os.path.join(out["X"], "minilm-az-output.json"))
    return out


def own_locked(fx, w):
    """A shard dir another run is writing now: a process holds its lock for a minute."""
    out = os.path.join(w, "shards")
    os.makedirs(out)
    lock = os.path.join(out, ".minilm-az.lock.sagemaker-ignore")
    holder = f"import fcntl, time; f = open({lock!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True)"
    holder += "; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE)
    proc.stdout.readline()  # the lock is held once it prints
    return {"X": out}


def own_marker_through_link(fx, w):
    """A tokenizer dir whose marker lists `sub/victim.txt`, where sub links to a directory outside it."""
    out = tokenizer_copy(fx, w)
    outside = os.path.join(w, "outside")
    os.makedirs(outside)
    with open(os.path.join(outside, "victim.txt"), "w") as f:
        f.write("not the tokenizer's\n")
    os.symlink(outside, os.path.join(out["X"], "sub"))
    marker = os.path.join(out["X"], "minilm-az-output.json")
    with open(marker) as f:
        m = json.load(f)
    m["outputs"][-1]["files"].append("sub/victim.txt")
    with open(marker, "w") as f:
        json.dump(m, f)
    return {**out, "O": outside}


def own_corpus_dir(fx, w):
    d = os.path.join(w, "corpus")
    os.makedirs(d)
    _copy(FIREFOX, os.path.join(d, "firefox.txt"))
    return {"C": d}


def _inp_shards(fx, w, edit) -> dict:
    """A copy of the shards S whose index.json `edit(index, dir)` changes; X is the copy."""
    d = _copy(fx["S"], os.path.join(w, "shards"))
    path = os.path.join(d, "index.json")
    with open(path) as f:
        index = json.load(f)
    edit(index, d)
    with open(path, "w") as f:
        json.dump(index, f)
    return {"X": d}


def inp_shard_outside_data(fx, w):
    """splits.train.shards[0].file is "../outside.bin": a file beside --data, of exactly the size the index asks."""

    def edit(index, d):
        first = index["splits"]["train"]["shards"][0]
        shutil.copyfile(os.path.join(d, first["file"]), os.path.join(w, "outside.bin"))
        first["file"] = "../outside.bin"

    return {**_inp_shards(fx, w, edit), "OUTSIDE": os.path.join(w, "outside.bin")}


def inp_shard_tokens_string(fx, w):
    """splits.train.shards[0].tokens as a string (a hand edit): a TypeError traceback before index.json was checked."""

    def edit(index, d):
        first = index["splits"]["train"]["shards"][0]
        first["tokens"] = str(first["tokens"])

    return _inp_shards(fx, w, edit)


def inp_ids_beyond_vocab(fx, w):
    """Token id 420 in train's first shard of T's 400-id vocabulary (below the 448 embedding rows: it would train
    silently), in an index.json from before max ids were recorded, so only a scan of the shard can find it."""

    def edit(index, d):
        for split in index["splits"].values():
            split.pop("max_id", None)
            for shard in split["shards"]:
                shard.pop("max_id", None)
        with open(os.path.join(d, index["splits"]["train"]["shards"][0]["file"]), "r+b") as f:
            f.seek(2 * 10)
            f.write((420).to_bytes(2, "little"))

    return _inp_shards(fx, w, edit)


def _inp_cut(w: str, name: str, packed: bytes) -> dict:
    path = os.path.join(w, name)
    with open(path, "wb") as f:
        f.write(packed[: len(packed) // 2])  # a download or copy that stopped halfway
    return {"X": path}


def inp_cut_zst(fx, w):
    import zstandard  # the prep extra, which the test environment has

    with open(KDE, "rb") as f:
        return _inp_cut(w, "kde.txt.zst", zstandard.ZstdCompressor().compress(f.read()))


def inp_cut_gz(fx, w):
    with open(KDE, "rb") as f:
        return _inp_cut(w, "kde.txt.gz", gzip.compress(f.read()))


def inp_corpus_dir(fx, w, json_text: str) -> dict:
    """A corpus directory: kde.txt, a notes.md, and a meta.json holding `json_text`."""
    d = os.path.join(w, "corpus")
    os.makedirs(d)
    _copy(KDE, os.path.join(d, "kde.txt"))
    with open(os.path.join(d, "notes.md"), "w") as f:
        f.write("# where the corpus came from\n")
    with open(os.path.join(d, "meta.json"), "w", encoding="utf-8") as f:
        f.write(json_text)
    return {"X": d}


def inp_pretty_json_in_corpus(fx, w):
    return inp_corpus_dir(fx, w, json.dumps({"source": "kde", "license": "GPL"}, indent=2) + "\n")


def inp_json_lines_in_corpus(fx, w):
    return inp_corpus_dir(fx, w, "".join(json.dumps({"text": f"Sənəd {i}"}) + "\n" for i in range(7)))


def inp_check_json_lines_read(r):
    assert "skipped 1 files that are not corpus files: notes.md" in r.stderr, r.stderr
    with open(os.path.join(r.paths["W"], "out", "index.json")) as f:
        splits = json.load(f)["splits"]
    with open(KDE, encoding="utf-8") as f:
        kde_docs = sum(1 for line in f if line.strip())
    assert sum(s["documents"] for s in splits.values()) == kde_docs + 7  # meta.json's 7 lines were read


ROWS = [
    # ---- data loss
    Row(
        "tok_train_overwrite_model_dir",
        f"python tokenize.py train --vocab-size 300 --corpus {KDE} --no-progress --overwrite --out {{X}}",
        fragment="{X}",
        protect=("{X}",),
        prep=model_copy,
    ),
    Row(
        "tok_train_overwrite_adapter_dir",
        f"python tokenize.py train --vocab-size 300 --corpus {KDE} --no-progress --overwrite --out {{X}}",
        fragment="{X}",
        protect=("{X}",),
        prep=adapter_copy,
    ),
    Row(
        "tok_report_json_exists",
        f"python tokenize.py report --tokenizer {{T}} --corpus {FIREFOX} --no-progress --json {{X}}",
        fragment="--json {X}",
        protect=("{X}",),
        prep=existing_report,
    ),
    Row(
        "tok_report_json_is_its_tokenizer",
        f"python tokenize.py report --tokenizer {{X}} --corpus {FIREFOX} "
        "--no-progress --json {X}/tokenizer.json --overwrite",
        fragment="{X}/tokenizer.json",
        protect=("{X}",),
        prep=tokenizer_copy,
    ),
    # ---- wrong results with exit 0
    Row(
        "phase1_without_base_tokenizer",
        f"python train.py --phase 1 --base-model {{M}} --tokenizer {{T}} --data {{S}} {SMALL} --out {{W}}/out",
        fragment="--base-tokenizer",
        protect=("{M}",),
        absent=("{W}/out",),
        fast=True,
    ),
    Row(
        "phase1_without_base_model",
        f"python train.py --phase 1 --base-tokenizer {{T}} --tokenizer {{T}} --data {{S}} {SMALL} --out {{W}}/out",
        fragment="--base-model",
        absent=("{W}/out",),
        fast=True,
    ),
    Row(
        "phase1_without_base_tokenizer_torchrun",
        "torchrun --standalone --nproc_per_node 2 train.py --phase 1 "
        f"--base-model {{M}} --tokenizer {{T}} --data {{S}} {SMALL} --out {{W}}/out",
        code=1,
        fragment="--base-tokenizer",
        absent=("{W}/out",),
        check=check_ranks_exit_2,
    ),
    Row(
        "phase2_base_of_another_tokenizer",
        f"{TR} --base-model {{MO}} --out {{W}}/out",
        fragment="is not the tokenizer of {MO}",
        protect=("{MO}",),
    ),
    Row(
        "eval_only_tokenizer_not_the_models",
        f"python train.py --eval-only --base-model {{M}} --tokenizer {{T2}} --eval-text {FIREFOX} --out {{W}}/out",
        fragment="--tokenizer {T2}",
        protect=("{M}",),
    ),
    Row(
        "finetune_tokenizer_not_the_models",
        f"{FT} --tokenizer {{T2}} --out {{W}}/out",
        fragment="--tokenizer {T2}",
        protect=("{M}",),
        absent=("{W}/out/adapter_model.safetensors",),
    ),
    Row(
        "resume_with_other_data",  # the run's own --out says so first (outputs.claim)
        f"{TR} --base-model {{M}} --data {{S2}} --checkpoint-every 1 --out {{X}}",
        fragment="holds an earlier `train.py`'s output from other inputs",
        protect=("{X}/checkpoints", "{X}/model.safetensors"),
        prep=run_copy,
    ),
    Row(
        "resume_with_other_data_torchrun",
        f"torchrun --standalone --nproc_per_node 2 train.py --phase 2 "
        f"--tokenizer {{T}} {SMALL} --base-model {{M}} --data {{S2}} --checkpoint-every 1 --out {{W}}/new "
        "--checkpoint-dir {C}",  # a checkpoint dir of its own, as on SageMaker: the checkpoint says so
        code=1,
        fragment="data=",
        protect=("{C}",),
        prep=checkpoints_copy,
        check=check_ranks_exit_2,
    ),
    Row(
        "resume_with_other_base_model",
        f"{TR} --base-model {{MB}} --checkpoint-every 1 --out {{W}}/new --checkpoint-dir {{C}}",
        fragment="base_model=",
        protect=("{C}", "{MB}"),
        prep=other_base,
    ),
    Row(
        "resume_never_with_other_data_runs",
        f"{TR} --base-model {{M}} --data {{S2}} --checkpoint-every 1 --resume never --overwrite --out {{X}}",
        code=0,
        prep=run_copy,
        check=check_fresh_run,
    ),
    Row(
        "finetune_diverging_loss",
        "python finetune.py --model {M} --data {CHAT} --lora-r 2 --global-batch 2 --steps 2 --lr 1e6 --out {W}/out",
        fragment="step 2",
        protect=("{M}",),
        absent=("{W}/out/adapter_model.safetensors", "{W}/out/adapter_config.json"),
        check=check_no_adapter,
    ),
    Row(
        "finetune_lr_past_float32",
        f"{FT} --lr 1e39 --warmup 0 --out {{W}}/out",
        fragment="--lr",
        absent=("{W}/out/adapter_model.safetensors",),
    ),
    Row(  # a file that exists, where a shard directory belongs: said as such (not "no such directory")
        "train_data_is_a_file",
        f"python train.py --phase 2 --tokenizer {{T}} --data {KDE} {SMALL} --out {{W}}/out",
        fragment=f"--data {KDE}: a file, where a directory belongs (token shards, from tokenize.py encode)",
        absent=("{W}/out",),
        fast=True,
    ),
    Row(  # plain text where chat JSONL belongs: the line names the layout a line must have
        "finetune_text_for_chat_jsonl",
        f"python finetune.py --model {{M}} --data {KDE} {SMALL_FT} --out {{W}}/out",
        fragment="; chat JSONL has one ",
        absent=("{W}/out",),
    ),
    Row(
        "train_global_batch_0",
        f"{TR} --global-batch 0 --out {{W}}/out",
        fragment="--global-batch",
        absent=("{W}/out",),
        fast=True,
    ),
    Row(
        "train_fp8_on_cpu",
        f"{TR} --fp8 tensorwise --compile --device cpu --out {{W}}/out",
        fragment="--fp8",
        absent=("{W}/out",),
        fast=True,
    ),
    Row(
        "train_fp8_fast_accum_without_fp8",
        f"{TR} --fp8-fast-accum --out {{W}}/out",
        fragment="--fp8-fast-accum needs --fp8",
        absent=("{W}/out",),
        fast=True,
    ),
    Row("train_lr_nan", f"{TR} --lr nan --out {{W}}/out", fragment="--lr", absent=("{W}/out",), fast=True),
    Row("train_steps_0", f"{TR} --steps 0 --out {{W}}/out", fragment="--steps", absent=("{W}/out",), fast=True),
    Row(
        "train_micro_batch_0",
        f"{TR} --micro-batch 0 --out {{W}}/out",
        fragment="--micro-batch",
        absent=("{W}/out",),
        fast=True,
    ),
    Row("train_seq_len_0", f"{TR} --seq-len 0 --out {{W}}/out", fragment="--seq-len", absent=("{W}/out",), fast=True),
    Row(
        "train_replicate_not_dividing_the_processes",
        "torchrun --standalone --nproc_per_node 2 train.py --phase 2 "
        f"--tokenizer {{T}} --data {{S}} {SMALL} --global-batch 4 --replicate 3 --out {{W}}/out",
        code=1,
        fragment="--replicate 3 must divide the number of processes (2)",
        absent=("{W}/out",),
        check=check_ranks_exit_2,
    ),
    Row(
        "finetune_replicate_on_one_process",
        f"{FT} --replicate 2 --out {{W}}/out",
        fragment="--replicate 2 must divide the number of processes (1)",
        absent=("{W}/out",),
        fast=True,
    ),
    Row(
        "finetune_prompt_top_p_0",
        "python finetune.py --model {M} --prompt Salam --top-p 0",
        fragment="--top-p",
        fast=True,
    ),
    Row(
        "finetune_lora_r_0",
        "python finetune.py --model {M} --data {CHAT} --lora-r 0 --out {W}/out",
        fragment="--lora-r",
        absent=("{W}/out",),
        fast=True,
    ),
    Row(
        "finetune_data_dir_layout",
        f"python finetune.py --model {{M}} --data {{X}} {SMALL_FT} --out {{W}}/out",
        code=0,
        prep=chat_dir,
        check=check_layout,
    ),
    # ---- tracebacks where one line belongs
    Row(
        "train_base_model_truncated_safetensors",
        f"{TR} --base-model {{X}} --out {{W}}/out",
        fragment="{X}/model.safetensors",
        protect=("{X}",),
        prep=corrupt_model,
    ),
    Row(
        "finetune_model_truncated_safetensors",
        f"python finetune.py --model {{X}} --data {{CHAT}} {SMALL_FT} --out {{W}}/out",
        fragment="{X}/model.safetensors",
        protect=("{X}",),
        prep=corrupt_model,
    ),
    Row(
        "prompt_adapter_truncated_safetensors",
        "python finetune.py --model {M} --adapter {X} --prompt Salam --max-new-tokens 4",
        fragment="{X}/adapter_model.safetensors",
        protect=("{X}",),
        prep=corrupt_adapter,
    ),
    Row(
        "tok_train_corrupt_gz",
        "python tokenize.py train --vocab-size 300 --corpus {X} --no-progress --out {W}/tok",
        fragment="{X}",
        protect=("{X}",),
        absent=("{W}/tok/tokenizer.json",),
        prep=corrupt_gz,
    ),
    Row(
        "tok_train_readonly_out",
        f"python tokenize.py train --vocab-size 300 --corpus {KDE} --no-progress --out {{RO}}",
        fragment="{RO}",
        prep=empty_dir,
        readonly="{RO}",
    ),
    Row(
        "tok_encode_readonly_out",
        f"python tokenize.py encode --tokenizer {{T}} --corpus {KDE} --no-progress --out {{RO}}",
        fragment="{RO}",
        prep=empty_dir,
        readonly="{RO}",
    ),
    Row("train_readonly_out", f"{TR} --out {{RO}}", fragment="{RO}", prep=empty_dir, readonly="{RO}"),
    Row(
        "train_readonly_checkpoint_dir",
        f"{TR} --out {{W}}/out --checkpoint-dir {{RO}}",
        fragment="--checkpoint-dir {RO}",
        prep=empty_dir,
        readonly="{RO}",
        check=check_started_nothing,
    ),
    Row("finetune_readonly_out", f"{FT} --out {{RO}}", fragment="{RO}", prep=empty_dir, readonly="{RO}"),
    Row(
        "train_config_string_field",
        f"{TR} --base-model {{X}} --out {{W}}/out",
        fragment="{X}/config.json",
        protect=("{X}",),
        prep=string_config,
    ),
    Row(
        "finetune_config_string_field",
        f"python finetune.py --model {{X}} --data {{CHAT}} {SMALL_FT} --out {{W}}/out",
        fragment="{X}/config.json",
        protect=("{X}",),
        prep=string_config,
    ),
    Row(
        "finetune_out_is_model",
        f"python finetune.py --model {{X}} --data {{CHAT}} {SMALL_FT} --out {{X}}",
        fragment="--out {X}",
        protect=("{X}",),
        prep=model_copy,
        fast=True,
    ),
    Row(
        "train_out_is_base_model",
        f"{TR} --base-model {{X}} --out {{X}}",
        fragment="--out {X}",
        protect=("{X}",),
        prep=model_copy,
        fast=True,
    ),
    Row(
        "train_no_complete_checkpoint",
        f"{TR} --base-model {{M}} --checkpoint-every 1 --resume auto --out {{X}}",
        fragment="{X}/checkpoints/phase2: no checkpoint can be resumed: step-00000002-",
        protect=("{X}/checkpoints", "{X}/model.safetensors"),
        prep=no_complete_checkpoint,
    ),
    Row(
        "finetune_invalid_utf8_line",
        f"python finetune.py --model {{M}} --data {{X}} {SMALL_FT} --out {{W}}/out",
        fragment=f"{{X}}:{BAD_LINE}:",
        protect=("{X}",),
        prep=bad_utf8_chat,
        absent=("{W}/out/adapter_model.safetensors",),
    ),
    Row(
        "finetune_invalid_utf8_line_skipped",
        f"python finetune.py --model {{M}} --data {{X}} {SMALL_FT} --on-bad-line skip --out {{W}}/out",
        code=0,
        protect=("{X}",),
        prep=bad_utf8_chat,
        check=check_skipped,
    ),
    Row("launcher_bad_region_dry_run", f"{LAUNCH} --region nowhere-1 --dry-run", fragment="--region", launcher=True),
    Row("launcher_bad_region", f"{LAUNCH} --region nowhere-1", fragment="--region", launcher=True),
    Row(
        "launcher_tokenize_checkpoint_s3",  # tokenize writes no checkpoints (train and finetune resume from theirs)
        "python -m minilm_az.launch.sagemaker tokenize encode --corpus s3://my-corpus/text/ "
        "--tokenizer s3://my-corpus/tok/ --checkpoint-s3 s3://my-corpus/ckpt/ --dry-run",
        fragment="--checkpoint-s3",
        launcher=True,
    ),
    Row(
        "launcher_role_name_dry_run",
        f"{LAUNCH} --region us-east-1 --role MyRole --dry-run",
        fragment="--role",
        launcher=True,
    ),
    Row("launcher_role_name", f"{LAUNCH} --region us-east-1 --role MyRole", fragment="--role", launcher=True),
    # ---- issue 29: ownership of outputs, one lock per output dir, Ctrl-C (lead)
    Row(
        "own_train_into_a_foreign_model_dir",
        f"{TR} --out {{X}}",
        fragment="--out {X}: holds files no minilm-az stage wrote",
        protect=("{X}",),
        prep=own_foreign_model,
    ),
    Row(
        "own_train_into_another_runs_dir",
        f"python train.py --phase 2 --tokenizer {{T}} --data {{S2}} {SMALL} --out {{X}}",
        fragment="from other inputs",
        protect=("{X}",),
        prep=run_copy,
    ),
    Row(
        "own_train_resume_never_into_a_run",
        f"python train.py --phase 2 --base-model {{M}} --tokenizer {{T}} --data {{S}} {SMALL} --resume never "
        "--out {X}",
        fragment="pass --overwrite to replace it",
        protect=("{X}",),
        prep=run_copy,
    ),
    Row(
        "own_finetune_into_a_tokenizer_dir",
        f"{FT} --out {{X}}",
        fragment="holds the output of `tokenize train`",
        protect=("{X}",),
        prep=tokenizer_copy,
    ),
    Row(
        "own_finetune_into_a_model_dir_overwrite",
        f"{FT} --overwrite --out {{X}}",
        fragment="holds the output of `train.py`",
        protect=("{X}",),
        prep=model_copy,
    ),
    Row(
        "own_encode_while_another_run_writes",
        f"python tokenize.py encode --tokenizer {{T}} --corpus {KDE} --no-progress --out {{X}}",
        fragment="another run is writing there now",
        protect=("{X}",),
        prep=own_locked,
    ),
    Row(
        "own_overwrite_never_removes_through_a_link",
        f"python tokenize.py train --vocab-size 300 --corpus {KDE} --no-progress --overwrite --out {{X}}",
        code=0,
        protect=("{O}",),
        prep=own_marker_through_link,
    ),
    Row(
        "own_report_json_inside_the_corpus_dir",
        "python tokenize.py report --tokenizer {T} --corpus {C} --no-progress --json {C}/firefox.txt --overwrite",
        fragment="--json {C}/firefox.txt is one of the inputs",
        protect=("{C}",),
        prep=own_corpus_dir,
    ),
    Row(
        "own_finetune_epochs_0",
        "python finetune.py --model {M} --data {CHAT} --epochs 0 --out {W}/out",
        fragment="--epochs must be > 0",
        absent=("{W}/out",),
        fast=True,
    ),
    Row(
        "own_train_huge_global_batch",  # numpy's MemoryError before: 745 GiB for the batch order
        "python train.py --phase 2 --tokenizer {T} --data {S} --global-batch 100000000000 --out {W}/out",
        fragment="--global-batch must be <= 1048576",
        absent=("{W}/out",),
        fast=True,
    ),
    # ---- issue 29: shard, corpus and compressed inputs validated at the boundary (inputs)
    Row(
        "inp_index_shard_file_outside_data",
        f"python train.py --phase 2 --tokenizer {{T}} --data {{X}} {SMALL} --out {{W}}/out",
        fragment='index.json: splits.train.shards[0].file "../outside.bin" points outside {X}',
        protect=("{X}", "{OUTSIDE}"),
        prep=inp_shard_outside_data,
    ),
    Row(
        "inp_index_field_of_the_wrong_type",
        f"python train.py --phase 2 --tokenizer {{T}} --data {{X}} {SMALL} --out {{W}}/out",
        fragment='index.json: splits.train.shards[0] {{"file": "train_00000.bin", "tokens": "',
        protect=("{X}",),
        prep=inp_shard_tokens_string,
    ),
    Row(
        "inp_token_ids_beyond_the_vocab",
        f"python train.py --phase 2 --tokenizer {{T}} --data {{X}} {SMALL} --out {{W}}/out",
        fragment="index.json: splits.train.shards[0].max_id 420 is not a token id below vocab_size 400",
        protect=("{X}",),
        prep=inp_ids_beyond_vocab,
    ),
    Row(
        "inp_truncated_zst_corpus",
        "python tokenize.py encode --no-progress --tokenizer {T} --corpus {X} --out {W}/out",
        fragment="{X}: cannot read (the file ends inside a zstd frame",
        protect=("{X}",),
        prep=inp_cut_zst,
    ),
    Row(
        "inp_truncated_gz_corpus",
        "python tokenize.py encode --no-progress --tokenizer {T} --corpus {X} --out {W}/out",
        fragment="{X}: cannot read (Compressed file ended before the end-of-stream marker",
        protect=("{X}",),
        prep=inp_cut_gz,
    ),
    Row(
        "inp_json_not_json_lines_in_corpus_dir",
        "python tokenize.py encode --no-progress --tokenizer {T} --corpus {X} --out {W}/out",
        fragment="{X}/meta.json: a .json corpus file must be JSON lines",
        protect=("{X}",),
        absent=("{W}/out",),
        prep=inp_pretty_json_in_corpus,
        fast=True,
    ),
    Row(
        "inp_json_lines_in_corpus_dir_are_read",
        "python tokenize.py encode --no-progress --tokenizer {T} --corpus {X} --val-fraction 0.05 --out {W}/out",
        code=0,
        protect=("{X}",),
        prep=inp_json_lines_in_corpus,
        check=inp_check_json_lines_read,
    ),
    # ---- issue 29: model dirs, adapters, dtypes, write errors (models)
    Row(
        "mdl_eval_only_mistral_config",
        f"python train.py --eval-only --base-model {{X}} --tokenizer {{X}} --eval-text {KDE} --seq-len 32",
        fragment="{X}/config.json: field 'model_type' is 'mistral'",
        protect=("{X}",),
        prep=mdl_mistral_config,
    ),
    Row(
        "mdl_finetune_gelu_config",
        f"python finetune.py --model {{X}} --data {{CHAT}} {SMALL_FT} --out {{W}}/out",
        fragment="{X}/config.json: field 'hidden_act' is 'gelu'",
        protect=("{X}",),
        absent=("{W}/out/adapter_model.safetensors",),
        prep=mdl_gelu_config,
    ),
    Row(
        "mdl_merge_int8_torch_dtype",
        f"python finetune.py --model {{X}} --data {{CHAT}} {SMALL_FT} --merge --out {{W}}/out",
        fragment="{X}/config.json: field 'torch_dtype' is 'int8'",
        protect=("{X}",),
        absent=("{W}/out/adapter_model.safetensors", "{W}/out/merged"),
        prep=mdl_int8_config,
        check=mdl_check_no_training,
    ),
    Row(
        "mdl_weight_map_outside_model_dir",
        f"python finetune.py --model {{X}} --data {{CHAT}} {SMALL_FT} --out {{W}}/out",
        fragment="{X}/model.safetensors.index.json: shard '../outside/model.safetensors' is outside {X}",
        protect=("{X}", "{O}"),
        absent=("{W}/out/adapter_model.safetensors",),
        prep=mdl_shard_outside,
    ),
    Row(
        "mdl_prompt_nan_adapter",
        "python finetune.py --model {M} --adapter {X} --prompt Salam --max-new-tokens 4 --temperature 0.8",
        fragment="{X}/adapter_model.safetensors: tensor",
        protect=("{X}",),
        prep=mdl_nan_adapter,
    ),
]


# ---------------------------------------------------------------- running a row


@dataclasses.dataclass
class Result:
    row: Row
    paths: dict
    argv: list
    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    before: dict = dataclasses.field(default_factory=dict)
    after: dict = dataclasses.field(default_factory=dict)
    skip: str | None = None

    def explain(self) -> str:
        return (
            f"\n$ {shlex.join(self.argv)}\nrc={self.rc} ({self.seconds:.1f} s)\n--- stdout (tail)\n"
            f"{self.stdout[-3000:]}\n--- stderr (tail)\n{self.stderr[-3000:]}"
        )


def snapshot(path: str):
    """sha256 of a file, {relpath: sha256} of a dir (metrics.jsonl, an append-only log, left out), None if absent."""

    def digest(p):
        with open(p, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    if os.path.isfile(path):
        return digest(path)
    if not os.path.isdir(path):
        return None
    out = {}
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            if name != "metrics.jsonl":
                p = os.path.join(root, name)
                out[os.path.relpath(p, path)] = digest(p)
    return out


def _clean_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SM_", "AWS_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _argv(cmd: str) -> list[str]:
    words = shlex.split(cmd)
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    return words


def _readonly_unshare_works() -> bool:
    d = tempfile.mkdtemp(prefix="ro-probe-")
    try:
        rc = subprocess.run(
            ["unshare", "-m", "sh", "-c", RO_SCRIPT + ' ; touch "$0/x" 2>/dev/null && exit 9; exit 0', d],
            capture_output=True,
            timeout=30,
        ).returncode
        return rc == 0 and not os.path.exists(os.path.join(d, "x"))
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(d, ignore_errors=True)


# In a private mount namespace, the dir is bind-mounted onto itself read-only; only the command sees it so.
RO_SCRIPT = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" || exit 97'


def run_row(row: Row, fx: dict, base: str, can_unshare: bool, runner: Prefork) -> Result:
    w = os.path.join(base, row.id)
    os.makedirs(w)
    paths = {**fx, "W": w}
    if row.prep:
        paths.update(row.prep(fx, w))
    fmt = lambda s: s.format(**paths)  # noqa: E731
    argv = _argv(fmt(row.cmd))
    r = Result(row, paths, argv)
    chmodded = None
    if row.readonly:
        ro = fmt(row.readonly)
        if os.geteuid() != 0:
            os.chmod(ro, 0o555)
            chmodded = ro
        elif can_unshare:
            argv = r.argv = ["unshare", "-m", "sh", "-c", RO_SCRIPT + ' && exec "$@"', ro, *argv]
        else:
            r.skip = (
                "running as root, where chmod 555 does not stop writes, and `unshare -m` + a read-only bind "
                "mount is not available here"
            )
            return r
    r.before = {p: snapshot(fmt(p)) for p in row.protect}
    env = _clean_env()
    if row.launcher:  # nothing may leave the machine: fake credentials, no metadata service, a dead proxy
        env.update(
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_SESSION_TOKEN="testing",
            AWS_EC2_METADATA_DISABLED="true",
            AWS_CONFIG_FILE=os.path.join(w, "no-aws-config"),
            AWS_SHARED_CREDENTIALS_FILE=os.path.join(w, "no-aws-credentials"),
            HOME=w,
            HTTPS_PROXY="http://127.0.0.1:9",
            HTTP_PROXY="http://127.0.0.1:9",
            NO_PROXY="",
        )
    t0 = time.monotonic()
    try:
        p = runner.run(argv, ROOT, env, ROW_TIMEOUT)
        r.rc, r.stdout, r.stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        r.rc, r.stdout, r.stderr = None, str(e.stdout or ""), f"{e.stderr or ''}\n(timed out after {ROW_TIMEOUT} s)"
    finally:
        r.seconds = time.monotonic() - t0
        if chmodded:
            os.chmod(chmodded, 0o755)
    r.after = {p: snapshot(fmt(p)) for p in row.protect}
    return r


# ---------------------------------------------------------------- fixtures


def _run(runner: Prefork, cmd: str, **fmt) -> None:
    argv = _argv(cmd.format(**fmt))
    p = runner.run(argv, ROOT, _clean_env(), ROW_TIMEOUT)
    assert p.returncode == 0, f"fixture failed: {shlex.join(argv)}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"


def _parallel(runner: Prefork, *cmds: tuple[str, dict]) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(cmds)) as pool:
        for f in [pool.submit(_run, runner, c, **kw) for c, kw in cmds]:
            f.result()


@pytest.fixture(scope="module")
def runner():
    """What runs the commands: `python X.py` in a fork of a server that imported torch (tests/prefork.py)."""
    server = Prefork(_clean_env())
    yield server
    server.close()


@pytest.fixture(scope="module")
def fx(tmp_path_factory, runner) -> dict:
    """T (400 ids, kde), T2 (300 ids, django): two tokenizers; S, S2 shards of T (kde / django), SO of T2;
    M: the base model (T); MO: a model of T2; A: an adapter on M; RUN: a run from M checkpointed every step."""
    t0 = time.monotonic()
    d = str(tmp_path_factory.mktemp("bad_inputs_fx"))
    p = {k: os.path.join(d, k) for k in ("T", "T2", "S", "S2", "SO", "M", "MO", "A", "RUN")}
    p["CHAT"] = CHAT
    tok = "python tokenize.py train --no-progress --vocab-size {n} --corpus {corpus} --out {out}"
    _parallel(runner, (tok, dict(n=400, corpus=KDE, out=p["T"])), (tok, dict(n=300, corpus=DJANGO, out=p["T2"])))
    enc = "python tokenize.py encode --no-progress --tokenizer {tok} --corpus {corpus} --val-fraction 0.05 --out {out}"
    _parallel(
        runner,
        (enc, dict(tok=p["T"], corpus=KDE, out=p["S"])),
        (enc, dict(tok=p["T"], corpus=DJANGO, out=p["S2"])),
        (enc, dict(tok=p["T2"], corpus=DJANGO, out=p["SO"])),
    )
    model = f"python train.py --phase 2 --preset tiny --tokenizer {{tok}} --data {{data}} {SMALL} --out {{out}}"
    _parallel(
        runner,
        (model, dict(tok=p["T"], data=p["S"], out=p["M"])),
        (model, dict(tok=p["T2"], data=p["SO"], out=p["MO"])),
    )
    _parallel(
        runner,
        (f"python finetune.py --model {{M}} --data {{CHAT}} {SMALL_FT} --out {{A}}", p),
        (
            f"python train.py --phase 2 --base-model {{M}} --tokenizer {{T}} --data {{S}} {SMALL} "
            "--checkpoint-every 1 --out {RUN}",
            p,
        ),
    )
    names = sorted(os.listdir(os.path.join(p["RUN"], "checkpoints", "phase2")))
    assert [n[: len("step-00000001")] for n in names] == ["step-00000001", "step-00000002"]
    print(f"fixtures: {time.monotonic() - t0:.1f} s")  # shown with -s
    return p


@pytest.fixture(scope="module")
def startup(runner) -> float:
    """Seconds `python train.py --help` takes here, started as the rows are: what "returns before any work" is
    measured against."""
    t0 = time.monotonic()
    runner.run([sys.executable, "train.py", "--help"], ROOT, _clean_env(), 60)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def results(request, fx, tmp_path_factory, runner) -> dict[str, Result]:
    """Every selected row's command, run in parallel once; each test then checks its own."""
    wanted = {
        item.callspec.params["row"].id
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_bad_input" and hasattr(item, "callspec")
    }
    rows = [r for r in ROWS if r.id in wanted]
    base = str(tmp_path_factory.mktemp("bad_inputs_rows"))
    can_unshare = any(r.readonly for r in rows) and os.geteuid() == 0 and _readonly_unshare_works()
    # the slowest first (two ranks each), so they do not end up last on their own
    rows.sort(key=lambda r: not r.cmd.startswith("torchrun"))
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        futures = {r.id: pool.submit(run_row, r, fx, base, can_unshare, runner) for r in rows}
        out = {k: f.result() for k, f in futures.items()}
    print("row seconds:", ", ".join(f"{k} {r.seconds:.1f}" for k, r in out.items()))  # shown with -s
    return out


# ---------------------------------------------------------------- the checks


def error_prefix(row: Row) -> str:
    """The regex of the error line's start: `tokenize.py train: error:`, `train.py: error:`, ..."""
    if row.launcher:
        return r"python -m minilm_az\.launch\.sagemaker: error: "
    script = next(w for w in shlex.split(row.cmd) if w.endswith(".py"))
    return re.escape(script) + r"( [a-z]+)?: error: "


def own_tracebacks(text: str) -> list[str]:
    """Tracebacks in `text` other than torchrun's own report that a child failed (its first frame is torchrun's)."""
    out = []
    for m in re.finditer(r"Traceback \(most recent call last\):\n(.*)", text):
        first = m.group(1)
        if not re.search(r"/torchrun\"|torch/distributed/run\.py\"|<frozen runpy>", first):
            out.append(text[m.start() : m.start() + 800])
    return out


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(row: Row, results, startup):
    r = results[row.id]
    if r.skip:
        pytest.skip(r.skip)
    fmt = lambda s: s.format(**r.paths)  # noqa: E731
    assert r.rc == row.code, f"exit code {r.rc}, expected {row.code}" + r.explain()
    tracebacks = own_tracebacks(r.stderr) + own_tracebacks(r.stdout)
    if row.cmd.startswith("torchrun"):
        assert not tracebacks, "a traceback of the script" + r.explain()
    else:
        assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, "a traceback" + r.explain()
    prefix = re.compile(error_prefix(row))
    errors = [ln for ln in r.stderr.splitlines() if prefix.match(ln)]
    assert not [ln for ln in r.stdout.splitlines() if prefix.match(ln)], "an error line on stdout" + r.explain()
    if row.code == 0:
        assert not errors, "an error line from a run that must succeed" + r.explain()
    else:
        assert len(errors) == 1, f"{len(errors)} error lines, expected exactly one" + r.explain()
        assert fmt(row.fragment) in errors[0], f"{fmt(row.fragment)!r} not in the error line" + r.explain()
    if row.launcher:
        assert r.stdout == "", "the launcher printed to stdout on an error" + r.explain()
        assert r.stderr.strip().splitlines() == errors, "the launcher's stderr must be its one error line" + r.explain()
    for p in row.protect:
        assert r.before[p] is not None, f"protected path {fmt(p)} missing before the run"
        assert r.after[p] == r.before[p], f"{fmt(p)} changed (data loss)" + r.explain()
    for p in row.absent:
        assert not os.path.exists(fmt(p)), f"{fmt(p)} exists: the command wrote it" + r.explain()
    if row.fast:
        assert not [ln for ln in r.stdout.splitlines() if ln.strip()], "a parser error after work began" + r.explain()
        # `startup` is measured alone; the rows run WORKERS at a time on os.cpu_count() cores
        limit = 2 * startup * max(1.0, WORKERS / (os.cpu_count() or 1)) + 10
        assert r.seconds < limit, f"took {r.seconds:.1f} s (limit {limit:.1f} s): not refused before any work"
    if row.check:
        try:
            row.check(r)
        except AssertionError as e:
            raise AssertionError(f"{e}{r.explain()}") from None


def test_one_table_every_case_once():
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids))
    for r in ROWS:
        assert r.code == 0 or r.fragment, f"{r.id}: an error row needs a fragment of its error line"
        assert r.cmd.split()[0] in ("python", "torchrun"), r.id
