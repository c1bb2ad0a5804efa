"""The package boundaries of STYLE.md, checked by walking every module's imports (ast).

    scheduler/    never torch, cupy, zkv.worker, zkv.kernels; sockets only in dispatcher.py
    worker/       never zkv.scheduler
    storage/      neither zkv.scheduler nor zkv.worker
    kernels/      pure: no zkv.scheduler / worker / storage, no sockets
    protocol.py   only zkv.errors
    integrations/ may import everything; nothing else in zkv imports it or an engine
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ZKV = Path(__file__).resolve().parents[1] / "zkv"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _modules() -> list[Path]:
    return sorted(p for p in ZKV.rglob("*.py"))


def _forbidden(rel: str) -> tuple[str, ...]:
    engines = ("vllm", "sglang", "zkv.integrations")
    if rel.startswith("integrations/"):
        return ()
    rules: tuple[str, ...] = engines
    if rel.startswith("scheduler/"):
        rules += ("torch", "cupy", "zkv.worker", "zkv.kernels")
        if rel != "scheduler/dispatcher.py":
            rules += ("zmq",)
    elif rel.startswith("worker/"):
        rules += ("zkv.scheduler",)
    elif rel.startswith("storage") :
        rules += ("zkv.scheduler", "zkv.worker")
    elif rel.startswith("kernels/"):
        rules += ("zkv.scheduler", "zkv.worker", "zkv.storage", "zmq")
    elif rel == "protocol.py":
        rules += ("torch", "zmq", "zkv.scheduler", "zkv.worker", "zkv.kernels", "zkv.storage")
    return rules


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ZKV)))
def test_module_respects_its_boundaries(path: Path) -> None:
    rel = str(path.relative_to(ZKV))
    bad = sorted(i for i in _imports(path) for f in _forbidden(rel)
                 if i == f or i.startswith(f + "."))
    assert not bad, f"zkv/{rel} imports {bad}"


def test_the_walk_sees_imports() -> None:
    """The checker itself: it must see a module-level and a function-level import."""
    src = ZKV / "scheduler" / "dispatcher.py"
    assert "zmq" in _imports(src)
    assert "zkv.kernels" in _imports(ZKV / "worker" / "sidecar.py")  # imported inside a function
