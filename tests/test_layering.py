"""The layering, read from the imports of every module under tessera/ (those inside functions too;
scripts/import_floors.py reads them): every module on a floor, importing only from below it (its own part, a
sibling part before its own, a lower floor), commands on the top floor only; the config schema at the bottom,
model groups that import neither each other nor the trainer, families that import no other family (what a group's
families share is the group's own code, which imports none of them), no circle, and nothing that imports an entry
point (`__main__`)."""

import ast
import pathlib

import pytest

from scripts import import_floors as floors
from scripts.import_floors import GRAPH, MODULES, ROOT, group_of, under

pytestmark = pytest.mark.fast

ABOVE_MODELS = {"tessera.trainer", "tessera.train", "tessera.generate", "tessera.plan", "tessera.estimate"}


def test_config_imports_nothing_else_of_tessera():
    """tessera/config is the schema; what needs the rest of Tessera is in tessera.preflight, above it. Its
    `python -m tessera.config` entry point (not part of the package's imports) runs that."""
    wrong = {(m, i) for m, deps in GRAPH.items() if under(m, "tessera.config") and m != "tessera.config.__main__"
             for i in deps if not under(i, "tessera.config")}
    assert not wrong, sorted(wrong)


def test_groups_import_neither_each_other_nor_the_trainer():
    wrong = set()
    for m, deps in GRAPH.items():
        own = group_of(m)
        if own is None:
            continue
        for i in deps:
            other = group_of(i)
            if (other is not None and other != own) or any(under(i, top) for top in ABOVE_MODELS):
                wrong.add((m, i))
    assert not wrong, sorted(wrong)


def test_a_groups_families_import_only_its_shared_code_never_each_other():
    assert not floors.within_groups(), floors.within_groups()
    assert "tessera.models.qwen3_5.moe" in floors.FAMILY_FOLDERS  # the registry was read: the finding means something


def test_the_group_rule_finds_a_family_importing_its_sibling_and_shared_code_importing_a_family():
    made_up = {"tessera.models.qwen3_5.moe.args": {"tessera.models.qwen3_5.dense.args", "tessera.models.qwen3_5.args"},
               "tessera.models.qwen3_5.counts": {"tessera.models.qwen3_5.moe"},
               "tessera.models.qwen3_5.model": {"tessera.models.common.attention"},
               "tessera.models.llama3.hf": {"tessera.models.common.hf"}}
    assert floors.within_groups(made_up) == [("tessera.models.qwen3_5.counts", "tessera.models.qwen3_5.moe"),
                                             ("tessera.models.qwen3_5.moe.args", "tessera.models.qwen3_5.dense.args")]


def test_shared_model_code_imports_no_group():
    wrong = {(m, i) for m, deps in GRAPH.items() if under(m, "tessera.models.common") or m == "tessera.models.contract"
             for i in deps if group_of(i) is not None}
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
    assert "tessera.config.sections" in GRAPH["tessera.preflight.options"]
    assert "tessera.data.encoded" in GRAPH["tessera.cache"]
    assert "tessera.preflight" in GRAPH["tessera.loss_compare"]  # imported inside a function
    assert "tessera.preflight" in GRAPH["tessera.config_cli"]
    assert "tessera.models.common.hf" in GRAPH["tessera.models"]


def test_every_module_is_on_a_floor():
    """A new module is given its place in scripts/import_floors.py: FLOORS (then `--write` the table)."""
    assert not floors.unplaced(), floors.unplaced()


def test_every_import_points_down():
    """A module imports only its own part, a sibling part listed before its own on its floor, or a lower floor."""
    assert not floors.upward_imports(), floors.upward_imports()


