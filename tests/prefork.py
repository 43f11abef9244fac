"""Run `python SCRIPT ARGS...` as a fresh interpreter would, in a fork of one that imported torch once.

A command's own process, exit code, stdout and stderr are what `subprocess.run` gives, while the ~1.3 s of CPU
that `import torch` costs each new interpreter is paid once: tests that run dozens of short commands of the root
scripts (tests/test_bad_inputs.py's rows) spend most of their time there otherwise.

The server (this file, run as a script with the environment the commands get) imports what the root scripts
import at their top, then forks one child per request; the child takes the request's directory, environment,
argv, sys.path[0] and file descriptors 0-2, and runs the script as `__main__` with runpy, so that its exit (an
exit code, an uncaught exception's traceback, a signal) is that of `python SCRIPT`. Only plain `python X.py`
commands go this way; `-m`, torchrun and anything else run as subprocesses (`Prefork.forks` says which).
`start()` forks a command and returns at once (pid, poll, wait: a test may kill it); `run(..., after, act)`
calls `act(pid)` once the command's stdout holds `after` (a signal mid-run, an input changed). The ranks of a
torchrun-style job fork from one server: their environments differ only in RANK_VARS, which no import reads (nor
the RUNTIME_PREFIXES variables: a command given SM_MODEL_DIR forks from the server of one without it).
`run_ranks()` runs such a job to its end, as `torchrun --standalone` would without its agent. A test's own script
(not a root script) forks too where its caller says so (`any_script`): it must import only this checkout's modules.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import gc
import importlib
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("tokenize.py", "train.py", "finetune.py")
# A process's place in a torchrun-style job: no import reads these, so the ranks of one job (and of the next) fork
# from one server, each with its own values.
RANK_VARS = frozenset(
    "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID "
    "SM_CURRENT_HOST".split()
)
# Read only when a command runs, never by an import (this checkout's modules read the environment inside functions;
# torch's imports read its own TORCH_*, OMP_* and the like): SageMaker's, this project's and AWS's variables. A
# command whose environment adds or changes only these forks from the same server as one without them.
RUNTIME_PREFIXES = ("SM_", "MINILM_AZ_", "AWS_")


# The environment of a plain `python X.py` on this machine, taken when the suite starts (before any fixture sets
# moto's AWS variables): nothing from a SageMaker or torchrun environment of the caller (it would change train.py's
# defaults under test), one thread a process (the suite runs several at once). The modules that use it share one
# server a worker.
PLAIN_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith("SM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
} | {"OMP_NUM_THREADS": "1"}

# Modules a training run imports lazily (FSDP2 and DCP bring torch._dynamo along): ~1.1 s of CPU in every rank of
# every run, paid once in the server instead.
PRELOAD = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.tensor")


def server_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in RANK_VARS and not k.startswith(RUNTIME_PREFIXES)}


def top_level_imports() -> list[str]:
    """The modules the root scripts import at their top (the scripts change; their imports are read, not listed)."""
    names = ["numpy", "torch"]
    for script in SCRIPTS:
        with open(os.path.join(ROOT, script), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
                names.append(node.module)
                names += [f"{node.module}.{a.name}" for a in node.names]  # `from pkg import module`
    return list(dict.fromkeys(names))


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# ---------------------------------------------------------------- the server (the process that forks)


def child(req: dict, server_fds: tuple[int, ...]) -> None:
    """In the fork: become `python SCRIPT ARGS` and run it; an exit or an exception ends the interpreter as usual."""
    signal.set_wakeup_fd(-1)
    for fd in server_fds:  # the server's pipes: a command must not hold them open
        os.close(fd)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    for fd, path, mode in (
        (0, os.devnull, os.O_RDONLY),
        (1, req["stdout"], os.O_WRONLY | os.O_APPEND),  # append: stdout and stderr may be one file
        (2, req["stderr"], os.O_WRONLY | os.O_APPEND),
    ):
        new = os.open(path, mode)
        os.dup2(new, fd)
        os.close(new)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    script, *args = req["argv"]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
    import runpy

    runpy.run_path(script, run_name="__main__")


def serve() -> None:
    sys.path[0] = ROOT  # as for `python ROOT/X.py`: minilm_az from this checkout
    for name in [*top_level_imports(), *PRELOAD]:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a name imported from a module (a function), or a module the script brings itself
    gc.freeze()  # the children's collections leave these objects (and their pages) alone: no copy on write
    own = resource.getrusage(resource.RUSAGE_SELF)  # fork copies one thread: there must be only one
    ready = {"ready": os_threads() == 1, "threads": os_threads(), "cpu": own.ru_utime + own.ru_stime}
    out_fd = os.dup(1)
    out = os.fdopen(out_fd, "w", buffering=1, closefd=False)
    out.write(json.dumps(ready) + "\n")
    if not ready["ready"]:
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    pending = b""
    while True:
        try:
            readable, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status, usage = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                cpu = usage.ru_utime + usage.ru_stime  # the command's and its children's
                out.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status), "cpu": cpu}) + "\n")
        if 0 in readable:
            data = os.read(0, 65536)
            if not data:
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(req, (out_fd, wake_r, wake_w))
                    sys.exit(0)
                out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")


# ---------------------------------------------------------------- the client (the test process)


def python_script(argv: list[str]) -> bool:
    """`python X.py ...` with this interpreter: a command the server can run (whose imports are its caller's say)."""
    return len(argv) > 1 and argv[0] == sys.executable and argv[1].endswith(".py") and not argv[1].startswith("-")


def root_script(argv: list[str], cwd: str) -> bool:
    """`python X.py ...`, X.py a root script of this checkout: the modules it imports are this checkout's, as the
    server's are (a copy of the checkout elsewhere would import its own: that runs as a subprocess)."""
    return (
        len(argv) > 1
        and argv[0] == sys.executable
        and os.path.basename(argv[1]) in SCRIPTS
        and os.path.dirname(os.path.abspath(os.path.join(cwd, argv[1]))) == ROOT
    )


Act = Callable[[int], None]  # what a test does to a running command, given its pid
_CPU = [0.0]  # CPU seconds of the servers' imports and of the commands that ended, as the servers report them
_CPU_LOCK = threading.Lock()


def cpu_seconds() -> float:
    """user + sys of the forked commands that ended and of the servers' start, in this process: a server's
    children count in RUSAGE_CHILDREN only once the server ends."""
    with _CPU_LOCK:
        return _CPU[0]


def _add_cpu(seconds: float) -> None:
    with _CPU_LOCK:
        _CPU[0] += seconds


@dataclasses.dataclass
class _Job:
    """A forked command, as much of subprocess.Popen as the tests use: pid, poll(), wait()."""

    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    pid: int | None = None
    code: int | None = None
    returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self.code if self.event.is_set() else None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.event.wait(timeout):
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self.poll()


class Prefork:
    """`run(argv, cwd, env, timeout)` -> subprocess.CompletedProcess, thread-safe; `env` must be the one the server
    was started with (imports read some variables, OMP_NUM_THREADS among them), else the command runs as a
    subprocess. `close()` ends the server."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.lock = threading.Lock()
        self.jobs: dict[int, _Job] = {}
        self.by_pid: dict[int, _Job] = {}
        self.early: dict[int, int] = {}  # pid -> code, for an exit read before its pid was
        self.next_id = 0
        self.reported = 0.0  # CPU seconds this server reported, counted in cpu_seconds() until it ends
        self.server = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = json.loads(self.server.stdout.readline() or '{"ready": false}')
        self.ready = hello["ready"]
        self._count(hello.get("cpu", 0.0))
        if self.ready:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.server.stdout:
            msg = json.loads(line)
            self._count(msg.get("cpu", 0.0))
            with self.lock:
                if "id" in msg:
                    job = self.jobs.pop(msg["id"])
                    job.pid = msg["pid"]
                    if job.pid in self.early:
                        job.code = self.early.pop(job.pid)
                        job.event.set()
                    else:
                        self.by_pid[job.pid] = job
                elif msg["pid"] in self.by_pid:
                    job = self.by_pid.pop(msg["pid"])
                    job.code = msg["code"]
                    job.event.set()
                else:
                    self.early[msg["pid"]] = msg["code"]

    def forks(self, argv: list[str], cwd: str, env: dict, any_script: bool = False) -> bool:
        """Whether `argv` runs as a fork: a root script's command (or with `any_script`, any `python X.py`) with the
        server's environment (but its rank)."""
        script = root_script(argv, cwd) or (any_script and python_script(argv))
        return self.ready and server_env(env) == self.env and script

    def start(self, argv: list[str], cwd: str, env: dict, out: str, err: str) -> _Job:
        """Fork `argv` (self.forks must hold), its stdout and stderr appended to the files `out` and `err`."""
        for path in (out, err):
            open(path, "a").close()
        job = _Job()
        with self.lock:
            self.next_id += 1
            self.jobs[self.next_id] = job
            req = dict(id=self.next_id, argv=argv[1:], cwd=cwd, env=env, stdout=out, stderr=err)
            self.server.stdin.write(json.dumps(req) + "\n")
            self.server.stdin.flush()
        while job.pid is None and not job.event.is_set():  # its pid comes back at once: a kill may follow
            time.sleep(0.001)
        return job

    def run(
        self, argv: list[str], cwd: str, env: dict, timeout: float, after: str = "", act: Act | None = None
    ) -> subprocess.CompletedProcess:
        """`argv` to its end (a fork where self.forks holds, else a subprocess); with `act`, `act(pid)` is called
        once the command's stdout holds the text `after` (see `_follow`)."""
        if not self.forks(argv, cwd, env):
            return _subprocess_run(argv, cwd, env, timeout, after, act)
        with tempfile.TemporaryDirectory(prefix="prefork-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            return _follow(argv, self.start(argv, cwd, env, out, err), out, err, timeout, after, act)

    def _count(self, seconds: float) -> None:
        self.reported += seconds
        _add_cpu(seconds)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)
        # Once reaped, the server's CPU and its children's (the forks, which it reaped) are in RUSAGE_CHILDREN:
        # what it reported comes out of cpu_seconds(), else the suite's table would count the forks twice.
        _add_cpu(-self.reported)


_SERVERS: dict[tuple, Prefork] = {}
_SERVERS_LOCK = threading.Lock()


def _server(env: dict) -> Prefork:
    """The server for `env` (its rank variables aside), started on first use and shared by every test of this
    process (the conftest ends them with the session)."""
    base = server_env(env)
    key = tuple(sorted(base.items()))
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            _SERVERS[key] = Prefork(base)
        return _SERVERS[key]


class TimedOut(subprocess.TimeoutExpired):
    """subprocess.TimeoutExpired (str stdout and stderr) whose message ends with the command's last output, so that
    a test that lets it through still says where the command hung."""

    def __str__(self) -> str:
        tails = f"--- stdout (tail)\n{self.stdout[-2000:]}\n--- stderr (tail)\n{self.stderr[-3000:]}"
        return f"{super().__str__()}\n{tails}"


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _follow(
    argv: list[str], job: _Job | subprocess.Popen, out: str, err: str, timeout: float, after: str, act: Act | None
) -> subprocess.CompletedProcess:
    """Wait for `job`, which writes to the files `out` and `err`, and read them. With `act`, read stdout as it grows
    and call `act(pid)` once it holds `after` (a test sends a signal, or changes an input mid-run), unless the job
    ended first. Past the timeout the job is killed and TimedOut raised, as subprocess.run raises TimeoutExpired;
    so is it when `act` (or anything here) raises, so that no command outlives its caller."""
    assert act is None or after, "act needs the text to wait for"

    def read(p):
        with open(p, encoding="utf-8", errors="replace") as f:
            return f.read()

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended just now
            os.kill(job.pid, signal.SIGKILL)
        job.wait(30)

    deadline = time.monotonic() + timeout
    try:
        if act is not None:
            with open(out, encoding="utf-8", errors="replace") as f:
                seen = ""
                while time.monotonic() < deadline:
                    ended = job.poll() is not None
                    seen += f.read()
                    if after in seen and not ended:
                        with contextlib.suppress(ProcessLookupError):  # it ended just now: as Popen.send_signal
                            act(job.pid)
                    if after in seen or ended:
                        break
                    time.sleep(0.005)
        code = job.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill()
        raise TimedOut(argv, timeout, read(out), read(err)) from None
    except BaseException:
        kill()
        raise
    return subprocess.CompletedProcess(argv, code, read(out), read(err))


def _default_sigint() -> None:
    """In a subprocess that a test signals: SIGINT's default action (Python's KeyboardInterrupt, as at a terminal),
    even where the test runs in a shell's background job, which ignores it (Prefork's children get it too)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _subprocess_run(
    argv: list[str], cwd: str, env: dict, timeout: float, after: str = "", act: Act | None = None
) -> subprocess.CompletedProcess:
    """`run` for a command that does not fork: subprocess.run, or with `act` a Popen followed as a fork is."""
    if act is None:
        try:
            return subprocess.run(
                argv, cwd=cwd, env=env, capture_output=True, text=True, errors="replace", timeout=timeout,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:  # its output is bytes here, text=True or not
            raise TimedOut(argv, timeout, _text(e.stdout), _text(e.stderr)) from None
    with tempfile.TemporaryDirectory(prefix="prefork-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        with open(out, "wb") as o, open(err, "wb") as e:
            job = subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=o, stderr=e, stdin=subprocess.DEVNULL, preexec_fn=_default_sigint
            )
        return _follow(argv, job, out, err, timeout, after, act)


def run(
    argv: list[str], cwd: str, env: dict, timeout: float, after: str = "", act: Act | None = None
) -> subprocess.CompletedProcess:
    """Prefork.run through the server for `env`."""
    if not root_script(argv, cwd):
        return _subprocess_run(argv, cwd, env, timeout, after, act)
    return _server(env).run(argv, cwd, env, timeout, after, act)


def start(
    argv: list[str], cwd: str, env: dict, out: str, err: str | None = None, any_script: bool = False
) -> _Job | subprocess.Popen:
    """`argv` started with stdout appended to the file `out`, stderr to `err` (default: `out` too): a fork where it
    can be (one rank of a torchrun-style job, say), else a subprocess. Either has pid, poll() and wait(timeout)."""
    err = err or out
    forkable = root_script(argv, cwd) or (any_script and python_script(argv))
    server = _server(env) if forkable else None
    if server is not None and server.forks(argv, cwd, env, any_script):
        return server.start(argv, cwd, env, out, err)
    with open(out, "ab") as f, open(err, "ab") as e:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=f, stderr=e, stdin=subprocess.DEVNULL)


def run_ranks(
    argv: list[str], cwd: str, env: dict, nproc: int, timeout: float, any_script: bool = False
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node NPROC ARGV[1:]` as its workers see it, without the agent: NPROC
    forks (where `start` can fork) with the variables torchrun gives a worker, their stdouts one stream and their
    stderrs another, as a torchrun's are. The exit code is the first failing rank's; a failing rank ends the
    others (as torchrun's agent does, so that none waits for it in a collective), and so does the timeout
    (subprocess.TimeoutExpired, with what the ranks wrote)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="prefork-ranks-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        jobs = []
        for rank in range(nproc):
            ranks = dict(RANK=rank, WORLD_SIZE=nproc, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=nproc, GROUP_RANK=0)
            ranks.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RUN_ID=f"prefork-{port}")
            jobs.append(start(argv, cwd, {**env, **{k: str(v) for k, v in ranks.items()}}, out, err, any_script))
        deadline = time.monotonic() + timeout
        while True:
            codes = [j.poll() for j in jobs]
            if any(codes) or None not in codes or time.monotonic() > deadline:  # a rank failed, all ended, or late
                break
            time.sleep(0.01)
        for j in jobs:  # what still runs when one failed or the time is up
            if j.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(j.pid, signal.SIGKILL)
                j.wait(30)

        def read(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                return f.read()

        if not any(codes) and None in codes:
            raise TimedOut(argv, timeout, read(out), read(err))
        code = next((c for c in codes if c), 0)
        return subprocess.CompletedProcess(argv, code, read(out), read(err))


def close_all() -> None:
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.close()
        _SERVERS.clear()


if __name__ == "__main__":
    serve()
