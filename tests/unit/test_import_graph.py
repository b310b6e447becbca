"""The project's import graph (issue 29: no import cycles).

Every .py file of trainer/, models/ and tessera/ is parsed with `ast` (nothing is imported); an edge A -> B is an
import in module A of project module B, at module level (class bodies, `if` / `try` blocks included) or inside a
function. `import a.b` is an edge to a.b; `from a import b` is an edge to the submodule a.b when that is a module,
else to a (a package's `__init__.py` is module a). Relative imports are resolved against the importing package.

* no cycles: Tarjan's strongly connected components; each one is printed with its simple cycles and the import
  lines (file:line) of the edges inside it;
* models/ imports nothing from trainer/ (model code knows no strategy or run);
* a function-local import of a project module says why it is local: a comment on its line, or on the line above
  (a comment above a contiguous run of import lines covers the run), e.g. `# optional dependency`,
  `# start-up time`, `# cycle: ...`. Function-local imports of third-party packages are not policed (they keep an
  optional dependency optional, or cut start-up).

Run as a script (`python tests/unit/test_import_graph.py [checkout]`) it prints the cycles, the function-local
project imports per folder and those without a reason.
"""
from __future__ import annotations

import ast
import io
import os
import re
import sys
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("trainer", "models", "tessera")

# (file, imported module) pairs of function-local project imports allowed without a reason comment; keep empty.
ALLOWED_WITHOUT_REASON: Set[Tuple[str, str]] = set()