def test_the_floor_rule_finds_what_climbs():
    """The rule itself, on imports that climb: a floor up, a sibling part above, another group (from a family or
    from a group's shared code), a family's command reaching the launcher (so an empty finding above means
    something); what points down passes."""
    climbing = {"tessera.checkpoint.manager": {"tessera.trainer"}, "tessera.muon": {"tessera.checkpoint.plain"},
                "tessera.models.flux.data": {"tessera.models.llama3.args"}, "tessera.data.tokens": {"tessera.config"},
                "tessera.models.flux.generate": {"tessera.preflight"},
                "tessera.models.qwen3_5.model": {"tessera.models.deepseek.v3.model", "tessera.models.qwen3_5.args"}}
    assert floors.upward_imports(climbing) == [("tessera.checkpoint.manager", "tessera.trainer"),
                                               ("tessera.models.flux.data", "tessera.models.llama3.args"),
                                               ("tessera.models.flux.generate", "tessera.preflight"),
                                               ("tessera.models.qwen3_5.model", "tessera.models.deepseek.v3.model"),
                                               ("tessera.muon", "tessera.checkpoint.plain")]
    assert floors.part_of("tessera.models.flux.generate") == ("tessera.models.flux", floors.GROUP)
    assert floors.part_of("tessera.models.qwen3_5.moe.hf") == ("tessera.models.qwen3_5", floors.GROUP)


def test_commands_are_on_the_top_floor_only():
    """What runs as a program (`python -m ...`) sits on the top floor, and nothing below it runs as one."""
    assert floors.commands_below_top() == []  # a family gives functions (ModelSpec), never a command
    top = {m for m in MODULES if floors.position(floors.part_of(m)[1])[0] == floors.TOP}
    assert {"tessera.train", "tessera.generate", "tessera.convert", "tessera.plan", "tessera.estimate.__main__",
            "tessera.loss_compare", "tessera.cache", "tessera.config_cli", "tessera.config.__main__"} <= top
    assert floors.runs_as_program("tessera.cache") and not floors.runs_as_program("tessera.preflight")


def test_the_floor_table_in_internals_is_current():
    doc = floors.DOC.read_text()
    assert floors.with_table(doc) == doc, "docs/internals.md's import floors are stale: run " \
                                          "`python scripts/import_floors.py --write`"


# Module-level containers the module itself fills or changes: process-wide state, which a second run in the same
# process (tests, notebooks) inherits. Run state belongs to the run's objects (the world, the model, the loader).
# Memoized functions (functools.cache / lru_cache) are not such state: the line above each says why it is safe
# ("Memoized safely: ...": pure, keyed by all it reads).
MUTATORS = {"append", "add", "clear", "update", "setdefault", "pop", "popitem", "extend", "insert", "remove",
            "discard"}


def mutable_bindings(body: list[ast.stmt]) -> set[str]:
    """Names that the statements of `body` bind to a mutable container (a dict, list or set)."""
    containers = set()
    for node in body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in
            ("dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"))
        if mutable:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            containers |= {t.id for t in targets if isinstance(t, ast.Name)}
    return containers


def changed_names(tree: ast.AST, attribute: bool) -> set[str]:
    """Names whose container is changed anywhere in `tree`: by a mutating method, or by assigning or deleting an
    item or slice; plain names (`x.add`), or with `attribute` the last name of a dotted one (`cls.x.add`)."""
    def name(node: ast.expr) -> str | None:
        if attribute:
            return node.attr if isinstance(node, ast.Attribute) else None
        return node.id if isinstance(node, ast.Name) else None

    changed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            changed.add(name(node.func.value))
        for target in getattr(node, "targets", None) or ([node.target] if isinstance(node, ast.AugAssign) else []):
            if isinstance(target, ast.Subscript):
                changed.add(name(target.value))
    return changed - {None}


def module_state(tree: ast.Module) -> set[str]:
    """Names bound at module level, or in a class body (as `Class.name`: shared by every instance), to a mutable
    container that the module changes."""
    found = mutable_bindings(tree.body) & changed_names(tree, attribute=False)
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        found |= {f"{cls.name}.{n}" for n in mutable_bindings(cls.body) & changed_names(cls, attribute=True)}
    return found


