"""The launcher <-> script contract, field by field, through the real container toolkit.

For every field of every stage's config dataclass (generated, so a new flag is covered the day it is
added): the launcher's command line -> the CreateTrainingJob request it really sends (moto) -> the
hyperparameters as `sagemaker_training` reads them -> its `to_cmd_args` argv -> the script's own parser
gives back the value asked for. Channel fields must arrive as their mounted /opt/ml/input/data path and
outputs as their fixed container path, whatever the user passes. (SDK 2.x's container; 3.x's drivers get
the same test in tests/test_sagemaker_v3.py, from `launcher_argv` here.)
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from conftest import BUCKET, ROLE  # the mocked account conftest's aws fixture sets up

from minilm_az import config as C
from minilm_az.launch import flags

STAGES = [
    ("tokenize", "clean"),
    ("tokenize", "train"),
    ("tokenize", "report"),
    ("tokenize", "encode"),
    ("train", None),
    ("finetune", None),
]


TEXT = "Salam, dünya: 'x' \"y\""  # spaces, quotes, a colon and non-ASCII survive as one argument


def other_value(f: dataclasses.Field, text: str = TEXT):
    """A value for `f` that is not its default, within its choices and bounds (`text` for a string)."""
    if flags.is_bool(f):
        return not f.default
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c != f.default)
    base = str(f.type).split("|")[0].strip()
    lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
    if base == "int":
        v = (f.default if f.default is not None else (lo or 0)) + 3
        return min(v, hi) if hi is not None else v
    if base == "float":
        if hi is not None:
            return round(((lo or 0.0) + hi) / 2 + 0.0123, 6) if (lo or 0.0) + 0.0123 < hi else hi
        return round((f.default or 0.0) * 1.5 + 0.0375, 6)
    if base == "list[str]":
        return [f"{C.CONTAINER_INPUT}/data/eval text ü.txt"]  # a local path would be refused: the job lacks it
    return text


def launcher_argv(stage: str, command: str | None, cls, text: str = TEXT) -> tuple[list[str], dict]:
    """The launcher command line setting every field, and what each field must arrive as."""
    argv = [stage] + ([command] if command else []) + (["--phase", "1"] if stage == "train" else [])
    want = {}
    for ch, fname in flags.channels(cls).items():
        argv += [flags.flag(fname), f"s3://bucket/in/{ch}/"]
        f = next(x for x in dataclasses.fields(cls) if x.name == fname)
        want[fname] = [f"{C.CONTAINER_INPUT}/{ch}"] if f.metadata.get("nargs") else f"{C.CONTAINER_INPUT}/{ch}"
    for fname, path in flags.container_paths(cls).items():
        want[fname] = path
    for f in dataclasses.fields(cls):
        if f.name in want or (stage == "train" and f.name == "phase"):
            continue
        v = other_value(f, text)
        want[f.name] = v
        if isinstance(v, bool):
            argv.append(flags.flag(f.name) if v else "--no-" + flags.flag(f.name)[2:])
        else:
            argv += [flags.flag(f.name), v[0] if isinstance(v, list) else str(v)]
    if stage == "train":
        want["phase"] = 1
    return argv + ["--role", ROLE, "--bucket", BUCKET], want


def toolkit_argv(hyperparameters: dict[str, str], tmp_path, monkeypatch) -> list[str]:
    """What the container's toolkit makes of the request's HyperParameters: its own reader, its own mapping."""
    mapping = pytest.importorskip("sagemaker_training.mapping")
    environment = pytest.importorskip("sagemaker_training.environment")
    path = tmp_path / "hyperparameters.json"
    path.write_text(json.dumps(hyperparameters))
    monkeypatch.setattr(environment, "hyperparameters_file_dir", str(path))
    hps = environment.read_hyperparameters()
    user = {k: v for k, v in hps.items() if not k.startswith("sagemaker_")}
    return [str(a) for a in mapping.to_cmd_args(user)]


@pytest.mark.parametrize("stage, command", STAGES)
def test_every_config_field_survives_launcher_toolkit_and_script_parser(
    stage,
    command,
    aws,
    project,
    tmp_path,
    monkeypatch,
):
    from minilm_az.launch import sagemaker as sm

    # Every field at once is no command a user could give (--eval-only with --resume, --prompt with --data): the
    # checks of what a flag means in a mode (config.check_values, tested in test_nothing_lost.py and
    # test_bad_inputs.py) step aside here, where what is tested is that each value arrives as it was given.
    monkeypatch.setattr(C, "check_values", lambda cfg: None)
    cls = sm.STAGES[stage].configs[command]
    argv, want = launcher_argv(stage, command, cls)
    launched = sm.launch(sm.parse_args(argv), boto_session=aws, root=project)
    hps = launched.request["HyperParameters"]
    if "checkpoint_dir" in want:  # the launcher's s3:// prefix for a job that trains, none for an --eval-only job
        want["checkpoint_dir"] = json.loads(hps["checkpoint-dir"]) if "checkpoint-dir" in hps else None
    args = toolkit_argv(hps, tmp_path, monkeypatch)
    assert args == sm.container_args(hps)  # the dry run prints what the container really runs
    if stage == "tokenize":
        script, args = sm.entry_argv(args)  # sm_entry.py puts the subcommand back in front
        assert (script, args[0]) == ("tokenize.py", command)
        args = args[1:]
    assert not [a for a in args if a.startswith("-") and not a.startswith("--")], "a one-dash flag would be refused"
    for k in [k for k in os.environ if k.startswith("SM_")]:
        monkeypatch.delenv(k)
    cfg = flags.parse_config(cls, flags.make_parser(cls, sm.STAGES[stage].script, "x\n\ny"), args)
    got = dataclasses.asdict(cfg)
    assert {k: got[k] for k in want} == want
    assert set(want) == {f.name for f in dataclasses.fields(cls)}  # every field was exercised


def test_false_booleans_and_sagemaker_spellings_parse_alike():
    for spelling in (["--merge", "false"], ["--merge", "False"], ["--merge=false"], ["--no-merge"]):
        cfg = flags.parse_config(
            C.FinetuneConfig, flags.make_parser(C.FinetuneConfig, "f", "x"), ["--merge"] + spelling
        )
        assert cfg.merge is False, spelling
    for spelling in (["--merge"], ["--merge", "true"], ["--merge", "True"], ["--merge=1"]):
        cfg = flags.parse_config(C.FinetuneConfig, flags.make_parser(C.FinetuneConfig, "f", "x"), spelling)
        assert cfg.merge is True, spelling


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["finetune", "--model", "s3://b/m/", "--data", "s3://b/d/", "--r", "16"], "unrecognized arguments: -r 16"),
        (["finetune", "--model", "s3://b/m/", "--data", "s3://b/d/", "--lora-rank", "16"], "--lora-rank"),
        (["train", "--phase", "2", "--data", "s3://b/d/", "--stepz", "5"], "--stepz"),
        (["train", "--phase", "2", "--data", "s3://b/d/", "--ac", "most"], "invalid choice: 'most'"),
        (["train", "--phase", "2", "--data", "s3://b/d/", "--global-batch", "0"], "--global-batch must be >= 1"),
        (["train", "--phase", "2", "--data", "s3://b/d/", "--out", "/tmp/x"], "--out is set by the launcher"),
        (["tokenize", "train", "--corpus", "s3://b/c/", "--tokenizer", "s3://b/t/"], "takes no --tokenizer"),
    ],
)
def test_a_flag_the_script_would_refuse_is_refused_at_launch(argv, msg, capsys):
    from minilm_az.launch import sagemaker as sm

    with pytest.raises(SystemExit) as e:
        sm.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1]
