import hashlib
import shutil
import tarfile
import warnings
import zipfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.model_selection import StratifiedKFold

from longattn.data import DatasetError
from longattn.data import download as dl
from longattn.data import textcls, wordpiece
from longattn.testing import LocalFileServer

FIXTURES = Path(__file__).parent / "fixtures" / "textcls"


@pytest.fixture(autouse=True)
def _small_classes_are_expected():
    with warnings.catch_warnings():  # sklearn warns that tiny fixture classes have fewer members than folds
        warnings.filterwarnings("ignore", message="The least populated class", category=UserWarning)
        yield


def test_paper_max_lengths():
    lengths = {name: textcls.get_textcls(name).max_length for name in textcls.TEXTCLS_DATASETS.names()}
    assert lengths == {"r8": 141, "bbc": 664, "20news": 700, "imdb": 539, "mimic3_50": 1024,
                       "scope95": 328, "scope40": 337}


def test_r8_layout_vocabulary_and_truncation():
    train = textcls.build_textcls("r8", "train", FIXTURES)
    test = textcls.build_textcls("r8", "test", FIXTURES / "R8")  # the R8 folder itself works too
    assert (len(train), len(test)) == (10, 4)
    assert train.classes == ["acq", "earn", "trade"] and train.num_classes == 3
    assert train.labels.tolist() == [1, 0, 1, 2, 1, 0, 1, 2, 1, 0]
    assert train.vocabulary[:3] == ["[PAD]", "[UNK]", "reuter"]  # the most frequent word first
    assert train.vocab_size == len(train.vocabulary) == test.vocab_size
    words = "champion products approves stock split the board approved a two for one split reuter".split()
    assert train[0]["tokens"].tolist() == [train.vocabulary.index(w) for w in words]
    assert textcls.UNK_ID in test[0]["tokens"].tolist()  # "taiwan" is not in the training vocabulary
    assert train.sources[3].endswith("R8/train.txt:4")
    short = textcls.build_textcls("r8", "train", FIXTURES, max_length=3)
    assert short.max_len == 3 and short[0]["tokens"].tolist() == train[0]["tokens"][:3].tolist()
    batch = textcls.collate_textcls([train[0], train[2]], pad_id=train.pad_id)
    assert batch["attention_mask"].sum(1).tolist() == [len(train[0]["tokens"]), len(train[2]["tokens"])]
    assert batch["label"].tolist() == [1, 1] and batch["label"].dtype == torch.long
    frequent = textcls.build_textcls("r8", "train", FIXTURES, min_count=2)
    counts = Counter(w for text in textcls.read_r8(FIXTURES, "train").texts for w in text.lower().split())
    assert frequent.vocabulary[2:] == [w for w in train.vocabulary[2:] if counts[w] >= 2] and counts["champion"] == 1
    assert frequent[0]["tokens"].tolist() == [frequent.vocabulary.index(w) if counts[w] >= 2 else textcls.UNK_ID
                                              for w in words]
    assert train.lengths().tolist() == [len(train[i]["tokens"]) for i in range(len(train))]
    with pytest.raises(DatasetError, match="min_count must be a positive int"):
        textcls.build_textcls("r8", "train", FIXTURES, min_count=0)


def test_r8_wordpiece_option():
    ds = textcls.build_textcls("r8", "test", FIXTURES, tokenizer="wordpiece", max_length=8)
    tokenizer = wordpiece.load_wordpiece()
    cls, sep = wordpiece.special_id(tokenizer, "[CLS]"), wordpiece.special_id(tokenizer, "[SEP]")
    for i in range(len(ds)):
        ids = ds[i]["tokens"].tolist()
        assert ids[0] == cls and ids[-1] == sep and len(ids) <= 8
    assert ds.vocab_size == tokenizer.get_vocab_size() and ds.pad_id == 0


