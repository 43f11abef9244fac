"""The SageMaker launcher, against moto's in-process mock of S3 and SageMaker (nothing leaves the machine).

Also the container side: the argv the container builds from our hyperparameters, sm_entry.py's
subcommand reordering, and train.py's log lines against the metric regexes we send. The contract field
by field is tests/test_contract.py; whole jobs replayed in a simulated container, tests/test_sm_container.py.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile

import prefork
import pytest
from conftest import BUCKET, ROLE  # the mocked account the aws fixture sets up

from minilm_az import config as C
from minilm_az.launch import sagemaker as sm
from minilm_az.logs import format_line

ROOT = sm.PROJECT_ROOT
TRAIN_SCRIPT, TOKENIZE_SCRIPT = sm.STAGES["train"].script, sm.STAGES["tokenize"].script


def regex(name: str, metrics=sm.TRAIN_METRICS) -> re.Pattern:
    return re.compile(next(m["Regex"] for m in metrics if m["Name"] == name))


# ---------------------------------------------------------------------------------------------
# Metric regexes against lines written by minilm_az.logs


TRAIN_LINE = format_line(
    "train",
    step=120,
    loss=3.4172,
    lr=2.4e-05,
    grad_norm=0.812,
    tokens_per_s=71234,
    tokens_per_s_per_gpu=8904.2,
    mfu=55.31,
    peak_mem_gib=27.4,
    eta="1:02:03",
)
EVAL_LINE = format_line("eval", step=120, val_loss=2.31, val_bpb=0.5795)
FINETUNE_LINE = format_line("finetune", step=10, loss=1.23, lr=0.0002, tokens_per_s=1234)


def test_train_metric_regexes_pick_each_value_out_of_a_log_line():
    assert "lr=2.4000e-05" in TRAIN_LINE  # the exponent form is what the regexes must survive
    want = {
        "train:loss": 3.4172,
        "train:lr": 2.4e-05,
        "train:grad_norm": 0.812,
        "train:tokens_per_s": 71234,
        "train:tokens_per_s_per_gpu": 8904.2,
        "train:mfu": 55.31,
        "train:peak_mem_gib": 27.4,
    }
    for name, value in want.items():
        m = regex(name).search(TRAIN_LINE)
        assert m and float(m.group(1)) == pytest.approx(value), name
    for name, value in {"eval:val_loss": 2.31, "eval:val_bpb": 0.5795}.items():
        assert float(regex(name).search(EVAL_LINE).group(1)) == pytest.approx(value)


def test_loss_regex_does_not_read_val_loss_or_other_streams():
    for name in ("train:loss", "train:tokens_per_s", "train:lr"):
        assert regex(name).search(EVAL_LINE) is None
        assert regex(name).search(FINETUNE_LINE) is None
    assert regex("eval:val_loss").search(TRAIN_LINE) is None
    # a torchrun/CloudWatch prefix in front of the line does not hide it
    assert float(regex("train:loss").search("[default0]:" + TRAIN_LINE).group(1)) == pytest.approx(3.4172)


def test_finetune_metric_regexes_match_finetune_and_eval_lines():
    f = sm.FINETUNE_METRICS
    assert float(regex("finetune:loss", f).search(FINETUNE_LINE).group(1)) == pytest.approx(1.23)
    assert float(regex("finetune:tokens_per_s", f).search(FINETUNE_LINE).group(1)) == 1234
    assert float(regex("eval:val_loss", f).search(format_line("eval", step=10, val_loss=1.1)).group(1)) == 1.1
    assert regex("finetune:loss", f).search(TRAIN_LINE) is None
    # SageMaker wants exactly one capture group per regex
    assert all(re.compile(m["Regex"]).groups == 1 for m in sm.TRAIN_METRICS + sm.FINETUNE_METRICS)


# ---------------------------------------------------------------------------------------------
# Flags -> hyperparameters -> the argv the container hands the script


def test_script_flags_become_hyperparameters_with_dashed_keys():
    hps = sm.parse_passthrough(
        [
            "--steps",
            "100",
            "--lr=3e-4",
            "--compile",
            "--no-liger",
            "--micro_batch",
            "4",
            "--ac",
            "selective",
            "--seed",
            "-1",
        ]
    )
    assert hps == {
        "steps": 100,
        "lr": "3e-4",
        "compile": "true",
        "liger": "false",
        "micro-batch": 4,
        "ac": "selective",
        "seed": -1,
    }


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["stray"], "unexpected argument"),
        (["--corpus", "a", "b"], "more than one value"),
        (["--sagemaker_program", "x.py"], "reserved"),
        (["--minilm-script", "x.py"], "reserved"),
        (["--steps", "1", "--steps", "2"], "twice"),
    ],
)
def test_script_flags_that_a_hyperparameter_cannot_carry_are_refused(argv, msg):
    with pytest.raises(ValueError, match=msg):
        sm.parse_passthrough(argv)


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["train", "--phase", "2", "--data", "/local/shards"], "not an s3:// URI"),
        (["train", "--phase", "2"], "--data"),
        (["train", "--phase", "2", "--data", "s3://b/d/", "--max-wait-hours", "48"], "only applies with --spot"),
        (
            [
                "train",
                "--phase",
                "2",
                "--data",
                "s3://b/d/",
                "--spot",
                "--max-run-hours",
                "10",
                "--max-wait-hours",
                "5",
            ],
            "at least --max-run-hours",
        ),
        (["train", "--phase", "2", "--data", "s3://b/d/", "--instance-type", "ml.m5.xlarge"], "needs a GPU instance"),
        (["finetune", "--model", "s3://b/m/", "--data", "s3://b/sft/", "--instance-count", "2"], "without --torchrun"),
        (["tokenize", "--corpus", "s3://b/c/"], "invalid choice|required"),
    ],
)
def test_bad_launch_flags_stop_before_anything_is_sent(argv, msg, capsys):
    with pytest.raises(SystemExit):
        sm.parse_args(argv)
    assert re.search(msg, capsys.readouterr().err)


def _as_sent(hps: dict) -> dict:
    """HyperParameters as the SDK puts them in the request: every value JSON-encoded."""
    return {k: json.dumps(v) for k, v in hps.items()}


def test_container_argv_is_sorted_flags_with_plain_values():
    args = sm.parse_args(
        [
            "train",
            "--phase",
            "2",
            "--data",
            "s3://corp/d/",
            "--steps",
            "100",
            "--lr",
            "3e-4",
            "--compile",
            "--micro-batch",
            "4",
        ]
    )
    plan = sm.plan_job(args, bucket=BUCKET, role=ROLE)
    sent = _as_sent(plan.hyperparameters) | {"sagemaker_program": '"train.py"'}
    assert sm.container_args(sent) == [
        "--checkpoint-dir",
        f"s3://{BUCKET}/minilm-az/checkpoints/{plan.job_name}/",  # every rank writes there itself
        "--compile",
        "true",
        "--data",
        "/opt/ml/input/data/data",
        "--lr",
        "3e-4",
        "--micro-batch",
        "4",
        "--out",
        "/opt/ml/model",
        "--phase",
        "2",
        "--steps",
        "100",
    ]


def test_sm_entry_moves_the_subcommand_in_front():
    argv = sm.container_args(
        _as_sent(
            {
                sm.COMMAND_KEY: "encode",
                sm.SCRIPT_KEY: "tokenize.py",
                "vocab-size": 32000,
                "corpus": "/opt/ml/input/data/corpus",
            }
        )
    )
    assert sm.entry_argv(argv) == (
        "tokenize.py",
        ["encode", "--corpus", "/opt/ml/input/data/corpus", "--vocab-size", "32000"],
    )


def test_sm_entry_runs_the_script_as_main(tmp_path):
    root = tmp_path / "code"
    shutil.copytree(ROOT / "minilm_az", root / "minilm_az", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / sm.ENTRY_WRAPPER, root / sm.ENTRY_WRAPPER)
    (root / "stage.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]) if __name__ == '__main__' else 0)")
    out = subprocess.run(
        [
            sys.executable,
            sm.ENTRY_WRAPPER,
            "--corpus",
            "/c",
            "--minilm-command",
            "train",
            "--minilm-script",
            "stage.py",
            "--vocab-size",
            "512",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["train", "--corpus", "/c", "--vocab-size", "512"]


def test_sm_entry_runs_the_real_tokenize_py_subcommand():
    # tokenize.py shares its name with the stdlib module that sm_entry.py's imports pull in first
    out = subprocess.run(
        [sys.executable, sm.ENTRY_WRAPPER, "--minilm-command", "train", "--help", "--minilm-script", TOKENIZE_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--vocab-size" in out.stdout


# ---------------------------------------------------------------------------------------------
# Against the mocked AWS API


def launch(aws, project, argv):
    return sm.launch(sm.parse_args(argv + ["--role", ROLE, "--bucket", BUCKET]), boto_session=aws, root=project)


def uploaded_source(aws, request) -> tarfile.TarFile:
    uri = json.loads(request["HyperParameters"]["sagemaker_submit_directory"])
    bucket, key = uri[len("s3://") :].split("/", 1)
    body = aws.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    return tarfile.open(fileobj=io.BytesIO(body))


def test_train_launch_creates_a_torchrun_job_with_our_settings(aws, project):
    launched = launch(
        aws,
        project,
        [
            "train",
            "--phase",
            "2",
            "--instance-type",
            "ml.p5.48xlarge",
            "--instance-count",
            "2",
            "--spot",
            "--max-run-hours",
            "48",
            "--data",
            "s3://corp/shards/",
            "--base-model",
            "s3://corp/p1/model/",
            "--tokenizer",
            "s3://corp/tok/",
            "--steps",
            "20000",
            "--micro-batch",
            "4",
            "--compile",
            "--env",
            "NCCL_DEBUG=WARN",
        ],
    )
    job = aws.client("sagemaker").describe_training_job(TrainingJobName=launched.job_name)
    assert job["AlgorithmSpecification"]["TrainingImage"].endswith("/pytorch-training:2.8.0-gpu-py312")
    assert job["ResourceConfig"] == {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100}
    hps = job["HyperParameters"]
    assert hps["sagemaker_torch_distributed_enabled"] == "true"
    assert json.loads(hps["sagemaker_program"]) == TRAIN_SCRIPT
    assert {k: hps[k] for k in ("phase", "steps", "micro-batch", "compile", "replicate")} == {
        "phase": "2",
        "steps": "20000",
        "micro-batch": "4",
        "compile": '"true"',
        "replicate": "2",  # HSDP: one model copy per instance (bench/comms_model.py)
    }
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in job["InputDataConfig"]}
    assert channels == {"data": "s3://corp/shards/", "base_model": "s3://corp/p1/model/", "tokenizer": "s3://corp/tok/"}
    ckpt = f"s3://{BUCKET}/minilm-az/checkpoints/{launched.job_name}/"
    # The script writes its checkpoints to S3 itself; no CheckpointConfig sync (docs/sagemaker.md says why).
    assert "CheckpointConfig" not in job and json.loads(hps["checkpoint-dir"]) == ckpt
    assert job["EnableManagedSpotTraining"] is True
    assert job["StoppingCondition"] == {"MaxRuntimeInSeconds": 48 * 3600, "MaxWaitTimeInSeconds": 96 * 3600}
    assert job["OutputDataConfig"]["CompressionType"] == "NONE"
    assert job["RoleArn"] == ROLE
    # moto answers MetricDefinitions with a placeholder, and drops Environment: read the request itself
    req = launched.request
    assert req["AlgorithmSpecification"]["MetricDefinitions"] == list(sm.TRAIN_METRICS)
    assert req["Environment"]["NCCL_DEBUG"] == "WARN"
    assert req["ProfilerConfig"] == {"DisableProfiler": True}
    assert launched.plan.model_uri == f"s3://{BUCKET}/minilm-az/output/{launched.job_name}/output/model/"


def test_uploaded_source_holds_the_code_and_requirements_but_not_runs(aws, project):
    launched = launch(aws, project, ["train", "--phase", "1", "--data", "s3://corp/shards/"])
    names = set(uploaded_source(aws, launched.request).getnames())
    assert {
        TRAIN_SCRIPT,
        sm.ENTRY_WRAPPER,
        "requirements.txt",
        "setup.cfg",
        "minilm_az/logs.py",
        "minilm_az/launch/sagemaker.py",
    } <= names
    assert not any(n.startswith(("runs", "tests", ".git")) or "__pycache__" in n for n in names)
    reqs = uploaded_source(aws, launched.request).extractfile("requirements.txt").read().decode()
    lines = [ln.split("#")[0].strip() for ln in reqs.splitlines()]
    assert ".[prep,tensorboard,s3]" in lines and any(ln.startswith("liger-kernel") for ln in lines)
    assert not any(re.match(r"torch\s*([<>=~!;#]|$)", ln) for ln in lines)  # the image's torch stays (torchao may)


def test_tokenize_launch_runs_the_subcommand_through_sm_entry_on_cpu(aws, project):
    launched = launch(
        aws,
        project,
        [
            "tokenize",
            "encode",
            "--corpus",
            "s3://corp/text/",
            "--tokenizer",
            "s3://corp/tok/",
            "--shard-tokens",
            "32000",
        ],
    )
    req = launched.request
    hps = req["HyperParameters"]
    assert json.loads(hps["sagemaker_program"]) == sm.ENTRY_WRAPPER
    assert "sagemaker_torch_distributed_enabled" not in hps
    assert req["AlgorithmSpecification"]["TrainingImage"].endswith("/pytorch-training:2.8.0-cpu-py312")
    assert req["ResourceConfig"]["InstanceType"] == "ml.m5.4xlarge"
    assert sm.entry_argv(sm.container_args(hps)) == (
        TOKENIZE_SCRIPT,
        [
            "encode",
            "--corpus",
            "/opt/ml/input/data/corpus",
            "--out",
            "/opt/ml/model",
            "--shard-tokens",
            "32000",
            "--tokenizer",
            "/opt/ml/input/data/tokenizer",
        ],
    )
    assert {c["ChannelName"] for c in req["InputDataConfig"]} == {"corpus", "tokenizer"}
    assert "CheckpointConfig" not in req and "MetricDefinitions" not in req["AlgorithmSpecification"]
    reqs = uploaded_source(aws, req).extractfile("requirements.txt").read().decode()
    assert "liger" not in reqs  # no Triton download on a CPU instance


def test_finetune_launch_is_one_gpu_process_with_model_and_data_channels(aws, project):
    launched = launch(
        aws,
        project,
        [
            "finetune",
            "--model",
            "s3://corp/p2/model/",
            "--data",
            "s3://corp/sft/",
            "--val-data",
            "s3://corp/sft-val/",
            "--lora-r",
            "16",
            "--merge",
        ],
    )
    req = launched.request
    assert {c["ChannelName"] for c in req["InputDataConfig"]} == {"model", "data", "val_data"}
    assert req["ResourceConfig"]["InstanceType"] == "ml.g5.2xlarge"
    assert "sagemaker_torch_distributed_enabled" not in req["HyperParameters"]
    assert sm.container_args(req["HyperParameters"]) == [
        "--checkpoint-dir",
        f"s3://{BUCKET}/minilm-az/checkpoints/{req['TrainingJobName']}/",
        "--data",
        "/opt/ml/input/data/data",
        "--lora-r",
        "16",
        "--merge",
        "true",
        "--model",
        "/opt/ml/input/data/model",
        "--out",
        "/opt/ml/model",
        "--val-data",
        "/opt/ml/input/data/val_data",
    ]
    assert req["AlgorithmSpecification"]["MetricDefinitions"] == list(sm.FINETUNE_METRICS)
    # A fine-tune checkpoints too (finetune.py resumes with --resume auto), into the job's own S3 prefix.
    assert "CheckpointConfig" not in req


def test_relaunch_with_the_same_checkpoint_prefix_resumes_there(aws, project):
    first = launch(aws, project, ["train", "--phase", "2", "--data", "s3://corp/shards/", "--spot"])
    again = launch(
        aws,
        project,
        [
            "train",
            "--phase",
            "2",
            "--data",
            "s3://corp/shards/",
            "--spot",
            "--checkpoint-s3",
            first.plan.checkpoint_uri,
        ],
    )
    assert again.job_name != first.job_name
    assert json.loads(again.request["HyperParameters"]["checkpoint-dir"]) == first.plan.checkpoint_uri


def test_a_checkpoint_prefix_the_launching_credentials_cannot_list_is_one_line_before_any_job(aws, project, capsys):
    argv = ["train", "--phase", "2", "--data", "s3://corp/shards/", "--checkpoint-s3", "s3://no-such-bucket-37/ck/"]
    with pytest.raises(SystemExit) as exit_:
        launch(aws, project, argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]  # the SDK line's own note aside
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "--checkpoint-s3 s3://no-such-bucket-37/ck/" in err[0] and "NoSuchBucket" in err[0], err
    assert aws.client("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []


def test_dry_run_prints_the_request_and_sends_nothing(aws, project, monkeypatch, capsys):
    monkeypatch.setattr(sm, "PROJECT_ROOT", project)
    assert sm.main(["train", "--phase", "2", "--data", "s3://corp/shards/", "--steps", "10", "--dry-run"]) == 0
    out = capsys.readouterr()
    printed = json.loads(out.out)
    assert printed["HyperParameters"]["phase"] == "2"
    assert "dry run, nothing sent: would create training job" in out.err
    assert (
        "train.py --checkpoint-dir s3://sagemaker-us-east-1-ACCOUNT/minilm-az/checkpoints/"
        f"{printed['TrainingJobName']}/ "
        "--data /opt/ml/input/data/data --out /opt/ml/model "
        "--phase 2 --steps 10" in out.err
    )
    assert aws.client("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []
    assert [b["Name"] for b in aws.client("s3").list_buckets()["Buckets"]] == [BUCKET]
    assert aws.client("s3").list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == 0


# ---------------------------------------------------------------------------------------------
# Refusals before anything is billed (issue 29): one line naming the flag and its value, exit 2, nothing sent


def refusal_line(capsys) -> str:
    """The one line the launcher printed on stderr (2.x's maintenance notice aside)."""
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("note:")]
    assert len(lines) == 1, lines
    return lines[0]


