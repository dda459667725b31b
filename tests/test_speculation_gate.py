"""SpeculationGate: per load level, how much to speculate, by measured output rate."""

from __future__ import annotations

import pytest

from specdec.core.adaptive import AdaptiveLength
from specdec.core.cost_model import CostModel
from specdec.core.speculation_gate import Arm, SpeculationGate, load_level


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(gate: SpeculationGate, clock: Clock, running: int,
             rates: tuple[float, float, float], seconds: float,
             step: float = 0.05) -> list[Arm]:
    """Rounds of `step` seconds; each emits what the arm in force produces (rates in
    ladder order: target-only, model-free, draft)."""
    played = []
    end = clock.now + seconds
    while clock.now < end:
        arm = gate.arm(running)
        played.append(arm)
        clock.now += step
        gate.record(round(rates[arm] * step * 100), running)
    return played


def share(played: list[Arm], arm: Arm) -> float:
    return sum(1 for each in played if each == arm) / len(played)


def counted_epochs(gate: SpeculationGate) -> int:
    return sum(epochs for _, arms in gate.snapshot().values() for _, epochs in arms)


def test_load_levels_are_powers_of_two() -> None:
    assert [load_level(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16)] == [1, 1, 2, 2, 3, 3, 4, 4, 5]


def test_the_faster_arm_wins_and_the_others_are_retested_less_and_less() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=16, clock=clock)
    rates = (20.0, 15.0, 10.0)  # every proposal costs more than it gains
    simulate(gate, clock, 8, rates, seconds=12.0)
    early = simulate(gate, clock, 8, rates, seconds=20.0)
    late = simulate(gate, clock, 8, rates, seconds=60.0)
    assert 0.5 < share(early, Arm.TARGET_ONLY) < share(late, Arm.TARGET_ONLY) < 1.0
    assert share(late, Arm.MODEL_FREE) > 0.0 and share(late, Arm.DRAFT) > 0.0  # in turn
    played, arms = gate.snapshot()[load_level(8)]
    assert played == Arm.TARGET_ONLY
    assert arms[Arm.TARGET_ONLY][0] > arms[Arm.MODEL_FREE][0] > arms[Arm.DRAFT][0]


def test_where_drafting_pays_it_stays_on() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=8, clock=clock)
    played = simulate(gate, clock, 1, (20.0, 24.0, 30.0), seconds=40.0)
    assert share(played, Arm.DRAFT) > 0.8


def test_where_only_model_free_proposals_pay_the_draft_sits_out() -> None:
    """Prompt lookup's rounds cost no draft forward; at a load where the draft's costs
    more than it gains, the gate keeps the model-free proposals and drops the draft."""
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=8, clock=clock)
    simulate(gate, clock, 8, (20.0, 26.0, 22.0), seconds=20.0)
    played = simulate(gate, clock, 8, (20.0, 26.0, 22.0), seconds=40.0)
    assert share(played, Arm.MODEL_FREE) > 0.8


def test_the_choice_follows_a_change_in_what_pays() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=4, clock=clock)
    before = simulate(gate, clock, 4, (20.0, 25.0, 30.0), seconds=20.0)
    assert share(before, Arm.DRAFT) > 0.7
    simulate(gate, clock, 4, (20.0, 15.0, 10.0), seconds=30.0)
    after = simulate(gate, clock, 4, (20.0, 15.0, 10.0), seconds=20.0)
    assert share(after, Arm.TARGET_ONLY) > 0.7


def test_a_level_without_data_starts_from_the_lower_levels_choice() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, clock=clock)
    simulate(gate, clock, 4, (20.0, 15.0, 10.0), seconds=30.0)
    assert gate.snapshot()[load_level(4)][0] == Arm.TARGET_ONLY
    for _ in range(200):  # the smoothed load reaches 16
        gate.arm(16)
    clock.now += 1.5  # the next call opens an epoch at the new level
    assert gate.arm(16) == Arm.TARGET_ONLY
    assert load_level(16) not in gate.snapshot()


def test_a_steady_load_whose_count_dips_between_requests_keeps_its_level() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, clock=clock)
    for step in range(400):  # 8 clients; one request ends and the next starts
        running = 7 if step % 5 == 0 else 8
        gate.arm(running)
        clock.now += 0.05
        gate.record(3, running)
    assert set(gate.snapshot()) == {load_level(8)}
    assert counted_epochs(gate) >= 15


def test_epochs_that_are_not_fair_samples_are_not_counted() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, clock=clock)
    # A fixed-length request's tokens are in the epoch: not the gate's doing.
    gate.arm(2)
    gate.record(50, 2, gated=False)
    clock.now += 1.1
    gate.arm(2)
    # The load moved to another level within the epoch.
    gate.record(50, 2)
    gate.record(50, 8)
    clock.now += 1.1
    gate.arm(2)
    # An idle gap: no rounds for a minute.
    gate.record(50, 2)
    clock.now += 60.0
    gate.arm(2)
    assert counted_epochs(gate) == 0


def test_an_epoch_that_prefilled_a_burst_of_prompts_is_not_a_sample() -> None:
    """Eight clients starting at once spend the epoch on their prompts' prefills, which
    slows whichever arm plays: more first rounds than a quarter of the running
    generations (and more than one) make the epoch no sample; the odd arrival does not."""
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, clock=clock)

    def epoch(first_rounds: int) -> int:
        """One epoch of 20 rounds; the number of epochs counted so far."""
        start = clock.now
        for index in range(20):
            clock.now = start + index * 0.045
            gate.arm(8)
            gate.record(2, 8, first_round=index < first_rounds)
        clock.now = start + 1.001
        gate.arm(8)  # closes it and opens the next
        return counted_epochs(gate)

    gate.arm(8)  # the first epoch opens
    assert epoch(8) == 0  # an epoch is counted (or not) when the next one ends
    assert epoch(3) == 0  # the one before was a burst: 8 prefills among 8 running
    assert epoch(2) == 0  # still more than a quarter
    assert epoch(0) == 1
    assert epoch(0) == 2


