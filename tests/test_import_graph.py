"""The package's import graph has no cycles: no module imports itself through others, and the folders form
layers — each folder imports only folders below it (so no two folders import each other, and machine/ at the
bottom imports nothing else of the package). Imports inside functions and TYPE_CHECKING blocks count: a
lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "exgrpo_megatron"
REPO = Path(__file__).resolve().parents[1]

# Bottom-up: a folder (or top-level module, or a member of training/) may import only those listed before it.
LAYERS: tuple[str, ...] = (
    "machine",  # what this machine offers (its CPU's bf16 unit): stdlib + torch only
    "config",  # the schema, its domains, validation, values derived from it
    "planning",  # the dry run, the model's size, the generating-ahead GPU split, start-up checks
    "distributed",  # launch environment, process groups, CPU shims, preemption signals
    "experience",  # the experience pool and the phase schedule (warm-up -> collecting -> mixed)
    "algo",  # the algorithm object (reads the phase), advantages and the loss: pure tensor functions
    "data",  # datasets, prompt templates, tokenizers, the sampler, the step plan
    "model",  # the GPTModel builder
    "checkpoint",
    "convert",  # HF <-> megatron mapping; seals its output with checkpoint/integrity's manifest
    "logging",
    "rollout",  # engines, their factory, group generation
    "reward",  # grading, rollout rewards
    "training",  # the training loop package's own __init__ (a docstring: imported with each member)
    "training.rollout_service",  # generation + grading for a list of question groups
    "policy",  # the trained policy: schedule, optimizer, log-probs
    "training.step_metrics",
    "training.step_observer",  # the hooks a run's observers receive (they only look at the trainer's objects)
    "training.components",  # what a run is built from
    "training.async_generation",  # generating ahead of training: the schedule, the generator process, the link
    "evaluate",  # the benchmark evaluation CLI
    "training.heldout_accuracy",  # in-training validation (avg@k on the held-out set)
    "training.run_state",
    "training.trainer",
    "train",  # the training CLI
    "",  # the package's own __init__
)


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports (`from a import b` counts a, and a.b where that is a module)."""
    mods = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            edges[module] |= {n for n in names if n in mods and n != module}
    return edges


def module_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def folder(module: str) -> str:
    """exgrpo_megatron.config.schema -> config; the package -> ''. The training loop's package is layered by its
    members: exgrpo_megatron.training.trainer -> training.trainer, exgrpo_megatron.training.async_generation.link
    -> training.async_generation."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "training":
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else ""


def layering_violations(edges: dict[str, set[str]]) -> list[str]:
    """`importer -> imported` for every import of a folder that is not below the importer's in LAYERS."""
    bad = []
    for module, imported in sorted(edges.items()):
        for target in sorted(imported):
            a, b = folder(module), folder(target)
            if a == b:
                continue
            if a not in LAYERS or b not in LAYERS:
                bad.append(f"{module} -> {target}: place folder {a if a not in LAYERS else b!r} in LAYERS")
            elif LAYERS.index(a) < LAYERS.index(b):
                bad.append(f"{module} -> {target}: {a} is below {b}")
    return bad


def mutual_folder_pairs(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    pairs = {(folder(m), folder(t)) for m, ts in edges.items() for t in ts if folder(m) != folder(t)}
    return {(a, b) for a, b in pairs if (b, a) in pairs and a < b}


def test_no_module_imports_itself_through_others():
    assert module_cycles(import_graph(REPO)) == []


def test_folders_import_only_the_layers_below_them():
    edges = import_graph(REPO)
    assert layering_violations(edges) == []
    assert mutual_folder_pairs(edges) == set()
    assert all(folder(t) == "machine" for m, ts in edges.items() if folder(m) == "machine" for t in ts)


def test_the_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    pkg = tmp_path / PACKAGE
    for path, text in {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/schema.py": "from exgrpo_megatron.model import builder\n",  # config -> model: upward
        "model/__init__.py": "",
        "model/builder.py": "def f():\n    from exgrpo_megatron.config.schema import X\n",  # lazy, still counts
        "reward/__init__.py": "",
        "reward/a.py": "import exgrpo_megatron.reward.b\n",
        "reward/b.py": "from exgrpo_megatron.reward import a\n",
    }.items():
        (pkg / path).parent.mkdir(parents=True, exist_ok=True)
        (pkg / path).write_text(text)
    edges = import_graph(tmp_path)
    cycles = module_cycles(edges)
    assert sorted(cycles) == [["exgrpo_megatron.config.schema", "exgrpo_megatron.model.builder"],
                              ["exgrpo_megatron.reward.a", "exgrpo_megatron.reward.b"]]
    assert layering_violations(edges) == [f"exgrpo_megatron.config.schema -> {target}: config is below model"
                                          for target in ("exgrpo_megatron.model", "exgrpo_megatron.model.builder")]
    assert mutual_folder_pairs(edges) == {("config", "model")}
