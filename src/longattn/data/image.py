"""LRA Image: CIFAR-10 as sequences of 1024 8-bit grayscale pixels (row-major), 10 classes.

Sources:
- `source="python"`: the official python batches `cifar-10-batches-py/{data_batch_1..5,test_batch}`
  (pickled dicts with b"data" uint8 [N, 3072] channel-planar RGB and b"labels").
- `source="folder"`: an image-folder tree `<split>/<class>/*.{png,jpg,jpeg}` (class ids = sorted
  class-folder names, which for CIFAR-10 is the official label order), extracted or in an archive of
  the data folder holding that tree (.tar.gz, .tgz, .tar or .zip, any name, read by content).

Grayscale as LRA (tf.image.rgb_to_grayscale, then back to uint8 as tf.image.convert_image_dtype):
g = trunc(255.5 * (0.2989 R + 0.5870 G + 0.1140 B) / 255) in float32.

Splits (LRA: train[:90%], train[90%:], test): val is the last 10% of the official training order for
the python batches; for an image folder (grouped by class) it is a seeded 10% (`split_seed`).

`noise_amplitude=a` adds uniform noise U(-a, a) to every grayscale pixel, rounds and clips to 0..255
(SKTformer Table 5). The noise of example i is drawn from a generator seeded with (noise_seed, split, i),
so it is the same in every epoch and in any access order.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .common import (DatasetError, archive_tree, check_count, check_split, class_folder_files, download_command,
                     find_first, holdout_split, no_layout_error, stratified_folds)

VOCAB_SIZE = 256
PAD_ID = 0  # pixels use every id 0..255; padding is told apart by the attention mask only
NUM_CLASSES = 10
SEQ_LEN = 1024
GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)  # tf.image.rgb_to_grayscale
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_SPLIT_CODE = {"train": 0, "val": 1, "test": 2}
BATCH_ROWS = 10_000  # every official python batch (Krizhevsky 2009): 5 x 10,000 train, 10,000 test
OFFICIAL_PER_CLASS = {"train": 5_000, "test": 1_000}


def rgb_to_gray(rgb: np.ndarray) -> np.ndarray:
    """uint8 [..., 3] RGB -> uint8 [...] gray, exactly as TensorFlow's conversion in LRA's pipeline."""
    if rgb.dtype != np.uint8 or rgb.shape[-1] != 3:
        raise DatasetError(f"expected uint8 [..., 3] RGB pixels, got {rgb.dtype} {rgb.shape}")
    unit = rgb.astype(np.float32) * np.float32(1.0 / 255.0)
    gray = unit @ GRAY_WEIGHTS
    return (gray * np.float32(255.5)).astype(np.uint8)  # float->int casts truncate, as tf.cast does


class PixelDataset(Dataset):
    """Images as flattened uint8 pixel sequences: `{"tokens": LongTensor[H*W], "label": int}`."""

    def __init__(self, pixels: np.ndarray, labels: np.ndarray, *, noise_amplitude: float = 0.0,
                 noise_seed: int = 0, split: str = "train") -> None:
        if pixels.ndim != 2 or pixels.dtype != np.uint8:
            raise DatasetError(f"pixels must be uint8 [N, L], got {pixels.dtype} {pixels.shape}")
        if len(pixels) != len(labels):
            raise DatasetError(f"{len(pixels)} images but {len(labels)} labels")
        if not noise_amplitude >= 0:
            raise DatasetError(f"noise_amplitude must be >= 0, got {noise_amplitude}")
        self.pixels = pixels
        self.labels = np.asarray(labels, dtype=np.int64)
        self.noise_amplitude = float(noise_amplitude)
        self.noise_seed = int(noise_seed)
        self.split_code = _SPLIT_CODE[split]
        self.pad_id = PAD_ID
        self.vocab_size = VOCAB_SIZE
        self.max_len = pixels.shape[1]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} examples")
        row = self.pixels[index]
        if self.noise_amplitude > 0:
            rng = np.random.default_rng([self.noise_seed, self.split_code, index])
            noisy = row.astype(np.float64) + rng.uniform(-self.noise_amplitude, self.noise_amplitude, row.shape)
            row = np.clip(np.rint(noisy), 0, 255)
        return {"tokens": torch.from_numpy(row.astype(np.int64)), "label": int(self.labels[index])}


# ----------------------------------------------------------------------------- official python batches

class _ArrayUnpickler(pickle.Unpickler):
    """Reads a python batch without running code from it: pickle can call any importable
    function, so only the numpy constructors of arrays, scalars and (non-object) dtypes resolve;
    any other global (os.system, eval, ...) is an error before anything is called."""

    _ARRAYS = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"), ("_codecs", "encode"),
    }
    _DTYPED = {("numpy", "dtype"), ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")}

    def find_class(self, module: str, name: str):  # noqa: ANN201 (pickle's protocol)
        if (module, name) in self._ARRAYS:
            return super().find_class(module, name)
        if (module, name) in self._DTYPED:
            build = super().find_class(module, name)
            return lambda dtype, *args: build(_plain_dtype(dtype), *args)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a CIFAR batch holds only arrays")


def _plain_dtype(dtype: object) -> object:
    """Object arrays could hold anything: only numeric / bytes dtypes are accepted."""
    if (isinstance(dtype, np.dtype) and dtype.hasobject) or (isinstance(dtype, str) and dtype.startswith("O")):
        raise pickle.UnpicklingError("refusing an object dtype: a CIFAR batch holds only numbers")
    return dtype


def _read_python_batch(path: Path, what: str = "CIFAR python file") -> dict:
    """The dict stored in one official CIFAR python file (CIFAR-10 batch, CIFAR-100 train/test/meta),
    read by the restricted unpickler: no code runs from the file."""
    try:
        with open(path, "rb") as handle:
            batch = _ArrayUnpickler(handle, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, ImportError) as error:
        raise DatasetError(f"{path}: not a {what} ({error})") from error
    if not isinstance(batch, dict):
        raise DatasetError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    return batch


def _batch_arrays(batch: dict, path: Path, label_key: bytes, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Validated uint8 [N, 3072] planar pixels and int64 labels (0..num_classes-1) of a python batch."""
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(label_key, batch.get(label_key.decode()))
    if data is None or labels is None:
        raise DatasetError(f"{path}: missing b'data' or {label_key!r} (keys: {sorted(map(str, batch))})")
    data = np.asarray(data)
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as error:
        raise DatasetError(f"{path}: {label_key!r} must be integers ({error})") from error
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * SEQ_LEN or len(data) != len(labels):
        raise DatasetError(f"{path}: b'data' must be uint8 [N, 3072] with N labels, got {data.dtype} "
                           f"{data.shape} and {len(labels)} labels")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DatasetError(f"{path}: {label_key.decode()} outside 0..{num_classes - 1}")
    return data, labels


