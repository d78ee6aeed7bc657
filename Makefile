# internlm-core: `make demo` and `make test` set everything up from scratch (a virtual environment in .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= build/demo
STAMP := $(VENV)/.installed

.PHONY: venv demo lint test test-fast bench clean

# uv installs the same pinned requirements as pip in seconds instead of ~1.5 minutes (it links from its cache);
# it reads pip's find-links (where a machine keeps wheels such as torch's CPU build) only when told. pip is the
# fallback when uv cannot be had. uv writes no bytecode: the first import of each module writes it instead (in
# about 10 s, against 30 s to compile every installed package up front), so Python must be let write it here.
UV_FIND_LINKS := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
unexport PYTHONDONTWRITEBYTECODE

# The package itself is installed editable (pyproject.toml): train.py, tools/, bench/ and the tests import
# internlm_core from this checkout without path hacks.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	( $(PY) -m pip install -q 'uv>=0.5' && $(VENV)/bin/uv pip install -q --python $(PY) \
		$(UV_FIND_LINKS) -r requirements-dev.txt -e . ) || $(PY) -m pip install -q -r requirements-dev.txt -e .
	touch $(STAMP)

venv: $(STAMP)

# Build a corpus from Python's standard library, tokenize it, train configs/tiny.py on it (from scratch each time).
demo: $(STAMP)
	rm -rf $(DEMO_DIR)/corpus $(DEMO_DIR)/data $(DEMO_DIR)/run
	$(PY) tools/make_demo_corpus.py --out $(DEMO_DIR)/corpus
	$(PY) tools/tokenizer.py --text_input_path $(DEMO_DIR)/corpus/train --bin_output_path $(DEMO_DIR)/data/train --tokenizer byte
	$(PY) tools/tokenizer.py --text_input_path $(DEMO_DIR)/corpus/valid --bin_output_path $(DEMO_DIR)/data/valid --tokenizer byte
	$(PY) train.py --config configs/tiny.py --run-dir $(DEMO_DIR)/run \
		--set data.train_folder=$(DEMO_DIR)/data/train data.valid_folder=$(DEMO_DIR)/data/valid model.vocab_size=512 data.total_steps=200 data.valid_every=40 monitor.log_every=20 adam.lr=1e-3 tokenizer=byte
	$(PY) tools/plot_metrics.py $(DEMO_DIR)/run

# pyflakes' rules over the repository (ruff, [tool.ruff] in pyproject.toml), the layering of internlm_core
# (.importlinter, docs/architecture.md); `make test` runs them before the tests
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q --timeout=600 -n 2 --dist loadfile --durations=15 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q --timeout=300 tests/unit

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) build RUN
