"""The package's layers, checked on its imports.

    cli, commands            the `specdec` command line
      |
    serving, coordinator,    gRPC and HTTP plumbing, security, discovery, the local stack,
    *_service                Ray replicas; the three services' servicers
      |
    engine                   models, KV caches, kernels, backends, steps
      |
    core                     the algorithm: sampling, rejection, trees, the loop, policies
      |
    settings, config, errors the settings registry and the error types

telemetry, bench and draft_training sit beside serving. A layer imports only layers
below it; nothing outside `commands/` and `cli.py` imports a command; the graph has no
cycle. The static checks read every import statement in the source (also those inside
functions), so a lazy import cannot hide a dependency; the runtime checks import modules
in a fresh interpreter and read sys.modules.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec", "coordinator", "draft_service", "target_service")
GENERATED = "specdec.proto"
MAX_LINES = 600
MAX_TOP_LEVEL_MODULES = 8  # in specdec/, besides the packages

# layer -> prefixes it must not import
FORBIDDEN = {
    "specdec.core": ["specdec.engine", "specdec.serving", "specdec.telemetry", "specdec.bench",
                     "specdec.commands", "specdec.cli", "specdec.draft_training",
                     "coordinator", "draft_service", "target_service"],
    "specdec.engine": ["specdec.serving", "specdec.commands", "specdec.cli", "specdec.bench",
                       "coordinator", "draft_service", "target_service"],
    "specdec.settings": ["specdec."],
    "specdec.errors": ["specdec."],
}
COMMANDS = ("specdec.commands", "specdec.cli")


def source_files() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            name = name.removesuffix(".__init__")
            if not (name == GENERATED or name.startswith(GENERATED + ".")):
                yield name, path


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The project modules a file imports; `from a import b` counts as a.b when that is a
    module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + [node.module or ""])
            else:
                base = node.module or ""
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                          else base)
    return {module.strip(".") for module in found if module.strip(".") in modules} - {name}


def import_graph() -> dict[str, set[str]]:
    files = dict(source_files())
    modules = set(files)
    return {name: imports_of(name, path, modules) for name, path in files.items()}


def under(module: str, prefix: str) -> bool:
    return module == prefix.rstrip(".") or module.startswith(prefix.rstrip(".") + ".")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        for layer, forbidden in FORBIDDEN.items():
            if under(module, layer):
                found += [f"{module} imports {dep}" for dep in sorted(imported)
                          if any(under(dep, prefix) for prefix in forbidden)]
        if not any(under(module, prefix) for prefix in COMMANDS):
            found += [f"{module} imports the command {dep}" for dep in sorted(imported)
                      if under(dep, "specdec.commands")]
    return found


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_layer_imports_a_higher_one_and_no_command_is_imported() -> None:
    assert layer_violations(import_graph()) == []


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    graph = {"specdec.core.a": {"specdec.engine.b"}, "specdec.engine.b": {"specdec.core.a"},
             "specdec.serving.c": {"specdec.commands.up"}}
    assert find_cycle(graph) == ["specdec.core.a", "specdec.engine.b", "specdec.core.a"]
    assert layer_violations(graph) == [
        "specdec.core.a imports specdec.engine.b",
        "specdec.serving.c imports the command specdec.commands.up"]
    # a lazy import inside a function counts
    graph = import_graph()
    assert "specdec.engine.draft_compile" in graph["specdec.engine.backends.cpu"] or \
        "specdec.engine.draft_precision" in graph["specdec.engine.backends.cpu"]


def test_modules_stay_small_and_the_top_level_stays_short() -> None:
    long = {name: n for name, path in source_files()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"
    top = sorted(p.name for p in (ROOT / "specdec").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


# Runtime checks: what importing a module pulls in, third-party packages included.
CORE = ["specdec.core.sampling", "specdec.core.rejection", "specdec.core.history",
        "specdec.core.loop", "specdec.core.policy", "specdec.core.adaptive",
        "specdec.core.interfaces", "specdec.core.prompt_lookup", "specdec.core.acceptance",
        "specdec.core.stats", "specdec.core.tree_acceptance", "specdec.core.speculation_gate"]
# Transport (grpc, the generated protos) and model loading stay out of the core.
CORE_FORBIDDEN = ["grpc", "specdec.proto", "transformers", "specdec.engine", "specdec.serving"]
# The runner's logic, the steps, the scheduler, the servicers and the coordinator reach
# hardware-specific tuning only through the backends' seam (LoadedModel's facts).
MODEL_SIDE = ["specdec.engine.runner", "specdec.engine.steps", "specdec.serving.model_service",
              "draft_service.servicer", "target_service.servicer", "coordinator.validation",
              "coordinator.servicer"]
TUNING = ["specdec.engine.kernels", "specdec.engine.draft_precision",
          "specdec.engine.draft_compile", "specdec.engine.backends"]
LIGHT = ["specdec.settings", "specdec.config", "specdec.commands.serve",
         "specdec.commands.settings"]
HEAVY = ["torch", "transformers", "grpc"]
COORDINATOR = ["coordinator.server", "coordinator.servicer", "coordinator.clients"]
# What serving a model needs and a coordinator does not: the runner, and transformers'
# model classes (which bring torch.compile's and torch.distributed's modules).
MODEL_LOADING = ["specdec.engine.runner", "specdec.serving.model_service",
                 "transformers.modeling_utils", "torch._dynamo"]


def imported_by(*modules: str) -> list[str]:
    code = f"import json, sys, {', '.join(modules)}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return list(json.loads(out))


def offending(modules: list[str], forbidden: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden)]


def test_core_imports_no_transport_or_model_loading() -> None:
    assert offending(imported_by(*CORE), CORE_FORBIDDEN) == []


def test_the_model_side_imports_no_hardware_tuning() -> None:
    assert offending(imported_by(*MODEL_SIDE), TUNING) == []


def test_settings_and_service_flags_import_nothing_heavy() -> None:
    assert offending(imported_by(*LIGHT), HEAVY) == []


def test_the_coordinator_loads_no_model_code() -> None:
    assert offending(imported_by(*COORDINATOR), MODEL_LOADING) == []


@pytest.mark.parametrize("module, forbidden", [("specdec.engine.steps", CORE_FORBIDDEN),
                                               ("specdec.engine.backends", TUNING),
                                               ("target_service.server", MODEL_LOADING)])
def test_the_runtime_check_sees_an_import(module: str, forbidden: list[str]) -> None:
    assert offending(imported_by(module), forbidden) != []
