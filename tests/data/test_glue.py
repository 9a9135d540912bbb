import hashlib
import io
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from longattn import metrics
from longattn.data import DatasetError
from longattn.data import download as dl
from longattn.data import glue, wordpiece
from longattn.testing import LocalFileServer

FIXTURES = Path(__file__).parent / "fixtures" / "glue_data"

# (task, split, examples, first label) of every fixture file, in the official layouts
EXPECTED = [
    ("cola", "train", 3, 1), ("cola", "dev", 2, 1), ("cola", "test", 2, None),
    ("sst2", "train", 3, 0), ("sst2", "dev", 2, 1), ("sst2", "test", 2, None),
    ("mrpc", "train", 2, 1), ("mrpc", "dev", 2, 1), ("mrpc", "test", 2, None),
    ("stsb", "train", 3, 5.0), ("stsb", "dev", 2, 5.0), ("stsb", "test", 1, None),
    ("qqp", "train", 2, 0), ("qqp", "dev", 3, 0), ("qqp", "test", 1, None),
    ("mnli", "train", 3, 2), ("mnli", "dev_matched", 2, 2), ("mnli", "dev_mismatched", 1, 1),
    ("mnli", "test_matched", 1, None), ("mnli", "test_mismatched", 1, None),
    ("qnli", "train", 2, 1), ("qnli", "dev", 1, 0), ("qnli", "test", 1, None),
    ("rte", "train", 2, 1), ("rte", "dev", 1, 1), ("rte", "test", 1, None),
]


@pytest.fixture(scope="module")
def tokenizer():
    return wordpiece.load_wordpiece()


@pytest.mark.parametrize("name,split,size,first_label", EXPECTED)
def test_every_official_layout_parses(name, split, size, first_label):
    examples = glue.read_glue(name, split, FIXTURES)
    task = glue.get_glue_task(name)
    assert len(examples) == size
    assert (examples.second is not None) == task.is_pair
    if first_label is None:
        assert examples.labels is None
    else:
        assert examples.labels[0] == first_label
        assert examples.labels.dtype == (np.float32 if task.is_regression else np.int64)
    assert all(isinstance(text, str) and text for text in examples.first)


def test_texts_columns_and_quirks():
    cola = glue.read_glue("cola", "train", FIXTURES)  # no header, sentence in the 4th column
    assert cola.first[2] == 'Kim é seemed to like "quoted" words.' and cola.labels.tolist() == [1, 0, 1]
    mrpc = glue.read_glue("mrpc", "train", FIXTURES / "MRPC")  # the task folder itself works too
    assert mrpc.first[0].startswith("Amrozi accused") and '" the witness "' in mrpc.first[0]  # quotes are text
    assert mrpc.second[0].startswith("Referring")
    qqp = glue.read_glue("qqp", "test", FIXTURES)  # test files have their own column order
    assert qqp.first == ["Why do rockets look white?"] and qqp.second == ["Why are rockets painted white?"]
    mnli = glue.read_glue("mnli", "dev", FIXTURES)  # "dev" means matched, as the papers report
    assert mnli.path.name == "dev_matched.tsv" and mnli.labels.tolist() == [2, 0]  # gold_label, not label1
    assert glue.read_glue("mnli", "val", FIXTURES).path.name == "dev_matched.tsv"
    assert glue.read_glue("rte", "train", FIXTURES).labels.tolist() == [1, 0]


def test_task_table():
    assert glue.GLUE_TASKS.names() == ["cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb"]
    for name in glue.GLUE_TASKS.names():
        task = glue.get_glue_task(name)
        assert all(m in metrics.names() for m in task.metrics) and task.paper_metric in task.metrics
    assert glue.get_glue_task("stsb").is_regression and glue.get_glue_task("stsb").num_labels == 1
    assert glue.get_glue_task("mnli").num_labels == 3 and glue.get_glue_task("cola").metrics == ("mcc",)
    assert glue.get_glue_task("mrpc").paper_metric == "acc_and_f1"


def test_pair_encoding_matches_transformers_bert_tokenizer(tokenizer):
    transformers = pytest.importorskip("transformers")
    reference = transformers.BertTokenizerFast.from_pretrained(str(wordpiece.minilm_dir()), local_files_only=True)
    examples = glue.read_glue("mrpc", "train", FIXTURES)
    for max_length in (128, 16):
        ds = glue.GlueDataset(examples, tokenizer, max_length=max_length)
        expected = reference(examples.first, examples.second, truncation="longest_first", max_length=max_length)
        for i in range(len(ds)):
            assert ds[i]["input_ids"].tolist() == expected["input_ids"][i]
            assert ds[i]["token_type_ids"].tolist() == expected["token_type_ids"][i]


