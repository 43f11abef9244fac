"""README.md stays true: its "try every stage on CPU" block runs as written (on a quick demo's outputs), every
`file:function` stop of its reading guide exists, and the guide's line counts are true and within the budget."""

import ast
import os
import re
import subprocess
import sys

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
TOLERANCE = 0.10  # how far a stated count may be from the true one


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


@pytest.mark.slow
def test_the_cpu_block_runs_as_written_on_a_demo_run_with_a_core_install(quick_demo, tmp_path, core_install):
    # The block names runs/demo (what `make demo` leaves) and writes runs/try: here a quick demo and a tmp dir.
    script = cpu_block().replace("runs/demo/", quick_demo + "/").replace("runs/try/", str(tmp_path) + "/")
    assert "runs/" not in script
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]  # `python`: this interpreter (a venv's)
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": path, "PYTHONPATH": core_install},  # no prep extra
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "fertility" in r.stdout or "tokens_per_word" in r.stdout
    assert re.search(r"^eval step=0 val_loss=\S+ val_bpb=\S+", r.stdout, re.M)  # --eval-only's line
    assert os.path.isfile(tmp_path / "phase2" / "model.safetensors")
    assert os.path.isfile(tmp_path / "sft" / "adapter_model.safetensors")
    assert r.stdout.strip().splitlines()[-1].strip()  # --prompt printed a reply


def test_the_demo_durations_are_one_set_in_readme_makefile_and_help():
    from demo.run import DURATIONS

    full, quick = re.findall(r"(\S+ min)", DURATIONS)
    makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    for text, where in ((README, "README.md"), (makefile, "Makefile")):
        assert full in text and quick in text, f"{where} does not say {full!r} and {quick!r} as --help does"


if __name__ == "__main__":  # the true numbers of each row of the reading guide's table, and their totals
    sums = {"lines": 0, "read": 0, "min": 0}
    for row in guide_table()[0]:
        true = true_counts(row["stops"])
        sums = {k: sums[k] + true[k] for k in sums}
        print(f"{row['stops'][0][0]:28} | {true['lines']} | {true['read']} | {true['min']} |")
    print(f"{'total':28} | **{sums['lines']:,}** | **{sums['read']:,}** | **{sums['min']}** |")
