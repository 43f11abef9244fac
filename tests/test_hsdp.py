"""HSDP (`--replicate N`) and gradient accumulation that reduces once a step, on CPU (gloo).

- train.py on 4 processes as 2 x 2 (HSDP) equals 4 processes plain (FSDP) and 1 process: losses, eval, export.
- A checkpoint written by the 2 x 2 layout resumes on 1 process and the other way round, ending where an
  uninterrupted run ends (the checkpoint of step 3 that the 2 x 2 run and the one-process reference of the first
  point write on their way, copied into a checkpoint dir of its own).
- Accumulation: FSDP reduces gradients once a step (one reduce-scatter per FSDP group, and under HSDP one
  all-reduce across the replicas), and the loss and gradients equal those of reducing every micro-batch.
- finetune.py with --replicate 2 on 4 processes equals --replicate 1.

The LR schedule is flat after warmup (--min-lr-ratio 1), so a run of 3 steps followed by a resume to 6 takes the
same steps as one run of 6.

Every job's ranks are forks of one interpreter that imported torch once (tests/prefork.py's `run_ranks`), with the
environment torchrun gives its workers: what is under test is HSDP's numbers, not the launcher (test_train.py's
SIGTERM test and test_multihost.py's hosts start real torchruns), and each of the ~30 processes here would otherwise
pay ~3 s of CPU for its imports on CI's two cores.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import prefork
import pytest
import test_train
import torch
from safetensors.torch import load_file
from test_train import CORPUS, ROOT, VAL, assert_losses_match, losses, records, weights

pytestmark = pytest.mark.slow

STEPS = 6
# 8 sequences a step: 4 processes run 2 micro-batches each (so HSDP accumulates), 1 process runs 8.
FLAGS = [
    *("--preset", "tiny", "--seq-len", 64, "--micro-batch", 1, "--global-batch", 8),
    *("--warmup", 2, "--min-lr-ratio", 1, "--log-every", 1, "--eval-every", 3, "--eval-batches", 4),
    *("--export-dtype", "float32", "--checkpoint-every", 0),
]


def ranks(argv: list, nproc: int, timeout: float = 240, any_script: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC ARGV` as its workers see it, forked (see the docstring),
    asserted to exit 0."""
    try:
        r = prefork.run_ranks(
            [sys.executable, *map(str, argv)], str(ROOT), prefork.PLAIN_ENV, nproc, timeout, any_script
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{argv[0]} hung for {timeout}s\n{(e.stdout or '')[-2000:]}\n{(e.stderr or '')[-3000:]}")
    assert r.returncode == 0, f"{argv[0]} exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def train(*args, nproc: int = 1) -> subprocess.CompletedProcess:
    """train.py ARGS on `nproc` processes, to its end (test_train.train for one)."""
    return test_train.train(*args) if nproc == 1 else ranks(["train.py", *args], nproc)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Our tokenizer and its token shards."""
    d = tmp_path_factory.mktemp("hsdp")
    for args in (
        ["train", "--corpus", *CORPUS, "--vocab-size", "1000", "--out", d / "tok"],
        ["encode", "--tokenizer", d / "tok", "--corpus", *CORPUS, "--val-corpus", VAL, "--out", d / "shards"],
    ):
        argv = [sys.executable, "tokenize.py", *map(str, args), "--no-progress"]
        r = prefork.run(argv, str(ROOT), prefork.PLAIN_ENV, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
    return ["--tokenizer", d / "tok", "--data", d / "shards", *FLAGS]


@pytest.fixture(scope="module")
def one(data, tmp_path_factory):
    """The reference: one process, STEPS steps, uninterrupted, with a checkpoint at step 3 on the way."""
    out = tmp_path_factory.mktemp("one") / "out"
    train(*data, "--out", out, "--steps", STEPS, "--checkpoint-every", 3)
    return out


@pytest.fixture(scope="module")
def two_by_two(data, tmp_path_factory):
    """4 processes as 2 x 2 (HSDP), STEPS steps, with a checkpoint at step 3 on the way: (out, stdout)."""
    out = tmp_path_factory.mktemp("two_by_two") / "out"
    r = train(*data, "--out", out, "--steps", STEPS, "--replicate", 2, "--checkpoint-every", 3, nproc=4)
    return out, r.stdout


def assert_same_run(got: Path, want: Path, first: int = 1) -> None:
    """The same losses from step `first` on (a resumed run logs no earlier ones), evals and exported weights."""
    assert_losses_match(losses(got), losses(want), range(first, STEPS + 1), tol=1e-5)
    evals = {r["step"]: r["val_loss"] for r in records(want, "eval")}
    for r in records(got, "eval"):
        assert abs(r["val_loss"] - evals[r["step"]]) <= 1e-5, r
    a, b = weights(got), weights(want)
    assert sorted(a) == sorted(b)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("replicate", [2, 1])
def test_four_processes_equal_one_with_and_without_hsdp(data, one, two_by_two, tmp_path, replicate):
    if replicate == 2:
        out, stdout = two_by_two
    else:
        out = tmp_path / "four"
        stdout = train(*data, "--out", out, "--steps", STEPS, "--replicate", replicate, nproc=4).stdout
    assert "world=4 micro_batch=1" in stdout and "batch accum=2 " in stdout
    assert records(out, "config")[0]["replicate"] == replicate
    assert_same_run(out, one)


@pytest.mark.parametrize("first, then", [(4, 1), (1, 4)], ids=["2x2_then_1", "1_then_2x2"])
def test_a_checkpoint_moves_between_hsdp_and_one_process(data, one, two_by_two, tmp_path, first, then):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"

    def layout(n: int) -> list:
        return ["--replicate", 2] if n == 4 else []

    written = (two_by_two[0] if first == 4 else one) / "checkpoints" / "phase2"
    (step3,) = written.glob("step-00000003-*")  # what the `first` layout wrote at step 3
    shutil.copytree(step3, ckpt / "phase2" / step3.name)
    r = train(*data, "--out", out, "--checkpoint-dir", ckpt, "--steps", STEPS, *layout(then), nproc=then)
    assert re.search(rf"resume from={ckpt / 'phase2' / 'step-00000003'}-[0-9a-f]{{8}} step=3", r.stdout), r.stdout
    assert_same_run(out, one, first=4)


# One rank of a run that builds train.py's model, then takes two optimizer steps with train.py's train_step
# (2 micro-batches a rank), counting the collectives FSDP2 calls.
ACCUMULATE = textwrap.dedent("""
    import sys
    import numpy as np, torch, torch.distributed as dist
    sys.path.insert(0, {root!r})
    import train
    from minilm_az import parallel
    from minilm_az.config import TrainConfig
    from minilm_az.data import BatchStream
    from minilm_az.logs import MetricLogger
    from minilm_az.model import build_model, get_preset

    out, replicate = sys.argv[1], int(sys.argv[2])
    proc = parallel.setup("cpu")
    calls = []

    def counted(name, collective):
        def call(*args, group=None, **kwargs):
            calls.append((name, dist.get_world_size(group)))
            return collective(*args, group=group, **kwargs)
        return call

    # FSDP2 reduce-scatters with reduce_scatter_single (torch 2.13) or reduce_scatter_tensor (older torch),
    # and all-reduces across the HSDP replicas with all_reduce (torch/distributed/fsdp/_fully_shard/).
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))

    class Tokens:  # what BatchStream reads of a TokenStream
        split, ids = "train", np.random.default_rng(0).integers(0, 320, 20_000)
        num_tokens = len(ids)

        def get(self, offset, n):
            return self.ids[offset : offset + n]

    flags = TrainConfig(preset="tiny", seq_len=32, micro_batch=1, global_batch=2 * proc.world_size, steps=2)
    flags.replicate, flags.device = replicate, "cpu"
    plan = train.resolve(flags, proc.world_size)
    stream = BatchStream(Tokens(), 32, flags.global_batch, 1, proc.rank, proc.world_size)

    def two_steps():
        model = train.build(plan, proc, 320, MetricLogger(None, enabled=False))
        init = {{n: parallel.full_tensor(p.detach()) for n, p in model.named_parameters()}}
        alone = dict(build_model(get_preset("tiny", 320), seed=0).named_parameters())
        params = [p for p in model.parameters() if p.requires_grad]
        # SGD, as Adam's first update is about lr times the sign of each gradient: a rounding difference in a
        # gradient near zero would become a difference of 2 lr in the second step.
        optimizer = torch.optim.SGD(params, lr=0.1)
        steps = []
        for step in range(2):
            calls.clear()
            loss, grad_norm = train.train_step(model, optimizer, stream, step, params, plan, proc)
            counts = {{f"{{name}}/{{size}}": calls.count((name, size)) for name, size in set(calls)}}
            grads = {{n: parallel.full_tensor(p.grad) for n, p in model.named_parameters()}}
            loss = parallel.all_reduce_sum([loss], proc.device)[0] / proc.world_size
            steps.append(dict(loss=loss, grad_norm=grad_norm, counts=counts, grads=grads))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return dict(
            mesh=list(next(model.parameters()).device_mesh.shape),
            init_diff=max(float((t - alone[n]).abs().max()) for n, t in init.items()),
            groups=1 + len(model.model.layers),  # fully_shard on each block and on the root
            steps=steps,
        )

    once = two_steps()
    parallel.sync_gradients = lambda model, sync: None  # the old way: every micro-batch reduces its gradients
    every = two_steps()
    if proc.rank == 0:
        torch.save(dict(once=once, every=every, accum=stream.accum_steps), out)
    parallel.finish()
    parallel.teardown()