def nothing_sent(aws) -> bool:
    return (
        aws.client("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []
        and aws.client("s3").list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == 0
    )


AWS_FLAGS = ["--role", ROLE, "--bucket", BUCKET]
TRAIN = ["train", "--phase", "2", *AWS_FLAGS, "--data", "s3://corp/shards/"]
FINETUNE = ["finetune", *AWS_FLAGS, "--model", "s3://corp/p2/model/", "--data", "s3://corp/sft/"]
TOKENIZE = ["tokenize", "encode", *AWS_FLAGS, "--corpus", "s3://corp/text/", "--tokenizer", "s3://corp/tok/"]


@pytest.mark.parametrize(
    "argv, flag, value",
    [
        # S3: every bucket and URI (a later flag wins over the same flag in the stage's argv above)
        (TRAIN + ["--data", "s3:///shards/"], "--data", "s3:///shards/"),
        (TRAIN + ["--data", "s3://corp/my shards/"], "--data", "'s3://corp/my shards/'"),
        (TRAIN + ["--data", "s3://Corp_Data/shards/"], "--data", "'Corp_Data'"),
        (TRAIN + ["--base-model", "s3://10.0.0.1/model/"], "--base-model", "'10.0.0.1'"),
        (TRAIN + ["--checkpoint-s3", "s3://ab/ckpt/"], "--checkpoint-s3", "'ab'"),
        (FINETUNE + ["--val-data", "s3://corp-/val/"], "--val-data", "'corp-'"),
        (TOKENIZE + ["--tokenizer", "s3://"], "--tokenizer", "'s3://'"),
        (TRAIN + ["--bucket", "My_Bucket"], "--bucket", "'My_Bucket'"),
        (TRAIN + ["--bucket", "s3://corp"], "--bucket", "(corp), without s3://"),
        (TRAIN + ["--prefix", "my runs"], "--prefix", "'my runs'"),
        # the training job name as sent (2.x sends --job-name as it is)
        (TRAIN + ["--job-name", "my_job"], "--job-name", "'my_job'"),
        (TRAIN + ["--job-name", "x" * 64], "--job-name", "x" * 64),
        (TRAIN + ["--job-name=-leading"], "--job-name", "'-leading'"),
        (TRAIN + ["--job-name", "a" + "-" * 68 + "b"], "--job-name", "at most 63 characters"),  # issue 29's audit
        (TRAIN + ["--data", "s3://xn--bucket/shards/"], "--data", "S3 reserves names"),
        (TRAIN + ["--bucket", "mine-s3alias"], "--bucket", "S3 reserves names"),
        # instance types
        (TRAIN + ["--instance-type", "ml.p55.48xlarge"], "--instance-type", "did you mean ml.p5.48xlarge"),
        (FINETUNE + ["--instance-type", "ml.g5x.2xlarge"], "--instance-type", "did you mean ml.g5.2xlarge"),
        (TRAIN + ["--instance-type", "p5.48xlarge"], "--instance-type", "'p5.48xlarge'"),
        (TRAIN + ["--instance-type", "ml.p5.48xlrage"], "--instance-type", "'ml.p5.48xlrage'"),
        # numbers SageMaker bounds
        (TRAIN + ["--volume-size", "0"], "--volume-size", "got 0"),
        (TRAIN + ["--volume-size", "-5"], "--volume-size", "got -5"),
        (TRAIN + ["--instance-count", "0"], "--instance-count", "got 0"),
        (TRAIN + ["--max-run-hours", "0"], "--max-run-hours", "got 0.0"),
        (TRAIN + ["--max-run-hours", "inf"], "--max-run-hours", "got inf"),
        (TRAIN + ["--max-run-hours", "1000"], "--max-run-hours", "at most 672 (28 days"),
        (TRAIN + ["--spot", "--max-run-hours", "1", "--max-wait-hours", "nan"], "--max-wait-hours", "got nan"),
        # environment
        (TRAIN + ["--env", "1 BAD=x"], "--env", "'1 BAD'"),
        (TRAIN + ["--env", "NCCL-DEBUG=WARN"], "--env", "'NCCL-DEBUG'"),
        (TRAIN + ["--env", "NCCL_DEBUG"], "--env", "'NCCL_DEBUG' has no value"),
        (TRAIN + ["--env", "K=" + "v" * 513], "--env", "the value of K is 513 characters"),
        # script flags naming files that the container does not have
        (TRAIN + ["--eval-text", "data/az/firefox.txt"], "--eval-text", "data/az/firefox.txt"),
        (TRAIN + ["--eval-text", "/home/me/val.txt"], "--eval-text", "/home/me/val.txt"),
        (TRAIN + ["--eval-text", "s3://corp/val.txt"], "--eval-text", "s3://corp/val.txt"),
        (TRAIN + ["--eval-text", "/opt/ml/input/data/eval/val.txt"], "--eval-text", "channel 'eval'"),
        (FINETUNE + ["--adapter", "./runs/sft"], "finetune.py", "--adapter does nothing without --chat or --prompt"),
    ],
)
def test_what_the_cloud_would_refuse_is_refused_before_anything_is_sent(
    argv, flag, value, aws, project, monkeypatch, capsys
):
    monkeypatch.setattr(sm, "PROJECT_ROOT", project)
    with pytest.raises(SystemExit) as e:
        sm.main(argv)
    assert e.value.code == 2
    line = refusal_line(capsys)
    assert line.startswith(f"{sm.PROG}: error: {flag}: "), line
    assert value in line, line
    assert nothing_sent(aws)


def test_launch_without_a_role_refuses_in_one_line_before_any_aws_call(aws, project, capsys):
    calls = []
    aws.events.register("before-call", lambda model, **_: calls.append(model.name))
    with pytest.raises(SystemExit) as e:  # no --bucket either: the default bucket would be looked up, even made
        sm.launch(
            sm.parse_args(["train", "--phase", "1", "--data", "s3://corp/shards/"]), boto_session=aws, root=project
        )
    assert e.value.code == 2
    line = refusal_line(capsys)
    assert line.startswith(f"{sm.PROG}: error: --role: ") and "arn:aws:iam::ACCOUNT:role/NAME" in line
    assert calls == []
    assert [b["Name"] for b in aws.client("s3").list_buckets()["Buckets"]] == [BUCKET]


def test_a_local_path_refusal_says_where_the_file_would_arrive(capsys):
    with pytest.raises(SystemExit):
        sm.parse_args(TRAIN + ["--eval-text", "data/az/firefox.txt"])
    assert "s3://corp/shards/firefox.txt is /opt/ml/input/data/data/firefox.txt" in refusal_line(capsys)


def test_a_local_path_refusal_names_no_channel_the_job_lacks(capsys):
    with pytest.raises(SystemExit):
        sm.parse_args(["tokenize", "train", "--corpus", "s3://corp/text/", "--text-field", "data/x.jsonl"])
    assert "/opt/ml/input/data/corpus/x.jsonl" in refusal_line(capsys)


@pytest.mark.parametrize(
    "name, refused",
    [("a" * 48, False), ("my_job", False), ("a" * 49, True), ("my job", True)],
)
def test_under_sdk_3_the_job_name_is_checked_with_the_timestamp_it_appends(name, refused, capsys):
    args = argparse.Namespace(job_name=name, sdk="v3")  # 3.x makes _ a hyphen and appends -YYYYmmddHHMMSS
    if not refused:
        sm._check_job_name(sm.build_parser(), args)
        return
    with pytest.raises(SystemExit) as e:
        sm._check_job_name(sm.build_parser(), args)
    assert e.value.code == 2
    assert refusal_line(capsys).startswith(f"{sm.PROG}: error: --job-name: {name!r}")


@pytest.mark.parametrize(
    "fail, reason",
    [
        (None, "Invalid value for parameter StoppingCondition.MaxRuntimeInSeconds, value: 0, valid min value: 1"),
        (ValueError("the SDK refused:\n  the reason on line two"), "the SDK refused: the reason on line two"),
    ],
)
def test_an_sdk_or_botocore_validation_error_is_printed_whole_on_one_line(
    fail, reason, aws, project, monkeypatch, capsys
):
    monkeypatch.setattr(sm, "PROJECT_ROOT", project)
    if fail is None:  # botocore's own ParamValidationError: let a zero run time through the launcher's checks
        monkeypatch.setattr(sm, "_check_numbers", lambda parser, args: None)
        argv = TRAIN + ["--max-run-hours", "0"]
    else:  # a multi-line ValueError, as the SDK raises while it builds the job

        def backend(*args, **kwargs):
            raise fail

        monkeypatch.setitem(sm.BACKENDS, "v2", backend)
        argv = TRAIN
    assert sm.main(argv) == 2
    line = refusal_line(capsys)
    assert line.startswith(f"{sm.PROG}: error: ") and line.endswith(reason), line
    assert aws.client("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--phase", "1", "--data", "s3://corp/shards/"],
        ["finetune", "--model", "s3://corp/p2/", "--data", "s3://corp/sft/"],
        *(
            ["tokenize", cmd, "--corpus", "s3://corp/text/", "--tokenizer", "s3://corp/tok/"]
            for cmd in ("encode", "report")
        ),
        *(["tokenize", cmd, "--corpus", "s3://corp/text/"] for cmd in ("train", "clean")),
        TRAIN + ["--bucket", "my.bucket-1", "--prefix", "team/minilm", "--checkpoint-s3", "s3://" + "b" * 63 + "/c/"],
        TRAIN + ["--job-name", "minilm-az--p2-run-7", "--instance-type", "ml.p4d.24xlarge", "--volume-size", "1"],
        TRAIN + ["--instance-type", "ml.g6e.12xlarge", "--max-run-hours", "0.5", "--spot", "--max-wait-hours", "1"],
        TRAIN + ["--instance-type", "ml.r8i-flex.large", "--no-torchrun"],  # a real family the table lacks
        TRAIN + ["--env", "NCCL_DEBUG=WARN", "--env", "_X1=", "--eval-text", "/opt/ml/input/data/data/val.txt"],
        FINETUNE + ["--lora-alpha", "28", "--targets", "q_proj,v_proj"],
    ],
)
def test_the_launchers_defaults_and_valid_values_pass_the_checks(argv):
    args = sm.parse_args(argv)
    assert sm.INSTANCE_TYPE.fullmatch(args.instance_type)


