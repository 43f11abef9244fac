"""train.py end to end on CPU (gloo): phase 1 trains only the embedding, 2-process FSDP equals 1 process,
resume after SIGKILL / SIGTERM repeats the uninterrupted run, the export loads in transformers, BPB
eval-only, and the one-line errors (exit 2) for bad input.

One uninterrupted reference run serves several tests; the error cases run side by side. A run of one process that
is not signalled runs in a fork of an interpreter that imported torch once (tests/prefork.py): its own process,
argv, environment, exit code and output all the same; so do the two ranks of the FSDP test, without torchrun's
agent (the SIGTERM test runs a real torchrun).
"""

import concurrent.futures
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import prefork
import pytest
import torch
from safetensors.torch import load_file

from minilm_az.checkpoint import step_dirs
from minilm_az.hf import load_pretrained, save_pretrained
from minilm_az.model import build_model, get_preset
from minilm_az.tokenizer import copy_tokenizer_files, load_tokenizer, tokenizer_hash
from minilm_az.transfer import transfer_embedding

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CORPUS = [str(ROOT / "data" / "az" / f) for f in ("mediawiki.txt", "kde.txt", "django.txt")]
VAL = str(ROOT / "data" / "az" / "firefox.txt")
SMALL = [
    "--preset",
    "tiny",
    "--seq-len",
    "64",
    "--micro-batch",
    "2",
    "--global-batch",
    "4",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--eval-batches",
    "2",
    "--export-dtype",
    "float32",
]
STEPS = 10


def cmd(*args, nproc: int = 1) -> list[str]:
    pre = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    return [*pre, "train.py", *map(str, args)]


