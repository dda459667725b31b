"""Offline checks of the Kubernetes manifests and the Prometheus config.

No API server runs here, so the manifests are rendered with `kubectl kustomize`,
validated against the Kubernetes OpenAPI schemas (`kubernetes-validate --strict`),
linted with yamllint, and then checked for the wiring the services rely on.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
OVERLAYS = ["cpu", "gpu"]
# The newest schema set that kubernetes-validate 1.37 ships (it has 1.26 to 1.37).
K8S_VERSION = "1.37.0"
PORTS = {"coordinator": (50051, 9464), "draft": (50052, 9465), "target": (50053, 9466)}


def tool(name: str) -> str:
    # The dev extra installs these into the venv; PATH may not include the venv's bin
    # (e.g. `.venv/bin/python -m pytest`), so look beside the interpreter first.
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found; install the dev extra: pip install -e '.[dev]'")
    return found


def run(*args: str, cwd: Path = ROOT) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert result.returncode == 0, f"{' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@functools.cache
def render(path: Path) -> str:
    return run(tool("kubectl"), "kustomize", str(path))


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render(path)) if d]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def config(objects: list[dict[str, Any]]) -> dict[str, str]:
    maps = [o for o in objects if o["kind"] == "ConfigMap"
            and o["metadata"]["name"].startswith("specdec-config")]
    assert len(maps) == 1
    return dict(maps[0]["data"])


# -- tools ---------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay: str, tmp_path: Path) -> None:
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(render(K8S / "overlays" / overlay))
    run(tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, str(rendered))


def test_strict_validation_rejects_unknown_fields(tmp_path: Path) -> None:
    # Guards the guard: a typo in a manifest must fail, not pass silently.
    bad = tmp_path / "bad.yaml"
    bad.write_text(render(K8S / "overlays" / "cpu").replace(
        "enableServiceLinks: false", "enableServiceLinks: false\n      enableServiceLink: false"))
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, str(bad)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "enableServiceLink" in result.stdout + result.stderr


def test_yamllint() -> None:
    run(tool("yamllint"), "--strict", "-c", str(ROOT / ".yamllint"), "k8s", "deploy")


# -- wiring --------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_deployments_and_probes(overlay: str) -> None:
    objects = docs(K8S / "overlays" / overlay)
    for role, (grpc_port, metrics_port) in PORTS.items():
        name = f"specdec-{role}"
        pod = find(objects, "Deployment", name)["spec"]["template"]
        container = pod["spec"]["containers"][0]
        assert container["args"] == [role]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["SPECDEC_PORT"] == str(grpc_port)
        assert env["SPECDEC_METRICS_PORT"] == str(metrics_port)
        assert env["OTEL_SERVICE_NAME"] == name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == grpc_port, (name, probe)
        assert container["resources"]["requests"] and container["resources"]["limits"]
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(metrics_port)
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        service = find(objects, "Service", name)["spec"]
        assert service["selector"].items() <= pod["metadata"]["labels"].items()
        assert {p["port"] for p in service["ports"]} == {grpc_port, metrics_port}
        for kind in ("PodDisruptionBudget", "HorizontalPodAutoscaler"):
            find(objects, kind, name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinator_discovers_headless_services(overlay: str) -> None:
    objects = docs(K8S / "overlays" / overlay)
    settings = config(objects)
    for role in ("draft", "target"):
        headless = find(objects, "Service", f"specdec-{role}-headless")
        assert headless["spec"]["clusterIP"] == "None"
        namespace = headless["metadata"]["namespace"]
        port = PORTS[role][0]
        expected = f"dns:///specdec-{role}-headless.{namespace}.svc.cluster.local:{port}"
        assert settings[f"SPECDEC_{role.upper()}_ENDPOINT"] == expected


def test_endpoints_follow_a_namespace_change(tmp_path: Path) -> None:
    # What `kustomize edit set namespace` does to a copy of the CPU overlay.
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    cpu = K8S / "overlays" / "cpu"
    for item in cpu.iterdir():
        shutil.copy(item, overlay / item.name)
    text = (overlay / "kustomization.yaml").read_text()
    relative = os.path.relpath(K8S, overlay)
    text = text.replace("../../", relative + "/").replace("namespace: specdec", "namespace: llm")
    (overlay / "kustomization.yaml").write_text(text)
    objects = docs(overlay)
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"] == ["llm"]
    settings = config(objects)
    assert settings["SPECDEC_DRAFT_ENDPOINT"].startswith("dns:///specdec-draft-headless.llm.svc")
    assert settings["SPECDEC_TARGET_ENDPOINT"].startswith("dns:///specdec-target-headless.llm.")


def test_gpu_overlay_requests_gpus() -> None:
    objects = docs(K8S / "overlays" / "gpu")
    settings = config(objects)
    assert settings["SPECDEC_DEVICE"] == "cuda" and settings["SPECDEC_DTYPE"] == "float32"
    assert settings["SPECDEC_TARGET_MODEL"] != settings["SPECDEC_DRAFT_MODEL"]
    for role in ("draft", "target"):
        deployment = find(objects, "Deployment", f"specdec-{role}")["spec"]
        assert deployment["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare GPU
        pod = deployment["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        assert pod["nodeSelector"]
    coordinator = find(objects, "Deployment", "specdec-coordinator")["spec"]["template"]
    assert "nvidia.com/gpu" not in coordinator["spec"]["containers"][0]["resources"]["limits"]


def test_cpu_overlay_uses_embedded_models_offline() -> None:
    objects = docs(K8S / "overlays" / "cpu")
    settings = config(objects)
    assert settings["SPECDEC_DEVICE"] == "cpu"
    assert settings["SPECDEC_TARGET_MODEL"] == "smollm2-135m-instruct"
    assert settings["HF_HUB_OFFLINE"] == "1"
    for kind, name in [("Deployment", "otel-collector"), ("Deployment", "jaeger"),
                       ("Service", "otel-collector"), ("Service", "jaeger")]:
        assert find(objects, kind, name)["metadata"]["namespace"] == "specdec"


# -- Prometheus ----------------------------------------------------------------------


def test_prometheus_config_matches_metrics_ports(tmp_path: Path) -> None:
    path = ROOT / "deploy" / "prometheus.yml"
    scrape = {job["job_name"]: job for job in yaml.safe_load(path.read_text())["scrape_configs"]}
    static = {t for group in scrape["specdec"]["static_configs"] for t in group["targets"]}
    assert static == {f"localhost:{metrics}" for _, metrics in PORTS.values()}
    assert scrape["kubernetes-pods"]["kubernetes_sd_configs"] == [{"role": "pod"}]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    # Debian's Prometheus is built without Kubernetes discovery: check the rest with it.
    local = {"scrape_configs": [scrape["specdec"]]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(local))
    run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
