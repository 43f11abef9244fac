"""README.md stays true: its "try every stage on CPU" block runs as written (on a quick demo's outputs), every
`file:function` stop of its reading guide exists, and the guide's line counts are true and within the budget."""

import ast
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def cpu_block() -> str:
    block = README.split("<!-- cpu-block:begin -->")[1].split("<!-- cpu-block:end -->")[0]
    return block.strip().removeprefix("```bash").removesuffix("```").strip()


def defined_names(path: str) -> set[str]:
    """Top-level functions and classes of a file, and Class.method for their methods."""
    return set(line_spans(path))


def line_spans(path: str) -> dict[str, int]:
    """Lines of each top-level function and class of a file, and of each Class.method, decorators included."""
    spans = {}

    def span(node: ast.AST) -> int:
        first = min([d.lineno for d in node.decorator_list] + [node.lineno])
        return node.end_lineno - first + 1

    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            spans[node.name] = span(node)
        if isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, ast.FunctionDef):
                    spans[f"{node.name}.{m.name}"] = span(m)
    return spans


# The reading guide is a table. Each row is one file: its `file:function` stops, what happens there, the
# file's size ("lines", as `wc -l` counts it), the lines of its stops ("read") and the minutes they take.
# When code moves, run `python tests/test_readme.py`: it prints every row's true numbers to paste in.
READING_PACE = 15  # lines a minute, the pace the guide states
READING_BUDGET = 1300  # lines to read from raw text to a loss value (issue 30)
TOLERANCE = 0  # how far a stated count may be from the true one: none (python tests/test_readme.py prints them)


def reading_guide() -> str:
    return README.split("## Reading guide")[1].split("\n## ")[0]


def guide_stops(text: str) -> list[tuple[str, str]]:
    """Every `path:Name` in backticks, the path as the repo root or minilm_az/ sees it."""
    stops = re.findall(r"`((?:minilm_az/)?[\w/]+\.py):([\w.]+)`", text)
    return [
        (path if os.path.isfile(os.path.join(ROOT, path)) else os.path.join("minilm_az", path), name)
        for path, name in stops
    ]


def number(cell: str) -> int:
    return int(cell.strip("* ").replace(",", ""))


def guide_table() -> tuple[list[dict], dict]:
    """The table's rows (stops, and the lines, read and min they state) and its total row."""
    rows, total = [], None
    for line in reading_guide().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6:
            continue
        numbers = {"lines": cells[3], "read": cells[4], "min": cells[5]}
        if cells[0].isdigit():
            rows.append({"stops": guide_stops(cells[1]), **{k: number(v) for k, v in numbers.items()}})
        elif "total" in cells[1]:
            total = {k: number(v) for k, v in numbers.items()}
    return rows, total


def true_counts(stops: list[tuple[str, str]]) -> dict:
    """What a row should state: its file's `wc -l`, the lines of its stops, and minutes at READING_PACE."""
    path = os.path.join(ROOT, stops[0][0])
    spans = line_spans(path)
    read = sum(spans[name] for _, name in stops)
    lines = open(path, encoding="utf-8").read().count("\n")
    return {"lines": lines, "read": read, "min": round(read / READING_PACE)}


def test_every_reading_guide_stop_names_a_function_that_exists():
    stops = guide_stops(reading_guide())
    assert len(stops) >= 15
    for path, name in stops:
        assert os.path.isfile(os.path.join(ROOT, path)), path
        assert name in defined_names(os.path.join(ROOT, path)), f"{path}:{name}"