""")


def accumulate(tmp_path: Path, nproc: int, replicate: int) -> dict:
    script = tmp_path / "accumulate.py"
    script.write_text(ACCUMULATE.format(root=str(ROOT)))
    out = tmp_path / "accumulate.pt"
    # The script imports this checkout's train.py and minilm_az alone, as the server has: it may fork.
    ranks([script, out, replicate], nproc, timeout=180, any_script=True)
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("nproc, replicate", [(2, 1), (4, 2)], ids=["fsdp_2", "hsdp_2x2"])
def test_accumulation_reduces_once_a_step_with_the_same_numbers(tmp_path, nproc, replicate):
    report = accumulate(tmp_path, nproc, replicate)
    once, every, accum = report["once"], report["every"], report["accum"]
    shard = nproc // replicate
    assert once["mesh"] == ([replicate, shard] if replicate > 1 else [nproc])
    assert once["init_diff"] == 0.0  # the same initial weights as a model built on one process
    groups = once["groups"]
    assert accum == 2
    for a, b in zip(once["steps"], every["steps"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6
        for name, g in a["grads"].items():
            torch.testing.assert_close(g, b["grads"][name], rtol=0, atol=1e-6, msg=name)
        scatters = [k for k in a["counts"] if k.startswith("reduce_scatter")]
        assert len(scatters) == 1, a["counts"]  # one function, over groups of `shard` ranks
        assert scatters[0].endswith(f"/{shard}")
        assert a["counts"][scatters[0]] == groups  # once a step for each FSDP group
        assert b["counts"][scatters[0]] == accum * groups  # against once per micro-batch
        across = f"all_reduce/{replicate}"  # HSDP's all-reduce between the replicas
        if replicate > 1:
            assert a["counts"][across] == groups and b["counts"][across] == accum * groups


def test_finetune_hsdp_equals_fsdp_on_four_processes(small_tokenizer_dir, tmp_path):
    from minilm_az.hf import save_pretrained
    from minilm_az.model import build_model, get_preset
    from minilm_az.tokenizer import copy_tokenizer_files, load_tokenizer

    base = tmp_path / "base"
    copy_tokenizer_files(small_tokenizer_dir, str(base))
    vocab = load_tokenizer(str(base)).get_vocab_size()
    save_pretrained(build_model(get_preset("tiny", vocab_size=vocab), seed=0), str(base))
    chat = os.path.join(ROOT, "data", "chat", "az_chat.jsonl")
    args = [*("--model", base, "--data", chat, "--val-fraction", 0, "--steps", 2, "--global-batch", 8)]
    args += [*("--micro-batch", 1, "--lora-r", 4, "--lora-dropout", 0, "--lr", "3e-3", "--log-every", 1)]
    args += ["--no-packing"]  # 2 padded micro-batches a rank, so the step accumulates
    outs = {}
    for replicate in (1, 2):
        out = outs[replicate] = tmp_path / f"replicate{replicate}"
        ranks(["finetune.py", *args, "--replicate", replicate, "--out", out], 4)
    fsdp, hsdp = (records(outs[k], "finetune") for k in (1, 2))
    assert [r["step"] for r in hsdp] == [1, 2]
    for a, b in zip(fsdp, hsdp):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6
    a, b = (load_file(str(outs[k] / "adapter_model.safetensors")) for k in (1, 2))
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)


def test_replicate_must_divide_the_processes_not_only_fit_in_them():
    """--replicate 3 on 4 processes fits but does not divide them (test_bad_inputs' torchrun row runs 3 on 2)."""
    from minilm_az.parallel import check_replicate

    for replicate, world in ((1, 4), (2, 4), (4, 4), (2, 8)):
        check_replicate(replicate, world)
    with pytest.raises(ValueError, match=r"^--replicate 3 must divide the number of processes \(4\)$"):
        check_replicate(3, 4)
