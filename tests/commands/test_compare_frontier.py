"""The frontier picture's labels: mechanisms of about the same cost and accuracy get labels that do not overlap, and\na point at the right edge gets its label on its left, inside the axes."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from longattn.commands.compare import LABEL_OFFSETS, _place_labels  # noqa: E402


def test_labels_of_coinciding_points_do_not_overlap():
    fig, axes = plt.subplots(figsize=(6.5, 4.5))
    axes.set_xscale("log")
    axes.set(xlim=(0.01, 10), ylim=(20, 40))
    points = [("nystrom (44 MB)", 0.59, 32.4, "C0"), ("skein (118 MB)", 0.66, 32.4, "C1"),
              ("fsat (45 MB)", 0.39, 30.9, "C2"), ("linformer (56 MB)", 0.26, 30.7, "C3")]
    _place_labels(fig, axes, points)
    renderer = fig.canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for text in axes.texts]
    assert [text.get_text() for text in axes.texts] == [label for label, *_ in points]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert axes.texts[0].xyann == LABEL_OFFSETS[0]  # the first label takes the first place
    plt.close(fig)


def test_the_label_of_a_point_at_the_right_edge_stays_inside_the_axes():
    fig, axes = plt.subplots(figsize=(6.5, 4.5))
    axes.set_xscale("log")
    axes.set(xlim=(0.01, 2.5), ylim=(20, 40))
    points = [("softmax (45 MB)", 2.2, 33.6, "C0"), ("singular (24 MB)", 0.0229, 32.7, "C1")]
    _place_labels(fig, axes, points)
    renderer = fig.canvas.get_renderer()
    frame = axes.get_window_extent(renderer)
    for text in axes.texts:
        box = text.get_window_extent(renderer)
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1, text.get_text()
    assert axes.texts[0].xyann[0] < 0 and axes.texts[1].xyann == LABEL_OFFSETS[0]
    plt.close(fig)