def memoized(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, the line above it) of each functools.cache / lru_cache decorator in `path`."""
    lines = path.read_text().splitlines()
    return [(i + 1, lines[i - 1]) for i, line in enumerate(lines)
            if line.startswith(("@functools.cache", "@functools.lru_cache", "@cache", "@lru_cache"))]


def test_no_process_wide_state():
    """Run state (a run's encoders, what it warned, the timeout in force, a forward's masks) lives in the run's
    objects, not in module-level containers: one fails here (hand it to the object that owns it instead)."""
    found = {f"{m}.{n}" for m, path in MODULES.items() for n in module_state(ast.parse(path.read_text()))}
    assert not found, sorted(found)
    memos = {f"{path.relative_to(ROOT)}:{n}": why for path in MODULES.values() for n, why in memoized(path)}
    assert len(memos) >= 3 and not [m for m, why in memos.items() if "Memoized safely" not in why], memos
    removed = ("_BUILT: dict = {}\n_warned: set[str] = set()\ndef f(k):\n    _BUILT[k] = 1\n    _warned.add(k)\n"
               "class G:\n    _groups: dict = {}\n    @classmethod\n    def new(cls, k):\n        cls._groups[k] = 1\n"
               "_gathered: list = [None, None]\ndef g(x):\n    _gathered[:] = [x, x]\n")
    assert module_state(ast.parse(removed)) == {"_BUILT", "_warned", "G._groups", "_gathered"}  # the kinds removed


def module_aliases(tree: ast.Module) -> dict[str, str]:
    """The names a module binds to Tessera modules (`from tessera.models.common import attention`, `import
    tessera.x as y`): {name: module}."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name: a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tessera"):
            names |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                      if f"{node.module}.{a.name}" in MODULES}
    return names


def module_attribute_writes(tree: ast.Module) -> list[str]:
    """Assignments to an attribute of a Tessera module, or of something in one (`attention.attend = ...`,
    `attention.CausalSDPA.attend = ...`): a function swapped for the whole process."""
    aliases, found = module_aliases(tree), []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in (t for top in targets for t in (top.elts if isinstance(top, ast.Tuple) else [top])):
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in aliases:
                found.append(ast.unparse(target))
    return found


def test_no_tessera_function_is_swapped():
    """Product code never assigns to a Tessera module's attributes (the estimate gives its traced models their
    kernels instead: tessera.estimate.trace.gpu_attention, scans.scans_at_once). On made-up code, the rule finds
    the swaps it replaced."""
    found = {m: writes for m, path in MODULES.items()
             if (writes := module_attribute_writes(ast.parse(path.read_text())))}
    assert not found, found
    swapped = ("from tessera.models.common import attention, deltanet\nimport tessera.memory as memory\n"
               "def f(g):\n    attention.attend, attention.CausalSDPA.attend = g, staticmethod(g)\n"
               "    deltanet.delta_scan = g\n    memory.x: int = 1\n    local = object()\n    local.attend = g\n")
    assert module_attribute_writes(ast.parse(swapped)) == ["attention.attend", "attention.CausalSDPA.attend",
                                                           "deltanet.delta_scan", "memory.x"]


def reaches(module: str, graph: dict = GRAPH) -> set[str]:
    """Every module `module` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for i in graph.get(todo.pop(), ()):
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return seen


def test_commands_that_only_parse_flags_import_the_schema_not_the_checks():
    """generate, convert and cache read a config (tessera.schema) and never validate one: the checks
    (tessera.preflight, with what they import) are not theirs to load. On made-up imports, the rule catches one
    through another module."""
    parse_only = ("tessera.generate", "tessera.convert", "tessera.cache")
    wrong = {(m, i) for m in parse_only for i in reaches(m) if under(i, "tessera.preflight")}
    assert not wrong, sorted(wrong)
    assert all("tessera.schema" in reaches(m) for m in parse_only)
    made_up = {"tessera.cache": {"tessera.data"}, "tessera.data": {"tessera.preflight.data"}}
    assert "tessera.preflight.data" in reaches("tessera.cache", made_up)
