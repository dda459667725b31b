"""The client side of the CLI as a script sees it: start-up without torch, `generate`'s
streams and JSON, the hint when nothing listens, pipes that close early."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from service_harness import Services
from tiny_models import tiny_llama

from specdec.serving.stack import free_port
from tests.telemetry_helpers import file_telemetry, run_request

SPECDEC = [sys.executable, "-m", "specdec.cli"]
ENV = {**os.environ, "SPECDEC_TRACING": "off", "SPECDEC_METRICS_PORT": "-1"}


def test_client_commands_do_not_import_torch_or_transformers() -> None:
    # The reported fault: every CLI call imported torch and transformers via specdec.config.
    probe = (
        "import sys\n"
        "from specdec.cli import build_parser, chosen_command, main\n"
        "for argv in (['generate', 'hi'], ['traces']):\n"
        "    build_parser(chosen_command(argv)).parse_args(argv)\n"
        "build_parser(None).format_help()\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy) or 'none')\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60, env=ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "none"


def test_help_lists_every_command_without_loading_it() -> None:
    started = time.monotonic()
    result = subprocess.run([*SPECDEC, "--help"], capture_output=True, text=True, timeout=60,
                            env=ENV)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    for command in ("up", "generate", "traces", "serve", "ray", "bench", "demo"):
        assert f"    {command}" in result.stdout
    assert "generate text through the coordinator" in result.stdout
    assert elapsed < 10  # a generous bound on a shared machine; torch alone takes longer


def test_every_command_is_found_by_the_name_it_registers() -> None:
    from specdec.cli import build_parser, chosen_command, command_modules

    names = command_modules()
    assert {"ray", "train-draft", "up", "generate"} <= set(names)
    for name in names:
        assert chosen_command(["-v", name, "--help"]) == name
        parser = build_parser(name)
        subparsers = next(a for a in parser._actions if a.dest == "command")
        assert subparsers.choices[name].get_default("func") is not None, name  # type: ignore[index]


def test_generate_help_gives_every_flag_a_default() -> None:
    from specdec.cli import build_parser

    parser = build_parser("generate")
    generate = next(action for action in parser._actions if action.dest == "command"
                    ).choices["generate"]  # type: ignore[union-attr]
    for action in generate._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in (action.help or ""), action.option_strings


def test_generate_hints_at_specdec_up_when_nothing_listens() -> None:
    port = free_port()
    result = subprocess.run([*SPECDEC, "generate", "hi", "--endpoint", f"127.0.0.1:{port}",
                             "--timeout-s", "5"], capture_output=True, text=True,
                            timeout=60, env=ENV)
    assert result.returncode == 1
    assert f"nothing answers at 127.0.0.1:{port}" in result.stderr
    assert "specdec up" in result.stderr
    assert "Traceback" not in result.stderr


def test_build_request_sends_only_what_was_asked() -> None:
    from specdec.commands.generate import build_request

    assert not build_request("x", max_new_tokens=4).HasField("speculation")
    adaptive = build_request("x", max_new_tokens=4, num_draft_tokens=6)
    assert (adaptive.speculation.num_draft_tokens, adaptive.speculation.adaptive) == (6, True)
    fixed = build_request("x", max_new_tokens=4, num_draft_tokens=6, fixed=True)
    assert (fixed.speculation.num_draft_tokens, fixed.speculation.adaptive) == (6, False)
    target_only = build_request("x", max_new_tokens=4, num_draft_tokens=0)
    assert (target_only.speculation.num_draft_tokens, target_only.speculation.adaptive) == (
        0, False)
    gated = build_request("x", max_new_tokens=4, draft_confidence=0.2)
    assert gated.speculation.adaptive and gated.speculation.num_draft_tokens == 0
    with pytest.raises(ValueError, match="--fixed needs"):
        build_request("x", max_new_tokens=4, fixed=True)


@pytest.fixture(scope="module")
def coordinator() -> Iterator[str]:
    from transformers import AutoTokenizer

    from specdec.engine.models import DEFAULT_TARGET, resolve

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_TARGET, progress=False))
    vocab = len(tokenizer)
    stack = Services(tiny_llama(vocab, seed=2, layers=1), tiny_llama(vocab, seed=1),
                     tokenizer=tokenizer)
    yield stack.coordinator_server.address
    stack.close()


def generate(endpoint: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SPECDEC, "generate", "Hello", "--max-new-tokens", "6",
                           "--endpoint", endpoint, *flags],
                          capture_output=True, text=True, timeout=120, env=ENV)


def test_generate_puts_text_on_stdout_and_stats_on_stderr(coordinator: str) -> None:
    full = generate(coordinator, "--json")
    assert full.returncode == 0, full.stderr
    response = json.loads(full.stdout)
    # Complete JSON: fields at their default values are present too.
    assert response["stats"]["degraded"] is False and response["stats"]["resyncs"] == 0
    assert "trace_id" in response and "kept_alternatives" in response["stats"]
    plain = generate(coordinator)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == response["text"] + "\n"
    assert "acceptance rate" in plain.stderr
    quiet = generate(coordinator, "--quiet", "--stream")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == response["text"] + "\n" and quiet.stderr == ""


def test_generate_into_a_closed_pipe_exits_quietly(coordinator: str) -> None:
    process = subprocess.Popen([*SPECDEC, "generate", "Hello", "--max-new-tokens", "6",
                                "--stream", "--endpoint", coordinator],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # `| head` that has read enough
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr


def test_traces_json_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    telemetry = file_telemetry(tmp_path / "coordinator.jsonl")
    run_request(telemetry, request_id="pipe")
    telemetry.shutdown()
    process = subprocess.Popen([*SPECDEC, "traces", "--json", "--trace-dir", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr
