"""Each stage launched with the real launcher and replayed in a simulated container by the real toolkit.

tests/sm_container.py builds /opt/ml from the CreateTrainingJob request (hyperparameters as sent, channels
downloaded from the mocked S3, the uploaded sourcedir) with /opt/ml/model a separate mount, and runs
sagemaker-training's entry point, which maps the hyperparameters to argv and starts `python SCRIPT ...`
or `torchrun ... train.py ...`. What fails here fails on SageMaker: flags the container spells
differently from the launcher, channels that arrive but are never read, renames into /opt/ml/model.
The first tests check the harness itself with probe programs, so a harness fault never reads as a
product one. Tests parametrized over `sdk` replay the request each SDK line sends: v2's through the image's
toolkit, v3's through its own sm_train.sh and drivers (marked `sdk3`; each runs where its SDK is installed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from minilm_az.launch import sagemaker as sm

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # pytest's rootdir-relative import puts it there
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm_container as smc  # noqa: E402

ROOT = sm.PROJECT_ROOT
AZ = ROOT / "data" / "az"
CHAT, CHAT_VAL = ROOT / "data" / "chat" / "az_chat.jsonl", ROOT / "data" / "chat" / "az_chat_val.jsonl"


@pytest.fixture
def aws(aws, request):
    """conftest's moto-mocked boto3 session, where this machine can replay a container at all."""
    why = smc.unavailable("v3" if request.node.get_closest_marker("sdk3") else "v2")
    if why:
        pytest.skip(why)
    return aws


SDKS = ["v2", pytest.param("v3", marks=pytest.mark.sdk3)]  # conftest's aws skips the one not installed
TORCHRUN = {  # how each SDK line's container starts train.py (nproc 2: the harness's GPUs)
    "v2": ["torchrun", "--nnodes", "1", "--nproc_per_node", "2", "train.py"],
    "v3": ["torchrun", "--nnodes=1", "--nproc_per_node=2", "train.py"],
}


def replay(aws, argv, tmp_path, inputs=None, root=ROOT, sdk=None, **kw) -> smc.ContainerRun:
    launched = smc.launch(aws, argv + (["--sdk", sdk] if sdk else []), inputs=inputs, root=root)
    assert launched.sdk == (sdk or "v2")
    return smc.replay(aws, launched, workdir=tmp_path / "job", **kw)


# ---------------------------------------------------------------------------------------------
# Inputs, made with the library (not the scripts under test)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for name in ("django.txt", "mediawiki.txt"):
        shutil.copy2(AZ / name, d / name)
    return d


@pytest.fixture(scope="module")
def base_model_dir(small_tokenizer_dir, tmp_path_factory) -> str:
    """A randomly initialised tiny model in HF format, with the tokenizer beside it (a phase-2 export's layout)."""
    from minilm_az.hf import save_pretrained
    from minilm_az.model import build_model, get_preset
    from minilm_az.tokenizer import copy_tokenizer_files, load_tokenizer

    out = str(tmp_path_factory.mktemp("base") / "model")
    vocab = load_tokenizer(small_tokenizer_dir).get_vocab_size()
    save_pretrained(build_model(get_preset("tiny", vocab), seed=0), out)
    copy_tokenizer_files(small_tokenizer_dir, out)
    return out


# ---------------------------------------------------------------------------------------------
# The harness itself

PROBE_VIEW = textwrap.dedent("""
    import errno, json, os, shutil, socket
    cfg = "/opt/ml/input/config/"
    hps = json.load(open(cfg + "hyperparameters.json"))
    channels = sorted(json.load(open(cfg + "inputdataconfig.json")))
    data = sorted(os.listdir("/opt/ml/input/data/corpus"))
    open("/opt/ml/output/staged", "w").write("x")
    try:
        os.replace("/opt/ml/output/staged", "/opt/ml/model/staged")
        rename = "ok"
    except OSError as e:
        rename = errno.errorcode[e.errno]
    try:
        os.rmdir("/opt/ml/model")
        rmdir = "ok"
    except OSError as e:
        rmdir = errno.errorcode[e.errno]
    try:
        shutil.rmtree("/opt/ml/model")
        rmtree = "ok"
    except OSError as e:
        rmtree = errno.errorcode[e.errno]
    shutil.copy("/opt/ml/output/staged", "/opt/ml/model/probe.txt")  # a copy crosses mounts fine
    print("PROBE " + json.dumps({"hps": hps, "channels": channels, "data": data, "rename": rename,
                                  "rmdir": rmdir, "rmtree": rmtree, "host": socket.gethostname(),
                                  "cwd": os.getcwd()}))
""")


