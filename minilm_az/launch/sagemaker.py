"""Launch tokenize.py, train.py or finetune.py as a SageMaker training job, one command from a laptop.

    python -m minilm_az.launch.sagemaker train --phase 2 --instance-type ml.p5.48xlarge --instance-count 2 \\
        --spot --data s3://b/shards/ --base-model s3://b/phase1/model/ --tokenizer s3://b/tok/ --steps 20000

Launcher flags (below) pick the machines and the S3 inputs; every other `--flag value` becomes a
hyperparameter, which the container hands back to the script as `--flag value`. Inputs arrive as
channels (`--data` -> `SM_CHANNEL_DATA`), the final model goes to `SM_MODEL_DIR` and is uploaded
uncompressed, so one stage's output prefix is the next stage's input. docs/sagemaker.md has the rest.

Either SageMaker Python SDK line launches the same job (`pip install -e ".[sagemaker]"`): 2.x through
its PyTorch estimator (`launch_v2`), 3.x through ModelTrainer with Torchrun (`launch_v3`); the installed
major version picks the backend, `--sdk v2|v3` forces one. The SDK is imported only inside `launch`;
parsing, planning and the container-side helpers need nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from minilm_az import config as C
from minilm_az.config import CONTAINER_CHECKPOINTS as CHECKPOINT_LOCAL_PATH
from minilm_az.config import CONTAINER_INPUT, CONTAINER_TENSORBOARD
from minilm_az.launch import flags

PROJECT_ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS_FILE = "requirements-sagemaker.txt"  # uploaded as requirements.txt, the only name the container installs
ENTRY_WRAPPER = "sm_entry.py"  # root file: runs a script whose first argument is a subcommand
FRAMEWORK_VERSION = "2.8.0"  # newest PyTorch training image either SDK line lists (and 2.x accepts for torchrun)
PY_VERSION = "py312"
SCRIPT_KEY, COMMAND_KEY = "minilm-script", "minilm-command"  # hyperparameters read by sm_entry.py
SDK_LINES = ("v2", "v3")
V3_RESERVED_CHANNELS = ("code", "sm_drivers")  # ModelTrainer adds these itself: the code and its container drivers


def sdk_version() -> str | None:
    """The installed SageMaker Python SDK's version, read from its metadata (importing 2.x prints a warning)."""
    try:
        return importlib.metadata.version("sagemaker")
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_sdk() -> str | None:
    """The installed SDK line, "v2" or "v3" (None: not installed, or another major version)."""
    line = f"v{(sdk_version() or '').split('.')[0]}"
    return line if line in SDK_LINES else None


# ---------------------------------------------------------------------------------------------
# Metrics: CloudWatch reads these out of the `stream key=value ...` lines of minilm_az/logs.py.
# `\b` keeps `loss=` from matching inside `val_loss=`; the number class covers 3.4172 and 1.2340e-05.

_NUM = r"([0-9.eE+-]+)"


def _metric(stream: str, key: str) -> dict[str, str]:
    return {"Name": f"{stream}:{key}", "Regex": rf"\b{stream} step=[0-9]+ .*?\b{key}={_NUM}"}


TRAIN_METRICS = tuple(
    [
        _metric("train", k)
        for k in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "peak_mem_gib")
    ]
    + [_metric("eval", k) for k in ("val_loss", "val_bpb")]
)
FINETUNE_METRICS = tuple(
    [_metric("finetune", k) for k in ("loss", "lr", "tokens_per_s")] + [_metric("eval", "val_loss")]
)


@dataclass(frozen=True)
class Stage:
    """What differs between the three scripts when they run on SageMaker; paths and flags come from the
    stage's config dataclass (config.py), which says which channel feeds which flag."""

    script: str
    configs: dict[str | None, type]  # subcommand (None: the script has none) -> its config dataclass
    required: tuple[str, ...]  # channels without which the job would fail after paying for start-up
    instance_type: str
    torchrun: bool  # run under torchrun on every GPU of every instance
    checkpoints: bool  # give the job a checkpoint S3 prefix by default
    metrics: tuple[dict[str, str], ...] = ()

    def channels(self) -> dict[str, str]:
        """channel -> the field it feeds, over all subcommands."""
        return {ch: f for cls in self.configs.values() for ch, f in flags.channels(cls).items()}


STAGES = {
    "tokenize": Stage(
        "tokenize.py", dict(C.TOKENIZE_CONFIGS), ("corpus",), "ml.m5.4xlarge", torchrun=False, checkpoints=False
    ),
    "train": Stage(
        "train.py",
        {None: C.TrainConfig},
        ("data",),
        "ml.p5.48xlarge",
        torchrun=True,
        checkpoints=True,
        metrics=TRAIN_METRICS,
    ),
    "finetune": Stage(
        "finetune.py",
        {None: C.FinetuneConfig},
        ("data", "model"),
        "ml.g5.2xlarge",
        torchrun=False,
        checkpoints=True,
        metrics=FINETUNE_METRICS,
    ),
}
TOKENIZE_COMMANDS = tuple(C.TOKENIZE_CONFIGS)


def stage_config(args: argparse.Namespace) -> type:
    return STAGES[args.stage].configs[getattr(args, "command", None)]


def is_gpu_instance(instance_type: str) -> bool:
    """ml.p* and ml.g* carry NVIDIA GPUs; everything else we launch on is CPU."""
    return re.match(r"ml\.[pg]\d", instance_type) is not None


# ---------------------------------------------------------------------------------------------
# Command line


