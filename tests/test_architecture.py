"""The map in ARCHITECTURE.md stays true: layers import only downward, rooms do not lean on each
other in circles, no library file is longer than a sitting, and the reading path lists real files.

Imports are read from the source (every ``import`` and ``from ... import``, at any depth), so a
lazy import inside a function counts as much as one at the top of a file.
"""
import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minidist"

# Lowest first. A module may import from its own layer and the layers before it, never after.
LAYERS = [
    ("machine", ["minidist.device", "minidist.allocator", "minidist.threads", "minidist.process_tree",
                 "minidist.files", "minidist.untrusted", "minidist.folder_lock", "minidist.waiting"]),
    ("collectives", ["minidist.comm"]),
    ("autograd", ["minidist.autograd"]),
    ("building blocks", ["minidist.nn", "minidist.optim", "minidist.amp", "minidist.data", "minidist.inspect",
                         "minidist.tune"]),
    ("the model", ["minidist.moe", "minidist.model"]),
    ("shared rules", ["minidist.parallel.mesh", "minidist.parallel.compose", "minidist.parallel"]),
    ("one room per idea", ["minidist.parallel.data", "minidist.parallel.tensor", "minidist.parallel.context",
                           "minidist.parallel.expert", "minidist.parallel.zero", "minidist.parallel.pipeline",
                           "minidist.parallel.ps"]),
    ("composition", ["minidist.parallel.step", "minidist.parallel.state", "minidist.parallel.spec",
                     "minidist.parallel.whole_model", "minidist.parallel.drop_replicas", "minidist.checkpoint"]),
    ("entry points", ["minidist.train", "minidist.run", "minidist.plan", "minidist.support_matrix", "minidist"]),
]
ROOMS = LAYERS[6][1]
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The index of the layer whose longest matching prefix names ``module``."""
    best, where = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), index
    assert where is not None, f"{module} is in no layer of tests/test_architecture.py"
    return where


def imports(path: Path) -> set[str]:
    """The minidist modules ``path`` imports (``from minidist import x``: minidist.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "minidist":
            if node.module == "minidist":
                found.update(f"minidist.{a.name}" for a in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "minidist")
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_layers_import_only_downward():
    upward = []
    for path in SOURCES:
        me = module_name(path)
        for target in imports(path):
            if layer_of(target) > layer_of(me):
                upward.append(f"{me} ({LAYERS[layer_of(me)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_rooms_do_not_import_each_other_in_circles():
    def room(module):
        return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)
    leans = defaultdict(set)
    for path in SOURCES:
        mine = room(module_name(path))
        for target in imports(path):
            theirs = room(target)
            if mine and theirs and theirs != mine:
                leans[mine].add(theirs)
    circles = [(a, b) for a in leans for b in leans[a] if a in leans.get(b, ())]
    assert not circles, f"rooms importing each other: {circles}"


def module_graph() -> dict[str, set[str]]:
    """{module: the minidist modules it imports}, files as nodes: ``from minidist.comm import ring``
    is an edge to ``minidist.comm.ring`` (a module), ``from minidist.comm import init`` to the
    package ``minidist.comm`` (its ``__init__``), and ``from minidist.x.y import name`` to ``minidist.x.y``."""
    names = {module_name(p) for p in SOURCES}
    graph = defaultdict(set)
    for path in SOURCES:
        me = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "minidist":
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "minidist"]
            else:
                continue
            for target in targets:
                while target not in names and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != me:
                    graph[me].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle_but_the_autograds():
    """Modules import each other in no circle, lazy imports included, but inside the autograd: a
    Tensor's operators are Functions and a Function makes Tensors (tensor <-> ops)."""
    found = [c for c in circles(module_graph()) if not all(m.startswith("minidist.autograd.") for m in c)]
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the finder finds one


def test_no_library_file_is_longer_than_a_sitting():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"library files over {MAX_LINES} lines: {long}"


def reading_path() -> list[tuple[str, int]]:
    """(file, stated line count) of every row of ARCHITECTURE.md's reading path."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Reading path"):]
    return [(m.group(1), int(m.group(2))) for m in re.finditer(r"`(minidist/[\w/]+\.py)` +\((\d+)\)", section)]


def test_architecture_md_reading_path_names_real_files_at_most_300_lines():
    rows = reading_path()
    assert len(rows) >= 20
    for file, stated in rows:
        actual = len((ROOT / file).read_text().splitlines())
        assert actual <= 300, f"{file}: {actual} lines on the reading path (at most 300)"
        assert abs(actual - stated) <= 15, f"ARCHITECTURE.md says {file} has {stated} lines; it has {actual}"


@pytest.mark.parametrize("phrase", ["ARCHITECTURE.md"])
def test_the_readme_links_the_map(phrase):
    assert phrase in (ROOT / "README.md").read_text()