def run_hps(tmp_path) -> dict:
    return json.loads((tmp_path / "job" / "opt_ml" / "input" / "config" / "hyperparameters.json").read_text())


def code_dir(run: smc.ContainerRun, tmp_path) -> str:
    """Where the code runs as a program sees it: /opt/ml/code (2.x) or /opt/ml/input/data/code (3.x)
    (patched isolation: /opt/ml is a symlink, which getcwd resolves)."""
    rel = "code" if run.sdk == "v2" else "input/data/code"
    return f"/opt/ml/{rel}" if run.isolation == "namespace" else str((tmp_path / "job" / "opt_ml" / rel).resolve())


def toolkit_argv(hps: dict) -> list[str]:
    """sagemaker-training's mapping, written out: sorted keys, one dash for one letter, JSON-decoded values."""
    out = []
    for k in sorted(k for k in hps if not k.startswith("sagemaker_")):
        out += [f"-{k}" if len(k) == 1 else f"--{k}", str(json.loads(hps[k]))]
    return out


def _probe(run: smc.ContainerRun, tag: str = "PROBE") -> list[dict]:
    return [json.loads(m.group(1)) for m in re.finditer(rf"^{tag} (.*)$", run.log, re.M)]


def env_of(probes: list[dict]) -> dict:
    return probes[0]["env"]


def test_harness_view_has_the_request_the_channels_and_a_separate_model_mount(aws, tmp_path, corpus_dir):
    run = replay(
        aws,
        ["tokenize", "train", "--vocab-size", "400"],
        tmp_path,
        inputs={"--corpus": corpus_dir},
        program=[sys.executable, "-c", PROBE_VIEW],
    )
    assert run.returncode == 0, run.explain()
    (p,) = _probe(run)
    assert p["hps"]["vocab-size"] == "400" and json.loads(p["hps"]["sagemaker_program"]) == sm.ENTRY_WRAPPER
    assert p["channels"] == ["corpus"] and p["data"] == ["django.txt", "mediawiki.txt"]
    assert p["hps"] == run_hps(tmp_path)  # exactly the request's HyperParameters
    assert (p["rename"], p["rmdir"], p["rmtree"]) == ("EXDEV", "EBUSY", "EBUSY")
    assert p["cwd"] == code_dir(run, tmp_path)
    if run.isolation == "namespace":
        assert p["host"] == "algo-1"
        assert not Path("/opt/ml/model/probe.txt").exists()  # the host's /opt/ml was never written
    assert run.model_files() == ["probe.txt"] and run.checkpoint_dir is None


PROBE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    # one line per rank in ONE write(2) under PIPE_BUF (4096 bytes), so the ranks' lines cannot interleave:
    # not SM_TRAINING_ENV, and not print(), which under the toolkit's `python -u` writes the newline apart
    keep = ("SM_HPS", "SM_USER_ARGS", "SM_MODEL_DIR", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("SM_CHANNEL_")}
    os.write(1, ("PROBE " + json.dumps({"argv": sys.argv, "env": env, "path": sys.path[:2]}) + "\\n").encode())
    code = 3 if os.environ.get("SM_HP_STEPS") == "3" else 0
    if os.environ.get("RANK", "0") == "0":
        open(os.path.join(os.environ["SM_MODEL_DIR"], "probe.json"), "w").write(json.dumps(sys.argv))
    sys.exit(code)
