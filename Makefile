# The README's two commands: `make demo` (the whole pipeline on CPU, then runs/demo/report.md) and `make test`.
# Each makes .venv on first use (the pinned torch, then the project with its dev extra) and reuses it after.
# On Linux, plain pip takes torch's CUDA build (several GB with its libraries). For the CPU-only build (~200 MB),
# point TORCH_INDEX at the PyTorch CPU wheel index: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (PyPI's macOS and Windows wheels are CPU builds already).
# With PYTHON=python (any interpreter that already has the dev extra) nothing is installed.
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
NAME ?= demo
SETUP := $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(VENV)/.installed)

.PHONY: setup demo demo-quick report test lint

setup: $(SETUP)

# One install step: a line that says what it does and about how long it takes, then a line every 20 s while it
# runs, so the first `make demo` is never silent for minutes (pip's -q keeps its own output short). The estimates
# were measured twice on 2 loaded CPU cores: the venv 12 s, torch 93 s and 37 s from a wheel already on disk, the
# dev extra 254 s and 175 s with every package downloaded; a slow connection adds to the downloads. The sleep
# writes nowhere, so a pipe reading make's output closes when make ends, not when the last sleep does.
# $(call step,N/3,what and how long,command)
define step
	@echo "setup $(1): $(2)"
	@t0=$$(date +%s); (while sleep 20 >/dev/null 2>&1; do echo "    ... $$(($$(date +%s) - t0)) s"; done) & \
	beat=$$!; $(3); rc=$$?; kill $$beat 2>/dev/null; [ $$rc = 0 ] && said=done || said="failed (exit $$rc)"; \
	echo "    $$said after $$(($$(date +%s) - t0)) s"; exit $$rc
endef
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
TORCH_FROM = $(if $(TORCH_INDEX),from $(TORCH_INDEX),from pip's default index (a wheel already on disk if pip has one); \
	the line after it says which build came)

# After torch, one line says which build pip actually took: on Linux PyPI's torch is the CUDA build (several GB),
# while a wheel already on disk or the CPU index gives the CPU build (~200 MB).
$(VENV)/.installed: setup.cfg pyproject.toml
	@echo "setup: installing into $(VENV): ~4-6 min on 2 cores plus the downloads; later runs reuse it"
	$(call step,1/3,python3 -m venv $(VENV) (~10 s),python3 -m venv $(VENV))
	$(call step,2/3,pip install $(TORCH) (~1 min plus the download) $(TORCH_FROM),\
	$(VENV)/bin/python -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)))
	@$(VENV)/bin/python -c "import torch; b = 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU'; \
	print(f'    torch {torch.__version__}: the {b} build' + ('' if b == 'CPU' else \
	' (several GB; for the CPU build: make ... TORCH_INDEX=$(CPU_TORCH_INDEX))'))"
	$(call step,3/3,pip install -e '.[dev]': the project and ~140 packages for tests and the demo (3-4 min),\
	$(VENV)/bin/python -m pip install -q -e ".[dev]")
	touch $@

# Durations measured with `time make demo` / `time make demo-quick` on 2 CPU cores (demo/run.py's --help says the same).
demo: $(SETUP)  ## tokenizer, base model, phase 1, phase 2, control, LoRA chat fine-tune, report (9-12 min on 2 cores)
	$(PYTHON) -m demo --name $(NAME)

demo-quick: $(SETUP)  ## the same stages with the CI test's few steps (~2 min)
	$(PYTHON) -m demo --name $(NAME)-quick --quick

report: $(SETUP)  ## rewrite runs/$(NAME)/report.md and its plots from what the run left
	$(PYTHON) -m demo.report runs/$(NAME)

# -n 2: two pytest-xdist workers (tests/conftest.py groups the tests so a module's fixtures are built once).
test: $(SETUP)  ## the whole suite (GPU tests skip without CUDA), ~10-16 min on 2 cores (pytest -n 2)
	$(PYTHON) -m pytest -q -ra -n 2

lint: $(SETUP)  ## ruff check and ruff format --check, as CI runs them
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