def test_cross_validation_folds_are_stratified_deterministic_and_cover():
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    folds = textcls.stratified_folds(labels, num_folds=5, seed=3)
    reference = StratifiedKFold(5, shuffle=True, random_state=3).split(np.zeros(100), labels)
    for (train, val), (ref_train, ref_val) in zip(folds, reference):
        assert train.tolist() == sorted(ref_train) and val.tolist() == sorted(ref_val)
        assert np.bincount(labels[val]).tolist() == [10, 6, 4]  # each fold keeps the class proportions
        assert not set(train) & set(val)
    assert sorted(np.concatenate([val for _, val in folds]).tolist()) == list(range(100))
    again = textcls.stratified_folds(labels, num_folds=5, seed=3)
    assert all((a[1] == b[1]).all() for a, b in zip(folds, again))
    assert any((a[1] != b[1]).any() for a, b in zip(folds, textcls.stratified_folds(labels, 5, seed=4)))
    with pytest.raises(DatasetError, match="no class has 3"):
        textcls.stratified_folds([0, 1, 2, 0, 1, 2], num_folds=3)
    with pytest.raises(DatasetError, match=r"num_folds must be in \[2, 6\]"):
        textcls.stratified_folds([0, 1, 2, 0, 1, 2], num_folds=7)


def test_fold_splits_of_a_dataset():
    full = textcls.build_textcls("r8", "train", FIXTURES)
    seen = []
    for fold in range(2):
        train = textcls.build_textcls("r8", "train", FIXTURES, fold=fold, num_folds=2)
        val = textcls.build_textcls("r8", "val", FIXTURES, fold=fold, num_folds=2)
        assert len(train) + len(val) == len(full)
        assert not set(train.sources) & set(val.sources)
        assert train.vocabulary == full.vocabulary  # one vocabulary for every fold: ids stay comparable
        seen += val.sources
    assert sorted(seen) == sorted(full.sources)
    with pytest.raises(DatasetError, match="no validation file"):
        textcls.build_textcls("r8", "val", FIXTURES)
    with pytest.raises(DatasetError, match=r"fold must be in \[0, 5\)"):
        textcls.build_textcls("r8", "train", FIXTURES, fold=5)


def _copy(tmp_path: Path, name: str) -> Path:
    shutil.copytree(FIXTURES / name, tmp_path / name)
    return tmp_path / name


