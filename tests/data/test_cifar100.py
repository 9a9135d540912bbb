import os
import pickle

import numpy as np
import pytest
import torch

from longattn.data import DatasetError
from longattn.data import image

from cifar100_files import COARSE, FINE, _write_cifar100


def test_patches_follow_the_reference_layout():
    rng = np.random.default_rng(1)
    planar = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
    patches = image.to_patches(planar)
    assert patches.shape == (2, image.CIFAR100_TOKENS, image.CIFAR100_PATCH_DIM) == (2, 256, 12)
    pixels = planar.reshape(2, 3, 32, 32)  # channel, row, column
    for n in range(2):
        for token in (0, 1, 17, 255):
            r, c = divmod(token, 16)
            expected = [pixels[n, ch, 2 * r + dy, 2 * c + dx] for dy in range(2) for dx in range(2) for ch in range(3)]
            assert patches[n, token].tolist() == expected


def test_cifar100_splits_labels_and_collate(tmp_path):
    root = _write_cifar100(tmp_path / "cifar-100-python")
    train = image.build_cifar100("train", tmp_path, check_counts=False)
    test = image.build_cifar100("test", tmp_path / "cifar-100-python", check_counts=False)
    assert (len(train), len(test)) == (40, 10) and train.classes == [n.decode() for n in FINE]
    assert train.max_len == 256 and train.patch_dim == 12 and train.num_classes == 100
    item = train[1]
    assert item["label"] == 25 and item["patches"].shape == (256, 12) and item["patches"].dtype == torch.float32
    raw = pickle.loads((root / "train").read_bytes())[b"data"][1]
    assert torch.equal(item["patches"], torch.from_numpy(image.to_patches(raw[None])[0] / np.float32(255)))
    coarse = image.build_cifar100("train", tmp_path, label_mode="coarse", check_counts=False)
    assert coarse.num_classes == 20 and coarse[1]["label"] == 5
    folds = [image.build_cifar100("val", tmp_path, fold=k, check_counts=False) for k in range(5)]
    assert [len(f) for f in folds] == [8] * 5
    assert all(np.bincount(f.labels, minlength=100)[[0, 25, 50, 75]].tolist() == [2] * 4 for f in folds)
    assert len(image.build_cifar100("train", tmp_path, fold=0, check_counts=False)) == 32
    batch = image.collate_patches([train[0], train[1]])
    assert batch["patches"].shape == (2, 256, 12) and batch["attention_mask"].all()
    assert batch["label"].tolist() == [0, 25]


def test_cifar100_errors(tmp_path):
    with pytest.raises(DatasetError, match="missing train, meta"):
        image.build_cifar100("train", tmp_path)
    with pytest.raises(DatasetError, match="no validation set"):
        image.build_cifar100("val", tmp_path)
    _write_cifar100(tmp_path)
    with pytest.raises(DatasetError, match="50,000|50000"):
        image.build_cifar100("train", tmp_path)  # the official count is checked by default
    with pytest.raises(DatasetError, match="label_mode"):
        image.build_cifar100("train", tmp_path, label_mode="medium", check_counts=False)
    batch = pickle.loads((tmp_path / "test").read_bytes())
    batch[b"fine_labels"][0] = 100
    (tmp_path / "test").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DatasetError, match=r"outside 0..99"):
        image.build_cifar100("test", tmp_path, check_counts=False)


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_cifar100_never_runs_code_from_a_batch(tmp_path):
    _write_cifar100(tmp_path)
    (tmp_path / "meta").write_bytes(pickle.dumps({b"fine_label_names": _Payload()}, protocol=2))
    with pytest.raises(DatasetError, match="refusing"):
        image.build_cifar100("test", tmp_path, check_counts=False)


def test_paper_length_for_cifar100():
    assert image.CIFAR100_TOKENS == 256  # Singularformer: (32 / 2) x (32 / 2) tokens


def test_a_folder_without_cifar100_names_the_layout_and_the_download_command(tmp_path):
    with pytest.raises(DatasetError, match=r"which is empty; accepted: the official cifar-100-python/\{train,test,meta\}"
                                           r".*`longattn data download cifar100 --data-dir "):
        image.load_cifar100(tmp_path, "train")
