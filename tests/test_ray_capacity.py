"""`specdec ray` refuses, with the arithmetic, a request the cluster cannot hold."""

from __future__ import annotations

import pytest

from specdec.commands.ray_up import check_capacity
from specdec.serving.ray_replicas import ReplicaSpec


def specs(target: int, target_cpus: float, draft: int = 1, draft_cpus: float = 1.0,
          target_gpus: float = 0.0) -> list[ReplicaSpec]:
    return [ReplicaSpec("target", target, target_cpus, target_gpus),
            ReplicaSpec("draft", draft, draft_cpus)]


def test_too_many_cpus_fails_with_the_sum() -> None:
    # The reported case: --target-replicas 2 on a 2-core machine waited out the timeout.
    with pytest.raises(RuntimeError) as error:
        check_capacity(specs(2, 1.0), {"CPU": 2.0})
    message = str(error.value)
    assert "has 2 CPUs" in message and "2 target x 1 + 1 draft x 1 = 3" in message
    assert "--target-replica-cpus" in message and "--draft-replica-cpus" in message


def test_the_documented_two_core_example_fits() -> None:
    # specdec ray --target-replicas 2 --target-replica-cpus 0.5 --draft-replica-cpus 0.5
    check_capacity(specs(2, 0.5, draft_cpus=0.5), {"CPU": 2.0})


def test_gpus_are_counted_too() -> None:
    with pytest.raises(RuntimeError, match="has 1 GPUs but the replicas need 2 target x 1 = 2"):
        check_capacity(specs(2, 0.5, draft_cpus=0.5, target_gpus=1.0), {"CPU": 8, "GPU": 1})
    check_capacity(specs(1, 1.0, target_gpus=1.0), {"CPU": 8, "GPU": 1})
