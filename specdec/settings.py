"""Every setting of the services, defined once: name, type, default, help, choices.

A setting `some-setting` is the flag `--some-setting`, which defaults to the environment
variable `SPECDEC_SOME_SETTING`, then to the default here. The CLI builds its flags from
this registry, the servicers and the loop take their defaults from it (`default(name)`),
a test checks the Kubernetes ConfigMap against it, and `specdec settings --markdown`
prints the reference table of the docs from it.

This module imports nothing heavy (no torch, transformers or grpc): the CLI, the
ConfigMap test and the docs read it without loading a model.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# A trace file rotates to <file>.1 past this size (one old file kept).
TRACE_FILE_MAX_MB = 100


def _default_trace_dir() -> str:
    """Where trace files go unless told: the user's state directory, not the current one."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                              "state")
    return os.path.join(state, "specdec", "traces")


MODELS = "models"
SERVICE = "service"
SPECULATION = "speculation"
LIMITS = "limits and timeouts"
TELEMETRY = "telemetry"
CPU_KERNELS = "advanced: CPU kernels"
SECURITY = "security"
HTTP = "HTTP API"
BENCH = "benchmark"
GROUPS = (MODELS, SERVICE, SPECULATION, LIMITS, SECURITY, HTTP, TELEMETRY, CPU_KERNELS, BENCH)


def env_name(flag: str) -> str:
    """`--some-setting` (or `some-setting`) -> `SPECDEC_SOME_SETTING`."""
    return "SPECDEC_" + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class Setting:
    name: str  # the flag without its dashes
    default: Any
    help: str
    group: str
    type: type = str
    choices: tuple[Any, ...] | None = None
    # A fine-tuning knob: in its own help group and marked in the reference table.
    advanced: bool = False
    # False for a setting read from the environment only (no flag).
    flag: bool = True
    # The default as the reference table shows it, where `default` is computed from the
    # machine (a path under the user's home): the table is the same on every machine.
    shown: str = ""

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    def from_env(self, environ: Mapping[str, str] | None = None) -> Any:
        """The environment's value, converted, or the default when unset or empty."""
        raw = (os.environ if environ is None else environ).get(self.env)
        return self.type(raw) if raw not in (None, "") else self.default


# Choices shared with the modules that implement them (a test checks they agree).
BACKENDS = ("auto", "cpu-tuned", "torch")
LINEAR_KERNELS = ("auto", "torch", "skinny", "onednn", "int8")
# --dtype int8 is a storage format, not a tensor dtype: int8 linear weights (the int8
# linear kernel, specdec.engine.int8) with everything else, activations included, in
# bfloat16.
INT8_DTYPE = "int8"
# --dtype auto: int8 weights where the int8 operator runs (a CPU with a C++ compiler),
# bfloat16 elsewhere; activations in bfloat16 either way.
AUTO_DTYPE = "auto"
# The linear kernel --dtype auto implies (resolved by specdec.engine.kernels.resolve_kernel
# at load, where the device and the operator are known); not a --linear-kernel choice.
INT8_IF_AVAILABLE = "int8-if-available"


def linear_kernel_for(dtype_name: str, linear_kernel: str) -> str:
    """The linear kernel a --dtype value implies: int8 for int8; for auto, int8 where it
    runs unless --linear-kernel names another; else linear_kernel."""
    name = dtype_name.lower()
    if name == INT8_DTYPE:
        return INT8_DTYPE
    if name == AUTO_DTYPE and linear_kernel == "auto":
        return INT8_IF_AVAILABLE
    return linear_kernel


def draft_dtype_for(draft_dtype: str, dtype_name: str) -> str:
    """The draft's dtype setting: --draft-dtype (empty: auto), where same is the target's
    --dtype (auto's activations, bfloat16, with the linear kernel linear_kernel_for
    gives)."""
    setting = draft_dtype or "auto"
    if setting != "same":
        return setting
    return "bfloat16" if dtype_name.lower() == AUTO_DTYPE else dtype_name
ATTENTION_KERNELS = ("auto", "sdpa", "grouped", "rowwise")
COMPILE_CHOICES = ("auto", "on", "off")
FUSED_STEP_CHOICES = ("auto", "off")
# SpeculationParams.method: where a round's proposals come from (coordinator.validation).
SPECULATION_METHODS = ("auto", "draft", "suffix", "lookup", "none")
# `specdec bench --workload` (specdec.bench.workloads): "all" runs each in one run.
BENCH_WORKLOADS = ("prompts", "repetition", "all")
DEFAULT_PORTS = {"coordinator": 50051, "draft": 50052, "target": 50053}
DEFAULT_METRICS_PORTS = {"coordinator": 9464, "draft": 9465, "target": 9466}

