"""Checkpoints straight to S3 (minilm_az/s3.py, checkpoint.S3Checkpointer), against a local S3 server
(tests/s3_server.py).

A job here is two simulated hosts of 2 processes each, started with torchrun's environment (RANK, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR...), each host with its own --out and its own SM_CURRENT_HOST, sharing nothing but
the S3 prefix and loopback. A restart is a new job; a kill is SIGKILL to every process of both hosts at a random
moment. What a restart must do is decided here from S3's listing alone (boto3, not the code under test): resume
from the newest checkpoint that has its commit object, or, when the prefix holds checkpoint objects but no
commit, exit 2 in one line and delete nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefork  # noqa: E402
from s3_server import S3Server, free_port  # noqa: E402
from test_multihost import TRAIN, _assert_same_model, _one_process  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
# A save every step, in the background; one val micro-batch an evaluation (it changes neither model nor RNG).
ARGV = [*TRAIN[1:6], str(STEPS), *TRAIN[7:], "--eval-batches", "1", "--checkpoint-every", "1"]
REFERENCE = [*ARGV[:-2], "--checkpoint-every", "0"]  # no checkpoint before its end
# Kills of both hosts at random moments. The suite runs 16 here (a restart is four forks, ~6 s of CPU) and 4 more
# through the container replay (tests/test_spot_restarts.py, ~18 s each), 20 in all, the count, within
# CI's budget; MINILM_AZ_S3_KILLS=20 runs the count on this path alone (~210 s on 2 cores).
KILLS = int(os.environ.get("MINILM_AZ_S3_KILLS", 16))
SEED = 20270101
COMMIT = "commit.json"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server.start(tmp_path_factory.mktemp("s3server"))
    yield server
    server.stop()


_buckets = iter(range(10**6))


def new_bucket(s3: S3Server) -> str:
    name = f"ckpt-{os.getpid()}-{next(_buckets)}"
    s3.make_bucket(name)
    return name


# ---------------------------------------------------------------------------------------------
# Jobs of two simulated hosts


class Job:
    """One launch of a job: `hosts` hosts of `nproc` processes each, their output lines collected per host."""

    def __init__(self, argv: list[str], workdir: Path, env: dict, hosts: int = 2, nproc: int = 2):
        self.lines: list[list[str]] = [[] for _ in range(hosts)]
        self.nproc = nproc
        self.procs: list = []
        self.readers: list[threading.Thread] = []
        self.outs = [workdir / f"algo-{k + 1}" / "out" for k in range(hosts)]
        port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        # The workers as torchrun starts them (its environment contract), without the agents, each forked from an
        # interpreter that imported torch once (tests/prefork.py): a restart of four processes then costs no
        # imports on CI's two cores. Each host has its own name and its own --out.
        for rank in range(hosts * nproc):
            k, local = divmod(rank, nproc)
            host_env = {
                **env,
                **dict(RANK=rank, WORLD_SIZE=hosts * nproc, LOCAL_RANK=local, LOCAL_WORLD_SIZE=nproc),
                **dict(GROUP_RANK=k, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RUN_ID="s3-test"),
                "SM_CURRENT_HOST": f"algo-{k + 1}",
                "OMP_NUM_THREADS": "1",
            }
            cmd = [sys.executable, "train.py", *argv, "--out", str(self.outs[k])]
            log = workdir / f"rank-{rank}.log"
            p = prefork.start(cmd, str(ROOT), {key: str(v) for key, v in host_env.items()}, str(log))
            self.procs.append(p)
            self.readers.append(threading.Thread(target=self._read, args=(p, log, self.lines[k]), daemon=True))
            self.readers[-1].start()

    @staticmethod
    def _read(p, log: Path, into: list[str]) -> None:
        """Follow the process's output file into `into`, line by line, until it ended and all is read."""
        with open(log, "a+", encoding="utf-8", errors="replace") as f:
            f.seek(0)
            part = ""
            while True:
                ended = p.poll() is not None
                part += f.read()
                *lines, part = part.split("\n")
                into.extend(lines)
                if ended:
                    if part:
                        into.append(part)
                    return
                time.sleep(0.01)

    def wait_for(self, pattern: str, timeout: float = 120) -> bool:
        """Until host 1 logs a line matching `pattern` (True), or both hosts ended first (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, ln) for ln in list(self.lines[0])):
                return True
            if all(p.poll() is not None for p in self.procs):
                return any(re.search(pattern, ln) for ln in list(self.lines[0]))
            time.sleep(0.02)
        raise AssertionError(f"no line {pattern!r} in {timeout} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL every process of every host, and anything they started."""
        pids = set()
        for p in self.procs:
            pids |= _tree(p.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.wait()

    def wait(self, timeout: float = 180) -> list[int]:
        """Each host's exit status: its first process's that failed, else 0 (as torchrun's agent reports it)."""
        codes = [p.wait(timeout=timeout) for p in self.procs]
        for reader in self.readers:  # each reads to the end of its file once its process ended
            reader.join(timeout=10)
        per_host = [codes[k * self.nproc : (k + 1) * self.nproc] for k in range(len(self.outs))]
        return [next((c for c in host if c), 0) for host in per_host]

    def log(self, k: int = 0) -> str:
        return "\n".join(self.lines[k])


def _tree(pid: int) -> set[int]:
    """pid and every process below it."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo += children.get(p, [])
    return found


def committed(s3: S3Server, bucket: str, prefix: str) -> tuple[list[str], list[str]]:
    """(names of committed checkpoints, newest first; every checkpoint name S3 has an object of), from boto3."""
    files: dict[str, set[str]] = {}
    for key in s3.keys(bucket, prefix):
        name, _, file = key[len(prefix) :].partition("/")
        files.setdefault(name, set()).add(file)
    step = lambda n: (int(n.split("-")[1]), n)  # noqa: E731
    return sorted((n for n, f in files.items() if COMMIT in f), key=step, reverse=True), sorted(files, key=step)


def commits_point_at_objects(s3: S3Server, bucket: str, prefix: str) -> None:
    """Every commit object lists only objects that S3 holds, at the size it lists."""
    objects = s3.objects(bucket, prefix)
    for key in objects:
        if key.endswith("/" + COMMIT):
            folder = key[: -len(COMMIT)]
            listed = json.loads(s3.boto().get_object(Bucket=bucket, Key=key)["Body"].read())["objects"]
            for file, size in listed.items():
                assert objects.get(folder + file) == size, (key, file)


def resumed_from(log: str) -> str | None:
    found = re.search(r"^resume from=\S*/(step-\d{8}-[0-9a-f]{8}) step=", log, re.M)
    return found.group(1) if found else None


@pytest.mark.slow
def test_two_hosts_killed_at_random_resume_from_the_newest_commit_and_finish_as_one_process(
    s3, tmp_path, container_shards_dir, small_tokenizer_dir
):
    rng = np.random.default_rng(SEED)
    pool = ThreadPoolExecutor(1)
    inputs = ["--data", container_shards_dir, "--tokenizer", small_tokenizer_dir]
    reference = pool.submit(_one_process, REFERENCE, tmp_path / "one", container_shards_dir, small_tokenizer_dir)
    pool.shutdown(wait=False)
    env = {**os.environ, **s3.env()}
    bucket, episodes, kills, runs, never = new_bucket(s3), 0, 0, 0, False
    seen = {"resumed": 0, "refused": 0, "mid-save": 0}
    while kills < KILLS or episodes == 0:
        runs += 1
        prefix = f"job-{episodes}/phase2/"
        whole, names = committed(s3, bucket, prefix)
        before = s3.objects(bucket, prefix)
        refuse = names and not whole and not never
        start = 0 if never or not whole else int(whole[0].split("-")[1])
        argv = [*ARGV, *inputs, "--checkpoint-dir", f"s3://{bucket}/job-{episodes}"]
        job = Job([*argv, *(["--resume", "never", "--overwrite"] if never else [])], tmp_path / f"run-{runs}", env)
        killing = kills < KILLS and start < STEPS and not refuse
        if killing:  # up to a second after a step's line: inside the next step, its save, its commit or the export
            at = int(rng.integers(start + 1, min(start + 3, STEPS + 1)))  # a restart costs more than a step
            if job.wait_for(rf"^train step={at} "):
                time.sleep(float(rng.uniform(0, 1)))
            job.kill()
        codes = job.wait()
        story = f"run {runs}: S3 held {names}, committed {whole}\n--- algo-1 ---\n{job.log(0)}\n--- algo-2 ---\n"
        story += job.log(1)
        commits_point_at_objects(s3, bucket, prefix)
        if refuse:  # objects but no commit: one line, exit 2, nothing deleted
            assert codes[0] != 0 and codes[0] != -9, story
            for k in (0, 1):
                errors = [ln for ln in job.log(k).splitlines() if ln.startswith("train.py: error:")]
                assert len(errors) == 1 and "no checkpoint can be resumed" in errors[0], story
            assert s3.objects(bucket, prefix) == before, story
            seen["refused"] += 1
            never = True
            continue
        assert resumed_from(job.log(0)) == (whole[0] if whole and not never else None), story
        seen["resumed"] += bool(resumed_from(job.log(0)))
        never = False
        if codes == [0, 0]:  # this job ran to the end: the model of an unbroken run
            _assert_same_model(job.outs[0], reference.result(), list(range(start + 1, STEPS + 1)))
            episodes += 1
            continue
        assert killing and codes[0] == -9, story
        kills += 1
        after, names_after = committed(s3, bucket, prefix)
        seen["mid-save"] += bool(set(names_after) - set(after))  # a save was being written when the hosts went
    print(f"{runs} jobs, {kills} kills, {episodes} finished, {seen}")
    assert seen["resumed"] >= KILLS // 3 and seen["mid-save"] >= KILLS // 5, seen


# ---------------------------------------------------------------------------------------------
# S3 faults, injected by the server, against the Checkpointer in this process


@pytest.fixture
def group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def aws_env(s3, monkeypatch):
    for key, value in {**s3.env(), "AWS_MAX_ATTEMPTS": "3"}.items():
        monkeypatch.setenv(key, value)
    yield s3
    s3.faults()


def _tiny():
    import torch

    from minilm_az.model import ModelConfig, materialize, meta_model

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=64)
    model = materialize(meta_model(cfg), torch.device("cpu"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 320, (2, 16))).float().pow(2).mean().backward()
    opt.step()
    return model, opt, {"model": cfg.to_dict(), "phase": 2}


def _same(a, b) -> bool:
    return all(x.equal(y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_s3_faults_are_retried_or_fail_the_save_in_one_line_and_the_previous_commit_stays_usable(
    group, aws_env, monkeypatch
):
    import torch

    from minilm_az import parallel
    from minilm_az.checkpoint import CheckpointError, S3Checkpointer

    s3, bucket = aws_env, new_bucket(aws_env)
    proc = parallel.Process(0, 1, 0, torch.device("cpu"))
    uri = f"s3://{bucket}/run"
    model, opt, state = _tiny()
    ck = S3Checkpointer(uri, proc, keep=2, async_save=True)
    # The first try of every PUT (each object, each part, the commit) answered 503 (throttling), then 500, then
    # its connection reset: the client retries each, and every save commits.
    for step, faults in enumerate([dict(put_status=503), dict(put_status=500), dict(reset_share=1.0)], 1):
        s3.faults(**faults, put_share=1.0 if "put_status" in faults else 0, once=True, match=r"/run/")
        ck.save(step, model, opt, state)
        assert ck.finalize() == f"{uri}/step-{step:08d}-{ck.token}", faults
    s3.faults()
    # A slow PUT: the loop waits only for the copy; the commit comes once the upload is done.
    s3.faults(put_delay_s=1.5, match=r"\.distcp$")
    started = time.monotonic()
    ck.save(4, model, opt, state)
    returned = time.monotonic() - started
    assert returned < 1.0 and not ck.pending_done(), returned
    assert ck.finalize().endswith("step-00000004-" + ck.token)
    # Every PUT of the data answered 500: after AWS_MAX_ATTEMPTS the save fails, in one line, and commits nothing.
    s3.faults(put_status=500, put_share=1.0, match=r"\.distcp$")
    ck.save(5, model, opt, state)
    with pytest.raises(CheckpointError) as failed:
        ck.finalize()
    message = str(failed.value)
    assert "\n" not in message and "checkpoint of step 5 was not written" in message, message
    assert message.endswith(f"the last committed one is {uri}/step-00000004-{ck.token}"), message
    s3.faults()
    whole, names = committed(s3, bucket, "run/")
    assert whole == [f"step-00000004-{ck.token}", f"step-00000003-{ck.token}"], (whole, names)
    commits_point_at_objects(s3, bucket, "run/")
    # The previous checkpoint loads exactly; the failed one is skipped with a warning naming it.
    again, again_opt, _ = _tiny()
    for p in again.parameters():
        p.data.zero_()
    warnings = []
    resumer = S3Checkpointer(uri, proc, async_save=False)
    step, _ = resumer.resume(again, again_opt, {"phase": 2}, {}, warnings.append, steps=100)
    assert step == 4 and _same(again, model), step
    skipped = f"warning: {uri}/step-00000005-{ck.token} is not committed (a save that did not finish); skipped"
    assert warnings in ([], [skipped]), warnings  # the failed save may have left no object at all
    # The next good save prunes the failed attempt's leftovers and what the keep count drops, never a user's name.
    s3.boto().put_object(Bucket=bucket, Key="run/step-00000001-best/note", Body=b"mine")
    resumer.save(6, model, opt, state)
    assert committed(s3, bucket, "run/")[1] == [
        "step-00000001-best",
        f"step-00000004-{ck.token}",
        f"step-00000006-{resumer.token}",
    ]


PROBE = """
import sys
from minilm_az.s3 import S3Error, Store
try:
    Store(sys.argv[1]).probe("test")
except S3Error as e:
    sys.exit(str(e))
"""


def test_the_write_probe_names_a_missing_bucket_credentials_and_region_in_one_line(group, aws_env, monkeypatch):
    from minilm_az.s3 import S3Error, Store, is_s3

    with pytest.raises(S3Error) as missing:
        Store("s3://no-such-bucket-here/run").probe("test")
    assert "\n" not in str(missing.value) and "cannot LIST s3://no-such-bucket-here/run/" in str(missing.value)
    assert "bucket does not exist" in str(missing.value) and "s3:PutObject" in str(missing.value)
    # No credentials anywhere: the LIST says so (a PUT said only that its request had ended), and the process
    # exits on its one line (a failed PUT's stream, left to the exit, was an 84-line panic of the native client).
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k in ("AWS_REGION",)}
    env |= {"AWS_ENDPOINT_URL_S3": aws_env.url, "AWS_EC2_METADATA_DISABLED": "true", "HOME": str(ROOT / "nowhere")}
    env |= {"AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    uri = f"s3://{new_bucket(aws_env)}/run"
    r = subprocess.run([sys.executable, "-c", PROBE, uri], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr[-2000:]
    assert f"cannot LIST {uri}/.minilm-az-probe-test" in r.stderr and "no AWS credentials found" in r.stderr
    aws_env.faults(put_status=403, put_share=1.0, match=r"/run/")  # credentials that may read but not write
    with pytest.raises(S3Error) as denied:
        Store(uri).probe("test")
    aws_env.faults()
    assert f"cannot PUT {uri}/.minilm-az-probe-test" in str(denied.value) and "Forbidden" in str(denied.value)
    for attempts in ("0", "101", "99999999999", "x"):  # past a C int the client itself panicked
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", attempts)
        with pytest.raises(S3Error, match=rf"^AWS_MAX_ATTEMPTS={attempts}: not a whole number of attempts from 1"):
            Store("s3://bkt/run")
    for url in ("S3://bkt/run", "s3a://bkt/run", "s3:/bkt/run", "s3:bkt/run", "gs://bkt/run"):
        with pytest.raises(S3Error, match=rf"^--checkpoint-dir {url}: a URL, but not s3://BUCKET/PREFIX"):
            is_s3(url)
    assert not is_s3("runs/s3-checkpoints") and not is_s3(None) and is_s3("s3://bkt/run")
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    with pytest.raises(S3Error, match=r"^s3://bkt/run: no AWS region: set AWS_REGION"):
        Store("s3://bkt/run")
    with pytest.raises(S3Error, match=r"^s3://Bad_Bucket/run: 'Bad_Bucket' is not an S3 bucket name"):
        Store("s3://Bad_Bucket/run")  # refused before any request, not a client's dump of a 404
    with pytest.raises(S3Error, match=r"^s3://bkt//run: not an S3 prefix"):
        Store("s3://bkt//run")  # "bkt//run" and "bkt/run" are two prefixes on S3


def test_a_checkpoint_whose_records_disagree_with_its_name_is_skipped_with_a_warning_and_nothing_deleted(
    group, aws_env
):
    """A folder whose train_state.json or commit.json does not record the step it is named for (a copy renamed to
    a newer step, a state edited by hand, not a dict, a step that is no number) is skipped with a warning naming
    it, and the one before it resumes; nothing is deleted. Resuming it resumed older weights as the newer step,
    and the next prune removed the checkpoints that really were newer."""
    import torch

    from minilm_az import parallel
    from minilm_az.checkpoint import S3Checkpointer

    s3, bucket = aws_env, new_bucket(aws_env)
    proc, uri, client = parallel.Process(0, 1, 0, torch.device("cpu")), f"s3://{bucket}/run", aws_env.boto()
    model, opt, state = _tiny()
    ck = S3Checkpointer(uri, proc, keep=5, async_save=False)
    ck.save(1, model, opt, state)
    ck.save(2, model, opt, state)
    second = ck.last().rsplit("/", 1)[1]

    def copy(name: str, state: str | None = None) -> None:
        """Step 2's objects under `name`, its state replaced by `state`, and a commit that matches them."""
        for key in s3.keys(bucket, f"run/{second}/"):
            client.copy_object(Bucket=bucket, Key=key.replace(second, name), CopySource={"Bucket": bucket, "Key": key})
        if state is not None:
            client.put_object(Bucket=bucket, Key=f"run/{name}/train_state.json", Body=state.encode())
        commit = json.loads(client.get_object(Bucket=bucket, Key=f"run/{name}/{COMMIT}")["Body"].read())
        listed = client.list_objects_v2(Bucket=bucket, Prefix=f"run/{name}/")["Contents"]
        held = {o["Key"].rsplit("/", 1)[1]: o for o in listed if not o["Key"].endswith(COMMIT)}
        commit["objects"], commit["etags"] = ({f: o[k] for f, o in held.items()} for k in ("Size", "ETag"))
        client.put_object(Bucket=bucket, Key=f"run/{name}/{COMMIT}", Body=json.dumps(commit).encode())

    renamed = f"step-00000009-{ck.token}"  # step 2's objects and commit under a newer step's name
    copy(renamed)
    states = {"{}": "None", "[]": "None", '{"step": "two"}': "'two'", '{"step": 8.0}': "8.0"}
    for i, text in enumerate(states):  # each in a newer copy of step 2, its state replaced
        copy(f"step-0000001{i}-{ck.token}", text)
    before = s3.objects(bucket, "run/")
    again, again_opt, _ = _tiny()
    warnings = []
    step, saved = S3Checkpointer(uri, proc, keep=2, async_save=False).resume(
        again, again_opt, {}, {}, warnings.append, 100
    )
    assert step == 2 and saved["step"] == 2 and _same(again, model), warnings
    assert len(warnings) == 5 and all("cannot be resumed" in w and "\n" not in w for w in warnings), warnings
    for (text, shown), warning in zip(reversed(states.items()), warnings):
        assert f"train_state.json records step {shown}, not the step its folder" in warning, (text, warning)
    assert f"train_state.json records step 2, not the step its folder {renamed} is named for" in warnings[-1]
    assert s3.objects(bucket, "run/") == before  # nothing deleted


def test_an_object_written_again_after_its_commit_with_as_many_bytes_is_not_resumed(group, aws_env):
    """A flipped byte in a data object, written back whole (same size): the commit records each object's ETag,
    which S3 changes on every write, so the checkpoint is skipped with a warning naming the object."""
    import torch

    from minilm_az import parallel
    from minilm_az.checkpoint import S3Checkpointer

    s3, bucket = aws_env, new_bucket(aws_env)
    proc, uri, client = parallel.Process(0, 1, 0, torch.device("cpu")), f"s3://{bucket}/run", aws_env.boto()
    model, opt, state = _tiny()
    ck = S3Checkpointer(uri, proc, keep=2, async_save=False)
    ck.save(1, model, opt, state)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randint(0, 320, (2, 16))).float().pow(2).mean().backward()
    opt.step()
    ck.save(2, model, opt, state)
    key = next(k for k in s3.keys(bucket, "run/") if "step-00000002" in k and k.endswith(".distcp"))
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    again, again_opt, _ = _tiny()
    warnings = []
    step, _ = S3Checkpointer(uri, proc, keep=2, async_save=False).resume(again, again_opt, {}, {}, warnings.append, 9)
    assert step == 1 and all(v.equal(want[k]) for k, v in again.state_dict().items()), warnings
    name = key.split("/")[-1]
    assert len(warnings) == 1 and f"({name}, for {COMMIT}, is missing or not as committed in S3 (" in warnings[0]
    # A commit edited to list nothing, its RNG object gone: what a save of its world size writes is required, not
    # only what the commit lists (a missing RNG loaded as a fresh one, silently). One without its ETags: refused.
    commit_key = key.rsplit("/", 1)[0] + f"/{COMMIT}"
    commit = json.loads(client.get_object(Bucket=bucket, Key=commit_key)["Body"].read())
    client.delete_object(Bucket=bucket, Key=key.rsplit("/", 1)[0] + "/rng-00000.safetensors")
    for edited, reason in (({**commit, "objects": {}, "etags": {}}, "(.metadata, for"), (commit, "KeyError: 'etags'")):
        edited = {k: v for k, v in edited.items() if k != "etags"} if edited is commit else edited
        client.put_object(Bucket=bucket, Key=commit_key, Body=json.dumps(edited).encode())
        warnings.clear()
        step, _ = S3Checkpointer(uri, proc, keep=2, async_save=False).resume(
            again, again_opt, {}, {}, warnings.append, 9
        )
        assert step == 1 and len(warnings) == 1 and reason in warnings[0], warnings