# tool pragmas are no reason: `# noqa: F401 - optional dependency` gives "optional dependency"
_PRAGMA = re.compile(r"\bnoqa\b(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?|\btype:\s*ignore(\[[^\]]*\])?"
                     r"|\bpragma:\s*no\s*cover\b|\bpylint:\s*disable=\S+|\bfmt:\s*(on|off|skip)\b")


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported project module
    path: str  # file of the importing module, relative to the repository root
    line: int  # the import statement's first line
    end_line: int  # its last line
    local: bool  # inside a function

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def project_modules(root: str = ROOT) -> Dict[str, str]:
    """{dotted module name: file path relative to root} of every .py file of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, name), root)
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = rel
    return modules


def _is_package(module: str, modules: Dict[str, str]) -> bool:
    return modules.get(module, "").endswith("__init__.py")


def _known(name: str, modules: Dict[str, str]) -> Optional[str]:
    """`name` if it is a project module, else its nearest ancestor that is one (None outside the project)."""
    if name.split(".")[0] not in PACKAGES:
        return None
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, module: str, modules: Dict[str, str]) -> List[str]:
    """The project modules an Import / ImportFrom node imports."""
    if isinstance(node, ast.Import):
        return [t for t in (_known(a.name, modules) for a in node.names) if t]
    if node.level:  # relative: against the importing package
        base = module.split(".")
        if not _is_package(module, modules):
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)]
        package = ".".join(base + ([node.module] if node.module else []))
    else:
        package = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{package}.{alias.name}"
        target = sub if sub in modules else _known(package, modules)
        if target and target not in out:
            out.append(target)
    return out


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, path: str, modules: Dict[str, str]):
        self.module, self.path, self.modules = module, path, modules
        self.depth = 0
        self.edges: List[Edge] = []

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _import(self, node):
        for target in _targets(node, self.module, self.modules):
            self.edges.append(Edge(self.module, target, self.path, node.lineno,
                                   getattr(node, "end_lineno", node.lineno), self.depth > 0))

    visit_Import = visit_ImportFrom = _import


def import_edges(root: str = ROOT) -> List[Edge]:
    modules = project_modules(root)
    edges = []
    for module, path in sorted(modules.items()):
        with open(os.path.join(root, path), encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        visitor = _Imports(module, path, modules)
        visitor.visit(tree)
        edges.extend(visitor.edges)
    return edges


def strongly_connected(nodes, graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only those that hold a cycle (more than
    one module, or a module importing itself)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    out = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    out.append(sorted(component))
    return sorted(out)


def simple_cycles(component: List[str], graph: Dict[str, Set[str]], limit: int = 200) -> List[List[str]]:
    """The simple cycles inside one component (each starting at its smallest module), at most `limit`."""
    members = set(component)
    cycles: List[List[str]] = []

    def extend(path: List[str], seen: Set[str]):
        if len(cycles) >= limit:
            return
        for child in sorted(graph.get(path[-1], ()) & members):
            if child == path[0]:
                cycles.append(path + [child])
            elif child > path[0] and child not in seen:
                seen.add(child)
                extend(path + [child], seen)
                seen.discard(child)

    for start in sorted(members):
        extend([start], {start})
    return cycles


def graph_of(edges: List[Edge]) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = defaultdict(set)
    for e in edges:
        graph[e.source].add(e.target)
    return graph


def describe_cycles(edges: List[Edge]) -> Tuple[List[List[str]], str]:
    """(the components that hold a cycle, a report of each: its cycles and the import lines of its edges)."""
    graph = graph_of(edges)
    components = strongly_connected({e.source for e in edges} | {e.target for e in edges}, graph)
    lines = []
    for component in components:
        members = set(component)
        lines.append(f"import cycle among {len(component)} modules: {', '.join(component)}")
        cycles = simple_cycles(component, graph)
        for cycle in cycles:
            lines.append("  cycle: " + " -> ".join(cycle))
        lines.append("  imports inside it:")
        for e in sorted(edges, key=lambda e: (e.path, e.line)):
            if e.source in members and e.target in members:
                lines.append(f"    {e.where()}: {e.source} -> {e.target}" + (" (function-local)" if e.local else ""))
    return components, "\n".join(lines)


def _reason(lines: List[str], edge: Edge, import_lines: Set[int]) -> Optional[str]:
    """The comment that gives a function-local import its reason: on one of its lines, or on the line above
    it or above the contiguous run of import lines it belongs to (1-based line numbers)."""
    for n in range(edge.line, edge.end_line + 1):
        comment = _comment(lines[n - 1])
        if comment:
            return comment
    n = edge.line - 1
    while n >= 1 and n in import_lines:  # (a comment at the end of another import's line is that import's reason)
        n -= 1
    if n >= 1 and lines[n - 1].strip().startswith("#"):
        return _comment(lines[n - 1])
    return None


def _comment(line: str) -> Optional[str]:
    if "#" not in line:
        return None
    texts = []  # a '#' inside a string is not a comment
    try:
        for t in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
            if t.type == tokenize.COMMENT:
                texts.append(t.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # a line of a statement that goes on (an open parenthesis): its comment is read already
    text = " ".join(_PRAGMA.sub("", t.lstrip("#")).strip(" -:") for t in texts).strip()
    return text or None


def _import_lines(source: str) -> Set[int]:
    """Every line of `source` that belongs to an import statement."""
    tree = ast.parse(source)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(range(node.lineno, getattr(node, "end_lineno", node.lineno) + 1))
    return out


def unexplained_local_imports(edges: List[Edge], root: str = ROOT) -> List[str]:
    out = []
    by_path = defaultdict(list)
    for e in edges:
        if e.local:
            by_path[e.path].append(e)
    for path, local in sorted(by_path.items()):
        with open(os.path.join(root, path), encoding="utf-8") as fh:
            source = fh.read()
        lines, import_lines = source.splitlines(), _import_lines(source)
        for e in sorted(local, key=lambda e: e.line):
            if (e.path, e.target) in ALLOWED_WITHOUT_REASON or _reason(lines, e, import_lines):
                continue
            item = f"{e.where()}: {lines[e.line - 1].strip()}"
            if item not in out:  # one line per statement (`from models import lora, registry`: two edges)
                out.append(item)
    return out


def local_import_counts(edges: List[Edge]) -> Dict[str, int]:
    """Function-local project import statements per folder of the importing file."""
    statements = {(e.path, e.line) for e in edges if e.local}
    counts: Dict[str, int] = defaultdict(int)
    for path, _ in statements:
        counts[os.path.dirname(path)] += 1
    return dict(sorted(counts.items()))


# ---- tests ----------------------------------------------------------------------------------------------------
def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The parser itself: module-level, function-local, relative and `from pkg import submodule` imports."""
    pkg = tmp_path / "models"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("X = 1\n")
    (pkg / "a.py").write_text("import models.b\nfrom models.sub import X\n\n\ndef f():\n"
                              "    # start-up time\n    from models import b\n    return b\n")
    (pkg / "b.py").write_text("from .sub import leaf\nclass C:\n    from models.a import f\n")
    (pkg / "c.py").write_text("def g():\n    from models.sub import leaf  # noqa: F401\n\n\n"
                              "def h():\n    import json  # a third-party or standard module: not policed\n"
                              "    from models.sub import X\n\n\n"
                              "def k():\n    # cycle: models.b imports this module\n    from models import b\n"
                              "    from models.sub import leaf\n    return b, leaf\n")
    edges = import_edges(str(tmp_path))
    got = {(e.source, e.target, e.local) for e in edges if e.source != "models.c"}
    assert got == {("models.a", "models.b", False), ("models.a", "models.sub", False),
                   ("models.a", "models.b", True), ("models.b", "models.sub.leaf", False),
                   ("models.b", "models.a", False), ("models.sub", "models.sub.leaf", False)}
    components, report = describe_cycles(edges)
    assert components == [["models.a", "models.b"]]
    # a pragma is no reason; a comment above covers the run of import lines below it
    assert unexplained_local_imports(edges, str(tmp_path)) == [
        "models/c.py:2: from models.sub import leaf  # noqa: F401", "models/c.py:7: from models.sub import X"]
    assert "models.a -> models.b -> models.a" in report


def test_no_import_cycles():
    components, report = describe_cycles(import_edges())
    assert not components, "import cycles in the project's modules:\n" + report


def test_models_import_nothing_from_trainer():
    bad = [f"{e.where()}: {e.source} imports {e.target}" for e in import_edges()
           if e.source.split(".")[0] == "models" and e.target.split(".")[0] == "trainer"]
    assert not bad, "models/ must not import trainer/:\n" + "\n".join(bad)


def test_function_local_project_imports_say_why():
    bad = unexplained_local_imports(import_edges())
    assert not bad, ("function-local imports of project modules without a one-line reason comment (on the line or "
                     "the line above; or move them to the module's top):\n" + "\n".join(bad))


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else ROOT  # another checkout (e.g. `git archive HEAD` unpacked)
    all_edges = import_edges(where)
    print(describe_cycles(all_edges)[1] or "no import cycles")
    print("function-local project import statements per folder:")
    for folder, count in local_import_counts(all_edges).items():
        print(f"  {folder}: {count}")
    missing = unexplained_local_imports(all_edges, where)
    print(f"without a reason comment: {len(missing)}")
    for item in missing:
        print("  " + item)
    sys.exit(0)
