"""The package's own imports: no cycle, no private name of one module used in another, and the
module map of mok/__init__.py true.

Walks every module of python/mok, sub-packages included (each module's AST, imports inside
functions included) for its imports of mok modules, and fails on a cycle among them, on an import
of a mok module inside a function (a lazy import dodges a cycle rather than removing it), on a
private name of one mok module (`_name`) used in another, and on a module that imports one listed
on its own line of the package docstring's map or below it. Private modules (`mok._checks`) are
fine to import; their private names are not.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "mok"


def _module_name(path):
    """mok/_checks.py -> "_checks"; mok/integrations/transformers.py -> "integrations.transformers";
    mok/integrations/__init__.py -> "integrations"."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(name for name in map(_module_name, PACKAGE.rglob("*.py")) if name)
EXTENSION = "_C"  # the compiled extension: a leaf (it imports nothing of mok)


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Walker(ast.NodeVisitor):
    """A module's imports of mok modules, the mok modules its names refer to, and its problems."""

    def __init__(self, name):
        self.name = name
        self.imports = set()  # mok modules ("mok" for the package itself)
        self.problems = []
        self.aliases = {}  # local name -> mok module it refers to
        self.depth = 0  # > 0 inside a function

    def _use(self, module, line, how):
        self.imports.add(module)
        if self.depth:
            self.problems.append(f"mok/{self.name}.py:{line}: {how} inside a function (import "
                                 f"mok modules at the top: a lazy import hides a cycle)")

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Import(self, node):
        for a in node.names:
            parts = a.name.split(".")
            if parts[0] != "mok":
                continue
            module = parts[1] if len(parts) > 1 else "mok"
            self._use(module, node.lineno, f"import {a.name}")
            if a.asname:
                self.aliases[a.asname] = module
            elif len(parts) == 1:
                self.aliases["mok"] = "mok"

    def visit_ImportFrom(self, node):
        if node.level:
            self.problems.append(f"mok/{self.name}.py:{node.lineno}: a relative import (mok "
                                 "imports its modules by their full name)")
            return
        parts = (node.module or "").split(".")
        if parts[0] != "mok":
            return
        for a in node.names:
            if len(parts) == 1:  # from mok import X: X a module of the package, or a name of it
                module = a.name if a.name in MODULES or a.name == EXTENSION else "mok"
                if module == "mok" and _private(a.name):
                    self.problems.append(f"mok/{self.name}.py:{node.lineno}: from mok import "
                                         f"{a.name}: a private name of the package")
                self._use(module, node.lineno, f"from mok import {a.name}")
                if module != "mok":
                    self.aliases[a.asname or a.name] = module
            else:
                module = parts[1]
                self._use(module, node.lineno, f"from {node.module} import {a.name}")
                if _private(a.name):
                    self.problems.append(f"mok/{self.name}.py:{node.lineno}: from {node.module} "
                                         f"import {a.name}: another module's private name")

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and _private(node.attr):
            module = self.aliases.get(node.value.id)
            if module is not None and module not in ("mok", self.name) \
                    and not (module == "mok" and node.attr in MODULES + [EXTENSION]):
                self.problems.append(f"mok/{self.name}.py:{node.lineno}: {node.value.id}."
                                     f"{node.attr}: a private name of mok.{module}")
            elif module == "mok" and node.attr not in MODULES + [EXTENSION]:
                self.problems.append(f"mok/{self.name}.py:{node.lineno}: mok.{node.attr}: a "
                                     "private name of the package")
        self.generic_visit(node)


def _walk(name):
    if name == "mok":
        path = PACKAGE / "__init__.py"
    else:
        path = PACKAGE.joinpath(*name.split(".")).with_suffix(".py")
        if not path.exists():  # a sub-package
            path = PACKAGE.joinpath(*name.split("."), "__init__.py")
    walker = _Walker(name)
    walker.visit(ast.parse(path.read_text(), str(path)))
    return walker


def _graph():
    """{module: the mok modules it imports}, and every problem found on the way. The extension is
    left out of the graph: only mok._native may import it (the one handle on it)."""
    walkers = {name: _walk(name) for name in ["mok"] + MODULES}
    graph = {name: sorted(w.imports - {name, EXTENSION}) for name, w in walkers.items()}
    problems = [p for w in walkers.values() for p in w.problems]
    problems += [f"mok/{name}.py imports the extension mok._C (only mok._native does: use "
                 "_native.lib)" for name, w in walkers.items()
                 if EXTENSION in w.imports and name != "_native"]
    return graph, problems


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in graph:
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _layers(graph):
    """Each module's layer: 0 for one that imports no mok module, else one above its highest
    import (the graph is acyclic)."""
    layer = {}

    def of(node):
        if node not in layer:
            layer[node] = 1 + max((of(n) for n in graph[node]), default=-1)
        return layer[node]

    for node in graph:
        of(node)
    return layer


def test_the_package_imports_no_cycle():
    graph, _ = _graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # Only the package's __init__ may import the package (a module importing `mok` imports every
    # module above it).
    importers = [name for name, deps in graph.items() if "mok" in deps and name != "mok"]
    assert not importers, f"modules that import the package itself: {importers}"
    layer = _layers(graph)
    assert layer["mok"] == max(layer.values()), "the package is not the top layer"
    assert layer["_native"] == 0, "mok._native must import no other mok module"


def _module_map():
    """mok/__init__.py's module map: {module: its line's index}, bottom up."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    lines = doc.split("The package's modules, bottom up")[1].split("\n\n")[1].splitlines()
    rows = [line.strip().split("  ")[0] for line in lines if not line.startswith(" " * 8)]
    return {name.strip(): i for i, row in enumerate(rows) for name in row.split(",")}


def test_the_module_map_is_the_import_order():
    graph, _ = _graph()
    row = _module_map()
    missing = sorted(set(graph) - {"mok"} - set(row))
    assert not missing, f"modules missing from mok/__init__.py's module map: {missing}"
    wrong = [f"{m} (line {row[m]}) imports {d} (line {row[d]})"
             for m, deps in graph.items() if m != "mok" for d in deps if row[d] >= row[m]]
    assert not wrong, "the module map says otherwise: " + "; ".join(wrong)


def test_no_lazy_imports_and_no_private_names_across_modules():
    _, problems = _graph()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source,problem", [
    ("def f():\n    from mok import ops\n", "inside a function"),
    ("from mok import _checks\n_checks._static(1, 2)\n", "a private name of mok._checks"),
    ("from mok._checks import _static\n", "another module's private name"),
    ("import mok\nmok._private\n", "a private name of the package"),
])
def test_the_walker_sees_each_problem(source, problem):
    """The checks above can fail: each kind of problem, in a made-up module, is reported."""
    walker = _Walker("made_up")
    walker.visit(ast.parse(source))
    assert any(problem in p for p in walker.problems), walker.problems


def test_the_walker_finds_a_cycle():
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert _cycle({"a": ["b"], "b": [], "c": ["a"]}) is None
