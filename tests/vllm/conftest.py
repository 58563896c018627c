"""The vLLM suite runs where vLLM is importable (`make test-vllm`, .venv-vllm); elsewhere it is skipped."""

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]  # `make test` (.venv): nothing here is collected

# vLLM's CPU build: a small KV-cache share (GiB of RAM) on the shared machine, and in-process engines.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> str:
    from tests.vllm.engines import tiny_model_config, write_tiny_hf_dir

    return write_tiny_hf_dir(str(tmp_path_factory.mktemp("tiny_hf")), tiny_model_config())


@pytest.fixture(scope="session")
def tiny_qwen3_hf_dir(tmp_path_factory) -> str:
    from tests.vllm.engines import tiny_model_config, write_tiny_hf_dir

    return write_tiny_hf_dir(str(tmp_path_factory.mktemp("tiny_qwen3_hf")), tiny_model_config(family="qwen3"))


@pytest.fixture(autouse=True)
def _ranks_are_new_interpreters(monkeypatch):
    """vLLM's CPU workers unlink their shared-memory segments (named by the TP group, the same in every test) only
    when their process exits normally, which a rank forked from the test rank server skips: here each rank is a
    new interpreter, as in a real run."""
    from tests.helpers import multirank

    monkeypatch.setattr(multirank, "START_METHOD", "spawn")