_REPLICAS = "host:port, a list host:port,host:port, or dns:///name:port"

_ALL = (
    # models
    Setting("target-model", "smollm2-135m-instruct",
            "target model: the embedded SmolLM2-135M-Instruct, or any HF path or id", MODELS),
    Setting("draft-model", "specdec-draft",
            "draft model: the embedded trained draft, or any HF path or id", MODELS),
    Setting("device", "cpu", "torch device: cpu, cuda, cuda:N or auto", MODELS),
    Setting("dtype", AUTO_DTYPE,
            "model dtype: auto (int8 on a CPU where the int8 operator builds, else "
            "bfloat16), bfloat16, float32, float16, or int8 (int8 linear weights with "
            "bfloat16 activations; CPU)", MODELS),
    Setting("backend", "auto",
            "how models run: auto (cpu-tuned on CPU, torch elsewhere), cpu-tuned (the "
            "row-invariant CPU kernels, the draft's precision and compile chosen at load), "
            "or torch (stock kernels)", MODELS, choices=BACKENDS),
    Setting("kv-budget-mb", 2048, "KV cache memory budget per model (MiB)", MODELS, type=int),
    Setting("model-cache", "",
            "directory of converted models (empty: $XDG_CACHE_HOME/specdec/models)",
            MODELS, flag=False),
    # service
    Setting("host", "127.0.0.1", "interface to listen on", SERVICE),
    Setting("port", 0, "port (0 = the role's default: coordinator "
            f"{DEFAULT_PORTS['coordinator']}, draft {DEFAULT_PORTS['draft']}, "
            f"target {DEFAULT_PORTS['target']})", SERVICE, type=int),
    Setting("draft-endpoint", f"127.0.0.1:{DEFAULT_PORTS['draft']}",
            f"coordinator: the draft replicas, {_REPLICAS} ('none' = no draft, target-only)",
            SERVICE),
    Setting("target-endpoint", f"127.0.0.1:{DEFAULT_PORTS['target']}",
            f"coordinator: the target replicas, {_REPLICAS}", SERVICE),
    Setting("discovery-refresh-s", 5.0,
            "coordinator: seconds between DNS re-resolutions of dns:/// endpoints",
            SERVICE, type=float, flag=False),
    Setting("max-workers", 32, "gRPC server threads", SERVICE, type=int),
    Setting("session-ttl-s", 600.0,
            "release a session's KV cache after this long without calls", SERVICE, type=float),
    Setting("grace-s", 5.0, "graceful-stop period for in-flight calls", SERVICE, type=float),
    Setting("max-concurrent-requests", 256,
            "coordinator: generations running at once; more wait in a queue", LIMITS,
            type=int),
    Setting("max-queued-requests", 256,
            "coordinator: requests waiting for a running slot; beyond this a request is "
            "refused at once with RESOURCE_EXHAUSTED", LIMITS, type=int),
    Setting("max-batch-sessions", 32,
            "draft/target: most sessions whose calls share one forward", SERVICE, type=int),
    Setting("max-batch-rows", 256,
            "draft/target: most token rows of one batched forward (the runner also splits "
            "above its measured row-invariance cap)", SERVICE, type=int),
    Setting("max-batch-prefills", 1,
            "draft/target: long catch-ups (a new session's prompt) run on their own between "
            "decode batches, at most this many after each", SERVICE, type=int),
    # speculation
    Setting("num-draft-tokens", 4,
            "draft length adaptive requests start from; requests that do not set speculation "
            "are adaptive (0 = those run target-only)", SPECULATION, type=int),
    # Drafts longer than this make a verification more than a decode-sized forward
    # (specdec.engine.shapes.DECODE_ROWS rows), whose cost then grows with its length.
    Setting("max-draft-tokens", 16,
            "most tokens drafted per round (a request asking more is rejected)",
            SPECULATION, type=int),
    # Beyond this a CPU verification costs more than the extra acceptance brings, and the
    # adaptive policy sweeps every length it allows once.
    Setting("max-adaptive-length", 8,
            "longest draft the adaptive policy chooses unless a request asks for more (a "
            "flag of `specdec bench`; the services use this default)", SPECULATION, type=int),
    Setting("draft-confidence", 0.4,
            "adaptive requests end a round's draft after a token the draft gives less than "
            "this probability (0 = off; a request may set its own)", SPECULATION, type=float),
    Setting("draft-alternatives", 2,
            "adaptive requests verify a token tree: up to this many alternatives beside the "
            "draft's chain each round, where the draft is least sure of it (0 = a chain; a "
            "request may set its own)", SPECULATION, type=int),
    # One forward per token either way; more steps save more round trips but stream
    # in larger pieces and skip prompt-lookup chances between them.
    Setting("decode-steps", 8,
            "coordinator: a round without a proposal has the target decode up to this many "
            "tokens in one Verify while the length policy drafts nothing (target-only "
            "requests; adaptive ones while the draft does not pay): the same tokens, without "
            "a round trip per token (1 = one token per Verify)", SPECULATION, type=int),
    Setting("prompt-lookup-tokens", 6,
            "speculative requests first look the last few tokens up in the text so far and "
            "propose up to this many of the tokens that followed them, without a draft "
            "forward (0 = off; a request may set its own)", SPECULATION, type=int),
    Setting("prompt-lookup-min", 2, "shortest n-gram prompt lookup matches", SPECULATION,
            type=int),
    Setting("prompt-lookup-max", 4, "longest n-gram prompt lookup matches (tried first)",
            SPECULATION, type=int),
    # Suffix decoding (specdec.core.suffix_cache): vLLM's suffix_decoding_* knobs.
    Setting("suffix-max-tokens", 0,
            "coordinator: most tokens (token-tree nodes) a suffix-decoding round proposes "
            "from text already seen, this request's and earlier responses' (0 = off; 16 "
            "is the measured setting)",
            SPECULATION, type=int),
    Setting("suffix-max-tree-depth", 24,
            "coordinator: longest substring the suffix trees hold: matched text plus "
            "proposed continuation", SPECULATION, type=int, advanced=True),
    Setting("suffix-prompt-tokens", 4096,
            "coordinator: a request's own suffix tree starts from at most this many of its "
            "latest tokens, which bounds what a long prompt costs the coordinator in time and "
            "memory (prompt lookup still searches the whole prompt; 0 = no limit)",
            SPECULATION, type=int, advanced=True),
    Setting("suffix-max-cached-requests", 10000,
            "coordinator: earlier responses the global suffix tree holds, oldest evicted "
            "first (0 = this request's text only)", SPECULATION, type=int),
    Setting("suffix-cache-mb", 512,
            "coordinator: memory of the global suffix tree (MiB); past it the oldest "
            "responses are evicted", SPECULATION, type=int),
    Setting("suffix-max-spec-factor", 1.0,
            "coordinator: a suffix round proposes at most this many tokens per matched "
            "token", SPECULATION, type=float, advanced=True),
    Setting("suffix-min-token-prob", 0.1,
            "coordinator: a suffix round proposes only continuations whose estimated "
            "probability (their frequency after the matched text) is at least this",
            SPECULATION, type=float, advanced=True),
    Setting("suffix-share-tenants", "off",
            "coordinator: on = every API key's requests speculate from every key's earlier "
            "responses; off = each key's only from its own", SPECULATION,
            choices=("on", "off")),
    # limits and timeouts
    Setting("max-new-tokens-limit", 2048, "largest max_new_tokens a request may ask for",
            LIMITS, type=int),
    Setting("draft-timeout-ms", 5000.0,
            "per-call deadline of Propose; a slower draft is skipped (target-only, still "
            "exact) and retried with backoff", LIMITS, type=float),
    Setting("target-timeout-s", 30.0,
            "how long one Verify may wait for an unavailable target, retries included",
            LIMITS, type=float),
    # telemetry
    Setting("tracing", "on", "OpenTelemetry tracing: on or off", TELEMETRY),
    Setting("trace-dir", _default_trace_dir(),
            "directory of the OTLP/JSON-lines trace files, one per service; each rotates to "
            f"<file>.1 past {TRACE_FILE_MAX_MB} MiB, so a service keeps at most "
            f"{2 * TRACE_FILE_MAX_MB} MiB", TELEMETRY,
            shown="${XDG_STATE_HOME:-~/.local/state}/specdec/traces"),
    Setting("trace-file", "",
            "trace file (OTLP/JSON lines); 'none' writes no file, empty means "
            "<trace-dir>/<role>.jsonl", TELEMETRY),
    Setting("trace-tokens", "off", "record token ids on spans: on or off", TELEMETRY),
    Setting("metrics-port", None,
            "Prometheus /metrics port (-1: off, 0: any free port; unset: "
            + ", ".join(f"{port} {role}" for role, port in DEFAULT_METRICS_PORTS.items())
            + ")", TELEMETRY, type=int),
    # advanced: CPU kernels (used by the cpu-tuned backend; the torch backend ignores them)
    Setting("torch-threads", 0, "torch intra-op threads (0 = auto: under `specdec up` every "
            "CPU of the host for each service; alone, torch's default)",
            CPU_KERNELS,
            type=int, advanced=True),
    Setting("linear-kernel", "auto",
            "matmul kernel of the linear layers: auto (skinny for float32, onednn for "
            "bfloat16 where the CPU has its bfloat16 support, else torch), torch, skinny, "
            "onednn or int8 (= --dtype int8)", CPU_KERNELS,
            choices=LINEAR_KERNELS, advanced=True),
    Setting("attention-kernel", "auto",
            "attention of decode-sized forwards: auto (grouped for float32, rowwise for "
            "reduced precision), sdpa, grouped or rowwise", CPU_KERNELS,
            choices=ATTENTION_KERNELS, advanced=True),
    Setting("draft-dtype", "auto",
            "draft model dtype: auto (at load, time the draft in --dtype against float32 "
            "with each CPU kernel and keep the fastest), same (= --dtype), or a dtype; "
            "changes the draft's speed and acceptance, never the output", CPU_KERNELS,
            advanced=True),
    Setting("draft-linear-kernel", "",
            "matmul kernel of the draft's linear layers (empty = --linear-kernel)",
            CPU_KERNELS, choices=("", *LINEAR_KERNELS), advanced=True),
    Setting("draft-compile", "auto",
            "torch.compile the draft's forward: auto (compile at load, time it against "
            "eager and keep the faster), on, off", CPU_KERNELS, choices=COMPILE_CHOICES,
            advanced=True),
    Setting("fused-step", "auto",
            "decode-sized forwards of the target and a token draft without transformers' "
            "module stack, q/k/v and gate/up as one int8 product each, the same logits bit "
            "for bit: auto (a Llama-family model on int8 weights with rowwise attention), "
            "off",
            CPU_KERNELS, choices=FUSED_STEP_CHOICES, advanced=True),
    # security (specdec.serving.security; docs/security.md)
    Setting("tls-cert-file", "", "PEM certificate this server presents (empty = plaintext)",
            SECURITY),
    Setting("tls-key-file", "", "PEM private key of --tls-cert-file", SECURITY),
    Setting("tls-ca-file", "",
            "PEM CA: draft and target require client certificates it signed (mutual TLS); "
            "the coordinator verifies the services' certificates against it, the HTTP API "
            "the coordinator's (and calls it over TLS)", SECURITY),
    Setting("tls-client-cert-file", "",
            "coordinator, HTTP API: PEM client certificate presented to the services it "
            "calls", SECURITY),
    Setting("tls-client-key-file", "",
            "coordinator, HTTP API: PEM private key of --tls-client-cert-file", SECURITY),
    Setting("tls-server-name", "",
            "coordinator, HTTP API: the name the certificates of the services it calls must "
            "carry (empty = the host of each endpoint; set it when endpoints are pod "
            "addresses)", SECURITY),
    Setting("api-keys-file", "",
            "coordinator: file of API keys, one per line, '#' comments; every Coordinator "
            "call then needs metadata 'authorization: Bearer <key>'; re-read when it "
            "changes (empty = no keys required)", SECURITY),
    Setting("reflection", "on", "gRPC server reflection", SECURITY, choices=("on", "off")),
    Setting("health-port", 0,
            "also serve grpc.health.v1 alone, in plaintext, on this port (for Kubernetes "
            "probes while the main port requires TLS; 0 = off)", SECURITY, type=int),
    Setting("max-message-mb", 64,
            "largest gRPC message this server or its channels send or receive (MiB)",
            SECURITY, type=int),
    Setting("max-sessions", 1024,
            "most sessions open at once on this service (coordinator: generations in "
            "flight); a new one beyond it gets RESOURCE_EXHAUSTED (0 = no cap)", SECURITY,
            type=int),
    Setting("max-prompt-tokens", 0,
            "coordinator: longest prompt in tokens (0 = the target's context)", SECURITY,
            type=int),
    # the HTTP API (specdec http; docs/http.md)
    Setting("http-host", "127.0.0.1", "interface the HTTP API listens on", HTTP),
    Setting("http-port", 8000, "HTTP API port (under `specdec up`: 0 = any free port, "
            "-1 = no HTTP API)", HTTP, type=int),
    Setting("coordinator-endpoint", "127.0.0.1:50051",
            "the coordinator the HTTP API calls, host:port", HTTP),
    # `specdec bench`'s own (not the services')
    Setting("workload", "prompts",
            "what `specdec bench` runs: prompts (the hand-written set), repetition (generated "
            "code edits, JSON extraction and multi-turn chat quoting earlier answers) or all "
            "(both in one run, with ratios per workload)", BENCH, choices=BENCH_WORKLOADS),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}

