# Two commands on a fresh clone: `make demo` (the whole pipeline on config/config.yaml) and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CORES  ?= all
CONFIG ?= config/config.yaml
INTEROP_VENV  := .venv-interop
INTEROP_STAMP := $(INTEROP_VENV)/.installed

.PHONY: demo test test-fast venv lint clean-results interop serving-check

venv: $(STAMP)

$(STAMP): envs/requirements.txt envs/bench.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r envs/requirements.txt
	$(BIN)/pip install --quiet --no-deps -r envs/bench.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The rules run the interpreter Snakemake runs in: no PATH set-up. The default config is read by the workflow itself
# (a YAML error names its line and column); another one is handed over with --configfile. A CONFIG that is not a file
# is refused in one line before anything is built (Snakemake answers a missing --configfile with a traceback).
ifneq ($(filter demo,$(MAKECMDGOALS)),)
ifeq ($(wildcard $(CONFIG)),)
$(error CONFIG=$(CONFIG): no such file; the configs are: $(wildcard config/*.yaml))
endif
endif
demo: $(STAMP)
	$(BIN)/snakemake --cores $(CORES) $(if $(filter-out config/config.yaml,$(CONFIG)),--configfile $(CONFIG))

# The interop check runs once, inside the suite (tests/e2e/test_evaluate_interop.py, the same check as `make interop`):
# its side venv is built first, and DFLASH_INTEROP=required makes a missing or broken one a failure, not a skip.
test: $(STAMP) $(INTEROP_STAMP)
	PATH=$(abspath $(BIN)):$$PATH DFLASH_INTEROP=required $(BIN)/python -m pytest -q tests

# The fast loop: tests/unit and tests/stages (tests/e2e is marked slow by its conftest.py), at most 3 minutes on 2 cores.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests/unit tests/stages

lint: $(STAMP)
	$(BIN)/snakemake --lint

clean-results:
	rm -rf results/*/ .snakemake

# Interop with the published reference package (dflash 0.1.0, DFlashDraftModel), in its own venv: both packages
# are named `dflash`. torch is pinned to the project's 2.13.0 so pip takes the CPU wheel on disk. The check exports
# drafters in full, sliding and mixed layer layouts with our code, decodes with our evaluator, then loads, runs and
# decodes them with the reference; any difference fails.
INTEROP_OUT   ?= results/interop

$(INTEROP_STAMP):
	test -x $(INTEROP_VENV)/bin/python || $(PYTHON) -m venv $(INTEROP_VENV)
	$(INTEROP_VENV)/bin/pip install --quiet "torch==2.13.0" "dflash[local]==0.1.0"
	cd / && $(abspath $(INTEROP_VENV))/bin/python -c "from dflash import DFlashDraftModel"
	touch $@

interop: $(STAMP) $(INTEROP_STAMP)
	rm -rf $(INTEROP_OUT)
	$(BIN)/python tests/interop/make_case.py $(INTEROP_OUT)
	cd $(INTEROP_OUT) && env -u PYTHONPATH $(abspath $(INTEROP_VENV))/bin/python $(abspath tests/interop/check_reference.py) .

# Serving check (not part of `make test`): vLLM's and SGLang's own DFlash classes, from their wheels in a side venv
# (envs/serving.txt, no GPU), are built from our export of full, sliding and mixed drafters, load its weights (every
# parameter compared with ours) and run their modules' forward against ours (docs/serving.md).
SERVING_VENV  := .venv-serving
SERVING_STAMP := $(SERVING_VENV)/.installed
SERVING_OUT   ?= results/serving

$(SERVING_STAMP): envs/serving.txt
	test -x $(SERVING_VENV)/bin/python || $(PYTHON) -m venv $(SERVING_VENV)
	$(SERVING_VENV)/bin/pip install --quiet --no-deps -r envs/serving.txt
	touch $@

serving-check: $(STAMP) $(SERVING_STAMP)
	rm -rf $(SERVING_OUT)
	$(BIN)/python tests/serving/make_case.py $(SERVING_OUT)
	cd $(SERVING_OUT) && env -u PYTHONPATH VLLM_TARGET_DEVICE=cpu VLLM_USE_V2_MODEL_RUNNER=1 \
		$(abspath $(SERVING_VENV))/bin/python $(abspath tests/serving/check_stacks.py) .
