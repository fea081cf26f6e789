# The two commands: `make run` (main job) and `make test` (whole suite). Both set up .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint verify bench certificate study clean portability ascend-check \
	test-triton32 test-notriton test-torch211 msprobe-fixtures gpu-wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[triton,dev,transformers,peft]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/opforge demo --out reports

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -n 2 -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

verify: $(STAMP)
	$(BIN)/opforge verify --report reports/verify

study: $(STAMP)
	$(BIN)/opforge demo --study --out reports --doc docs/precision-study.md

certificate: $(STAMP)
	$(BIN)/opforge verify --report reports/verify --certificate docs/precision-certificate.md

bench: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python benchmarks/replay.py

# ---------------------------------------------------------------------------------------
# The other configurations CI checks after `make test` (`make portability`, ~25 min on 2
# cores): each in its own virtual environment, built from its constraints file.
ASCEND := .venv-ascend
TRITON32 := .venv-triton32
NOTRITON := .venv-notriton

# The rule of environment $(1): pip and $(3) installed under the pins of $(2).
define environment
$(1)/.installed: pyproject.toml $(2)
	rm -rf $(1) && $$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet -c $(2) $(3)
	touch $$@
endef

# Every kernel variant lowered for an Ascend 910B by triton-ascend (no NPU, no CANN
# needed: with CANN installed the binary stage runs too).
$(eval $(call environment,$(ASCEND),constraints-ascend.txt,-e . triton-ascend pybind11))

# Then the row reductions at a model's width, where their tiles hold one row (the samples'
# rows are short: such a tile failed to lower until 2026-12-07); about a minute.
WIDE_ROW_OPS := rms_norm add_rms_norm layer_norm softmax log_softmax cross_entropy
ascend-check: $(ASCEND)/.installed
	$(ASCEND)/bin/opforge compile-check --target ascend910b --quiet
	$(ASCEND)/bin/opforge compile-check --target ascend910b $(WIDE_ROW_OPS) \
		--shapes 4096x8192 --quiet

# Triton 3.2 (what triton-ascend is built on): the registry-wide tests (every operator's
# samples, layouts, held launches, traffic) under its interpreter, and compile-check for
# sm_90 with its compiler. The whole suite passes there too (about 14 minutes).
TRITON32_TESTS ?= tests/test_ops.py tests/test_layouts.py tests/test_call_path.py \
	tests/test_traffic.py
TRITON32_PACKAGES := -e ".[triton,dev]"
$(eval $(call environment,$(TRITON32),constraints-triton32.txt,$(TRITON32_PACKAGES)))

test-triton32: $(TRITON32)/.installed
	HYPOTHESIS_PROFILE=ci $(TRITON32)/bin/python -m pytest -n 2 -q $(TRITON32_TESTS)
	$(TRITON32)/bin/opforge compile-check softmax rms_norm sigmoid matmul --dtype bfloat16 --quiet

# No Triton at all (opforge without the triton extra): the torch backend's tests, and
# `opforge verify` on it.
$(eval $(call environment,$(NOTRITON),constraints.txt,-e ".[dev]"))

test-notriton: $(NOTRITON)/.installed
	HYPOTHESIS_PROFILE=ci $(NOTRITON)/bin/python -m pytest -n 2 -q
	$(NOTRITON)/bin/opforge verify --cases samples --quiet

# The oldest torch pyproject.toml admits (2.11, the GPU machine's, with its Triton 3.6):
# the whole suite under 3.6's interpreter. PyPI's torch 2.11 is a CUDA build: about 5 GB
# installed, its CUDA libraries unused here.
TORCH211 := .venv-torch211
TORCH211_PACKAGES := -e ".[triton,dev,transformers,peft]"
$(eval $(call environment,$(TORCH211),constraints-torch211.txt,$(TORCH211_PACKAGES)))

test-torch211: $(TORCH211)/.installed
	HYPOTHESIS_PROFILE=ci $(TORCH211)/bin/python -m pytest -n 2 -q

portability: ascend-check test-triton32 test-notriton test-torch211

# The msprobe dumps tests/test_msprobe.py reads, written by MindStudio Probe itself in its
# own environment (committed; not part of CI). The environment also runs
# benchmarks/dump_vs_msprobe.py (with PYTHONPATH=src: hence rich and safetensors).
MSPROBE := .venv-msprobe
$(MSPROBE)/.installed: constraints-msprobe.txt
	rm -rf $(MSPROBE) && $(PYTHON) -m venv $(MSPROBE)
	$(MSPROBE)/bin/python -m pip install --quiet --upgrade pip
	$(MSPROBE)/bin/python -m pip install --quiet -c constraints-msprobe.txt torch mindstudio-probe \
		rich safetensors
	touch $@

msprobe-fixtures: $(MSPROBE)/.installed
	$(MSPROBE)/bin/python tests/fixtures/msprobe/generate.py

# The GPU machine's peers, carried to it in .wheels/ (it has no network; Python 3.12):
# Liger-Kernel, and transformers with its dependencies for benchmarks/hf_training_step.py
# (numpy is installed there only where the machine lacks it; see gpu_check.sh). ~45 MiB.
LIGER_VERSION ?= 0.8.5
GPU_PLATFORMS := --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux_2_28_x86_64 --platform any
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps -d .wheels liger-kernel==$(LIGER_VERSION)
	$(PYTHON) -m pip download --quiet -d .wheels --only-binary=:all: --python-version 3.12 \
		$(GPU_PLATFORMS) transformers==5.24.0 tokenizers==0.23.3 huggingface_hub==2.4.0 \
		safetensors==0.8.0

clean:
	rm -rf $(VENV) $(ASCEND) $(TRITON32) $(NOTRITON) $(TORCH211) $(MSPROBE) reports .pytest_cache
