"""Row invariance: a token's result does not depend on how many rows share its forward.

The reduced-precision serving path (bfloat16 on CPU: oneDNN linears, "rowwise" attention)
rests on it: a verification of k + 1 rows must give each row the bits a one-row decode of
that token gives, or greedy speculative output leaves the target's own wherever two
logits are closer than the rounding.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from cpu_features import ONEDNN_BF16, needs_onednn_bf16
from torch import nn

from specdec.core.loop import GenerateConfig, RoundEvent, generate
from specdec.engine import models
from specdec.engine.attention import resolve_attention
from specdec.engine.backends.cpu import load_causal_lm
from specdec.engine.kernels import ONEDNN_MIN_ROWS, OneDnnLinear, resolve_kernel
from specdec.engine.local import LocalDrafter, LocalVerifier
from specdec.engine.runner import ExtendRequest, ModelRunner
from specdec.engine.shapes import DECODE_ROWS

CPU = torch.device("cpu")
# The module's targets load once, on one worker (module fixtures run once per worker).
pytestmark = pytest.mark.xdist_group("row-invariance-targets")


def _dtypes() -> list[object]:
    return [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)]


def _onednn_layer(in_features: int, out_features: int, dtype: torch.dtype,
                  bias: bool = False) -> nn.Linear:
    torch.manual_seed(in_features + out_features)
    layer = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    layer.__class__ = OneDnnLinear
    return layer


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("rows", [1, 2, ONEDNN_MIN_ROWS, 9, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_equals_f_linear(dtype: torch.dtype, rows: int, bias: bool) -> None:
    layer = _onednn_layer(96, 200, dtype, bias)
    x = torch.randn(1, rows, 96).to(dtype)
    with torch.inference_mode():
        out = layer(x)
    expected = F.linear(x.float(), layer.weight.float(),
                        None if layer.bias is None else layer.bias.float())
    assert out.shape == (1, rows, 200) and out.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("in_features", [576, 1536])  # SmolLM2's two input widths
def test_onednn_linear_row_result_is_independent_of_row_count(dtype: torch.dtype,
                                                              in_features: int) -> None:
    # Every row count a decode-sized forward of one session can have (the runner cuts
    # longer extends into pieces of at most DECODE_ROWS). Beyond that the cap depends
    # on the CPU (an Intel host with AMX sums 33 or more rows in another order): the
    # runner measures it at load (specdec.engine.kernels.row_invariant_rows) and splits batches.
    layer = _onednn_layer(in_features, 192, dtype)
    x = torch.randn(DECODE_ROWS, in_features).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
        for rows in range(2, DECODE_ROWS + 1):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_onednn_linear_trains_through_f_linear_and_follows_weight_updates() -> None:
    layer = _onednn_layer(8, 4, torch.float32)
    x = torch.randn(3, 8)
    layer(x).sum().backward()  # autograd: the reordered copy has no gradient
    assert layer.weight.grad is not None
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: the reordered copy must be rebuilt
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), 2 * before)


def test_auto_kernels_for_reduced_precision_on_cpu() -> None:
    assert resolve_kernel("auto", CPU, torch.bfloat16) == ("onednn" if ONEDNN_BF16 else "torch")
    assert resolve_attention("auto", CPU, torch.bfloat16) == "rowwise"
    assert resolve_kernel("auto", CPU, torch.float32) == "skinny"
    assert resolve_attention("auto", CPU, torch.float32) == "grouped"
    assert resolve_attention("auto", torch.device("cuda"), torch.bfloat16) == "sdpa"


# -- the real target in bfloat16 --------------------------------------------------------------

def _load_target(attention_kernel: str = "auto", linear_kernel: str = "auto"
                 ) -> models.LoadedModel:
    return load_causal_lm(models.DEFAULT_TARGET, CPU, torch.bfloat16, progress=False,
                          attention_kernel=attention_kernel, linear_kernel=linear_kernel,
                          fused_step="auto")


@pytest.fixture(scope="module")
def target_bf16() -> models.LoadedModel:
    if not ONEDNN_BF16:
        pytest.skip("this CPU has no oneDNN bfloat16: --dtype bfloat16 is not row-invariant here")
    return _load_target()


@pytest.fixture(scope="module")
def target_int8() -> models.LoadedModel:
    """--dtype int8: int8 linear weights, bfloat16 activations, the fused step (as served)."""
    loaded = _load_target(linear_kernel="int8")
    assert loaded.precision.endswith("fused step")
    return loaded


@pytest.fixture(params=["bfloat16", "int8"])
def served_target(request: pytest.FixtureRequest) -> models.LoadedModel:
    """The target in each precision whose greedy output is exact under speculation."""
    return request.getfixturevalue("target_bf16" if request.param == "bfloat16"
                                   else "target_int8")


def _verify_vs_decode(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 9-token block after a 60-token prompt (random tokens, fixed seed), as
    one verification, and as one-token decodes."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 49152, (60,), generator=generator).tolist()
    block = torch.randint(0, 49152, (9,), generator=generator).tolist()
    runner.extend("verify", 0, 0, prompt)
    fingerprint = runner._sessions["verify"].history.fingerprint(len(prompt))
    verified = runner.extend("verify", len(prompt), fingerprint, block,
                             num_logits=len(block)).logits
    decoded = []
    runner.extend("decode", 0, 0, prompt)
    for position, token in enumerate(block, start=len(prompt)):
        history = runner._sessions["decode"].history
        decoded.append(runner.extend("decode", position, history.fingerprint(position),
                                     [token]).logits)
    return verified, torch.cat(decoded)


@pytest.mark.slow
def test_verification_rows_equal_decoded_rows_bit_for_bit(
        served_target: models.LoadedModel) -> None:
    """At two threads, so the operators split their outputs over threads as a service
    on every core of a 2-core host does (tests/conftest.py restores the worker's share)."""
    torch.set_num_threads(2)
    runner = ModelRunner(served_target.model)
    verified, decoded = _verify_vs_decode(runner)
    assert torch.equal(verified, decoded)


@pytest.mark.slow
@needs_onednn_bf16
def test_grouped_attention_control_is_not_row_invariant_in_bfloat16() -> None:
    """The control: the fp32 kernel in bfloat16 changes rows, so the test above has power."""
    runner = ModelRunner(_load_target("grouped").model)
    verified, decoded = _verify_vs_decode(runner)
    assert not torch.equal(verified, decoded)


def _branches_vs_decode(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a token tree's branches verified beside a 4-token chain (branches beside
    the chain and after other branches, up to three deep), and of each branch's path
    decoded one token per forward after the same prefix."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 49152, (40,), generator=generator).tolist()
    chain = torch.randint(0, 49152, (4,), generator=generator).tolist()
    start = len(prompt)
    # Each branch's parent slot: chain token j sits at start + j, branch i at start + 4 + i.
    parents = [start, start, start + 1, start + 4, start + 7, start + 3, start - 1]
    branches = torch.randint(0, 49152, (len(parents),), generator=generator).tolist()
    runner.extend("tree", 0, 0, prompt)
    history = runner._sessions["tree"].history
    tree = runner.extend("tree", start, history.fingerprint(start), chain + branches,
                         num_logits=len(branches), branch_parents=parents)
    assert runner._sessions["tree"].history.tokens == prompt + chain  # branches left

    def path(slot: int) -> list[int]:
        if slot < start:
            return []
        if slot < start + len(chain):
            return chain[: slot - start + 1]
        index = slot - start - len(chain)
        return [*path(parents[index]), branches[index]]

    runner.extend("decode", 0, 0, prompt)  # the same prefill, then one token per forward
    history = runner._sessions["decode"].history
    decoded = []
    for index in range(len(branches)):
        tokens = path(start + len(chain) + index)
        logits = runner.extend("decode", start, history.fingerprint(start), tokens[:1]).logits
        for token in tokens[1:]:
            logits = runner.extend("decode", len(history), history.fingerprint(),
                                   [token]).logits
        decoded.append(logits)
    return tree.logits, torch.cat(decoded)


@pytest.mark.slow
def test_token_tree_branches_equal_decoded_rows_bit_for_bit(
        served_target: models.LoadedModel) -> None:
    branches, decoded = _branches_vs_decode(ModelRunner(served_target.model))
    assert torch.equal(branches, decoded)


@pytest.mark.parametrize("kernel", ["grouped", "sdpa"])
def test_token_tree_branches_match_decoded_rows_with_the_other_kernels(kernel: str) -> None:
    """float32 kernels take the tree as a 4D mask: equal up to float32 rounding."""
    target = load_causal_lm(models.DEFAULT_TARGET, CPU, torch.float32, progress=False,
                                   attention_kernel=kernel)
    branches, decoded = _branches_vs_decode(ModelRunner(target.model))
    torch.testing.assert_close(branches, decoded, rtol=1e-4, atol=1e-4)


def test_long_extend_runs_the_prompt_as_one_prefill_and_the_draft_in_decode_forwards() -> None:
    runner = types.SimpleNamespace(_row_invariant=True)
    pieces = ModelRunner._pieces
    assert pieces(runner, DECODE_ROWS, 3) == [(0, DECODE_ROWS)]  # type: ignore[arg-type]
    assert pieces(runner, 60, 1) == [(0, 60)]  # type: ignore[arg-type]
    assert pieces(runner, 60, 5) == [(0, 56), (56, 60)]  # type: ignore[arg-type]
    assert pieces(runner, 60, 21) == [(0, 40), (40, 56), (56, 60)]  # type: ignore[arg-type]
    # A session re-sent from position 0 replays its prompt's prefill, then decode pieces.
    assert pieces(runner, 60, 5, 20) == [(0, 20), (20, 36), (36, 52), (52, 60)]  # type: ignore[arg-type]
    assert pieces(runner, 60, 5, 58) == [(0, 56), (56, 60)]  # type: ignore[arg-type]
    runner._row_invariant = False
    assert pieces(runner, 60, 5) == [(0, 60)]  # type: ignore[arg-type]
    assert pieces(runner, 60, 5, 20) == [(0, 60)]  # type: ignore[arg-type]


def _moved_session_logits(runner: ModelRunner, prefill_length: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A session decodes 24 tokens after a 40-token prompt (rounds of 1 to 5 tokens), then
    verifies a 4-token block; the same block verified by a session re-sent from position
    0 (a replica that lost the cache), prefilling `prefill_length` tokens first."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 49152, (40,), generator=generator).tolist()
    generated = torch.randint(0, 49152, (24,), generator=generator).tolist()
    block = torch.randint(0, 49152, (4,), generator=generator).tolist()
    runner.extend("kept", 0, 0, prompt)
    position = len(prompt)
    for size in (1, 5, 3, 1, 2, 4, 5, 3):
        history = runner._sessions["kept"].history
        runner.extend("kept", position, history.fingerprint(position),
                      generated[position - 40:position - 40 + size])
        position += size
    history = runner._sessions["kept"].history
    kept = runner.extend("kept", position, history.fingerprint(position), block,
                         num_logits=len(block)).logits
    moved = runner.extend_batch([ExtendRequest(
        "moved", 0, 0, prompt + generated + block, num_logits=len(block),
        prefill_length=prefill_length)])[0]
    assert not isinstance(moved, Exception)
    return kept, moved.logits


@pytest.mark.slow
def test_a_session_re_sent_from_position_0_gets_its_cache_back_bit_for_bit(
        target_bf16: models.LoadedModel) -> None:
    kept, moved = _moved_session_logits(ModelRunner(target_bf16.model), 40)
    assert torch.equal(kept, moved)
    # The control: the whole history in one prefill rounds differently.
    kept, moved = _moved_session_logits(ModelRunner(target_bf16.model), 0)
    assert not torch.equal(kept, moved)


@pytest.mark.slow
# The feature draft's rounds are chains, which the token draft's rounds cover in int8.
@pytest.mark.parametrize(("precision", "draft_name"), [
    ("bfloat16", models.DEFAULT_DRAFT), ("bfloat16", models.FEATURE_DRAFT),
    ("int8", models.DEFAULT_DRAFT)])
def test_greedy_speculation_equals_target_only_decoding(
        request: pytest.FixtureRequest, precision: str, draft_name: str) -> None:
    served_target: models.LoadedModel = request.getfixturevalue(
        "target_bf16" if precision == "bfloat16" else "target_int8")
    """Against the target as served, same kernels: specdec's own target-only loop, and
    transformers' `generate` (prefill, then one-row forwards) on the same model object."""
    tokenizer = served_target.tokenizer
    assert tokenizer is not None
    draft = load_causal_lm(draft_name, CPU, torch.bfloat16, progress=False)
    eos = [int(served_target.model.config.eos_token_id)]
    prompts = [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True,
        return_dict=True)["input_ids"]) for text in
        ("Name three uses of copper.", "Explain what a hash map is.")]
    prompts.append(tokenizer("The history of the printing press")["input_ids"])  # < 16 rows
    kept_alternatives = 0
    for prompt in prompts:
        target_only = generate(None, LocalVerifier(ModelRunner(served_target.model)), prompt,
                               GenerateConfig(max_new_tokens=40, num_draft_tokens=0,
                                              eos_token_ids=eos))
        with torch.inference_mode():
            generated = served_target.model.generate(torch.tensor([prompt]), max_new_tokens=40,
                                                   do_sample=False)
        hf_tokens = generated[0, len(prompt):].tolist()
        assert target_only.token_ids == hf_tokens[: len(target_only.token_ids)]
        # (2, 0): the chain alone; the others token trees (the default 2 alternatives, a
        # deeper tree of 8, and 13 beside 1 token: a full 16-row forward of branches). A
        # feature draft proposes chains whatever it is asked: one tree request shows it.
        shapes = ((2, 0), (8, 0), (2, 2), (4, 8), (1, 13))
        if draft_name == models.FEATURE_DRAFT:
            shapes = shapes[:3]
        elif precision == "int8":  # the chain, the default tree and the full 16-row one
            shapes = shapes[::2]
        for draft_length, alternatives in shapes:
            drafter = LocalDrafter(ModelRunner(draft.model, target_vocab_size=49152,
                                               token_map=draft.token_map))
            events: list[RoundEvent] = []
            speculative = generate(drafter, LocalVerifier(ModelRunner(served_target.model)),
                                   prompt, GenerateConfig(max_new_tokens=40,
                                                          num_draft_tokens=draft_length,
                                                          eos_token_ids=eos,
                                                          num_alternatives=alternatives),
                                   on_round=events.append)
            assert speculative.token_ids == target_only.token_ids, (prompt, draft_length)
            assert speculative.stats.accepted_tokens > 0
            kept_alternatives += sum(len(event.kept_branches) for event in events)
    if draft_name == models.FEATURE_DRAFT:
        assert kept_alternatives == 0  # a feature draft proposes chains
    else:
        assert kept_alternatives > 0  # the trees' path ran