def test_a_second_run_on_the_same_prefix_stops_at_its_first_commit_and_deletes_nothing(group, aws_env):
    """S3 has no lock a killed run would let go of. A folder under the prefix that is neither this run's nor was
    there when it started is another run's: the save fails in one line, before its commit and its prune (which
    would delete the other run's checkpoints), and the other run's checkpoints stay."""
    import torch

    from minilm_az import parallel
    from minilm_az.checkpoint import CheckpointError, S3Checkpointer

    s3, bucket = aws_env, new_bucket(aws_env)
    proc, uri = parallel.Process(0, 1, 0, torch.device("cpu")), f"s3://{bucket}/run"
    model, opt, state = _tiny()
    first, second = (S3Checkpointer(uri, proc, keep=1, async_save=False) for _ in range(2))
    for ck in (first, second):
        assert ck.resume(model, opt, {}, {}, print, 100) == (0, None)
    first.save(1, model, opt, state)
    kept = s3.objects(bucket, "run/")
    with pytest.raises(CheckpointError) as e:
        second.save(2, model, opt, state)
    assert str(e.value) == (
        f"{uri}: checkpoint of step 2 was not written (another run writes under this prefix "
        f"(step-00000001-{first.token} appeared since this one started): one prefix takes one run at a time); the "
        "last committed one is none yet"
    )
    assert kept.items() <= s3.objects(bucket, "run/").items()  # the first run's checkpoint is whole
    assert f"run/step-00000002-{second.token}/{COMMIT}" not in s3.objects(bucket, "run/")


