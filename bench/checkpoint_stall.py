"""How long a training checkpoint stalls training: synchronous DCP save against `Checkpointer(async_save=True)`.

    cd bench && PYTHONPATH=.. python checkpoint_stall.py --out-dir /tmp/ck          # H200: 1B, ~5 min
    cd bench && PYTHONPATH=.. python checkpoint_stall.py --preset tiny --device cpu --seq-len 64 --micro-batch 2
    cd bench && PYTHONPATH=.. python checkpoint_stall.py --modes async,s3     # S3: a local server, or --s3 URI

Mode `s3` is the async save to an s3:// prefix (checkpoint.S3Checkpointer: every rank's objects, then the commit),
to `--s3 s3://BUCKET/PREFIX` with the AWS environment (AWS_ENDPOINT_URL_S3 for MinIO & co.), or without `--s3` to a
local moto S3 server that this script starts (tests/s3_server.py; the `s3` and `dev` extras). `write_s` then
runs until every rank's objects are uploaded (the commit follows at the next finalize), and `size_gib` is the
objects' total.

The model is built as train.py builds it on one GPU (meta -> FSDP2 with bf16 compute -> materialise,
fused AdamW), trained a few steps on random tokens so the optimizer state exists, then checkpointed
`--repeats` times per mode. For each save:

- `in_save_s`: wall time the training loop is blocked inside `save()` (sync: the whole write and the
  rename; async: get_state_dict, the copy to pinned CPU memory, the RNG/state files);
- `slowdown 5` (`slowdown_s`): the next `--steps` steps' time minus as many steps' just before the save;
- `slowdown all` (`slowdown_all_s`): the same over every step trained until an async write finished
  (`steps`): the background write competes for the CPU, the GIL and PCIe;
- `stall_s` = in_save_s + slowdown_all_s: what the checkpoint costs the run;
- `write_s`: from the call until the checkpoint is on disk (async: until `pending_done()`);
- `size_gib`: the checkpoint directory on disk.
Prints a table; writes checkpoint_stall.json to $OUT (or --json) when set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minilm_az import parallel  # noqa: E402
from minilm_az.checkpoint import open_checkpoints  # noqa: E402
from minilm_az.kernels import select_ops  # noqa: E402
from minilm_az.model import get_preset, materialize, meta_model  # noqa: E402


def build(preset: str, vocab: int, proc: parallel.Process):
    model = meta_model(get_preset(preset, vocab), select_ops(proc.device, liger=False))
    parallel.parallelize(model, mixed_precision=proc.device.type == "cuda")
    materialize(model, proc.device, seed=0)
    cuda = proc.device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda, foreach=not cuda)
    return model, opt


def make_step(model, opt, args, device):
    g = torch.Generator(device=device).manual_seed(0)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (args.micro_batch, args.seq_len), device=device, generator=g)
    y = torch.randint(0, vocab, (args.micro_batch, args.seq_len), device=device, generator=g)

    def step() -> float:
        t = time.perf_counter()
        loss = model(x, targets=y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # synchronises, as train.py's loss all-reduce does
        return time.perf_counter() - t

    return step


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def disk_gib_per_s(path: str, gib: float = 2.0) -> float:
    """Sequential write speed of the checkpoint disk, fsync included (the ceiling for write_s)."""
    os.makedirs(path, exist_ok=True)
    f, block = os.path.join(path, "dd.bin"), os.urandom(64 << 20)
    t = time.perf_counter()
    with open(f, "wb") as fh:
        for _ in range(int(gib * 16)):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    rate = gib / (time.perf_counter() - t)
    os.remove(f)
    return rate


def measure(mode: str, model, opt, step, args, proc, first_step: int, deadline: float, rows: list) -> None:
    ck_dir = f"{args.s3.rstrip('/')}/{time.time_ns()}" if mode == "s3" else os.path.join(args.out_dir, mode)
    shutil.rmtree(ck_dir, ignore_errors=True)
    ck = open_checkpoints(ck_dir, proc, keep=1, async_save=mode != "sync")
    last_write = 0.0
    for r in range(args.repeats):
        if time.time() + 1.5 * last_write + 30 > deadline:
            print(f"{mode}: skipping repeat {r}: --budget-s would be exceeded", flush=True)
            break
        n = first_step + r
        base = sum(step() for _ in range(args.steps)) / args.steps
        t0 = time.perf_counter()
        ck.save(n, model, opt, {"bench": True})
        in_save = time.perf_counter() - t0
        after, steps, write_s = [], 0, None
        # The first --steps steps, then on until the background write is done: all of them pay for it.
        while steps < args.steps or (write_s is None and steps < args.max_steps):
            after.append(step())
            steps += 1
            if write_s is None and ck.pending_done():
                write_s = time.perf_counter() - t0
        while not ck.pending_done():
            time.sleep(0.01)
        write_s = write_s or time.perf_counter() - t0
        final = ck.finalize() or ck.last()
        if mode == "sync":
            write_s = in_save
        last_write = write_s
        n_during = len(after) if mode != "sync" else args.steps
        slow_all = sum(after[:n_during]) - n_during * base
        rows.append(
            {
                "mode": mode,
                "repeat": r,
                "in_save_s": in_save,
                "slowdown_s": sum(after[: args.steps]) - args.steps * base,
                "slowdown_all_s": slow_all,
                "steps_during_write": n_during if mode != "sync" else 0,
                "stall_s": in_save + slow_all,
                "write_s": write_s,
                "step_s": base,
                "size_gib": (s3_bytes(ck, final) if mode == "s3" else dir_bytes(final)) / 2**30,
            }
        )
        print(row_line(rows[-1]), flush=True)
        save_json(args, rows)
    ck.close()
    shutil.rmtree(ck_dir, ignore_errors=True)  # keep the disk for the next mode


def s3_bytes(ck, uri: str) -> int:
    """The total size of checkpoint `uri`'s objects on S3."""
    return sum(ck.store.list(ck.store.where.key(uri.rsplit("/", 1)[1]) + "/").values())


