"""The package's layout rules (docs/design.md): no import cycles between modules nor between the folders of
``hf_meshtune/``, and torchft's private internals reached from one package only (``dp/diloco/``, whose
``TORCHFT_INTERNALS`` lists them)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from hf_meshtune.dp.diloco import TORCHFT_INTERNALS

PACKAGE = Path(__file__).resolve().parents[1] / "hf_meshtune"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports when it is imported (top level, ``TYPE_CHECKING`` blocks aside)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {t for t in [target, *(f"{target}.{a.name}" for a in node.names)] if t in modules}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_meshtune"):
            found |= {t for t in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if t in modules}
    return found


def test_no_module_imports_one_that_imports_it_back():
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _runtime_imports(path, set(paths)) for name, path in paths.items()}
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other back:\n" + "\n".join(cycles)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every cycle a depth-first walk of ``graph`` (node → the nodes it imports) meets, as ``a -> b -> a``."""
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                cycles.append(" -> ".join(stack[stack.index(child) :] + [child]))
            elif child not in state:
                visit(child, [*stack, child])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def _all_imports(path: Path, modules: set[str]) -> set[str]:
    """Every package module ``path`` imports, lazily inside a function or at the top (``TYPE_CHECKING`` aside).

    ``from X import name`` counts as an import of module ``X.name`` where that is a module, else of ``X``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found, todo = set(), [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hf_meshtune")):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
    return found & modules


def _folder(module: str) -> str:
    """The layout node a module belongs to: its top-level folder of ``hf_meshtune/``, or itself if top-level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hf_meshtune"


def folder_graph() -> dict[str, set[str]]:
    """Which top-level folders (and top-level modules) of ``hf_meshtune/`` import which, lazy imports included."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = graph.setdefault(_folder(name), set())
        edges |= {_folder(t) for t in _all_imports(path, set(paths))} - {_folder(name)}
    return graph


def test_no_folder_imports_one_that_imports_it_back():
    """Folders meet one way only: counting every import, lazy ones too, the folder graph has no cycle."""
    graph = folder_graph()
    assert {"anchor", "dp", "pipeline"} <= graph["runtime"]  # the parser sees the imports it is to judge
    cycles = _cycles(graph)
    assert not cycles, "folders that import each other back:\n" + "\n".join(cycles)


def test_torchft_internals_are_reached_from_dp_diloco_only():
    adapter = PACKAGE / "dp" / "diloco"
    private = sorted({attribute for _, attribute, _ in TORCHFT_INTERNALS if attribute.startswith("_")})
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, private)) + r")\b|from torchft[\w.]* import [^\n]*\b_\w+")
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text.strip()}"
                 for path in PACKAGE.rglob("*.py") if adapter not in path.parents
                 for line, text in enumerate(path.read_text().splitlines(), 1) if pattern.search(text)]  # fmt: skip
    assert not offenders, offenders
    assert any(pattern.search(p.read_text()) for p in adapter.glob("*.py"))  # the pattern finds the real uses


def test_the_package_version_is_the_one_pyproject_declares():
    import tomllib

    import hf_meshtune

    declared = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["version"]
    assert hf_meshtune.__version__ == declared
