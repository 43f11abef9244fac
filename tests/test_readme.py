"""README.md stays true: its "try every stage on CPU" block runs as written (on a quick demo's outputs), and
every `file:function` stop of its reading guide exists."""

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
    names = set()
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{m.name}" for m in node.body if isinstance(m, ast.FunctionDef)}
    return names


def test_every_reading_guide_stop_names_a_function_that_exists():
    guide = README.split("## Reading guide")[1].split("\n## ")[0]
    stops = re.findall(r"`((?:minilm_az/)?[\w/]+\.py):([\w.]+)`", guide)
    assert len(stops) >= 15
    for path, name in stops:
        full = path if os.path.isfile(os.path.join(ROOT, path)) else os.path.join("minilm_az", path)
        assert os.path.isfile(os.path.join(ROOT, full)), path
        assert name in defined_names(os.path.join(ROOT, full)), f"{path}:{name}"


@pytest.mark.slow
def test_the_cpu_block_runs_as_written_on_a_demo_run(quick_demo, tmp_path):
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
        env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": path},
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
