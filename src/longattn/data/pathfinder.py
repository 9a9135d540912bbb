"""LRA Pathfinder (Linsley et al. 2018; Kim et al. 2020) at 32x32: are the two dots joined by a path?

Generator (vectorised NumPy, re-implemented from the task's description): every image has two main
dashed contours of `contour_length` paddles (a paddle is a `paddle_length` px stroke followed by a
`gap` px gap, each paddle turning by at most `max_turn_degrees` from the last) and short distractor
contours. A positive image puts a dot (radius `marker_radius`) on both ends of the same main contour,
a negative one on one end of each main contour, so both classes show the same strokes and dots and
only connectivity tells them apart. Main contours keep `min_separation` px from each other and
distractors keep it from both. Drawn at `supersample`x resolution and box-filtered (anti-aliasing),
as LRA's images are. LRA's pathfinder32 "hard" set used contour_length 14, paddle length 2, margin 1,
marker radius 1.5, distractor length 14 // 3 and 20 // that many distractors: these are the defaults.

Loader for the official release: `<root>/curv_contour_length_14/metadata/*.npy` are *text* files
(despite the suffix), one image a line, space separated: `imgs/<k> sample_<j>.png <i> <label> ...`;
field 0/1 give the image path relative to the difficulty folder, field 3 the label. Images are 32x32
8-bit grayscale PNGs. Splits: metadata files in numeric order, lines in file order, then 80/10/10
contiguous (LRA's TFDS `[:80%]`, `[80%:90%]`, `[90%:]`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .common import DatasetError, check_split, download_command, find_first, no_layout_error
from .image import PixelDataset

VOCAB_SIZE = 256
PAD_ID = 0
NUM_CLASSES = 2
LRA_SPLIT_SIZES = {"train": 160_000, "val": 20_000, "test": 20_000}  # 200k images, 80/10/10
_SPLIT_CODE = {"train": 0, "val": 1, "test": 2}
_SPLIT_RANGES = {"train": (0.0, 0.8), "val": (0.8, 0.9), "test": (0.9, 1.0)}
_CHUNK = 512
_SECOND_ATTEMPTS = 3


_GRID = 1  # occupancy grid cells per pixel, for the separation checks


def _stamp(grid: np.ndarray, owner: np.ndarray, points: np.ndarray, disc: np.ndarray) -> None:
    """Mark grid[owner[i]] cells within the disc around points[i] [n, P, 2] (pixel coordinates)."""
    size = grid.shape[-1]
    cells = np.floor(points * _GRID).astype(np.int64)[:, :, None, :] + disc[None, None]  # [n, P, D, 2]
    x, y = cells[..., 0], cells[..., 1]
    valid = (x >= 0) & (x < size) & (y >= 0) & (y < size)
    flat = (owner[:, None, None] * size + y) * size + x
    grid.reshape(-1)[flat[valid]] = True


def _hits(grid: np.ndarray, owner: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Whether any of points [n, T, P, 2] falls on a marked cell of grid[owner[i]]: [n, T]."""
    size = grid.shape[-1]
    cells = np.clip(np.floor(points * _GRID).astype(np.int64), 0, size - 1)
    flat = (owner[:, None, None] * size + cells[..., 1]) * size + cells[..., 0]
    return grid.reshape(-1)[flat].any(axis=-1)


