"""The package's layers import one way: no import cycle between modules or between packages (lazy
imports inside functions count), and code outside gppo.core reads core's public names only."""

import ast
from pathlib import Path

import gppo
import gppo.core

ROOT = Path(gppo.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the gppo modules it imports anywhere in its body (a package's own submodules that
    `from package import name` reaches are resolved to the submodule where one exists)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == "gppo"}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gppo":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package(module: str) -> str:
    """The layer a module belongs to: gppo.<first part> (gppo itself for the package's __init__)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_cycle_between_modules():
    graph = _imports()
    # A package's __init__ importing its own submodules is how a package exports; a submodule
    # importing its own package's __init__ back would then be a cycle, and is one here.
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for module, targets in _imports().items():
        if module == "gppo":  # the top-level package re-exports gppo.core and is no layer of its own
            continue
        edges = graph.setdefault(_package(module), set())
        edges |= {_package(t) for t in targets if _package(t) not in (_package(module), "gppo")}
    assert _cycle(graph) is None, f"import cycle between packages: {' -> '.join(_cycle(graph))}"


def test_core_imports_nothing_outside_core():
    for module, targets in _imports().items():
        if module.startswith("gppo.core"):
            outside = [t for t in targets if not t.startswith("gppo.core")]
            assert not outside, f"{module} imports {outside}: gppo.core is pure tensor math"


def test_core_imports_only_torch_and_the_standard_library():
    import sys

    for path in (ROOT / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in ("torch", "gppo") or top in sys.stdlib_module_names, f"{path.name} imports {name}"


def test_integrations_import_no_trainer_module():
    for module, targets in _imports().items():
        if module.startswith("gppo.integrations"):
            trainer = [t for t in targets if t.startswith("gppo.trainer")]
            assert not trainer, f"{module} imports {trainer}: integrations use the public API and gppo.models"


def test_outside_core_uses_core_public_names_only():
    for module, targets in _imports().items():
        if not module.startswith("gppo.core") and module != "gppo":
            private = [t for t in targets if t.startswith("gppo.core.")]
            assert not private, f"{module} imports {private}: import the public names of gppo.core"


def test_core_public_names_exist():
    for name in gppo.core.__all__:
        assert hasattr(gppo.core, name), name


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
