"""--device says what it chose, and why CUDA cannot be used where it cannot."""

from __future__ import annotations

import logging

import pytest
import torch

from specdec.engine.models import parse_device


def test_auto_logs_its_choice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="specdec.engine.models"):
        device = parse_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert f"--device auto: using {device}" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cuda_without_a_gpu_says_why() -> None:
    with pytest.raises(ValueError) as error:
        parse_device("cuda")
    expected = "built without CUDA" if torch.version.cuda is None else "sees no GPU"
    assert expected in str(error.value)
