"""The one way a stage's config dataclass becomes command-line flags, on a laptop and on SageMaker.

Each field becomes a `--flag-name` with its `help`. Booleans take `--x`, `--no-x` and `--x true|false`,
because `--x true` is what SageMaker's toolkit passes. `lo`/`hi` bound numbers. All checks happen in the
parser, before any work. The scripts also fall back to SM_CHANNEL_<CHANNEL> and SM_MODEL_DIR, so a user's own
estimator works without naming every path. The launcher (sagemaker.py) checks pass-through flags with the
same parser before anything is billed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys

from minilm_az.config import CONTAINER_CHECKPOINTS, CONTAINER_MODEL, CONTAINER_TENSORBOARD
from minilm_az.logs import prints_errors


def in_sagemaker() -> bool:
    return "SM_MODEL_DIR" in os.environ or "SM_TRAINING_ENV" in os.environ


def on_container(here: bool = True) -> bool:
    """Whether the container's fixed paths (/opt/ml/checkpoints, its TensorBoard dir) are this run's: SageMaker's
    variables are set and /opt/ml is there. A laptop with a leftover SM_MODEL_DIR has no /opt/ml, and the run would
    make one, outside every dir its command names (audit 5). `here=False`: a container's flags checked elsewhere."""
    return in_sagemaker() and (not here or os.path.isdir(os.path.dirname(CONTAINER_CHECKPOINTS)))


def tensorboard_dir(on: bool, out: str) -> str | None:
    """Where --tensorboard writes event files (None: it is off): OUT/tensorboard, or, when OUT is a SageMaker job's
    model dir, the dir its TensorBoardOutputConfig syncs to S3 (the launcher's --tensorboard sets one up). An
    --out of the user's own keeps its events beside it even where SageMaker's variables are set."""
    if not on:
        return None
    job_out = on_container() and os.path.realpath(out) == os.path.realpath(
        os.environ.get("SM_MODEL_DIR", CONTAINER_MODEL)
    )
    return CONTAINER_TENSORBOARD if job_out else os.path.join(out, "tensorboard")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def str2bool(v: str | bool) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().strip('"').strip("'").lower()
    if s in ("1", "true", "yes", "y", "on"):
        return True
    if s in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {v!r}")


def _none_or(t):
    # "none" is how SageMaker's hyperparameters say "not set"; an empty value is a mistake (`--steps ""` from an
    # unset shell variable), never a request for the default.
    def parse(v: str):
        if str(v).strip() == "":
            raise argparse.ArgumentTypeError("is empty; give a value, or leave the flag out for its default")
        return None if str(v).lower() in ("none", "null") else t(v)

    parse.__name__ = t.__name__
    return parse


def is_bool(f: dataclasses.Field) -> bool:
    return f.type in ("bool", bool)


def channels(cls) -> dict[str, str]:
    """SageMaker channel -> the field it feeds."""
    return {f.metadata["channel"]: f.name for f in dataclasses.fields(cls) if "channel" in f.metadata}


def container_paths(cls) -> dict[str, str]:
    """Output field -> its fixed container path (/opt/ml/model, /opt/ml/checkpoints)."""
    return {f.name: f.metadata["container"] for f in dataclasses.fields(cls) if "container" in f.metadata}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are printed once on each host (torchrun starts one process per GPU)."""

    def error(self, message: str):
        """One line, not argparse's usage block: the flag and what is wrong with it."""
        if prints_errors():
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        self.exit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help (but not "None"), examples in the epilog kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def add_dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    """One `--flag` per dataclass field, typed from the field's annotation, defaults shown in --help."""
    for f in dataclasses.fields(cls):
        meta = {k: v for k, v in f.metadata.items() if k in ("choices", "nargs")}
        help_ = f.metadata.get("help", "")
        if "channel" in f.metadata:
            help_ += f" [SageMaker channel {f.metadata['channel']!r}]"
        if is_bool(f):  # `--x true|false` is rewritten to `--x` / `--no-x` by normalize_bools
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=f.default, help=help_)
            continue
        base = str(f.type).split("|")[0].strip()
        typ = {"int": int, "float": float, "str": str, "list[str]": str}.get(base, str)
        if "None" in str(f.type) and typ is not str:
            typ = _none_or(typ)
        parser.add_argument(
            flag(f.name),
            default=f.default,
            type=typ,
            help=help_,
            metavar=f.name.upper() if "choices" not in meta else None,
            **meta,
        )


def normalize_bools(argv: list[str], cls) -> list[str]:
    """`--x true`, `--x=False` (SageMaker's form) -> `--x` / `--no-x`, for the boolean fields of `cls`."""
    names = {flag(f.name) for f in dataclasses.fields(cls) if is_bool(f)}
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        key, eq, val = tok.partition("=")
        if key in names:
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                val, eq = argv[i + 1], "="
                i += 1
            if eq:
                try:
                    tok = key if str2bool(val) else "--no-" + key[2:]
                except argparse.ArgumentTypeError:
                    tok = f"{key}={val}"  # argparse rejects it with the flag named
        out.append(tok)
        i += 1
    return out


