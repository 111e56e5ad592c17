"""The chapters as texts: lesson lines under the cap, code laid out by the formatter, and prose
that teaches the final design, pointing to the lab rather than narrating it."""

from pathlib import Path
import re

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "tutorials").glob("[0-9][0-9]-*.py"))
LESSON_LINES_CAP = 600
SAVE = re.compile(r"^# ?@save \w+/\w+\s*$")
CELL = re.compile(r"^# ?%%")
# A pointer to the lab: a log or CSV file of it, or one of its scripts.
LAB_REFERENCE = re.compile(r"lab/[\w.-]+|[\w-]+\.log\b|tools/experiments/[\w.-]+")


def lesson_lines(text: str) -> int:
    """Lines outside the cells the package is exported from (``# @save``): prose and the
    lesson's own code."""
    count, saved = 0, False
    for line in text.splitlines():
        if CELL.match(line):
            saved = False
        elif SAVE.match(line):
            saved = True
        if not saved:
            count += 1
    return count


def prose(text: str) -> str:
    """The comment lines of a chapter (sphinx-gallery's text blocks and code comments)."""
    return "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_lesson_lines_under_the_cap(chapter):
    assert lesson_lines(chapter.read_text()) <= LESSON_LINES_CAP


def test_lesson_lines_leave_out_the_package_cells():
    text = "# %%\n# prose\nx = 1\n# %%\n# @save ops/demo\ndef f():\n    pass\n# %%\ny = 2\n"
    assert lesson_lines(text) == 6  # the saved cell's three lines are not counted


def test_no_code_packed_against_the_formatter():
    files = [*CHAPTERS, *sorted((ROOT / "src" / "stepkernels").rglob("*.py"))]
    packed = [str(path.relative_to(ROOT)) for path in files if "# fmt: skip" in path.read_text()]
    assert not packed, f"'# fmt: skip' in {packed}: let ruff format lay the code out"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_prose_points_to_the_lab_at_most_twice(chapter):
    """History of attempts, logs and sweeps live in lab/; a chapter cites at most two of them."""
    cited = set(LAB_REFERENCE.findall(prose(chapter.read_text())))
    assert len(cited) <= 2, sorted(cited)