def _walks(rng: np.random.Generator, count: int, paddles: int, *, size: int, paddle_length: float, gap: float,
           max_turn: float, margin: float, min_separation: float, lookahead: float,
           forbidden: np.ndarray | None = None, owner: np.ndarray | None = None,
           tries: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`count` dashed contours grown paddle by paddle (vectorised over contours and `tries` proposals).

    Each paddle turns by U(-max_turn, max_turn) from the previous one. Of the `tries` proposals the
    first is taken that stays inside the margin, keeps `min_separation` from the cells marked in
    forbidden[owner[i]] (other contours) and from the contour's own older paddles, preferring ones
    that leave room ahead. Returns paddle starts and unit directions [count, paddles, 2] and whether
    the whole contour could be grown [count].
    """
    rows = np.arange(count)
    starts = np.zeros((count, paddles, 2))
    directions = np.zeros((count, paddles, 2))
    ok = np.ones(count, dtype=bool)
    angle = np.zeros(count)
    low, high = margin, size - margin
    along = np.array([0.0, 0.5, 1.0])[:, None] * paddle_length  # sample points of a paddle
    disc = _disc_offsets(min_separation * _GRID).astype(np.int64)
    # Self-avoidance: after paddle k is placed, paddle k - lag joins the forbidden cells, where lag is
    # the fewest paddles whose length along the contour safely exceeds min_separation.
    lag = max(1, math.ceil((1.5 * min_separation - gap) / (paddle_length + gap)))
    own = np.zeros((count, size * _GRID, size * _GRID), dtype=bool) if paddles > lag + 1 else None
    for k in range(paddles):
        if k == 0:
            origin = rng.uniform(low, high, (count, tries, 2))
            proposal = rng.uniform(0.0, 2.0 * math.pi, (count, tries))
        else:
            origin = np.broadcast_to((starts[:, k - 1] + (paddle_length + gap) * directions[:, k - 1])[:, None],
                                     (count, tries, 2))
            # The second half of the proposals may turn twice as sharply; they are taken only when no
            # proposal within max_turn fits (a contour cornered by the border or another contour).
            limit = np.where(np.arange(tries) < tries // 2, max_turn, 2.0 * max_turn)
            proposal = angle[:, None] + rng.uniform(-1.0, 1.0, (count, tries)) * limit
        unit = np.stack([np.cos(proposal), np.sin(proposal)], axis=-1)
        stroke = origin[:, :, None, :] + along * unit[:, :, None, :]  # [count, tries, 3, 2]
        valid = ((stroke >= low) & (stroke <= high)).all(axis=(-1, -2))
        if forbidden is not None:
            valid &= ~_hits(forbidden, owner, stroke)
        if own is not None:
            valid &= ~_hits(own, rows, stroke)
        # Prefer proposals whose heading leaves room ahead (a point `lookahead` px further on is inside),
        # so contours bend away from the border before reaching it instead of dying against it.
        score = valid.astype(np.int8)
        if k > 0:
            score += valid & (np.arange(tries) < tries // 2)
        for distance in (0.5 * lookahead, lookahead):
            ahead = origin + (paddle_length + distance) * unit
            score += 2 * (valid & ((ahead >= low) & (ahead <= high)).all(axis=-1))
        chosen = np.argmax(score, axis=1)
        ok &= valid[rows, chosen]
        starts[:, k] = origin[rows, chosen]
        directions[:, k] = unit[rows, chosen]
        angle = proposal[rows, chosen]
        if own is not None and k >= lag:  # paddles closer along the contour than `lag` are its neighbours
            _stamp(own, rows, starts[:, k - lag, None] + along[None] * directions[:, k - lag, None], disc)
    return starts, directions, ok


def _stroke_points(starts: np.ndarray, directions: np.ndarray, paddle_length: float, samples: int) -> np.ndarray:
    """Points along every paddle: [..., paddles * samples, 2]."""
    t = np.linspace(0.0, paddle_length, samples)
    points = starts[..., :, None, :] + t[:, None] * directions[..., :, None, :]
    return points.reshape(*starts.shape[:-2], starts.shape[-2] * samples, 2)


def _ends(starts: np.ndarray, directions: np.ndarray, paddle_length: float) -> np.ndarray:
    """Both end points of contours [n, paddles, 2] -> [n, 2, 2] (start of the first paddle, end of the last)."""
    return np.stack([starts[:, 0], starts[:, -1] + paddle_length * directions[:, -1]], axis=1)


def _clear_of_own_dots(starts: np.ndarray, directions: np.ndarray, paddle_length: float, gap: float,
                       clearance: float) -> np.ndarray:
    """Whether each contour [n, paddles, 2] stays `clearance` px from the dots on its own two ends,
    ignoring the paddles next to each end (they touch it by construction). [n] bool."""
    paddles = starts.shape[1]
    skip = max(1, math.ceil(1.5 * clearance / (paddle_length + gap)))
    if paddles <= skip:
        return np.ones(len(starts), dtype=bool)
    points = starts[:, :, None] + np.array([0.0, 0.5, 1.0])[:, None] * paddle_length * directions[:, :, None]
    ends = _ends(starts, directions, paddle_length)
    near_start = np.sqrt(((points[:, skip:] - ends[:, None, None, 0]) ** 2).sum(-1)).min(axis=(1, 2))
    near_end = np.sqrt(((points[:, : paddles - skip] - ends[:, None, None, 1]) ** 2).sum(-1)).min(axis=(1, 2))
    return (near_start >= clearance) & (near_end >= clearance)


def generate_pathfinder(num_examples: int, *, seed: int = 0, image_size: int = 32, contour_length: int = 14,
                        paddle_length: float = 2.0, gap: float = 1.0, max_turn_degrees: float = 45.0,
                        num_distractors: int | None = None, distractor_length: int | None = None,
                        marker_radius: float = 1.5, min_separation: float = 1.5, margin: float = 1.0,
                        supersample: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images [N, image_size, image_size] and labels [N] (exactly balanced up to one), seeded."""
    distractor_length = max(1, contour_length // 3) if distractor_length is None else distractor_length
    num_distractors = 20 // distractor_length if num_distractors is None else num_distractors
    if num_examples < 0 or contour_length < 1 or distractor_length < 1 or num_distractors < 0:
        raise DatasetError("need num_examples >= 0, contour_length >= 1, distractor_length >= 1, num_distractors >= 0")
    if paddle_length <= 0 or gap < 0 or supersample < 1 or image_size < 4 or not 0 <= margin < image_size / 2:
        raise DatasetError("need paddle_length > 0, gap >= 0, supersample >= 1, image_size >= 4, 0 <= margin < size/2")
    rng = np.random.default_rng(seed)
    walk = dict(size=image_size, paddle_length=paddle_length, gap=gap, max_turn=math.radians(max_turn_degrees),
                margin=margin, min_separation=min_separation,
                lookahead=2.0 * (paddle_length + gap))
    samples = int(math.ceil(paddle_length * supersample * 2)) + 1  # <= half a canvas pixel apart
    labels = rng.permutation(np.arange(num_examples) % 2)
    canvas_size = image_size * supersample
    disc = _disc_offsets(marker_radius * supersample)
    images = np.empty((num_examples, image_size, image_size), dtype=np.uint8)
    grid_size = image_size * _GRID
    separation_disc = _disc_offsets(min_separation * _GRID).astype(np.int64)
    dot_clearance = min_separation + marker_radius  # no stroke may come closer to a dot's centre
    marker_disc = _disc_offsets(dot_clearance * _GRID).astype(np.int64)
    done, failures = 0, 0
    while done < num_examples:
        want = num_examples - done
        proposals = min(_CHUNK, 3 * want + 16)
        # Two main contours, the second grown away from the first; pairs that cannot be grown are redrawn.
        first_starts, first_dirs, ok_first = _walks(rng, proposals, contour_length, **walk)
        ok_first &= _clear_of_own_dots(first_starts, first_dirs, paddle_length, gap, dot_clearance)
        first_starts, first_dirs = first_starts[ok_first], first_dirs[ok_first]
        grown = len(first_starts)
        first_points = _stroke_points(first_starts, first_dirs, paddle_length, 3)
        forbidden = np.zeros((grown, grid_size, grid_size), dtype=bool)
        _stamp(forbidden, np.arange(grown), first_points, separation_disc)
        _stamp(forbidden, np.arange(grown), _ends(first_starts, first_dirs, paddle_length), marker_disc)
        # Several attempts at the second contour per first one: it is the harder of the two to fit.
        owner = np.repeat(np.arange(grown), _SECOND_ATTEMPTS)
        second_starts, second_dirs, ok_second = _walks(rng, len(owner), contour_length, forbidden=forbidden,
                                                       owner=owner, **walk)
        # The second contour's dots must keep min_separation from the first contour too.
        near_first = np.zeros_like(forbidden)
        _stamp(near_first, np.arange(grown), first_points, marker_disc)
        second_ends = _ends(second_starts, second_dirs, paddle_length)[:, None]  # [attempts, 1, 2 ends, 2]
        ok_second &= ~_hits(near_first, owner, second_ends)[:, 0]
        ok_second &= _clear_of_own_dots(second_starts, second_dirs, paddle_length, gap, dot_clearance)
        # Dots of different contours must not touch: centres at least 2 radii + min_separation apart.
        first_ends = _ends(first_starts, first_dirs, paddle_length)[owner]
        dot_gap = np.sqrt(((second_ends[:, 0, :, None] - first_ends[:, None]) ** 2).sum(-1)).min(axis=(1, 2))
        ok_second &= dot_gap >= 2.0 * marker_radius + min_separation
        ok_second = ok_second.reshape(grown, _SECOND_ATTEMPTS)
        attempt = np.argmax(ok_second, axis=1)  # the first successful attempt of each first contour
        pick = np.arange(grown) * _SECOND_ATTEMPTS + attempt
        second_starts, second_dirs = second_starts[pick], second_dirs[pick]
        keep = np.flatnonzero(ok_second.any(axis=1))[:want]
        if not len(keep):
            failures += 1
            if failures > 50:
                raise DatasetError("pathfinder: contours do not fit; lower contour_length or min_separation")
            continue
        starts = np.stack([first_starts, second_starts], axis=1)[keep]
        directions = np.stack([first_dirs, second_dirs], axis=1)[keep]
        count = len(keep)
        main_points = _stroke_points(starts, directions, paddle_length, samples).reshape(count, -1, 2)
        strokes = [main_points]
        if num_distractors:
            forbidden = np.zeros((count, grid_size, grid_size), dtype=bool)
            coarse = _stroke_points(starts, directions, paddle_length, 3).reshape(count, -1, 2)
            _stamp(forbidden, np.arange(count), coarse, separation_disc)
            dots = _ends(starts.reshape(-1, contour_length, 2), directions.reshape(-1, contour_length, 2),
                         paddle_length).reshape(count, 4, 2)
            _stamp(forbidden, np.arange(count), dots, marker_disc)
            owner = np.repeat(np.arange(count), num_distractors)
            d_starts, d_dirs, d_ok = _walks(rng, count * num_distractors, distractor_length, forbidden=forbidden,
                                            owner=owner, **walk)
            d_points = _stroke_points(d_starts, d_dirs, paddle_length, samples)
            # Distractors that could not be grown are moved off-canvas, so they are not drawn.
            d_points = np.where(d_ok[:, None, None], d_points, -1.0)
            strokes.append(d_points.reshape(count, -1, 2))
        canvas = np.zeros((count, canvas_size, canvas_size), dtype=np.float32)
        _draw_points(canvas, np.concatenate(strokes, axis=1) * supersample)
        # Dots: positive = both ends of contour 0; negative = start of contour 0 and end of contour 1.
        last_end = starts[:, :, -1] + paddle_length * directions[:, :, -1]  # [count, 2 contours, 2]
        positive = labels[done : done + count, None] == 1
        for centre in (starts[:, 0, 0], np.where(positive, last_end[:, 0], last_end[:, 1])):
            _draw_points(canvas, centre[:, None, :] * supersample + disc[None])
        pooled = canvas.reshape(count, image_size, supersample, image_size, supersample).mean(axis=(2, 4))
        images[done : done + count] = np.rint(pooled * 255.0).astype(np.uint8)
        done += count
    return images, labels.astype(np.int64)


def _disc_offsets(radius: float) -> np.ndarray:
    span = int(math.ceil(radius))
    grid = np.stack(np.meshgrid(np.arange(-span, span + 1), np.arange(-span, span + 1), indexing="xy"), -1)
    grid = grid.reshape(-1, 2).astype(np.float64)
    return grid[(grid**2).sum(-1) <= radius**2]


def _draw_points(canvas: np.ndarray, points: np.ndarray) -> None:
    """Set canvas pixels under points [B, P, 2] (x, y in canvas pixels) to 1; off-canvas points are ignored."""
    batch, height, width = canvas.shape
    cells = np.floor(points).astype(np.int64)
    x, y = cells[..., 0], cells[..., 1]
    valid = (x >= 0) & (x < width) & (y >= 0) & (y < height)
    rows = np.broadcast_to(np.arange(batch)[:, None], x.shape)
    canvas.reshape(-1)[(rows * height * width + y * width + x)[valid]] = 1.0


# ----------------------------------------------------------------------------- official release loader

class PathfinderFiles(Dataset):
    """Official pathfinder PNGs, read lazily: `{"tokens": LongTensor[1024], "label": int}`."""

    def __init__(self, paths: list[Path], labels: np.ndarray, image_size: int = 32) -> None:
        self.paths = paths
        self.labels = labels
        self.image_size = image_size
        self.pad_id = PAD_ID
        self.vocab_size = VOCAB_SIZE
        self.max_len = image_size * image_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        from PIL import Image, UnidentifiedImageError

        path = self.paths[index]
        try:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("L"), dtype=np.uint8)
        except (UnidentifiedImageError, OSError) as error:
            raise DatasetError(f"{path}: cannot decode image ({error})") from error
        if pixels.shape != (self.image_size, self.image_size):
            raise DatasetError(f"{path}: expected {self.image_size}x{self.image_size}, got {pixels.shape}")
        return {"tokens": torch.from_numpy(pixels.reshape(-1).astype(np.int64)), "label": int(self.labels[index])}


def _metadata_key(path: Path) -> tuple[int, str]:
    return (int(path.stem), path.name) if path.stem.isdigit() else (1 << 62, path.name)


def read_metadata(folder: Path) -> tuple[list[Path], np.ndarray]:
    """Image paths and labels listed by `<folder>/metadata/*.npy`, in numeric file order."""
    meta_dir = folder / "metadata"
    files = sorted(meta_dir.glob("*.npy"), key=_metadata_key)
    if not files:
        raise DatasetError(f"pathfinder: no metadata/*.npy files in {folder}")
    paths, labels = [], []
    for file in files:
        for line_number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 4 or fields[3] not in ("0", "1"):
                raise DatasetError(f"{file}:{line_number}: expected '<dir> <image> <n> <label 0|1> ...', got {line[:80]!r}")
            paths.append(folder / fields[0] / fields[1])
            labels.append(int(fields[3]))
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise DatasetError(f"pathfinder: {len(missing)} images listed in {meta_dir} are missing, e.g. {missing[0]}")
    return paths, np.asarray(labels, dtype=np.int64)


# The difficulty folders of the pathfinder32 release (option ``difficulty``), and the folders of data_dir that
# may hold them: itself, pathfinder32/, and the unpacked release (lra_release.gz nests a second lra_release/
# folder, which LRA's own dataset_setup.sh reads).
DIFFICULTIES = ("curv_baseline", "curv_contour_length_9", "curv_contour_length_14")
RELEASE_FOLDERS = ("", "pathfinder32/", "lra_release/pathfinder32/", "lra_release/lra_release/pathfinder32/")


def difficulty_folder(data_dir: str | Path, difficulty: str) -> Path | None:
    return find_first(data_dir, [folder + difficulty for folder in RELEASE_FOLDERS])


def _no_release_error(data_dir: str | Path, difficulty: str) -> DatasetError:
    others = [name for name in DIFFICULTIES if name != difficulty and difficulty_folder(data_dir, name) is not None]
    found = f" (it has {', '.join(others)}; option difficulty picks one)" if others else ""
    layouts = [f"{difficulty}/metadata/*.npy and the images they list, in the folder or in its pathfinder32/",
               f"the unpacked LRA release: lra_release/pathfinder32/{difficulty}/ or "
               f"lra_release/lra_release/pathfinder32/{difficulty}/",
               "no data folder (data.data_dir unset, no --data-dir): the images are generated"]
    return no_layout_error(f"Pathfinder: no {difficulty}/{found}", data_dir, layouts,
                           download_command("lra_release", data_dir, unverified=True))


def build_pathfinder(split: str, data_dir: str | Path | None = None, *, difficulty: str = "curv_contour_length_14",
                     num_examples: int | None = None, seed: int = 0, **generator_options) -> Dataset:
    """The official images of ``difficulty`` in data_dir's pathfinder32 layout, or generated images when
    data_dir is None; a data_dir without that layout is an error naming it, never generated images instead."""
    check_split(split)
    if data_dir is not None:
        folder = difficulty_folder(data_dir, difficulty)
        if folder is None:
            raise _no_release_error(data_dir, difficulty)
        if generator_options or num_examples is not None:
            raise DatasetError(f"pathfinder: generator options {sorted(generator_options)} do not apply to the "
                               f"official images in {folder}")
        paths, labels = read_metadata(folder)
        lo, hi = (int(round(f * len(labels))) for f in _SPLIT_RANGES[split])
        return PathfinderFiles(paths[lo:hi], labels[lo:hi])
    count = LRA_SPLIT_SIZES[split] if num_examples is None else num_examples
    images, labels = generate_pathfinder(count, seed=seed * 3 + _SPLIT_CODE[split], **generator_options)
    return PixelDataset(images.reshape(count, -1), labels, split=split)