""")


@pytest.fixture
def probe_project(tmp_path) -> Path:
    """A copy of the checkout whose train.py and finetune.py are PROBE_SCRIPT.

    tokenize.py stays real: /opt/ml/code is on the container's PYTHONPATH, so every `import tokenize` of the
    standard library (torch, torchrun) meets it, and only the real one hands that import back to the stdlib.
    """
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "minilm_az", root / "minilm_az", ignore=shutil.ignore_patterns("__pycache__"))
    for f in [
        *ROOT.glob("*.py"),
        *(ROOT / n for n in ("setup.cfg", "pyproject.toml", "README.md", sm.REQUIREMENTS_FILE)),
    ]:
        if f.is_file():
            shutil.copy2(f, root / f.name)
    for script in ("train.py", "finetune.py"):
        (root / script).write_text(PROBE_SCRIPT)
    return root


@pytest.mark.parametrize("sdk", SDKS)
def test_harness_runs_train_under_the_containers_torchrun_with_its_argv_and_env(
    sdk, aws, tmp_path, probe_project, container_shards_dir
):
    run = replay(
        aws,
        ["train", "--phase", "2", "--steps", "4", "--no-liger", "--lr", "3e-4"],
        tmp_path,
        inputs={"--data": container_shards_dir},
        root=probe_project,
        sdk=sdk,
    )
    assert run.returncode == 0 and run.program_returncode == 0, run.explain()
    assert run.sdk == sdk and run.command[: len(TORCHRUN[sdk])] == TORCHRUN[sdk], run.command
    probes = _probe(run)
    assert sorted(p["env"]["RANK"] for p in probes) == ["0", "1"] and probes[0]["env"]["WORLD_SIZE"] == "2"
    hps = run_hps(tmp_path)
    argv = probes[0]["argv"][1:]
    if sdk == "v2":
        assert argv == toolkit_argv(hps) == sm.container_args(hps)  # the launcher's model of the container holds
        assert json.loads(env_of(probes)["SM_USER_ARGS"]) == argv
    else:
        assert argv == sm.container_args_v3(hps)
    assert {("--liger", "false"), ("--lr", "3e-4"), ("--phase", "2"), ("--steps", "4")} <= set(zip(argv, argv[1:]))
    env = env_of(probes)
    assert env["SM_CHANNEL_DATA"] == "/opt/ml/input/data/data" and env["SM_MODEL_DIR"] == "/opt/ml/model"
    decoded = {k: json.loads(v) for k, v in hps.items() if not k.startswith("sagemaker_")}
    assert json.loads(env["SM_HPS"]) == decoded
    assert probes[0]["path"][0] == code_dir(run, tmp_path)  # the uploaded code, not this checkout
    assert run.model_files() == ["probe.json"] and run.checkpoint_dir is None  # no CheckpointConfig: no local sync
    # checkpoints go to the job's S3 prefix, from every rank (issue 37)
    assert dict(zip(argv, argv[1:]))["--checkpoint-dir"] == smc.checkpoint_uri({"HyperParameters": hps})
    assert (run.output_dir / "success").is_file() == (sdk == "v2")  # 3.x's sm_train.sh leaves no such file


@pytest.mark.parametrize("sdk", SDKS)
def test_harness_reports_a_failing_program_as_a_failed_job(sdk, aws, tmp_path, probe_project, base_model_dir):
    run = replay(
        aws,
        ["finetune", "--steps", "3"],
        tmp_path,
        inputs={"--data": CHAT, "--model": base_model_dir},
        root=probe_project,
        sdk=sdk,
    )
    assert run.program_returncode == 3 and run.returncode != 0, run.explain()
    assert "torchrun" not in run.command, run.command
    if sdk == "v2":
        assert run.command[1:3] == ["--", "finetune.py"], run.command
        assert run.failure and "ExecuteUserScriptError" in run.failure
    else:
        assert run.command[1:3] == ["finetune.py", "--model"], run.command
        assert run.failure and "CalledProcessError" in run.failure


# ---------------------------------------------------------------------------------------------
# The stages, as SageMaker runs them


def _metric_values(log: str, name: str, metrics=sm.TRAIN_METRICS) -> list[float]:
    rx = re.compile(next(m["Regex"] for m in metrics if m["Name"] == name))
    return [float(m.group(1)) for m in map(rx.search, log.splitlines()) if m]


@pytest.mark.slow
@pytest.mark.parametrize("sdk", SDKS)
def test_tokenize_train_with_passthrough_flags_writes_the_tokenizer_to_the_model_dir(sdk, aws, tmp_path, corpus_dir):
    run = replay(
        aws,
        ["tokenize", "train", "--vocab-size", "400", "--no-progress", "--overwrite"],
        tmp_path,
        inputs={"--corpus": corpus_dir},
        sdk=sdk,
    )
    assert run.returncode == 0, run.explain()
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(run.model_files()), (
        run.explain()
    )
    from minilm_az.tokenizer import load_tokenizer

    assert load_tokenizer(str(run.model_dir)).get_vocab_size() == 400


@pytest.mark.slow
def test_tokenize_encode_writes_shards_and_index_to_the_model_dir(aws, tmp_path, corpus_dir, small_tokenizer_dir):
    run = replay(
        aws,
        ["tokenize", "encode", "--val-fraction", "0.1"],
        tmp_path,
        inputs={"--corpus": corpus_dir, "--tokenizer": small_tokenizer_dir},
    )
    assert run.returncode == 0, run.explain()
    files = run.model_files()
    assert "index.json" in files and any(f.endswith(".bin") for f in files), run.explain()
    index = json.loads((run.model_dir / "index.json").read_text())
    assert all(index["splits"][s]["tokens"] > 0 for s in ("train", "val")), index


@pytest.mark.slow
@pytest.mark.parametrize("sdk", SDKS)
def test_train_phase2_under_torchrun_exports_and_checkpoints(
    sdk, aws, tmp_path, container_shards_dir, small_tokenizer_dir
):
    run = replay(
        aws,
        (
            "train --phase 2 --preset tiny --steps 4 --checkpoint-every 2 --seq-len 32 --micro-batch 2 "
            "--global-batch 4 --eval-every 2 --log-every 1 --no-liger --tensorboard"
        ).split(),
        tmp_path,
        inputs={"--data": container_shards_dir, "--tokenizer": small_tokenizer_dir},
        sdk=sdk,
    )
    assert run.returncode == 0, run.explain()
    assert run.command[: len(TORCHRUN[sdk])] == TORCHRUN[sdk], run.command
    files = run.model_files()
    assert "config.json" in files and "model.safetensors" in files, run.explain()
    assert "tokenizer.json" in files
    assert committed_in_s3(tmp_path, "phase2/"), run.explain()  # every rank's part, and rank 0's commit last
    # --tensorboard: event files in the dir the job's TensorBoardOutputConfig uploads (test_sagemaker checks its path)
    assert any(f.name.startswith("events.out.tfevents") for f in (run.output_dir / "tensorboard").iterdir())
    log = run.program_output()
    assert len(_metric_values(log, "train:loss")) == 4, run.explain()  # CloudWatch reads these off the log
    assert _metric_values(log, "eval:val_bpb"), run.explain()


def committed_in_s3(tmp_path: Path, under: str) -> list[str]:
    """The checkpoints with a commit.json under the replayed job's --checkpoint-dir (+ `under`), on the S3 server."""
    uri = json.loads(run_hps(tmp_path)["checkpoint-dir"]) + under
    return sorted(k for k in smc.s3_objects(uri) if k.endswith("/commit.json"))