def test_r8_errors_name_file_and_line(tmp_path):
    folder = _copy(tmp_path, "R8")
    (folder / "test.txt").write_text("earn\tfine\nship\tvessels collide reuter", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"R8/test.txt:2: label 'ship' does not occur in the training set"):
        textcls.build_textcls("r8", "test", tmp_path)
    (folder / "test.txt").write_text("earn\tfine\nno tab on this line\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"R8/test.txt:2: expected 'label<TAB>text'"):
        textcls.build_textcls("r8", "test", tmp_path)
    (folder / "test.txt").write_text("earn\tfine\nacq\t   \nearn\talso fine\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"empty document at .*R8/test.txt:2 \(1 in all\)"):
        textcls.build_textcls("r8", "test", tmp_path)
    assert len(textcls.build_textcls("r8", "test", tmp_path, skip_empty=True)) == 2
    (folder / "test.txt").write_bytes(b"earn\tfine\nacq\tcaf\xe9\n")
    with pytest.raises(DatasetError, match=r"R8/test.txt:2: not UTF-8"):
        textcls.build_textcls("r8", "test", tmp_path)
    with pytest.raises(DatasetError, match="accepted: train.txt; R8/train.txt; download it with "
                                           "`longattn data download r8"):
        textcls.build_textcls("r8", "train", tmp_path / "nowhere")
    with pytest.raises(DatasetError, match="did you mean '20news'"):
        textcls.build_textcls("20newsgroups", "train", tmp_path)
    with pytest.raises(DatasetError, match="tokenizer must be"):
        textcls.build_textcls("r8", "train", tmp_path, tokenizer="bpe")


def test_bbc_folder_zip_latin1_and_holdout(tmp_path):
    corpus = textcls.read_bbc(FIXTURES, "train")
    assert len(corpus) == 25 and corpus.latin1_files == 1  # README.TXT is not a document
    latin = corpus.texts[corpus.sources.index(f"{FIXTURES / 'bbc'}/entertainment/003.txt")]
    assert "café owner's résumé £100" in latin
    train = textcls.build_textcls("bbc", "train", FIXTURES)
    test = textcls.build_textcls("bbc", "test", FIXTURES)
    assert (len(train), len(test)) == (20, 5) and np.bincount(test.labels).tolist() == [1] * 5
    assert train.classes == ["business", "entertainment", "politics", "sport", "tech"]
    assert not set(train.sources) & set(test.sources)
    other_seed = textcls.build_textcls("bbc", "test", FIXTURES, seed=1)
    assert other_seed.sources != test.sources and len(other_seed) == 5
    with zipfile.ZipFile(tmp_path / "bbc-fulltext.zip", "w") as archive:
        for file in sorted((FIXTURES / "bbc").rglob("*")):
            archive.write(file, f"bbc/{file.relative_to(FIXTURES / 'bbc')}")
    zipped = textcls.build_textcls("bbc", "test", tmp_path)
    assert [zipped[i]["tokens"].tolist() for i in range(5)] == [test[i]["tokens"].tolist() for i in range(5)]


def test_20news_folder_and_archive(tmp_path):
    train = textcls.build_textcls("20news", "train", FIXTURES)
    test = textcls.build_textcls("20news", "test", FIXTURES)
    assert (len(train), len(test)) == (10, 3)
    assert train.classes == ["alt.atheism", "comp.graphics", "sci.space"]
    graphics = [s.rsplit("/", 1)[1] for s in train.sources if "/comp.graphics/" in s]
    assert graphics == ["10", "50960", "52060", "60001"]  # numeric id order
    corpus = textcls.read_20news(FIXTURES, "train")
    assert corpus.latin1_files == 1 and "Merci à tous" in corpus.texts[corpus.sources.index(
        f"{FIXTURES / '20news-bydate-train'}/comp.graphics/60001")]
    assert corpus.texts[0].startswith("From: mathew@mantis.co.uk\nSubject:")  # headers kept
    with tarfile.open(tmp_path / "20news-bydate.tar.gz", "w:gz") as archive:
        for top in ("20news-bydate-train", "20news-bydate-test"):
            archive.add(FIXTURES / top, top)
    from_archive = textcls.build_textcls("20news", "train", tmp_path)
    assert [from_archive[i]["tokens"].tolist() for i in range(10)] == [train[i]["tokens"].tolist() for i in range(10)]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "20news-bydate.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(DatasetError, match="not a readable archive"):
        textcls.build_textcls("20news", "train", tmp_path / "bad")


def test_imdb_through_the_shared_reader(tmp_path):
    reviews = {"train/pos/0_9.txt": "A GREAT film, truly!", "train/neg/0_2.txt": "Dull.<br />Bad.",
               "test/pos/0_8.txt": "Great.", "test/neg/0_1.txt": "Awful film"}
    for name, text in reviews.items():
        (tmp_path / "aclImdb" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "aclImdb" / name).write_text(text, encoding="utf-8")
    train = textcls.build_textcls("imdb", "train", tmp_path)
    assert train.classes == ["neg", "pos"] and train.labels.tolist() == [0, 1]
    words = [train.vocabulary[i] for i in train[1]["tokens"].tolist()]
    assert words == ["a", "great", "film", ",", "truly", "!"]  # lower-cased words and punctuation
    assert len(textcls.build_textcls("imdb", "test", tmp_path)) == 2


def test_imdb_archive_is_read_once_per_build_of_the_splits(tmp_path, monkeypatch):
    import io

    from longattn.data import text
    from longattn.data.common import read_once
    from longattn.experiment.config import resolve_config
    from longattn.tasks import get_task

    archive = tmp_path / "aclImdb_fixture.tar.gz"

    def write_archive(word: str) -> None:
        with tarfile.open(archive, "w:gz") as tar:
            for subset in ("train", "test"):
                for label in ("pos", "neg"):
                    for i in range(5):
                        data = f"{word} {label} review {i}".encode()
                        info = tarfile.TarInfo(f"aclImdb/{subset}/{label}/{i}_5.txt")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))

    passes = []
    real_iter = text.iter_archive_files
    monkeypatch.setattr(text, "iter_archive_files", lambda path: (passes.append(path), real_iter(path))[1])
    write_archive("first")
    with read_once():
        splits = {split: textcls.build_textcls("imdb", split, tmp_path, fold=1) for split in ("train", "val", "test")}
        again = textcls.build_textcls("imdb", "train", tmp_path, fold=1)
    assert len(passes) == 1  # train, val and test (and a second train) from one pass over the archive
    assert [len(splits[s]) for s in ("train", "val", "test")] == [8, 2, 10]
    assert again.tokens[0].tolist() == splits["train"].tokens[0].tolist()
    assert "first" in splits["test"].vocabulary

    config = resolve_config("imdb", overrides=[f"data.data_dir={tmp_path}", "data.num_folds=2"])
    get_task("imdb").build_data(config)  # the task builds its three splits in one block
    assert len(passes) == 2

    write_archive("second")  # outside a block every build reads again: a changed file is never stale
    assert "second" in textcls.build_textcls("imdb", "train", tmp_path, fold=1).vocabulary
    assert len(passes) == 3