# ---------------------------------------------------------------------------------------------
# Issue 37's three scenarios, on the new design. Under SageMaker's per-host sync each one lost a job or started
# it at step 0 silently; here none may lose a committed checkpoint or start at step 0 without a word.


def test_a_host_stalled_mid_save_leaves_the_previous_commit_usable_and_its_leftovers_are_pruned_later(group, aws_env):
    """Scenario 1, a lagging host. With S3 there is no per-host upload to lag: a rank whose PUTs stall holds back
    only its own save, which stays uncommitted; the restarted job resumes from the commit before it, and its
    next commit prunes the stalled attempt's objects, never a commit."""
    import torch

    from minilm_az import parallel
    from minilm_az.checkpoint import S3Checkpointer

    s3, bucket = aws_env, new_bucket(aws_env)
    proc, uri = parallel.Process(0, 1, 0, torch.device("cpu")), f"s3://{bucket}/run"
    model, opt, state = _tiny()
    lagging = S3Checkpointer(uri, proc, keep=2, async_save=True)
    lagging.save(1, model, opt, state)
    first = lagging.finalize()
    s3.faults(put_delay_s=2.0, match=rf"step-00000002-{lagging.token}/")  # this host's uploads stall
    lagging.save(2, model, opt, state)  # and then the job is lost: this save is never finalized
    restarted, again_opt, _ = _tiny()
    for p in restarted.parameters():
        p.data.zero_()
    warnings = []
    resumer = S3Checkpointer(uri, proc, keep=2, async_save=False)
    step, _ = resumer.resume(restarted, again_opt, {"phase": 2}, {}, warnings.append, steps=100)
    assert (step, resumer.last()) == (1, first) and _same(restarted, model), (step, warnings)
    lagging._pending[2].join()  # the stalled upload lands late, and still nothing commits it
    s3.faults()
    whole, names = committed(s3, bucket, "run/")
    assert whole == [first.rsplit("/", 1)[1]] and f"step-00000002-{lagging.token}" in names, (whole, names)
    resumer.save(2, restarted, again_opt, state)
    resumer.save(3, restarted, again_opt, state)
    whole, names = committed(s3, bucket, "run/")
    assert names == [f"step-00000002-{resumer.token}", f"step-00000003-{resumer.token}"] == whole[::-1], names
    commits_point_at_objects(s3, bucket, "run/")


