"""Reliability and security of the data readers (issue 13): a damaged archive is an error naming
the file, never a run on part of the data; split counts are checked against the official ones;
a CIFAR python batch cannot run code."""

import io
import pickle
import tarfile

import numpy as np
import pytest

from longattn.data import DatasetError, build_dataset
from reliability import ARCHIVES, CLEAR_ERROR, CORRECT_RESULT, bad_input
from longattn.data import download as dl
from longattn.data import image

WORDS = "the film was good bad long dull superb plot acting music scene actor ending".split()


def _reviews(per_class: int) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    files = {}
    for subset in ("train", "test"):
        for label in ("pos", "neg"):
            for i in range(per_class):
                text = " ".join(rng.choice(WORDS, size=int(rng.integers(50, 150))))
                files[f"aclImdb/{subset}/{label}/{i}_{7 if label == 'pos' else 2}.txt"] = text.encode()
    return files


def _tar(path, files: dict[str, bytes], mode: str = "w:gz"):
    with tarfile.open(path, mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _damaged(path, how: str, where: float):
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    if how == "overwrite":
        data[at:at + 64] = bytes((b + 97) % 256 for b in data[at:at + 64])
    else:
        data = data[:at]
    path.write_bytes(bytes(data))
    return path


def _damage_case(mode: str, how: str):
    # bytes changed inside a member of an uncompressed tar read back as changed text: the documented result
    outcome = CORRECT_RESULT if (mode, how) == ("w", "overwrite") else CLEAR_ERROR
    return pytest.param(mode, how, id=f"{'tar' if mode == 'w' else 'tar.gz'}-{how}", marks=bad_input(ARCHIVES, outcome))


@pytest.mark.parametrize("mode, how", [_damage_case(m, h) for m in ("w:gz", "w") for h in ("overwrite", "truncate")])
@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_damaged_imdb_archive_is_an_error_naming_the_file(tmp_path, mode, how, where):
    archive = _tar(tmp_path / "aclImdb_copy.tar.gz", _reviews(20), mode)
    for subset in ("train", "test"):
        assert len(build_dataset("text", subset, data_dir=str(tmp_path), check_counts=False)) == 40
    _damaged(archive, how, where)
    if mode == "w" and how == "overwrite":
        # An uncompressed tar has no checksum over member content: bytes changed inside a review
        # are undetectable; damage that reaches a header must still be an error.
        try:
            for subset in ("train", "test"):
                assert len(build_dataset("text", subset, data_dir=str(tmp_path), check_counts=False)) == 40
        except DatasetError as error:
            assert str(archive) in str(error)
        return
    for subset in ("train", "test"):
        with pytest.raises(DatasetError, match="aclImdb_copy.tar.gz"):
            build_dataset("text", subset, data_dir=str(tmp_path), check_counts=False)


@bad_input(ARCHIVES, CLEAR_ERROR)
def test_archive_cut_after_its_last_member_is_truncated(tmp_path):
    archive = _tar(tmp_path / "aclImdb_copy.tar", _reviews(20), "w")
    archive.write_bytes(archive.read_bytes().rstrip(b"\0"))  # no end-of-archive blocks
    with pytest.raises(DatasetError, match="aclImdb_copy.tar: .*truncated"):
        build_dataset("text", "test", data_dir=str(archive), check_counts=False)


@bad_input(ARCHIVES, CLEAR_ERROR)
def test_corrupted_header_in_the_middle_is_not_read_as_the_end(tmp_path):
    files = _reviews(20)
    archive = _tar(tmp_path / "aclImdb_copy.tar", files, "w")
    data = bytearray(archive.read_bytes())
    header = data.index(b"aclImdb/test/pos/0_7.txt")  # a member header in the middle
    data[header + 148:header + 156] = b"0000000\0"  # its checksum field no longer matches
    archive.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="corrupted archive"):
        build_dataset("text", "test", data_dir=str(archive), check_counts=False)


@bad_input(ARCHIVES, CLEAR_ERROR, cases=2)
@bad_input(ARCHIVES, CORRECT_RESULT)  # a deliberate subset, check_counts=False
def test_imdb_counts_are_checked_against_the_official_counts(tmp_path):
    _tar(tmp_path / "aclImdb_copy.tar.gz", _reviews(3))
    with pytest.raises(DatasetError, match=r"'train' has 6 examples .*25,000.*check_counts=False"):
        build_dataset("text", "train", data_dir=str(tmp_path))
    folder = tmp_path / "extracted"
    for name, data in _reviews(3).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    with pytest.raises(DatasetError, match=r"'test' has 6 examples"):
        build_dataset("text", "test", data_dir=str(folder))
    assert len(build_dataset("text", "test", data_dir=str(folder), check_counts=False)) == 6


@bad_input(ARCHIVES, CLEAR_ERROR)
def test_official_imdb_archive_name_is_checked_against_its_checksum(tmp_path):
    _tar(tmp_path / "aclImdb_v1.tar.gz", _reviews(3))
    with pytest.raises(DatasetError, match="SHA256 .* does not match .*not the official aclImdb_v1.tar.gz"):
        build_dataset("text", "train", data_dir=str(tmp_path), check_counts=False)


@bad_input(ARCHIVES, CLEAR_ERROR)
def test_damaged_image_folder_archive_is_an_error(tmp_path):
    from PIL import Image

    files = {}
    for label in ("cat", "dog"):
        for i in range(10):
            buffer = io.BytesIO()
            Image.fromarray(np.full((32, 32, 3), 10 * i, np.uint8)).save(buffer, format="PNG")
            files[f"test/{label}/{i}.png"] = buffer.getvalue()
    archive = _damaged(_tar(tmp_path / "cifar_test.tar.gz", files), "truncate", 0.9)
    with pytest.raises(DatasetError, match="cifar_test.tar.gz"):
        build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False)
    assert archive.exists()


@bad_input(ARCHIVES, CLEAR_ERROR)
def test_damaged_download_is_not_extracted(tmp_path):
    archive = _damaged(_tar(tmp_path / "data.tar.gz", _reviews(5)), "overwrite", 0.9)
    with pytest.raises(dl.DownloadError, match="data.tar.gz: cannot extract"):
        dl._safe_extract(archive, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.tar.gz"]  # staging removed, no marker


# ----------------------------------------------------------------------------- CIFAR python batches


class _RunsCommand:
    """What an attacker pickles: unpickling calls os.system(command)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


class _Evaluates:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


def _cifar_folder(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    return folder


@bad_input(ARCHIVES, CLEAR_ERROR)
@pytest.mark.parametrize("payload", ["system", "eval", "object_array"])
def test_crafted_cifar_batch_does_not_execute(tmp_path, payload):
    folder = _cifar_folder(tmp_path)
    marker = tmp_path / "pwned"
    if payload == "system":
        evil = {b"data": _RunsCommand(f"touch {marker}"), b"labels": [0]}
    elif payload == "eval":
        evil = {b"data": _Evaluates(f"open({str(marker)!r}, 'w').close()"), b"labels": [0]}
    else:
        evil = {b"data": np.array([_RunsCommand(f"touch {marker}")], dtype=object), b"labels": [0]}
    with open(folder / "test_batch", "wb") as handle:
        pickle.dump(evil, handle, protocol=2)
    with pytest.raises(DatasetError, match="test_batch: not a CIFAR-10 python batch .*refusing"):
        build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False)
    assert not marker.exists(), "the crafted batch ran code"


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_genuine_batches_of_every_pickle_protocol_load(tmp_path, protocol):
    folder = _cifar_folder(tmp_path)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (image.BATCH_ROWS, 3072), dtype=np.uint8)
    labels = list(rng.integers(0, 10, image.BATCH_ROWS))  # numpy scalars, pickled as such
    with open(folder / "test_batch", "wb") as handle:
        pickle.dump({b"batch_label": b"testing batch 1 of 1", b"labels": labels, b"data": data,
                     b"filenames": [b"x.png"] * image.BATCH_ROWS}, handle, protocol=protocol)
    ds = build_dataset("image", "test", data_dir=str(tmp_path))  # the official count: 10,000
    assert len(ds) == image.BATCH_ROWS and ds[3]["label"] == labels[3]


@bad_input(ARCHIVES, CLEAR_ERROR, cases=2)
def test_cifar_batch_counts_and_truncation(tmp_path):
    folder = _cifar_folder(tmp_path)
    data = np.zeros((7, 3072), np.uint8)
    with open(folder / "test_batch", "wb") as handle:
        pickle.dump({b"data": data, b"labels": [1] * 7}, handle)
    with pytest.raises(DatasetError, match=r"test_batch: this batch has 7 examples .*10,000"):
        build_dataset("image", "test", data_dir=str(tmp_path))
    payload = (folder / "test_batch").read_bytes()
    (folder / "test_batch").write_bytes(payload[: len(payload) // 2])
    with pytest.raises(DatasetError, match="test_batch: not a CIFAR-10 python batch"):
        build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False)


# ----------------------------------------------------------------------------- dangling links in class folders

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

from reliability import CLEAR_ERROR, FOLDERS, cases  # noqa: E402

from longattn.data import textcls  # noqa: E402

TEXTCLS = Path(__file__).parent / "fixtures" / "textcls"


def _copy_textcls(name: str, folder: str = ""):
    def prepare(root: Path) -> Path:
        shutil.copytree(TEXTCLS / name, root / name)
        return root / name / folder

    return prepare


def _imdb_folder(root: Path) -> Path:
    for name in ("train/pos/0_9.txt", "train/neg/0_2.txt", "test/pos/0_8.txt", "test/neg/0_1.txt"):
        (root / "aclImdb" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "aclImdb" / name).write_text("a fine film", encoding="utf-8")
    return root / "aclImdb" / "train" / "pos"


def _image_folder(root: Path) -> Path:
    from test_image import _png

    for cls in ("cat", "airplane"):
        (root / "train" / cls).mkdir(parents=True)
        (root / "train" / cls / "0000.png").write_bytes(_png((0, 0, 0)))
    return root / "train" / "cat"


DANGLING = {
    # (prepare a copy of the data: returns the folder that gets the dangling link, the link's name, read it)
    "BBC document": (_copy_textcls("bbc", "business"), "999.txt", lambda root: textcls.read_bbc(root, "train")),
    "BBC class folder": (_copy_textcls("bbc"), "weather", lambda root: textcls.read_bbc(root, "train")),
    "20 Newsgroups document": (_copy_textcls("20news-bydate-train", "comp.graphics"), "61000",
                               lambda root: textcls.read_20news(root, "train")),
    "IMDb review": (_imdb_folder, "1_10.txt", lambda root: textcls.build_textcls("imdb", "train", root)),
    "image file": (_image_folder, "0001.png",
                   lambda root: build_dataset("image", "train", data_dir=str(root), check_counts=False)),
}


@pytest.mark.parametrize("prepare, name, read", cases(FOLDERS, CLEAR_ERROR, DANGLING))
def test_dangling_link_in_a_class_folder_is_an_error_naming_it(tmp_path, prepare, name, read):
    link = prepare(tmp_path) / name
    read(tmp_path)  # the copy reads as it is
    link.symlink_to(tmp_path / "moved-away" / name)
    with pytest.raises(DatasetError, match=rf"{link}: a symbolic link to .*moved-away/{name}, which does not exist"):
        read(tmp_path)


# ----------------------------------------------------------------------------- the other readers of users' files

from reliability import CORRECT_RESULT as _CORRECT, OTHER_READERS  # noqa: E402

from longattn.data import listops  # noqa: E402

MIMIC = TEXTCLS / "mimic3"


def _mimic(tmp_path, text: str) -> Path:
    folder = tmp_path / "mimic3"
    shutil.copytree(MIMIC, folder)
    (folder / "test_50.csv").write_text(text, encoding="utf-8")
    return folder


OTHER_FILES = {
    # (write the file into tmp_path, read it, the error)
    "MIMIC row of two lines after a note of three": (
        lambda tmp: _mimic(tmp, 'SUBJECT_ID,HADM_ID,TEXT,LABELS,length\n1,2,"a note\nover three\nlines",401.9,5\n'
                                '3,4,"a short\nrow"\n'),
        lambda folder: textcls.build_textcls("mimic3_50", "test", folder),
        r"mimic3/test_50.csv:5: expected 5 columns, found 3"),
    "MIMIC header with a column twice": (
        lambda tmp: _mimic(tmp, "SUBJECT_ID,HADM_ID,TEXT,TEXT,LABELS\n1,2,a,b,401.9\n"),
        lambda folder: textcls.build_textcls("mimic3_50", "test", folder),
        r"mimic3/test_50.csv:1: the header names column\(s\) \['TEXT'\] more than once"),
    "MIMIC file not UTF-8": (
        lambda tmp: (_mimic(tmp, "SUBJECT_ID,HADM_ID,TEXT,LABELS\n"), (tmp / "mimic3" / "test_50.csv").open("ab").write(
            b'1,2,"caf\xe9",401.9\n'), tmp / "mimic3")[-1],
        lambda folder: textcls.build_textcls("mimic3_50", "test", folder),
        r"mimic3/test_50.csv:2: not UTF-8"),
    "ListOps token after blank lines": (
        lambda tmp: (tmp / "basic_val.tsv").write_text("Source\tTarget\n( [MAX 2 3 ] )\t3\n\n\n( [MAX 2 x ] )\t3\n")
        and tmp,
        lambda folder: listops.load_listops(folder, "val"),
        r"basic_val.tsv:5: unknown ListOps token 'x'"),
    "ListOps file not UTF-8": (
        lambda tmp: (tmp / "basic_val.tsv").write_bytes(b"Source\tTarget\n( [MAX 2 \xff ] )\t3\n") and tmp,
        lambda folder: listops.load_listops(folder, "val"),
        r"basic_val.tsv:2: not UTF-8"),
}


@pytest.mark.parametrize("write, read, message", cases(OTHER_READERS, CLEAR_ERROR, OTHER_FILES))
def test_other_readers_name_the_file_and_the_line_where_the_row_starts(tmp_path, write, read, message):
    folder = write(tmp_path)
    with pytest.raises(DatasetError, match=message):
        read(folder)


@bad_input(OTHER_READERS, _CORRECT)
def test_a_damaged_dataset_cache_is_built_again(tmp_path, capsys):
    options = {"num_examples": 8, "seed": 0, "max_length": 60, "min_length": 10}
    first = build_dataset("listops", "train", cache_dir=tmp_path, **options)
    (cache,) = tmp_path.glob("*.pkl")
    cache.write_bytes(cache.read_bytes()[:50])  # cut by a full disk or damaged since
    again = build_dataset("listops", "train", cache_dir=tmp_path, **options)
    assert f"warning: {cache} is damaged" in capsys.readouterr().err
    assert [again[i]["tokens"].tolist() for i in range(8)] == [first[i]["tokens"].tolist() for i in range(8)]
