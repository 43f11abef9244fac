"""Spot interruptions of a two-host job, over and over, with checkpoints straight to S3 (issue 37).

Each restart is a new replay of the same job (tests/sm_container.py: two containers, the toolkit's torchrun line
on each), whose every rank writes its part of each checkpoint to the job's s3:// prefix on a local S3 server.
Both hosts are killed at a random moment, mid-save more often than not (a checkpoint is written every step, in
the background). What is allowed after each restart is decided here, from S3's listing alone and without the
code under test: the job resumes from the newest checkpoint that has a commit object, never from step 0 while
one exists, and a commit never names an object S3 lacks; with checkpoint objects but no commit it exits 2 in one
line and deletes nothing, and the next launch passes --resume never --overwrite. When a job finally runs to the
end, its model must equal an uninterrupted single-process run's.
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm_container as smc  # noqa: E402
from test_multihost import TRAIN, _assert_same_model, _one_process, launch  # noqa: E402

STEPS = 8
ARGV = [*TRAIN[:6], str(STEPS), *TRAIN[7:], "--checkpoint-every", "1"]  # a save every step, in the background
# The reference: no checkpoint before its end, and one val micro-batch an evaluation (neither changes the model).
REFERENCE = [*ARGV[1:-2], "--checkpoint-every", "0", "--eval-batches", "1"]
# Restarts after a kill of both hosts, over all episodes: 4 in the suite, as each is a job of two replayed hosts
# (~18 s of CPU on 2 cores); tests/test_s3_checkpoint.py kills the same workers 16 times more without the
# container, so 20 in all, issue 37's count. A run of 8 here hit a save in every kill (8 of 8); issue 37's
# measurement ran 20 on this path alone (MINILM_AZ_SPOT_KILLS=20 pytest -s this file).
KILLS = int(os.environ.get("MINILM_AZ_SPOT_KILLS", 4))
SEED = 20261205
NAME = re.compile(r"step-\d{8}-[0-9a-f]{8}")


@pytest.fixture
def aws(aws):
    """conftest's moto-mocked boto3 session, where this machine can replay two containers at once."""
    why = smc.unavailable("v2")
    if why:
        pytest.skip(why)
    if smc.isolation_mode() != "namespace":
        pytest.skip("a replay of several hosts needs mount namespaces (unshare and mount, e.g. as root)")
    return aws


def in_s3(uri: str) -> tuple[list[str], list[str], dict[str, int]]:
    """(checkpoints S3 holds a commit of, newest first; every checkpoint name S3 has an object of; all objects).

    A commit must list only objects S3 holds, at their size: that is checked here, for every commit."""
    objects = smc.s3_objects(uri)
    names = sorted({k.split("/")[0] for k in objects if NAME.fullmatch(k.split("/")[0])}, reverse=True)
    committed = [n for n in names if f"{n}/commit.json" in objects]
    for name in committed:
        bucket, key = uri[len("s3://") :].split("/", 1)
        body = smc.s3_server().boto().get_object(Bucket=bucket, Key=f"{key}{name}/commit.json")["Body"].read()
        for file, size in json.loads(body)["objects"].items():
            assert objects.get(f"{name}/{file}") == size, (name, file, size, objects.get(f"{name}/{file}"))
    return committed, names, objects


def resumed_from(run: smc.JobRun) -> str | None:
    found = re.search(r"^resume from=\S*/(step-\d{8}-[0-9a-f]{8}) step=", run.host(1).log, re.M)
    return found.group(1) if found else None


@pytest.mark.slow
def test_kills_of_both_hosts_at_random_resume_from_the_newest_checkpoint_s3_has_committed(
    aws, tmp_path, container_shards_dir, small_tokenizer_dir
):
    rng = np.random.default_rng(SEED)
    # The uninterrupted single-process run runs beside the launch and the first job.
    pool = ThreadPoolExecutor(1)
    reference = pool.submit(_one_process, REFERENCE, tmp_path / "one", container_shards_dir, small_tokenizer_dir)
    pool.shutdown(wait=False)
    inputs = {"--data": container_shards_dir, "--tokenizer": small_tokenizer_dir}

    def episode(k: int):
        """One job (the one every restart replays) and its fresh start, over a prefix of their own."""
        where = ["--checkpoint-s3", f"s3://{smc.BUCKET}/spot-{tmp_path.name}/{k}/"]
        job = launch(aws, [*ARGV, *where], hosts=2, inputs=inputs)
        return job, job.plan.checkpoint_uri + "phase2/"

    (job, uri), fresh = episode(0), None
    kills = episodes = runs = 0
    seen = {"resumed": 0, "refused": 0, "mid-save": 0}
    never = False
    while kills < KILLS or episodes == 0:
        runs += 1
        committed, names, before = in_s3(uri)
        start = 0 if never or not committed else int(committed[0].split("-")[1])
        triggers = []
        killing = kills < KILLS and start < STEPS
        if killing:  # both hosts, up to a second after a step's line: inside the next step, its save, or the export
            at = int(rng.integers(start + 1, STEPS + 1))
            triggers.append(
                smc.Trigger(line=rf"^train step={at} ", host=1, seconds=float(rng.uniform(0, 1)), kill="all")
            )
        if never and fresh is None:
            fresh = launch(aws, [*job_argv(job), "--resume", "never", "--overwrite"], hosts=2, inputs=inputs)
        run = smc.replay_job(
            aws, fresh if never else job, workdir=tmp_path / f"run-{runs}", hosts=2, nproc=1, timeout=180,
            triggers=triggers,
        )  # fmt: skip
        story = f"run {runs} (seed {SEED}): S3 held {names}, committed {committed}\n{run.explain()}"
        assert not run.timed_out, story
        if not never and names and not committed:  # nothing to resume: one line, exit 2, nothing deleted
            # train.py's status 2 is in torchrun's failure summary; the container's is the toolkit's (1)
            assert run.returncode != 0 and not any(h.killed for h in run.hosts), story
            for k in (1, 2):
                errors = [ln for ln in run.host(k).log.splitlines() if ln.startswith("train.py: error:")]
                assert len(errors) == 1 and "no checkpoint can be resumed" in errors[0], story
                assert re.search(r"exitcode\s*:\s*2 ", run.host(k).log), story
            assert in_s3(uri)[2] == before, story
            seen["refused"] += 1
            never = True
            continue
        assert resumed_from(run) == (committed[0] if committed and not never else None), story
        seen["resumed"] += bool(resumed_from(run))
        never = False
        if run.returncode == 0:  # this job ran to the end: the model of an unbroken run
            _assert_same_model(run.host(1).model_dir, reference.result(), list(range(start + 1, STEPS + 1)))
            episodes += 1
            (job, uri), fresh = episode(episodes), None
            continue
        assert killing and all(h.killed for h in run.hosts), story
        kills += 1
        committed_now, names_now, _ = in_s3(uri)
        # A kill never loses the newest commit: only a newer commit lets a prune delete an older one.
        assert not committed or (committed_now and committed_now[0] >= committed[0]), story
        seen["mid-save"] += bool(set(names_now) - set(committed_now))  # a save was being written when they went
    print(f"{runs} jobs, {kills} kills, {episodes} finished, {seen}")
    assert seen["resumed"] >= KILLS // 2 and seen["mid-save"] >= KILLS // 4, seen  # what the kills hit, roughly


def job_argv(job) -> list[str]:
    """The launcher's argv of `job`'s train stage, with its checkpoint prefix: what a fresh start relaunches."""
    return [*ARGV, "--checkpoint-s3", job.plan.checkpoint_uri]
