# Entry points; see README.md. `make demo` and `make test` create the virtual environment when it
# is missing and install the project with every extra: `pip install -e ".[dev,all]"` (all =
# deepspeed + mpi + triton; see pyproject.toml).
# TORCH is the torch requirement installed first, when the venv has no torch yet: by default the
# CPU wheel torch==2.13.0+cpu, from the configured indexes (a local wheel folder) or, when they
# cannot provide it, from PyTorch's CPU index (TORCH_INDEX). Override it, e.g. `make demo
# TORCH=torch` for PyPI's default (CUDA) build on GPUs; a venv that has torch keeps it.
VENV        ?= .venv
PY          := $(VENV)/bin/python
TORCH       ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

# OLDEST_TRITON: the oldest triton the project supports (pyproject: triton >= 3.6; the GPU
# machines' torch 2.11 ships 3.6.0), installed apart (`pip install --target`) so that the suite
# compiles the GPU kernels with it too (tests/test_bench_kernels.py).
OLDEST_TRITON ?= triton==3.6.0

# NEWEST_TRANSFORMERS: the transformers the Hugging Face folders of `megabeta export --format hf`
# are also checked on (the venv keeps 4.x: lm-eval 0.4 needs it), installed apart with what it
# needs beyond the venv (tests/support/scripts/install_apart.py), for
# tests/unit/hf/test_hf_transformers5.py.
NEWEST_TRANSFORMERS ?= transformers==5.*

.PHONY: test test-fast demo bench-model bench-data venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(VENV)/bin/pip install -q "$(TORCH)" 2>/dev/null || \
	  { echo "$(TORCH) is not on the configured indexes: trying $(TORCH_INDEX)"; \
	    $(VENV)/bin/pip install -q --index-url "$(TORCH_INDEX)" "$(TORCH)"; }
	$(VENV)/bin/pip install -q -e ".[dev,all]"
	touch $@

$(VENV)/triton-3.6/.installed: $(VENV)/.installed
	$(VENV)/bin/pip install -q --no-deps --target $(VENV)/triton-3.6 "$(OLDEST_TRITON)"
	touch $@

$(VENV)/transformers-5/.installed: $(VENV)/.installed
	rm -rf $(VENV)/transformers-5
	$(PY) tests/support/scripts/install_apart.py $(VENV)/transformers-5 "$(NEWEST_TRANSFORMERS)"
	touch $@

venv: $(VENV)/.installed

# The whole suite on two pytest-xdist workers, a test file to a worker (its module fixtures, such
# as a trained run, built once).
test: $(VENV)/.installed $(VENV)/triton-3.6/.installed $(VENV)/transformers-5/.installed
	$(PY) -m pytest -n 2 --dist loadfile tests

# The unit tests alone (tests/unit/<package>/), for the inner loop: two pytest-xdist workers,
# under 3 minutes on 2 cores; the multi-process ones (marked slow: torchrun, mpirun, several
# ranks or workers) run with the whole suite.
test-fast: $(VENV)/.installed $(VENV)/triton-3.6/.installed $(VENV)/transformers-5/.installed
	$(PY) -m pytest -n 2 -m "not slow" tests/unit

demo: $(VENV)/.installed
	$(PY) -m megabeta.demo

bench-model: $(VENV)/.installed
	$(PY) -m megabeta.bench model

bench-data: $(VENV)/.installed
	$(PY) -m megabeta.bench data