def test_mimic3_multilabel(tmp_path):
    train = textcls.build_textcls("mimic3_50", "train", FIXTURES / "mimic3")
    assert train.multilabel and train.classes == ["038.9", "401.9", "414.01", "428.0", "584.9"]
    assert train[0]["label"].tolist() == [0, 1, 1, 0, 0] and train[0]["label"].dtype == torch.float32
    words = [train.vocabulary[i] for i in train[3]["tokens"].tolist()]
    assert words == ["sepsis,", "treated", "with", "antibiotics"]  # quoted CSV field with a comma
    val = textcls.build_textcls("mimic3_50", "val", FIXTURES / "mimic3")  # the official dev file
    test = textcls.build_textcls("mimic3_50", "test", FIXTURES)  # or its parent folder
    assert len(val) == 1 and test[0]["label"].tolist() == [0, 0, 0, 1, 1]
    batch = textcls.collate_textcls([train[0], train[1]])
    assert batch["label"].shape == (2, 5) and batch["label"].dtype == torch.float32
    folds = textcls.build_textcls("mimic3_50", "val", FIXTURES / "mimic3", fold=0, num_folds=5)
    assert len(folds) == 1  # KFold: multi-label rows cannot be stratified
    folder = _copy(tmp_path, "mimic3")
    with open(folder / "test_50.csv", "a", encoding="utf-8") as handle:
        handle.write("108,2008,new code,999.9,2\n")
    with pytest.raises(DatasetError, match=r"mimic3/test_50.csv:3: label '999.9' is not among the 5"):
        textcls.build_textcls("mimic3_50", "test", folder)
    (folder / "dev_50.csv").write_text("SUBJECT_ID,HADM_ID,NOTE\n1,2,x\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"dev_50.csv:1: expected a header with TEXT and LABELS"):
        textcls.build_textcls("mimic3_50", "val", folder)


def test_scope_fasta_folds_and_residues(tmp_path):
    corpus = textcls.read_scope("40")(FIXTURES / "scope", "train")
    assert corpus.labels == ["a.1"] * 4 + ["b.1"] * 4 + ["c.2"]
    assert corpus.texts[0] == "SLFEQLGGQAAVQAVTAQFYANIQADATVATFFNGIDMPNQTNK"  # lines joined, upper-cased
    train = textcls.build_textcls("scope40", "train", FIXTURES / "scope")
    test = textcls.build_textcls("scope40", "test", FIXTURES / "scope")
    assert (len(train), len(test)) == (7, 2) and train.classes == ["a.1", "b.1", "c.2"]
    assert "c.2" not in [test.classes[i] for i in test.labels]  # a single-document class stays in train
    assert train.vocab_size == len(textcls.AMINO_ACIDS) + 2
    third = textcls.read_scope("40")(FIXTURES / "scope", "train").texts[2]
    ids = textcls._encode_residues([third], 100)[0]
    assert ids[third.index("X")] == textcls.AMINO_ACIDS.index("X") + 2
    with pytest.raises(DatasetError, match=r"holds astral-.*-40-2.08.fa; accepted: the ASTRAL FASTA \*-95-\*.fa"):
        textcls.build_textcls("scope95", "train", FIXTURES / "scope")
    bad = tmp_path / "astral-scopedom-seqres-gd-sel-gs-bib-40-2.08.fa"
    bad.write_text(">d1dlwa_ a.1 (A:) truncated class\nslfe\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"2.08.fa:1: expected '>domain class.fold"):
        textcls.build_textcls("scope40", "train", tmp_path)


def test_download_r8_from_local_server(tmp_path, monkeypatch):
    files = {name: (FIXTURES / "R8" / name).read_bytes() for name in ("train.txt", "test.txt")}
    for name in ("r8_train", "r8_test"):
        archive = dl.ARCHIVES[name]
        monkeypatch.setitem(dl.ARCHIVES, name, replace(
            archive, sha256=hashlib.sha256(files[archive.filename]).hexdigest(), size=None))
    with LocalFileServer(files) as server:
        folder = textcls.download_textcls("r8", tmp_path, base_url=server.url, progress=False)
    assert len(textcls.build_textcls("r8", "train", folder)) == 10
    with pytest.raises(DatasetError, match="allow_unverified"):
        textcls.download_textcls("bbc", tmp_path, progress=False)
    with pytest.raises(DatasetError, match="credentialed"):
        textcls.download_textcls("mimic3_50", tmp_path)
    assert dl.ARCHIVES["20news"].sha256 == "8f1b2514ca22a5ade8fbb9cfa5727df95fa587f4c87b786e15c759fa66d95610"


def test_real_r8(shared_data):
    folder = shared_data / "textcls" / "R8"
    if not (folder / "train.txt").is_file():
        pytest.skip("no textcls/R8 in the shared data folder")
    assert dl.check_digests(folder / "train.txt", dl.ARCHIVES["r8_train"].sha256)
    train = textcls.build_textcls("r8", "train", folder)
    test = textcls.build_textcls("r8", "test", folder)
    assert (len(train), len(test)) == (5485, 2189) and train.num_classes == 8
    assert np.bincount(train.labels)[train.classes.index("earn")] == 2840
    assert train.max_len == 141 and test.max_len == 141
    val = textcls.build_textcls("r8", "val", folder, fold=0)
    assert len(val) == 1097 and set(np.unique(val.labels)) == set(range(8))


def test_bbc_and_20news_error_rules(tmp_path):
    """Empty documents and labels the training set lacks get errors naming the file (BBC and 20NG layouts)."""
    bbc = _copy(tmp_path / "a", "bbc")
    (bbc / "sport" / "006.txt").write_text("  \n")
    with pytest.raises(DatasetError, match=r"empty document at .*bbc/sport/006.txt \(1 in all\)"):
        textcls.build_textcls("bbc", "train", tmp_path / "a")
    assert len(textcls.build_textcls("bbc", "train", tmp_path / "a", skip_empty=True)) == 20
    for top in ("20news-bydate-train", "20news-bydate-test"):
        _copy(tmp_path / "b", top)
    unknown = tmp_path / "b" / "20news-bydate-test" / "rec.autos"
    unknown.mkdir()
    (unknown / "103007").write_text("From: a@b.c\nSubject: cars\n\nfast cars\n")
    with pytest.raises(DatasetError, match=r"20news-bydate-test/rec.autos/103007: label 'rec.autos' does not occur"):
        textcls.build_textcls("20news", "test", tmp_path / "b")
    assert len(textcls.build_textcls("20news", "train", tmp_path / "b")) == 10


# ----------------------------------------------------------------------------- packings (issue 59)

def _pack(folder: Path, tops: list[str], archive: Path, packing: str) -> Path:
    """``tops`` (folders of ``folder``) packed into ``archive`` as a zip or a tar of that mode."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    if packing == "zip":
        with zipfile.ZipFile(archive, "w") as handle:
            for top in tops:
                for file in sorted((folder / top).rglob("*")):
                    handle.write(file, str(file.relative_to(folder)))
    else:
        with tarfile.open(archive, packing) as handle:
            for top in tops:
                handle.add(folder / top, top)
    return archive


def _documents(name: str, data_dir: Path) -> dict[str, tuple[list, list]]:
    """(tokens, label) of every document of each split of fold 0 of 2 (the fixtures have 4 documents a class)."""
    splits = {split: textcls.build_textcls(name, split, data_dir, fold=0, num_folds=2)
              for split in ("train", "val", "test")}
    return {split: ([d[i]["tokens"].tolist() for i in range(len(d))], d.labels.tolist()) for split, d in splits.items()}


@pytest.mark.parametrize("file_name, packing", [
    ("bbc-fulltext.zip", "zip"), ("bbc.tar", "w"), ("bbc-fulltext.tar.gz", "w:gz"), ("mirror.tgz", "w:gz"),
    ("bbc-fulltext.tar.gz", "zip"),  # a zip under a tar name: read by its content
])
def test_bbc_gives_the_same_documents_and_splits_whatever_the_packing(tmp_path, file_name, packing):
    _pack(FIXTURES, ["bbc"], tmp_path / file_name, packing)
    assert _documents("bbc", tmp_path) == _documents("bbc", FIXTURES)


@pytest.mark.parametrize("file_name, packing", [("20news-bydate.tar.gz", "w:gz"), ("20news.zip", "zip")])
def test_20news_gives_the_same_documents_and_splits_as_folder_and_archive(tmp_path, file_name, packing):
    _pack(FIXTURES, ["20news-bydate-train", "20news-bydate-test"], tmp_path / file_name, packing)
    assert _documents("20news", tmp_path) == _documents("20news", FIXTURES)


def test_imdb_from_a_zip_under_any_name(tmp_path):
    reviews = {"train/pos/0_9.txt": "A GREAT film", "train/neg/0_2.txt": "Dull.", "train/pos/1_7.txt": "Fine",
               "train/neg/1_3.txt": "Bad", "test/pos/0_8.txt": "Great.", "test/neg/0_1.txt": "Awful film"}
    for name, text in reviews.items():
        (tmp_path / "tree" / "aclImdb" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tree" / "aclImdb" / name).write_text(text, encoding="utf-8")
    _pack(tmp_path / "tree", ["aclImdb"], tmp_path / "packed" / "imdb_reviews.zip", "zip")
    folder = textcls.build_textcls("imdb", "test", tmp_path / "tree")
    packed = textcls.build_textcls("imdb", "test", tmp_path / "packed")
    assert [packed[i]["tokens"].tolist() for i in range(2)] == [folder[i]["tokens"].tolist() for i in range(2)]


@pytest.mark.parametrize("name, layout, command", [
    ("r8", "R8/train.txt", "longattn data download r8 --data-dir {dir}"),
    ("bbc", "bbc/<class>/<nnn>.txt", "longattn data download bbc --data-dir {dir} --allow-unverified"),
    ("20news", "20news-bydate-{train,test}/<group>/<id>", "longattn data download 20news --data-dir {dir}"),
    ("imdb", "aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt", "longattn data download imdb --data-dir {dir}"),
    ("scope95", "*-95-*.fa", "longattn data download scope95 --data-dir {dir} --allow-unverified"),
    ("mimic3_50", "train_50.csv", None),
])
def test_a_folder_without_the_data_names_what_it_holds_the_layouts_and_the_download(tmp_path, name, layout, command):
    for folder, expected in ((tmp_path / "empty", "is empty"), (tmp_path / "other", "holds notes.txt, photos/")):
        folder.mkdir()
        if expected != "is empty":
            (folder / "notes.txt").write_text("x")
            (folder / "photos").mkdir()
        with pytest.raises(DatasetError) as error:
            textcls.build_textcls(name, "train", folder)
        message = str(error.value)
        assert f"no usable data in {folder}, which {expected}; accepted: " in message and layout in message
        assert (command is None and "download" not in message) or f"`{command.format(dir=folder)}`" in message
