"""The floors of the house (docs/architecture.md): a module imports only its own floor or floors below it, and no
two files import each other, directly or through others.

Every import counts: top-level, inside functions, under `if TYPE_CHECKING:`, relative, and a string literal
that names an openk2 module (the lazy registries' tables, `importlib.import_module("openk2...")`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom to top. A top-level module or package of openk2 sits on exactly one floor.
FLOORS: list[tuple[str, ...]] = [
    ("config", "configfile", "rng", "fileio", "progress"),  # foundation: shapes, run files, randomness, atomic
    # writes, progress lines
    ("chat",),  # the K2 wire format
    ("model",),
    ("optim",),
    ("data",),
    ("infer",),  # engine, KV cache, server
    ("llm",),  # ChatModel and its backends (the local one runs the engine)
    ("rephrase",),  # LLM rewriting of pre-training text
    ("train",),
    ("agentic",),
    ("rl",),
    ("eval",),
    ("experiments",),
    ("pipeline", "cli", "__main__", ""),  # commands, the recipe that runs them, the root package
]


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, e.g. openk2.train.sft
    target: str  # imported module, e.g. openk2.chat.format
    line: int


def module_name(path: Path, src: Path) -> str:
    """`src/openk2/train/sft.py` -> `openk2.train.sft` (a package's `__init__.py` is the package)."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def known_modules(src: Path, package: str = "openk2") -> dict[str, Path]:
    """Every module of `package` under `src`, by dotted name."""
    return {module_name(p, src): p for p in sorted((src / package).rglob("*.py"))}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a module (`openk2.chat.render` -> `openk2.chat`)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The openk2 modules `module` imports, anywhere in its file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from openk2.chat import format` imports the submodule; `from openk2.chat import render` the package.
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                names.append((submodule if submodule in modules else origin, node.lineno))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # A lazy table's "module" or "module:factory", or import_module's argument ("openk2" alone is a name).
            target = node.value.partition(":")[0]
            if "." in target and target in modules:
                names.append((target, node.lineno))
    edges = set()
    for name, line in names:
        if not name.startswith("openk2"):
            continue
        target = resolve(name, modules)
        if target is not None and target != module:
            edges.add(Edge(module, target, line))
    return sorted(edges, key=lambda e: (e.line, e.target))


def floor_of(module: str, floors: list[tuple[str, ...]]) -> int:
    """The floor index of an openk2 module (by its first component below `openk2`)."""
    top = module.split(".")[1] if "." in module else ""
    for index, names in enumerate(floors):
        if top in names:
            return index
    raise AssertionError(f"{module}: top-level name {top!r} is on no floor; add it to FLOORS and docs/architecture.md")


def floor_violations(src: Path, floors: list[tuple[str, ...]], package: str = "openk2") -> list[str]:
    """One line per import that reaches a higher floor."""
    modules = known_modules(src, package)
    problems = []
    for module, path in modules.items():
        floor_of(module, floors)  # every module has a floor, imported or not
        for edge in imports_of(module, path, modules):
            here, there = floor_of(edge.source, floors), floor_of(edge.target, floors)
            if there > here:
                problems.append(f"{path.relative_to(src)}:{edge.line}: {edge.source} ({'/'.join(floors[here])}) "
                                f"imports {edge.target} ({'/'.join(floors[there])}, a higher floor)")
    return problems


def import_cycles(src: Path, package: str = "openk2") -> list[list[str]]:
    """Groups of modules that import each other (strongly connected components with more than one file).

    A package's `__init__` is not an edge into its own submodules' cycle: `openk2.chat` re-exporting
    `openk2.chat.format` while `format` imports `openk2.chat.template` is the usual package layout.
    """
    modules = known_modules(src, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for edge in imports_of(module, path, modules):
            if not edge.target.startswith(module + ".") and not module.startswith(edge.target + "."):
                graph[module].add(edge.target)
    return [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
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
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


# ---------------------------------------------------------------------------------------------- the house
def test_every_import_respects_the_floors():
    problems = floor_violations(SRC, FLOORS)
    assert not problems, "imports against the floor order:\n" + "\n".join(problems)


def test_no_import_cycles_between_files():
    cycles = import_cycles(SRC)
    assert not cycles, "modules importing each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_model_imports_no_torch_distributed():
    """Parallelism is applied to the model from outside (train/parallel)."""
    for path in sorted((SRC / "openk2" / "model").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("torch.distributed") for n in names), f"{path}:{node.lineno}"


# ------------------------------------------------------------------------------ the checker on a made-up tree
def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "openk2" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


SMALL_FLOORS = [("config",), ("model",), ("train",), ("cli", "")]
CLEAN = {
    "__init__.py": "",
    "config.py": "import json\n",
    "model/__init__.py": "from openk2.model.layers import Block\n",
    "model/layers.py": "from openk2.config import *\nfrom . import helpers\n",
    "model/helpers.py": "",
    "train/__init__.py": "",
    "train/loop.py": "from ..model import layers\n",
    "cli/__init__.py": "TABLE = {'train': 'openk2.train.loop'}\n",
}


def test_checker_accepts_a_clean_tree(tmp_path):
    src = _tree(tmp_path, CLEAN)
    assert floor_violations(src, SMALL_FLOORS) == []
    assert import_cycles(src) == []


@pytest.mark.parametrize(("file", "text", "expect"), [
    ("model/layers.py", "from openk2.train.loop import x\n", "openk2.model.layers (model) imports openk2.train.loop"),
    ("model/layers.py", "def f():\n    from openk2 import train\n", "imports openk2.train (train"),
    ("model/layers.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import openk2.cli\n",
     "imports openk2.cli (cli/, a higher floor)"),
    ("model/helpers.py", "from ..train import loop\n", "openk2.model.helpers (model) imports openk2.train.loop"),
    ("config.py", "import importlib\nM = importlib.import_module('openk2.model.layers')\n",
     "openk2.config (config) imports openk2.model.layers"),
    ("model/helpers.py", "TABLE = {'x': 'openk2.train.loop:Loop'}\n",
     "openk2.model.helpers (model) imports openk2.train"),
])
def test_checker_finds_a_forbidden_import(tmp_path, file, text, expect):
    src = _tree(tmp_path, {**CLEAN, file: text})
    problems = floor_violations(src, SMALL_FLOORS)
    assert len(problems) == 1 and expect in problems[0], problems


def test_checker_finds_a_cycle_within_a_floor(tmp_path):
    src = _tree(tmp_path, {**CLEAN, "model/helpers.py": "def f():\n    from openk2.model import layers\n"})
    assert floor_violations(src, SMALL_FLOORS) == []
    assert import_cycles(src) == [["openk2.model.helpers", "openk2.model.layers"]]


def test_checker_names_a_package_missing_from_the_floors(tmp_path):
    src = _tree(tmp_path, {**CLEAN, "extra.py": ""})
    with pytest.raises(AssertionError, match="'extra' is on no floor"):
        floor_violations(src, SMALL_FLOORS)
