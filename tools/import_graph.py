"""The project's import graph, read with ast, and the layering rules tests/test_layering.py holds it to.

Every import counts: at module level or inside a function (a lazy import is still a dependency;
it only moves the failure from import time to the first call), and
``importlib.import_module("a.literal.name")``. The project's packages are the folders at the
repository's root that hold an ``__init__.py`` (minidl, minidl_parallel, ...). The rules:

1. **No import cycle** of modules, however long. The one exception: a package's ``__init__``
   (its face, which re-exports its modules) and a single one of its own modules that imports
   it back (``import minidl.ops as ops`` in ``minidl/ops/tensor_methods.py``) are not a cycle.
   A cycle with two or more modules besides package faces is one, through a face or not:
   ``a -> pkg (__init__) -> pkg.b -> a`` is, since importing ``pkg`` runs ``pkg.b``.
2. **No folder loop.** Inside every package, its *children* -- each of its modules, its
   ``__init__``, and each sub-package taken whole with everything under it -- import one
   another without a loop; so do the top-level packages. ``minidl/_intra_op.py`` importing
   ``minidl/kernels/__init__.py`` while ``minidl/kernels/cpu/blas.py`` imports
   ``minidl/_intra_op.py`` is a loop in ``minidl/`` between ``_intra_op.py`` and ``kernels/``. A
   loop of modules alone is rule 1's, so a folder loop has a sub-package in it; as in rule 1, a
   package's ``__init__`` and one child alone are not a loop. (A sub-package may still import
   its parent's modules, and the parent its sub-packages, as long as the two directions do not
   meet.)
3. **No forbidden import:** ``minidl`` never imports ``minidl_parallel``.

Run from the project's root: ``python3 tools/import_graph.py`` prints what breaks a rule and
exits 1 if anything does. (The logic of the workspace's import_cycles.py, as a library the
repository keeps.)
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = (("minidl", "minidl_parallel"),)  # (importer's top package, imported top package)


class Graph:
    """The modules of some packages and, for each, the project modules it imports.

    ``edges[module]``: {imported module: line of the first such import in the importer}.
    ``faces``: the modules that are a package's ``__init__``.
    """

    def __init__(self, edges, faces, paths):
        self.edges, self.faces, self.paths = edges, faces, paths

    def where(self, importer, imported):
        """``path:line`` of importer's import of imported, for messages."""
        return f"{self.paths[importer]}:{self.edges[importer][imported]}"