def launch(*args, nproc: int = 1) -> subprocess.Popen:
    # A session of its own, so a hung run is killed with all its torchrun workers.
    return subprocess.Popen(
        cmd(*args, nproc=nproc),
        cwd=ROOT,
        env=prefork.PLAIN_ENV,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish(p: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(p)
        out, err = p.communicate()
        pytest.fail(f"train.py hung for {timeout}s\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run_one(*args, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python train.py ARGS` run to its end (no signal to send it): a fork of tests/prefork.py's server."""
    try:
        return prefork.run(cmd(*args), str(ROOT), prefork.PLAIN_ENV, timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"train.py hung for {timeout}s\n{(e.stdout or '')[-2000:]}\n{(e.stderr or '')[-2000:]}")


def train(*args) -> subprocess.CompletedProcess:
    r = run_one(*args)
    assert r.returncode == 0, f"train.py exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def records(out: Path, kind: str = "train", after: int = 0) -> list[dict]:
    """metrics.jsonl records of `kind`, from byte offset `after` on (what a later run appended)."""
    with open(out / "metrics.jsonl", "rb") as f:
        f.seek(after)
        return [r for r in map(json.loads, f.read().decode().splitlines()) if r["kind"] == kind]


def losses(out: Path, after: int = 0) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out, "train", after)}


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def wait_for(cond, p: subprocess.Popen, what: str, timeout: float = 120):
    t = time.monotonic()
    while not cond():
        if p.poll() is not None:
            pytest.fail(f"train.py exited ({p.returncode}) before {what}: {p.stderr.read()[-2000:]}")
        if time.monotonic() - t > timeout:
            kill(p)
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def checkpoint_step(ckpt_dir: Path) -> int | None:
    """The step of the newest checkpoint dir (renamed into place, so complete on one host), once there is one."""
    names = step_dirs(str(ckpt_dir))
    return int(names[0].split("-")[1]) if names else None


def train_lines(out: Path) -> int:
    """How many train records metrics.jsonl holds so far (cheap enough to poll)."""
    try:
        return (out / "metrics.jsonl").read_bytes().count(b'{"kind": "train"')
    except FileNotFoundError:
        return 0


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Our tokenizer (1000) and its shards; a base tokenizer (700, another corpus) with a random tiny base
    model of its vocabulary; and shards written with the base tokenizer (for the hash mismatch)."""
    d = tmp_path_factory.mktemp("train")

    def tokenize(*args):  # forks of the server run_one's train.py runs fork from
        argv = [sys.executable, "tokenize.py", *map(str, args), "--no-progress"]
        r = prefork.run(argv, str(ROOT), prefork.PLAIN_ENV, timeout=180)
        assert r.returncode == 0, f"{shlex.join(argv)}\n{r.stderr[-3000:]}"

    tokenize("train", "--corpus", *CORPUS, "--vocab-size", "1000", "--out", d / "tok")
    tokenize("encode", "--tokenizer", d / "tok", "--corpus", *CORPUS, "--val-corpus", VAL, "--out", d / "shards")
    tokenize("train", "--corpus", CORPUS[1], "--vocab-size", "700", "--out", d / "base_tok")
    tokenize(
        "encode",
        "--tokenizer",
        d / "base_tok",
        "--corpus",
        CORPUS[2],
        "--val-corpus",
        CORPUS[2],
        "--out",
        d / "base_shards",
    )
    base_vocab = load_tokenizer(str(d / "base_tok")).get_vocab_size(with_added_tokens=True)
    save_pretrained(build_model(get_preset("tiny", vocab_size=base_vocab), seed=5), str(d / "base"))
    copy_tokenizer_files(str(d / "base_tok"), str(d / "base"))
    return d


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """One uninterrupted 1-process run from random init: STEPS steps, exported."""
    out = tmp_path_factory.mktemp("reference") / "out"
    r = train("--tokenizer", data / "tok", "--data", data / "shards", "--out", out, "--steps", STEPS, *SMALL)
    assert "export dir=" in r.stdout
    return out


def assert_losses_match(got: dict[int, float], want: dict[int, float], steps, tol: float):
    assert sorted(got) == list(steps)
    for s in steps:
        assert abs(got[s] - want[s]) <= tol, f"step {s}: loss {got[s]} != {want[s]}"


# ---------------------------------------------------------------- the proofs


def test_phase1_changes_only_the_embedding(data, tmp_path):
    out = tmp_path / "phase1"
    r = train(
        "--phase",
        1,
        "--base-model",
        data / "base",
        "--base-tokenizer",
        data / "base",
        "--tokenizer",
        data / "tok",
        "--data",
        data / "shards",
        "--out",
        out,
        "--steps",
        6,
        *SMALL,
    )
    base, new = weights(data / "base"), weights(out)
    assert sorted(base) == sorted(new) and "lm_head.weight" not in new  # tied stays tied
    for name, t in base.items():
        if name != "model.embed_tokens.weight":
            assert torch.equal(new[name], t), f"{name} changed in phase 1"

    n_tok = load_tokenizer(str(data / "tok")).get_vocab_size(with_added_tokens=True)
    start, stats = transfer_embedding(
        base["model.embed_tokens.weight"],
        load_tokenizer(str(data / "base_tok")),
        load_tokenizer(str(data / "tok")),
        1024,
    )
    emb = new["model.embed_tokens.weight"]
    assert emb.shape == (1024, 128)  # 1000 ids padded to a multiple of 64
    assert f"vocab_transfer tensor=model.embed_tokens.weight {stats}" in r.stdout
    assert stats.copied + stats.averaged + stats.special_mean == n_tok and stats.copied > 0 and stats.averaged > 0
    assert (emb - start).abs().amax(1).gt(0).float().mean() > 0.99  # trained (decay touches every row)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 1024 and cfg["tie_word_embeddings"] is True
    assert tokenizer_hash(str(out)) == tokenizer_hash(str(data / "tok"))

    # Nothing but the embedding has optimizer state.
    import torch.distributed.checkpoint as dcp

    (step6,) = (out / "checkpoints" / "phase1").glob("step-00000006-*")
    meta = dcp.FileSystemReader(str(step6)).read_metadata()
    state = {k.rsplit(".", 1)[0] for k in meta.state_dict_metadata if k.startswith("optim.state.")}
    assert state == {"optim.state.model.embed_tokens.weight"}


def test_two_process_fsdp_matches_one_process(data, reference, tmp_path):
    # The two ranks as torchrun starts them, forked without its agent (tests/prefork.py): what is under test is
    # FSDP's numbers; the SIGTERM test below runs a real torchrun of two.
    out = tmp_path / "two"
    argv = cmd("--tokenizer", data / "tok", "--data", data / "shards", "--out", out, "--steps", STEPS, *SMALL)
    r = prefork.run_ranks(argv, str(ROOT), prefork.PLAIN_ENV, 2, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "world=2 micro_batch=2" in r.stdout and "batch accum=1 " in r.stdout
    assert_losses_match(losses(out), losses(reference), range(1, STEPS + 1), tol=1e-5)
    one, two = weights(reference), weights(out)
    assert sorted(one) == sorted(two)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-4, msg=name)


def test_resume_after_sigkill_repeats_the_uninterrupted_losses(data, reference, tmp_path):
    out = tmp_path / "killed"
    args = [
        "--tokenizer",
        data / "tok",
        "--data",
        data / "shards",
        "--out",
        out,
        "--steps",
        STEPS,
        *SMALL,
        "--checkpoint-every",
        3,
    ]
    p = launch(*args)
    ckpt = out / "checkpoints" / "phase2"
    wait_for(lambda: checkpoint_step(ckpt) is not None, p, "the first checkpoint")
    p.send_signal(signal.SIGKILL)
    p.communicate()
    assert p.returncode == -signal.SIGKILL
    killed_at = checkpoint_step(ckpt)
    assert killed_at is not None and killed_at < STEPS
    logged = (out / "metrics.jsonl").stat().st_size

    r = train(*args, "--resume", "auto")
    assert f"step={killed_at}" in r.stdout.split("resume from=")[1].splitlines()[0]
    assert_losses_match(losses(out, after=logged), losses(reference), range(killed_at + 1, STEPS + 1), tol=1e-6)
    for name, t in weights(reference).items():
        torch.testing.assert_close(weights(out)[name], t, rtol=0, atol=1e-6, msg=name)


def test_checkpoint_minutes_bounds_what_a_sigkill_loses(data, tmp_path):
    """SageMaker's spot interruption as it really arrives (no SIGTERM reaches train.py): a SIGKILL at a random
    moment. With --checkpoint-minutes 0.05 (3 s) and --checkpoint-every off, the newest complete checkpoint is
    at most 3 s (plus one step and the write) older than the kill, and the resume starts from it."""
    out, interval = tmp_path / "clock", 3.0
    args = ["--tokenizer", data / "tok", "--data", data / "shards", "--out", out, *SMALL, "--checkpoint-every", 0]
    p = launch(*args, "--steps", 100_000, "--checkpoint-minutes", interval / 60)
    ckpt = out / "checkpoints" / "phase2"
    wait_for(lambda: checkpoint_step(ckpt) is not None, p, "the first timed checkpoint")
    first = checkpoint_step(ckpt)
    wait_for(lambda: checkpoint_step(ckpt) != first, p, "the second timed checkpoint")
    time.sleep(np.random.default_rng().uniform(0, 2 * interval))  # anywhere in the next interval or two
    kill(p)
    killed = time.time()
    p.communicate()
    step = checkpoint_step(ckpt)
    saved = (ckpt / step_dirs(str(ckpt))[0] / "train_state.json").stat().st_mtime  # written at that step's end
    assert killed - saved <= interval + 2.0, f"the kill lost {killed - saved:.1f} s of training"
    steps_run = max(r["step"] for r in records(out))
    assert first < step <= steps_run
    r = train(*args, "--steps", step + 2, "--resume", "auto")
    assert f"step={step}" in r.stdout.split("resume from=")[1].splitlines()[0]


def test_sigterm_on_one_rank_checkpoints_exits_cleanly_and_resumes(data, reference, tmp_path):
    """A spot interruption: the signal reaches rank 1 only; both ranks stop after the same step, save, exit 0.
    The resume runs on one process (DCP reshards) and continues the reference's losses."""
    out = tmp_path / "term"
    args = [
        "--tokenizer",
        data / "tok",
        "--data",
        data / "shards",
        "--out",
        out,
        "--steps",
        STEPS,
        *SMALL,
        "--checkpoint-every",
        0,
    ]
    p = launch(*args, nproc=2)
    wait_for(lambda: train_lines(out) >= 2, p, "step 2")
    workers = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if parent_of(pid) == p.pid]
    rank1 = [pid for pid in workers if b"LOCAL_RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()]
    assert len(workers) == 2 and len(rank1) == 1
    os.kill(rank1[0], signal.SIGTERM)
    r = finish(p, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    stopped_at = checkpoint_step(out / "checkpoints" / "phase2")
    assert stopped_at is not None and 2 <= stopped_at < STEPS, stopped_at
    assert f"stopped by signal 15 at step {stopped_at}; resume with --resume auto" in r.stdout
    assert not (out / "model.safetensors").exists()  # stopped, not finished
    assert_losses_match(losses(out), losses(reference), range(1, stopped_at + 1), tol=1e-5)
    logged = (out / "metrics.jsonl").stat().st_size

    r = train(*args)  # --resume auto is the default
    assert f"resume from={out / 'checkpoints' / 'phase2' / f'step-{stopped_at:08d}'}-" in r.stdout
    assert f" step={stopped_at}" in r.stdout.split("resume from=")[1].splitlines()[0]
    assert_losses_match(losses(out, after=logged), losses(reference), range(stopped_at + 1, STEPS + 1), tol=1e-5)


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


@pytest.fixture(scope="module")
def hf_reference(reference):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(str(reference), torch_dtype=torch.float32).eval()


def test_export_loads_in_transformers_with_the_same_logits(reference, hf_reference):
    import transformers

    hf = hf_reference
    ours = load_pretrained(str(reference)).eval()
    ids = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() <= 1e-5
    text = "Bakı Azərbaycanın paytaxtıdır."
    auto = transformers.AutoTokenizer.from_pretrained(str(reference))
    assert auto(text)["input_ids"] == load_tokenizer(str(reference)).encode(text).ids


def test_eval_only_on_raw_text_prints_val_bpb(reference, hf_reference, tmp_path):
    docs = ["Bakı Azərbaycanın paytaxtı və ən böyük şəhəridir.", "Faylı yadda saxlamaq üçün düyməni basın."]
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(docs) + "\n", encoding="utf-8")
    r = run_one(
        "--eval-only",
        "--base-model",
        reference,
        "--tokenizer",
        reference,
        "--eval-text",
        text,
        "--seq-len",
        256,
        "--micro-batch",
        1,
        "--out",
        tmp_path / "eval",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("eval "))
    got = dict(kv.split("=", 1) for kv in line.split()[1:])
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    assert int(got["val_bytes"]) == n_bytes

    # Independently: transformers' logits over EOS doc EOS doc EOS, every token after the first predicted.
    tok = load_tokenizer(str(reference))
    eos = tok.token_to_id("<|end_of_text|>")
    ids = [eos]
    for d in docs:
        ids += tok.encode(d, add_special_tokens=False).ids + [eos]
    assert len(ids) <= 256 and int(got["val_tokens"]) == len(ids) - 1  # one window: the full context
    with torch.no_grad():
        logits = hf_reference(torch.tensor([ids])).logits[0, :-1]
    nll = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
    assert float(got["val_bpb"]) == pytest.approx(nll / (math.log(2) * n_bytes), rel=1e-4)


# ---------------------------------------------------------------- bad input: exit 2, one line, nothing lost


def bad_cases(d: Path, tmp: Path) -> dict[str, tuple[list, str]]:
    """name -> (train.py arguments, what the one-line error must say)."""
    short = tmp / "short_context"
    shutil.copytree(d / "base", short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 32}))
    no_weights = tmp / "no_weights"
    shutil.copytree(d / "base", no_weights)
    (no_weights / "model.safetensors").unlink()
    ok = ["--tokenizer", d / "tok", "--data", d / "shards", "--steps", 4, *SMALL]
    phase1 = ["--phase", 1, "--base-tokenizer", d / "base", *ok]
    return {
        "shards_of_another_tokenizer": (
            ["--tokenizer", d / "tok", "--data", d / "base_shards", *SMALL],
            "token shards were written with tokenizer",
        ),
        "missing_data_dir": (
            ["--tokenizer", d / "tok", "--data", tmp / "nowhere", *SMALL],
            f"--data {tmp / 'nowhere'}: no such directory",
        ),
        "seq_len_above_context": (
            [*phase1, "--base-model", short],
            "--seq-len 64 exceeds the model's context of 32 tokens",
        ),
        "missing_base_weights": ([*phase1, "--base-model", no_weights], f"{no_weights}: no model.safetensors"),
        "global_batch_does_not_divide": (
            [*ok, "--global-batch", 5],
            "--global-batch 5 is not a multiple of --micro-batch x processes = 2 x 1",
        ),
        # Adam moves every weight by ~lr: at 1e6 the first update wrecks the model, step 2's grads are not finite.
        "diverging_loss": (
            [*ok, "--lr", 1e6, "--warmup", 1, "--checkpoint-every", 1],
            "at step 2: stopped before the update; last good checkpoint: ",
        ),
    }


