"""The algorithmic core imports no transport, CLI or benchmark code, and the settings
import nothing heavy. The modules of each list are imported in a fresh interpreter,
whose sys.modules then tells what they pulled in (together, which covers each alone)."""

from __future__ import annotations

import json
import subprocess
import sys

CORE = ["specdec.sampling", "specdec.rejection", "specdec.history", "specdec.loop",
        "specdec.policy", "specdec.adaptive", "specdec.interfaces", "specdec.prompt_lookup",
        "specdec.acceptance", "specdec.stats", "specdec.vocab"]
# Transport (grpc, the generated protos), the CLI, the benchmarks, and the model-side
# modules (runner, steps, kernels), which the core reaches only through its interfaces.
CORE_FORBIDDEN = ["grpc", "specdec.proto", "specdec.cli", "specdec.commands", "specdec.bench",
                  "specdec.steps", "specdec.runner", "specdec.kernels", "specdec.attention",
                  "specdec.model_service", "transformers"]
# The runner's logic, the steps, the scheduler, the servicers and the coordinator reach
# hardware-specific tuning only through the backends' seam (LoadedModel's facts).
MODEL_SIDE = ["specdec.runner", "specdec.steps", "specdec.model_service",
              "draft_service.servicer", "target_service.servicer", "coordinator.validation",
              "coordinator.servicer"]
TUNING = ["specdec.kernels", "specdec.draft_precision", "specdec.draft_compile",
          "specdec.backends"]
LIGHT = ["specdec.settings", "specdec.config", "specdec.commands.serve",
         "specdec.commands.settings"]
HEAVY = ["torch", "transformers", "grpc"]


def imported_by(*modules: str) -> list[str]:
    code = f"import json, sys, {', '.join(modules)}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return list(json.loads(out))


def offending(modules: list[str], forbidden: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden)]


def test_core_imports_no_transport_cli_or_bench() -> None:
    assert offending(imported_by(*CORE), CORE_FORBIDDEN) == []


def test_the_model_side_imports_no_hardware_tuning() -> None:
    assert offending(imported_by(*MODEL_SIDE), TUNING) == []


def test_settings_and_service_flags_import_nothing_heavy() -> None:
    assert offending(imported_by(*LIGHT), HEAVY) == []


def test_the_check_sees_an_import() -> None:
    assert offending(imported_by("specdec.steps"), CORE_FORBIDDEN) != []