# Which settings each service command takes.
MODEL_SETTINGS = ("target-model", "draft-model", "device", "dtype", "backend", "kv-budget-mb",
                  "torch-threads", "linear-kernel", "attention-kernel", "draft-dtype",
                  "draft-linear-kernel", "draft-compile", "fused-step")
# Accepted by every role, so `specdec up` can pass one set to all three.
SERVICE_SETTINGS = (*MODEL_SETTINGS, "session-ttl-s", "max-workers", "max-draft-tokens",
                    "num-draft-tokens", "draft-confidence", "decode-steps",
                    "draft-alternatives", "prompt-lookup-tokens", "prompt-lookup-min",
                    "prompt-lookup-max", "suffix-max-tokens", "suffix-max-tree-depth",
                    "suffix-prompt-tokens", "suffix-max-cached-requests", "suffix-cache-mb",
                    "suffix-max-spec-factor", "suffix-min-token-prob", "suffix-share-tenants",
                    "max-new-tokens-limit", "draft-timeout-ms",
                    "target-timeout-s", "grace-s", "max-batch-sessions",
                    "max-batch-rows", "max-batch-prefills",
                    "max-concurrent-requests", "max-queued-requests")
ADDRESS_SETTINGS = ("host", "port", "draft-endpoint", "target-endpoint")
TELEMETRY_SETTINGS = tuple(s.name for s in _ALL if s.group == TELEMETRY)
SECURITY_SETTINGS = tuple(s.name for s in _ALL if s.group == SECURITY)
# Those of `specdec http`: it serves TLS and calls the coordinator (API keys are the
# coordinator's: the HTTP API forwards the caller's Authorization header).
HTTP_SECURITY_SETTINGS = ("tls-cert-file", "tls-key-file", "tls-ca-file",
                          "tls-client-cert-file", "tls-client-key-file", "tls-server-name")