@pytest.fixture(scope="module")
def bad_runs(data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    cases = bad_cases(data, tmp)
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # side by side
        runs = {name: pool.submit(run_one, *args, "--out", tmp / name) for name, (args, _) in cases.items()}
        return tmp, {name: (runs[name].result(), cases[name][1]) for name in cases}


@pytest.mark.parametrize(
    "case",
    [
        "shards_of_another_tokenizer",
        "missing_data_dir",
        "seq_len_above_context",
        "missing_base_weights",
        "global_batch_does_not_divide",
        "diverging_loss",
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_problem(bad_runs, case):
    _, runs = bad_runs
    r, says = runs[case]
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("train.py: error: ")]
    assert len(errors) == 1 and says in errors[0], r.stderr[-2000:]


def test_diverging_loss_keeps_the_last_good_checkpoint(bad_runs):
    tmp, runs = bad_runs
    r, _ = runs["diverging_loss"]
    kept = Path(r.stderr.split("last good checkpoint: ")[1].split()[0])
    assert kept.parent == tmp / "diverging_loss" / "checkpoints" / "phase2" and kept.name.startswith("step-00000001-")
    assert (kept / "train_state.json").is_file() and any(kept.glob("*.distcp"))
    assert sorted(losses(tmp / "diverging_loss")) == [1]
    assert np.isfinite(losses(tmp / "diverging_loss")[1])
    assert not (tmp / "diverging_loss" / "model.safetensors").exists()