def check_bounds(parser: argparse.ArgumentParser, cfg) -> None:
    for f in dataclasses.fields(cfg):
        v, lo, hi = getattr(cfg, f.name), f.metadata.get("lo"), f.metadata.get("hi")
        if v is None or isinstance(v, (bool, list, str)):
            continue
        if isinstance(v, float) and not math.isfinite(v):  # argparse's float() takes "nan" and "inf"
            parser.error(f"{flag(f.name)} must be a finite number, got {v}")
        if lo is not None and v < lo:
            parser.error(f"{flag(f.name)} must be >= {lo}, got {v}")
        if f.metadata.get("gt") is not None and v <= f.metadata["gt"]:
            parser.error(f"{flag(f.name)} must be > {f.metadata['gt']}, got {v}")
        if hi is not None and v > hi:
            parser.error(f"{flag(f.name)} must be <= {hi}, got {v}")


def sm_defaults(cfg, given: frozenset[str] = frozenset(), here: bool = True) -> None:
    """Values not given on the command line (`given`: the fields it named), as a container sets them: paths from
    SM_CHANNEL_<CHANNEL> and SM_MODEL_DIR, and fields whose metadata holds a `sagemaker` default of their own."""
    # An --out the user gave (not the job's model dir) keeps its checkpoints beside it, as outside SageMaker; and
    # without a job's model dir (SageMaker's variables on a laptop) nothing goes to the container's paths.
    model_dir = os.environ.get("SM_MODEL_DIR")
    job_dirs = {os.path.normpath(p) for p in (model_dir, CONTAINER_MODEL) if p}  # `/opt/ml/model/` is the job's too
    own_out = any(
        f.name in given and os.path.normpath(getattr(cfg, f.name)) not in job_dirs
        for f in dataclasses.fields(cfg)
        if f.metadata.get("container") == CONTAINER_MODEL
    )
    for f in dataclasses.fields(cfg):
        if f.name in given or getattr(cfg, f.name) not in (None, f.default):
            continue
        if (own_out or not model_dir) and f.metadata.get("container") == CONTAINER_CHECKPOINTS:
            continue
        ch = f.metadata.get("channel")
        value = os.environ.get(f"SM_CHANNEL_{ch.upper()}") if ch else None
        if f.metadata.get("container") == CONTAINER_MODEL:
            value = os.environ.get("SM_MODEL_DIR")
        elif f.metadata.get("container") == CONTAINER_CHECKPOINTS and on_container(here):
            value = CONTAINER_CHECKPOINTS
        elif "sagemaker" in f.metadata and in_sagemaker():  # a default of its own there (the checkpoint clock)
            value = f.metadata["sagemaker"]
        if value:
            setattr(cfg, f.name, [value] if f.metadata.get("nargs") else value)


def make_parser(cls, prog: str, doc: str) -> Parser:
    """The parser of one stage: description = the docstring's first paragraph, epilog = its examples."""
    head, _, rest = doc.strip().partition("\n\n")
    p = Parser(
        prog=prog, description=head, epilog=rest.split("\n\n")[0], formatter_class=HelpFormatter, allow_abbrev=False
    )
    add_dataclass_args(p, cls)
    return p


def parse_config(cls, parser: argparse.ArgumentParser, argv: list[str] | None = None, here: bool = True):
    """argv -> a `cls` instance: SageMaker booleans normalised, bounds checked, container defaults filled.

    `here`: the run is on this machine, so an optional package a flag needs must be installed (the launcher
    checks a container's flags with here=False: the container installs it)."""
    argv = normalize_bools(list(sys.argv[1:] if argv is None else argv), cls)
    ns = parser.parse_args(argv)
    cfg = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
    check_bounds(parser, cfg)
    if here and getattr(cfg, "tensorboard", False) and importlib.util.find_spec("tensorboard") is None:
        parser.error(
            "--tensorboard needs the tensorboard package, which is in the tensorboard extra: "
            "pip install -e '.[tensorboard]'"
        )
    named = {w[2:].split("=")[0].replace("-", "_") for w in argv if w.startswith("--")}
    sm_defaults(cfg, frozenset(named | {n[3:] for n in named if n.startswith("no_")}), here)
    return cfg


class _Raising(Parser):
    def error(self, message: str):
        raise ValueError(message)


def check_args(cls, argv: list[str]) -> None:
    """Parse `argv` as the stage's script would (flags, types, choices, bounds); ValueError on the first problem."""
    p = _Raising(prog=cls.__name__, allow_abbrev=False)
    add_dataclass_args(p, cls)
    parse_config(cls, p, argv, here=False)