def default(name: str) -> Any:
    """The default of setting `name` (its code default, not the environment's)."""
    return SETTINGS[name].default


def add_setting(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str,
                default: Any, help: str, type: Any = str, **kwargs: Any) -> None:
    """Add --flag whose default comes from SPECDEC_FLAG, then from `default` (for a
    command's own flags; the services' settings come from the registry)."""
    raw = os.environ.get(env_name(flag))
    value = type(raw) if raw not in (None, "") else default
    shown = "unset" if default is None else "empty" if default == "" else default
    parser.add_argument(flag, default=value, type=type,
                        help=f"{help} (env {env_name(flag)}; default: {shown})", **kwargs)


def add_settings(parser: argparse.ArgumentParser, names: Iterable[str],
                 grouped: bool = True) -> None:
    """Flags for the named settings; with `grouped`, in one argparse group per section."""
    chosen = [SETTINGS[name] for name in names if SETTINGS[name].flag]
    for group in GROUPS:
        members = [s for s in chosen if s.group == group]
        if not members:
            continue
        target: argparse.ArgumentParser | argparse._ArgumentGroup = (
            _group(parser, group) if grouped else parser)
        for setting in members:
            extra = {"choices": setting.choices} if setting.choices is not None else {}
            add_setting(target, "--" + setting.name, setting.default, setting.help,
                        type=setting.type, **extra)


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    for existing in parser._action_groups:
        if existing.title == title:
            return existing
    return parser.add_argument_group(title)


def markdown_table() -> str:
    """The reference table of every setting, grouped, for docs/configuration.md."""
    lines: list[str] = []
    for group in GROUPS:
        lines += ["", f"### {group}", "", "| flag | environment | default | meaning |",
                  "|---|---|---|---|"]
        for s in (s for s in _ALL if s.group == group):
            flag = f"`--{s.name}`" if s.flag else "(environment only)"
            shown = f"`{s.shown}`" if s.shown else "unset" if s.default is None \
                else f"`{s.default}`" if s.default != "" else "empty"
            meaning = s.help + (f" (one of: {', '.join(c or 'empty' for c in s.choices)})"
                                if s.choices else "")
            lines.append(f"| {flag} | `{s.env}` | {shown} | {meaning.replace('|', '/')} |")
    return "\n".join(lines[1:]) + "\n"
