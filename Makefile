# Short tasks for streamrft. `make setup` once, then `make run` / `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test test-unit test-integration test-e2e lint format bench infra-up infra-down docs

# The install is redone only when pyproject.toml changes.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

run: setup
	OMP_NUM_THREADS=1 $(BIN)/streamrft run examples/arithmetic.yaml

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m tools.check_layers
	$(BIN)/python -m tools.docgen --check README.md
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -p no:cacheprovider

test-unit: setup
	$(BIN)/python -m pytest tests/unit -p no:cacheprovider

test-integration: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/integration -p no:cacheprovider

test-e2e: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/e2e -p no:cacheprovider

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python -m tools.check_layers
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

docs: setup
	$(BIN)/python -m tools.docgen README.md

bench: setup
	OMP_NUM_THREADS=1 $(BIN)/python bench/experience_path.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/weight_sync.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/reliability.py
	OMP_NUM_THREADS=1 $(BIN)/python bench/scale_explorers.py

infra-up: setup
	$(BIN)/streamrft infra up

infra-down: setup
	$(BIN)/streamrft infra down