def _unpickle_batch(path: Path, check_counts: bool = True) -> tuple[np.ndarray, np.ndarray]:
    data, labels = _batch_arrays(_read_python_batch(path, "CIFAR-10 python batch"), path, b"labels", NUM_CLASSES)
    check_count(str(path), "this batch", {"rows": len(labels)}, {"rows": BATCH_ROWS}, check_counts)
    return data, labels


def load_python_batches(data_dir: str | Path, subset: str, check_counts: bool = True
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Gray pixels [N, 1024] and labels of the official `train` (5 batches, in order) or `test` batch,
    read without unpickling code (only arrays); each batch must hold 10,000 rows unless not
    ``check_counts``."""
    planar, labels = load_python_batches_rgb(data_dir, subset, check_counts)
    rgb = planar.reshape(-1, 3, SEQ_LEN).transpose(0, 2, 1)  # planar -> [N, 1024, 3]
    return rgb_to_gray(np.ascontiguousarray(rgb)), labels


def load_python_batches_rgb(data_dir: str | Path, subset: str, check_counts: bool = True
                            ) -> tuple[np.ndarray, np.ndarray]:
    """uint8 channel-planar RGB [N, 3072] and labels of the official CIFAR-10 python batches."""
    root = Path(data_dir)
    folder = root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root
    names = [f"data_batch_{i}" for i in range(1, 6)] if subset == "train" else ["test_batch"]
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise DatasetError(f"CIFAR-10: missing {', '.join(missing)} in {folder} "
                           "(expected the official cifar-10-batches-py/ folder)")
    datas, labels = zip(*(_unpickle_batch(folder / name, check_counts) for name in names))
    return np.concatenate(datas), np.concatenate(labels)


# ----------------------------------------------------------------------------- image folders

def _decode_image(data: bytes | Path, where: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as image:
            rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError) as error:
        raise DatasetError(f"{where}: cannot decode image ({error})") from error
    return rgb


def _gray_sequence(rgb: np.ndarray, where: str, image_size: int) -> np.ndarray:
    if rgb.shape[:2] != (image_size, image_size):
        raise DatasetError(f"{where}: expected a {image_size}x{image_size} image, got {rgb.shape[1]}x{rgb.shape[0]}")
    return rgb_to_gray(rgb).reshape(-1)


def _planar_rgb(rgb: np.ndarray, where: str, image_size: int) -> np.ndarray:
    if rgb.shape[:2] != (image_size, image_size):
        raise DatasetError(f"{where}: expected a {image_size}x{image_size} image, got {rgb.shape[1]}x{rgb.shape[0]}")
    return rgb.transpose(2, 0, 1).reshape(-1)  # channel-planar, the python batches' layout


def _collect(entries: list[tuple[str, str, object]], where: str, image_size: int,
             classes: list[str] | None, pixels_of=_gray_sequence) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """entries: (class name, file name, bytes or Path). Sorted by (class, file) for a stable order.
    ``pixels_of(rgb, where, image_size)`` makes one image's row (default: LRA's gray sequence)."""
    if not entries:
        raise DatasetError(f"no images (*.png, *.jpg) found under {where}; expected <split>/<class>/<image>")
    entries.sort(key=lambda entry: (entry[0], entry[1]))
    names = classes or sorted({entry[0] for entry in entries})
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted({entry[0] for entry in entries} - set(index))
    if unknown:
        raise DatasetError(f"{where}: class folders {unknown} are not among the training classes {names}")
    pixels = np.stack([pixels_of(_decode_image(data, f"{where}/{cls}/{name}"), f"{where}/{cls}/{name}",
                                 image_size) for cls, name, data in entries])
    labels = np.array([index[cls] for cls, _, _ in entries], dtype=np.int64)
    return pixels, labels, names


def _folder_entries(folder: Path) -> list[tuple[str, str, object]]:
    return class_folder_files(folder, IMAGE_SUFFIXES)


def _archive_entries(data_dir: Path, subset: str) -> tuple[list[tuple[str, str, object]], str] | None:
    """(class, file name, bytes) of the `<subset>/<class>/<image>` members of the first archive of data_dir that
    has any (.tar.gz, .tgz, .tar or .zip, read by content), and the archive; None if none has."""
    found = archive_tree(data_dir, re.compile(rf"(?:^|/){subset}/([^/]+)/([^/]+)$"), subset)
    if found is None:
        return None
    archive, members = found
    entries = [(match.group(1), match.group(2), data) for match, data in members
               if Path(match.group(2)).suffix.lower() in IMAGE_SUFFIXES]
    return entries, str(archive)


def _subset_entries(data_dir: Path, subset: str) -> tuple[list[tuple[str, str, object]], str]:
    folder = data_dir / subset
    if folder.is_dir():
        return _folder_entries(folder), str(folder)
    found = _archive_entries(data_dir, subset)
    if found is not None:
        return found
    suffixes = "|".join(suffix.lstrip(".") for suffix in IMAGE_SUFFIXES)
    raise no_layout_error(f"image folder ({subset})", data_dir,
                          [f"{subset}/<class>/*.{suffixes} as a folder",
                           "the same tree in a .tar.gz, .tgz, .tar or .zip"],
                          download_command("cifar10", data_dir))


def load_image_folder(data_dir: str | Path, subset: str, image_size: int = 32, check_counts: bool = True,
                      rgb: bool = False) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Gray pixels (``rgb``: channel-planar RGB, [N, 3 * S * S]), labels and class names of
    `<data_dir>/<subset>/<class>/*` (or its tar.gz); with ``check_counts`` each class must have
    CIFAR-10's official count (5,000 train, 1,000 test)."""
    root = Path(data_dir)
    classes = None
    if subset != "train":  # label ids must match training: take class names from the train tree when present
        try:
            train_entries, _ = _subset_entries(root, "train")
            classes = sorted({entry[0] for entry in train_entries}) or None
        except DatasetError:
            classes = None
    entries, where = _subset_entries(root, subset)
    pixels, labels, names = _collect(entries, where, image_size, classes, _planar_rgb if rgb else _gray_sequence)
    per_class = np.bincount(labels, minlength=NUM_CLASSES)
    check_count(where, repr(subset), dict(zip(names, per_class.tolist())),
                {name: OFFICIAL_PER_CLASS[subset] for name in names} if len(names) == NUM_CLASSES
                else {f"{NUM_CLASSES} classes": OFFICIAL_PER_CLASS[subset]}, check_counts)
    return pixels, labels, names


