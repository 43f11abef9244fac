# The README's two commands: `make demo` (the whole pipeline on CPU, then runs/demo/report.md) and `make test`.
PYTHON ?= python
NAME ?= demo

.PHONY: demo demo-quick report test lint

# Durations measured with `time make demo` / `time make demo-quick` on 2 CPU cores (demo/run.py's --help says the same).
demo:  ## tokenizer, base model, phase 1, phase 2, control, LoRA chat fine-tune, report (~11 min on 2 cores)
	$(PYTHON) -m demo --name $(NAME)

demo-quick:  ## the same stages with the CI test's few steps (~2 min)
	$(PYTHON) -m demo --name $(NAME)-quick --quick

report:  ## rewrite runs/$(NAME)/report.md and its plots from what the run left
	$(PYTHON) -m demo.report runs/$(NAME)

test:
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check .
