"""Replay a SageMaker training job on this machine: the launcher's real request, the real container toolkit.

    launched = launch(session, ["train", "--phase", "2", "--steps", "4"], inputs={"--data": shards_dir})
    run = replay(session, launched, workdir=tmp_path)
    assert run.returncode == 0, run.explain()
    assert "config.json" in run.model_files()

`launch` runs `minilm_az.launch.sagemaker.launch` against a moto-mocked AWS (the caller owns the mock): each
local input is uploaded to the mocked S3 first and passed to its launcher flag (`--data s3://...`). `replay` then
builds what the instance would see from the CreateTrainingJob request alone:

- /opt/ml/input/config/{hyperparameters,resourceconfig,inputdataconfig,checkpointconfig}.json (one host,
  algo-1; the hyperparameters exactly as sent, i.e. JSON-encoded by the SDK);
- /opt/ml/input/data/<channel>/ downloaded from the channel's S3 prefix (File mode);
- /opt/ml/code empty: the toolkit fetches sourcedir.tar.gz itself (its S3 download is pointed at the
  bytes the launcher uploaded) and extracts it;
- /opt/ml/model (its own mount, empty), the checkpoint LocalPath (empty), /opt/ml/output;

and, for an SDK 2.x request, runs the image's entry point, `sagemaker_training.cli.train` (the real toolkit)
with SAGEMAKER_TRAINING_MODULE=sagemaker_pytorch_container.training:main, as the AWS PyTorch image sets it
(the real sagemaker-pytorch-training package when installed; else, or with SM_CONTAINER_FRAMEWORK=fallback,
`pytorch_training_main` below, which calls the same sagemaker_training pieces). The toolkit computes SM_*
from the files, maps hyperparameters to argv (`mapping.to_cmd_args`) and runs `python train.py ...` or,
with torch_distributed, `torchrun --nnodes 1 --nproc_per_node N train.py ...`. Two deliberate departures,
both logged: requirements.txt is not pip-installed (this environment already has the project and its
dependencies), and torchrun gets `nproc` processes per host (2 by default) instead of one per GPU (none
on a CPU machine). Patched isolation adds a third: MASTER_ADDR is 127.0.0.1 (algo-1 does not resolve). Not
logged, as nothing a job sees changes: the image's module reads torch's version (SM_DLC_TORCH_VERSION) from the
package metadata instead of importing torch in the toolkit's process (~1.5 s of CPU a host).

Isolation ("namespace", used wherever `unshare` and `mount` are permitted, e.g. as root): the driver runs
under `unshare --mount --propagation private` (plus --net/--uts/--pid where allowed), bind-mounts the job's
directory on /opt/ml (a private tmpfs on /opt first when /opt/ml does not exist, the host's /opt entries
bound back in), mounts a tmpfs on /opt/ml/model and a hosts file on /etc/hosts, and names the host algo-1.
The host's /opt/ml is never written. A rename into /opt/ml/model really fails with EXDEV and rmdir of it
with EBUSY; the model is copied out before the namespace ends.
Fallback ("patched"; force it with SM_CONTAINER_ISOLATION=patched): /opt/ml is a symlink to the job's
directory for the duration of the run (under a lock; refused if /opt/ml already exists), and a
sitecustomize on PYTHONPATH makes os.rename/os.replace across /opt/ml/model raise EXDEV and os.rmdir of it
(hence shutil.rmtree) raise EBUSY, in every Python process of the job.

An SDK 3.x request (ModelTrainer) replaces the image's entry point: its ContainerEntrypoint and
ContainerArguments (`/bin/bash -c ".../sm_drivers/sm_train.sh"`) run as they are, over the `code` and
`sm_drivers` channels the SDK uploaded (downloaded like any channel). SDK's environment.py writes
sm_training.env, sm_train.sh sources it, cds to /opt/ml/input/data/code and runs the Torchrun or basic
driver, which builds `--key value` argv from SM_HPS. Two departures, both logged: requirements are not
pip-installed (the drivers' install_requirements.py becomes a stub that checks the file is there), and
an `nvidia-smi` on PATH reports `nproc` GPUs, so the Torchrun driver starts `nproc` processes per host
(torch still finds no CUDA and trains on the CPU).

Several hosts (`replay(..., hosts=N)` or `replay_job`): one view per instance under WORKDIR/algo-K, built
as above with resourceconfig.json naming algo-K among algo-1..algo-N, every channel downloaded to every host
(FullyReplicated), each host its own /opt/ml/model mount and checkpoint LocalPath. The hosts start together,
each under its own mount, UTS and PID namespaces, all in one private network namespace where every algo-K is
127.0.0.1 (each host's /etc/hosts), so the toolkit's own line `torchrun --nnodes N --nproc_per_node P
--master_addr algo-1 --master_port 7777 --node_rank K-1` (3.x's driver: the same as `--key=value`) meets at
algo-1's port 7777 unchanged. Where --net is not permitted the hosts share this machine's network and the
master port is a free one (logged). Triggers kill a host's whole process tree or call back when a log line
appears or after some seconds; a job past its timeout is killed and returned as timed out.

S3 from inside: a job whose script writes checkpoints to s3:// (the launcher's --checkpoint-dir) reaches one
local S3 server per test process (`s3_server()`, tests/s3_server.py, with the launch bucket made on it). The
container's environment carries AWS_ENDPOINT_URL_S3, a region and fake credentials, as a real job gets an
endpoint and its role's credentials; a relay carries 127.0.0.1:PORT inside the job's private network to the
server on this machine's loopback, so the hosts keep their own network and still see S3, as an instance does.

This module's top level needs only the standard library: `replay` copies it into the job's directory and
runs it there as the driver (`python sm_container.py --driver SPEC`).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # the driver runs this file alone, with the standard library only
    from s3_server import S3Server

PROJECT_ROOT = Path(__file__).resolve().parent.parent
BUCKET = "minilm-az-container-test"
ROLE = "arn:aws:iam::123456789012:role/minilm-az-sagemaker"
OPT_ML = "/opt/ml"
HOST = "algo-1"
FRAMEWORK_MODULE = "sagemaker_pytorch_container.training:main"
FALLBACK_FRAMEWORK_MODULE = "sm_container:pytorch_training_main"
HARNESS_EXIT = 97  # the driver's status when the harness itself failed before the toolkit started
PATCHED_LOCK = "/tmp/sm_container.opt_ml.lock"


class HarnessError(RuntimeError):
    """The replay could not be set up: a problem of this harness or of the test, never of the product."""


# ---------------------------------------------------------------------------------------------
# Launch (inside the caller's moto mock)


def aws_test_env() -> dict[str, str]:
    """Environment for a boto3 session inside moto: fake credentials, a region, no config files or metadata."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "SAGEMAKER_SUPPRESS_V2_WARNING": "1",
        "SAGEMAKER_VALIDATE_ROLE": "false",  # 3.x would ask IAM (SimulatePrincipalPolicy) about the role
    }


def upload(session: Any, local: str | Path, uri: str) -> str:
    """Upload a file or a directory tree under the S3 prefix `uri` (which ends with '/'); returns `uri`."""
    local = Path(local)
    bucket, prefix = _split_s3(uri)
    s3 = session.client("s3")
    files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
    if not files:
        raise HarnessError(f"{local}: nothing to upload (missing or empty)")
    for f in files:
        rel = f.name if f == local else f.relative_to(local).as_posix()
        s3.upload_file(str(f), bucket, prefix + rel)
    return uri


