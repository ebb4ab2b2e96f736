"""The house's shape (issue 34): few plain modules at jllama's top, no import circles.

An import circle here is two modules each importing the other, directly or round a longer
loop, at the top of the file or inside a function (a deferred import still ties the two
together); imports under `if TYPE_CHECKING:` are annotations only and do not count.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import jllama

REPO = Path(__file__).parent.parent


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(folder: Path, prefix: str) -> dict[str, set[str]]:
    """Module name -> the names of the modules in `folder` it imports. `prefix` is the dotted
    name of `folder` ("jllama"), or "" for a folder of scripts importing each other by bare
    name (bench/)."""
    modules = {}
    for path in folder.rglob("*.py"):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(([prefix] if prefix else []) + parts)] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            else:
                targets = []
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
                    break
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
                        found.append(sorted(component))
    return found


def test_circle_finder_finds_a_circle_worked_out_by_hand():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_at_most_six_plain_modules_at_the_top_of_jllama():
    plain = [m.name for m in pkgutil.iter_modules(jllama.__path__) if not m.ispkg]
    assert len(plain) <= 6, plain


def test_no_import_circle_among_jllamas_modules():
    assert circles(import_graph(REPO / "jllama", "jllama")) == []


def test_no_import_circle_among_the_bench_scripts():
    assert circles(import_graph(REPO / "bench", "")) == []


def test_the_old_top_level_paths_still_import_with_a_warning():
    import importlib
    import sys
    import warnings

    sys.modules.pop("jllama.session", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("jllama.session")
    assert old is importlib.import_module("jllama.generation.session")
    assert any("jllama.generation.session" in str(w.message) for w in caught)
