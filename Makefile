# Entry points; see README.md. `make demo` and `make test` create the virtual environment when it
# is missing. TORCH picks the torch build (CPU wheel by default; `make demo TORCH=torch` on GPUs).
VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0+cpu

.PHONY: test demo bench-model bench-data venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest tests

demo: $(VENV)/.installed
	$(PY) -m megabeta.demo

bench-model: $(VENV)/.installed
	$(PY) -m megabeta.bench model

bench-data: $(VENV)/.installed
	$(PY) -m megabeta.bench data
