"""The scheduler's parts: which module imports which at run time (no circle), and no module
reaching into another part's private fields."""

from __future__ import annotations

import ast
from pathlib import Path

import zkv.scheduler

PKG = Path(zkv.scheduler.__file__).parent


def _runtime_imports(path: Path) -> set[str]:
    """zkv.scheduler modules imported at module level (``if TYPE_CHECKING`` excluded)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.ImportFrom) and n.module:
                if n.module == "zkv.scheduler":
                    out.update(a.name for a in n.names)
                elif n.module.startswith("zkv.scheduler."):
                    out.add(n.module.split(".")[2])
            elif isinstance(n, ast.Import):
                out.update(a.name.split(".")[2] for a in n.names
                           if a.name.startswith("zkv.scheduler."))
    return out


def test_no_import_circle_among_the_scheduler_modules() -> None:
    graph = {p.stem: _runtime_imports(p) for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert graph["manager"] >= {"commit", "requests", "external", "invariants", "core"}
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        if state.get(m) == 2:
            return
        assert state.get(m) != 1, f"import circle: {' -> '.join([*stack, m])}"
        state[m] = 1
        for dep in sorted(graph.get(m, ())):
            visit(dep, [*stack, m])
        state[m] = 2
        order.append(m)

    for m in sorted(graph):
        visit(m, [])
    assert order.index("radix") < order.index("core") < order.index("tiers") < order.index(
        "commit") < order.index("manager")


def test_no_module_reads_another_objects_private_fields() -> None:
    """``x._name`` only on ``self`` / ``cls`` (or a same-class ``other`` in ``__eq__``):
    the parts talk through their declared attributes and methods (no mixin-style reach)."""
    offenders = []
    for path in PKG.glob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for n in ast.walk(fn):
                if (isinstance(n, ast.Attribute) and n.attr.startswith("_")
                        and not n.attr.startswith("__") and isinstance(n.value, ast.Name)
                        and n.value.id not in ("self", "cls")
                        and not (fn.name == "__eq__" and n.value.id == "other")):
                    offenders.append(f"{path.name}:{n.lineno} {n.value.id}.{n.attr}")
    assert not offenders, offenders


def test_the_manager_is_composed_not_mixed_in() -> None:
    from zkv.scheduler.core import Core
    from zkv.scheduler.manager import CacheManager

    assert CacheManager.__mro__ == (CacheManager, object)
    from zkv.scheduler.records import CacheConfig

    cm = CacheManager(CacheConfig(4))
    assert isinstance(cm.core, Core) and cm.tree is cm.core.tree and cm.ledger is cm.core.ledger