def build_image(split: str, data_dir: str | Path | None = None, *, source: str | None = None,
                noise_amplitude: float = 0.0, noise_seed: int = 0, val_fraction: float = 0.1,
                split_seed: int = 0, check_counts: bool = True) -> PixelDataset:
    """CIFAR-10 gray pixel sequences for `split` from the python batches or an image folder.

    check_counts=False accepts fewer images than CIFAR-10's official counts (a deliberate subset).

    source=None picks "python" when `cifar-10-batches-py/` (or its files) is in data_dir, else "folder".
    """
    check_split(split)
    if data_dir is None:
        raise DatasetError("image (CIFAR-10) needs data_dir: cifar-10-batches-py/ or <split>/<class>/*.jpg|png")
    root = Path(data_dir)
    if source is None:
        source = "python" if find_first(root, ["cifar-10-batches-py/test_batch", "test_batch"]) else "folder"
    if source not in ("python", "folder"):
        raise DatasetError(f"source must be 'python' or 'folder', got {source!r}")
    subset = "test" if split == "test" else "train"
    if source == "python":
        pixels, labels = load_python_batches(root, subset, check_counts)
        holdout_seed = None  # official order: val = last 10% of train, as LRA's train[90%:]
    else:
        pixels, labels, _ = load_image_folder(root, subset, check_counts=check_counts)
        holdout_seed = split_seed
    if split != "test":
        chosen = holdout_split(len(labels), split, val_fraction, holdout_seed)
        pixels, labels = pixels[chosen], labels[chosen]
    return PixelDataset(np.ascontiguousarray(pixels), labels, noise_amplitude=noise_amplitude,
                        noise_seed=noise_seed, split=split)


