"""The tracked tree stays small, self-contained and written for its users.

Reads `git ls-files` and the working-tree files it names; skipped outside a git checkout.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_TREE_BYTES = 60 * 1024 * 1024
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

# "Session" in this project means a generation session, and the tree speaks of the
# project alone: no wording about how or where its files were written, and no citations
# of files outside the repository. The patterns are assembled from parts, so that this
# file holds none of the phrases it forbids.
_ORDINALS = ("third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
             "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|"
             r"twentieth|twenty-\w+|thirtieth|\d+(?:st|nd|rd|th)")
_PERIOD = r"(?:sess" + r"ion|rou" + r"nd)"
FORBIDDEN = {
    "an ordinal before 'session'": re.compile(rf"\b(?:{_ORDINALS})\s+sess" + "ion",
                                              re.IGNORECASE),
    "'session' numbered in parentheses": re.compile(r"\((?:first|second)\s+sess" + r"ion\)",
                                                    re.IGNORECASE),
    "a machine or predecessor of a session": re.compile(
        r"\bthis\s+sess" + r"ion's\s+(?:machine|predecessor)"
        + r"|\b(?:develop" + r"ment|wo" + rf"rk) {_PERIOD}s?\b",
        re.IGNORECASE),
    "an accelerator lent": re.compile(r"\bGPU (?:was )?le" + r"nt\b", re.IGNORECASE),
    "a citation of a note outside the repository": re.compile(
        r"REFERENCE[.]md|(?<![\w./-])shared[/]"),
}
BINARY_SUFFIXES = {".png", ".safetensors", ".jpg", ".gif", ".pdf"}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    # A file deleted in the working tree but not yet from the index takes no room.
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def text_of(path: Path) -> str | None:
    if path.suffix in BINARY_SUFFIXES:
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def test_tracked_tree_stays_under_the_limit() -> None:
    sizes = {path: path.stat().st_size for path in tracked_files()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: -item[1])[:5]
    assert total <= MAX_TREE_BYTES, (
        f"the tracked tree holds {total / 2**20:.1f} MiB, over the "
        f"{MAX_TREE_BYTES / 2**20:.0f} MiB limit; largest files: "
        + ", ".join(f"{p.relative_to(ROOT)} ({s / 2**20:.1f} MiB)" for p, s in largest))


def test_no_work_period_wording_or_outside_citations() -> None:
    hits = []
    for path in tracked_files():
        relative = path.relative_to(ROOT).as_posix()
        text = text_of(path)
        if text is None or relative == THIS_FILE:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for reason, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    hits.append(f"{relative}:{number}: {reason}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} lines to rewrite:\n" + "\n".join(hits)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_markdown_links_point_at_files_and_headings_that_exist() -> None:
    link = re.compile(r"\]\(([^)\s]+)\)")
    broken = []
    for path in tracked_files():
        if path.suffix != ".md":
            continue
        text = path.read_text()
        for target in link.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file_part, _, fragment = target.partition("#")
            destination = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)} -> {target}"
            if not destination.exists():
                broken.append(f"{where}: no such file")
            elif fragment and destination.suffix == ".md":
                headings = re.findall(r"^#+\s+(.*)$", destination.read_text(), re.MULTILINE)
                if fragment not in {_anchor(h) for h in headings}:
                    broken.append(f"{where}: no such heading")
    assert not broken, "\n".join(broken)