def test_a_prefill_stall_is_not_charged_to_the_arm_it_fell_in() -> None:
    """Target-only runs 10 % faster, but a new prompt's prefill (0.6 s, the target busy
    with it alone) happens to fall in every epoch that plays it. Charged to that arm, the
    stall would make target-only look 2.3 times slower; the gate takes the prefill's
    forward time out of the epoch's duration and finds the faster arm."""
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=2, clock=clock)
    played = []
    for _ in range(60):
        start = clock.now
        arm = gate.arm(8)  # ends the last epoch, begins this one
        played.append(arm)
        stall_s = 0.6 if arm == Arm.TARGET_ONLY else 0.0
        rounds = round((1.0 - stall_s) / 0.05)
        for _ in range(rounds):
            clock.now += 0.05
            gate.record(round((22.0, 20.0, 20.0)[arm] * 0.05 * 8), 8)
            gate.arm(8)
        if stall_s:
            clock.now += stall_s
            gate.record(1, 8, first_round=True, prefill_s=stall_s)
        clock.now = start + 1.0 + 1e-6
    assert share(played[-30:], Arm.TARGET_ONLY) > 0.5


def test_a_prefill_that_began_in_the_epoch_before_is_taken_out_of_both() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, clock=clock)
    played = gate.arm(1)  # epoch 1 begins at 0 s
    clock.now = 0.5
    gate.record(10, 1)
    clock.now = 1.0
    gate.arm(1)  # epoch 1 ends, epoch 2 begins
    clock.now = 1.2  # a prefill forward of 0.7 s ends: 0.5 s of it in epoch 1
    gate.record(1, 1, first_round=True, prefill_s=0.7)
    clock.now = 2.0
    gate.arm(1)  # epoch 2 ends, and epoch 1 is counted
    assert gate.snapshot()[1][1][played] == (pytest.approx(10 / 0.5), 1)


class FixedGate(SpeculationGate):
    """A deployment's gate that always plays one arm."""

    def __init__(self, played: Arm) -> None:
        super().__init__()
        self.played = played

    def arm(self, running: int) -> Arm:
        return self.played


def test_the_gates_arm_decides_what_an_adaptive_round_may_propose() -> None:
    for played, draft, model_free in [(Arm.TARGET_ONLY, False, False),
                                      (Arm.MODEL_FREE, False, True), (Arm.DRAFT, True, True)]:
        policy = AdaptiveLength(4, 8, costs=CostModel(), gate=FixedGate(played))
        assert (policy.next_length() == 4) == draft and policy.gated_off != draft
        assert policy.model_free == model_free


def test_arms_within_the_margin_do_not_flip_the_choice() -> None:
    """Once an arm is chosen, re-tests that find a neighbour ahead by less than
    SWITCH_MARGIN keep it (the epochs cannot tell them apart); a clear lead switches."""
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=2, ema=1.0,
                           clock=clock)
    simulate(gate, clock, 8, (20.0, 24.0, 15.0), seconds=20.0)
    assert gate.snapshot()[load_level(8)][0] == Arm.MODEL_FREE
    close = simulate(gate, clock, 8, (20.4, 20.0, 15.0), seconds=30.0)
    arms = gate.snapshot()[load_level(8)][1]
    assert arms[Arm.TARGET_ONLY][0] > arms[Arm.MODEL_FREE][0]  # measured ahead, by 2 %
    assert share(close, Arm.MODEL_FREE) > 0.5  # and model-free proposals are still played
    simulate(gate, clock, 8, (24.0, 20.0, 15.0), seconds=10.0)
    clear = simulate(gate, clock, 8, (24.0, 20.0, 15.0), seconds=20.0)
    assert share(clear, Arm.TARGET_ONLY) > 0.5  # 20 % ahead: target-only played


def test_a_shift_in_what_requests_ask_does_not_flip_the_choice() -> None:
    """Phases of easy and hard requests move every arm's rate together (drafting stays
    20 % ahead): each re-test is compared with the epochs beside it, not with a rate the
    other arm had phases ago, so drafting stays played through every phase."""
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=4, max_explore_every=32, clock=clock)
    rates = (40.0, 44.0, 48.0)
    simulate(gate, clock, 8, rates, seconds=20.0)
    played: list[Arm] = []
    for phase in range(8):
        scale = 0.4 if phase % 2 == 0 else 1.0
        played += simulate(gate, clock, 8, (rates[0] * scale, rates[1] * scale,
                                            rates[2] * scale), seconds=15.0)
    assert share(played, Arm.DRAFT) > 0.8


def test_a_retest_that_finds_a_neighbour_ahead_brings_the_next_one_forward() -> None:
    """Model-free proposals alone have won for minutes, so re-tests are 32 epochs apart.
    When drafting starts to lead (the others unchanged), the first re-test that measures
    it ahead resets the interval, even before the comparisons' mean has crossed the
    margin, so drafting is chosen after a few more re-tests, not several 32-epoch waits."""
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=4, max_explore_every=32, clock=clock)
    simulate(gate, clock, 8, (30.0, 40.0, 28.0), seconds=200.0)
    simulate(gate, clock, 8, (30.0, 40.0, 52.0), seconds=50.0)
    after = simulate(gate, clock, 8, (30.0, 40.0, 52.0), seconds=20.0)
    assert share(after, Arm.DRAFT) > 0.8
