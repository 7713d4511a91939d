# Two commands on a fresh clone: `make demo` (the whole pipeline on config/config.yaml) and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CORES  ?= all
CONFIG ?= config/config.yaml

.PHONY: demo test venv lint clean-results

venv: $(STAMP)

$(STAMP): envs/requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r envs/requirements.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/snakemake --cores $(CORES) --configfile $(CONFIG)

test: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m pytest -q tests

lint: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/snakemake --lint

clean-results:
	rm -rf results/*/ .snakemake
