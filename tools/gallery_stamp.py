"""Tell sphinx-gallery to re-run the chapters when what they import has changed.

sphinx-gallery re-executes a chapter only when the chapter's own file changes (it compares
an MD5 of the file). The chapters' output also depends on the package they import and on the
results it ships, so conf.py asks ``package_changed()`` and sets ``run_stale_examples`` from it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "stepkernels"
STAMP = ROOT / "docs" / "tutorials" / ".package-stamp"


def package_stamp(package: Path = PACKAGE) -> str:
    """A hash of every file of the package: its code and the recorded results."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def package_changed(stamp_file: Path = STAMP, package: Path = PACKAGE) -> bool:
    """True, and the stamp updated, when the package differs from the last build's."""
    stamp = package_stamp(package)
    changed = not stamp_file.exists() or stamp_file.read_text() != stamp
    if changed:
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        stamp_file.write_text(stamp)
    return changed