def test_instance_families_in_the_typo_table_are_real_training_families():
    pytest.importorskip("botocore")
    assert set(sm.INSTANCE_FAMILIES) <= sm._training_families()
    assert {sm.INSTANCE_TYPE.fullmatch(s.instance_type)["family"] for s in sm.STAGES.values()} <= set(
        sm.INSTANCE_FAMILIES
    )


# ---------------------------------------------------------------------------------------------
# Container-like run of the real train.py (skipped until the root scripts exist)


@pytest.fixture(scope="module")
def train_log(tmp_path_factory, small_tokenizer_dir, container_shards_dir):
    """A 4-step train.py run on the suite's small tokenizer and shards; its output is what CloudWatch's regexes
    read. A fork of tests/prefork.py's server (test_train.py's one-process runs share it), as `python train.py`.
    (tests/test_sm_container.py replays whole jobs in a simulated container.)"""
    out = tmp_path_factory.mktemp("sm") / "out"
    argv = [sys.executable, TRAIN_SCRIPT, "--phase", "2", "--data", container_shards_dir]
    argv += ["--tokenizer", small_tokenizer_dir, "--out", str(out), "--preset", "tiny", "--steps", "4"]
    argv += ["--log-every", "1", "--eval-every", "2", "--seq-len", "64", "--global-batch", "2", "--device", "cpu"]
    r = prefork.run(argv, str(ROOT), prefork.PLAIN_ENV, timeout=300)
    assert r.returncode == 0, f"{argv}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


@pytest.mark.slow
def test_metric_regexes_match_real_train_output(train_log):
    for name in ("train:loss", "train:lr", "train:tokens_per_s", "eval:val_loss", "eval:val_bpb"):
        values = [float(m.group(1)) for m in map(regex(name).search, train_log.splitlines()) if m]
        assert values, f"{name} matched no line of train.py's output"
    losses = [float(m.group(1)) for m in map(regex("train:loss").search, train_log.splitlines()) if m]
    assert len(losses) == 4


def test_train_paths_default_to_the_container_dirs_inside_sagemaker(monkeypatch):
    import os

    from minilm_az import config as C
    from minilm_az.launch import flags

    def parse():
        return flags.parse_config(C.TrainConfig, flags.make_parser(C.TrainConfig, "train.py", "x"), ["--phase", "2"])

    monkeypatch.setenv("SM_MODEL_DIR", "/opt/ml/model")
    monkeypatch.setenv("SM_CHANNEL_DATA", "/opt/ml/input/data/data")
    monkeypatch.setenv("SM_CHANNEL_BASE_MODEL", "/opt/ml/input/data/base_model")
    isdir = os.path.isdir
    with monkeypatch.context() as m:  # a container: its /opt/ml is there
        m.setattr(os.path, "isdir", lambda p: p == "/opt/ml" or isdir(p))
        cfg = parse()
    assert (cfg.checkpoint_dir, cfg.out, cfg.data, cfg.base_model) == (
        sm.CHECKPOINT_LOCAL_PATH,
        "/opt/ml/model",
        "/opt/ml/input/data/data",
        "/opt/ml/input/data/base_model",
    )
    if not isdir("/opt/ml"):  # a laptop with SageMaker's variables left set: no checkpoint goes to a new /opt/ml
        assert parse().checkpoint_dir is None


