"""A child command's output, read as it comes (tests only)."""

from __future__ import annotations

import subprocess


def read_until(process: subprocess.Popen[str], prefix: str) -> list[str]:
    """The child's stdout lines up to and including the first that starts with `prefix`
    (all of them if it exits first); blocks until then."""
    assert process.stdout is not None
    lines: list[str] = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix):
            break
    return lines
