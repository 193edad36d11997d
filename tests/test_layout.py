"""The package's shape: the public names, subpackages named after the parts, no import
cycle, no class that owns too much.  These are the promises of docs/ARCHITECTURE.md."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import reachy_memory

PACKAGE = Path(reachy_memory.__file__).parent

# The public face: adding a name is a decision, removing one breaks users.
PUBLIC = [
    "DEFAULT_EMBEDDER", "AlreadyRunningError", "AsyncMemoryClient", "BusyError", "ClosedError", "Config",
    "RememberingPausedError",
    "ConfigError", "CorruptionError", "DaemonUnavailableError", "Embedder", "FormatVersionError", "Memory",
    "MemoryClient", "MemoryManager", "MemoryStore", "MemoryType", "ModelError", "ModelMismatchError",
    "ModelUnavailableError", "NotFoundError", "OnnxEmbedder", "ProtocolError", "ReachyMemoryError",
    "ReadOnlyError", "RemoteError", "RequestTimeoutError", "SearchResult", "ServiceError", "StorageError",
    "StorageFullError", "StoreLockedError", "TooLargeError", "ValidationError", "load_config", "load_embedder",
]
PARTS = {"engine", "people", "storage", "embedding", "daemon", "integrations"}
MAX_TOP_MODULES = 15
MAX_CLASS_LINES = 600


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def module_level_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports when it loads (not in functions, not for type checkers)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, ast.Try | ast.If) else [node]:
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("reachy_memory"):
                out.add(sub.module)
                out.update(f"{sub.module}.{a.name}" for a in sub.names if f"{sub.module}.{a.name}" in known)
            elif isinstance(sub, ast.Import):
                out.update(a.name for a in sub.names if a.name.startswith("reachy_memory"))
    out.discard(name)
    return out & known


def test_the_public_names_are_exactly_these() -> None:
    assert sorted(reachy_memory.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(reachy_memory, name) is not None


def test_the_parts_are_subpackages_and_the_top_stays_small() -> None:
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages >= PARTS
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= MAX_TOP_MODULES, sorted(top)


def test_no_import_cycle() -> None:
    mods = modules()
    graph = {name: module_level_imports(name, path, set(mods)) for name, path in mods.items()}
    # a package's __init__ importing its own submodules is not a cycle worth naming
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*stack[stack.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_no_class_owns_too_much() -> None:
    big = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    big.append(f"{name}.{node.name}: {lines} lines")
    assert not big, big
