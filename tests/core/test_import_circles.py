"""No import circles in moe_plugin/ or integrations/ (installed as moe_plugin.integrations): the graph of every
import statement in their files, at any depth (lazy imports inside functions and annotation-only imports count
too), read from the source with ast, has no cycle. A circle found is named module by module."""
import ast
from pathlib import Path

from helpers.paths import REPO

PACKAGES = {"moe_plugin": REPO / "moe_plugin", "moe_plugin.integrations": REPO / "integrations"}


def modules(packages: dict = PACKAGES) -> dict:
    """{dotted module name: its file} for every module of the folders ({package name: folder})."""
    found = {}
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package,) + parts)] = path
    return found


def imports(name: str, path: Path, known: dict) -> set:
    """The project's modules that the file imports: `from x import y` names module x.y where y is a module, else x."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            named.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    found = set()
    for target in named:
        while target and target not in known:      # moe_plugin.ops.grouped.grouped_mm -> moe_plugin.ops.grouped
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def graph_of(known: dict) -> dict:
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_module_imports_itself_through_others():
    assert circles(graph_of(modules())) == []


def test_the_reading_finds_a_circle_through_a_lazy_import(tmp_path):
    """The check itself, on a made-up package: a lazy import inside a function closing a loop is found, an
    annotation-only one too, and the same chain without them is not."""
    (tmp_path / "ops").mkdir()
    files = {"__init__.py": "from .ops.a import run\n", "ops/__init__.py": "",
             "ops/a.py": "from . import b\nfrom .b import helper as run\n", "ops/b.py": "import os\nfrom pkg import c\n",
             "c.py": "import torch\n\ndef late():\n    from pkg.ops.a import run\n    return run\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    known = modules({"pkg": tmp_path})
    assert circles(graph_of(known)) == [["pkg.c", "pkg.ops.a", "pkg.ops.b"]]
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .ops import a\n")
    assert circles(graph_of(known)) == [["pkg.c", "pkg.ops.a", "pkg.ops.b"]]
    (tmp_path / "c.py").write_text("import torch\n")
    assert graph_of(known)["pkg.ops.a"] == {"pkg.ops.b"} and circles(graph_of(known)) == []


def test_no_test_file_edits_sys_path():
    """Tests and their helpers reach `helpers` through pytest.ini's pythonpath (in pytest) or PYTHONPATH (in the
    processes they start), never by editing sys.path."""
    edits = [f"{path.relative_to(REPO)}:{number}" for path in sorted((REPO / "tests").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "sys.path." in line and not line.lstrip().startswith(("#", '"', "'"))
             and path != Path(__file__).resolve()]
    assert edits == []