# ----------------------------------------------------------------------------- CIFAR-100 as 2x2 patches

CIFAR100_ROWS = {"train": 50_000, "test": 10_000}  # the official files (Krizhevsky 2009)
CIFAR100_PATCH = 2  # Singularformer section 4.1: each 2x2 pixel patch is one token
CIFAR100_TOKENS = (32 // CIFAR100_PATCH) ** 2  # 256, the paper's maximum length for CIFAR 100
CIFAR100_PATCH_DIM = CIFAR100_PATCH * CIFAR100_PATCH * 3  # 12 values: (dy, dx, channel)
CIFAR100_LABEL_KEYS = {"fine": (b"fine_labels", b"fine_label_names", 100),
                       "coarse": (b"coarse_labels", b"coarse_label_names", 20)}


def to_patches(planar: np.ndarray, patch: int = CIFAR100_PATCH, image_size: int = 32) -> np.ndarray:
    """uint8 [N, 3 * S * S] channel-planar images (the python batches' layout) -> uint8 [N, (S/p)^2, p*p*3]:
    patches in row-major order, each patch's values ordered (dy, dx, channel)."""
    grid = image_size // patch
    images = planar.reshape(-1, 3, grid, patch, grid, patch)  # N, C, row, dy, col, dx
    return np.ascontiguousarray(images.transpose(0, 2, 4, 3, 5, 1)).reshape(-1, grid * grid, patch * patch * 3)


class PatchDataset(Dataset):
    """Images as sequences of patch vectors: ``{"patches": FloatTensor[T, D] in [0, 1], "label": int}``."""

    def __init__(self, patches: np.ndarray, labels: np.ndarray, classes: list[str]) -> None:
        if patches.ndim != 3 or patches.dtype != np.uint8 or len(patches) != len(labels):
            raise DatasetError(f"patches must be uint8 [N, T, D] with N labels, got {patches.dtype} "
                               f"{patches.shape} and {len(labels)} labels")
        self.patches = patches
        self.labels = np.asarray(labels, dtype=np.int64)
        self.classes = classes
        self.num_classes = len(classes)
        self.max_len = patches.shape[1]
        self.patch_dim = patches.shape[2]

    def __len__(self) -> int:
        return len(self.labels)

    def lengths(self) -> np.ndarray:
        """Tokens per image: all equal (length-grouped batching then keeps the shuffled order)."""
        return np.full(len(self), self.max_len)

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} examples")
        patches = torch.from_numpy(self.patches[index].astype(np.float32) / 255.0)
        return {"patches": patches, "label": int(self.labels[index])}


def collate_patches(items: Sequence[dict]) -> dict[str, torch.Tensor]:
    """{"patches": Float[B, T, D], "attention_mask": bool[B, T] (all True), "label": Long[B]}."""
    if not items:
        raise DatasetError("collate: empty batch")
    patches = torch.stack([item["patches"] for item in items])
    return {"patches": patches, "attention_mask": torch.ones(patches.shape[:2], dtype=torch.bool),
            "label": torch.tensor([item["label"] for item in items], dtype=torch.long)}


