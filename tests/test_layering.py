"""The layering, read from the imports of every module under tessera/ (those inside functions too): the config
schema at the bottom, families that import neither each other nor the trainer, no circle, and nothing that
imports an entry point (`__main__`)."""

import ast
import pathlib

import pytest

pytestmark = pytest.mark.fast

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tessera"
FAMILY_SHARED = {"common", "contract"}  # what families may import of tessera.models, beside their own folder
ABOVE_FAMILIES = {"tessera.trainer", "tessera.train", "tessera.generate", "tessera.plan", "tessera.estimate"}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: pathlib.Path) -> set[str]:
    """The tessera modules `path` imports, wherever in it (a name imported from a package counts as the
    package's module when it is not a module itself)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                head = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(head + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_config_imports_nothing_else_of_tessera():
    """tessera/config is the schema; what needs the rest of Tessera is in tessera.preflight, above it. Its
    `python -m tessera.config` entry point (not part of the package's imports) runs that."""
    wrong = {(m, i) for m, deps in GRAPH.items() if under(m, "tessera.config") and m != "tessera.config.__main__"
             for i in deps if not under(i, "tessera.config")}
    assert not wrong, sorted(wrong)


def family_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["tessera", "models"] and parts[2] not in FAMILY_SHARED:
        return parts[2]
    return None


def test_families_import_neither_each_other_nor_the_trainer():
    wrong = set()
    for m, deps in GRAPH.items():
        own = family_of(m)
        if own is None:
            continue
        for i in deps:
            other = family_of(i)
            if (other is not None and other != own) or any(under(i, top) for top in ABOVE_FAMILIES):
                wrong.add((m, i))
    assert not wrong, sorted(wrong)


def test_shared_model_code_imports_no_family():
    wrong = {(m, i) for m, deps in GRAPH.items() if under(m, "tessera.models.common") or m == "tessera.models.contract"
             for i in deps if family_of(i) is not None}
    assert not wrong, sorted(wrong)


def test_no_module_imports_an_entry_point():
    wrong = {(m, i) for m, deps in GRAPH.items() for i in deps if i.endswith(".__main__")}
    assert not wrong, sorted(wrong)


def test_no_import_circle():
    """Strongly connected components of the import graph (Tarjan's): each must be one module."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_reader_sees_imports():
    """The reader itself: it finds a family's known imports (so an empty finding above means something)."""
    assert "tessera.models.contract" in GRAPH["tessera.models.flux"]
    assert "tessera.config.sections" in GRAPH["tessera.preflight"]
    assert "tessera.models.flux.data" in GRAPH["tessera.models.flux.cache"]
