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
OVERLAYS = ["cpu", "gpu", "secure"]
HEALTH_PORT = 50060  # SPECDEC_HEALTH_PORT: plaintext health only, for the probes
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
            assert container[probe]["grpc"]["port"] == HEALTH_PORT, (name, probe)
        assert {"name": "health", "containerPort": HEALTH_PORT} in container["ports"]
        assert config(objects)["SPECDEC_HEALTH_PORT"] == str(HEALTH_PORT)
        assert container["resources"]["requests"] and container["resources"]["limits"]
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(metrics_port)
        assert_hardened(pod["spec"])
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


# -- security -----------------------------------------------------------------------


def assert_hardened(pod: dict[str, Any]) -> None:
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_hardened(overlay: str) -> None:
    deployments = [o for o in docs(K8S / "overlays" / overlay) if o["kind"] == "Deployment"]
    assert len(deployments) >= 5  # three services and the observability stack
    for deployment in deployments:
        assert_hardened(deployment["spec"]["template"]["spec"])


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and In expressions) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
               if e["operator"] == "In")


def allowed_peers(objects: list[dict[str, Any]], labels: dict[str, str],
                  port: str) -> list[dict[str, Any]]:
    """The `from` peers of every ingress rule of the policies selecting these labels that
    covers the named port; a rule without `from` allows everyone ({})."""
    peers: list[dict[str, Any]] = []
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        if not selects(policy["spec"]["podSelector"], labels):
            continue
        for rule in policy["spec"]["ingress"]:
            if any(p["port"] == port for p in rule.get("ports", [])):
                peers += rule.get("from", [{}])
    return peers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(overlay: str) -> None:
    objects = docs(K8S / "overlays" / overlay)
    pods = {role: find(objects, "Deployment", f"specdec-{role}")["spec"]["template"]
            for role in PORTS}
    observability = {"podSelector": {"matchLabels": {
        "app.kubernetes.io/component": "observability"}}}
    for role, pod in pods.items():
        labels = pod["metadata"]["labels"]
        grpc_peers = allowed_peers(objects, labels, "grpc")
        if role == "coordinator":
            assert grpc_peers == [{}]  # the public API
        else:  # only coordinator pods, and no rule that lets everyone in
            assert grpc_peers and all("podSelector" in p and selects(
                p["podSelector"], pods["coordinator"]["metadata"]["labels"])
                and "namespaceSelector" not in p for p in grpc_peers), grpc_peers
            assert not selects(grpc_peers[0]["podSelector"], pods["draft"]["metadata"]["labels"])
        metrics_peers = allowed_peers(objects, labels, "metrics")
        assert observability in metrics_peers and {} not in metrics_peers
        assert all(p == observability or "namespaceSelector" in p for p in metrics_peers)
        assert allowed_peers(objects, labels, "health") == [{}]  # probes
        for port in pod["spec"]["containers"][0]["ports"]:  # every port has a rule
            assert allowed_peers(objects, labels, port["name"]), (role, port["name"])


def test_secure_overlay_mounts_certificates_and_keys() -> None:
    objects = docs(K8S / "overlays" / "secure")
    settings = config(objects)
    assert settings["SPECDEC_TLS_CERT_FILE"] == "/etc/specdec/tls/tls.crt"
    assert settings["SPECDEC_TLS_KEY_FILE"] == "/etc/specdec/tls/tls.key"
    assert settings["SPECDEC_TLS_CA_FILE"] == "/etc/specdec/tls/ca.crt"
    assert settings["SPECDEC_REFLECTION"] == "off"
    for role in PORTS:
        pod = find(objects, "Deployment", f"specdec-{role}")["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        container = pod["containers"][0]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert volumes["tls"]["secret"]["secretName"] == "specdec-tls"
        assert mounts["tls"]["mountPath"] == "/etc/specdec/tls" and mounts["tls"]["readOnly"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        if role == "coordinator":
            assert volumes["tls-client"]["secret"]["secretName"] == "specdec-tls-client"
            assert volumes["api-keys"]["secret"]["secretName"] == "specdec-api-keys"
            assert env["SPECDEC_TLS_CLIENT_CERT_FILE"].startswith(
                mounts["tls-client"]["mountPath"])
            assert env["SPECDEC_API_KEYS_FILE"].startswith(mounts["api-keys"]["mountPath"])
        else:
            assert "api-keys" not in volumes and "SPECDEC_API_KEYS_FILE" not in env
        service = find(objects, "Service", f"specdec-{role}")["spec"]
        assert service["ports"][0]["appProtocol"] == "grpc"  # TLS, not h2c


def test_secure_overlay_serves_the_http_api_over_https() -> None:
    objects = docs(K8S / "overlays" / "secure")
    pod = find(objects, "Deployment", "specdec-http")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # The ConfigMap's TLS settings (certificate, CA, server name) reach it, and the files.
    assert container["envFrom"][0]["configMapRef"]["name"].startswith("specdec-config")
    assert {"SPECDEC_TLS_CERT_FILE", "SPECDEC_TLS_CA_FILE",
            "SPECDEC_TLS_SERVER_NAME"} <= config(objects).keys()
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["tls"]["mountPath"] == "/etc/specdec/tls"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    assert find(objects, "Service", "specdec-http")["spec"]["ports"][0]["appProtocol"] == "https"


def test_cert_manager_component_issues_the_secrets_tls_reads(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    relative = os.path.relpath(K8S, overlay)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{relative}/overlays/secure]\n"
        f"components: [{relative}/components/cert-manager]\n")
    objects = docs(overlay)
    certificates = {o["metadata"]["name"]: o["spec"] for o in objects
                    if o["kind"] == "Certificate"}
    assert certificates["specdec-tls"]["secretName"] == "specdec-tls"
    assert certificates["specdec-tls-client"]["secretName"] == "specdec-tls-client"
    server_name = config(objects)["SPECDEC_TLS_SERVER_NAME"]
    assert server_name in certificates["specdec-tls"]["dnsNames"]
    assert "client auth" in certificates["specdec-tls-client"]["usages"]
    # The core objects still validate strictly; cert-manager's kinds are its CRDs'.
    core = tmp_path / "core.yaml"
    core.write_text(yaml.safe_dump_all(
        [o for o in objects if not o["apiVersion"].startswith("cert-manager.io/")]))
    run(tool("kubernetes-validate"), "--strict", "--quiet", "-k", K8S_VERSION, str(core))


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
