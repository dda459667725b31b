"""SpeculationGate: per load level, drafting on or off by measured output rate."""

from __future__ import annotations

from specdec.core.adaptive import AdaptiveLength
from specdec.core.cost_model import CostModel
from specdec.core.speculation_gate import SpeculationGate, load_level


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(gate: SpeculationGate, clock: Clock, running: int, rate_on: float,
             rate_off: float, seconds: float, step: float = 0.05) -> list[bool]:
    """Rounds of `step` seconds; each emits what the arm in force produces."""
    choices = []
    end = clock.now + seconds
    while clock.now < end:
        on = gate.allows(running)
        choices.append(on)
        clock.now += step
        gate.record(round((rate_on if on else rate_off) * step * 100), running)
    return choices


def test_load_levels_are_powers_of_two() -> None:
    assert [load_level(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16)] == [1, 1, 2, 2, 3, 3, 4, 4, 5]


def test_the_faster_arm_wins_and_the_other_is_retested_less_and_less() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=8, clock=clock)
    simulate(gate, clock, 8, rate_on=10.0, rate_off=20.0, seconds=4.0)
    early = simulate(gate, clock, 8, rate_on=10.0, rate_off=20.0, seconds=20.0)
    late = simulate(gate, clock, 8, rate_on=10.0, rate_off=20.0, seconds=40.0)
    assert 0 < sum(early) / len(early) < 0.5
    assert sum(late) / len(late) < sum(early) / len(early)  # the interval doubled
    assert any(late)  # still re-tested
    on_rate, on_epochs, off_rate, off_epochs = gate.snapshot()[load_level(8)]
    assert off_rate > on_rate and off_epochs > on_epochs > 0


def test_where_drafting_pays_it_stays_on() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=8, clock=clock)
    choices = simulate(gate, clock, 1, rate_on=30.0, rate_off=20.0, seconds=40.0)
    assert sum(choices) / len(choices) > 0.8


def test_the_choice_follows_a_change_in_what_pays() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=4, clock=clock)
    before = simulate(gate, clock, 4, rate_on=30.0, rate_off=20.0, seconds=20.0)
    assert sum(before) / len(before) > 0.7
    simulate(gate, clock, 4, rate_on=10.0, rate_off=20.0, seconds=30.0)
    after = simulate(gate, clock, 4, rate_on=10.0, rate_off=20.0, seconds=20.0)
    assert sum(after) / len(after) < 0.3


def test_a_level_without_data_starts_from_the_lower_levels_choice() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, clock=clock)
    simulate(gate, clock, 4, rate_on=10.0, rate_off=20.0, seconds=10.0)
    for _ in range(200):  # the smoothed load reaches 16
        gate.allows(16)
    clock.now += 1.5  # the next call opens an epoch at the new level
    assert not gate.allows(16)
    assert load_level(16) not in gate.snapshot()


def test_a_steady_load_whose_count_dips_between_requests_keeps_its_level() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, clock=clock)
    for step in range(400):  # 8 clients; one request ends and the next starts
        running = 7 if step % 5 == 0 else 8
        gate.allows(running)
        clock.now += 0.05
        gate.record(3, running)
    counted = gate.snapshot()
    assert set(counted) == {load_level(8)}
    assert sum(epochs for _, on, _, off in counted.values() for epochs in (on, off)) >= 15


def test_epochs_that_are_not_fair_samples_are_not_counted() -> None:
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, clock=clock)
    # A fixed-length request's tokens are in the epoch: not the gate's doing.
    gate.allows(2)
    gate.record(50, 2, gated=False)
    clock.now += 1.1
    gate.allows(2)
    # The load moved to another level within the epoch.
    gate.record(50, 2)
    gate.record(50, 8)
    clock.now += 1.1
    gate.allows(2)
    # An idle gap: no rounds for a minute.
    gate.record(50, 2)
    clock.now += 60.0
    gate.allows(2)
    assert all(epochs == 0 for _, on, _, off in gate.snapshot().values()
               for epochs in (on, off))


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
            gate.allows(8)
            gate.record(2, 8, first_round=index < first_rounds)
        clock.now = start + 1.001
        gate.allows(8)  # closes it and opens the next
        return sum(on + off for _, on, _, off in gate.snapshot().values())

    gate.allows(8)  # the first epoch opens
    assert epoch(8) == 0  # a burst: 8 prefills among 8 running
    assert epoch(3) == 0  # still more than a quarter
    assert epoch(2) == 1
    assert epoch(0) == 2


class ClosedGate(SpeculationGate):
    def allows(self, running: int) -> bool:
        return False


def test_a_closed_gate_makes_adaptive_rounds_draft_nothing() -> None:
    policy = AdaptiveLength(4, 8, costs=CostModel(), gate=ClosedGate())
    assert policy.next_length() == 0 and policy.gated_off
    open_policy = AdaptiveLength(4, 8, costs=CostModel(), gate=SpeculationGate())
    assert open_policy.next_length() == 4 and not open_policy.gated_off


def test_arms_within_the_margin_do_not_flip_the_choice() -> None:
    """Once an arm is chosen, a re-test that finds the other ahead by less than
    SWITCH_MARGIN keeps it (the epochs cannot tell them apart); a clear lead switches."""
    clock = Clock()
    gate = SpeculationGate(epoch_s=1.0, explore_every=2, max_explore_every=2, ema=1.0,
                           clock=clock)
    simulate(gate, clock, 8, rate_on=20.0, rate_off=20.4, seconds=10.0)
    assert gate.snapshot()[load_level(8)][0] < gate.snapshot()[load_level(8)][2]
    close = simulate(gate, clock, 8, rate_on=20.4, rate_off=20.0, seconds=30.0)
    on_rate, _, off_rate, _ = gate.snapshot()[load_level(8)]
    assert on_rate > off_rate  # the re-tests measured drafting ahead, by 2 %
    assert sum(close) / len(close) < 0.5  # and target-only is still played
    simulate(gate, clock, 8, rate_on=24.0, rate_off=20.0, seconds=10.0)
    clear = simulate(gate, clock, 8, rate_on=24.0, rate_off=20.0, seconds=20.0)
    assert sum(clear) / len(clear) > 0.5  # 20 % ahead: drafting is played