def test_keep_checkpoints_1_never_leaves_s3_without_a_commit(group, aws_env):
    """Scenario 2, --keep-checkpoints 1: the one kept checkpoint is deleted only after the next one's commit, so a
    save lost half-way (its objects up, no commit) leaves the previous commit to resume from."""
    import torch

    from minilm_az import parallel
    from minilm_az.checkpoint import S3Checkpointer

    s3, bucket = aws_env, new_bucket(aws_env)
    proc, uri = parallel.Process(0, 1, 0, torch.device("cpu")), f"s3://{bucket}/run"
    model, opt, state = _tiny()
    ck = S3Checkpointer(uri, proc, keep=1, async_save=True)
    for step in (1, 2):
        ck.save(step, model, opt, state)
        ck.finalize()
        assert committed(s3, bucket, "run/") == ([f"step-{step:08d}-{ck.token}"],) * 2
    s3.faults(put_delay_s=1.0, match=r"step-00000003-")
    ck.save(3, model, opt, state)  # lost before its commit
    ck._pending[2].join()
    s3.faults()
    whole, names = committed(s3, bucket, "run/")
    assert whole == [f"step-00000002-{ck.token}"] and len(names) == 2, (whole, names)
    again, again_opt, _ = _tiny()
    step, _ = S3Checkpointer(uri, proc, keep=1, async_save=False).resume(again, again_opt, {}, {}, print, 100)
    assert step == 2 and _same(again, model)