def test_pair_layout_uncased_and_truncation(tokenizer):
    cls, sep = wordpiece.special_id(tokenizer, "[CLS]"), wordpiece.special_id(tokenizer, "[SEP]")
    ids, types = wordpiece.encode(tokenizer, ["Hello World"], ["good day"], max_length=128)
    ids, types = ids[0].tolist(), types[0].tolist()
    assert ids[0] == cls and ids.count(sep) == 2 and ids[-1] == sep
    second_start = ids.index(sep) + 1
    assert types == [0] * second_start + [1] * (len(ids) - second_start)
    lower, _ = wordpiece.encode(tokenizer, ["hello world"], ["GOOD DAY"], max_length=128)
    assert lower[0].tolist() == ids  # uncased vocabulary
    long_ids, long_types = wordpiece.encode(tokenizer, ["word " * 200], ["short"], max_length=20)
    assert len(long_ids[0]) == 20 and long_types[0].sum() == 2  # the longer text is cut first
    single, single_types = wordpiece.encode(tokenizer, ["just one"], max_length=128)
    assert single[0][0] == cls and single[0][-1] == sep and single_types[0].sum() == 0
    with pytest.raises(DatasetError, match="no room"):
        wordpiece.encode(tokenizer, ["a"], ["b"], max_length=4)


def test_dataset_and_collate(tokenizer):
    ds = glue.build_glue("stsb", "train", FIXTURES, tokenizer=tokenizer)
    batch = glue.collate_glue([ds[0], ds[1], ds[2]], pad_id=ds.pad_id)
    assert batch["labels"].dtype == torch.float32 and batch["labels"].tolist() == pytest.approx([5.0, 3.8, 0.0])
    lengths = [len(ds[i]["input_ids"]) for i in range(3)]
    assert batch["attention_mask"].sum(1).tolist() == lengths and batch["attention_mask"].dtype == torch.bool
    assert (batch["input_ids"][~batch["attention_mask"]] == ds.pad_id).all()
    assert (batch["token_type_ids"][~batch["attention_mask"]] == 0).all()
    cola = glue.build_glue("cola", "dev", FIXTURES, tokenizer=tokenizer)
    assert glue.collate_glue([cola[0], cola[1]])["labels"].dtype == torch.long
    test = glue.build_glue("cola", "test", FIXTURES, tokenizer=tokenizer)
    assert "label" not in test[0] and "labels" not in glue.collate_glue([test[0]])
    with pytest.raises(DatasetError, match="some items have a label"):
        glue.collate_glue([cola[0], test[0]])
    with pytest.raises(IndexError):
        cola[2]


def _copy_task(tmp_path: Path, folder: str) -> Path:
    shutil.copytree(FIXTURES / folder, tmp_path / folder)
    return tmp_path / folder


