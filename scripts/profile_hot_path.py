"""Profile the speculative hot path with py-spy and say where a round's time goes.

Runs greedy generations in-process (target-only and speculative with the default pair)
under `py-spy record`, then groups the sampled leaf frames (the Python line that was
running, C extensions included in it) into the parts of a round: GEMMs, attention,
the rest of the model's layers, cache bookkeeping, mask building, specdec's own loop,
sampling, and everything else. Output: a markdown table on stdout (and --out).

    .venv/bin/python scripts/profile_hot_path.py --draft-length 3 --dtype float32
    .venv/bin/python scripts/profile_hot_path.py --worker ...   # (internal: the profiled run)

Needs py-spy (in the dev extra) and permission to trace a child process.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINEAR_FILES = ("torch/nn/modules/linear.py", "specdec/engine/kernels.py")
# (group, predicate on "function (file:line)") in priority order: first match wins.
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("GEMMs (nn.Linear)", ("torch/nn/modules/linear.py",)),
    ("attention (sdpa)",
     ("sdpa_attention.py", "scaled_dot_product", "specdec/engine/attention.py")),
    ("KV cache (transformers cache_utils)", ("cache_utils.py",)),
    ("mask building (transformers masking_utils)", ("masking_utils.py",)),
    ("RMSNorm, RoPE, MLP glue (modeling_llama)", ("modeling_llama.py", "activations.py")),
    ("module call overhead (torch.nn.Module)", ("torch/nn/modules/module.py",)),
    ("specdec sampling / rejection", ("specdec/core/sampling.py", "specdec/core/rejection.py")),
    ("specdec loop, runner, history", ("specdec/",)),
    ("transformers other", ("transformers/",)),
    ("torch other", ("torch/",)),
]


def classify(stack: list[str]) -> str:
    leaf = stack[-1]
    if any(f in leaf for f in LINEAR_FILES) and len(stack) > 1:
        # The LM head is called from the *ForCausalLM forward, the layers' GEMMs from
        # the attention and MLP blocks: the split shows what a wide vocabulary costs.
        callers = [frame for frame in stack[:-1] if "torch/nn/modules/module.py" not in frame]
        caller = callers[-1] if callers else ""
        return "GEMMs: LM head" if "ForCausalLM.forward" in caller else "GEMMs: layers"
    for group, needles in GROUPS:
        if any(needle in leaf for needle in needles):
            return group
    return "other"


def worker(args: argparse.Namespace) -> None:
    import torch

    from specdec.bench.prompts import chat_encoder, load_prompts, select
    from specdec.core.loop import GenerateConfig, generate
    from specdec.core.sampling import SamplingParams
    from specdec.engine.local import LocalDrafter, LocalVerifier
    from specdec.engine.models import (
        DEFAULT_DRAFT,
        DEFAULT_TARGET,
        load_causal_lm,
        model_info,
        parse_dtype,
    )
    from specdec.engine.runner import ModelRunner

    torch.set_num_threads(args.torch_threads)
    dtype, cpu = parse_dtype(args.dtype), torch.device("cpu")
    target = load_causal_lm(DEFAULT_TARGET, cpu, dtype, progress=False)
    draft = load_causal_lm(DEFAULT_DRAFT, cpu, dtype, progress=False)
    target_runner = ModelRunner(target.model)
    draft_runner = ModelRunner(draft.model, target_runner.vocab.target_vocab_size,
                               draft.token_map)
    drafter = LocalDrafter(draft_runner) if args.draft_length else None
    verifier = LocalVerifier(target_runner)
    encode = chat_encoder(target.tokenizer)
    prompts = [encode(p.text) for p in select(load_prompts(), 1)]
    eos = model_info(DEFAULT_TARGET).eos_token_ids
    config = GenerateConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(),
                            num_draft_tokens=args.draft_length, eos_token_ids=eos)
    generate(drafter, verifier, prompts[0][:32], config)  # warm-up, also not profiled much
    Path(args.ready_file).write_text("ready")
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        for prompt in prompts:
            generate(drafter, verifier, prompt, config)


def profile(args: argparse.Namespace) -> str:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        ready, raw = Path(tmp) / "ready", Path(tmp) / "profile.txt"
        child = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--ready-file", str(ready),
             "--seconds", str(args.seconds + 5), *forwarded(args)])
        while not ready.exists():
            if child.poll() is not None:
                raise SystemExit(f"the profiled run exited early (status {child.returncode})")
            time.sleep(0.5)
        subprocess.run([py_spy, "record", "--pid", str(child.pid), "--format", "raw",
                        "--duration", str(args.seconds), "--rate", "200", "--output", str(raw),
                        "--nonblocking"], check=True, stdout=subprocess.DEVNULL)
        child.wait()
        samples: collections.Counter[str] = collections.Counter()
        functions: collections.Counter[str] = collections.Counter()
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            leaf = stack.split(";")[-1]
            samples[classify(stack.split(";"))] += int(count)
            functions[leaf.split(" (")[0] + " " + leaf[leaf.find("("):].split(":")[0] + ")"] \
                += int(count)
    total = sum(samples.values())
    title = (f"greedy, {'target-only' if not args.draft_length else f'k={args.draft_length}'}"
             f", {args.dtype}, {args.torch_threads} thread(s), {total} samples "
             f"over {args.seconds} s")
    lines = [f"### {title}", "", "| where | share of samples |", "|---|---|"]
    lines += [f"| {group} | {count / total:.1%} |" for group, count in samples.most_common()]
    lines += ["", "Top leaf functions:", "", "| function (file) | share |", "|---|---|"]
    lines += [f"| `{name}` | {count / total:.1%} |" for name, count in functions.most_common(12)]
    return "\n".join(lines) + "\n"


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--draft-length", str(args.draft_length), "--dtype", args.dtype,
            "--torch-threads", str(args.torch_threads),
            "--max-new-tokens", str(args.max_new_tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-length", type=int, default=3, help="0 = target only")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=40, help="how long py-spy samples")
    parser.add_argument("--out", help="append the markdown here too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    report = profile(args)
    print(report)
    if args.out:
        with open(args.out, "a") as out:
            out.write(report + "\n")


if __name__ == "__main__":
    main()
