"""The launcher through SageMaker Python SDK 3.x (ModelTrainer + Torchrun), against moto, beside 2.x.

Marked `sdk3`: they run where 3.x is installed (.ci/run's second venv) and skip under 2.x. The request each
line sends for each stage is compared field by field with the other line's (2.x launched by its own
interpreter, `SM_SDK2_PYTHON` or .venv/bin/python); every config field goes through 3.x's real container
drivers (environment.py's sm_training.env, sourced by bash as sm_train.sh does, then the driver's argv) into
the script's own parser. Whole 3.x jobs replayed in the simulated container: tests/test_sm_container.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sm_container as smc
from conftest import BUCKET, ROLE
from test_contract import STAGES, launcher_argv

from minilm_az.launch import flags
from minilm_az.launch import sagemaker as sm

ROOT = sm.PROJECT_ROOT
pytestmark = pytest.mark.sdk3  # conftest's aws fixture skips these unless 3.x is installed
needs_v3 = pytest.mark.skipif(sm.installed_sdk() != "v3", reason=f"needs SDK 3.x; this has {sm.sdk_version()}")

# A string every field of type str gets: spaces, a colon, double quotes, non-ASCII, and text JSON would
# re-read (3.x decodes each value twice). No single quote: see test_a_single_quote_is_refused_at_launch.
TEXT = 'Salam, dünya: "y" 1.10'


def drivers_dir() -> Path:
    from sagemaker.train.constants import SM_DRIVERS_LOCAL_PATH

    return Path(SM_DRIVERS_LOCAL_PATH)


def s3_text(aws, uri: str) -> str:
    bucket, key = uri[5:].split("/", 1)
    return aws.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read().decode()


def channel_uri(request: dict, name: str) -> str:
    return next(c for c in request["InputDataConfig"] if c["ChannelName"] == name)["DataSource"]["S3DataSource"][
        "S3Uri"
    ]


def drivers_argv(hyperparameters: dict[str, str], tmp_path: Path) -> list[str]:
    """What 3.x's container makes of HyperParameters: its environment.py writes sm_training.env, bash sources
    it (sm_train.sh), and its driver turns SM_HPS into argv (common.utils.hyperparameters_to_cli_args)."""
    cfg = tmp_path / "config"
    cfg.mkdir()
    (cfg / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    (cfg / "inputdataconfig.json").write_text("{}")
    rc = {"current_host": "algo-1", "current_instance_type": "ml.m5.4xlarge", "hosts": ["algo-1"]}
    (cfg / "resourceconfig.json").write_text(json.dumps(rc | {"network_interface_name": "eth0"}))
    env_file = tmp_path / "sm_training.env"
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(drivers_dir())!r})\n"
        "from scripts import environment as e\n"
        f"c = {str(cfg)!r}\n"
        "e.set_env(*(json.load(open(f'{c}/{n}.json')) for n in ('resourceconfig', 'inputdataconfig', "
        f"'hyperparameters')), output_file={str(env_file)!r})\n"
    )
    env = {**os.environ, "TRAINING_JOB_NAME": "job", "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    show = "import json, os, sys; print(json.dumps(os.environ['SM_HPS']))"
    out = subprocess.run(
        ["bash", "-c", f'set -e; source "$1"; {sys.executable} -c "{show}"', "bash", str(env_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    sys.path.insert(0, str(drivers_dir()))
    try:
        from common.utils import hyperparameters_to_cli_args
    finally:
        sys.path.remove(str(drivers_dir()))
    return hyperparameters_to_cli_args(json.loads(json.loads(out.stdout)))


def launch(aws, project, argv):
    return sm.launch(sm.parse_args(argv + ["--role", ROLE, "--bucket", BUCKET]), boto_session=aws, root=project)


# ---------------------------------------------------------------------------------------------
# The contract, field by field, through 3.x's container drivers


@pytest.mark.parametrize("stage, command", STAGES)
def test_every_config_field_survives_the_v3_drivers_and_the_script_parser(
    stage, command, aws, project, tmp_path, monkeypatch
):
    from minilm_az import config as C

    monkeypatch.setattr(C, "check_values", lambda cfg: None)  # every field at once: transport, not modes (as 2.x's)
    cls = sm.STAGES[stage].configs[command]
    argv, want = launcher_argv(stage, command, cls, text=TEXT)
    launched = launch(aws, project, argv)
    assert launched.sdk == "v3"
    hps = launched.request["HyperParameters"]
    if "checkpoint_dir" in want:  # the launcher's s3:// prefix for a job that trains, none for an --eval-only job
        raw = hps.get("checkpoint-dir")
        want["checkpoint_dir"] = (json.loads(raw) if raw and raw.startswith('"') else raw) if raw else None
    args = drivers_argv(hps, tmp_path)
    assert args == sm.container_args_v3(hps)  # the dry run prints what the container really runs
    if stage == "tokenize":
        script, args = sm.entry_argv(args)
        assert (script, args[0]) == ("tokenize.py", command)
        args = args[1:]
    cfg = flags.parse_config(cls, flags.make_parser(cls, sm.STAGES[stage].script, "x\n\ny"), args)
    got = dataclasses.asdict(cfg)
    assert {k: got[k] for k in want} == want
    assert set(want) == {f.name for f in dataclasses.fields(cls)}


@needs_v3
def test_a_single_quote_is_refused_at_launch(capsys):
    # 3.x's environment.py writes `export SM_HPS='{...}'`: a ' in a value ends the quoting, and bash drops it
    with pytest.raises(SystemExit) as e:
        sm.parse_args(["finetune", "--model", "s3://b/m/", "--data", "s3://b/d/", "--targets", "it's", "--sdk", "v3"])
    assert e.value.code == 2
    assert "single quote" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_longest_job_name_the_launcher_takes_under_v3_is_sent_whole_with_the_sdks_timestamp(aws, project):
    # The launcher's model of 3.x's naming (_check_job_name): underscores made hyphens, -YYYYmmddHHMMSS appended.
    base = "my_run-" + "x" * (63 - len(sm.V3_STAMP) - len("my_run-"))
    launched = launch(aws, project, ["train", "--phase", "2", "--data", "s3://corp/shards/", "--job-name", base])
    assert re.fullmatch(base.replace("_", "-") + r"-[0-9]{14}", launched.job_name), launched.job_name


# ---------------------------------------------------------------------------------------------
# The same job through either SDK line

JOBS = {
    "tokenize": ["tokenize", "encode", "--corpus", "s3://corp/text/", "--tokenizer", "s3://corp/tok/", "--no-progress"],
    "train": (
        "train --phase 2 --instance-count 2 --spot --max-run-hours 48 --input-mode FastFile --data s3://corp/shards/ "
        "--base-model s3://corp/p1/model/ --tokenizer s3://corp/tok/ --steps 20000 --lr 3e-4 --compile "
        "--env NCCL_DEBUG=WARN --tensorboard"
    ).split(),
    "finetune": (
        "finetune --model s3://corp/p2/ --data s3://corp/sft/ --val-data s3://corp/sft-val/ --lora-r 16 --merge"
    ).split(),
}
STAMP = re.compile(r"-\d{4}-\d\d-\d\d-\d\d-\d\d-\d\d-\d{3}(?=/)")  # the launch's own timestamp, in checkpoint URIs


def sdk2_python() -> str | None:
    for py in (os.environ.get("SM_SDK2_PYTHON"), str(ROOT / ".venv" / "bin" / "python")):
        if py and shutil.which(py):
            out = subprocess.run(
                [py, "-c", "import importlib.metadata as m; print(m.version('sagemaker'))"],
                capture_output=True,
                text=True,
            )
            if out.returncode == 0 and out.stdout.startswith("2."):
                return py
    return None


def job_view(request: dict, distribution: str | None) -> dict:
    """The CreateTrainingJob fields both lines must agree on, with the hyperparameters as the script parses them."""
    hps, alg = request["HyperParameters"], request["AlgorithmSpecification"]
    if distribution is None:  # 2.x says it in a hyperparameter; 3.x in its drivers channel
        distribution = "torchrun" if hps.get("sagemaker_torch_distributed_enabled") == "true" else "none"
        argv = sm.container_args(hps)
    else:
        argv = sm.container_args_v3(hps)
    stage = sm.STAGES[next(s for s in sm.STAGES if request["TrainingJobName"].startswith(f"minilm-az-{s}"))]
    command = None
    if stage.script == "tokenize.py":
        _, argv = sm.entry_argv(argv)
        command, argv = argv[0], argv[1:]
    cls = stage.configs[command]
    parsed = dataclasses.asdict(flags.parse_config(cls, flags.make_parser(cls, stage.script, "x"), argv))
    if parsed.get("checkpoint_dir"):  # the S3 prefix holds the job's name, and so the launch's timestamp
        parsed["checkpoint_dir"] = STAMP.sub("-STAMP", parsed["checkpoint_dir"])
    ckpt, tb = request.get("CheckpointConfig"), request.get("TensorBoardOutputConfig")
    return {
        "image": alg["TrainingImage"],
        "input_mode": alg["TrainingInputMode"],
        "resources": request["ResourceConfig"],
        "distribution": distribution,
        "channels": sorted(
            (c for c in request["InputDataConfig"] if c["ChannelName"] not in sm.V3_RESERVED_CHANNELS),
            key=lambda c: c["ChannelName"],
        ),
        "checkpoint": ckpt and {**ckpt, "S3Uri": STAMP.sub("-STAMP", ckpt["S3Uri"])},
        "tensorboard": tb and {**tb, "S3OutputPath": STAMP.sub("-STAMP", tb["S3OutputPath"])},
        "spot": bool(request.get("EnableManagedSpotTraining")),
        "stopping": request["StoppingCondition"],
        "metrics": alg.get("MetricDefinitions", []),
        "hyperparameter_keys": sorted(k for k in hps if not k.startswith("sagemaker_")),
        "script_config": parsed,
        "output": request["OutputDataConfig"],
        "environment": request.get("Environment"),
        "role": request["RoleArn"],
    }


def v3_distribution(aws, request: dict) -> str:
    """What 3.x's drivers channel makes the container start: torchrun only with a Torchrun config."""
    drivers = channel_uri(request, "sm_drivers").rstrip("/")
    script = s3_text(aws, f"{drivers}/sm_train.sh")
    torchrun = json.loads(s3_text(aws, f"{drivers}/distributed.json"))
    if "torchrun_driver.py" in script:
        assert torchrun == {"process_count_per_node": None, "smp": None}  # one process per GPU, as 2.x
        return "torchrun"
    assert "basic_script_driver.py" in script and torchrun == {}
    return "none"


@pytest.mark.parametrize("stage", sorted(JOBS))
def test_both_sdk_lines_send_the_same_job(stage, aws, project):
    py = sdk2_python()
    if py is None:
        pytest.skip("no SDK 2.x interpreter to compare with: set SM_SDK2_PYTHON (CI: .venv/bin/python)")
    out = subprocess.run(  # smc.launch adds --role and --bucket
        [py, str(ROOT / "tests" / "sm_container.py"), "--launch", *JOBS[stage]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    v2 = json.loads(out.stdout.strip().splitlines()[-1])
    assert v2["sdk"] == "v2"
    v3 = smc.launch(aws, JOBS[stage], root=project)
    assert v3.sdk == "v3"
    want = job_view(v2["request"], None)
    got = job_view(v3.request, v3_distribution(aws, v3.request))
    assert got == want
    assert want["distribution"] == ("torchrun" if stage == "train" else "none")
    # 3.x's job runs the same file with the requirements installed; its name is the SDK's, read back
    code = channel_uri(v3.request, "code").rstrip("/")
    assert json.loads(s3_text(aws, f"{code.rsplit('/', 1)[0]}/sm_drivers/sourcecode.json"))["entry_script"] == (
        sm.ENTRY_WRAPPER if stage == "tokenize" else sm.STAGES[stage].script
    )
    assert "requirements.txt" in s3_text(aws, f"{code.rsplit('/', 1)[0]}/sm_drivers/sm_train.sh")
    assert v3.job_name == v3.request["TrainingJobName"] and v3.job_name.startswith(v3.plan.base_job_name + "-")
    assert v3.plan.model_uri == f"s3://{smc.BUCKET}/minilm-az/output/{v3.job_name}/output/model/"


# ---------------------------------------------------------------------------------------------
# The command line under 3.x


def test_dry_run_prints_the_v3_request_and_sends_nothing(aws, project, monkeypatch, capsys):
    monkeypatch.setattr(sm, "PROJECT_ROOT", project)
    monkeypatch.delenv("SAGEMAKER_VALIDATE_ROLE")  # a dry run asks IAM nothing, validation on or off
    assert sm.main(["train", "--phase", "2", "--data", "s3://corp/shards/", "--steps", "10", "--dry-run"]) == 0
    out = capsys.readouterr()
    printed = json.loads(out.out)
    assert printed["HyperParameters"]["phase"] == "2"
    assert printed["AlgorithmSpecification"]["ContainerEntrypoint"] == ["/bin/bash"]
    assert "dry run, nothing sent: would create training job minilm-az-train-p2-" in out.err
    assert "torchrun --nnodes=N --nproc_per_node=GPUS train.py --phase 2 --data /opt/ml/input/data/data" in out.err
    assert "note: SageMaker Python SDK" not in out.err  # the 2.x notice only
    assert os.environ.get("SAGEMAKER_VALIDATE_ROLE") is None
    assert aws.client("sagemaker").list_training_jobs()["TrainingJobSummaries"] == []
    assert aws.client("s3").list_objects_v2(Bucket=BUCKET).get("KeyCount", 0) == 0


@needs_v3
def test_forcing_the_sdk_line_that_is_not_installed_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        sm.parse_args(["train", "--phase", "2", "--data", "s3://b/d/", "--sdk", "v2"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "--sdk v2: this environment has sagemaker 3." in err[0] and "'sagemaker>=2.250,<3'" in err[0]
    )


@needs_v3
def test_v3_hyperparameters_give_the_script_the_exact_string():
    hps = {"lr": "3e-4", "run-name": "1.10", "steps": 20000, "compile": "true", "out": "/opt/ml/model", "x": ""}
    sent = sm.v3_hyperparameters(hps)
    assert sent["steps"] == "20000" and sent["out"] == '"/opt/ml/model"'  # as 2.x sends them
    assert sm.container_args_v3(sent) == [a for k, v in hps.items() for a in (f"--{k}", str(v))]


def test_launches_on_one_session_each_capture_their_own_request_and_a_dry_run_sends_nothing(aws, project):
    # 3.x caches a SageMaker client per boto session, born with the first launch's event handlers
    first = launch(aws, project, ["train", "--phase", "2", "--data", "s3://corp/shards/", "--steps", "1"])
    dry = launch(aws, project, ["train", "--phase", "2", "--data", "s3://corp/shards/", "--steps", "2", "--dry-run"])
    again = launch(aws, project, ["train", "--phase", "2", "--data", "s3://corp/shards/", "--steps", "3"])
    assert [x.request["HyperParameters"]["steps"] for x in (first, dry, again)] == ["1", "2", "3"]
    assert not dry.sent
    names = {j["TrainingJobName"] for j in aws.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]}
    assert names == {first.job_name, again.job_name}
