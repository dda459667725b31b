"""One source for every default: the settings registry, read by the CLI, the services,
the loop and the Kubernetes config."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest
import yaml

from specdec import settings
from specdec.settings import SETTINGS, default

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"

# ConfigMap values that deliberately differ from the defaults, and why.
DELIBERATE = {
    "SPECDEC_HOST": "pods listen on their pod IP",
    "SPECDEC_KV_BUDGET_MB": "sized to the pods' memory limits",
    "SPECDEC_MAX_NEW_TOKENS_LIMIT": "sized to the pods' memory limits",
    "SPECDEC_MODEL_CACHE": "the image's model directory",
    "SPECDEC_DRAFT_ENDPOINT": "the headless Service of the draft pods",
    "SPECDEC_TARGET_ENDPOINT": "the headless Service of the target pods",
    "SPECDEC_TRACE_FILE": "a read-only root filesystem: spans go over OTLP only",
    "SPECDEC_HEALTH_PORT": "kubelet probes cannot speak TLS: a plaintext health-only port",
    "SPECDEC_MAX_SESSIONS": "sized to the pods' memory limits",
    "SPECDEC_MAX_PROMPT_TOKENS": "sized to the pods' memory limits",
}
BY_ENV = {s.env: s for s in SETTINGS.values()}


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.startswith("#"))
    return {key: value for key, value in pairs}


def parsed(setting: settings.Setting, raw: str) -> object:
    value = setting.type(raw) if raw != "" else setting.default
    if setting.choices is not None:
        assert value in setting.choices, (setting.env, raw)
    return value


def test_configmap_names_real_settings_with_default_values() -> None:
    entries = {k: v for k, v in read_env_file(K8S / "base" / "specdec.env").items()
               if k.startswith("SPECDEC_")}
    assert entries, "the base ConfigMap sets no SPECDEC_* key"
    unknown = sorted(set(entries) - set(BY_ENV))
    assert unknown == [], f"ConfigMap keys that name no setting: {unknown}"
    for key, raw in entries.items():
        setting = BY_ENV[key]
        if key in DELIBERATE:
            assert parsed(setting, raw) != setting.default, f"{key} equals the default now"
        else:
            assert parsed(setting, raw) == setting.default, (
                f"{key}={raw} differs from the default {setting.default!r}; change the "
                "default in specdec/settings.py or list the difference in DELIBERATE")


def test_every_specdec_key_in_the_manifests_names_a_setting() -> None:
    lines = [line.split("#", 1)[0] for path in K8S.rglob("*")
             if path.suffix in (".yaml", ".env") for line in path.read_text().splitlines()]
    names = {name for line in lines for name in re.findall(r"\bSPECDEC_[A-Z0-9_]+", line)}
    assert names, "no SPECDEC_* key found under k8s/"
    assert sorted(names - set(BY_ENV)) == []


def test_deployments_use_the_default_ports() -> None:
    for role in ("coordinator", "draft", "target"):
        for document in yaml.safe_load_all((K8S / "base" / f"{role}.yaml").read_text()):
            if document.get("kind") != "Deployment":
                continue
            container = document["spec"]["template"]["spec"]["containers"][0]
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env["SPECDEC_PORT"] == str(settings.DEFAULT_PORTS[role])
            assert env["SPECDEC_METRICS_PORT"] == str(settings.DEFAULT_METRICS_PORTS[role])


def test_serve_flags_come_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.config import serve_parser

    for setting in SETTINGS.values():
        monkeypatch.delenv(setting.env, raising=False)
    monkeypatch.setenv("SPECDEC_NUM_DRAFT_TOKENS", "7")
    parser = serve_parser()
    args = parser.parse_args(["target"])
    flagged = [s for s in SETTINGS.values() if s.flag and s.name != "max-adaptive-length"
               and s.group not in (settings.HTTP, settings.BENCH)]  # not the services'
    for setting in flagged:
        expected = 7 if setting.name == "num-draft-tokens" else setting.default
        assert getattr(args, setting.dest) == expected, setting.name
    helps = {action.dest: action.help for action in parser._actions}
    assert str(helps["draft_alternatives"]).endswith("(env SPECDEC_DRAFT_ALTERNATIVES; default: 2)")
    assert str(helps["metrics_port"]).endswith("default: unset)")
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert set(groups[settings.CPU_KERNELS]) == {
        "torch_threads", "linear_kernel", "attention_kernel", "draft_dtype",
        "draft_linear_kernel", "draft_compile", "fused_step"}
    assert all(SETTINGS[d.replace("_", "-")].advanced for d in groups[settings.CPU_KERNELS])


def test_up_forwards_every_service_setting() -> None:
    from specdec.commands.up import FORWARDED

    assert {name.replace("_", "-") for name in FORWARDED} == set(settings.SERVICE_SETTINGS)


def test_code_defaults_are_the_registry_defaults() -> None:
    from coordinator.servicer import CoordinatorSettings, make_policy
    from draft_service.servicer import DraftServicer
    from specdec.core import adaptive, prompt_lookup
    from specdec.core.loop import GenerateConfig
    from specdec.engine import shapes
    from target_service.servicer import TargetServicer

    coordinator = CoordinatorSettings()
    assert coordinator.num_draft_tokens == GenerateConfig().num_draft_tokens \
        == default("num-draft-tokens")
    assert coordinator.max_draft_tokens == default("max-draft-tokens")
    assert coordinator.max_new_tokens_limit == default("max-new-tokens-limit")
    assert coordinator.draft_timeout_s * 1000 == default("draft-timeout-ms")
    assert coordinator.target_timeout_s == default("target-timeout-s")
    assert coordinator.draft_confidence == default("draft-confidence")
    assert coordinator.num_alternatives == shapes.DEFAULT_ALTERNATIVES \
        == default("draft-alternatives")
    assert (coordinator.prompt_lookup_tokens, coordinator.prompt_lookup_min,
            coordinator.prompt_lookup_max) == (
        default("prompt-lookup-tokens"), default("prompt-lookup-min"),
        default("prompt-lookup-max")) == (
        prompt_lookup.DEFAULT_LOOKUP_TOKENS, prompt_lookup.DEFAULT_MIN_NGRAM,
        prompt_lookup.DEFAULT_MAX_NGRAM)
    for servicer in (DraftServicer, TargetServicer):
        parameter = inspect.signature(servicer.__init__).parameters["max_draft_tokens"]
        assert parameter.default == default("max-draft-tokens")
    policy = adaptive.AdaptiveLength()
    assert (policy.initial, policy.max_length) == (default("num-draft-tokens"),
                                                   default("max-adaptive-length"))
    assert inspect.signature(make_policy).parameters["max_length"].default \
        == default("max-adaptive-length")
    adaptive_policy = adaptive.length_policy(default("num-draft-tokens"), True)
    assert isinstance(adaptive_policy, adaptive.AdaptiveLength)
    assert adaptive_policy.max_length == default("max-adaptive-length")


def test_choices_match_the_modules_that_implement_them() -> None:
    from specdec.engine import attention, draft_compile, kernels

    assert settings.LINEAR_KERNELS == kernels.KERNELS
    assert settings.ATTENTION_KERNELS == attention.ATTENTION_KERNELS
    assert settings.COMPILE_CHOICES == draft_compile.SETTINGS


def test_from_env_converts_and_falls_back() -> None:
    setting = SETTINGS["kv-budget-mb"]
    assert setting.from_env({"SPECDEC_KV_BUDGET_MB": "512"}) == 512
    assert setting.from_env({"SPECDEC_KV_BUDGET_MB": ""}) == 2048 == setting.default
    with pytest.raises(ValueError):
        setting.from_env({"SPECDEC_KV_BUDGET_MB": "lots"})


def test_markdown_table_lists_every_setting_and_matches_the_docs() -> None:
    table = settings.markdown_table()
    for setting in SETTINGS.values():
        assert f"`{setting.env}`" in table
    assert f"### {settings.CPU_KERNELS}" in table
    docs = ROOT / "docs" / "configuration.md"
    if not docs.exists():
        pytest.skip("docs/configuration.md is not in this tree")
    assert table in docs.read_text(), (
        "docs/configuration.md's table is stale: regenerate it with "
        "`specdec settings --markdown`")


def test_settings_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from specdec.commands import settings as command

    assert command.run(argparse.Namespace(markdown=True)) == 0
    assert capsys.readouterr().out == settings.markdown_table()
