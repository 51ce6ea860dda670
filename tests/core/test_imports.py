"""The package's import graph: few function-level imports of its own modules, each with its reason on its line, and
`import moe_plugin` loads no host framework (issue 32) nor torch's compiler (a second per process)."""
import ast
import subprocess
import sys
from pathlib import Path

from helpers.paths import REPO

ROOT = REPO
MOST_FUNCTION_LEVEL_IMPORTS = 8   # issue 32: under 10; 8 since the transformers adapter's circle was untied
HOSTS = ("transformers", "deepspeed", "fairseq", "omegaconf")
COMPILER = ("torch._dynamo",)     # a second of every process's start (the CLI's, each rank's); loaded when compiling


def own_module(node: ast.AST) -> bool:
    """Whether an import statement names a module of this package (relative, or moe_plugin...)."""
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "moe_plugin"
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "moe_plugin" for alias in node.names)
    return False


def function_level_imports(root: Path = ROOT):
    """(file, line number, line) of every import of the package's own modules inside a function, over moe_plugin/
    and integrations/."""
    found = set()
    for folder in ("moe_plugin", "integrations"):
        for path in sorted((root / folder).rglob("*.py")):
            source = path.read_text()
            lines = source.splitlines()
            for function in ast.walk(ast.parse(source)):
                if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.update((str(path.relative_to(root)), node.lineno, lines[node.lineno - 1].strip())
                                 for node in ast.walk(function) if own_module(node))
    return sorted(found)


def test_the_counter_finds_function_level_imports_only(tmp_path):
    package = tmp_path / "moe_plugin"
    package.mkdir()
    (tmp_path / "integrations").mkdir()
    (package / "a.py").write_text("from . import b\nimport moe_plugin.c\n\n"
                                  "def f():\n    from .b import x   # why\n    import moe_plugin.c as c\n"
                                  "    import torch\n    from torch import nn\n\n"
                                  "class K:\n    def g(self):\n        from moe_plugin import d\n")
    assert [(line, text) for _, line, text in function_level_imports(tmp_path)] == [
        (5, "from .b import x   # why"), (6, "import moe_plugin.c as c"), (12, "from moe_plugin import d")]


def test_few_function_level_imports_of_our_own_modules_each_with_its_reason():
    found = function_level_imports()
    print(f"{len(found)} function-level imports of moe_plugin's own modules:")
    for path, line, text in found:
        print(f"  {path}:{line}  {text}")
    assert len(found) <= MOST_FUNCTION_LEVEL_IMPORTS, found
    assert [f"{path}:{line}" for path, line, text in found if "#" not in text] == []


def test_importing_moe_plugin_loads_no_host_framework_nor_the_compiler():
    code = ("import sys, moe_plugin, moe_plugin.train, moe_plugin.cli\n"
            f"print(' '.join(name for name in {HOSTS + COMPILER!r} if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == []


def test_the_transformers_adapter_imports_no_other_adapter():
    """It never picks DeepSpeed's block class by itself: the DeepSpeed adapter asks for it (deepspeed/hf.py)."""
    code = ("import sys, moe_plugin.integrations.transformers\n"
            "print(' '.join(name for name in sys.modules if name == 'deepspeed' or "
            "name.startswith(('moe_plugin.integrations.deepspeed', 'moe_plugin.integrations.fairseq_moe'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == []


def test_the_router_marks_autocast_available_as_torch_compiler_would():
    """router.py sets the mark @torch.compiler.assume_constant_result sets, without importing torch._dynamo."""
    import torch.compiler
    from moe_plugin import router

    def probe():
        return None
    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe and set(vars(probe)) == {"_dynamo_marked_constant"}
    assert vars(router.autocast_available) == vars(probe)
