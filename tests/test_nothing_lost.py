"""Nothing lost, second pass (issue 38): one row or more per family, each a bad input given as a user gives it.

Every row asserts, as tests/test_bad_inputs.py's rows do (its helpers are imported): the exit code, exactly one
`<prog>: error:` line holding the row's fragment, no traceback, and that every file that existed is byte-identical
afterwards. Here that is every file of the row's own directory W (its inputs, and the files beside them that lie
outside the dirs on the command line) and of the shared fixtures, metrics.jsonl included, less the paths a row
names in `changes` (a run that must succeed writes its output). One set-up (a 400-id tokenizer, its shards, a
2-step tiny model and a 1-step adapter) is shared by every row; the rows run two at a time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest
from prefork import Prefork
from test_bad_inputs import CHAT, KDE, ROOT, SMALL, SMALL_FT, Result, _argv, _clean_env, own_tracebacks
from test_ownership import _tmpfs_works

ROW_TIMEOUT = 300
TR = f"python train.py --phase 2 --preset tiny --tokenizer {{T}} --data {{S}} {SMALL}"  # how M was made
FT = f"python finetune.py --model {{M}} --data {{CHAT}} {SMALL_FT}"  # how A was made


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    cmd: str  # with {placeholders}: fixtures (T, S, M, A), the row's dir W and what its prep returns
    fragment: str = ""  # in the one error line (formatted like cmd)
    code: int = 2
    prep: Callable | None = None  # prep(fx, w) -> extra placeholders
    env: dict = dataclasses.field(default_factory=dict)
    changes: tuple[str, ...] = ()  # paths (formatted) a succeeding row may write; every other file must stay
    absent: tuple[str, ...] = ()  # paths (formatted) that must not exist afterwards
    prog: str = ""  # the error line's program when it is not the script's name (the demo)
    check: Callable | None = None
    signal: int = 0  # sent to the command once its stdout holds `after` (a user's Ctrl-C, a kill)
    after: str = ""
    during: Callable | None = None  # during(paths), instead of a signal, once stdout holds `after` (a user's edit)
    marks: tuple = ()  # pytest marks of the row (a skip where the machine cannot set it up)


def tree(path: str) -> dict[str, str]:
    """{relative path: sha256 or link target} of everything under `path` (the run's lock, gone at exit, left out)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
            p = os.path.join(root, name)
            rel = os.path.relpath(p, path)
            if name.startswith(".minilm-az.lock"):
                continue
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif name == "metrics.jsonl":
                with open(p, "rb") as f:
                    out[rel] = f.read()
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
            else:
                out[rel] = "special"
    return out


# ---------------------------------------------------------------- row inputs


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst, symlinks=True) if os.path.isdir(src) else shutil.copyfile(src, dst)
    return dst


def finished_run(fx, w):
    """A copy of M, a finished train.py run, whose checkpoints/ was removed to free disk."""
    x = _copy(fx["M"], os.path.join(w, "run"))
    shutil.rmtree(os.path.join(x, "checkpoints"))
    return {"X": x}


def run_copy(fx, w):
    return {"X": _copy(fx["M"], os.path.join(w, "run"))}


def finished_adapter(fx, w):
    x = _copy(fx["A"], os.path.join(w, "adapter"))
    shutil.rmtree(os.path.join(x, "checkpoints"))
    return {"X": x}


def run_without_tensorboard(fx, w):
    """A copy of M (trained without --tensorboard), where a user keeps a file in tensorboard/."""
    x = _copy(fx["M"], os.path.join(w, "run"))
    os.makedirs(os.path.join(x, "tensorboard"))
    with open(os.path.join(x, "tensorboard", "notes.txt"), "w") as f:
        f.write("mine\n")
    return {"X": x}


def out_with_a_users_staging_named_dir(fx, w):
    """An --out where a user keeps a folder named like a staging dir, holding a file (the audit's data loss)."""
    x = os.path.join(w, "out")
    os.makedirs(os.path.join(x, ".staging-backup"))
    with open(os.path.join(x, ".staging-backup", "important.txt"), "w") as f:
        f.write("mine\n")
    return {"X": x}


def metrics_jsonl_links_out(fx, w):
    """A copy of M whose metrics.jsonl is a symlink to a user's file beside it: a resume would append to it."""
    x = _copy(fx["M"], os.path.join(w, "run"))
    with open(os.path.join(w, "mylog.txt"), "w") as f:
        f.write("mine\n")
    os.remove(os.path.join(x, "metrics.jsonl"))
    os.symlink(os.path.join(w, "mylog.txt"), os.path.join(x, "metrics.jsonl"))
    return {"X": x}


def runs_dir_is_a_file(fx, w):
    with open(os.path.join(w, "f"), "w") as f:
        f.write("mine\n")
    return {"X": os.path.join(w, "f")}


def tokenizer_copy(fx, w):
    return {"X": _copy(fx["T"], os.path.join(w, "tok"))}


def base_copy(fx, w):
    return {"X": _copy(fx["M"], os.path.join(w, "base"))}


def add_a_token(paths):
    """A user's edit of the tokenizer a run read at its start: one token more in its tokenizer.json."""
    from tokenizers import Tokenizer

    path = os.path.join(paths["X"], "tokenizer.json")
    tok = Tokenizer.from_file(path)
    tok.add_tokens(["yenisöz"])
    tok.save(path)


def adapter_then_new_base_tokenizer(fx, w):
    """A 1-step adapter on a copy of M, whose tokenizer.json is then edited: the adapter's ids are the old one's."""
    x = base_copy(fx, w)["X"]
    _run(FT + " --out {O}", fx["runner"], M=x, CHAT=CHAT, O=os.path.join(w, "out"))
    add_a_token({"X": x})
    return {"X": x}


def out_links_to_base(fx, w):
    x = _copy(fx["M"], os.path.join(w, "base"))
    os.symlink(x, os.path.join(w, "link"))
    return {"X": x, "L": os.path.join(w, "link")}


def hardlinked_twin(fx, w):
    """M copied, then the copy copied again with hard links (`cp -al`): the twin shares every file's inode."""
    a = _copy(fx["M"], os.path.join(w, "a"))
    subprocess.run(["cp", "-al", a, os.path.join(w, "b")], check=True)
    return {"X": os.path.join(w, "b")}


