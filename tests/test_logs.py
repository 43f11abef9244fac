"""The training loop's progress lines (minilm_az/logs.py): when they print, and the one line for a plan whose
measured steps put its end absurdly far out for the device it runs on."""

from minilm_az.logs import Progress, eta


def test_a_plan_days_long_at_its_first_cpu_step_says_so_once_and_names_the_sizing_flags():
    meter = Progress(total=15_000, every=10)
    meter.add(50.0, loss=11.0)  # the 1B recipe's first step on a laptop CPU
    assert meter.due(1)
    assert meter.flush(1)["eta"] == eta(1, 15_000, 50.0)
    note = meter.long_plan(1, "cpu")
    assert note and note.startswith("plan: 14,999 more steps at 50.0 s a step on cpu is about 208 h")
    for flag in ("--preset", "--steps", "--seq-len", "--global-batch"):
        assert flag in note
    meter.add(50.0, loss=11.0)
    meter.flush(2)
    assert meter.long_plan(2, "cpu") is None  # once


def test_a_plan_that_fits_the_device_prints_nothing():
    meter = Progress(total=300, every=10)
    meter.add(0.5, loss=3.0)
    meter.flush(1)
    assert meter.long_plan(1, "cpu") is None
    meter.add(200.0, loss=3.0)  # a later slow window is not judged: the first window decided
    meter.flush(2)
    assert meter.long_plan(2, "cpu") is None


def test_on_cuda_the_first_step_with_its_compilation_does_not_decide():
    meter = Progress(total=15_000, every=10, start=100)
    meter.add(90.0, loss=3.0)  # compilation and warm-up
    meter.flush(101)
    assert meter.long_plan(101, "cuda") is None
    for _ in range(9):
        meter.add(0.8, loss=3.0)
    meter.flush(110)
    assert meter.long_plan(110, "cuda") is None  # 0.8 s a step: 3.3 h left
    slow = Progress(total=15_000, every=10)
    slow.add(90.0, loss=3.0)
    slow.flush(1)
    assert slow.long_plan(1, "cuda") is None
    for _ in range(9):
        slow.add(5.0, loss=3.0)
    slow.flush(10)
    assert "on cuda is about 21 h" in (slow.long_plan(10, "cuda") or "")
