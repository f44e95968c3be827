# One entry point for people and CI. `make test` and `make demo` build the virtual
# environment on first use; the CPU torch wheel is installed first so that pip never
# pulls a multi-GB CUDA build on a machine without a GPU.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup slurm-packages postgres-packages test test-all lint demo clean gpu-wheels gpu-data gpu-ablation device-venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

# tests/trainer/test_slurm.py starts a real Slurm cluster from Debian's slurm-wlm and munge. A root
# shell with apt-get (the CI machine) installs them when missing; elsewhere that test skips and
# says why.
slurm-packages:
	@PATH="$$PATH:/usr/sbin:/sbin"; if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing slurm-wlm and munge (apt-get) for the Slurm test"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; \
		else \
			echo "slurm-wlm and munge are not installed (installing them needs root and apt-get): the Slurm test will skip"; \
		fi; \
	fi

# The team registry's tests (tests/tracking: PostgreSQL, S3, basic auth) start a real PostgreSQL server from Debian's
# package (its binaries in /usr/lib/postgresql/VERSION/bin); installed the same way, else those tests skip and say why.
postgres-packages:
	@if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing postgresql (apt-get) for the team registry's tests"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql >/dev/null; \
		else \
			echo "PostgreSQL is not installed (installing it needs root and apt-get): the team registry's tests will skip"; \
		fi; \
	fi

# Two tiers (tests/tiers.py). `make test`: ruff and the fast tier, every test not marked `full`, each held to
# FAST_LIMIT_S (a test over it fails and says to mark it `full`). `make test-all` (CI): ruff and both tiers in
# one pytest session, so that the fixtures they share are built once; the fast tier's tests held to the limit.
FAST_LIMIT_S ?= 15
# The whole suite's budget (printed against the run's time, with the slowest tests once over it) and its limit
# (the session fails above it), so that growth shows long before CI's own 90 minutes. CI's whole `.ci/run` took
# 1,815 s at e3e291f (setup and Debian's packages included); the suite is held under 3,600 s.
SUITE_BUDGET_S ?= 1800
SUITE_LIMIT_S ?= 3600

test: setup
	$(VENV)/bin/ruff check .
	DS_ACCELERATOR=cpu $(PY) -m pytest -q -m "not full" --fast-tier-limit=$(FAST_LIMIT_S)

test-all: setup slurm-packages postgres-packages
	$(VENV)/bin/ruff check .
	DS_ACCELERATOR=cpu $(PY) -m pytest -q --fast-tier-limit=$(FAST_LIMIT_S) \
		--suite-budget=$(SUITE_BUDGET_S) --suite-limit=$(SUITE_LIMIT_S)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: setup
	DS_ACCELERATOR=cpu PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash demo/run.sh

clean:
	rm -rf $(VENV) demo-output .pytest_cache

# The offline GPU campaign's luggage (docs/gpu-machine.md): wheels the GPU machine lacks and
# shards made by the real pipeline, in the git-ignored .gpu/ that a device call names in `carry`.
gpu-wheels: setup
	PY=$(PY) bash benchmarks/gpu/wheels.sh

gpu-data: setup
	PY=$(PY) bash benchmarks/gpu/data.sh

# The GPU machine's library versions (KINDS.md's pip list of its 'cuda' image).
GPU_PINS := torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0

# The GPU machine's Python 3.12.3 and its packages only (no deepspeed, webdataset, mlflow, ...), for
# rehearsing a device call on this CPU machine with the carried wheels installed as the device installs
# them (docs/gpu-machine.md, "Before a GPU session"). Git-ignored; about 5.3 GB.
device-venv: setup
	PY=$(PY) bash benchmarks/gpu/device_venv.sh .device-venv $(GPU_PINS)

# The gpu-scale ablation's luggage (docs/gpu-machine.md, "The ablation on the GPU machine"): the
# dataset made here by the real Beam pipeline, all-MiniLM-L6-v2 in float16 and the wheels, in .gpu-ablation/.
gpu-ablation: setup
	PY=$(PY) bash benchmarks/quality/gpu_prepare.sh