EMPTY_ON_RANK0 = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_s3_checkpoint import _tiny
from minilm_az.checkpoint import Checkpointer, CheckpointError
from minilm_az.parallel import Process
rank, store, ckpt_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
model, opt, _ = _tiny()
ck = Checkpointer(ckpt_dir, Process(rank, 2, 0, torch.device("cpu")), async_save=False)
try:
    print("resumed at step", ck.resume(model, opt, {{}}, {{}}, print, 100)[0])
except CheckpointError as e:
    print("refused:", e)
dist.destroy_process_group()
"""


def test_an_empty_checkpoint_dir_on_rank_0s_host_is_refused_on_every_rank_never_a_silent_step_0(group, tmp_path):
    """Scenario 3: rank 0's host sees an empty dir, rank 1's host the checkpoints. "Nothing to resume" is decided
    from every rank's view: the ranks disagree, so every rank refuses in one line, and nothing is deleted."""
    import torch

    from minilm_az import parallel
    from minilm_az.checkpoint import Checkpointer, step_dirs

    model, opt, state = _tiny()
    full, empty = tmp_path / "host1", tmp_path / "host0"
    empty.mkdir()
    Checkpointer(str(full), parallel.Process(0, 1, 0, torch.device("cpu")), async_save=False).save(1, model, opt, state)
    before = step_dirs(str(full))
    script = tmp_path / "two.py"
    script.write_text(EMPTY_ON_RANK0.format(tests=os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "store"), str([empty, full][r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for rank, (out, err) in enumerate(outs):
        lines = out.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("refused: "), (rank, out, err[-2000:])
        assert "the ranks see different checkpoints (rank 0 sees 0, newest none; rank 1 sees 1" in lines[0], lines
        assert "s3://BUCKET/PREFIX" in lines[0], lines
    assert step_dirs(str(full)) == before and os.listdir(empty) == []