def lock_dangling_link(fx, w):
    x = os.path.join(w, "out")
    os.makedirs(x)
    os.symlink(os.path.join(w, "outside", "created"), os.path.join(x, ".minilm-az.lock.sagemaker-ignore"))
    os.makedirs(os.path.join(w, "outside"))
    return {"X": x}


def lock_is_dir(fx, w):
    x = os.path.join(w, "out")
    os.makedirs(os.path.join(x, ".minilm-az.lock.sagemaker-ignore"))
    return {"X": x}


def out_dangling_link(fx, w):
    os.symlink(os.path.join(w, "nowhere", "deeper"), os.path.join(w, "out"))
    return {"X": os.path.join(w, "out")}


def shard_rewritten(fx, w):
    """M's run dir (with its checkpoints) and a copy of its shards whose first train shard is rewritten in place
    (two tokens swapped: valid ids, the same size), index.json unchanged."""
    x = _copy(fx["M"], os.path.join(w, "run"))
    s = _copy(fx["S"], os.path.join(w, "shards"))
    with open(os.path.join(s, "index.json")) as f:
        first = json.load(f)["splits"]["train"]["shards"][0]["file"]
    with open(os.path.join(s, first), "r+b") as f:
        data = bytearray(f.read())
        mid = len(data) // 2 & ~1
        data[mid : mid + 2], data[mid + 2 : mid + 4] = data[mid + 2 : mid + 4], data[mid : mid + 2]
        if data[mid : mid + 2] == data[mid + 2 : mid + 4]:
            data[mid : mid + 2] = (1).to_bytes(2, "little")
        f.seek(0)
        f.write(data)
    return {"X": x, "S2": s}


def _shards_with(fx, w, split: str, edit) -> dict:
    s = _copy(fx["S"], os.path.join(w, "shards"))
    with open(os.path.join(s, "index.json")) as f:
        file = os.path.join(s, json.load(f)["splits"][split]["shards"][0]["file"])
    with open(file, "r+b") as f:
        f.write(edit(os.path.getsize(file)))
    return {"S2": s, "BIN": file}


def random_bytes_train(fx, w):
    """The train shard overwritten with random bytes (index.json and its max_id unchanged): ids far past 400."""
    return _shards_with(fx, w, "train", lambda n: os.urandom(n))


def id_past_vocab_val(fx, w):
    """One id (420) past the 400-id vocabulary in the val shard, below the 448 embedding rows."""
    return _shards_with(fx, w, "val", lambda n: (420).to_bytes(2, "little"))


def model_without_tokenizer(fx, w):
    x = _copy(fx["M"], os.path.join(w, "model"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(x, name)):
            os.remove(os.path.join(x, name))
    return {"X": x}


def checkpoints_is_a_file(fx, w):
    x = _copy(fx["M"], os.path.join(w, "run"))
    shutil.rmtree(os.path.join(x, "checkpoints"))
    with open(os.path.join(x, "checkpoints"), "w") as f:
        f.write("a note\n")
    return {"X": x}


def corpus_fifo(fx, w):
    os.mkfifo(os.path.join(w, "pipe.txt"))
    return {"X": os.path.join(w, "pipe.txt")}


def another_base_of_the_same_shape(fx, w):
    """A copy of M with one weight byte changed: the same shape, the same tokenizer, another model."""
    x = _copy(fx["M"], os.path.join(w, "other"))
    with open(os.path.join(x, "model.safetensors"), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(x, "model.safetensors")) // 2)
        f.write(b"\x01" if f.read(1) != b"\x01" else b"\x02")
    return {"X": x}


def adapter_without_identity(fx, w):
    """A copy of A as adapters were saved before they recorded their base by content: its shape alone."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    x = _copy(fx["A"], os.path.join(w, "adapter"))
    path = os.path.join(x, "adapter_model.safetensors")
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    base = {k: v for k, v in json.loads(meta["minilm_az.base"]).items() if k != "identity"}
    save_file(tensors, path, metadata={**meta, "minilm_az.base": json.dumps(base, sort_keys=True)})
    return {"X": x}


def _log_path_as(src: str, name: str, kind: str):
    """A copy of fixture `src` where its `name` (metrics.jsonl, tensorboard) is a `kind` ("dir" or "file") of a
    user's, holding a note."""

    def prep(fx, w):
        x = _copy(fx[src], os.path.join(w, "run"))
        path = os.path.join(x, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        if kind == "dir":
            os.makedirs(path)
            path = os.path.join(path, "notes.txt")
        with open(path, "w") as f:
            f.write("mine\n")
        return {"X": x}

    return prep


def run_with_a_users_file(name: str):
    """A copy of M where a user keeps a file of their own named `name` (a weight layout's name no run recorded)."""

    def prep(fx, w):
        x = _copy(fx["M"], os.path.join(w, "run"))
        with open(os.path.join(x, name), "w") as f:
            f.write("mine\n")
        return {"X": x}

    return prep


def adapter_copy(fx, w):
    return {"X": _copy(fx["A"], os.path.join(w, "adapter"))}


def merged_adapter(fx, w):
    """A finished 1-step adapter with --merge: OUT/merged is the base with this adapter folded in."""
    x = os.path.join(w, "adapter")
    _run(FT + " --merge --out {X}", **fx, X=x)  # fx["runner"] is _run's runner
    return {"X": x}


def earlier_evaluation(fx, w):
    """An --eval-only output (its metrics.jsonl, its marker) and a text large enough that encoding it takes seconds,
    so a signal sent once the model is built lands before the evaluation's line."""
    x = os.path.join(w, "eval")
    _run(f"{EVAL} --eval-text {KDE} --eval-batches 1 --out {{X}}", **fx, X=x)  # fx["runner"] is _run's runner
    with open(KDE, encoding="utf-8") as f:
        text = f.read()
    with open(os.path.join(w, "big.txt"), "w", encoding="utf-8") as f:
        f.write(text * max(1, (8 << 20) // len(text.encode())))
    return {"X": x, "BIG": os.path.join(w, "big.txt")}


def _corpus_dir(mode: int):
    """A corpus directory with the permission bits `mode` (no search bit, or no read bit) and one corpus file."""

    def prep(fx, w):
        c = os.path.join(w, "corpus")
        os.makedirs(c)
        shutil.copyfile(KDE, os.path.join(c, "kde.txt"))
        os.chmod(c, mode)
        return {"C": c, "PY": sys.executable}

    return prep


def removed_cwd(fx, w):
    return {"PY": sys.executable, "R": ROOT}


def check_earlier_log_replaced(r):
    """SIGTERM after a step: the run saves a checkpoint, its first output, and only then is the earlier log gone."""
    assert "stopped by signal 15" in r.stdout, r.explain()
    with open(os.path.join(r.paths["X"], "metrics.jsonl")) as f:
        kinds = [json.loads(line)["kind"] for line in f]
    assert kinds[0] == "config" and "checkpoint" in kinds and "export" not in kinds, kinds


def check_identity_warning(r):
    assert "records no identity of its base" in r.stderr, r.explain()


def check_user_file_stays(r):
    assert "export dir=" in r.stdout, r.stdout[-2000:]
    with open(os.path.join(r.paths["X"], "tensorboard", "notes.txt")) as f:
        assert f.read() == "mine\n"


def run_with_a_note_in_its_checkpoint(fx, w):
    """A copy of M whose checkpoint dir holds a user's note beside the save's files."""
    x = _copy(fx["M"], os.path.join(w, "run"))
    (step,) = os.listdir(os.path.join(x, "checkpoints", "phase2"))
    with open(os.path.join(x, "checkpoints", "phase2", step, "NOTE.txt"), "w") as f:
        f.write("mine\n")
    return {"X": x, "STEP": step}


def check_note_kept_beside_the_pruned_checkpoint(r):
    phase2 = os.path.join(r.paths["X"], "checkpoints", "phase2")
    kept = os.path.join(phase2, r.paths["STEP"] + ".kept")
    assert sorted(os.listdir(kept)) == ["NOTE.txt"], sorted(os.listdir(phase2))  # the save's own files went
    with open(os.path.join(kept, "NOTE.txt")) as f:
        assert f.read() == "mine\n"
    assert not os.path.exists(os.path.join(phase2, r.paths["STEP"])), "the pruned checkpoint is still there"


def phase_dir_links_to_a_copy_of_the_shards(fx, w):
    """A copy of M whose checkpoints/phase2 is a link to a copy of the shards (the fourth audit's find)."""
    x, shards = _copy(fx["M"], os.path.join(w, "run")), _copy(fx["S"], os.path.join(w, "sh"))
    shutil.rmtree(os.path.join(x, "checkpoints", "phase2"))
    os.symlink(shards, os.path.join(x, "checkpoints", "phase2"))
    return {"X": x}


def check_changed_lr_warned(r):
    assert "with changed lr=0.0024->0.001" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]


def check_own_out_under_sagemaker(r):
    new = os.path.join(r.paths["W"], "new")
    assert os.listdir(os.path.join(new, "checkpoints", "phase2")), "the checkpoints did not go beside --out"
    assert [n for n in os.listdir(os.path.join(new, "tensorboard")) if n.startswith("events.")], "no events in --out"


def check_made(*dirs: str):
    """A check that the run made each of `dirs` (relative to the row's dir W)."""

    def check(r):
        for d in dirs:
            assert os.path.isdir(os.path.join(r.paths["W"], d)), d + r.explain()

    return check


NO_OPT_ML = (pytest.mark.skipif(os.path.isdir("/opt/ml"), reason="this machine has an /opt/ml"),)


def check_twin_resumed(r):
    assert "resume from=" in r.stdout, r.stdout[-2000:]


# ---------------------------------------------------------------- the table

NEW = "--out {W}/new"
# A run that would take hours and saves nothing on its own: a signal always lands before its first checkpoint.
LONG = "--steps 100000 --checkpoint-every 0 --checkpoint-minutes 0"
EVAL = "python train.py --eval-only --base-model {M} --tokenizer {M} --seq-len 32"
# Root reads any directory: the command runs without the capabilities that let it, as a user would.
AS_A_USER = "setpriv --bounding-set=-dac_override,-dac_read_search " if os.geteuid() == 0 else ""
NEEDS_SETPRIV = (pytest.mark.skipif(AS_A_USER != "" and not shutil.which("setpriv"), reason="needs setpriv"),)
ROWS = [
    # 1. a finished output is replaced only with --overwrite
    Row(
        "f1_train_finished_no_checkpoints",
        f"{TR} --steps 1 --out {{X}}",
        "no checkpoint to continue",
        prep=finished_run,
    ),
    Row(
        "f1_train_finished_own_checkpoint_dir",
        f"{TR} --steps 1 --out {{X}} --checkpoint-dir {{W}}/ckpt",
        "no checkpoint to continue",
        prep=finished_run,
    ),
    Row(
        "f1_finetune_finished_no_checkpoints",
        f"{FT} --out {{X}}",
        "no checkpoint to continue",
        prep=finished_adapter,
    ),
    Row(  # the resume's refusal, like every refusal, comes before the log's file opens: metrics.jsonl stays
        "f1_train_checkpoint_past_steps_writes_no_log_line",
        f"{TR} --steps 1 --out {{X}}",
        "past --steps 1",
        prep=run_copy,
    ),
    # 2. cleanup removes only the files a run recorded writing
    Row(
        "f2_overwrite_keeps_a_file_in_tensorboard",
        f"{TR} --resume never --overwrite --out {{X}}",
        code=0,
        prep=run_without_tensorboard,
        changes=("{X}",),
        check=check_user_file_stays,
    ),
    Row(  # a pruned checkpoint's dir loses the save's files; a file a user put there stays, its dir renamed .kept
        "f2_prune_keeps_a_users_note_in_a_checkpoint_dir",
        f"{TR} --steps 3 --checkpoint-every 1 --keep-checkpoints 1 --out {{X}}",
        code=0,
        prep=run_with_a_note_in_its_checkpoint,
        changes=("{X}",),
        check=check_note_kept_beside_the_pruned_checkpoint,
    ),
    Row(  # a user's ".staging-backup" is no staging dir of ours: the dir is not empty, and nothing in it goes
        "f2_users_staging_named_dir_stays",
        "python tokenize.py train --corpus " + KDE + " --vocab-size 300 --no-progress --out {X}",
        "holds files no minilm-az stage wrote (.staging-backup)",
        prep=out_with_a_users_staging_named_dir,
    ),
    # 3. paths compared as files
    Row(
        "f3_out_symlink_to_base",
        f"{TR} --base-model {{X}} --overwrite --out {{L}}",
        "is --base-model",
        prep=out_links_to_base,
    ),
    Row(
        "f3_hardlinked_twin",
        f"{TR} --out {{X}}",
        code=0,
        prep=hardlinked_twin,
        changes=("{X}",),
        check=check_twin_resumed,
    ),
    Row(
        "f3_lock_dangling_link",
        f"{TR} --out {{X}}",
        "is a symlink to",
        prep=lock_dangling_link,
        absent=("{W}/outside/created",),
    ),
    Row(  # a resume never appends to a user's file through a link in --out
        "f3_metrics_jsonl_is_a_link",
        f"{TR} --out {{X}}",
        "metrics.jsonl is a symlink to",
        prep=metrics_jsonl_links_out,
    ),
    Row("f3_out_is_an_s3_url", f"{TR} --out s3://bucket/run", "a URL; outputs are local directories", absent=("s3:",)),
    # 4. inputs known by content
    Row("f4_shard_rewritten_in_place", f"{TR} --data {{S2}} --out {{X}}", "from other inputs", prep=shard_rewritten),
    Row(
        "f4_random_bytes_in_train_shard",
        f"{TR} --data {{S2}} {NEW}",
        "{BIN}: token",
        prep=random_bytes_train,
        changes=("{W}/new",),
    ),
    Row(
        "f4_id_past_vocab_in_val_shard",
        f"{TR} --data {{S2}} {NEW}",
        "{BIN}: token 0 is id 420",
        prep=id_past_vocab_val,
        changes=("{W}/new",),
    ),
    Row(  # an adapter records its base by content: another base of the same shape is refused, naming both
        "f4_adapter_on_another_base_of_the_same_shape",
        "python finetune.py --model {X} --adapter {A} --prompt Salam --max-new-tokens 2",
        "{A}: adapter trained on {M} (",
        prep=another_base_of_the_same_shape,
    ),
    Row(  # one saved before adapters recorded it still loads, with a warning line
        "f4_adapter_saved_without_its_base_identity_loads",
        "python finetune.py --model {M} --adapter {X} --prompt Salam --max-new-tokens 2",
        code=0,
        prep=adapter_without_identity,
        check=check_identity_warning,
    ),
    Row(
        "f4_model_without_tokenizer_json",
        f"python train.py --eval-only --base-model {{X}} --tokenizer {{T}} --eval-text {KDE} --seq-len 32 {NEW}",
        "has no tokenizer.json",
        prep=model_without_tokenizer,
    ),
    # 5. every value checked where it enters, named
    Row("f5_out_empty", f'{TR} --out ""', "--out is empty", absent=("runs/phase2/minilm-az-output.json",)),
    Row("f5_steps_empty", f'{TR} --steps "" {NEW}', "argument --steps: is empty"),
    Row("f5_lora_alpha_0", f"{FT} --lora-alpha 0 {NEW}", "--lora-alpha"),
    Row("f5_seed_negative", f"{FT} --seed -1 {NEW}", "--seed"),
    Row("f5_adapter_on_a_training_run", f"{FT} --adapter {{A}} {NEW}", "--adapter does nothing without --chat"),
    Row("f5_tokenize_out_empty", f'python tokenize.py train --corpus {KDE} --out ""', "--out is empty"),
    Row("f5_demo_procs_0", "python -m demo --procs 0 --runs-dir {W}", "--procs", prog="python -m demo"),
    Row(  # it became tokenize.py clean --workers 100000, a pool of that many processes (audit 6)
        "f5_demo_procs_past_the_cpus",
        "python -m demo --procs 100000 --runs-dir {W}/runs",
        "--procs 100000 is far more than",
        prog="python -m demo",
        absent=("{W}/runs",),
    ),
    Row(  # the run blocked on it with no line (audit 6); a tokenizer.json that is a FIFO already said so
        "f8_chat_data_is_a_fifo",
        "python finetune.py --model {M} --data {W}/pipe.txt " + SMALL_FT + " --out {W}/a",
        "{W}/pipe.txt: a FIFO",
        prep=corpus_fifo,
        absent=("{W}/a",),
    ),
    Row(  # "" put the run in the working directory (the fourth audit's find)
        "f5_demo_runs_dir_empty",
        "python -m demo --quick --runs-dir '' --name nl-empty-runs-dir",
        "--runs-dir is empty",
        prog="python -m demo",
        absent=("nl-empty-runs-dir",),
    ),
    Row(  # a resumed run with another --lr says so (it said nothing, and the finished run re-exported its model)
        "f5_resume_with_changed_lr_warns",
        f"{TR} --lr 0.001 --out {{X}}",
        code=0,
        prep=run_copy,
        changes=("{X}",),
        check=check_changed_lr_warned,
    ),
    *(
        Row(f"f5_env_{var.lower()}_{i}", f"{TR} {NEW}", var, env={var: value})
        for var, values in (
            ("MINILM_AZ_COLLECTIVE_TIMEOUT_S", ("abc", "inf", "-5", "1e300")),  # 1e300: a traceback (C int)
            ("OMP_NUM_THREADS", ("0", "4,2", "", "999999999999")),  # "": libgomp's line alone; a C int's overflow
            ("WORLD_SIZE", ("abc",)),
            ("LOCAL_RANK", ("abc",)),  # set by hand outside torchrun: its error line was never printed
        )
        for i, value in enumerate(values)
    ),
    Row("f5_env_local_rank_by_hand_flag_error", f"{TR} --steps abc {NEW}", "--steps", env={"LOCAL_RANK": "1"}),
    Row("f5_env_world_size_finetune", f"{FT} {NEW}", "WORLD_SIZE", env={"WORLD_SIZE": "abc"}),
    Row(  # the tokenizer trainer's own integers overflowed: a Rust panic, and a marker left in --out
        "f5_vocab_size_past_31_bits",
        f"python tokenize.py train --corpus {KDE} --vocab-size 99999999999 --out {{W}}/t",
        "vocab size 99999999999 is too large",
        absent=("{W}/t",),
    ),
    Row(  # a chat line of bytes that are no UTF-8 was a TypeError traceback from the tokenizer
        "f5_chat_line_not_utf8",
        """sh -c 'printf "Sal\\377am\\nSalam\\n" | "$0" finetune.py --model {M} --adapter {A} --chat \
        --max-new-tokens 2' {PY}""",
        code=0,
        prog="finetune.py",
        prep=lambda fx, w: {"PY": sys.executable},
        check=lambda r: "# that line is not valid UTF-8: not sent" in r.stderr or pytest.fail(r.stderr[-2000:]),
    ),
    Row(
        "f5_eval_only_steps",
        f"python train.py --eval-only --base-model {{M}} --tokenizer {{M}} --steps 5 {NEW}",
        "--steps does nothing with --eval-only",
    ),
    Row("f5_base_tokenizer_alone", f"{TR} --base-tokenizer {{M}} {NEW}", "--base-tokenizer does nothing without"),
    Row("f5_prompt_with_merge", "python finetune.py --model {M} --prompt Salam --merge", "--merge does nothing with"),
    Row("f5_prompt_with_out", "python finetune.py --model {M} --prompt Salam --out {W}/o", "--out does nothing with"),
    Row(
        "f5_val_fraction_with_val_corpus",
        f"python tokenize.py encode --tokenizer {{T}} --corpus {KDE} --val-corpus {KDE} --val-fraction 0.3 {NEW}",
        "--val-fraction does nothing with --val-corpus",
    ),
    Row("f5_seed_too_large", f"{TR} --seed 100000000000000000000000 {NEW}", "--seed"),
    Row("f5_prompt_spaces_only", "python finetune.py --model {M} --prompt '   '", "--prompt is empty"),
    Row(
        "f5_clean_threshold_of_a_filter_that_is_off",
        f"python tokenize.py clean --corpus {KDE} --lang none --lang-threshold 0.9 --out {{W}}/c",
        "--lang-threshold does nothing with --lang none",
    ),
    Row("f5_warmup_longer_than_steps", f"{TR} --warmup 100 {NEW}", "--warmup 100 is longer than --steps 2"),
    Row("f5_preset_with_base_model", f"{TR} --base-model {{M}} --preset llama3.2-1b {NEW}", "--preset does nothing"),
    Row("f5_s3_prefix_with_an_empty_segment", f"{TR} --checkpoint-dir s3://bucket//run {NEW}", "not an S3 prefix"),
    *(  # a URL of another form is refused, never a local dir named "S3:" or "s3a:" in the working directory
        Row(f"f5_checkpoint_dir_url_{i}", f"{cmd} --checkpoint-dir {url} {NEW}", "a URL, but not s3://", absent=(top,))
        for i, (cmd, url, top) in enumerate(
            [(TR, "S3://bucket/run", "S3:"), (TR, "s3a://bucket/run", "s3a:"), (FT, "s3:/bucket/run", "s3:")]
        )
    ),
    # 6. no file of an --eval-only without --out
    Row(
        "f6_eval_only_tensorboard_without_out",
        f"python train.py --eval-only --base-model {{M}} --tokenizer {{M}} --eval-text {KDE} --tensorboard",
        "--tensorboard with --eval-only needs --out",
        absent=("runs/phase2/tensorboard",),
    ),
    # 6. SageMaker's variables never override a path the user gave
    Row(
        "f6_sm_env_explicit_out_keeps_checkpoints_and_events",
        f"{TR} --steps 2 --checkpoint-every 1 --tensorboard {NEW}",
        code=0,
        env={"SM_TRAINING_ENV": "{}", "SM_MODEL_DIR": "/opt/ml/model"},
        changes=("{W}/new",),
        absent=("/opt/ml/checkpoints", "/opt/ml/output/tensorboard"),
        check=check_own_out_under_sagemaker,
    ),
    Row(  # a leftover SM_MODEL_DIR on a laptop put the checkpoints and events into a new /opt/ml (audit 6)
        "f6_sm_model_dir_on_a_laptop_makes_no_opt_ml",
        f"{TR} --checkpoint-every 1 --tensorboard --out {{W}}/smout",
        code=0,
        env={"SM_MODEL_DIR": "{W}/smout"},
        changes=("{W}/smout",),
        absent=("/opt/ml",),
        check=check_made("smout/checkpoints", "smout/tensorboard"),
        marks=NO_OPT_ML,
    ),
    Row(
        "f6_sm_model_dir_without_out_on_a_laptop",
        f"{TR} --checkpoint-every 1",
        code=0,
        env={"SM_MODEL_DIR": "{W}/sm"},
        changes=("{W}/sm",),
        absent=("/opt/ml",),
        check=check_made("sm/checkpoints"),
        marks=NO_OPT_ML,
    ),
    # 8. errors say what was found
    Row(  # a link where train.py puts phase 2's saves: they went into the shards it points at (fourth audit)
        "f8_phase_dir_is_a_link",
        f"{TR} --overwrite --out {{X}}",
        "checkpoints/phase2 is a symlink to",
        prep=phase_dir_links_to_a_copy_of_the_shards,
    ),
    Row("f8_out_dangling_link", f"{TR} --out {{X}}", "a symlink to", prep=out_dangling_link, absent=("{W}/nowhere",)),
    Row("f8_lock_is_a_directory", f"{TR} --out {{X}}", "where the run's lock file goes", prep=lock_is_dir),
    Row("f8_corpus_dev_null", "python tokenize.py train --corpus /dev/null --out {W}/tok", "a character device"),
    Row("f8_corpus_fifo", "python tokenize.py train --corpus {X} --out {W}/tok", "a FIFO", prep=corpus_fifo),
    Row(
        "f8_data_dev_null", f"python train.py --phase 2 --tokenizer {{T}} --data /dev/null {NEW}", "a character device"
    ),
    Row(
        "f8_demo_runs_dir_is_a_file",
        "python -m demo --runs-dir {X}",
        "--runs-dir",
        prep=runs_dir_is_a_file,
        prog="python -m demo",
    ),
    Row("f8_prompt_empty", 'python finetune.py --model {M} --prompt ""', "--prompt is empty"),
    Row(  # said as what was found, before the claim removes or writes anything (not "[Errno 21] Is a directory")
        "f8_metrics_jsonl_is_a_directory",
        f"{TR} --out {{X}}",
        "{X}/metrics.jsonl is a directory, expected a file",
        prep=_log_path_as("M", "metrics.jsonl", "dir"),
    ),
    Row(
        "f8_finetune_metrics_jsonl_is_a_directory",
        f"{FT} --out {{X}}",
        "{X}/metrics.jsonl is a directory, expected a file",
        prep=_log_path_as("A", "metrics.jsonl", "dir"),
    ),
    Row(  # not "[Errno 17] File exists" after the resume
        "f8_tensorboard_is_a_file",
        f"{TR} --tensorboard --out {{X}}",
        "{X}/tensorboard is a file, expected a directory",
        prep=_log_path_as("M", "tensorboard", "file"),
    ),
    Row(
        "f8_checkpoints_is_a_file",
        f"{TR} --out {{X}}",
        "is a file, where a directory belongs",
        prep=checkpoints_is_a_file,
    ),
    # Second audit (a): an export removes only files a run recorded writing, never a name's pattern
    Row(
        "a_export_keeps_a_users_file_named_like_a_shard",
        f"{TR} --steps 3 --out {{X}}",
        code=0,
        prep=run_with_a_users_file("model-00001-of-00002.safetensors"),
        changes=("{X}/metrics.jsonl", "{X}/model.safetensors", "{X}/checkpoints", "{X}/minilm-az-output.json"),
    ),
    Row(  # left beside the new model.safetensors, it is what a reader (ours among them) would load instead
        "a_export_refuses_a_users_index_it_would_leave_beside_the_model",
        f"{TR} --steps 3 --out {{X}}",
        "{X}/model.safetensors.index.json: no minilm-az output recorded writing it, and a reader would load it",
        prep=run_with_a_users_file("model.safetensors.index.json"),
        changes=("{X}/metrics.jsonl", "{X}/checkpoints", "{X}/minilm-az-output.json"),
    ),
    # (c) an --overwrite stopped before its first output (a checkpoint, the export, an evaluation's line) leaves the
    # earlier run whole: its metrics.jsonl and marker are byte-identical (the new run's checkpoints go to W/ckpt)
    *(
        Row(
            f"c_{name}_overwrite_{sig.name.lower()}_before_its_first_output_keeps_the_earlier_run",
            cmd,
            "interrupted" if sig == signal.SIGINT else "",
            code=130 if sig == signal.SIGINT else -signal.SIGKILL,
            prep=prep,
            changes=("{W}/ckpt",),
            signal=sig,
            after=after,
        )
        for name, cmd, prep, after in (
            (
                "train",
                f"{TR} {LONG} --resume never --overwrite --out {{X}} --checkpoint-dir {{W}}/ckpt",
                run_copy,
                "train step=1 ",
            ),
            (
                "finetune",
                f"{FT} {LONG} --resume never --overwrite --out {{X}} --checkpoint-dir {{W}}/ckpt",
                adapter_copy,
                "finetune step=1 ",
            ),
            ("eval_only", f"{EVAL} --eval-text {{BIG}} --overwrite --out {{X}}", earlier_evaluation, "batch "),
        )
        for sig in (signal.SIGKILL, signal.SIGINT)
    ),
    Row(  # its checkpoints too: the first save's finalize prunes them, not Checkpointer._fresh at start
        "c_train_overwrite_sigkill_before_its_first_checkpoint_keeps_the_earlier_checkpoints",
        f"{TR} {LONG} --resume never --overwrite --out {{X}}",
        code=-signal.SIGKILL,
        prep=run_copy,
        signal=signal.SIGKILL,
        after="train step=1 ",
    ),
    Row(  # SIGTERM saves a checkpoint, the run's first output: then, and only then, the earlier log goes
        "c_train_overwrite_sigterm_replaces_the_earlier_log_once_its_checkpoint_exists",
        f"{TR} {LONG} --resume never --overwrite --out {{X}} --checkpoint-dir {{W}}/ckpt",
        code=0,
        prep=run_copy,
        changes=("{X}/metrics.jsonl", "{X}/minilm-az-output.json", "{W}/ckpt"),
        signal=signal.SIGTERM,
        after="train step=1 ",
        check=check_earlier_log_replaced,
    ),
    # (d) a merged model never stands beside an adapter it was not made from
    Row(
        "d_finetune_overwrite_removes_the_earlier_adapters_merged_model",
        f"{FT} --resume never --overwrite --out {{X}}",
        code=0,
        prep=merged_adapter,
        changes=("{X}",),
        absent=("{X}/merged",),
    ),
    Row(
        "d_finetune_resumed_without_merge_removes_the_merged_model_of_its_earlier_adapter",
        f"{FT} --steps 2 --out {{X}}",
        code=0,
        prep=merged_adapter,
        changes=("{X}",),
        absent=("{X}/merged",),
    ),
    # (e) errors say what was found
    Row(
        "e_corpus_dir_without_search_permission",
        AS_A_USER + "{PY} tokenize.py train --corpus {C} --vocab-size 300 --no-progress --out {W}/tok",
        "{C}: permission denied",
        prep=_corpus_dir(0o600),
        prog="tokenize.py",
        absent=("{W}/tok",),
        marks=NEEDS_SETPRIV,
    ),
    Row(
        "e_corpus_dir_without_read_permission",
        AS_A_USER + "{PY} tokenize.py train --corpus {C} --vocab-size 300 --no-progress --out {W}/tok",
        "{C}: cannot list the corpus directory (Permission denied)",
        prep=_corpus_dir(0o300),
        prog="tokenize.py",
        absent=("{W}/tok",),
        marks=NEEDS_SETPRIV,
    ),
    Row(  # the export shipped the edited tokenizer beside weights trained on the other one's ids (audit 5)
        "d4_tokenizer_edited_during_train",
        "python train.py --phase 2 --preset tiny --tokenizer {X} --data {S} --steps 100 --seq-len 32 "
        "--global-batch 2 --eval-batches 1 --log-every 1 --out {W}/out",
        "{X}/tokenizer.json changed since this run read it",
        prep=tokenizer_copy,
        after="step=1 ",
        during=add_a_token,
        changes=("{X}", "{W}/out"),
        absent=("{W}/out/model.safetensors", "{W}/out/tokenizer.json"),
    ),
    Row(
        "d4_tokenizer_edited_during_finetune",
        "python finetune.py --model {X} --data {CHAT} --steps 60 --lora-r 2 --global-batch 2 --log-every 1 "
        "--out {W}/out",
        "{X}/tokenizer.json changed since this run read it",
        prep=base_copy,
        after="step=1 ",
        during=add_a_token,
        changes=("{X}", "{W}/out"),
        absent=("{W}/out/adapter_model.safetensors", "{W}/out/tokenizer.json"),
    ),
    Row(  # the resume took the adapter trained on the old tokenizer's ids as this run's (audit 5)
        "d4_finetune_resume_with_the_bases_tokenizer_edited",
        FT.replace("--steps 1", "--steps 2").replace("{M}", "{X}") + " --out {W}/out",
        "holds an earlier `finetune.py`'s output from other inputs",
        prep=adapter_then_new_base_tokenizer,
    ),
    Row(  # torch's import died on it with a oneMKL "FATAL" line
        "e_working_directory_removed",
        """sh -c 'mkdir "$0" && cd "$0" && rmdir "$0" && exec "$@"' {W}/gone {PY} {R}/train.py --phase 2 """
        "--tokenizer {T} --data {S} --out {W}/new",
        "the working directory no longer exists",
        prep=removed_cwd,
        prog="train.py",
        absent=("{W}/new", "{W}/gone"),
    ),
]


# ---------------------------------------------------------------- running the rows


def _run(cmd: str, runner: Prefork, **paths) -> None:
    argv = _argv(cmd.format(**paths))
    p = runner.run(argv, ROOT, _clean_env(), ROW_TIMEOUT)
    assert p.returncode == 0, f"fixture failed: {shlex.join(argv)}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"


@pytest.fixture(scope="module")
def runner():
    """What runs the rows' `python X.py` commands without the environment of their own: forks of a server that
    imported torch once (tests/prefork.py, as test_bad_inputs.py's rows); the others run as subprocesses."""
    server = Prefork(_clean_env())
    yield server
    server.close()


@pytest.fixture(scope="module")
def fx(tmp_path_factory, runner) -> dict:
    """T: a 400-id tokenizer (kde); S: its shards; M: a finished 2-step tiny model; A: a finished 1-step adapter;
    and the runner, which the rows' preps run their commands with too."""
    d = str(tmp_path_factory.mktemp("nothing_lost_fx"))
    p = {k: os.path.join(d, k) for k in ("T", "S", "M", "A")} | {"CHAT": CHAT}
    _run(f"python tokenize.py train --no-progress --vocab-size 400 --corpus {KDE} --out {{T}}", runner, **p)
    enc = f"python tokenize.py encode --no-progress --tokenizer {{T}} --corpus {KDE} --val-fraction 0.05 --out {{S}}"
    _run(enc, runner, **p)
    _run(TR + " --out {M}", runner, **p)
    _run(FT + " --out {A}", runner, **p)
    return p | {"runner": runner}


def run_row(row: Row, fx: dict, base: str, runner: Prefork) -> Result:
    w = os.path.join(base, row.id)
    os.makedirs(w)
    paths = {**fx, "W": w}
    if row.prep:
        paths.update(row.prep(fx, w))
    argv = _argv(row.cmd.format(**paths))
    env = {k: v.replace("{W}", w) for k, v in row.env.items()}  # a row's own dir in a variable (SM_MODEL_DIR)
    r = Result(row, paths, argv)
    r.before = tree(w)
    act = None  # what a signalled row does once its stdout holds row.after: send the signal, or change an input
    if row.signal or row.during:
        act = (lambda pid: row.during(paths)) if row.during else (lambda pid: os.kill(pid, row.signal))
    try:  # a fork where the row is `python X.py` with no environment of its own, else a subprocess
        p = runner.run(argv, ROOT, {**_clean_env(), **env}, ROW_TIMEOUT, row.after, act)
        r.rc, r.stdout, r.stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        r.rc, r.stdout, r.stderr = None, e.stdout, f"{e.stderr}\n(timed out)"  # prefork's TimedOut: str, not bytes
    r.after = tree(w)
    return r


@pytest.fixture(scope="module")
def results(request, fx, tmp_path_factory, runner) -> dict[str, Result]:
    wanted = {
        i.callspec.params["row"].id
        for i in request.session.items
        if hasattr(i, "callspec") and "row" in i.callspec.params
    }
    before = tree(os.path.dirname(fx["T"]))
    base = str(tmp_path_factory.mktemp("nothing_lost_rows"))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {r.id: pool.submit(run_row, r, fx, base, runner) for r in ROWS if r.id in wanted}
        out = {k: f.result() for k, f in futures.items()}
    assert tree(os.path.dirname(fx["T"])) == before, "a row changed the shared fixtures (data loss)"
    return out


@pytest.mark.parametrize("row", [pytest.param(r, marks=r.marks) for r in ROWS], ids=[r.id for r in ROWS])
def test_nothing_lost(row: Row, results):
    check_row(row, results[row.id])


def check_row(row: Row, r: Result) -> None:
    fmt = lambda s: s.format(**r.paths)  # noqa: E731
    assert r.rc == row.code, f"exit code {r.rc}, expected {row.code}" + r.explain()
    assert "Traceback" not in r.stderr + r.stdout and not own_tracebacks(r.stderr), "a traceback" + r.explain()
    prog = row.prog or next(w for w in shlex.split(row.cmd) if w.endswith(".py"))
    errors = [ln for ln in r.stderr.splitlines() if re.match(re.escape(prog) + r"( [a-z]+)?: error: ", ln)]
    if row.code in (0, -signal.SIGKILL):
        assert not errors, "an error line from a run that must succeed, or that was killed" + r.explain()
    else:
        assert len(errors) == 1, f"{len(errors)} error lines, expected one" + r.explain()
        assert fmt(row.fragment) in errors[0], f"{fmt(row.fragment)!r} not in the error line" + r.explain()
    w = r.paths["W"]
    allowed = [os.path.relpath(fmt(c), w) for c in row.changes]

    def keep(t: dict) -> dict:
        return {k: v for k, v in t.items() if not any(k == a or k.startswith(a + os.sep) for a in allowed)}

    before, after = keep(r.before), keep(r.after)
    assert after == before, "a file that existed changed or went, or a file appeared (data loss)" + r.explain()
    for p in row.absent:
        assert not os.path.lexists(os.path.join(ROOT, fmt(p))), f"{fmt(p)} exists: the command wrote it" + r.explain()
    if row.check:
        row.check(r)


def a_place_to_fill(fx, w):
    os.makedirs(os.path.join(w, "full"))
    return {"PY": sys.executable}


# --out lies on a 256 KiB tmpfs, mounted in a mount namespace of the command's own (as tests/test_ownership.py's
# full-disk test does): the metrics fit, the weights of the export do not.
FULL_DISK = Row(
    "f8_full_disk_at_export",
    """unshare -m sh -c 'mount -t tmpfs -o size=256k tmpfs "$0" && exec "$@"' {W}/full {PY} """
    + TR.removeprefix("python ")
    + " --checkpoint-dir {W}/ckpt --out {W}/full/model",
    "{W}/full/model: cannot write the output (No space left on device; ",  # not safetensors' "(os error 28)"
    prep=a_place_to_fill,
    changes=("{W}/ckpt",),
)


@pytest.mark.skipif(not _tmpfs_works(), reason="needs root and `unshare -m` to mount a small tmpfs")
def test_a_full_disk_at_export_is_one_line_naming_the_path_and_the_free_space(fx, tmp_path):
    r = run_row(FULL_DISK, fx, str(tmp_path), fx["runner"])
    check_row(FULL_DISK, r)
    assert re.search(r"; [\d.]+ [KMG]i?B free there\)$", r.stderr.strip().splitlines()[-1]), r.explain()


# ---------------------------------------------------------------- in-process: where no CLI path is under test


def test_a_model_changed_in_the_middle_is_another_model(tmp_path):
    """4: the fingerprint reads every byte (it read only the first and last MiB: a change between them was missed)."""
    import torch
    from safetensors.torch import save_file

    from minilm_az.hf import model_fingerprint

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file({"w": torch.zeros(3 << 18)}, str(d / "model.safetensors"))  # 3 MiB
    before = model_fingerprint(str(d))
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(os.path.getsize(d / "model.safetensors") // 2)
        f.write(b"\x01")
    assert model_fingerprint(str(d)) != before


def test_a_demo_rerun_keeps_what_a_person_put_in_its_dir_and_logs(tmp_path):
    """2 and 7: a rerun removes the files demo.json lists, never a folder's other files."""
    from demo import run as demo

    run = tmp_path / "demo"
    (run / "logs").mkdir(parents=True)
    (run / "phase2").mkdir()
    for name in ("logs/01_clean.log", "phase2/model.safetensors", "logs/mine.txt", "phase2/notes.md"):
        (run / name).write_text(name)
    files = ["logs/01_clean.log", "phase2/model.safetensors", demo.MARKER]
    (run / demo.MARKER).write_text(json.dumps({"files": files}))
    demo.prepare_run_dir(str(run))
    assert sorted(os.listdir(run / "logs")) == ["mine.txt"] and os.listdir(run / "phase2") == ["notes.md"]


def test_a_second_demo_of_the_same_name_is_refused_and_ctrl_c_is_one_line(tmp_path, monkeypatch, capsys):
    """7: one lock per run name; Ctrl-C ends the demo with one line and exit 130."""
    from demo import run as demo

    run = tmp_path / "demo"
    run.mkdir()
    lock = run / ".minilm-az.lock.sagemaker-ignore"
    holder = f"import fcntl, time; f = open({str(lock)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True)"
    proc = subprocess.Popen([sys.executable, "-c", holder + "; time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()
        with pytest.raises(SystemExit, match="another run is writing there now"):
            demo.run_demo("demo", demo.QUICK, str(tmp_path), baseline=KDE)
    finally:
        proc.kill()
        proc.wait()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", interrupted)
    assert demo.main(["--runs-dir", str(tmp_path), "--name", "other"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["demo: interrupted; a rerun of --name other starts over"]


def test_sagemaker_defaults_fill_only_what_the_command_line_left_out(monkeypatch):
    """Family 6: an explicit value equal to a field's default is still explicit (--checkpoint-minutes 0 stays 0), and
    without a job's model dir (SageMaker's variables on a laptop) no checkpoint goes to the container's path."""
    from minilm_az.config import CONTAINER_CHECKPOINTS, TrainConfig
    from minilm_az.launch.flags import make_parser, parse_config

    def parse(*argv):
        return parse_config(TrainConfig, make_parser(TrainConfig, "train.py", "x"), list(argv), here=False)

    monkeypatch.setenv("SM_TRAINING_ENV", "{}")
    monkeypatch.delenv("SM_MODEL_DIR", raising=False)
    cfg = parse("--checkpoint-minutes", "0")
    assert cfg.checkpoint_minutes == 0 and cfg.checkpoint_dir is None and cfg.out is None
    assert parse().checkpoint_minutes == 30.0  # not given: the SageMaker clock
    monkeypatch.setenv("SM_MODEL_DIR", "/opt/ml/model")
    cfg = parse()
    assert cfg.out == "/opt/ml/model" and cfg.checkpoint_dir == CONTAINER_CHECKPOINTS
    assert parse("--out", "/data/mine").checkpoint_dir is None  # an --out of the user's own keeps them beside it
    assert parse("--out", "/opt/ml/model/").checkpoint_dir == CONTAINER_CHECKPOINTS  # the job's, spelled otherwise
