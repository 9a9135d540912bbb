import pytest
import torch

from longattn.data import LRA_TASKS, DatasetError, build_dataset, collate, get_task


def test_task_table():
    assert set(LRA_TASKS) == {"listops", "text", "retrieval", "image", "pathfinder"}
    assert (get_task("listops").num_classes, get_task("listops").max_len) == (10, 2000)
    assert (get_task("text").vocab_size, get_task("text").max_len) == (257, 4096)
    assert get_task("retrieval").dual and get_task("retrieval").max_len == 4000
    for name in ("image", "pathfinder"):
        task = get_task(name)
        assert (task.vocab_size, task.max_len, task.dual) == (256, 1024, False)
    assert get_task("image").num_classes == 10 and get_task("pathfinder").num_classes == 2
    for name in ("listops", "text", "retrieval"):  # byte/symbol tasks keep padding out of the data's ids
        assert get_task(name).pad_id == get_task(name).vocab_size - 1
    with pytest.raises(DatasetError, match="unknown LRA task"):
        get_task("mnist")


def test_collate_single_with_explicit_mask():
    items = [{"tokens": torch.tensor([0, 0, 3]), "label": 1}, {"tokens": torch.tensor([5]), "label": 0}]
    batch = collate(items)
    assert batch["tokens"].dtype == torch.long and batch["attention_mask"].dtype == torch.bool
    assert batch["tokens"].tolist() == [[0, 0, 3], [5, 0, 0]]
    assert batch["attention_mask"].tolist() == [[True, True, True], [True, False, False]]  # zeros stay real
    assert batch["label"].tolist() == [1, 0]
    wide = collate(items, pad_to=6, pad_id=17)
    assert wide["tokens"].shape == (2, 6) and wide["tokens"][1, 1:].eq(17).all()
    assert wide["attention_mask"].sum().item() == 4
    with pytest.raises(DatasetError, match="pad_to=2"):
        collate(items, pad_to=2)
    with pytest.raises(DatasetError, match="empty"):
        collate([])


def test_collate_dual():
    items = [{"tokens0": torch.tensor([1, 2]), "tokens1": torch.tensor([3]), "label": 1},
             {"tokens0": torch.tensor([4]), "tokens1": torch.tensor([5, 6, 7]), "label": 0}]
    batch = collate(items)
    assert batch["tokens0"].shape == (2, 2) and batch["tokens1"].shape == (2, 3)
    assert batch["attention_mask1"].tolist() == [[True, False, False], [True, True, True]]
    assert batch["label"].tolist() == [1, 0]


def test_dispatch_and_option_errors():
    ds = build_dataset("listops", "test", num_examples=20, min_length=10, max_length=40)
    assert len(ds) == 20  # no data folder: generated
    with pytest.raises(DatasetError, match="unexpected keyword"):
        build_dataset("listops", "train", num_exmples=5)
    with pytest.raises(DatasetError, match="unknown split"):
        build_dataset("listops", "dev", num_examples=5)
    with pytest.raises(DatasetError, match="aclImdb"):
        build_dataset("text", "train")
    with pytest.raises(DatasetError, match="new_aan_pairs"):
        build_dataset("retrieval", "val")
    with pytest.raises(DatasetError, match="cifar-10-batches-py"):
        build_dataset("image", "train")


@pytest.mark.parametrize("task, layout", [("listops", "basic_{train,val,test}.tsv (header Source<TAB>Target)"),
                                          ("pathfinder", "curv_contour_length_14/metadata/*.npy")])
def test_a_data_folder_without_the_release_names_its_layouts_instead_of_generating(tmp_path, task, layout):
    for folder, expected in ((tmp_path / "empty", "is empty"), (tmp_path / "other", "holds notes.txt, photos/"),
                             (tmp_path / "missing", "does not exist")):
        if expected != "does not exist":
            folder.mkdir()
        if expected.startswith("holds"):
            (folder / "notes.txt").write_text("x")
            (folder / "photos").mkdir()
        with pytest.raises(DatasetError) as error:
            build_dataset(task, "train", data_dir=str(folder))
        message = str(error.value)
        assert f"no usable data in {folder}, which {expected}; accepted: " in message and layout in message
        assert "lra_release/lra_release/" in message and "no --data-dir): the " in message
        assert message.endswith(f"`longattn data download lra_release --data-dir {folder} --allow-unverified`")


def test_the_unpacked_release_layout_is_found(tmp_path):
    nested = tmp_path / "lra_release" / "lra_release"
    (nested / "listops-1000").mkdir(parents=True)
    (nested / "listops-1000" / "basic_val.tsv").write_text("Source\tTarget\n( ( [MAX 1 ) 2 ) ] )\t2\n")
    (nested / "tsv_data").mkdir()
    (nested / "tsv_data" / "new_aan_pairs.eval.tsv").write_text("1\ta\tb\txy\tz\n")
    assert build_dataset("listops", "val", data_dir=str(tmp_path))[0]["label"] == 2
    assert build_dataset("retrieval", "val", data_dir=str(tmp_path))[0]["tokens0"].tolist() == [120, 121]
    with pytest.raises(DatasetError, match="ListOps: no basic_train.tsv: no usable data in .*accepted: basic_"):
        build_dataset("listops", "train", data_dir=str(tmp_path))
    (nested / "pathfinder32" / "curv_baseline").mkdir(parents=True)
    with pytest.raises(DatasetError, match=r"Pathfinder: no curv_contour_length_14/ \(it has curv_baseline; option "
                                           r"difficulty picks one\): no usable data in "):
        build_dataset("pathfinder", "train", data_dir=str(tmp_path))


def test_dataloader_round_trip():
    ds = build_dataset("listops", "train", num_examples=16, min_length=10, max_length=60, seed=2)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, collate_fn=collate)
    batches = list(loader)
    assert len(batches) == 2
    lengths = [len(ds[i]["tokens"]) for i in range(8)]
    assert batches[0]["attention_mask"].sum(1).tolist() == lengths


def test_cache_dir_reuses_and_keys_on_options(tmp_path, capsys):
    kwargs = dict(num_examples=8, min_length=10, max_length=40, seed=1)
    first = build_dataset("listops", "train", cache_dir=tmp_path, **kwargs)
    files = list(tmp_path.glob("listops-train-*.pkl"))
    assert len(files) == 1
    again = build_dataset("listops", "train", cache_dir=tmp_path, **kwargs)
    assert [again[i]["tokens"].tolist() for i in range(8)] == [first[i]["tokens"].tolist() for i in range(8)]
    files[0].write_bytes(b"")  # prove the calls read the cache: a damaged file is noticed, then rebuilt
    capsys.readouterr()
    rebuilt = build_dataset("listops", "train", cache_dir=tmp_path, **kwargs)
    assert f"{files[0]} is damaged" in capsys.readouterr().err
    assert [rebuilt[i]["tokens"].tolist() for i in range(8)] == [first[i]["tokens"].tolist() for i in range(8)]
    assert files[0].stat().st_size > 0
    build_dataset("listops", "train", cache_dir=tmp_path, **{**kwargs, "seed": 2})
    assert len(list(tmp_path.glob("listops-train-*.pkl"))) == 2
