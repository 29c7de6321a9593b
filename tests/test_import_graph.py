"""Whale's floors, checked on the import graph of ``src/whale``.

Every module under ``src/whale`` is parsed with :mod:`ast` (nothing is imported), and every ``import`` /
``from ... import`` in it, at module level or inside a function or class, becomes an edge to the Whale module it
names (``from whale.pkg import name`` names ``whale.pkg.name`` when that is a module, else ``whale.pkg``). An
import under ``if TYPE_CHECKING:`` never runs and is not an edge. Parent packages a Python import executes on
the way (``whale/__init__.py`` for any ``whale.x``) are not edges either, as in import-linter: only what the
code names.

The floors, lowest first (a module may import its own floor and the floors below, never one above):

0. **base**: the leaves every floor may use: units, the cluster spec and device catalogue (and the emulation's
   core count), the annotations, the split rules' registry, the losses, device detection, and
   ``whale.memory.host`` (each rank's host memory from the cluster spec: pure arithmetic the planner's estimator
   and the runtime's offload both read; it lives with the memory mechanisms but imports only units).
1. **plan**: the contract, ``whale.plan``: the frozen Plan, its checks, validation, layout, printout, schedules
   as data and the one apportionment rule (``plan.shares``) that turns its weights into whole units.
2. **spec**: what names plan data but plans nothing: ``config`` (the user's settings, whose vocabularies are the
   plan's), the MoE layer (``moe``, which records its MoELayer entries) and the Hugging Face split rules.
3. **planner**: ``whale.planner``: pure functions that choose a plan, and the step-time model
   (``planner.steptime``) and the calibration cache's reader; nothing above the plan and the spec.
4. **memory**: ``whale.memory``: torch-level memory mechanisms (tracker, checkpoint wrappers, host memory,
   monitor) that both the profiler in the front end and the runtime use.
5. **frontend**: model + annotations + cluster -> plan (profiling, stage cuts, the auto planner); it reads cached
   calibration data only.
6. **parallel**: the parallel mechanisms a plan's stages run on (split, pipeline, data parallel, ZeRO, MoE).
7. **runtime**: executes a plan (engine, context, checkpoints, launch); decides nothing.
8. **calibration**: ``whale.calibration``: measurement that launches the engine (unit timings, engine fits) and
   the prediction that measures what the cache lacks. ``whale.elastic``: controllers
   that watch a running engine and change its plan (straggler re-balancing).
9. **api**: the package root ``whale`` (the public names) and the command lines.

The issue's ``parallel/memory`` floor is split in two here because the front end's profiler really uses
``whale.memory`` (the storage tracker, the checkpoint wrappers' targets, host memory), and ``whale.memory`` imports
nothing of parallel, frontend or runtime.
"""

from __future__ import annotations

import ast
import functools
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

FLOORS: dict[str, int] = {
    "whale.units": 0, "whale.cluster": 0, "whale.emulation_cores": 0, "whale.annotation": 0, "whale.splitrules": 0,
    "whale.loss": 0, "whale.detect": 0, "whale.memory.host": 0,
    "whale.plan": 1,
    "whale.config": 2, "whale.moe": 2, "whale.splitrules_hf": 2,
    "whale.planner": 3,
    "whale.memory": 4,
    "whale.frontend": 5,
    "whale.parallel": 6,
    "whale.runtime": 7,
    "whale.calibration": 8, "whale.elastic": 8,
    "whale": 9, "whale.cli": 9, "whale.plan_cli": 9, "whale.simulate_cli": 9, "whale.checkpoint_cli": 9,
}
"""Module or package -> floor (a module's floor is that of its longest listed prefix)."""

NAMES = ("base", "plan", "spec", "planner", "memory", "frontend", "parallel", "runtime", "calibration", "api")


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted name -> (file, is a package ``__init__``) of every module under ``src/whale``."""
    out = {}
    for path in sorted((SRC / "whale").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node of ``tree`` outside ``if TYPE_CHECKING:`` blocks (at any depth)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                todo.extend(child.orelse)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            todo.append(child)


def _resolve(name: str, modules: dict) -> str | None:
    """The Whale module ``name`` is, or lies in (``whale.x.y.Attr`` -> ``whale.x.y``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the Whale modules it imports (top-level and function-level), by the rules in the docstring."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        out = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [_resolve(a.name, modules) for a in node.names if a.name.split(".")[0] == "whale"]
            else:
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] != "whale":
                    continue
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _resolve(base, modules)
                           for a in node.names]
            out.update(t for t in targets if t is not None and t != name)
    return graph


def floor_of(module: str) -> int:
    """The floor of ``module``: that of the longest prefix in :data:`FLOORS`.

    Raises:
        KeyError: a module no entry covers (add it to the table, on the floor it belongs to)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in FLOORS:
            return FLOORS[".".join(parts[:i])]
    raise KeyError(f"{module} is on no floor; add it to FLOORS in tests/test_import_graph.py")


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of modules, the first repeated at the end), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        """Depth-first from ``m``; the cycle closed by a back edge, if any."""
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_every_module_is_on_a_floor():
    assert all(floor_of(m) in range(len(NAMES)) for m in import_graph())


def test_no_import_goes_up_a_floor():
    graph = import_graph()
    up = sorted(f"{m} ({NAMES[floor_of(m)]}) imports {t} ({NAMES[floor_of(t)]})"
                for m, targets in graph.items() for t in targets if floor_of(t) > floor_of(m))
    assert not up, "imports above their floor:\n" + "\n".join(up)


def test_the_contract_and_the_planner_import_nothing_above_them():
    graph = import_graph()
    plan = {t for m, ts in graph.items() if m.startswith("whale.plan.") for t in ts}
    assert all(t.startswith("whale.plan.") or floor_of(t) == 0 for t in plan), sorted(plan)
    planner = {t for m, ts in graph.items() if m.startswith("whale.planner.") for t in ts}
    assert all(floor_of(t) <= FLOORS["whale.planner"] for t in planner), sorted(planner)
    assert not any(t.startswith(("whale.planner", "whale.frontend", "whale.parallel", "whale.runtime",
                                 "whale.calibration")) for t in plan)


def test_no_import_cycle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_function_level_imports():
    """The parser counts an import inside a function (the CLI's lazy runtime import) as an edge, and none under
    TYPE_CHECKING; plan.py imports printing.py and printing.py imports nothing of plan.py, not even for typing."""
    graph = import_graph()
    assert "whale.runtime.launch" in graph["whale.cli"]
    assert "whale.plan.plan" not in graph["whale.plan.printing"] and "whale.plan.printing" in graph["whale.plan.plan"]
    text = (SRC / "whale" / "plan" / "printing.py").read_text()
    assert "whale.plan.plan import" not in text and "import whale.plan.plan" not in text
    code = "import typing\nif typing.TYPE_CHECKING:\n    import whale.cli\ndef f():\n    import whale.units\n"
    assert [a.name for node in _imports(ast.parse(code)) for a in node.names] == ["typing", "whale.units"]
    assert "whale.calibration.predict" in graph["whale.simulate_cli"]
