# The README's two commands: `make demo` (the whole pipeline on CPU, then runs/demo/report.md) and `make test`.
PYTHON ?= python
NAME ?= demo

.PHONY: demo demo-quick report test lint

demo:  ## tokenizer, base model, phase 1, phase 2, LoRA chat fine-tune, report (< 15 min on 2 cores)
	$(PYTHON) -m minilm_az.demo --name $(NAME)

demo-quick:  ## the same stages with the CI test's few steps (~3 min)
	$(PYTHON) -m minilm_az.demo --name $(NAME)-quick --quick

report:  ## rewrite runs/$(NAME)/report.md and its plots from what the run left
	$(PYTHON) -m minilm_az.report runs/$(NAME)

test:
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check .
