"""Every name of our code that the docs, the conf/ comments and the package's own docstrings and comments mention
resolves: a stale module path, file path or attribute fails here, naming where it is written.

What counts as a reference (nothing else is read, so prose never trips the test):
  - a path with a folder that ends in .py, .md or .yaml (`algo/loss.py`, docs/exgrpo.md): the file exists, relative
    to the repository, to exgrpo_megatron/, or to the referring file's folder or the one above it;
  - `exgrpo_megatron.x.y.Attr`, anywhere: the module exists and the attribute chain resolves;
  - a backticked dotted name whose first part is one of our modules (`experience.schedule.legacy_state`,
    `schedule.solved_fraction`, a sub-package or a module's own name) or one of our classes (`Class.method`): the
    same, from any module of that name. A backticked name whose first part is also a config section
    (`algo.clip_ratio`) may instead be a config key: then the key must exist (or be a renamed key's old name).
Names that are not ours are never matched (their first part is not one of our modules or classes); the paths
below are the original repositories' and libraries', cited, not ours.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from exgrpo_megatron.algo.registry import registered_names
from exgrpo_megatron.algo.settings import VariantSettings
from exgrpo_megatron.config.aliases import RENAMED_KEYS
from exgrpo_megatron.config.schema import RootConfig

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "exgrpo_megatron"

# Paths that name other projects' files (cited, not ours): the prefix -> whose they are.
FOREIGN_PATHS: dict[str, str] = {
    "verl/": "verl, the original's trainer ([C] citations)",
    "eval_scripts/": "the original repository's evaluation scripts ([C] citations)",
    "megatron/": "megatron-core's sources",
    "transformers/": "Hugging Face transformers' sources",
    "vllm/": "vLLM's sources",
    "models/gpt/": "megatron-core's sources (megatron/core/...)",
    "tensor_parallel/": "megatron-core's sources (megatron/core/...)",
    "docs/source/": "megatron-core's documentation",
    "src/encoder.py": "GPT-2's byte-level BPE (openai/gpt-2)",
    "my_project/": "docs/algorithms.md's example of a user's own file",
}
# Backticked names that start like one of our modules but are someone else's.
FOREIGN_NAMES: dict[str, str] = {
    "logging.warning": "the standard library's logging",
    "model.load_weights": "vLLM's model (its weight loader)",
    "output_layer.weight": "a megatron-core parameter's name",
}
_EXTENSIONS = ("json", "jsonl", "yaml", "md", "parquet", "txt", "pt", "safetensors")

_PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w.-]*/)+[A-Za-z_][\w-]*\.(?:py|md|yaml))(?![\w/])")
_QUALIFIED = re.compile(r"\bexgrpo_megatron(?:\.[A-Za-z_]\w*)+")
_BACKTICKED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


def _sources() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "conf").rglob("*.yaml"))]
    return files + sorted(PACKAGE.rglob("*.py"))


def _mentions(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what the file says in prose: a doc whole, a yaml file's comments, a module's docstrings
    and comments."""
    text = path.read_text()
    if path.suffix == ".md":
        return list(enumerate(text.splitlines(), 1))
    if path.suffix == ".yaml":
        return [(n, line.split("#", 1)[1]) for n, line in enumerate(text.splitlines(), 1) if "#" in line]
    out = [(n, line.split("#", 1)[1]) for n, line in enumerate(text.splitlines(), 1) if "#" in line]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out += [(node.lineno + i, line) for i, line in enumerate(node.value.splitlines())]
    return out