def _count_lines(path: Path) -> int:
    return sum(1 for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip())


@pytest.mark.slow
def test_finetune_reads_the_val_data_channel_and_writes_the_adapter(aws, tmp_path, base_model_dir):
    data, val = tmp_path / "sft", tmp_path / "sft-val"
    data.mkdir()
    val.mkdir()
    shutil.copy2(CHAT, data / CHAT.name)
    shutil.copy2(CHAT_VAL, val / CHAT_VAL.name)
    n_val = _count_lines(CHAT_VAL)
    assert n_val != max(1, int(_count_lines(CHAT) * 0.05))  # the val file's count is not the 5 % split's
    run = replay(
        aws,
        (
            "finetune --lora-r 4 --lora-alpha 8 --steps 2 --micro-batch 2 --global-batch 4 --max-seq-len 256 "
            "--eval-every 1 --log-every 1 --no-liger"
        ).split(),
        tmp_path,
        inputs={"--model": base_model_dir, "--data": data, "--val-data": val},
    )
    assert run.returncode == 0, run.explain()
    files = run.model_files()
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files), run.explain()
    cfg = json.loads((run.model_dir / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (4, 8), cfg
    # the val conversations came from the val_data channel's file: the program names it, and the count it logs
    # is that file's (no 5 % split of --data, no other file, gives it)
    out = run.program_output().splitlines()
    named = [ln for ln in out if CHAT_VAL.name in ln]
    assert named, f"the program never names {CHAT_VAL.name}\n{run.explain()}"
    on_named, as_key = rf"(?<![\w.]){n_val}(?![\w.])", rf"\bval\w*={n_val}(?![\w.])"
    assert any(re.search(on_named, ln) for ln in named) or any(re.search(as_key, ln) for ln in out), (
        f"no log line gives the val set's size as {n_val} (the lines of {CHAT_VAL.name})\n{run.explain()}"
    )
    assert _metric_values(run.program_output(), "eval:val_loss", sm.FINETUNE_METRICS)
    # and it checkpointed straight to the job's checkpoint prefix on S3, committed
    assert committed_in_s3(tmp_path, ""), run.explain()