def input_flags(stage: str) -> dict[str, str]:
    """The launcher's input flags for `stage` (`--model`, `--val-data`, ...) -> the channel each one creates."""
    from minilm_az.launch import sagemaker as sm

    sub = next(a for a in sm.build_parser()._actions if a.dest == "stage")
    return {
        flag: a.dest[3:] for a in sub.choices[stage]._actions if a.dest.startswith("ch_") for flag in a.option_strings
    }


def launch(
    session: Any,
    argv: list[str],
    *,
    inputs: dict[str, str | Path] | None = None,
    root: str | Path = PROJECT_ROOT,
    bucket: str = BUCKET,
    role: str = ROLE,
):
    """`python -m minilm_az.launch.sagemaker ARGV --input s3://... --role ROLE --bucket BUCKET`, against moto.

    `inputs` maps a launcher input flag (`--data`, `--model`, `--val-data`: what a user types) to a local
    file or dir, uploaded first to s3://BUCKET/inputs/<id>/<flag>/. Returns the launcher's
    `Launched(plan, request, sent)`; the channel names are the launcher's business.
    """
    from minilm_az.launch import sagemaker as sm

    s3 = session.client("s3")
    if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=bucket)
    known = input_flags(argv[0])
    flags: list[str] = []
    run_id = uuid.uuid4().hex[:8]
    for flag, local in (inputs or {}).items():
        if flag not in known:
            raise HarnessError(f"the launcher's {argv[0]} has no input flag {flag}; it has {sorted(known)}")
        flags += [flag, upload(session, local, f"s3://{bucket}/inputs/{run_id}/{flag.lstrip('-')}/")]
    args = sm.parse_args(list(argv) + flags + ["--role", role, "--bucket", bucket])
    launched = sm.launch(args, boto_session=session, root=root)
    if not launched.request.get("HyperParameters"):
        raise HarnessError("the launch captured no CreateTrainingJob request")
    return launched


def launch_in_moto(argv: list[str]) -> dict:
    """`launch(ARGV)` in a fresh moto mock with this environment's SDK: {"sdk", "request", "plan"} as JSON data.

    For comparing the two SDK lines, which never share an environment: `python sm_container.py --launch ARGV`
    run by the other line's interpreter prints this.
    """
    import dataclasses

    import boto3
    import moto

    os.environ.update(aws_test_env())
    os.environ.pop("AWS_PROFILE", None)
    with moto.mock_aws():
        launched = launch(boto3.Session(region_name="us-east-1"), argv)
    return {"sdk": launched.sdk, "request": launched.request, "plan": dataclasses.asdict(launched.plan)}


def source_tarball(session: Any, request: dict) -> bytes:
    """The sourcedir.tar.gz the launcher uploaded (sagemaker_submit_directory)."""
    bucket, key = _split_s3(json.loads(request["HyperParameters"]["sagemaker_submit_directory"]))
    return session.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()


