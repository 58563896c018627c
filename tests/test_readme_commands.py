"""The README's commands run as written: every line of its ```bash blocks runs here, offline on CPU, except
the lines tagged in a trailing comment with [gpu], [hub], [cluster] or [long] (what they need: a GPU, a
reachable model hub, the cluster's model files or Slurm, or minutes of training). Placeholders (HF_DIR,
OUT_DIR, RUN_DIR, OUT_HF) stand for a tiny Qwen2 model with the character tokenizer, the directories the
commands write, and a run directory whose checkpoints/latest names the converted checkpoint."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TAGS = ("gpu", "hub", "cluster", "long")
TAG = re.compile(r"#\s*\[(\w+)\]")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]*\b")


def readme_commands(text: str) -> list[tuple[str, str | None]]:
    """(command, tag or None) for each command line of the ```bash blocks, in order."""
    out: list[tuple[str, str | None]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            tag = TAG.search(line)
            command = line.split("#", 1)[0].strip() if "#" in line else line.strip()
            out.append((command, tag.group(1) if tag else None))
    return out


def write_tiny_hf_model(path: Path) -> None:
    """A tiny random Qwen2 over the character tokenizer, as an HF directory (transformers' own classes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from exgrpo_megatron.convert.hf_tokenizer import save_char_tokenizer
    from exgrpo_megatron.data.tokenizer import CharTokenizer

    torch.manual_seed(0)
    tok = CharTokenizer()
    config = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                         pad_token_id=tok.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(path)
    save_char_tokenizer(str(path))


def test_the_commands_are_found_and_every_tag_is_known() -> None:
    commands = readme_commands(README.read_text())
    assert {tag for _, tag in commands} <= {*TAGS, None}
    runnable = [c for c, tag in commands if tag is None]
    assert any("--dry-run" in c for c in runnable) and any("convert_megatron_to_hf" in c for c in runnable)


def test_every_untagged_readme_command_runs_offline_on_cpu(tmp_path: Path) -> None:
    hf_dir, run_dir = tmp_path / "hf_model", tmp_path / "run"
    write_tiny_hf_model(hf_dir)
    places = {"HF_DIR": hf_dir, "OUT_DIR": tmp_path / "megatron", "RUN_DIR": run_dir, "OUT_HF": tmp_path / "out_hf"}
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000001").symlink_to(places["OUT_DIR"])  # written by the README's convert
    (run_dir / "checkpoints" / "latest").write_text("step_00000001")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ran = []
    for command, tag in readme_commands(README.read_text()):
        if tag is not None:
            continue
        unknown = set(PLACEHOLDER.findall(command)) - set(places) - {"HF_HUB_OFFLINE"}
        assert not unknown, f"README command {command!r}: unknown placeholder(s) {unknown}; tag it or add them here"
        argv = shlex.split(command)
        if argv[0] == "python":
            argv[0] = sys.executable
        argv = [_substitute(arg, places) for arg in argv]
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"README command {command!r} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        ran.append(command)
    assert (places["OUT_HF"] / "config.json").is_file() and len(ran) >= 3, ran


def _substitute(arg: str, places: dict[str, Path]) -> str:
    for name, path in places.items():
        arg = re.sub(rf"\b{name}\b", str(path), arg)
    return arg


@pytest.mark.parametrize("line,expected", [
    ("python tools/x.py A  # [hub] when a hub is reachable", ("python tools/x.py A", "hub")),
    ("make test   # the same environment", ("make test", None)),
])
def test_readme_command_parsing(line: str, expected: tuple[str, str | None]) -> None:
    assert readme_commands(f"text\n```bash\n{line}\n```\n") == [expected]