def test_the_reading_guide_states_true_line_counts_within_the_budget():
    rows, total = guide_table()
    assert len(rows) >= 5 and total, "the reading guide has no table of | # | stops | what | lines | read | min |"
    wrong = []
    for row in rows:
        files = {path for path, _ in row["stops"]}
        assert len(files) == 1, f"one file a row, not {sorted(files)}"
        true = true_counts(row["stops"])
        close = all(abs(row[key] - true[key]) <= TOLERANCE * true[key] for key in ("lines", "read"))
        close = close and abs(row["min"] - true["read"] / READING_PACE) <= max(1, TOLERANCE * true["min"])
        if not close:
            stated = {key: row[key] for key in true}
            wrong.append(f"{files.pop()}: states {stated}, true {true}")
    assert not wrong, "update the reading guide's table (python tests/test_readme.py prints it):\n" + "\n".join(wrong)
    for key in ("lines", "read", "min"):
        assert total[key] == sum(row[key] for row in rows), f"the total row's {key} is not the sum of the rows"
    assert total["read"] <= READING_BUDGET, f"the path reads {total['read']} lines, over {READING_BUDGET}"


def clone_after_make_demo(where, demo_run: str):
    """A directory laid out as the block expects in a clone after `make demo`: copies of the root scripts, the
    engine and data/, `.venv` (this interpreter's environment, as `make` would have made it) and `runs/demo`
    (a quick demo's outputs). The block then runs verbatim, and whatever it writes lands in this copy."""
    for name in ("tokenize.py", "train.py", "finetune.py"):
        shutil.copy2(os.path.join(ROOT, name), where / name)
    for name in ("minilm_az", "data"):
        shutil.copytree(os.path.join(ROOT, name), where / name, ignore=shutil.ignore_patterns("__pycache__"))
    if sys.prefix != sys.base_prefix:  # a venv: link its root, so that its pyvenv.cfg is found beside bin/python
        (where / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    else:  # an interpreter of its own (make's PYTHON=python): link it where the block looks for it
        (where / ".venv" / "bin").mkdir(parents=True)
        (where / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (where / "runs").mkdir()
    (where / "runs" / "demo").symlink_to(demo_run, target_is_directory=True)


def fresh_shell_env(where, core_install: str) -> dict:
    """The environment of a new terminal: no venv activated and none on PATH. A bare `python`, `python3`, `pip`
    or `torchrun` is a stub that fails, so the block cannot lean on whatever the machine has installed."""
    venv_bins = {os.path.dirname(sys.executable), os.path.join(sys.prefix, "bin")}
    stubs = where / "no-venv-bin"
    stubs.mkdir()
    for name in ("python", "python3", "pip", "torchrun"):
        (stubs / name).write_text(
            f"#!/bin/sh\necho 'the block called a bare {name}: not in a fresh shell' >&2\nexit 127\n"
        )
        (stubs / name).chmod(0o755)
    path = [str(stubs)] + [d for d in os.environ["PATH"].split(os.pathsep) if d and d not in venv_bins]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "CONDA_PREFIX")}
    # OMP_NUM_THREADS as the suite runs everything; PYTHONPATH makes the interpreter a core install (no prep
    # extra), as the README says the block needs only the core.
    return {**env, "PATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", "PYTHONPATH": core_install}