@cache
def _modules() -> dict[str, list[str]]:
    """Our modules by every dotted suffix of their name: "schedule" -> [experience.schedule,
    training.async_generation.schedule], "experience.schedule" -> [experience.schedule], ..."""
    out: dict[str, list[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(REPO).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        for i in range(1, len(parts)):
            out.setdefault(".".join(parts[i:]), []).append(".".join(parts))
    return out


@cache
def _classes() -> dict[str, list[str]]:
    """Our classes' names -> the modules defining them."""
    out: dict[str, list[str]] = {}
    for module in {m for ms in _modules().values() for m in ms}:
        for node in ast.walk(ast.parse(_module_file(module).read_text())):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(module)
    return out


def _module_file(module: str) -> Path:
    base = REPO / module.replace(".", "/")
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _has_attrs(module: str, attrs: list[str]) -> bool:
    """Does `module.attrs[0].attrs[1]...` exist? The module's source first (no import); what it imports, or what a
    class inherits, by importing it."""
    body: list[ast.stmt] = ast.parse(_module_file(module).read_text()).body
    for i, name in enumerate(attrs):
        found = _defined(body, name)
        if found is None:
            break
        if not isinstance(found, ast.ClassDef):
            return i == len(attrs) - 1 or _imported_has(module, attrs)
        body = found.body
    else:
        return True
    return _imported_has(module, attrs)


def _defined(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The statement of `body` (a module's or a class's) that defines `name`, a method's `self.name = ...`
    included."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and sub.attr == name
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    return sub  # type: ignore[return-value]
    return None


def _imported_has(module: str, attrs: list[str]) -> bool:
    try:
        obj: object = importlib.import_module(module)
    except ImportError:
        return False
    for name in attrs:
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        if not hasattr(obj, name) and name not in fields:
            return False
        obj = getattr(obj, name, None)
    return True


def _resolves_code(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        head, attrs = ".".join(parts[:cut]), parts[cut:]
        if head in _modules():
            return any(_has_attrs(m, attrs) for m in _modules()[head])
        if cut == 1 and head in _classes():
            return any(_has_attrs(m, parts) for m in _classes()[head])
    return False


@cache
def _config_keys() -> frozenset[str]:
    """Every config key (`algo.clip_ratio`, `rollout.generator.device`, the sections themselves), every variant's
    setting (`algo.settings.kl_coef`) and every renamed key's old name."""
    keys: set[str] = set()

    def walk(config: object, prefix: str) -> None:
        for f in dataclasses.fields(config):  # type: ignore[arg-type]
            keys.add(prefix + f.name)
            value = getattr(config, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, prefix + f.name + ".")

    walk(RootConfig(), "")
    registered_names()  # imports the variants, so every settings class is defined
    pending = [VariantSettings]
    while pending:  # a variant's own settings: algo.settings.<field> (algo/settings.py)
        cls = pending.pop()
        pending += cls.__subclasses__()
        keys |= {f"algo.settings.{f.name}" for f in dataclasses.fields(cls)}
    return frozenset(keys | set(RENAMED_KEYS))


def _is_ours(name: str) -> bool:
    first = name.split(".")[0]
    return (first in _modules() or first in _classes()) and name not in FOREIGN_NAMES


@cache
def _repo_files() -> tuple[str, ...]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    return tuple(listed)


def _file_exists(ref: str) -> bool:
    """A file of the repository at `ref`, or at `ref` below some folder of it (`async_generation/schedule.py`)."""
    return any(f == ref or f.endswith("/" + ref) for f in _repo_files())


def _problems(mentions: list[tuple[int, str]], where: str) -> list[str]:
    out = []
    for line, text in mentions:
        for ref in _PATH.findall(text):
            if not ref.startswith(tuple(FOREIGN_PATHS)) and not _file_exists(ref):
                out.append(f"{where}:{line}: file {ref}")
        for ref in _QUALIFIED.findall(text):
            if not _resolves_code(ref.removeprefix("exgrpo_megatron.")):
                out.append(f"{where}:{line}: name {ref}")
        for ref in _BACKTICKED.findall(text):
            if ref.startswith("exgrpo_megatron.") or not _is_ours(ref):
                continue
            stem, _, extension = ref.rpartition(".")
            if extension in _EXTENSIONS:
                continue
            if extension == "py":
                resolved = _file_exists(ref)
            else:
                resolved = _resolves_code(ref) or ref in _config_keys()
            if not resolved:
                out.append(f"{where}:{line}: name {ref}")
    return out


def test_every_named_file_and_name_exists():
    problems = [p for f in _sources() for p in _problems(_mentions(f), str(f.relative_to(REPO)))]
    assert not problems, "stale references:\n" + "\n".join(problems)


@pytest.mark.parametrize("stale", ["`experience/phase.py`", "training/ahead/schedule.py",
                                   "exgrpo_megatron.ahead.schedule", "`schedule.no_such_function`",
                                   "`ExperienceSchedule.replays`", "`Policy.notify_weights_changed`",
                                   "`algo.no_such_key`", "`rollout.generator.no_such_key`"])
def test_a_stale_reference_is_found(tmp_path, stale):
    """Each kind of reference, written stale into a doc, is reported once; its live twin is not."""
    doc = tmp_path / "planted.md"
    doc.write_text(f"The schedule: {stale}.\n")
    assert len(_problems(_mentions(doc), "planted.md")) == 1
    live = {"`experience/phase.py`": "`experience/schedule.py`", "training/ahead/schedule.py":
            "training/async_generation/schedule.py", "exgrpo_megatron.ahead.schedule":
            "exgrpo_megatron.training.async_generation.schedule", "`schedule.no_such_function`":
            "`schedule.solved_fraction`", "`ExperienceSchedule.replays`": "`ExperienceSchedule.collects`",
            "`Policy.notify_weights_changed`": "`Policy.weights_version`", "`algo.no_such_key`": "`algo.clip_ratio`",
            "`rollout.generator.no_such_key`": "`rollout.generator.device`"}[stale]
    doc.write_text(f"The schedule: {live}.\n")
    assert _problems(_mentions(doc), "planted.md") == []