def module_name(relative_path):
    parts = list(relative_path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imported_names(node, module, is_face, modules):
    """The dotted names an import statement (or import_module call) brings in."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            parts = module.split(".")
            base = parts[: len(parts) - node.level + (1 if is_face else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        # ``from pkg import name``: the module pkg.name where there is one, else pkg itself.
        return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix for a in node.names]
    if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "import_module")):
        return [node.args[0].value]
    return []


def top_level_packages(root):
    """The folders directly under ``root`` that are packages (hold an ``__init__.py``)."""
    return sorted(p.parent.name for p in Path(root).glob("*/__init__.py"))


def build(root=ROOT, packages=None):
    """The import graph of ``packages`` (folders under ``root``; default: all of them), every
    import included."""
    root = Path(root)
    packages = top_level_packages(root) if packages is None else packages
    paths = {module_name(p.relative_to(root)): p.relative_to(root)
             for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    faces = {m for m, p in paths.items() if p.name == "__init__.py"}
    edges = {m: {} for m in paths}
    for module, path in paths.items():
        tree = ast.parse((root / path).read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            for name in _imported_names(node, module, module in faces, paths):
                while name and name not in paths:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    line = edges[module].get(name, node.lineno)
                    edges[module][name] = min(line, node.lineno)
    return Graph(edges, faces, paths)


def strongly_connected(edges):
    """The strongly connected components of more than one node, each sorted, in a stable order
    (Tarjan's algorithm, iterative: a deep chain of imports does not hit the recursion limit)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
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
    return sorted(found)


def _a_cycle_through(component, edges, start):
    """The shortest closed path from ``start`` through the component, each step an edge."""
    members = set(component)
    previous, frontier = {start: None}, [start]
    while frontier:  # breadth first: the shortest way back to start
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(edges[node]):
                if nxt == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return list(reversed(path)) + [start]
                if nxt in members and nxt not in previous:
                    previous[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no cycle through {start} in {component}")


def _a_face_and_its_own_module(component, faces):
    """True for rule 1's exception: one module and the faces of packages that hold it."""
    deepest = max(component, key=lambda m: m.count("."))
    return all(m == deepest or (m in faces and deepest.startswith(m + ".")) for m in component)


def import_cycles(graph):
    """Messages, one per import cycle: its modules, and one loop of imports with file and line."""
    edges = graph.edges
    messages = []
    for component in strongly_connected(edges):
        if _a_face_and_its_own_module(component, graph.faces):
            continue
        # Shown: a shortest loop that is a cycle by rule 1 (not only a face and its module).
        starts = [m for m in component if m not in graph.faces] or component  # (faces alone: any)
        loops = [_a_cycle_through(component, edges, m) for m in starts]
        loop = next((c for c in loops if not _a_face_and_its_own_module(c[:-1], graph.faces)), loops[0])
        steps = ", ".join(f"{a} -> {b} ({graph.where(a, b)})" for a, b in zip(loop, loop[1:]))
        messages.append(f"import cycle of {len(component)} modules: {', '.join(component)}; e.g. {steps}")
    return messages


def _children(graph, importer, imported):
    """The package in which an import crosses between children, and the two children it joins.

    A child of package P is one of P's modules (``minidl/_intra_op.py``), P's ``__init__``, or one
    of P's sub-packages taken whole, with everything under it (``minidl/kernels/``). The import
    joins the children of the deepest package holding both modules.
    """
    def package_parts(module):
        return module.split(".") if module in graph.faces else module.split(".")[:-1]

    a, b = package_parts(importer), package_parts(imported)
    depth = 0
    while depth < min(len(a), len(b)) and a[depth] == b[depth]:
        depth += 1

    def child(module):
        parts = module.split(".")
        if module in graph.faces and len(parts) == depth:
            return "/".join(parts) + "/__init__.py"  # the package's own face, beside its children
        if module in graph.faces or len(parts) > depth + 1:
            return "/".join(parts[:depth + 1]) + "/"  # a sub-package, taken whole
        return "/".join(parts) + ".py"
    return "/".join(a[:depth]) + "/", child(importer), child(imported)


def folder_loops(graph):
    """Messages, one per folder loop: the children of one package that form it, and every import
    between them, grouped by pair of children (at most three named per pair).

    Inside every package (and among the top-level packages), its children -- modules, and
    sub-packages each taken whole -- must import one another without a loop. A loop of modules
    alone is an import cycle (reported by :func:`import_cycles`), so a folder loop is one with a
    sub-package in it: ``minidl/_intra_op.py -> minidl/kernels/ -> minidl/_intra_op.py``.
    """
    levels = {}  # package -> {child: {child it imports: [(importer, imported)]}}
    for module, targets in graph.edges.items():
        for target in targets:
            package, child, imported_child = _children(graph, module, target)
            if child != imported_child:
                level = levels.setdefault(package, {})
                level.setdefault(imported_child, {})
                level.setdefault(child, {}).setdefault(imported_child, []).append((module, target))
    messages = []
    for package, level in sorted(levels.items()):
        for component in strongly_connected(level):
            if all(c.endswith(".py") for c in component):
                continue  # modules only: an import cycle, reported as one
            if len([c for c in component if c != package + "__init__.py"]) < 2:
                continue  # the package's face and one child: not a loop (as in import_cycles)
            steps = "; ".join(
                f"{a} -> {b} by " + ", ".join(f"{m} -> {t} ({graph.where(m, t)})" for m, t in sorted(level[a][b])[:3])
                + (f" and {len(level[a][b]) - 3} more" if len(level[a][b]) > 3 else "")
                for a in component for b in sorted(level[a]) if b in component)
            where = "between the top-level packages" if package == "/" else f"in {package}"
            messages.append(f"folder loop {where} ({len(component)} children: {', '.join(component)}): {steps}")
    return messages


def forbidden_imports(graph, forbidden=FORBIDDEN):
    """Messages, one per import of a package its importer must not know."""
    top = lambda name: name.partition(".")[0]  # noqa: E731
    return [f"{m} imports {t} ({graph.where(m, t)}): {low} must never import {high}"
            for low, high in forbidden for m in sorted(graph.edges) if top(m) == low
            for t in sorted(graph.edges[m]) if top(t) == high]


def problems(graph):
    """Everything that breaks a rule, as messages."""
    return import_cycles(graph) + folder_loops(graph) + forbidden_imports(graph)


if __name__ == "__main__":
    found = problems(build())
    print("\n".join(found) or "import graph: no cycle, no folder loop, no forbidden import")
    sys.exit(1 if found else 0)
