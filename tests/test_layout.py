"""The package's layout: no import cycle, and the flat layout's module names still import for one
release, with a warning naming the new home."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_torchrl.deprecated import MOVED, new_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_name_imports_the_new_module_with_a_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_old_names_inside_the_new_packages_and_saved_reward_paths_still_work():
    from rlhf_torchrl.objectives.ppo import make_ppo_loss
    from rlhf_torchrl.rewards.functions import vader_sentiment
    from rlhf_torchrl.rewards.scoring import load_reward_function

    with pytest.warns(DeprecationWarning, match="rlhf_torchrl.objectives.make_ppo_loss moved"):
        from rlhf_torchrl.objectives import make_ppo_loss as old
    assert old is make_ppo_loss
    with pytest.warns(DeprecationWarning, match="rlhf_torchrl.data.check_prompts moved"):
        from rlhf_torchrl.data import check_prompts  # noqa: F401
    sys.modules.pop("rlhf_torchrl.reward_functions", None)
    with pytest.warns(DeprecationWarning):  # a saved config of an older run names it so
        assert load_reward_function("rlhf_torchrl.reward_functions:vader_sentiment") is vader_sentiment
    # a submodule of a moved package is one module, not a second copy
    with pytest.warns(DeprecationWarning):
        import rlhf_torchrl.sandbox.bubblewrap as old_bwrap
    import rlhf_torchrl.envs.sandbox.bubblewrap as bwrap

    assert old_bwrap is bwrap
    assert new_name("rlhf_torchrl.keys") is None
    with pytest.raises(AttributeError):
        import rlhf_torchrl.objectives as objectives

        objectives.no_such_name  # noqa: B018


def _imports(tree) -> list:
    """The import statements of a module, inside functions too, but not under ``if TYPE_CHECKING``."""
    found = []

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            walk(child)

    walk(tree)
    return found


def _package_imports() -> dict[str, set[str]]:
    """module -> the package modules it imports, at module level or inside a function (a cycle
    held apart by a function-level import is a cycle still)."""
    graph = {}
    for path in (ROOT / "rlhf_torchrl").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlhf_torchrl"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("rlhf_torchrl"))
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycle_between_modules():
    """No two modules import each other, directly or through others, at module level or inside
    functions (a package and its own submodules aside)."""
    graph = _package_imports()
    cycles = []

    def visit(node, stack, on_stack, done):
        stack.append(node)
        on_stack.add(node)
        for dep in graph[node]:
            if dep.startswith(node + "."):  # a package's __init__ importing its submodules
                continue
            if dep in on_stack:
                cycle = stack[stack.index(dep):] + [dep]
                if not all(b.startswith(a + ".") or a.startswith(b + ".") for a, b in zip(cycle, cycle[1:])):
                    cycles.append(" -> ".join(cycle))
            elif dep not in done:
                visit(dep, stack, on_stack, done)
        stack.pop()
        on_stack.discard(node)
        done.add(node)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [], set(), done)
    assert not cycles, "\n".join(cycles[:10])


def test_the_package_imports_in_a_fresh_interpreter_with_warnings_as_errors_for_its_own_names():
    """Importing the package and each subpackage uses no deprecated name of its own."""
    code = ("import warnings; warnings.filterwarnings('error', message='.*moved to rlhf_torchrl'); "
            "import rlhf_torchrl, rlhf_torchrl.cli, rlhf_torchrl.config.builders, rlhf_torchrl.plan")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
