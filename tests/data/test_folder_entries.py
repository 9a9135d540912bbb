"""Class folders take real folders of regular files only, and documents are decoded by their byte-order mark
(issue 56): a symbolic link, a stray sub-folder, a folder named like a document or a FIFO is a DatasetError naming
its path (never an extra class, a document counted twice or one skipped without a word); a UTF-16 or UTF-8 file
with its mark reads as its text, NUL bytes without a mark are refused (never read through the Latin-1 fallback)."""

import os
import re
from pathlib import Path

import pytest

from longattn.data import DatasetError, build_dataset, textcls
from reliability import CLEAR_ERROR, CORRECT_RESULT, FOLDERS, bad_input, cases
from test_data_reliability import _copy_textcls, _image_folder, _imdb_folder


def read_bbc(root: Path):
    return textcls.read_bbc(root, "train")


def read_images(root: Path):
    return build_dataset("image", "train", data_dir=str(root), check_counts=False)


def read_imdb(root: Path):
    return textcls.build_textcls("imdb", "train", root)


def _link(target: str):
    """Make the entry a symbolic link to ``target`` (relative to the folder that gets the entry)."""
    return lambda folder, entry: entry.symlink_to(folder / target)


def _folder(folder: Path, entry: Path) -> None:
    entry.mkdir()
    (entry / "001.txt").write_text("a document one level too deep", encoding="utf-8")


def _fifo(folder: Path, entry: Path) -> None:
    os.mkfifo(entry)


ENTRIES = {
    # (prepare a copy of the data: returns the folder that gets the entry, the entry's name, make it, read, error)
    "BBC class folder linked to another class": (_copy_textcls("bbc"), "weather", _link("sport"), read_bbc,
                                                 "a symbolic link to .*sport"),
    "BBC document linked to another class's": (_copy_textcls("bbc", "business"), "900.txt",
                                               _link("../sport/001.txt"), read_bbc, "a symbolic link to .*sport/001"),
    "BBC stray sub-folder": (_copy_textcls("bbc", "business"), "drafts", _folder, read_bbc,
                             "a folder where a document belongs"),
    "BBC folder named like a document": (_copy_textcls("bbc", "business"), "900.txt", _folder, read_bbc,
                                         "a folder where a document belongs"),
    "BBC FIFO document": (_copy_textcls("bbc", "business"), "901.txt", _fifo, read_bbc, "not a regular file"),
    "BBC FIFO beside the class folders": (_copy_textcls("bbc"), "pipe", _fifo, read_bbc,
                                          "not a folder where a class folder belongs"),
    "20 Newsgroups stray sub-folder": (_copy_textcls("20news-bydate-train", "comp.graphics"), "old", _folder,
                                       lambda root: textcls.read_20news(root, "train"), "a folder where a document"),
    "image class folder linked to another": (lambda root: _image_folder(root).parent, "dog", _link("cat"),
                                             read_images, "a symbolic link to .*cat"),
    "image folder named like an image": (_image_folder, "0001.png", _folder, read_images,
                                         "a folder where a document belongs"),
    "IMDb review linked to another": (_imdb_folder, "1_10.txt", _link("../neg/0_2.txt"), read_imdb,
                                      "a symbolic link to .*neg/0_2.txt"),
    "IMDb FIFO review": (_imdb_folder, "1_10.txt", _fifo, read_imdb, "not a regular file"),
}


@pytest.mark.parametrize("prepare, name, make, read, error", cases(FOLDERS, CLEAR_ERROR, ENTRIES))
def test_an_entry_that_is_not_a_real_folder_or_file_is_an_error_naming_it(tmp_path, prepare, name, make, read, error):
    folder = prepare(tmp_path)
    read(tmp_path)  # the copy reads as it is
    entry = folder / name
    make(folder, entry)
    with pytest.raises(DatasetError, match=re.escape(f"{entry}: ") + error):
        read(tmp_path)


@bad_input(FOLDERS, CORRECT_RESULT)
def test_a_regular_file_beside_the_class_folders_is_no_class(tmp_path):
    root = _copy_textcls("bbc")(tmp_path)
    assert (root / "README.TXT").is_file()  # as in the BBC release
    assert sorted(set(read_bbc(tmp_path).labels)) == ["business", "entertainment", "politics", "sport", "tech"]


TEXT = "Café au lait, naïve résumé"
MARKED = {"utf-16 LE": TEXT.encode("utf-16"), "utf-16 BE": b"\xfe\xff" + TEXT.encode("utf-16-be"),
          "utf-8 with mark": TEXT.encode("utf-8-sig"), "utf-32": TEXT.encode("utf-32")}


@pytest.mark.parametrize("data", cases(FOLDERS, CORRECT_RESULT, MARKED))
def test_a_document_with_a_byte_order_mark_reads_as_its_text(tmp_path, data):
    root = _copy_textcls("bbc", "business")(tmp_path)
    before = read_bbc(tmp_path)
    (root / "900.txt").write_bytes(data)
    corpus = read_bbc(tmp_path)
    assert corpus.texts[corpus.sources.index(f"{root}/900.txt")] == TEXT
    assert len(corpus) == len(before) + 1 and corpus.latin1_files == before.latin1_files  # no fallback


UNMARKED = {"utf-16 without its mark": (TEXT.encode("utf-16-le"), "900.txt:1: a NUL byte at byte 1"),
            "a mark over bytes of another encoding": (b"\xff\xfe" + b"abc", "900.txt: starts with the byte-order "
                                                      "mark of utf-16 but is not utf-16")}


@pytest.mark.parametrize("data, error", cases(FOLDERS, CLEAR_ERROR, UNMARKED))
def test_nul_bytes_without_a_mark_or_a_wrong_mark_are_refused(tmp_path, data, error):
    root = _copy_textcls("bbc", "business")(tmp_path)
    (root / "900.txt").write_bytes(data)
    with pytest.raises(DatasetError, match=error):
        read_bbc(tmp_path)
