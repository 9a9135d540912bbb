"""CIFAR-100 files in the official python layout, for tests (data, tasks)."""

import pickle

import numpy as np

FINE = [f"fine{i:02d}".encode() for i in range(100)]
COARSE = [f"coarse{i:02d}".encode() for i in range(20)]


def _write_cifar100(folder, train_rows=40, test_rows=10, seed=0):
    """The official cifar-100-python/{train,test,meta} layout: pickled dicts with bytes keys."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        fine = (np.arange(rows) % 4 * 25).tolist()  # 4 fine classes, 10 images each in train
        batch = {b"filenames": [f"img_{i}.png".encode() for i in range(rows)],
                 b"batch_label": f"{name} batch 1 of 1".encode(),
                 b"fine_labels": fine, b"coarse_labels": [label // 5 for label in fine],
                 b"data": rng.integers(0, 256, (rows, 3072), dtype=np.uint8)}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {b"fine_label_names": FINE, b"coarse_label_names": COARSE}
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder
