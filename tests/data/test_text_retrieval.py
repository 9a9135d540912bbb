import io
import tarfile
from pathlib import Path

import pytest

from longattn.data import DatasetError, build_dataset, collate
from longattn.data import text

REVIEWS = {
    "train/pos/0_9.txt": "Great film \u00e9!",
    "train/pos/1_8.txt": "Loved it",
    "train/neg/0_2.txt": "Bad\x00movie",  # a NUL byte is a real token (id 0)
    "train/neg/1_1.txt": "Awful",
    "test/pos/0_10.txt": "Superb",
    "test/neg/0_3.txt": "Dull",
}


def _write_tar(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            data = content.encode("utf-8")
            info = tarfile.TarInfo(f"aclImdb/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_imdb_from_tarball_and_folder_agree(tmp_path):
    _write_tar(tmp_path / "aclImdb_fixture.tar.gz", REVIEWS)
    from_tar = build_dataset("text", "train", data_dir=str(tmp_path), check_counts=False)
    folder = tmp_path / "extracted"
    for name, content in REVIEWS.items():
        (folder / "aclImdb" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "aclImdb" / name).write_text(content, encoding="utf-8")
    from_folder = build_dataset("text", "train", data_dir=str(folder), check_counts=False)
    assert len(from_tar) == len(from_folder) == 4
    for i in range(4):
        assert from_tar[i]["tokens"].tolist() == from_folder[i]["tokens"].tolist()
        assert from_tar[i]["label"] == from_folder[i]["label"]
    # sorted by (label, id): neg 0, neg 1, pos 0, pos 1
    assert [from_tar[i]["label"] for i in range(4)] == [0, 0, 1, 1]
    assert from_tar[0]["tokens"].tolist() == list(b"Bad\x00movie")
    assert from_tar[2]["tokens"].tolist() == list("Great film \u00e9!".encode("utf-8"))
    # archive passed as a file path; truncation; val defaults to the test set as in LRA
    short = build_dataset("text", "train", data_dir=str(tmp_path / "aclImdb_fixture.tar.gz"), max_length=3,
                          check_counts=False)
    assert short[2]["tokens"].tolist() == list(b"Gre")
    assert len(build_dataset("text", "val", data_dir=str(tmp_path), check_counts=False)) == 2
    held = build_dataset("text", "val", data_dir=str(tmp_path), val_source="holdout", val_fraction=0.25,
                         check_counts=False)
    rest = build_dataset("text", "train", data_dir=str(tmp_path), val_source="holdout", val_fraction=0.25,
                         check_counts=False)
    assert len(held) == 1 and len(rest) == 3


def test_text_masks_do_not_use_token_zero(tmp_path):
    _write_tar(tmp_path / "aclImdb_fixture.tar.gz", REVIEWS)
    ds = build_dataset("text", "train", data_dir=str(tmp_path), check_counts=False)
    batch = collate([ds[0], ds[1]], pad_id=text.PAD_ID)
    assert batch["attention_mask"][0].sum() == len(b"Bad\x00movie")
    assert batch["tokens"][0, 3] == 0 and batch["attention_mask"][0, 3]


def test_text_errors(tmp_path):
    with pytest.raises(DatasetError, match="needs data_dir"):
        build_dataset("text", "train")
    with pytest.raises(DatasetError, match="aclImdb_v1.tar.gz"):
        build_dataset("text", "train", data_dir=str(tmp_path), check_counts=False)
    (tmp_path / "aclImdb_fixture.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(DatasetError, match="not a readable archive"):
        build_dataset("text", "train", data_dir=str(tmp_path), check_counts=False)
    _write_tar(tmp_path / "aclImdb_fixture.tar.gz", {"train/pos/0_9.txt": "only positive"})
    with pytest.raises(DatasetError, match="one class"):
        build_dataset("text", "train", data_dir=str(tmp_path), check_counts=False)


def test_real_imdb_test_split(shared_data):
    if not (shared_data / "imdb").is_dir():
        pytest.skip("no imdb/ in the shared data folder")
    ds = build_dataset("text", "test", data_dir=str(shared_data / "imdb"))
    assert len(ds) == 25_000
    assert int(ds.labels.sum()) == 12_500
    assert ds.max_len == 4096


def _aan_line(label: str, a: str, b: str) -> str:
    return f"{label}\tid_{a[:3]}\tid_{b[:3]}\t{a}\t{b}\n"


def test_retrieval_fixture(tmp_path):
    folder = tmp_path / "tsv_data"
    folder.mkdir()
    (folder / "new_aan_pairs.train.tsv").write_text(
        _aan_line("1", "doc one text", "cited \"doc\"") + _aan_line("0.0", "x" * 50, "y"), encoding="utf-8")
    (folder / "new_aan_pairs.eval.tsv").write_text(_aan_line("1.0", "a", "b"), encoding="utf-8")
    ds = build_dataset("retrieval", "train", data_dir=str(tmp_path), max_length=10)
    assert len(ds) == 2
    item = ds[0]
    assert item["label"] == 1 and item["tokens0"].tolist() == list(b"doc one te")
    assert item["tokens1"].tolist() == list(b'cited "doc')
    assert ds[1]["label"] == 0 and len(ds[1]["tokens0"]) == 10
    assert len(build_dataset("retrieval", "val", data_dir=str(tmp_path))) == 1  # val reads the eval file
    batch = collate([ds[0], ds[1]], pad_id=256)
    assert set(batch) == {"tokens0", "attention_mask0", "tokens1", "attention_mask1", "label"}
    assert batch["attention_mask1"].sum(1).tolist() == [10, 1]


def test_retrieval_errors(tmp_path):
    with pytest.raises(DatasetError, match="new_aan_pairs.train.tsv"):
        build_dataset("retrieval", "train")
    with pytest.raises(DatasetError, match="new_aan_pairs.test.tsv"):
        build_dataset("retrieval", "test", data_dir=str(tmp_path))
    (tmp_path / "new_aan_pairs.test.tsv").write_text("1\tid\tid\tonly four\n")
    with pytest.raises(DatasetError, match=r"new_aan_pairs.test.tsv:1: expected 5"):
        build_dataset("retrieval", "test", data_dir=str(tmp_path))
    (tmp_path / "new_aan_pairs.test.tsv").write_text("2\ta\tb\tc\td\n")
    with pytest.raises(DatasetError, match="not 0 or 1"):
        build_dataset("retrieval", "test", data_dir=str(tmp_path))


def test_a_folder_without_the_aan_pairs_names_what_it_holds_and_the_download_command(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"which holds notes.txt; accepted: new_aan_pairs.train.tsv in the folder; "
                                           r"tsv_data/new_aan_pairs.train.tsv; the unpacked LRA release: .*"
                                           r"lra_release/lra_release/tsv_data/; .*`longattn data download lra_release"):
        build_dataset("retrieval", "train", data_dir=str(tmp_path))