def test_a_replicate_the_user_passes_wins_over_one_copy_per_instance(aws, project):
    argv = ["train", "--phase", "2", "--instance-count", "2", "--data", "s3://corp/shards/", "--replicate", "1"]
    assert launch(aws, project, argv).request["HyperParameters"]["replicate"] == "1"
    one = launch(aws, project, ["train", "--phase", "2", "--data", "s3://corp/shards/"])
    assert "replicate" not in one.request["HyperParameters"]  # one instance: plain FSDP2, the script's default


def test_tensorboard_syncs_the_scripts_event_files_to_s3(aws, project):
    """--tensorboard reaches the script, and the job gets a TensorBoardOutputConfig whose local path is the dir the
    script writes in a container (launch.flags.tensorboard_dir): SageMaker uploads it while the job runs."""
    launched = launch(aws, project, ["train", "--phase", "2", "--data", "s3://corp/shards/", "--tensorboard"])
    req = launched.request
    assert "--tensorboard" in sm.container_args(req["HyperParameters"])
    tb = req["TensorBoardOutputConfig"]
    assert tb["LocalPath"] == "/opt/ml/output/tensorboard" == C.CONTAINER_TENSORBOARD
    assert tb["S3OutputPath"] == f"s3://{BUCKET}/minilm-az/tensorboard/{req['TrainingJobName']}/"
    plain = launch(aws, project, ["finetune", "--model", "s3://corp/m/", "--data", "s3://corp/d/"])
    assert "TensorBoardOutputConfig" not in plain.request  # only when asked for