def _split_s3(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise HarnessError(f"{uri!r} is not an s3:// URI")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


# ---------------------------------------------------------------------------------------------
# The container's view of the job, built from the request


def _under_opt_ml(path: str) -> str:
    rel = os.path.relpath(path, OPT_ML)
    if rel.startswith(".."):
        raise HarnessError(f"{path} is outside {OPT_ML}; the replay only simulates {OPT_ML}")
    return rel


def prepare(
    session: Any, request: dict, workdir: str | Path, *, host: str = HOST, hosts: Sequence[str] = (HOST,)
) -> Path:
    """Write WORKDIR/opt_ml (what /opt/ml holds when the toolkit starts) and WORKDIR/harness; returns opt_ml.

    `host` is the instance this view is for, `hosts` all the job's instances (resourceconfig.json's list).
    """
    workdir = Path(workdir)
    root, harness = workdir / "opt_ml", workdir / "harness"
    if root.exists():
        raise HarnessError(f"{root} exists: one replay per workdir")
    rc = request["ResourceConfig"]
    if rc.get("InstanceCount", 1) != len(hosts):
        if len(hosts) == 1:
            raise HarnessError("the replay simulates one instance; launch with --instance-count 1")
        raise HarnessError(
            f"the request asks for {rc.get('InstanceCount', 1)} instances; the replay has {len(hosts)} hosts"
        )
    if host not in hosts:
        raise HarnessError(f"{host} is not one of the job's hosts {list(hosts)}")
    itype = rc["InstanceType"]
    cfg = root / "input" / "config"
    for d in (cfg, root / "input" / "data", root / "code", root / "model", root / "output" / "data", harness):
        d.mkdir(parents=True)
    _write_json(cfg / "hyperparameters.json", request["HyperParameters"])
    _write_json(
        cfg / "resourceconfig.json",
        {
            "current_host": host,
            "current_instance_type": itype,
            "current_group_name": "homogeneousCluster",
            "hosts": list(hosts),
            "network_interface_name": "eth0",
            "instance_groups": [
                {"instance_group_name": "homogeneousCluster", "instance_type": itype, "hosts": list(hosts)}
            ],
        },
    )
    channels = request.get("InputDataConfig") or []
    _write_json(
        cfg / "inputdataconfig.json",
        {
            c["ChannelName"]: {
                "TrainingInputMode": c.get("InputMode", "File"),
                "S3DistributionType": "FullyReplicated",
                "RecordWrapperType": "None",
            }
            for c in channels
        },
    )
    s3 = session.client("s3")
    for c in channels:
        src = c["DataSource"]["S3DataSource"]
        if src.get("S3DataType", "S3Prefix") != "S3Prefix":
            raise HarnessError(f"channel {c['ChannelName']}: only S3Prefix data sources are replayed")
        bucket, prefix = _split_s3(src["S3Uri"])
        dest = root / "input" / "data" / c["ChannelName"]
        dest.mkdir()
        keys = [
            o["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])
            if not o["Key"].endswith("/")
        ]
        if not keys:  # SageMaker fails such a job before the container starts
            raise HarnessError(f"channel {c['ChannelName']}: no S3 objects under {src['S3Uri']}")
        for key in keys:
            rel = key[len(prefix) :].lstrip("/") or key.rsplit("/", 1)[-1]
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, key, str(dest / rel))
    ckpt = request.get("CheckpointConfig")
    if ckpt:
        _write_json(cfg / "checkpointconfig.json", ckpt)
        (root / _under_opt_ml(ckpt.get("LocalPath", "/opt/ml/checkpoints"))).mkdir(parents=True)
    if is_v3(request):
        stub = root / "input" / "data" / "sm_drivers" / "scripts" / "install_requirements.py"
        if not stub.is_file():
            raise HarnessError(f"the sm_drivers channel has no {stub.relative_to(root)}")
        stub.write_text(INSTALL_STUB)
    else:
        (harness / "sourcedir.tar.gz").write_bytes(source_tarball(session, request))
    return root


def is_v3(request: dict) -> bool:
    """An SDK 3.x (ModelTrainer) request: it brings its own entry point instead of the image's toolkit."""
    return bool((request.get("AlgorithmSpecification") or {}).get("ContainerEntrypoint"))


# The drivers' install_requirements.py, replaced: this environment already has the project and its dependencies.
INSTALL_STUB = r"""
import os, sys
req = sys.argv[1]
if not os.path.isfile(req):
    sys.exit(f"sm_container: {os.getcwd()}/{req} does not exist (pip install -r would fail)")
print(f"sm_container: skipped `pip install -r {req}` in {os.getcwd()}: the test environment already has "
      "the project and its dependencies", flush=True)
"""

# What the instance's GPUs look like to environment.py (SM_NUM_GPUS), and so to the Torchrun driver.
FAKE_NVIDIA_SMI = r"""#!/bin/sh
[ "$1" = "--list-gpus" ] || { echo "sm_container: this nvidia-smi only answers --list-gpus" >&2; exit 1; }
i=0; while [ $i -lt @N@ ]; do echo "GPU $i: simulated by sm_container (UUID: GPU-sm-$i)"; i=$((i+1)); done
"""


def container_env(request: dict) -> dict[str, str]:
    """The process environment on the instance: the image's, the platform's, the request's Environment."""
    region = json.loads(request["HyperParameters"].get("sagemaker_region", '"us-east-1"'))
    name = request["TrainingJobName"]
    try:
        import sagemaker_pytorch_container.training  # noqa: F401

        module = FRAMEWORK_MODULE
    except ImportError:
        module = FALLBACK_FRAMEWORK_MODULE
    if os.environ.get("SM_CONTAINER_FRAMEWORK") == "fallback":  # to test the stand-in where the real one is installed
        module = FALLBACK_FRAMEWORK_MODULE
    env = {
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/bin:/bin")]),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",  # as the PyTorch image sets it
        "SAGEMAKER_TRAINING_MODULE": module,
        "TRAINING_JOB_NAME": name,
        "TRAINING_JOB_ARN": f"arn:aws:sagemaker:{region}:123456789012:training-job/{name}",
        "AWS_REGION": region,
        "AWS_DEFAULT_REGION": region,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    if checkpoint_uri(request):  # the job's role and S3's endpoint, as the instance would have them
        env.update(s3_server().env())
    env.update(request.get("Environment") or {})
    return env


def checkpoint_uri(request: dict) -> str | None:
    """The s3:// URI the launcher passed as the script's --checkpoint-dir (None: the job has none)."""
    raw = (request.get("HyperParameters") or {}).get("checkpoint-dir")
    try:
        uri = json.loads(raw) if raw else None
    except ValueError:  # 3.x sends plain strings
        uri = raw
    return uri if isinstance(uri, str) and uri.startswith("s3://") else None


_S3: S3Server | None = None


def s3_server() -> S3Server:
    """The local S3 server of this test process (started at the first call, stopped at exit), holding BUCKET."""
    global _S3
    if _S3 is None or _S3.proc.poll() is not None:
        import atexit
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from s3_server import S3Server

        _S3 = S3Server.start(Path(tempfile.mkdtemp(prefix="sm-container-s3-")))
        atexit.register(_S3.stop)
        _S3.make_bucket(BUCKET)
    return _S3


def s3_objects(uri: str) -> dict[str, int]:
    """key (relative to `uri`) -> size of every object the local S3 server holds under the prefix `uri`."""
    bucket, prefix = _split_s3(uri.rstrip("/") + "/")
    return {k[len(prefix) :]: size for k, size in s3_server().objects(bucket, prefix).items()}


CLONE_NEWNET = 0x40000000  # setns(2)'s flag for a network namespace


class _Relay:
    """TCP connections to 127.0.0.1:PORT inside a private network namespace, carried to 127.0.0.1:PORT on this
    machine's (where the S3 server listens). One thread accepts; two pump each connection's bytes."""

    def __init__(self, netns_pid: int, port: int) -> None:
        import ctypes

        libc, box = ctypes.CDLL(None, use_errno=True), {}

        def listen_inside() -> None:
            # setns changes the namespace of the calling thread only: this short thread enters the job's network,
            # binds there and ends; the socket stays in the namespace it was made in, and the rest of this
            # process stays in this machine's.
            try:
                with open(f"/proc/{netns_pid}/ns/net") as ns:
                    if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns into the job's network namespace")
                sock = socket.socket()
                sock.bind(("127.0.0.1", port))
                sock.listen(64)
                box["socket"] = sock
            except OSError as e:
                box["error"] = e

        t = threading.Thread(target=listen_inside)
        t.start()
        t.join()
        if "error" in box:
            raise HarnessError(f"could not relay S3 into the job's network: {box['error']}")
        self.port, self.listener = port, box["socket"]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self.listener.accept()
                outside = socket.create_connection(("127.0.0.1", self.port))
            except OSError:
                return  # closed: the job ended
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):  # either side's end (or reset) ends the connection on both
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


def _private_network(request: dict) -> tuple[subprocess.Popen | None, list[str], _Relay | None]:
    """A network namespace for the job's hosts (loopback up), its nsenter prefix, and the S3 relay into it when
    the job writes checkpoints to S3; (None, [], None) where --net is not permitted (this machine's network)."""
    if "--net" not in (namespace_flags() or []):
        return None, [], None
    holder = _network_holder()
    try:
        relay = _Relay(holder.pid, s3_server().port) if checkpoint_uri(request) else None
    except BaseException:
        _stop_holder(holder)
        raise
    return holder, ["nsenter", f"--net=/proc/{holder.pid}/ns/net"], relay


def _stop_holder(holder: subprocess.Popen | None, relay: _Relay | None = None) -> None:
    if relay is not None:
        relay.close()
    if holder is not None:
        holder.kill()
        holder.wait()
        for stream in (holder.stdout, holder.stderr):
            stream.close()


# ---------------------------------------------------------------------------------------------
# Running it


@dataclass
class ContainerRun:
    """What a replayed job left: exit statuses, output, and the files of /opt/ml/model and the checkpoints."""

    returncode: int  # the container's exit status (what SageMaker reports): 0 is a Completed job
    program_returncode: int | None  # exit status of what the toolkit ran (python/torchrun); None: never ran
    command: list[str] | None  # the command the toolkit ran, as it logged it
    stdout: str
    stderr: str
    log: str  # stdout and stderr interleaved as they came
    model_dir: Path  # a copy of /opt/ml/model as the job left it
    checkpoint_dir: Path | None  # CheckpointConfig.LocalPath as the job left it (None: the job has none)
    output_dir: Path  # /opt/ml/output (success / failure files)
    isolation: str  # "namespace" or "patched"
    seconds: float
    sdk: str = "v2"  # which SDK line's request: "v2" ran the image's toolkit, "v3" its own sm_train.sh
    host: str = HOST  # which instance of the job this was (resourceconfig.json's current_host)
    killed: bool = False  # the harness SIGKILLed it (a trigger, or the job's timeout): its /opt/ml/model is lost
    frozen: bool = False  # a trigger SIGSTOPped it (an instance gone silent) before it was killed

    @property
    def failure(self) -> str | None:
        f = self.output_dir / "failure"
        return f.read_text(errors="replace") if f.is_file() else None

    def model_files(self) -> list[str]:
        return _files(self.model_dir)

    def checkpoint_files(self) -> list[str]:
        return _files(self.checkpoint_dir) if self.checkpoint_dir else []

    def program_log(self) -> str:
        """The log without the toolkit's dump of its environment (pages of JSON before the command)."""
        return re.sub(
            r"\nTraining Env:\n.*?\nInvoking script with the following command:\n",
            "\n[environment dump]\n",
            self.log,
            flags=re.S,
        )

    def program_output(self) -> str:
        """Only what the program printed: the lines after the toolkit's command line, without its log lines."""
        cmd = " ".join(self.command or [])
        log, start = self.log, 0
        for before in ("\n", "\nExecuting command: ") if cmd else ():  # 2.x's toolkit, 3.x's driver
            at = log.find(before + cmd + "\n")
            if at >= 0:
                start = at + len(before) + len(cmd) + 1
                break
        lines = log[start:].splitlines()
        return "\n".join(ln for ln in lines if not _TOOLKIT_LINE.match(ln)) + "\n"

    def explain(self, tail: int = 6000) -> str:
        """A summary for assertion messages: statuses, the command, the files, the end of the log."""
        return (
            f"{self.host}: container exit {self.returncode}{' (frozen)' if self.frozen else ''}"
            f"{' (killed)' if self.killed else ''}, "
            f"program exit {self.program_returncode}, "
            f"isolation {self.isolation}, {self.seconds:.1f} s\ncommand: {' '.join(self.command or ['?'])}\n"
            f"/opt/ml/model: {self.model_files()}\ncheckpoints: {self.checkpoint_files()}\n"
            f"--- log tail ---\n{self.program_log()[-tail:]}"
        )


_TOOLKIT_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ +(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"|sm_container: "
    r"|\++ "  # sm_train.sh's `set -x` trace
)


def _files(d: Path | None) -> list[str]:
    if d is None or not d.is_dir():
        return []
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() or p.is_symlink())


