"""parallel.agree: a problem that only some ranks (hosts) find stops every rank with one message that names the
rank and host, instead of leaving the others waiting in the next collective; one print per host."""

import os
import socket
import subprocess
import sys

import pytest
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank: int, world: int, port: int, cases: dict[str, list[int]], out: str) -> None:
    """Each case in turn, in one process group: `agree` is one collective a call and leaves none waiting."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), SM_CURRENT_HOST=f"algo-{rank + 1}")
    from minilm_az import parallel

    proc = parallel.setup("cpu")
    for case, failing in cases.items():

        def check(failing: list[int] = failing) -> int:
            if rank in failing:
                raise OSError(f"/opt/ml/checkpoints: not writable here ({'same' if len(failing) == world else rank})")
            return 7

        try:
            result = f"ok {parallel.agree(check, proc)}"
        except (ValueError, OSError) as e:
            result = f"{type(e).__name__}: {e}"
        with open(os.path.join(out, f"{case}-rank{rank}"), "w") as f:
            f.write(result)
    parallel.teardown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Two ranks (hosts), the ranks that fail a check, and what each rank then holds.
TWO_RANKS = {
    "none": ([], ["ok 7", "ok 7"]),
    "host2_only": ([1], ["ValueError: rank 1 on algo-2: /opt/ml/checkpoints: not writable here (1)"] * 2),
    "every_rank_alike": ([0, 1], ["OSError: /opt/ml/checkpoints: not writable here (same)"] * 2),  # the plain message
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> str:
    """The cases of TWO_RANKS, one after another, in one job of two processes (a job each cost 4 more torch starts)."""
    out = str(tmp_path_factory.mktemp("agree"))
    cases = {case: failing for case, (failing, _) in TWO_RANKS.items()}
    mp.spawn(_worker, args=(2, _free_port(), cases, out), nprocs=2, join=True)
    return out


@pytest.mark.parametrize("case", TWO_RANKS)
def test_every_rank_raises_the_first_failing_ranks_reason(two_ranks, case):
    got = [open(os.path.join(two_ranks, f"{case}-rank{r}")).read() for r in range(2)]
    assert got == TWO_RANKS[case][1]


def test_three_ranks_failing_differently_name_the_first_and_count_the_rest(tmp_path):
    mp.spawn(_worker, args=(3, _free_port(), {"two_fail": [1, 2]}, str(tmp_path)), nprocs=3, join=True)
    want = "ValueError: rank 1 on algo-2 (and 1 more ranks): /opt/ml/checkpoints: not writable here (1)"
    assert [(tmp_path / f"two_fail-rank{r}").read_text() for r in range(3)] == [want] * 3


@pytest.mark.parametrize(
    "local_rank, world_size, printed", [("0", "16", True), ("1", "16", False), ("1", None, True), ("abc", "16", True)]
)
def test_errors_print_once_per_host_on_its_local_rank_0(local_rank, world_size, printed):
    """Under torchrun (WORLD_SIZE > 1) only local rank 0 prints; a process alone, or a LOCAL_RANK that is no number
    (set by hand), always says why it stops."""
    code = "from minilm_az.logs import print_error; print_error('train.py', ValueError('rank 9 on algo-2: x'))"
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | {"RANK": "9", "LOCAL_RANK": local_rank}
    env |= {"WORLD_SIZE": world_size} if world_size else {}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.stderr == ("train.py: error: rank 9 on algo-2: x\n" if printed else ""), r.stderr


def test_under_torchrun_the_reason_is_in_its_summary_at_the_end_of_the_log(tmp_path):
    """torchrun ends a failed run with its own summary; each failing rank's error file puts our one line there, in
    place of "To enable traceback see: ...", so the reason is what a user reads last."""
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train.py"]
        + ["--data", str(tmp_path / "none"), "--tokenizer", str(tmp_path / "none"), "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=180,
    )
    line = f"train.py: error: --tokenizer {tmp_path / 'none'}: no such directory"
    assert r.returncode != 0 and r.stderr.count(line) >= 1, r.stderr[-3000:]
    tail = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()][-3:]
    assert tail[0].startswith("error_file:") and tail[1].startswith("traceback : " + line), tail
    assert not (tmp_path / "out").exists()