def load_cifar100(data_dir: str | Path, subset: str, label_mode: str = "fine", check_counts: bool = True
                  ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """uint8 [N, 3072] planar pixels, labels and class names of the official `train` or `test` file
    (50,000 / 10,000 images unless not `check_counts`)."""
    if label_mode not in CIFAR100_LABEL_KEYS:
        raise DatasetError(f"label_mode must be 'fine' or 'coarse', got {label_mode!r}")
    label_key, names_key, num_classes = CIFAR100_LABEL_KEYS[label_mode]
    root = Path(data_dir)
    folder = root / "cifar-100-python" if (root / "cifar-100-python").is_dir() else root
    missing = [name for name in (subset, "meta") if not (folder / name).is_file()]
    if missing:
        raise no_layout_error(f"CIFAR-100: missing {', '.join(missing)} in {folder}", root,
                              ["the official cifar-100-python/{train,test,meta}", "{train,test,meta} directly"],
                              download_command("cifar100", root))
    path = folder / subset
    data, labels = _batch_arrays(_read_python_batch(path), path, label_key, num_classes)
    check_count(str(path), f"CIFAR-100 {subset}", {"images": len(labels)}, {"images": CIFAR100_ROWS[subset]},
                check_counts)
    meta = _read_python_batch(folder / "meta")
    names = meta.get(names_key)
    if names is None or len(names) != num_classes:
        raise DatasetError(f"{folder / 'meta'}: expected {num_classes} names under {names_key!r}")
    return data, labels, [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def build_cifar100(split: str, data_dir: str | Path | None = None, *, label_mode: str = "fine",
                   fold: int | None = None, num_folds: int = 5, seed: int = 0, check_counts: bool = True
                   ) -> PatchDataset:
    """CIFAR-100 as 256 tokens of 2x2x3 pixels (Singularformer). `fold=k`: train/val are the other folds
    and fold k of a stratified K-fold split of the official training set (the paper's 5-fold CV)."""
    check_split(split)
    if data_dir is None:
        raise DatasetError("CIFAR-100 needs data_dir: the folder holding cifar-100-python/ (download it with "
                           f"`{download_command('cifar100', 'DIR')}`)")
    if split == "val" and fold is None:
        raise DatasetError("CIFAR-100 has no validation set: pass fold=k for fold k of the cross-validation")
    data, labels, classes = load_cifar100(data_dir, "test" if split == "test" else "train", label_mode, check_counts)
    data, labels = _fold_part(data, labels, split, fold, num_folds, seed)
    return PatchDataset(to_patches(data), labels, classes)


def _fold_part(data: np.ndarray, labels: np.ndarray, split: str, fold: int | None, num_folds: int, seed: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Fold ``fold`` of a stratified K-fold split of the training set (val) or the other folds (train);
    the folds split the training set only, the test set stays whole."""
    if fold is None or split == "test":
        return data, labels
    train_index, val_index = stratified_folds(labels, num_folds, seed)[fold]
    chosen = val_index if split == "val" else train_index
    return data[chosen], labels[chosen]


# ----------------------------------------------------------------------------- CIFAR-10 as 2x2 patches

# the official label order of the python batches (batches.meta), also the sorted class-folder names
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

def load_cifar10_rgb(data_dir: str | Path, subset: str, check_counts: bool = True
                     ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """uint8 [N, 3072] channel-planar RGB pixels, labels and class names of CIFAR-10 ``subset`` ("train"
    or "test"), from the python batches or an image folder / its tar.gz."""
    root = Path(data_dir)
    if find_first(root, ["cifar-10-batches-py/test_batch", "test_batch"]):
        pixels, labels = load_python_batches_rgb(root, subset, check_counts)
        return pixels, labels, CIFAR10_CLASSES
    return load_image_folder(root, subset, check_counts=check_counts, rgb=True)


def build_cifar10_patches(split: str, data_dir: str | Path | None = None, *, fold: int | None = None,
                          num_folds: int = 5, seed: int = 0, check_counts: bool = True) -> PatchDataset:
    """CIFAR-10 as 256 tokens of 2x2x3 pixels, the layout of Singularformer's CIFAR-100 (a stand-in where
    CIFAR-100 is absent). ``fold=k``: train/val are the other folds and fold k of a stratified K-fold split
    of the official training set; the test set stays whole."""
    check_split(split)
    if data_dir is None:
        raise DatasetError("CIFAR-10 needs data_dir: cifar-10-batches-py/ or <split>/<class>/*.jpg|png (or tar.gz)")
    if split == "val" and fold is None:
        raise DatasetError("CIFAR-10 patches have no validation set: pass fold=k for fold k of the cross-validation")
    data, labels, classes = load_cifar10_rgb(data_dir, "test" if split == "test" else "train", check_counts)
    data, labels = _fold_part(data, labels, split, fold, num_folds, seed)
    return PatchDataset(to_patches(data), labels, classes)
