# Set-up and test entry points; see README.md.
PY ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

.PHONY: test bench-model
test:
	$(PY) -m pytest tests

bench-model:
	$(PY) -m megabeta.bench model
