"""How closely the int8 target follows a reference (bfloat16, or float32), on held-out chat.

The held-out chat is the project's held-out prompts (no training context holds them) in
the chat template, each answered greedily by the reference target (--reference, default
bfloat16). Along those conversations, teacher-forced:
- top-1 agreement: the share of answer positions where the compared target's most
  probable token is the reference's greedy token (the share of greedy tokens unchanged);
- perplexity of each model on the answers, and its ratio to the reference's.
Both models use the cpu-tuned backend's kernels, as the services run them.
`--simulate-int8-inputs` instead runs the compared model's int8 weights in float32 on
inputs rounded to 8 bits with a scale per 32 (llama.cpp's Q8 products), to measure what
8-bit activations would cost without a kernel for them.

    .venv/bin/python scripts/measure_int8_quality.py --prompts 32 --max-new-tokens 64
    .venv/bin/python scripts/measure_int8_quality.py --reference float32
"""

from __future__ import annotations

import argparse
import math
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--target-model", default="smollm2-135m-instruct")
    parser.add_argument("--compare", default="int8",
                        help="the --dtype compared with the reference (int8, float32, ...)")
    parser.add_argument("--reference", default="bfloat16",
                        help="the --dtype that answers and is compared with (bfloat16, "
                             "float32)")
    parser.add_argument("--simulate-int8-inputs", action="store_true",
                        help="int8 weights in float32 on inputs rounded to 8 bits per 32")
    args = parser.parse_args()
    if args.simulate_int8_inputs:
        simulate_int8_inputs()

    from specdec.draft_training.heldout import held_out_chat
    from specdec.engine.backends.cpu import load_causal_lm
    from specdec.engine.models import parse_dtype
    from specdec.settings import linear_kernel_for

    cpu = torch.device("cpu")
    reference = load_causal_lm(args.target_model, cpu, parse_dtype(args.reference),
                               progress=False,
                               linear_kernel=linear_kernel_for(args.reference, "auto"))
    compared = load_causal_lm(args.target_model, cpu, parse_dtype(args.compare),
                              progress=False,
                              linear_kernel=linear_kernel_for(args.compare, "auto"))
    tokenizer = reference.tokenizer
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    agree = positions = own = 0
    base = args.reference
    nll = {base: 0.0, args.compare: 0.0}
    started = time.perf_counter()
    for index, prompt in enumerate(held_out_chat(args.prompts)):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.inference_mode():
            answer = reference.model.generate(ids, max_new_tokens=args.max_new_tokens,
                                              do_sample=False, eos_token_id=eos,
                                              pad_token_id=eos)
            start = ids.shape[1]
            targets = answer[0, start:]
            logits = {base: reference.model(answer).logits[0, start - 1:-1].float(),
                      args.compare: compared.model(answer).logits[0, start - 1:-1].float()}
        agree += int((logits[args.compare].argmax(-1) == targets).sum())
        own += int((logits[base].argmax(-1) == targets).sum())
        positions += len(targets)
        for name, rows in logits.items():
            nll[name] += float(torch.nn.functional.cross_entropy(rows, targets,
                                                                 reduction="sum"))
        print(f"  {index + 1}/{args.prompts}: {positions} positions, "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    perplexity = {name: math.exp(total / positions) for name, total in nll.items()}
    print(f"held-out chat: {args.prompts} prompts, {positions} answer positions "
          f"({base} greedy answers, up to {args.max_new_tokens} tokens)")
    print(f"top-1 agreement of {args.compare} with {base}: {agree / positions:.4f}")
    # The answers come from one-token decode steps, the teacher-forced logits from one
    # forward over the whole conversation (prefill kernels): where the two differ in
    # the last bits, a near-tie can flip even for the reference itself.
    print(f"top-1 agreement of {base} teacher-forced with its own answers: "
          f"{own / positions:.4f}")
    for name, value in perplexity.items():
        print(f"perplexity {name}: {value:.4f} "
              f"({value / perplexity[base] - 1:+.2%} against {base})")
    if args.compare == "int8":
        served_weights(args.target_model)


def served_weights(target_model: str) -> None:
    """How far the int8 weights as served (quantized from the bfloat16 load) lie from the
    checkpoint's float32 weights, for layers of 16-level groups (a GGUF Q4_1's, held
    exactly from float32) and the others: the share equal, the largest error over its
    group's range."""
    from specdec.engine import int8
    from specdec.engine.backends.cpu import load_causal_lm

    model = load_causal_lm(target_model, torch.device("cpu"), torch.float32, progress=False,
                           linear_kernel="torch").model
    kinds: dict[str, list[float]] = {}  # kind -> [equal, total, worst]
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and int8.supports(module):
            weight = module.weight.detach().float()
            codes = int8.quantize(weight)[0]
            kind = "16-level layers" if bool((codes % 8 == 0).all()) else "other layers"
            served = int8.dequantize(*int8.quantize(weight.bfloat16()))
            groups = weight.reshape(weight.shape[0], -1, int8.GROUP)
            spread = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(int8.GROUP, 1)
            error = float(((served - weight).abs() / spread.clamp_min(1e-30)).max())
            tally = kinds.setdefault(kind, [0.0, 0.0, 0.0])
            tally[0] += int((served == weight).sum())
            tally[1] += weight.numel()
            tally[2] = max(tally[2], error)
    for kind, (equal, total, worst) in kinds.items():
        largest = f"1/{1 / worst:,.0f}" if worst else "0"
        print(f"int8 weights as served, {kind}: {equal / total:.1%} equal to the checkpoint's "
              f"float32, the largest error {largest} of its group's range")


class Int8InputsLinear(torch.nn.Module):
    """A linear layer on the int8 format's weights (float32) whose inputs are rounded to
    8 bits, symmetric, with a scale per 32 (a simulation, not a kernel)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        from specdec.engine import int8
        self.weight = int8.dequantize(*int8.quantize(linear.weight))
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.float().reshape(*x.shape[:-1], -1, 32)
        scale = blocks.abs().amax(-1, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        rounded = ((blocks / scale).round().clamp(-127, 127) * scale).reshape(x.shape)
        return torch.nn.functional.linear(rounded, self.weight, self.bias).to(x.dtype)


def simulate_int8_inputs() -> None:
    """Make --dtype int8's loader put Int8InputsLinear where it would put Int8Linear."""
    from specdec.engine import int8

    def replace(model: torch.nn.Module) -> int:
        return len(int8.replace_linears(model, Int8InputsLinear))

    int8.quantize_linears = replace


if __name__ == "__main__":
    main()