@pytest.mark.slow
def test_the_cpu_block_runs_as_written_twice_in_a_fresh_shell_with_a_core_install(quick_demo, tmp_path, core_install):
    # The block as a user pastes it into a new terminal in a clone, after `make demo`, and then once more: the
    # second run must work too (the block overwrites its shards and retrains instead of stopping at what the
    # first run left). It runs in a copy of the checkout, so nothing it writes can land in the real one.
    script = cpu_block()
    assert re.search(r"(^|[\s;&|(])(python3?|pip|torchrun) ", script) is None, "the block calls a bare interpreter"
    clone = tmp_path / "clone"
    clone.mkdir()
    clone_after_make_demo(clone, quick_demo)
    before = sorted(os.listdir(clone))
    env = fresh_shell_env(tmp_path, core_install)
    # The README's "about N s on 2 idle cores" is a measurement (49-52 s, 2026-12-07); under the suite the other
    # worker's load makes it ~75 s, so only a run over 3x the figure says the sentence (or the block) is stale.
    said = re.search(r"It takes about (\d+) s on 2 idle cores", re.sub(r"\s+", " ", README))
    assert said, "the README no longer says how long the CPU block takes"
    for attempt in ("first", "second"):
        t0 = time.monotonic()
        r = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], cwd=clone, capture_output=True, text=True, timeout=900, env=env
        )
        took = time.monotonic() - t0
        where = f"the {attempt} run of the block"
        assert r.returncode == 0, f"{where} failed:\n" + r.stdout[-3000:] + r.stderr[-3000:]
        assert took <= 3 * int(said[1]), f"{where} took {took:.0f} s; the README says about {said[1]} s"
        assert "fertility" in r.stdout or "tokens_per_word" in r.stdout, where
        assert re.search(r"^train step=5 ", r.stdout, re.M), f"{where}: phase 1 did not train its 5 steps"
        assert re.search(r"^eval step=0 val_loss=\S+ val_bpb=\S+", r.stdout, re.M), where  # --eval-only's line
        assert os.path.isfile(clone / "runs" / "try" / "phase2" / "model.safetensors"), where
        assert os.path.isfile(clone / "runs" / "try" / "sft" / "adapter_model.safetensors"), where
        assert r.stdout.strip().splitlines()[-1].strip(), f"{where}: --prompt printed no reply"
    # Everything the block wrote is under runs/try: nothing in the copy's root and nothing in runs/ beside it
    # (__pycache__ aside: importing tokenize.py as the `tokenize` module caches it, as in any checkout).
    assert sorted(set(os.listdir(clone)) - {"__pycache__"}) == before
    assert sorted(os.listdir(clone / "runs")) == ["demo", "try"]


def test_the_demo_durations_are_one_set_in_readme_makefile_docs_and_help():
    from demo.run import DURATIONS

    full, quick = re.findall(r"(\S+ min)", DURATIONS)
    makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    guide = open(os.path.join(ROOT, "docs", "demo.md"), encoding="utf-8").read()
    for text, where in ((README, "README.md"), (makefile, "Makefile"), (guide, "docs/demo.md")):
        assert full in text and quick in text, f"{where} does not say {full!r} and {quick!r} as --help does"


def test_the_demo_checks_its_measured_figures_against_the_readme_and_the_check_can_fail():
    from demo.run import readme_drift

    figures = r"BPB ([\d.]+) \(the base stand-in\) → ([\d.]+) \(phase 1\) → ([\d.]+)\s+\(phase 2\), and ([\d.]+)"
    said = re.search(figures, README)
    span = re.search(r"`make demo` takes\s+(\d+)-(\d+) min on 2 CPU cores", README)
    assert said and span, "the README no longer states the demo's figures where `make demo` reads them"
    stated = dict(zip(("base", "phase1", "phase2", "control"), map(float, said.groups())))
    inside = (int(span[1]) + int(span[2])) / 2
    (line,) = readme_drift(README, stated, inside, 2)
    assert line.startswith("README: val BPB within ±") and "differs" not in line, line
    off = {**stated, "phase2": stated["phase2"] + 0.05}
    (line,) = readme_drift(README, off, inside, 2)
    assert "phase2 val BPB" in line and "differs" in line, line
    assert any("differs" in x and "min" in x for x in readme_drift(README, stated, int(span[2]) + 3, 2))
    assert any("not compared" in x for x in readme_drift(README, stated, inside, 16))
    assert "differs" in readme_drift("a README without the sentences", stated, inside, 2)[0]


if __name__ == "__main__":  # the true numbers of each row of the reading guide's table, and their totals
    sums = {"lines": 0, "read": 0, "min": 0}
    for row in guide_table()[0]:
        true = true_counts(row["stops"])
        sums = {k: sums[k] + true[k] for k in sums}
        print(f"{row['stops'][0][0]:28} | {true['lines']} | {true['read']} | {true['min']} |")
    print(f"{'total':28} | **{sums['lines']:,}** | **{sums['read']:,}** | **{sums['min']}** |")
