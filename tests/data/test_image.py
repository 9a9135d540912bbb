import io
import pickle
import tarfile
import zipfile

import numpy as np
import pytest
from PIL import Image

from longattn.data import DatasetError, build_dataset
from longattn.data import image


def _batch(rng, n, path):
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = list(rng.integers(0, 10, n))
    with open(path, "wb") as handle:
        pickle.dump({b"data": data, b"labels": labels, b"batch_label": b"x"}, handle)
    return data, labels


def _python_batches(root):
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    train = [_batch(rng, 4, folder / f"data_batch_{i}") for i in range(1, 6)]
    test = _batch(rng, 3, folder / "test_batch")
    return train, test


def test_grayscale_formula_matches_tensorflow_conversion():
    rgb = np.array([[255, 255, 255], [0, 0, 0], [255, 0, 0], [0, 255, 0], [0, 0, 255], [10, 200, 30]], np.uint8)
    # trunc(255.5 * (0.2989 R + 0.5870 G + 0.1140 B) / 255), computed independently in float64
    expected = [int(255.5 * (0.2989 * r + 0.5870 * g + 0.1140 * b) / 255.0) for r, g, b in rgb.tolist()]
    assert image.rgb_to_gray(rgb).tolist() == expected == [255, 0, 76, 149, 29, 124]


def test_python_batches_layout_and_splits(tmp_path):
    train, test = _python_batches(tmp_path)
    ds_train = build_dataset("image", "train", data_dir=str(tmp_path), check_counts=False)
    ds_val = build_dataset("image", "val", data_dir=str(tmp_path), check_counts=False)
    ds_test = build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False)
    assert (len(ds_train), len(ds_val), len(ds_test)) == (18, 2, 3)  # 20 train -> 90/10, last 10% is val
    data, labels = test
    item = ds_test[1]
    rgb = data[1].reshape(3, 32, 32).transpose(1, 2, 0)  # planar R, G, B rows
    assert item["tokens"].shape == (1024,) and item["tokens"].dtype.is_floating_point is False
    assert item["tokens"].tolist() == image.rgb_to_gray(rgb).reshape(-1).tolist()
    assert item["label"] == labels[1]
    last_train_data, last_train_labels = train[-1]
    assert ds_val[1]["label"] == last_train_labels[-1]
    assert ds_train[0]["label"] == train[0][1][0]


def test_noise_is_deterministic_bounded_and_per_example(tmp_path):
    _python_batches(tmp_path)
    clean = build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False)
    noisy = build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False, noise_amplitude=8)
    again = build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False, noise_amplitude=8)
    other_seed = build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False, noise_amplitude=8,
                               noise_seed=1)
    a, b = noisy[0]["tokens"], noisy[0]["tokens"]
    assert a.tolist() == b.tolist() == again[0]["tokens"].tolist()  # same every access
    assert a.tolist() != other_seed[0]["tokens"].tolist()
    assert noisy[0]["tokens"].tolist() != noisy[1]["tokens"].tolist()
    diff = (a - clean[0]["tokens"]).abs()
    assert diff.max() <= 8 and diff.float().mean() > 1
    assert a.min() >= 0 and a.max() <= 255
    with pytest.raises(DatasetError):
        build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False, noise_amplitude=-1)


def _png(value, mode="RGB"):
    buffer = io.BytesIO()
    Image.new(mode, (32, 32), value).save(buffer, format="PNG")
    return buffer.getvalue()


