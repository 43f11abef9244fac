# The README's two commands: `make demo` (the whole pipeline on CPU, then runs/demo/report.md) and `make test`.
# Each makes .venv on first use (the pinned CPU torch, then the project with its dev extra) and reuses it after.
# Where plain pip would pick a CUDA build of torch, point TORCH_INDEX at the PyTorch CPU wheel index.
# With PYTHON=python (any interpreter that already has the dev extra) nothing is installed.
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
NAME ?= demo
SETUP := $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(VENV)/.installed)

.PHONY: setup demo demo-quick report test lint

setup: $(SETUP)

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $@

# Durations measured with `time make demo` / `time make demo-quick` on 2 CPU cores (demo/run.py's --help says the same).
demo: $(SETUP)  ## tokenizer, base model, phase 1, phase 2, control, LoRA chat fine-tune, report (6-10 min on 2 cores)
	$(PYTHON) -m demo --name $(NAME)

demo-quick: $(SETUP)  ## the same stages with the CI test's few steps (~1.5 min)
	$(PYTHON) -m demo --name $(NAME)-quick --quick

report: $(SETUP)  ## rewrite runs/$(NAME)/report.md and its plots from what the run left
	$(PYTHON) -m demo.report runs/$(NAME)

test: $(SETUP)  ## the whole suite (GPU tests skip without CUDA), ~8 min on 2 cores
	$(PYTHON) -m pytest -q -ra

lint: $(SETUP)  ## ruff check and ruff format --check, as CI runs them
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
