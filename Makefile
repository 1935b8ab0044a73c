# Two entry points (see README): `make demo` and `make test`. Both create .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch build to install when the venv has none. ROCm/CUDA users: install your own wheel into .venv
# first (see README); it is kept.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.loracls-installed

.PHONY: demo test test-fast lint install numbers docs

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH)
	$(PY) -m pip install -e ".[embedded,dev,serve]"
	touch $@

demo: $(STAMP)
	$(VENV)/bin/loracls train --config configs/demo.yaml

# two workers of one thread each, a file to a worker, the longest files first (tests/conftest.py)
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: $(STAMP) lint
	$(PY) -m pytest $(XDIST) -ra --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -ra -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts

# Re-measure every figure the READMEs quote on this commit (about five hours on 2 CPU cores); see benchmarks/README.md
numbers: $(STAMP)
	$(PY) benchmarks/reproduce.py

# The user guide (docs/, mkdocs.yml) into site/; --strict: a broken link or a missing page fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site