def test_image_folder_and_tarball(tmp_path):
    tree = tmp_path / "tree"
    for split, count in (("train", 10), ("test", 2)):
        for cls, colour in (("cat", (200, 10, 10)), ("airplane", (0, 0, 0))):
            (tree / split / cls).mkdir(parents=True)
            for i in range(count):
                (tree / split / cls / f"{i:04d}.png").write_bytes(_png(colour))
    test = build_dataset("image", "test", data_dir=str(tree), check_counts=False)
    assert len(test) == 4
    assert sorted(test[i]["label"] for i in range(4)) == [0, 0, 1, 1]  # airplane = 0, cat = 1 (sorted)
    black = [test[i] for i in range(4) if test[i]["label"] == 0][0]
    assert black["tokens"].tolist() == [0] * 1024  # black pixels are real tokens, not padding
    train = build_dataset("image", "train", data_dir=str(tree), check_counts=False)
    val = build_dataset("image", "val", data_dir=str(tree), check_counts=False)
    assert (len(train), len(val)) == (18, 2)
    # the same tree as tar.gz archives named like the shared copy
    archives = tmp_path / "archives"
    archives.mkdir()
    for split in ("train", "test"):
        with tarfile.open(archives / f"cifar10_{split}_jpg.tar.gz", "w:gz") as tar:
            tar.add(tree / split, arcname=split)
    from_tar = build_dataset("image", "test", data_dir=str(archives), check_counts=False)
    assert [from_tar[i]["tokens"].tolist() for i in range(4)] == [test[i]["tokens"].tolist() for i in range(4)]
    # one zip holding both trees, under a name that says neither split: read by content
    packed = tmp_path / "packed"
    packed.mkdir()
    with zipfile.ZipFile(packed / "cifar_mirror.zip", "w") as handle:
        for file in sorted(tree.rglob("*.png")):
            handle.write(file, str(file.relative_to(tree)))
    from_zip = build_dataset("image", "test", data_dir=str(packed), check_counts=False)
    assert [from_zip[i]["tokens"].tolist() for i in range(4)] == [test[i]["tokens"].tolist() for i in range(4)]


def test_image_errors(tmp_path):
    with pytest.raises(DatasetError, match="needs data_dir"):
        build_dataset("image", "train")
    with pytest.raises(DatasetError, match="test_batch|tar.gz"):
        build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "test_batch").write_bytes(b"garbage")
    with pytest.raises(DatasetError, match="not a CIFAR-10 python batch"):
        build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False)
    with open(folder / "test_batch", "wb") as handle:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, handle)
    with pytest.raises(DatasetError, match=r"\[N, 3072\]"):
        build_dataset("image", "test", data_dir=str(tmp_path), check_counts=False)
    bad = tmp_path / "tree" / "test" / "cat"
    bad.mkdir(parents=True)
    (bad / "x.png").write_bytes(_png((1, 2, 3))[:20])
    with pytest.raises(DatasetError, match="cannot decode"):
        build_dataset("image", "test", data_dir=str(tmp_path / "tree"), check_counts=False, source="folder")


def test_shared_cifar_jpeg_copy(shared_data):
    folder = shared_data / "cifar10"
    if not folder.is_dir():
        pytest.skip("no cifar10/ in the shared data folder")
    ds = build_dataset("image", "test", data_dir=str(folder))
    assert len(ds) == 10_000
    assert np.bincount(ds.labels, minlength=10).tolist() == [1000] * 10
    assert ds[0]["tokens"].shape == (1024,)


def test_cifar10_as_patches_from_python_batches_and_folder(tmp_path):
    (tmp_path / "py").mkdir()
    train, test = _python_batches(tmp_path / "py")
    ds = image.build_cifar10_patches("test", str(tmp_path / "py"), check_counts=False)
    assert len(ds) == 3 and ds.max_len == 256 and ds.patch_dim == 12 and ds.classes[0] == "airplane"
    planar = test[0][1]  # second image, channel-planar [3072]
    patches = ds[1]["patches"]
    assert patches.shape == (256, 12)
    # token 17 is the patch at row 1, col 1: pixels (2..3, 2..3), values ordered (dy, dx, channel)
    expected = [planar[c * 1024 + (2 + dy) * 32 + 2 + dx] / 255 for dy in range(2) for dx in range(2) for c in range(3)]
    assert patches[17].tolist() == pytest.approx(expected)
    folds = [image.build_cifar10_patches("val", str(tmp_path / "py"), fold=k, check_counts=False) for k in range(5)]
    assert sum(len(f) for f in folds) == 20
    assert len(image.build_cifar10_patches("train", str(tmp_path / "py"), fold=0, check_counts=False)) == 20 - len(folds[0])
    with pytest.raises(DatasetError, match="fold=k"):
        image.build_cifar10_patches("val", str(tmp_path / "py"), check_counts=False)
    # an image folder: a red image's patches hold (1, 0, 0) per pixel
    tree = tmp_path / "tree"
    for split in ("train", "test"):
        for cls, colour in (("cat", (255, 0, 0)), ("airplane", (0, 0, 0))):
            (tree / split / cls).mkdir(parents=True)
            (tree / split / cls / "0.png").write_bytes(_png(colour))
    red = image.build_cifar10_patches("test", str(tree), check_counts=False)
    assert red.classes == ["airplane", "cat"] and red.labels.tolist() == [0, 1]
    assert red[1]["patches"][0].tolist() == [1.0, 0.0, 0.0] * 4