def test_malformed_files_name_file_and_line(tmp_path):
    rte = _copy_task(tmp_path, "RTE")
    with open(rte / "train.tsv", "a", encoding="utf-8") as handle:
        handle.write("2\tonly one sentence\tentailment\n")
    with pytest.raises(DatasetError, match=r"RTE/train.tsv:4: expected 4 tab-separated columns.*found 3"):
        glue.read_glue("rte", "train", tmp_path)
    (rte / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"RTE/dev.tsv:2: unknown label 'maybe'.*entailment, not_entailment"):
        glue.read_glue("rte", "dev", tmp_path)
    stsb = _copy_task(tmp_path, "STS-B")
    text = (stsb / "dev.tsv").read_text(encoding="utf-8").replace("4.750", "high")
    (stsb / "dev.tsv").write_text(text, encoding="utf-8")
    with pytest.raises(DatasetError, match=r"STS-B/dev.tsv:3: score 'high' is not a number"):
        glue.read_glue("stsb", "dev", tmp_path)
    (stsb / "test.tsv").write_bytes(b"index\tsentence1\tsentence2\n0\t\xff\tb\n")
    with pytest.raises(DatasetError, match=r"test.tsv:2: not UTF-8"):
        glue.read_glue("stsb", "test", tmp_path)
    (stsb / "train.tsv").write_text("index\tquestion\tsentence\tlabel\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"train.tsv:1: header has no column 'sentence1'"):
        glue.read_glue("stsb", "train", tmp_path)
    cola = _copy_task(tmp_path, "CoLA")
    (cola / "dev.tsv").write_text("gj04\t1\tThe sentence without the judgement column.\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"CoLA/dev.tsv:1: expected 4"):
        glue.read_glue("cola", "dev", tmp_path)


def test_missing_files_and_unknown_names(tmp_path):
    with pytest.raises(DatasetError, match="no train.tsv"):
        glue.read_glue("qnli", "train", tmp_path)
    with pytest.raises(DatasetError, match="has no split 'dev_matched'"):
        glue.read_glue("qnli", "dev_matched", FIXTURES)
    with pytest.raises(DatasetError, match="WNLI is excluded"):
        glue.get_glue_task("wnli")
    with pytest.raises(DatasetError, match="did you mean 'sst2'"):
        glue.get_glue_task("sst")


def test_mrpc_splits_from_official_sources(tmp_path):
    folder = tmp_path / "MRPC"
    folder.mkdir()
    for name in ("msr_paraphrase_train.txt", "msr_paraphrase_test.txt", "dev_ids.tsv"):
        shutil.copy(FIXTURES / "MRPC" / name, folder / name)
    glue.write_mrpc_splits(folder)
    for name in ("train.tsv", "dev.tsv", "test.tsv"):
        assert (folder / name).read_bytes() == (FIXTURES / "MRPC" / name).read_bytes(), name
    (folder / "dev_ids.tsv").unlink()
    with pytest.raises(DatasetError, match="missing .*dev_ids.tsv"):
        glue.write_mrpc_splits(folder)


def _zip_of(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for file in sorted(folder.rglob("*")):
            archive.write(file, f"{folder.name}/{file.relative_to(folder)}")
    return buffer.getvalue()


def test_download_glue_from_local_server(tmp_path, monkeypatch):
    files = {"CoLA.zip": _zip_of(FIXTURES / "CoLA")}
    for name in ("msr_paraphrase_train.txt", "msr_paraphrase_test.txt", "dev_ids.tsv"):
        files[name] = (FIXTURES / "MRPC" / name).read_bytes()
    for name, archive in list(dl.ARCHIVES.items()):  # the fixtures' checksums in place of the real ones
        if archive.filename in files:
            monkeypatch.setitem(dl.ARCHIVES, name, replace(
                archive, sha256=hashlib.sha256(files[archive.filename]).hexdigest(), size=None))
    with LocalFileServer(files) as server:
        glue.download_glue(tmp_path, ["cola", "mrpc"], base_url=server.url, progress=False)
    assert glue.read_glue("cola", "train", tmp_path).first == glue.read_glue("cola", "train", FIXTURES).first
    assert (tmp_path / "MRPC" / "dev.tsv").read_bytes() == (FIXTURES / "MRPC" / "dev.tsv").read_bytes()
    with pytest.raises(DatasetError, match="allow_unverified"):
        glue.download_glue(tmp_path, ["qqp"], progress=False)


def test_glue_archives_in_the_download_table():
    for name in ("cola", "sst2", "stsb", "mnli", "qnli", "rte"):
        archive = dl.ARCHIVES[f"glue_{name}"]
        assert archive.url == "https://dl.fbaipublicfiles.com/glue/data/" + archive.filename
        assert archive.sha256 is not None and len(archive.sha256) == 64


# ----------------------------------------------------------------------------- the real files (skipped if absent)

REAL_SIZES = {"sst2": (67349, 872), "cola": (8551, 1043), "mrpc": (3668, 408), "stsb": (5749, 1500)}


@pytest.mark.parametrize("name", sorted(REAL_SIZES))
def test_real_glue_sizes(shared_data, name):
    root = shared_data / "glue"
    if not (root / glue.get_glue_task(name).folder).is_dir():
        pytest.skip(f"no glue/{glue.get_glue_task(name).folder} in the shared data folder")
    train, dev = (glue.read_glue(name, split, root) for split in ("train", "dev"))
    assert (len(train), len(dev)) == REAL_SIZES[name]
    assert glue.read_glue(name, "test", root).labels is None


def test_real_mrpc_rebuilt_from_sources(shared_data, tmp_path, tokenizer):
    folder = shared_data / "glue" / "MRPC"
    if not (folder / "msr_paraphrase_train.txt").is_file():
        pytest.skip("no glue/MRPC sources in the shared data folder")
    for name in ("msr_paraphrase_train.txt", "msr_paraphrase_test.txt", "dev_ids.tsv"):
        dl.check_digests(folder / name, dl.ARCHIVES[{"dev_ids.tsv": "glue_mrpc_dev_ids",
                                                      "msr_paraphrase_train.txt": "glue_mrpc_train",
                                                      "msr_paraphrase_test.txt": "glue_mrpc_test"}[name]].sha256)
        shutil.copy(folder / name, tmp_path / name)
    glue.write_mrpc_splits(tmp_path)
    for name in ("train.tsv", "dev.tsv", "test.tsv"):
        assert (tmp_path / name).read_bytes() == (folder / name).read_bytes(), name
    ds = glue.build_glue("mrpc", "dev", shared_data / "glue", tokenizer=tokenizer)
    lengths = ds.input_ids.lengths()
    assert lengths.max() <= glue.MAX_LENGTH and int(ds.labels.sum()) == 279  # 68% paraphrases in dev


from reliability import CLEAR_ERROR, GLUE, cases  # noqa: E402

BAD_GLUE = {
    # (task folder, file, its text, task, split, message)
    "dev without its label column": ("RTE", "dev.tsv", "index\tsentence1\tsentence2\n0\ta\tb\n", "rte", "dev",
                                     r"RTE/dev.tsv:1: header has no column 'label' .*a dev file needs its labels"),
    "train without its label column": ("SST-2", "train.tsv", "sentence\nit is good\n", "sst2", "train",
                                       r"SST-2/train.tsv:1: header has no column 'label'"),
    "STS-B score above 5": ("STS-B", "dev.tsv", "index\tsentence1\tsentence2\tscore\n0\ta\tb\t5.2\n", "stsb", "dev",
                            r"STS-B/dev.tsv:2: score '5.2' lies outside 0..5"),
    "STS-B score below 0": ("STS-B", "train.tsv", "index\tsentence1\tsentence2\tscore\n0\ta\tb\t1\n1\tc\td\t-0.5\n",
                            "stsb", "train", r"STS-B/train.tsv:3: score '-0.5' lies outside 0..5"),
    "STS-B score inf": ("STS-B", "dev.tsv", "index\tsentence1\tsentence2\tscore\n0\ta\tb\tinf\n", "stsb", "dev",
                        r"STS-B/dev.tsv:2: score 'inf' lies outside"),
    "STS-B score nan": ("STS-B", "dev.tsv", "index\tsentence1\tsentence2\tscore\n0\ta\tb\tnan\n", "stsb", "dev",
                        r"STS-B/dev.tsv:2: score 'nan' lies outside"),
    "duplicated header column": ("QNLI", "dev.tsv", "index\tquestion\tsentence\tlabel\tlabel\n0\ta\tb\tentailment\t"
                                 "not_entailment\n", "qnli", "dev", r"QNLI/dev.tsv:1: header names column\(s\) 'label' "
                                 "more than once"),
    "duplicated text column": ("MRPC", "test.tsv", "index\t#1 ID\t#2 ID\t#1 String\t#1 String\n0\t1\t2\ta\tb\n",
                               "mrpc", "test", r"MRPC/test.tsv:1: header names column\(s\) '#1 String' more than once"),
}


@pytest.mark.parametrize("folder, name, text, task, split, message", cases(GLUE, CLEAR_ERROR, BAD_GLUE))
def test_bad_glue_files_fail_at_load_time_naming_file_line_and_column(tmp_path, folder, name, text, task, split,
                                                                      message):
    (_copy_task(tmp_path, folder) / name).write_text(text, encoding="utf-8")
    with pytest.raises(DatasetError, match=message):
        glue.read_glue(task, split, tmp_path)


def test_a_folder_without_glue_names_what_it_holds_and_the_download_command(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"GLUE rte: no train.tsv .* which holds notes.txt; accepted: the official "
                                           r"glue_data/ root holding RTE/train.tsv.*`longattn data download glue "
                                           r"--data-dir "):
        glue.find_split(glue.GLUE_TASKS.get("rte"), "train", tmp_path)