def parse_passthrough(extra: list[str]) -> dict[str, Any]:
    """Script flags left over by the launcher -> hyperparameters: `--steps 100` -> {"steps": 100}.

    `--flag` alone is "true", `--no-flag` alone is `flag` "false"; keys use dashes (`--micro_batch`
    becomes `micro-batch`); integers stay integers, everything else is sent as the string given.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or tok == "--":
            raise ValueError(f"unexpected argument {tok!r}: script flags are passed as --flag value")
        key, eq, value = tok[2:].partition("=")
        key = key.replace("_", "-")
        if not eq:
            nxt = extra[i + 1] if i + 1 < len(extra) else None
            if nxt is None or nxt.startswith("--"):
                key, value = (key[3:], "false") if key.startswith("no-") else (key, "true")
            else:
                value = nxt
                i += 1
        if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            raise ValueError(f"--{key} got more than one value; a hyperparameter holds exactly one")
        if key.startswith(("sagemaker", "minilm-")):
            raise ValueError(f"--{key}: names starting with sagemaker or minilm- are reserved")
        if key in out:
            raise ValueError(f"--{key} given twice")
        out[key] = int(value) if re.fullmatch(r"-?(0|[1-9][0-9]*)", value) else value
        i += 1
    return out


def _env_pair(value: str) -> tuple[str, str | None]:
    """`KEY=VALUE` -> (KEY, VALUE); a value without `=` keeps None, which `_check_env` refuses with the flag named."""
    k, eq, v = value.partition("=")
    return k, (v if eq else None)


# ---------------------------------------------------------------------------------------------
# Checks before anything is billed: each family refuses, in one line that names the flag, what SageMaker or
# the container would only refuse later, after the code upload or after paying for the instances' start-up.

PROG = "python -m minilm_az.launch.sagemaker"
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's general purpose bucket naming rules
RESERVED_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")  # S3's naming rules reserve these two ends
RESERVED_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
JOB_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")  # CreateTrainingJob's TrainingJobName pattern
V3_STAMP = "-20260710120000"  # the shape of what SDK 3.x appends to a base name (-YYYYmmddHHMMSS), then cuts at 63
INSTANCE_TYPE = re.compile(r"ml\.(?P<family>[a-z][a-z0-9]*(?:-[a-z0-9]+)*)\.(?:[0-9]*xlarge|large|medium)")
# A few real training families, for suggestions. The table only guards typos: a family it lacks is still
# accepted when botocore's own list of training instance types has it, so new hardware is never refused.
INSTANCE_FAMILIES = (
    "p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "g4dn", "g5", "g6", "g6e",
    "trn1", "trn1n", "trn2", "m5", "m6i", "m7i", "c5", "c6i", "c7i", "r5",
)  # fmt: skip
ENV_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")  # CreateTrainingJob's Environment key pattern
ENV_MAX_ITEMS, ENV_MAX_CHARS = 100, 512  # its limits: entries, and characters in a key or a value
RELATIVE_PATH = re.compile(r"[\w.-]+(/[\w.-]+)+/?")  # data/az/firefox.txt; a sentence with a slash has spaces


def _refuse(message: str) -> NoReturn:
    """The launcher's one-line refusal (exit 2) from outside parse_args, where no parser is at hand."""
    flags.Parser(prog=PROG).error(message)


def _bucket_problem(bucket: str) -> str | None:
    """What S3 would reject in a bucket name, or None."""
    if not bucket:
        return "the URI names no bucket; expected s3://BUCKET/KEY"
    if bucket.startswith("s3://"):
        return f"pass the bucket's name alone ({bucket[5:].split('/')[0]}), without s3://"
    if not BUCKET_NAME.fullmatch(bucket) or ".." in bucket:
        return (
            f"{bucket!r} is not an S3 bucket name; expected 3-63 lowercase letters, digits, dots and hyphens, "
            "starting and ending with a letter or digit"
        )
    if re.fullmatch(r"[0-9]+(\.[0-9]+){3}", bucket):
        return f"{bucket!r} is not an S3 bucket name; S3 refuses names shaped like an IP address"
    if bucket.startswith(RESERVED_BUCKET_PREFIXES) or bucket.endswith(RESERVED_BUCKET_SUFFIXES):
        return f"{bucket!r} is not an S3 bucket name; S3 reserves names that start or end like this one"
    return None


def _check_s3(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every bucket and s3:// URI the job names: the channels, the checkpoint prefix, and the bucket and prefix
    that the code, output and checkpoint URIs are built from. S3 keys may hold whitespace, but in a URI given
    on a command line it is nearly always a quoting slip, and the job would then read or write elsewhere."""
    uris = {flags.flag(f): getattr(args, f"ch_{ch}") for ch, f in STAGES[args.stage].channels().items()}
    uris["--checkpoint-s3"] = args.checkpoint_s3
    for flag, uri in uris.items():
        if uri is None:
            continue
        if not uri.startswith("s3://") or len(uri) <= 5:
            parser.error(f"{flag}: {uri!r} is not an s3:// URI (upload it first: aws s3 sync DIR s3://BUCKET/KEY/)")
        if re.search(r"\s", uri):
            parser.error(f"{flag}: {uri!r} holds whitespace; expected s3://BUCKET/KEY without spaces")
        problem = _bucket_problem(uri[5:].split("/")[0])
        if problem:
            parser.error(f"{flag}: {uri}: {problem}")
    if args.bucket is not None and (problem := _bucket_problem(args.bucket)):
        parser.error(f"--bucket: {problem}")
    if re.search(r"\s", args.prefix):
        parser.error(f"--prefix: {args.prefix!r} holds whitespace; expected a key prefix such as minilm-az")


def _check_job_name(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The name CreateTrainingJob will get. 2.x sends --job-name as it is; 3.x sends it with underscores made
    hyphens and its own timestamp appended, cut at 63 characters. The default names are built valid."""
    if args.job_name is None:
        return
    sent = args.job_name
    if args.sdk == "v3":
        if len(sent) + len(V3_STAMP) > 63:
            parser.error(
                f"--job-name: {sent!r} is {len(sent)} characters; SDK 3.x appends -YYYYmmddHHMMSS and cuts the "
                f"name at 63, so at most {63 - len(V3_STAMP)} keep the timestamp whole"
            )
        sent = sent.replace("_", "-") + V3_STAMP
    if not JOB_NAME.fullmatch(sent) or len(sent) > 63:  # the pattern bounds its groups, not the characters
        parser.error(
            f"--job-name: {args.job_name!r} is not a SageMaker training job name; expected letters, digits and "
            "hyphens, starting and ending with a letter or digit, at most 63 characters"
        )


def _training_families() -> set[str]:
    """The instance families botocore's SageMaker model lists for training (empty without botocore)."""
    try:
        import botocore.session
    except ImportError:
        return set()
    model = botocore.session.get_session().get_service_model("sagemaker")
    return {t.split(".")[1] for t in model.shape_for("TrainingInstanceType").enum}


def _check_instance_type(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A misspelled --instance-type is refused by CreateTrainingJob only after the code is uploaded."""
    m = INSTANCE_TYPE.fullmatch(args.instance_type)
    if not m:
        parser.error(
            f"--instance-type: {args.instance_type!r} is not a SageMaker training instance type; expected "
            f"ml.<family>.<size>, e.g. {STAGES[args.stage].instance_type}"
        )
    family = m["family"]
    if family in INSTANCE_FAMILIES or family in _training_families():
        return
    size = args.instance_type.split(".", 2)[2]
    close = difflib.get_close_matches(family, INSTANCE_FAMILIES, n=3)
    hint = f"did you mean {' or '.join(f'ml.{f}.{size}' for f in close)}?" if close else ""
    parser.error(
        f"--instance-type: {args.instance_type!r} has an unknown instance family {family!r}; "
        + (hint or f"known families: {', '.join(INSTANCE_FAMILIES)}")
    )


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """SageMaker's bounds on the machine and time flags. argparse's float() also takes nan and inf, which
    no stopping condition can hold."""
    for flag, value in (("--instance-count", args.instance_count), ("--volume-size", args.volume_size)):
        if value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    for flag, hours in (("--max-run-hours", args.max_run_hours), ("--max-wait-hours", args.max_wait_hours)):
        if hours is not None and not (math.isfinite(hours) and hours * 3600 >= 1):
            parser.error(f"{flag}: must be a positive number of hours (at least one second), got {hours}")
    if args.max_run_hours * 3600 > 2_419_200:  # CreateTrainingJob's MaxRuntimeInSeconds: at most 28 days
        parser.error(f"--max-run-hours: at most 672 (28 days, SageMaker's limit), got {args.max_run_hours}")


def _check_env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """CreateTrainingJob's limits on Environment; the launcher's PYTHONUNBUFFERED counts as one entry."""
    for key, value in args.env:
        if value is None:
            parser.error(f"--env: {key!r} has no value; expected KEY=VALUE")
        if not ENV_NAME.fullmatch(key) or len(key) > ENV_MAX_CHARS:
            parser.error(
                f"--env: {key!r} is not an environment variable name; expected letters, digits and _, "
                f"not starting with a digit, at most {ENV_MAX_CHARS} characters"
            )
        if len(value) > ENV_MAX_CHARS:
            parser.error(f"--env: the value of {key} is {len(value)} characters; SageMaker takes {ENV_MAX_CHARS}")
    if len({"PYTHONUNBUFFERED", *(k for k, _ in args.env)}) > ENV_MAX_ITEMS:
        parser.error(f"--env: more than {ENV_MAX_ITEMS} variables with the launcher's PYTHONUNBUFFERED")


def _check_local_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A script flag naming a file on this machine (or in S3) reaches the container as a path that is not
    there, and the job fails after its start-up is paid. Only the free-text flags are looked at: a number,
    a boolean or a choice cannot be a path. A value counts as a path when it exists here or is written as one."""
    cls = stage_config(args)
    free_text = {
        f.name
        for f in dataclasses.fields(cls)
        if "str" in str(f.type) and not flags.is_bool(f) and "choices" not in f.metadata
    }
    mounted = {ch: getattr(args, f"ch_{ch}") for ch in flags.channels(cls) if getattr(args, f"ch_{ch}")}
    for key, value in args.hyperparameters.items():
        if key.replace("-", "_") not in free_text or not isinstance(value, str):
            continue
        if value.startswith(f"{CONTAINER_INPUT}/"):
            ch = value[len(CONTAINER_INPUT) + 1 :].split("/")[0]
            if ch not in mounted:
                parser.error(
                    f"--{key}: {value} is under channel {ch!r}, which this job does not mount; "
                    f"its channels are {', '.join(mounted)}"
                )
            continue
        written_as_path = value.startswith(("/", "./", "../", "~", "s3://")) or RELATIVE_PATH.fullmatch(value)
        if value.startswith("/opt/ml/") or not (written_as_path or Path(value).exists()):
            continue
        ch, uri = next(iter(mounted.items()))
        name = Path(value).name or "FILE"
        parser.error(
            f"--{key}: {value} does not exist in the container, which sees only /opt/ml and the channels; put the "
            f"file under an input prefix of this job and pass its container path, e.g. {uri.rstrip('/')}/{name} "
            f"is {CONTAINER_INPUT}/{ch}/{name}"
        )


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argparse tree: one subcommand per stage, each with the common flags."""
    p = flags.Parser(  # one-line errors, like the scripts'
        prog=PROG,
        allow_abbrev=False,
        description="Launch a minilm-az stage as a SageMaker training job. Flags not listed here are "
        "passed to the script as hyperparameters (--steps 1000 -> train.py --steps 1000).",
    )
    sub = p.add_subparsers(dest="stage", required=True, metavar="{tokenize,train,finetune}")
    for name, stage in STAGES.items():
        sp = sub.add_parser(
            name,
            allow_abbrev=False,
            help=f"run {stage.script}",
            description=f"Run {stage.script} on SageMaker; unknown flags go to the script.",
        )
        if name == "tokenize":
            sp.add_argument("command", choices=TOKENIZE_COMMANDS, help="the tokenize.py subcommand")
        if name == "train":
            sp.add_argument("--phase", type=int, choices=(1, 2), required=True)
        g = sp.add_argument_group("inputs (S3 prefixes, mounted as channels)")
        for ch, fname in stage.channels().items():
            g.add_argument(
                flags.flag(fname),
                dest=f"ch_{ch}",
                metavar="S3_URI",
                required=ch in stage.required,
                help=f"channel {ch!r}, passed as {flags.flag(fname)} {CONTAINER_INPUT}/{ch}",
            )
        a = sp.add_argument_group("AWS")
        a.add_argument("--role", help="execution role ARN (default: the SageMaker SDK config file)")
        a.add_argument("--region", help="default: the usual AWS config (AWS_REGION, ~/.aws/config)")
        a.add_argument("--profile", help="AWS profile to use")
        a.add_argument("--bucket", help="bucket for code, outputs and checkpoints (default: sagemaker-REGION-ACCOUNT)")
        a.add_argument("--prefix", default="minilm-az", help="key prefix in the bucket (default: %(default)s)")
        a.add_argument("--job-name", help="default: minilm-az-<stage>-<timestamp>")
        m = sp.add_argument_group("machines and cost")
        m.add_argument("--instance-type", default=stage.instance_type, help="default: %(default)s")
        m.add_argument("--instance-count", type=int, default=1, help="default: %(default)s")
        m.add_argument(
            "--spot",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="managed spot capacity (cheaper, interruptible; default: off)",
        )
        m.add_argument("--max-run-hours", type=float, default=24.0, help="hard stop (default: %(default)s)")
        m.add_argument(
            "--max-wait-hours",
            type=float,
            help="spot only: run time plus time waiting for capacity (default: 2 x max-run-hours)",
        )
        m.add_argument(
            "--checkpoint-s3",
            metavar="S3_URI",
            help="where every rank writes its checkpoints (the script's --checkpoint-dir); reuse it to resume"
            + (" (default: per job under the bucket)" if stage.checkpoints else ""),
        )
        m.add_argument("--volume-size", type=int, default=100, help="EBS GB per instance (default: %(default)s)")
        m.add_argument(
            "--input-mode",
            choices=("File", "FastFile"),
            default="File",
            help="File copies inputs before start; FastFile streams them (default: %(default)s)",
        )
        c = sp.add_argument_group("container")
        c.add_argument("--framework-version", default=FRAMEWORK_VERSION, help="default: %(default)s")
        c.add_argument("--py-version", default=PY_VERSION, help="default: %(default)s")
        c.add_argument("--image-uri", help="custom training image (overrides the two above)")
        c.add_argument(
            "--torchrun",
            action=argparse.BooleanOptionalAction,
            default=stage.torchrun,
            help="one process per GPU on every instance (default: %(default)s)",
        )
        c.add_argument(
            "--env",
            type=_env_pair,
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="environment variable for the job (repeatable)",
        )
        r = sp.add_argument_group("this command")
        r.add_argument(
            "--wait",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="stay attached and stream the job's logs (default: return once created)",
        )
        r.add_argument("--dry-run", action="store_true", help="print the request, send nothing")
        r.add_argument(
            "--sdk",
            choices=SDK_LINES,
            help="SageMaker Python SDK line to launch with (default: the installed one)",
        )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse launcher flags; the rest becomes `args.hyperparameters`. Exits with a message on bad input."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        args.hyperparameters = parse_passthrough(extra)
    except ValueError as e:
        parser.error(str(e))
    if args.role and not re.fullmatch(r"arn:aws[a-z-]*:iam::\d{12}:role/\S+", args.role):
        parser.error(f"--role wants the role's ARN (arn:aws:iam::ACCOUNT:role/NAME), got {args.role!r}")
    if args.region:
        try:
            import botocore.session

            known = botocore.session.get_session().get_available_regions("sagemaker")
        except ImportError:  # no SDK here: the launch itself will say so
            known = [args.region]
        if args.region not in known:
            parser.error(f"--region {args.region!r} is not a SageMaker region (e.g. us-east-1, eu-west-1)")
    if args.max_wait_hours is not None and not args.spot:
        parser.error("--max-wait-hours only applies with --spot")
    if args.spot and args.max_wait_hours is not None and args.max_wait_hours < args.max_run_hours:
        parser.error("--max-wait-hours must be at least --max-run-hours")
    if args.instance_count > 1 and not args.torchrun:
        parser.error(
            f"--instance-count {args.instance_count} without --torchrun would run the whole "
            f"job independently on every instance"
        )
    if args.checkpoint_s3 and not STAGES[args.stage].checkpoints:
        # A prefix the script never writes would promise a resume that cannot happen.
        parser.error(f"{args.stage} writes no checkpoints, so --checkpoint-s3 would resume nothing")
    cls = stage_config(args)
    takes = flags.channels(cls)
    for ch, fname in STAGES[args.stage].channels().items():
        if getattr(args, f"ch_{ch}") and ch not in takes:
            parser.error(f"{args.stage} {getattr(args, 'command', '')} takes no {flags.flag(fname)}")
    if args.stage == "tokenize" and "tokenizer" in takes and not args.ch_tokenizer:
        parser.error(f"tokenize {args.command} needs --tokenizer S3_URI")
    fixed = set(flags.container_paths(cls)) | {f for f in takes.values()}
    for key in args.hyperparameters:
        if key.replace("-", "_") in fixed:
            parser.error(
                f"--{key} is set by the launcher (a channel or a container path); pass an S3 URI to the "
                f"input flag instead"
            )
    try:  # the script's own parser, here on the laptop: a typo must not cost an instance start-up
        # with the --out the job will have, as the script will see it (a --prompt, say, trains no job's output)
        outs = {f: p for f, p in flags.container_paths(cls).items() if p != CHECKPOINT_LOCAL_PATH}
        given = {**{f.replace("_", "-"): p for f, p in outs.items()}, **args.hyperparameters}
        flags.check_args(cls, container_args({k: json.dumps(v) for k, v in given.items()}))
    except ValueError as e:
        parser.error(f"{STAGES[args.stage].script}: {e}")
    installed = installed_sdk()
    if args.sdk and args.sdk != installed:
        have = f"sagemaker {sdk_version()}" if sdk_version() else "no sagemaker"
        parser.error(
            f"--sdk {args.sdk}: this environment has {have}; pip install "
            + ("'sagemaker>=2.250,<3'" if args.sdk == "v2" else "'sagemaker>=3,<4'")
        )
    args.sdk = args.sdk or installed
    if args.sdk == "v3":
        for key, value in args.hyperparameters.items():
            if "'" in str(value):
                parser.error(
                    f"--{key}: SDK 3.x's container writes hyperparameters into a shell file in '...' quotes, "
                    "so a value with a single quote would reach the script altered; leave the quote out"
                )
    _check_instance_type(parser, args)  # first: a misspelled GPU type would read as a CPU one just below
    if args.torchrun and not args.image_uri and not is_gpu_instance(args.instance_type):
        parser.error(
            f"--torchrun needs a GPU instance (ml.p*/ml.g*), not {args.instance_type}; "
            "pass --no-torchrun for a single CPU process"
        )
    _check_s3(parser, args)
    _check_job_name(parser, args)
    _check_numbers(parser, args)
    _check_env(parser, args)
    _check_local_paths(parser, args)
    return args


# ---------------------------------------------------------------------------------------------
# The plan: everything the job request says, resolved, as plain data (no SDK needed).


@dataclass
class JobPlan:
    """One training job, fully resolved; `build_estimator` (2.x) or `build_model_trainer` (3.x) maps it onto the SDK."""

    stage: str
    job_name: str  # 2.x creates the job under this name; 3.x under base_job_name plus its own timestamp
    base_job_name: str
    entry_point: str
    hyperparameters: dict[str, Any]
    channels: dict[str, str]
    role: str
    instance_type: str
    instance_count: int
    torchrun: bool
    spot: bool
    max_run_s: int
    max_wait_s: int | None
    checkpoint_uri: str | None
    tensorboard_uri: str | None  # where SageMaker syncs the script's --tensorboard event files
    output_path: str
    code_location: str
    volume_size: int
    input_mode: str
    framework_version: str
    py_version: str
    image_uri: str | None
    environment: dict[str, str] = field(default_factory=dict)
    metric_definitions: list[dict[str, str]] = field(default_factory=list)

    @property
    def model_uri(self) -> str:
        """Where SM_MODEL_DIR lands: uncompressed, so it can be the next stage's channel as is."""
        return f"{self.output_path}/{self.job_name}/output/model/"


def _timestamped(base: str) -> str:
    now = time.time()
    stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime(now)) + f"-{int(now * 1000) % 1000:03d}"
    return f"{base[: 63 - len(stamp) - 1]}-{stamp}"


def plan_job(args: argparse.Namespace, *, bucket: str, role: str) -> JobPlan:
    """Turn parsed flags into a JobPlan (job name, S3 layout, hyperparameters, channels)."""
    stage = STAGES[args.stage]
    hps: dict[str, Any] = {}
    cls = stage_config(args)
    if args.stage == "tokenize":
        hps[SCRIPT_KEY], hps[COMMAND_KEY] = stage.script, args.command
        base = f"minilm-az-tokenize-{args.command}"
    elif args.stage == "train":
        hps["phase"] = args.phase
        base = f"minilm-az-train-p{args.phase}"
    else:
        base = "minilm-az-finetune"
    # The whole contract is on the command line: every mounted channel and every output as an explicit path.
    for ch, fname in flags.channels(cls).items():
        if getattr(args, f"ch_{ch}"):
            hps[fname.replace("_", "-")] = f"{CONTAINER_INPUT}/{ch}"
    job_name = args.job_name or _timestamped(base)
    root = f"s3://{bucket}/{args.prefix.strip('/')}".rstrip("/")
    trains = stage.checkpoints and not getattr(args, "eval_only", False)  # an --eval-only job saves nothing
    checkpoint_uri = args.checkpoint_s3 or (f"{root}/checkpoints/{job_name}/" if trains else None)
    for fname, path in flags.container_paths(cls).items():
        # Checkpoints go straight to S3 from every rank (minilm_az/s3.py): no host's disk holds a copy that
        # SageMaker's per-host sync would have to bring there later (docs/checkpoints.md).
        if path == CHECKPOINT_LOCAL_PATH:
            if checkpoint_uri:
                hps[fname.replace("_", "-")] = checkpoint_uri
        else:
            hps[fname.replace("_", "-")] = path
    if args.instance_count > 1 and any(f.name == "replicate" for f in dataclasses.fields(cls)):
        # One model copy per instance, sharded over its GPUs, keeps the all-gathers on NVLink: HSDP is ahead on
        # p4d and ties on p5 (bench/comms_model.py). A --replicate the user passes still wins, just below.
        hps["replicate"] = args.instance_count
    hps.update(args.hyperparameters)
    tensorboard = str(hps.get("tensorboard", "false")).lower() == "true"  # the script flag, passed through
    max_run_s = int(args.max_run_hours * 3600)
    max_wait_s = None
    if args.spot:
        max_wait_s = int((args.max_wait_hours or 2 * args.max_run_hours) * 3600)
    channels = {ch: getattr(args, f"ch_{ch}") for ch in stage.channels() if getattr(args, f"ch_{ch}")}
    return JobPlan(
        stage=args.stage,
        job_name=job_name,
        base_job_name=args.job_name or base,
        entry_point=ENTRY_WRAPPER if args.stage == "tokenize" else stage.script,
        hyperparameters=hps,
        channels=channels,
        role=role,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        torchrun=args.torchrun,
        spot=args.spot,
        max_run_s=max_run_s,
        max_wait_s=max_wait_s,
        checkpoint_uri=checkpoint_uri,
        tensorboard_uri=f"{root}/tensorboard/{job_name}/" if tensorboard else None,
        output_path=f"{root}/output",
        code_location=f"{root}/code",
        volume_size=args.volume_size,
        input_mode=args.input_mode,
        framework_version=args.framework_version,
        py_version=args.py_version,
        image_uri=args.image_uri,
        environment={"PYTHONUNBUFFERED": "1", **dict(args.env)},
        metric_definitions=[dict(m) for m in stage.metrics],
    )


def stage_source_dir(dest: str | Path, *, gpu: bool, root: str | Path = PROJECT_ROOT) -> Path:
    """Copy what the container needs (root scripts, minilm_az/, packaging files) into `dest`.

    Runs, data and tests stay behind; requirements-sagemaker.txt becomes requirements.txt, without
    its `# gpu` lines on CPU instances.
    """
    root, dest = Path(root), Path(dest)
    if not (root / "minilm_az").is_dir():
        raise FileNotFoundError(f"{root} has no minilm_az/: launch from a checkout of the project")
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(root.iterdir()):
        if f.is_file() and (
            f.suffix == ".py" or f.name in ("setup.cfg", "pyproject.toml", "README.md") or f.name.startswith("LICENSE")
        ):
            shutil.copy2(f, dest / f.name)
    shutil.copytree(root / "minilm_az", dest / "minilm_az", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    req = root / REQUIREMENTS_FILE
    if not req.is_file():
        raise FileNotFoundError(f"{req} is missing; the container would not install the project")
    lines = [ln for ln in req.read_text().splitlines() if gpu or "# gpu" not in ln]
    (dest / "requirements.txt").write_text("\n".join(lines) + "\n")
    return dest


def build_estimator(plan: JobPlan, sagemaker_session: Any, source_dir: str | Path):
    """SDK 2.x: the PyTorch estimator for `plan` (the one place that knows its constructor)."""
    from sagemaker.pytorch import PyTorch

    kwargs: dict[str, Any] = {}
    if plan.image_uri:
        kwargs["image_uri"] = plan.image_uri
    else:
        kwargs.update(framework_version=plan.framework_version, py_version=plan.py_version)
    if plan.torchrun:
        kwargs["distribution"] = {"torch_distributed": {"enabled": True}}
    if plan.spot:
        kwargs.update(use_spot_instances=True, max_wait=plan.max_wait_s)
    if plan.tensorboard_uri:
        from sagemaker.debugger import TensorBoardOutputConfig

        kwargs["tensorboard_output_config"] = TensorBoardOutputConfig(plan.tensorboard_uri, CONTAINER_TENSORBOARD)
    return PyTorch(
        entry_point=plan.entry_point,
        source_dir=str(source_dir),
        role=plan.role,
        instance_type=plan.instance_type,
        instance_count=plan.instance_count,
        hyperparameters=dict(plan.hyperparameters),
        environment=dict(plan.environment),
        metric_definitions=[dict(m) for m in plan.metric_definitions] or None,
        output_path=plan.output_path,
        code_location=plan.code_location,
        volume_size=plan.volume_size,
        input_mode=plan.input_mode,
        max_run=plan.max_run_s,
        disable_output_compression=True,  # model dir lands as files, ready to be the next channel
        disable_profiler=True,
        debugger_hook_config=False,  # no Debugger hooks in a torchrun job
        base_job_name=plan.job_name,
        sagemaker_session=sagemaker_session,
        **kwargs,
    )


def launch_v2(plan: JobPlan, session: Any, source_dir: str | Path, wait: bool) -> None:
    """SDK 2.x: the estimator's `fit`, under the job name the plan chose. The image's toolkit runs the script."""
    from sagemaker.inputs import TrainingInput

    estimator = build_estimator(plan, session, source_dir)
    inputs = {k: TrainingInput(v, input_mode=plan.input_mode) for k, v in plan.channels.items()}
    estimator.fit(inputs=inputs, job_name=plan.job_name, wait=False)
    if wait:
        estimator.latest_training_job.wait(logs="All")


def build_model_trainer(plan: JobPlan, session: Any, source_dir: str | Path):
    """SDK 3.x: the ModelTrainer for `plan` (the one place that knows its configs, which refuse unknown fields)."""
    from sagemaker.core import image_uris
    from sagemaker.core.shapes import MetricDefinition
    from sagemaker.core.training.configs import (
        Compute,
        OutputDataConfig,
        SourceCode,
        StoppingCondition,
        TensorBoardOutputConfig,
    )
    from sagemaker.train.distributed import Torchrun
    from sagemaker.train.model_trainer import ModelTrainer

    image = plan.image_uri or image_uris.retrieve(  # no framework estimator in 3.x: the same image, named
        "pytorch",
        session.boto_region_name,
        version=plan.framework_version,
        py_version=plan.py_version,
        instance_type=plan.instance_type,
        image_scope="training",
    )
    trainer = ModelTrainer(
        sagemaker_session=session,
        role=plan.role,
        base_job_name=plan.base_job_name,  # the SDK appends a timestamp; launch reads the name back
        input_s3_key_prefix=plan.code_location.split("/", 3)[3],  # code + drivers under PREFIX/code/JOB/input/
        training_image=image,
        # requirements are installed only when named here; code lands in /opt/ml/input/data/code
        source_code=SourceCode(
            source_dir=str(source_dir), entry_script=plan.entry_point, requirements="requirements.txt"
        ),
        distributed=Torchrun() if plan.torchrun else None,  # one process per GPU, as 2.x's torch_distributed
        compute=Compute(
            instance_type=plan.instance_type,
            instance_count=plan.instance_count,
            volume_size_in_gb=plan.volume_size,
            enable_managed_spot_training=plan.spot,
        ),
        stopping_condition=StoppingCondition(
            max_runtime_in_seconds=plan.max_run_s, max_wait_time_in_seconds=plan.max_wait_s
        ),
        output_data_config=OutputDataConfig(s3_output_path=plan.output_path, compression_type="NONE"),
        training_input_mode=plan.input_mode,
        hyperparameters=v3_hyperparameters(plan.hyperparameters),
        environment=dict(plan.environment),
    )
    if plan.metric_definitions:
        metrics = [MetricDefinition(name=m["Name"], regex=m["Regex"]) for m in plan.metric_definitions]
        trainer.with_metric_definitions(metrics)
    if plan.tensorboard_uri:
        trainer.with_tensorboard_output_config(
            TensorBoardOutputConfig(s3_output_path=plan.tensorboard_uri, local_path=CONTAINER_TENSORBOARD)
        )
    return trainer


def launch_v3(plan: JobPlan, session: Any, source_dir: str | Path, wait: bool) -> None:
    """SDK 3.x: ModelTrainer's `train`. Its own sm_train.sh replaces the image's entry point and runs the script."""
    from sagemaker.core.shapes import Channel, DataSource, S3DataSource

    trainer = build_model_trainer(plan, session, source_dir)
    channels = [  # Channel, not InputData: InputData would fix every channel's mode to File
        Channel(
            channel_name=name,
            data_source=DataSource(
                s3_data_source=S3DataSource(
                    s3_data_type="S3Prefix", s3_uri=uri, s3_data_distribution_type="FullyReplicated"
                )
            ),
            input_mode=plan.input_mode,
        )
        for name, uri in plan.channels.items()
    ]
    trainer.train(input_data_config=channels, wait=wait, logs=wait)


BACKENDS = {"v2": launch_v2, "v3": launch_v3}


# ---------------------------------------------------------------------------------------------
# Launch


@dataclass
class Launched:
    """What was (or, with --dry-run, would have been) sent."""

    plan: JobPlan  # job_name is the job's real name, read back from the request
    request: dict[str, Any]  # CreateTrainingJob parameters exactly as handed to botocore
    sent: bool
    sdk: str = "v2"  # the SDK line that sent it
    region: str = ""

    @property
    def job_name(self) -> str:
        return self.plan.job_name


class _FakeHTTP:
    status_code = 200
    headers: dict[str, str] = {}
    raw = None
    content = b""


def _offline_response(captured: dict[str, Any]):
    """before-call handler for --dry-run: answer every AWS call locally, so nothing leaves the machine."""

    def answer(model: Any, **_: Any):
        if model.name == "CreateTrainingJob":
            return _FakeHTTP(), {"TrainingJobArn": "arn:aws:sagemaker:dry-run"}
        if model.name == "ListBuckets":  # 3.x looks for its staging bucket even when told which one
            return _FakeHTTP(), {"Buckets": []}
        if model.name == "DescribeTrainingJob" and captured:  # 3.x reads the job back after creating it
            return _FakeHTTP(), {**captured, "TrainingJobArn": "arn:aws:sagemaker:dry-run"}
        return _FakeHTTP(), {}

    return answer


V2_NOTICE = (
    "note: SageMaker Python SDK {version} is the 2.x line, in maintenance mode until its end of support on "
    "2027-07-06; pip install 'sagemaker>=3,<4' and the same command launches through 3.x"
)


def launch(args: argparse.Namespace, boto_session: Any = None, root: str | Path | None = None) -> Launched:
    """Upload the code under `root` (this checkout) and create the job; with `args.dry_run`, only build it."""
    root = Path(root or PROJECT_ROOT)
    for name in {STAGES[args.stage].script, ENTRY_WRAPPER}:
        if not (root / name).is_file():
            raise SystemExit(f"error: {root / name} does not exist; launch from a checkout of the project")
    sdk = getattr(args, "sdk", None) or installed_sdk()
    if sdk is None:
        raise SystemExit("error: no SageMaker Python SDK here: pip install -e '.[sagemaker]'")
    if sdk == "v2":  # its own warning is four lines, printed twice
        os.environ.setdefault("SAGEMAKER_SUPPRESS_V2_WARNING", "1")
        print(V2_NOTICE.format(version=sdk_version()), file=sys.stderr)
    for name in ("sagemaker.config", "sagemaker", "sagemaker_core"):  # INFO lines would spoil --dry-run > file
        logging.getLogger(name).setLevel(logging.WARNING)
    import boto3

    boto_session = boto_session or boto3.Session(profile_name=args.profile, region_name=args.region)
    region = boto_session.region_name
    if not region:
        raise SystemExit("error: no AWS region: pass --region or set AWS_REGION")
    captured: dict[str, Any] = {}

    def capture(params: dict[str, Any], **_: Any) -> None:
        captured.clear()
        captured.update(copy.deepcopy(params))

    hooks = [("before-parameter-build.sagemaker.CreateTrainingJob", capture)]
    if args.dry_run:
        hooks.append(("before-call", _offline_response(captured)))
    for event, fn in hooks:  # before the SDK session exists: clients copy the handlers they are born with
        boto_session.events.register(event, fn)
    validate_role = os.environ.get("SAGEMAKER_VALIDATE_ROLE")
    if args.dry_run:  # 3.x checks the role's policies through IAM, which a dry run does not ask
        os.environ["SAGEMAKER_VALIDATE_ROLE"] = "false"
    try:
        _silence_sdk_telemetry(sdk)
        bucket = args.bucket or (f"sagemaker-{region}-ACCOUNT" if args.dry_run else None)
        session, role = _sdk_session(sdk, boto_session, bucket)
        role = args.role or role
        if not role:  # before default_bucket(), which asks STS and S3 and may create the bucket
            if not args.dry_run:
                _refuse(
                    "--role: no execution role given, and the SageMaker SDK's config file names none "
                    "(SageMaker.TrainingJob.RoleArn); pass --role arn:aws:iam::ACCOUNT:role/NAME "
                    "(docs/sagemaker.md lists what it needs)"
                )
            role = "arn:aws:iam::ACCOUNT:role/ROLE"
        bucket = bucket or session.default_bucket()
        plan = plan_job(args, bucket=bucket, role=role)
        if plan.checkpoint_uri and not args.dry_run:
            _check_checkpoint_prefix(boto_session, plan.checkpoint_uri)
        with tempfile.TemporaryDirectory(prefix="minilm-az-src-") as tmp:
            src = stage_source_dir(tmp, gpu=is_gpu_instance(plan.instance_type), root=root)
            BACKENDS[sdk](plan, session, src, args.wait and not args.dry_run)
    finally:
        for event, fn in hooks:
            boto_session.events.unregister(event, fn)
        if sdk == "v3":
            _forget_v3_clients()
        if args.dry_run:
            os.environ.pop("SAGEMAKER_VALIDATE_ROLE", None)
            if validate_role is not None:
                os.environ["SAGEMAKER_VALIDATE_ROLE"] = validate_role
    if not captured:
        raise RuntimeError(f"the SDK ({sdk}) sent no CreateTrainingJob request")
    plan = dataclasses.replace(plan, job_name=captured["TrainingJobName"])
    return Launched(plan=plan, request=captured, sent=not args.dry_run, sdk=sdk, region=region)


def _check_checkpoint_prefix(boto_session: Any, uri: str) -> None:
    """Before anything is billed: the checkpoint bucket exists and the launching credentials can list the prefix.

    The job's role, not these credentials, writes there; train.py's write probe checks the role at start, and
    docs/sagemaker.md lists the permissions it needs. A missing bucket or a bucket in another account shows here.
    """
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    try:
        boto_session.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
    except Exception as e:  # botocore's ClientError (NoSuchBucket, AccessDenied) or a credentials error
        code = getattr(e, "response", {}).get("Error", {}).get("Code") or type(e).__name__
        _refuse(
            f"--checkpoint-s3 {uri}: cannot list it with the launching credentials ({code}); the job's role needs "
            "s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject there (docs/sagemaker.md)"
        )


def _sdk_session(sdk: str, boto_session: Any, bucket: str | None) -> tuple[Any, str | None]:
    """The SDK's session and the execution role its config file names (None: none)."""
    if sdk == "v2":
        import sagemaker
        from sagemaker.config import TRAINING_JOB_ROLE_ARN_PATH
        from sagemaker.utils import resolve_value_from_config

        session = sagemaker.Session(boto_session=boto_session, default_bucket=bucket)
    else:
        from sagemaker.core.common_utils import resolve_value_from_config
        from sagemaker.core.config.config_schema import TRAINING_JOB_ROLE_ARN_PATH
        from sagemaker.core.helper.session_helper import Session

        _forget_v3_clients()
        session = Session(boto_session=boto_session, default_bucket=bucket)
    return session, resolve_value_from_config(None, TRAINING_JOB_ROLE_ARN_PATH, sagemaker_session=session)


def _forget_v3_clients() -> None:
    """3.x keeps one SageMaker client per boto session for the process, with the event handlers it was born
    with: a second launch on the same session would see the first one's capture (and dry-run answers, or
    lack of them). Dropped before and after each launch, every launch's clients carry its own handlers."""
    from sagemaker.core.utils.utils import SageMakerClient

    SageMakerClient.reset()


def _silence_sdk_telemetry(sdk: str) -> None:
    """Each SDK reports each call over plain HTTPS, outside botocore: a dry run must send nothing.

    Its own switch (TelemetryOptOut in the SDK config) makes every config lookup re-validate a large
    JSON schema, ~10 s per launch, so the sender is replaced instead.
    """
    if sdk == "v2":
        from sagemaker.telemetry import telemetry_logging
    else:
        from sagemaker.core.telemetry import telemetry_logging

    if hasattr(telemetry_logging, "_send_telemetry_request"):
        telemetry_logging._send_telemetry_request = lambda *a, **k: None


def container_args(hyperparameters: dict[str, str]) -> list[str]:
    """The argv the SageMaker container builds from the request's HyperParameters.

    As sagemaker-training does it: sagemaker_* keys dropped, keys sorted, each value JSON-decoded
    (falling back to the raw string) and printed with str(), so `"2"` -> `2` and `"\\"3e-4\\""` -> `3e-4`.
    """
    out = []
    for k in sorted(hyperparameters):
        if k.startswith("sagemaker_"):
            continue
        v = _json_or_raw(hyperparameters[k])
        out += [f"--{k}" if len(k) > 1 else f"-{k}", str(v)]
    return out


def v3_hyperparameters(hyperparameters: dict[str, Any]) -> dict[str, str]:
    """HyperParameters for SDK 3.x: JSON-encoded like 2.x's, and encoded twice where the container's two
    decodings (environment.py, then the driver) would change the string the script gets ("3e-4" -> 0.0003)."""
    out = {}
    for k, v in hyperparameters.items():
        once = json.dumps(v)
        out[k] = once if container_args_v3({k: once}) == [f"--{k}", str(v)] else json.dumps(once)
    return out


def _json_or_raw(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def container_args_v3(hyperparameters: dict[str, str]) -> list[str]:
    """The argv SDK 3.x's container drivers build from the request's HyperParameters.

    As sagemaker/train/container_drivers does it: request order; environment.py JSON-decodes each value into
    SM_HPS, the driver decodes it again and prints a string as it is, anything else as JSON; `--key` always.
    """
    out = []
    for k, raw in hyperparameters.items():
        v = _json_or_raw(_json_or_raw(raw))
        out += [f"--{k}", v if isinstance(v, str) else json.dumps(v)]
    return out


def container_command(plan: JobPlan, hyperparameters: dict[str, str], sdk: str = "v2") -> str:
    """What runs on each instance, in shell words (for the dry-run printout)."""
    if sdk == "v3":
        launcher = "torchrun --nnodes=N --nproc_per_node=GPUS " if plan.torchrun else "python "
        return launcher + " ".join([plan.entry_point] + container_args_v3(hyperparameters))
    launcher = "torchrun --nnodes N --nproc_per_node GPUS --node_rank R ... " if plan.torchrun else "python "
    return launcher + " ".join([plan.entry_point] + container_args(hyperparameters))


def main(argv: list[str] | None = None) -> int:
    """`python -m minilm_az.launch.sagemaker STAGE ...`: launch the job and print where things go."""
    args = parse_args(argv)
    try:
        launched = launch(args)
    except Exception as e:  # botocore/SDK errors (bad region, role, credentials) are one line here, not 190
        # The whole message, its lines joined: botocore's ParamValidationError and the SDK's ValueErrors give
        # their reason after the first line, so cutting at the first line would leave only "validation failed".
        reason = " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
        print(f"{PROG}: error: {type(e).__name__}: {reason}", file=sys.stderr)
        return 2
    plan, req = launched.plan, launched.request
    if args.dry_run:
        print(json.dumps(req, indent=2, default=str))
    region = launched.region
    print(
        f"{'dry run, nothing sent: would create' if args.dry_run else 'created'} training job {plan.job_name}",
        file=sys.stderr,
    )
    print(f"  runs:        {container_command(plan, req.get('HyperParameters', {}), launched.sdk)}", file=sys.stderr)
    print(f"  model to:    {plan.model_uri}", file=sys.stderr)
    if plan.checkpoint_uri:
        print(f"  checkpoints: {plan.checkpoint_uri}  (pass --checkpoint-s3 with this to resume)", file=sys.stderr)
    if plan.tensorboard_uri:
        print(f"  tensorboard: {plan.tensorboard_uri}  (tensorboard --logdir {plan.tensorboard_uri})", file=sys.stderr)
    if not args.dry_run:
        print(
            f"  console:     https://{region}.console.aws.amazon.com/sagemaker/home?region={region}"
            f"#/jobs/{plan.job_name}",
            file=sys.stderr,
        )
    return 0


# ---------------------------------------------------------------------------------------------
# Inside the container: sm_entry.py hands its argv here.


def entry_argv(argv: list[str]) -> tuple[str, list[str]]:
    """Split sm_entry.py's sorted `--key value` argv into (script, [subcommand, *flags])."""
    rest, script, command = [], None, None
    i = 0
    while i < len(argv):
        tok = argv[i]
        key, eq, val = tok.partition("=")
        if key in (f"--{SCRIPT_KEY}", f"--{COMMAND_KEY}"):
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"sm_entry.py: {key} needs a value")
                val = argv[i + 1]
                i += 1
            if key == f"--{SCRIPT_KEY}":
                script = val
            else:
                command = val
        else:
            rest.append(tok)
        i += 1
    if not script:
        raise SystemExit(f"sm_entry.py: no --{SCRIPT_KEY} hyperparameter; nothing to run")
    return script, ([command] if command else []) + rest


def run_entry(argv: list[str], root: str | Path) -> None:
    """Run `root/<script>` as __main__ with the subcommand moved to the front of its argv."""
    import runpy

    script, script_argv = entry_argv(argv)
    path = Path(root) / script
    if not path.is_file():
        raise SystemExit(f"sm_entry.py: {path} does not exist")
    sys.argv = [str(path)] + script_argv
    runpy.run_path(str(path), run_name="__main__")


__all__ = [
    "BACKENDS",
    "FINETUNE_METRICS",
    "SDK_LINES",
    "STAGES",
    "TRAIN_METRICS",
    "JobPlan",
    "Launched",
    "Stage",
    "build_estimator",
    "build_model_trainer",
    "build_parser",
    "container_args",
    "container_args_v3",
    "container_command",
    "entry_argv",
    "installed_sdk",
    "is_gpu_instance",
    "launch",
    "launch_v2",
    "launch_v3",
    "main",
    "parse_args",
    "parse_passthrough",
    "plan_job",
    "run_entry",
    "sdk_version",
    "stage_source_dir",
    "v3_hyperparameters",
]

if __name__ == "__main__":
    sys.exit(main())