_NAMESPACE_FLAGS: list[str] | None = None


def namespace_flags() -> list[str] | None:
    """The `unshare` flags this machine permits for the replay (None: no private mount namespace)."""
    global _NAMESPACE_FLAGS
    if _NAMESPACE_FLAGS is not None:
        return _NAMESPACE_FLAGS or None
    probe = 'd=$(mktemp -d) && mount -t tmpfs tmpfs "$d" && umount "$d" && rmdir "$d"'
    extras = {"--net": " && ip link set lo up", "--uts": " && hostname algo-1", "--pid": ""}
    base = ["--mount", "--propagation", "private"]
    found: list[str] = []
    if shutil.which("unshare") and _ok(["unshare", *base, "sh", "-c", probe]):
        found = list(base)
        for flag, check in extras.items():
            extra = [flag, "--fork", "--kill-child", "--mount-proc"] if flag == "--pid" else [flag]
            if (flag != "--net" or shutil.which("ip")) and _ok(["unshare", *found, *extra, "sh", "-c", probe + check]):
                found += extra
    _NAMESPACE_FLAGS = found
    return found or None


def _ok(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def isolation_mode() -> str:
    forced = os.environ.get("SM_CONTAINER_ISOLATION")
    if forced in ("namespace", "patched"):
        if forced == "namespace" and not namespace_flags():
            raise HarnessError("SM_CONTAINER_ISOLATION=namespace, but unshare/mount are not permitted here")
        return forced
    return "namespace" if namespace_flags() else "patched"


def unavailable(sdk: str = "v2") -> str | None:
    """Why no replay of an `sdk` ("v2", "v3") request can run on this machine (None: it can), to skip with."""
    if sdk == "v3":
        if not shutil.which("bash"):
            return "no bash here to run the 3.x request's sm_train.sh"
    else:
        try:
            import sagemaker_training.cli.train  # noqa: F401
        except ImportError as e:
            return f"the container toolkit is not installed (pip install sagemaker-training): {e}"
    try:
        mode = isolation_mode()
    except HarnessError as e:
        return str(e)
    if mode == "patched" and not os.path.islink(OPT_ML):
        parent = os.path.dirname(OPT_ML)
        if os.path.exists(OPT_ML):
            return f"no mount namespace here, and {OPT_ML} exists, so it cannot be simulated"
        if not os.access(parent if os.path.isdir(parent) else os.path.dirname(parent), os.W_OK):
            return f"no mount namespace here, and {parent} is not writable for a temporary {OPT_ML}"
    return None


def replay(
    session: Any,
    launched: Any,
    *,
    workdir: str | Path,
    nproc: int = 2,
    timeout: float = 300,
    program: list[str] | None = None,
    hosts: int = 1,
    triggers: Sequence[Trigger] = (),
    readonly: dict[int, Sequence[str]] | None = None,
) -> ContainerRun | JobRun:
    """Build the container's view of `launched.request` under `workdir` and run the job there.

    `program` (an argv) runs instead of the toolkit, in the same view, cwd /opt/ml/code, with the toolkit's
    code dir left empty unless the program fills it: for testing the harness itself.
    With `hosts` > 1 this is `replay_job` (see there for the other arguments), and returns its JobRun.
    """
    request = launched.request if hasattr(launched, "request") else launched
    if hosts != 1:
        return replay_job(
            session,
            request,
            workdir=workdir,
            hosts=hosts,
            nproc=nproc,
            timeout=timeout,
            program=program,
            triggers=triggers,
            readonly=readonly,
        )
    if triggers or readonly:
        raise HarnessError("triggers and readonly are replay_job's; call it (hosts=1 works there)")
    prepare(session, request, workdir)
    return run_container(workdir, request, nproc=nproc, timeout=timeout, program=program)


def run_container(
    workdir: str | Path, request: dict, *, nproc: int = 2, timeout: float = 300, program: list[str] | None = None
) -> ContainerRun:
    workdir = Path(workdir).resolve()
    root = workdir / "opt_ml"
    mode = isolation_mode()
    spec, env, driver = _host_setup(workdir, request, nproc=nproc, program=program, mode=mode)
    lock = holder = relay = None
    if mode == "namespace":
        holder, prefix, relay = _private_network(request)
        flags = [f for f in namespace_flags() or [] if f != "--net" or holder is None]
        cmd = [*prefix, "unshare", *flags, *driver]
    else:
        cmd = driver
        site = workdir / "harness" / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE.replace("@MODEL@", str(root / "model")))
        env["PYTHONPATH"] = str(site)
        env["SM_STUDIO_LOCAL_MODE"] = "true"  # algo-1 does not resolve here: skip the toolkit's DNS wait
        env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's port, shared network
        lock = _link_opt_ml(root)
    t0 = time.time()
    try:
        proc = subprocess.Popen(
            cmd, env=env, cwd=str(workdir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        out, err, log = _collect(proc, timeout)
    finally:
        _stop_holder(holder, relay)
        if lock is not None:
            _unlink_opt_ml(lock)
    return _host_result(spec, request, proc.returncode, out, err, log, seconds=time.time() - t0)


def _host_setup(
    workdir: Path,
    request: dict,
    *,
    nproc: int,
    program: list[str] | None,
    mode: str,
    host: str = HOST,
    hosts: Sequence[str] = (HOST,),
    extra: dict | None = None,
) -> tuple[dict, dict[str, str], list[str]]:
    """One host's driver: its spec (written to harness/spec.json), its environment, and its argv."""
    root, harness = workdir / "opt_ml", workdir / "harness"
    alg = request.get("AlgorithmSpecification") or {}
    spec = {
        "mode": mode,
        "root": str(root),
        "harness": str(harness),
        "nproc": nproc,
        "program": program,
        "model_copy": str(workdir / "model"),
        "status": str(harness / "status.json"),
        "submit_dir": json.loads(request["HyperParameters"].get("sagemaker_submit_directory", "null")),
        "entrypoint": (alg.get("ContainerEntrypoint") or []) + (alg.get("ContainerArguments") or []),
        "host": host,
        **(extra or {}),
    }
    shutil.copy2(__file__, harness / "sm_container.py")
    # Every host of the job resolves to loopback: the hosts share one network namespace (or this machine's).
    # With several, the host's own name comes first, so that its fqdn (torchrun's failure report) is algo-K.
    others = [h for h in hosts if h != host]
    names = [
        f"127.0.0.1\t{host} localhost" if others else f"127.0.0.1\tlocalhost {host}",
        "::1\tlocalhost ip6-localhost",
    ]
    names += [f"127.0.0.1\t{' '.join(others)}"] if others else []
    (harness / "hosts").write_text("\n".join([*names, f"127.0.0.1\t{socket.gethostname()}"]) + "\n")
    _write_json(harness / "spec.json", spec)
    env = container_env(request)
    if spec["entrypoint"]:  # 3.x: the instance's GPUs, as nvidia-smi lists them
        (harness / "bin").mkdir()
        smi = harness / "bin" / "nvidia-smi"
        smi.write_text(FAKE_NVIDIA_SMI.replace("@N@", str(nproc)))
        smi.chmod(0o755)
        env["PATH"] = f"{harness / 'bin'}{os.pathsep}{env['PATH']}"
    driver = [sys.executable, str(harness / "sm_container.py"), "--driver", str(harness / "spec.json")]
    return spec, env, driver


def _host_result(
    spec: dict,
    request: dict,
    returncode: int,
    out: str,
    err: str,
    log: str,
    *,
    seconds: float,
    killed: bool = False,
    frozen: bool = False,
) -> ContainerRun:
    """What one host's driver left: its status file, its log, its directories.

    A host the harness killed (`killed`) never reaches the status "done"; any other host that does not
    failed in the harness itself.
    """
    status = json.loads(Path(spec["status"]).read_text()) if Path(spec["status"]).is_file() else {}
    if status.get("stage") != "done" and (not killed or status.get("error")):
        raise HarnessError(
            f"the harness failed on {spec['host']} ({status.get('error') or 'no status'}), exit {returncode}\n"
            f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"
        )
    root, mode, program = Path(spec["root"]), spec["mode"], spec["program"]
    ckpt = (request.get("CheckpointConfig") or {}).get("LocalPath")
    command, program_rc = status.get("command"), status.get("program_returncode")
    if spec["entrypoint"] and not program:  # 3.x: its driver logs the command and how it ended
        ran = re.search(r"^Executing command: (.*)$", log, re.M)
        failed = re.search(r"^Command failed with exit code (-?\d+)", log, re.M)
        command = ran.group(1).split() if ran else None
        program_rc = int(failed.group(1)) if failed else (0 if ran and returncode == 0 else None)
        print(
            f"sm_container: nvidia-smi listed {spec['nproc']} simulated GPUs; requirements.txt was not pip-installed",
            file=sys.stderr,
        )
    return ContainerRun(
        returncode=returncode,
        program_returncode=program_rc,
        command=command,
        stdout=out,
        stderr=err,
        log=log,
        model_dir=Path(spec["model_copy"]) if mode == "namespace" else root / "model",
        checkpoint_dir=root / _under_opt_ml(ckpt) if ckpt else None,
        output_dir=root / "output",
        isolation=mode,
        seconds=seconds,
        sdk="v3" if spec["entrypoint"] else "v2",
        host=spec["host"],
        killed=killed,
        frozen=frozen,
    )


def _collect(proc: subprocess.Popen, timeout: float) -> tuple[str, str, str]:
    """stdout, stderr, and both interleaved in arrival order (what CloudWatch would show)."""
    lines: list[tuple[int, str]] = []
    lock = threading.Lock()

    def read(stream, i):
        for raw in iter(stream.readline, b""):
            with lock:
                lines.append((i, raw.decode("utf-8", "replace")))
        stream.close()

    readers = [
        threading.Thread(target=read, args=(s, i), daemon=True) for i, s in enumerate((proc.stdout, proc.stderr))
    ]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()
        for t in readers:
            t.join(5)
        raise HarnessError(f"the replay ran past {timeout} s\n{''.join(ln for _, ln in lines)[-6000:]}") from None
    for t in readers:
        t.join()
    return (
        "".join(ln for i, ln in lines if i == 0),
        "".join(ln for i, ln in lines if i == 1),
        "".join(ln for _, ln in lines),
    )


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link_opt_ml(root: Path):
    """Patched mode: /opt/ml -> the job's dir for one run, under a lock; refuses a /opt/ml not made by us."""
    lock = open(PATCHED_LOCK, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        if os.path.islink(OPT_ML):
            os.unlink(OPT_ML)  # a previous replay's (we hold the lock, so nobody else's is live)
        if os.path.exists(OPT_ML):
            raise HarnessError(f"patched isolation needs {OPT_ML} free, and it exists on this machine")
        os.makedirs(os.path.dirname(OPT_ML), exist_ok=True)
        os.symlink(root, OPT_ML)
    except BaseException:
        lock.close()
        raise
    return lock


def _unlink_opt_ml(lock) -> None:
    try:
        if os.path.islink(OPT_ML):
            os.unlink(OPT_ML)
    finally:
        lock.close()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2))


# Patched isolation: what a separate mount on /opt/ml/model would make the kernel answer.
SITECUSTOMIZE = r"""
import errno as _errno
import os as _os

_MODEL = _os.path.realpath("@MODEL@")


def _path(p, dir_fd=None):
    p = _os.fsdecode(p) if not isinstance(p, int) else _os.readlink(f"/proc/self/fd/{p}")
    if dir_fd is not None and not _os.path.isabs(p):
        p = _os.path.join(_os.readlink(f"/proc/self/fd/{dir_fd}"), p)
    head, tail = _os.path.split(_os.path.abspath(p))
    return _os.path.join(_os.path.realpath(head), tail)


def _inside(p):
    return p == _MODEL or p.startswith(_MODEL + _os.sep)


def _mover(real):
    def move(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        s, d = _path(src, src_dir_fd), _path(dst, dst_dir_fd)
        if _MODEL in (s, d):
            raise OSError(_errno.EBUSY, "Device or resource busy (simulated mount point)", src, None, dst)
        if _inside(s) != _inside(d):
            raise OSError(_errno.EXDEV, "Invalid cross-device link (simulated mount)", src, None, dst)
        return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    return move


def _remover(real):
    def rmdir(path, *, dir_fd=None):
        if _path(path, dir_fd) == _MODEL:
            raise OSError(_errno.EBUSY, "Device or resource busy (simulated mount point)", path)
        return real(path, dir_fd=dir_fd)
    return rmdir


_os.rename, _os.replace, _os.rmdir = _mover(_os.rename), _mover(_os.replace), _remover(_os.rmdir)
"""


# ---------------------------------------------------------------------------------------------
# Several hosts: one job on N instances, each its own namespaces and /opt/ml


@dataclass
class Trigger:
    """What the replay does once, at a moment the test picks: SIGKILL hosts (`kill`), SIGSTOP hosts (`freeze`),
    and/or `call(job)`, in that order.

    The moment is `seconds` after the hosts started or, with `line` (a regex), `seconds` after the first log
    line (stdout or stderr) of host `host` (1-based; None: any host) that matches it. Triggers due at the same
    moment fire in list order. A kill takes the host's whole process tree (driver, toolkit, torchrun,
    workers) at once: the kernel closes its sockets, so its peers read a reset, as when a process dies. A
    freeze stops the tree and leaves its sockets open: its peers hear nothing more, as when an instance
    vanishes from the network (a spot interruption); the harness kills it at the end.
    """

    line: str | None = None
    host: int | None = None
    seconds: float = 0.0
    kill: int | Sequence[int] | Literal["all"] | None = None
    freeze: int | Sequence[int] | Literal["all"] | None = None
    call: Callable[[LiveJob], object] | None = None

    def describe(self) -> str:
        where = (
            f"line /{self.line}/ on {'any host' if self.host is None else f'algo-{self.host}'}"
            if self.line
            else "start"
        )
        return f"{self.seconds:g} s after {where}"


class _Host:
    """One instance while the job runs: its process, and its log lines as they arrive."""

    def __init__(self, index: int, workdir: Path, spec: dict, env: dict[str, str], cmd: list[str]) -> None:
        self.index, self.name, self.workdir = index, spec["host"], workdir
        self.spec, self.env, self.cmd = spec, env, cmd
        self.lines: list[tuple[float, int, str]] = []  # (seconds since start, 0 stdout / 1 stderr, text)
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.readers: list[threading.Thread] = []
        self.killed = False
        self.frozen = False
        self.ended: float | None = None

    def start(self, t0: float, seen: Callable[[_Host, float, str], None]) -> None:
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            cwd=str(self.workdir),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

        def read(stream, i: int) -> None:
            for raw in iter(stream.readline, b""):
                t, text = time.monotonic() - t0, raw.decode("utf-8", "replace")
                with self.lock:
                    self.lines.append((t, i, text))
                seen(self, t, text)
            stream.close()

        self.readers = [
            threading.Thread(target=read, args=(s, i), daemon=True)
            for i, s in enumerate((self.proc.stdout, self.proc.stderr))
        ]
        for t in self.readers:
            t.start()

    def text(self, stream: int | None = None) -> str:
        with self.lock:
            return "".join(ln for _, i, ln in self.lines if stream is None or i == stream)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> bool:
        """SIGKILL the host's process tree; False if it had already exited."""
        if not self.running():
            return False
        self.killed = True
        for p in _stop_tree(self.proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return True

    def freeze(self) -> bool:
        """SIGSTOP the host's process tree (it stays, silent, until killed); False if it had already exited."""
        if not self.running():
            return False
        self.frozen = True
        _stop_tree(self.proc.pid)
        return True


class LiveJob:
    """The job while it runs, as a Trigger's `call` sees it; hosts are numbered from 1 (algo-1)."""

    def __init__(self, hosts: list[_Host], t0: float, events: list[str], ckpt: str | None) -> None:
        self._hosts, self._t0, self._events, self._ckpt = hosts, t0, events, ckpt

    @property
    def names(self) -> list[str]:
        return [h.name for h in self._hosts]

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._t0

    def _host(self, k: int) -> _Host:
        if not 1 <= k <= len(self._hosts):
            raise HarnessError(f"host {k}: the job has hosts 1..{len(self._hosts)}")
        return self._hosts[k - 1]

    def opt_ml(self, k: int) -> Path:
        """Host k's /opt/ml, as this machine sees it."""
        return Path(self._host(k).spec["root"])

    def checkpoint_dir(self, k: int) -> Path:
        """Host k's CheckpointConfig.LocalPath, as this machine sees it."""
        if not self._ckpt:
            raise HarnessError("the request has no CheckpointConfig")
        return self.opt_ml(k) / _under_opt_ml(self._ckpt)

    def log(self, k: int) -> str:
        return self._host(k).text()

    def running(self, k: int) -> bool:
        return self._host(k).running()

    def kill(self, which: int | Sequence[int] | Literal["all"]) -> None:
        """SIGKILL hosts' whole process trees (see Trigger)."""
        for k in _host_numbers(which, len(self._hosts)):
            h = self._host(k)
            done = h.kill()
            self._events.append(f"{self.seconds:.1f} s: {'killed' if done else 'kill: already exited,'} {h.name}")

    def freeze(self, which: int | Sequence[int] | Literal["all"]) -> None:
        """SIGSTOP hosts' whole process trees (see Trigger)."""
        for k in _host_numbers(which, len(self._hosts)):
            h = self._host(k)
            done = h.freeze()
            self._events.append(f"{self.seconds:.1f} s: {'froze' if done else 'freeze: already exited,'} {h.name}")


def _host_numbers(which: int | Sequence[int] | Literal["all"], n: int) -> list[int]:
    if which == "all":
        return list(range(1, n + 1))
    return [which] if isinstance(which, int) else list(which)


@dataclass
class JobRun:
    """What a replayed job of several instances left: one ContainerRun per host (algo-1 first), and when."""

    hosts: list[ContainerRun]
    seconds: float  # from the hosts' start until the last one ended
    ended: list[float | None]  # when each host's container exited, in seconds from the start
    timed_out: bool  # the job ran past its timeout and the harness killed what was left
    events: list[str]  # what the harness did and saw, in order ("12.3 s: killed algo-2", "14.0 s: algo-1 exited 1")

    def host(self, k: int) -> ContainerRun:
        """Host k, numbered from 1 (algo-1) as the job's resourceconfig.json names them."""
        return self.hosts[k - 1]

    @property
    def returncode(self) -> int:
        """The job's status as SageMaker would see it: 0 only when every host's container exited 0."""
        return next((h.returncode for h in self.hosts if h.returncode != 0), 0)

    def explain(self, tail: int = 3000) -> str:
        head = f"job of {len(self.hosts)} hosts, exit {self.returncode}, {self.seconds:.1f} s"
        head += " (TIMED OUT)" if self.timed_out else ""
        parts = [head, *self.events]
        parts += [f"=== {h.host} ===\n{h.explain(tail)}" for h in self.hosts]
        return "\n".join(parts)


def replay_job(
    session: Any,
    launched: Any,
    *,
    workdir: str | Path,
    hosts: int = 2,
    nproc: int = 2,
    timeout: float = 300,
    program: list[str] | None = None,
    triggers: Sequence[Trigger] = (),
    readonly: dict[int, Sequence[str]] | None = None,
    emptied: dict[int, Sequence[str]] | None = None,
    host_env: dict[int, dict[str, str]] | None = None,
) -> JobRun:
    """Replay `launched.request` on `hosts` instances at once (the request's InstanceCount), each as SageMaker
    gives it: its own mount, UTS and PID namespaces, its own /opt/ml under WORKDIR/algo-K (channels downloaded
    to every host, FullyReplicated; its own model mount), resourceconfig.json naming it among all hosts, and the
    toolkit's (2.x) or the SDK drivers' (3.x) own torchrun line per host (`--nnodes N ... --node_rank K-1
    --master_addr algo-1 --master_port 7777`).

    The hosts share one private network namespace, where every algo-K resolves to loopback and 7777 is free,
    and S3 is the local server, relayed in (see the module's docstring); where --net is not permitted they share
    this machine's and torchrun's master port is a free one instead (logged). `triggers` kill hosts or call back
    at chosen moments; `timeout` kills whatever still runs and returns with `timed_out` (a hang is a result, not
    an exception). `readonly` maps a host number to paths under /opt/ml mounted read-only on that host;
    `emptied`, to paths under /opt/ml left empty there (e.g. "input/data/tokenizer": a channel that gave that
    host no files, as ShardedByS3Key does when a prefix has fewer objects than the job has hosts); `host_env`, to
    environment variables that host alone gets (e.g. an S3 endpoint it cannot reach).
    """
    request = launched.request if hasattr(launched, "request") else launched
    if hosts < 1:
        raise HarnessError(f"hosts={hosts}: a job has at least one instance")
    workdir = Path(workdir).resolve()
    names = [f"algo-{k}" for k in range(1, hosts + 1)]
    for k, name in enumerate(names, 1):
        root = prepare(session, request, workdir / name, host=name, hosts=names)
        for rel in (emptied or {}).get(k, ()):
            shutil.rmtree(root / rel)
            (root / rel).mkdir()
    return run_job(
        workdir,
        request,
        hosts=names,
        nproc=nproc,
        timeout=timeout,
        program=program,
        triggers=triggers,
        readonly=readonly,
        host_env=host_env,
    )


def run_job(
    workdir: str | Path,
    request: dict,
    *,
    hosts: Sequence[str],
    nproc: int = 2,
    timeout: float = 300,
    program: list[str] | None = None,
    triggers: Sequence[Trigger] = (),
    readonly: dict[int, Sequence[str]] | None = None,
    host_env: dict[int, dict[str, str]] | None = None,
) -> JobRun:
    """Run the prepared WORKDIR/<host> views concurrently (see replay_job)."""
    workdir = Path(workdir).resolve()
    if isolation_mode() != "namespace":
        raise HarnessError("a replay of several hosts needs mount namespaces (unshare/mount, e.g. as root)")
    flags = [f for f in namespace_flags() or [] if f != "--net"]
    events: list[str] = []
    hs: list[_Host] = []
    holder, prefix, relay = _private_network(request)
    port = None if holder is not None else _free_port()
    try:
        for k, name in enumerate(hosts, 1):
            extra = {"readonly": list((readonly or {}).get(k, ())), "master_port": port}
            spec, env, driver = _host_setup(
                workdir / name,
                request,
                nproc=nproc,
                program=program,
                mode="namespace",
                host=name,
                hosts=hosts,
                extra=extra,
            )
            env.update((host_env or {}).get(k, {}))
            if port and spec["entrypoint"]:
                _set_v3_master_port(Path(spec["root"]), port)
            hs.append(_Host(k, workdir / name, spec, env, [*prefix, "unshare", *flags, *driver]))
        return _run_hosts(hs, request, triggers, events, timeout)
    finally:
        for h in hs:
            h.kill()
        _stop_holder(holder, relay)


def _run_hosts(
    hs: list[_Host],
    request: dict,
    triggers: Sequence[Trigger],
    events: list[str],
    timeout: float,
) -> JobRun:
    seen: list[tuple[int, float, str]] = []
    seen_lock = threading.Lock()

    def on_line(h: _Host, t: float, text: str) -> None:
        with seen_lock:
            seen.append((h.index, t, text))

    t0 = time.monotonic()
    live = LiveJob(hs, t0, events, (request.get("CheckpointConfig") or {}).get("LocalPath"))
    for h in hs:
        h.start(t0, on_line)
    due: dict[int, float] = {i: tr.seconds for i, tr in enumerate(triggers) if tr.line is None}
    fired: set[int] = set()
    timed_out, consumed = False, 0
    while True:
        now = time.monotonic() - t0
        with seen_lock:
            new, consumed = seen[consumed:], len(seen)
        for i, tr in enumerate(triggers):
            if tr.line is None or i in due:
                continue
            hit = next((t for k, t, text in new if tr.host in (None, k) and re.search(tr.line, text)), None)
            if hit is not None:
                due[i] = hit + tr.seconds
        for i in sorted(i for i, at in due.items() if i not in fired and at <= now):
            fired.add(i)
            tr = triggers[i]
            events.append(f"{now:.1f} s: trigger {tr.describe()}")
            if tr.kill is not None:
                live.kill(tr.kill)
            if tr.freeze is not None:
                live.freeze(tr.freeze)
            if tr.call is not None:
                tr.call(live)
        for h in hs:
            if h.ended is None and not h.running():
                h.ended = time.monotonic() - t0
                events.append(f"{h.ended:.1f} s: {h.name} exited {h.proc.returncode}")
        if all(h.ended is not None for h in hs):
            break
        if now > timeout:
            timed_out = True
            events.append(f"{now:.1f} s: timeout ({timeout:g} s): killing what still runs")
            live.kill([h.index for h in hs if h.running()])
            for h in hs:
                h.proc.wait()
                h.ended = h.ended if h.ended is not None else time.monotonic() - t0
            break
        time.sleep(0.02)
    for h in hs:
        for t in h.readers:
            t.join(10)
    results = [
        _host_result(
            h.spec,
            request,
            h.proc.returncode,
            h.text(0),
            h.text(1),
            h.text(),
            seconds=h.ended or 0.0,
            killed=h.killed,
            frozen=h.frozen,
        )
        for h in hs
    ]
    ended = [h.ended for h in hs]
    return JobRun(results, max(e or 0.0 for e in ended), ended, timed_out, events)


def _network_holder() -> subprocess.Popen:
    """A process that holds a new network namespace (loopback up) for the hosts to join."""
    holder = subprocess.Popen(
        ["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec sleep 86400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    if holder.stdout.readline().strip() != b"up":
        holder.kill()
        raise HarnessError(f"could not start the job's network namespace: {holder.stderr.read().decode()[-2000:]}")
    return holder


def _set_v3_master_port(root: Path, port: int) -> None:
    """3.x on this machine's network: environment.py's SM_MASTER_PORT (7777) becomes a free port (logged)."""
    env_py = root / "input" / "data" / "sm_drivers" / "scripts" / "environment.py"
    text = env_py.read_text()
    if "SM_MASTER_PORT = 7777" not in text:
        raise HarnessError(f"{env_py}: no `SM_MASTER_PORT = 7777` to point at port {port}")
    env_py.write_text(
        text.replace("SM_MASTER_PORT = 7777", f"SM_MASTER_PORT = {port}  # sm_container: 7777 may be taken here")
    )


def _stop_tree(pid: int) -> list[int]:
    """SIGSTOP pid and every process below it, top down, until no new one appears; returns them all. Stopped,
    none can fork or be reparented out of reach (torchrun starts its workers in sessions of their own)."""
    stopped: list[int] = []
    todo = [pid]
    while todo:
        for p in todo:
            try:
                os.kill(p, signal.SIGSTOP)
                stopped.append(p)
            except ProcessLookupError:
                pass
        children = _children()
        todo = [c for p in stopped for c in children.get(p, []) if c not in stopped]
    return stopped


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc (parent pid: field 4 of /proc/PID/stat)."""
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(d))
    return out


# ---------------------------------------------------------------------------------------------
# The driver: runs inside the namespace (or with the patches), as the image's `train` entry point would


def _sh(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise HarnessError(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")


def _enter_container_view(spec: dict) -> None:
    """Inside the private mount namespace: /opt/ml, its model mount, /etc/hosts, the hostname."""
    harness = Path(spec["harness"])
    if os.path.exists("/sys/class/net/lo") and shutil.which("ip"):
        subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True)
    try:
        socket.sethostname(spec.get("host", HOST))
    except (OSError, AttributeError):
        pass  # no UTS namespace: the hosts file names this host too
    if not os.path.isdir(OPT_ML):
        if not os.path.isdir("/opt"):
            raise HarnessError("no /opt on this machine to hold the private /opt/ml")
        # /opt/ml must not be created on the host: a private tmpfs /opt, the host's entries bound back in
        orig = harness / "host-opt"
        orig.mkdir()
        _sh("mount", "--rbind", "/opt", str(orig))
        _sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/opt")
        for e in sorted(os.listdir(orig)):
            src, dst = orig / e, os.path.join("/opt", e)
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
                continue
            Path(dst).mkdir() if src.is_dir() else Path(dst).touch()
            _sh("mount", "--rbind", str(src), dst)
        os.mkdir(OPT_ML)
    _sh("mount", "--bind", spec["root"], OPT_ML)
    _sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", f"{OPT_ML}/model")
    _sh("mount", "--bind", str(harness / "hosts"), "/etc/hosts")
    for rel in spec.get("readonly") or []:  # a read-only mount refuses writes even to root, as a full disk would
        path = os.path.join(OPT_ML, rel)
        _sh("mount", "--bind", path, path)
        _sh("mount", "-o", "remount,bind,ro", path)


def _patch_toolkit(spec: dict, status: dict) -> None:
    """The departures from the image (no pip install, nproc workers per host, torch's version read without importing
    it) and what we record."""
    from sagemaker_training import files, logging_config, modules, process, torch_distributed

    def no_install(path, capture_error=False):
        print(
            f"sm_container: skipped `pip install -r {path}/requirements.txt`: the test environment already "
            f"has the project and its dependencies",
            flush=True,
        )

    modules.install_requirements = no_install

    tarball = os.path.join(spec["harness"], "sourcedir.tar.gz")

    def s3_download(url, dst):
        if url != spec["submit_dir"]:
            raise HarnessError(f"the toolkit asked for {url}; the replay only holds {spec['submit_dir']}")
        shutil.copyfile(tarball, dst)

    files.s3_download = s3_download

    init = torch_distributed.TorchDistributedRunner.__init__

    def runner_init(self, user_entry_point, args, env_vars, processes_per_host, *a, **k):
        print(
            f"sm_container: torchrun gets {spec['nproc']} processes per host (the toolkit would start "
            f"{processes_per_host}: one per GPU)",
            flush=True,
        )
        init(self, user_entry_point, args, env_vars, spec["nproc"], *a, **k)

    torch_distributed.TorchDistributedRunner.__init__ = runner_init

    if spec.get("master_port"):  # several hosts on this machine's network: 7777 may be taken
        torch_distributed.MASTER_PORT = str(spec["master_port"])
        print(f"sm_container: torchrun's --master_port is {spec['master_port']} (the toolkit's is 7777)", flush=True)

    log_invocation = logging_config.log_script_invocation

    def record_invocation(cmd, env_vars, logger=None):
        status["command"] = [str(c) for c in cmd]
        _save_status(spec, status)
        return log_invocation(cmd, env_vars, logger)

    logging_config.log_script_invocation = record_invocation

    try:
        from sagemaker_pytorch_container import training as image
    except ImportError:  # not installed: pytorch_training_main, which calls the same function
        image = None
    if image is not None and hasattr(image, "_set_torch_version_environment"):
        image._set_torch_version_environment = set_torch_version_environment

    create = process.create

    def record_create(*a, **k):
        if spec["mode"] == "patched" and "MASTER_ADDR" in os.environ:  # algo-1 resolves only in the namespace
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PET_MASTER_PORT"])
            print(
                f"sm_container: MASTER_ADDR=127.0.0.1 MASTER_PORT={os.environ['MASTER_PORT']} (patched isolation: "
                f"{HOST} does not resolve here)",
                flush=True,
            )
        rc, output, proc = create(*a, **k)
        status["program_returncode"] = rc
        _save_status(spec, status)
        return rc, output, proc

    process.create = record_create


def set_torch_version_environment() -> None:
    """SM_DLC_TORCH_VERSION, which the image's module sets by importing torch: the same string from the package
    metadata, without ~1.5 s of CPU in every host of every replay."""
    from importlib.metadata import version

    os.environ["SM_DLC_TORCH_VERSION"] = version("torch")


def pytorch_training_main() -> None:
    """sagemaker_pytorch_container.training:main (sagemaker-pytorch-training 3.0.0), for where it is not
    installed: the same runner choice and the same sagemaker_training calls, for the runners we launch."""
    from sagemaker_training import entry_point, environment, runner

    env = environment.Environment()
    if os.environ.get("SM_STUDIO_LOCAL_MODE", "False").lower() != "true":
        for host in env.hosts:
            socket.gethostbyname(host)
    os.environ.update(NCCL_SOCKET_IFNAME=env.network_interface_name, NCCL_IB_DISABLE="1", NCCL_DEBUG="WARN")
    os.environ.update(MASTER_ADDR=env.master_hostname, MASTER_PORT="7777")
    fw = env.additional_framework_parameters
    runner_type = runner.ProcessRunnerType
    if env.current_instance_group in env.distribution_instance_groups:
        others = [
            k
            for k in (
                "sagemaker_mpi_enabled",
                "sagemaker_pytorch_ddp_enabled",
                "sagemaker_distributed_dataparallel_enabled",
                "sagemaker_pytorch_xla_multi_worker_enabled",
            )
            if fw.get(k)
        ]
        if others:
            raise HarnessError(f"the fallback toolkit module replays torch_distributed only, not {others}")
        if fw.get("sagemaker_torch_distributed_enabled"):
            runner_type = runner.TorchDistributedRunnerType
    set_torch_version_environment()
    entry_point.run(
        uri=env.module_dir,
        user_entry_point=env.user_entry_point,
        args=env.to_cmd_args(),
        env_vars=env.to_env_vars(),
        capture_error=not fw.get("sagemaker_toolkit_native_launcher_enabled"),
        runner_type=runner_type,
    )


def _save_status(spec: dict, status: dict) -> None:
    tmp = spec["status"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, spec["status"])


def _driver(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    status: dict[str, Any] = {"stage": "setup"}
    _save_status(spec, status)
    try:
        if spec["mode"] == "namespace":
            _enter_container_view(spec)
        probe = os.path.join(OPT_ML, "input", "config", "hyperparameters.json")
        if not os.path.isfile(probe):
            raise HarnessError(f"{probe} is not there: the container view was not set up")
        if not spec["program"] and not spec["entrypoint"]:
            _patch_toolkit(spec, status)
            from sagemaker_training.cli import train as toolkit_train
    except Exception:
        status["error"] = traceback.format_exc()
        _save_status(spec, status)
        print(f"sm_container harness error:\n{status['error']}", file=sys.stderr, flush=True)
        return HARNESS_EXIT
    status["stage"] = "running"
    _save_status(spec, status)
    code: int = 1
    try:
        if spec["program"]:
            status["command"] = spec["program"]
            code = subprocess.run(spec["program"], cwd=os.path.join(OPT_ML, "code")).returncode
            status["program_returncode"] = code
        elif spec["entrypoint"]:  # 3.x: the request's own entry point, as the platform starts it
            code = subprocess.run(spec["entrypoint"], cwd="/").returncode
        else:
            try:
                toolkit_train.main()  # trainer.train() always ends in sys.exit
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            if spec["mode"] == "namespace":
                shutil.copytree(os.path.join(OPT_ML, "model"), spec["model_copy"], symlinks=True)
            status["stage"] = "done"
        except Exception:
            status["error"] = "copying /opt/ml/model out failed:\n" + traceback.format_exc()
            code = HARNESS_EXIT
        _save_status(spec, status)
    return code


__all__ = [
    "BUCKET",
    "ROLE",
    "ContainerRun",
    "HarnessError",
    "JobRun",
    "LiveJob",
    "Trigger",
    "aws_test_env",
    "container_env",
    "input_flags",
    "is_v3",
    "isolation_mode",
    "launch",
    "launch_in_moto",
    "namespace_flags",
    "prepare",
    "pytorch_training_main",
    "replay",
    "replay_job",
    "run_container",
    "run_job",
    "source_tarball",
    "unavailable",
    "upload",
]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--driver":
        sys.exit(_driver(sys.argv[2]))
    if len(sys.argv) > 2 and sys.argv[1] == "--launch":
        sys.path.insert(0, str(PROJECT_ROOT))
        print(json.dumps(launch_in_moto(sys.argv[2:]), default=str))
        sys.exit(0)
    sys.exit("usage: sm_container.py --driver SPEC.json | --launch STAGE ... (see the module docstring)")