def local_s3(workdir: str) -> str:
    """Start the tests' local S3 server (moto) with a bucket, point the AWS environment at it; the s3:// URI."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from s3_server import S3Server

    server = S3Server.start(__import__("pathlib").Path(workdir))
    server.make_bucket("stall")
    __import__("atexit").register(server.stop)
    os.environ.update(server.env())
    return "s3://stall/bench"


def save_json(args, rows: list) -> None:
    # Rewritten after every row: a run stopped at its time limit still leaves what it measured.
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": args.env, "rows": rows}, f, indent=2)


HEADER = (
    f"{'mode':<6} {'rep':>3} {'in save() s':>11} {'slowdown 5':>10} {'slowdown all':>12} {'steps':>5} "
    f"{'stall s':>8} {'write s':>8} {'step s':>7} {'size GiB':>8}"
)


def row_line(r: dict) -> str:
    return (
        f"{r['mode']:<6} {r['repeat']:>3} {r['in_save_s']:>11.2f} {r['slowdown_s']:>10.2f} "
        f"{r['slowdown_all_s']:>12.2f} {r['steps_during_write']:>5} {r['stall_s']:>8.2f} {r['write_s']:>8.2f} "
        f"{r['step_s']:>7.3f} {r['size_gib']:>8.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--vocab", type=int, default=100352)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (optimizer state, allocator)")
    ap.add_argument("--steps", type=int, default=5, help="steps timed before and after each save")
    ap.add_argument("--repeats", type=int, default=2, help="saves per mode (the first async one pins memory)")
    ap.add_argument("--max-steps", type=int, default=2000, help="most steps trained while an async write runs")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--budget-s", type=float, default=540, help="skip repeats that would end after this")
    ap.add_argument("--out-dir", default="/tmp/ck", help="checkpoints go here (local disk)")
    ap.add_argument("--s3", help="mode s3's prefix, s3://BUCKET/PREFIX (default: a local server this script starts)")
    ap.add_argument(
        "--json", default=os.path.join(os.environ["OUT"], "checkpoint_stall.json") if os.environ.get("OUT") else None
    )
    args = ap.parse_args()

    deadline = time.time() + args.budget_s
    if "s3" in args.modes.split(",") and not args.s3:
        args.s3 = local_s3(os.path.join(args.out_dir, "s3server"))
    proc = parallel.setup(args.device)
    model, opt = build(args.preset, args.vocab, proc)
    step = make_step(model, opt, args, proc.device)
    for _ in range(args.warmup):
        step()
    args.env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if proc.device.type == "cuda" else platform.processor(),
        "params": sum(p.numel() for p in model.parameters()),
        "cpus": os.cpu_count(),
        "disk": args.out_dir,
        "disk_write_gib_per_s": round(disk_gib_per_s(args.out_dir), 2),
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
    }
    print(json.dumps(args.env), flush=True)
    print(HEADER, flush=True)
    rows: list[dict] = []
    for i, mode in enumerate(args.modes.split(",")):
        measure(mode, model, opt, step, args, proc, 100 * (i + 1), deadline, rows)
    parallel.finish()
    parallel.teardown()


if __name__ == "__main__":
    main()
