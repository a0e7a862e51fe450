"""Labelled evaluation samples by name: a small registry of loaders and NumPy preprocessing.

Each dataset is a name with its splits and the package that ships its files (nothing is
downloaded at run time and nothing is committed to the repository). :func:`load` yields
:class:`Sample` values (an input and its label, None where the set has no labels), at most
``samples`` of them, in a fixed order, so two runs see the same samples.

==========================  ===========  ==========================================================
name                        splits       what
==========================  ===========  ==========================================================
``digits``                  train, test  scikit-learn's 1,797 labelled 8x8 handwritten digits;
                                         test is the last 450 (Note [digits split])
``movielens-100k``          train, test  recbole's MovieLens-100k ratings; test holds each user's
                                         last 10 rated items by time (input: user index, label:
                                         the held-out item indices)
``movielens-100k-titles``   all          the 1,682 movie titles of MovieLens-100k (real text, no
                                         labels: performance samples for text models)
``synthetic``               all          seeded uniform random tensors shaped like the manifest's
                                         inputs (no labels: performance only)
==========================  ===========  ==========================================================

Note [digits split]: scikit-learn ships the digits in a fixed order; the first 1,347 are the
training split and the last 450 the test split. No shuffle, so the split needs no seed and
never changes with the scikit-learn version.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import NotFound, ValidationError

if TYPE_CHECKING:
    from trims.evaluation.harness.manifest import DatasetRef, Input, Preprocessing

__all__ = [
    "DATASETS",
    "DIGITS_TRAIN",
    "DatasetInfo",
    "Ratings",
    "Sample",
    "check",
    "digits",
    "load",
    "movielens_100k",
    "preprocess_image",
]

log = logging.getLogger(__name__)

#: Note [digits split]
DIGITS_TRAIN = 1347
#: items held out per user in the movielens-100k test split
HELD_OUT = 10


@dataclass(frozen=True)
class Sample:
    """One evaluation sample: the model input (before batching) and its label (None: none)."""

    input: Any
    label: Any


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    splits: tuple[str, ...]
    package: str
    install: str
    description: str


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(
        "digits", ("train", "test"), "sklearn", "pip install scikit-learn",
        "scikit-learn's labelled 8x8 handwritten digits (1,797 images, 10 classes)",
    ),
    "movielens-100k": DatasetInfo(
        "movielens-100k", ("train", "test"), "recbole", "pip install recbole",
        "MovieLens-100k ratings from the recbole wheel (943 users, 1,682 items)",
    ),
    "movielens-100k-titles": DatasetInfo(
        "movielens-100k-titles", ("all",), "recbole", "pip install recbole",
        "the 1,682 movie titles of MovieLens-100k (text without labels)",
    ),
    "synthetic": DatasetInfo(
        "synthetic", ("all",), "numpy", "pip install numpy",
        "seeded random tensors shaped like the manifest's inputs (performance only)",
    ),
}  # fmt: skip


def check(name: str, split: str) -> DatasetInfo:
    """The dataset's entry; NotFound naming it and what to install when it cannot be had."""
    info = DATASETS.get(name)
    if info is None:
        raise NotFound(
            f"no dataset {name!r}; choose from {', '.join(sorted(DATASETS))}", dataset=name
        )
    if split not in info.splits:
        raise ValidationError(
            f"dataset {name!r} has no split {split!r}; choose from {', '.join(info.splits)}",
            dataset=name,
        )
    if importlib.util.find_spec(info.package) is None:
        raise NotFound(
            f"dataset {name!r} needs the {info.package} package, which is not installed; "
            f"{info.install}",
            dataset=name,
        )
    return info


def load(ref: DatasetRef, inputs: Sequence[Input] = ()) -> Iterator[Sample]:
    """At most ``ref.samples`` samples of ``ref.name``/``ref.split``, preprocessed for the
    first of ``inputs`` (images: its preprocessing and layout; other sets: as they are)."""
    check(ref.name, ref.split)
    first = inputs[0] if inputs else None
    source = _LOADERS[ref.name](ref.split, first)
    for i, sample in enumerate(source):
        if i >= ref.samples:
            return
        yield sample


def digits(split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 8, 8] float64 in [0, 16], labels [N] int64) of one split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images, labels = data.images, data.target.astype(np.int64)
    part = slice(None, DIGITS_TRAIN) if split == "train" else slice(DIGITS_TRAIN, None)
    return images[part], labels[part]


@dataclass(frozen=True)
class Ratings:
    """MovieLens-100k as dense indices: users and items numbered from 0 in order of id."""

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    timestamps: np.ndarray
    n_users: int
    n_items: int

    def split(self) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """(train mask over the interactions, user -> held-out item indices): each user's
        last :data:`HELD_OUT` interactions by time (ties by item) form the test split."""
        order = np.lexsort((self.items, self.timestamps, self.users))
        train = np.ones(len(self.users), dtype=bool)
        held: dict[int, np.ndarray] = {}
        users_sorted = self.users[order]
        bounds = np.flatnonzero(np.diff(users_sorted)) + 1
        for rows in np.split(order, bounds):
            last = rows[-HELD_OUT:]
            train[last] = False
            held[int(self.users[rows[0]])] = np.sort(self.items[last])
        return train, held


def movielens_dir() -> Path:
    files = importlib.resources.files("recbole") / "dataset_example" / "ml-100k"
    path = Path(str(files))
    if not (path / "ml-100k.inter").is_file():
        raise NotFound(
            f"dataset 'movielens-100k': {path}/ml-100k.inter is missing; reinstall recbole",
            dataset="movielens-100k",
        )
    return path


@cache
def movielens_100k() -> Ratings:
    """The ratings file of recbole's MovieLens-100k, read once per process."""
    table = np.loadtxt(movielens_dir() / "ml-100k.inter", skiprows=1, dtype=np.int64)
    user_ids, users = np.unique(table[:, 0], return_inverse=True)
    item_ids, items = np.unique(table[:, 1], return_inverse=True)
    log.debug("movielens-100k: %d ratings, %d users, %d items", len(table), len(user_ids),
              len(item_ids))  # fmt: skip
    return Ratings(users, items, table[:, 2].astype(np.float32), table[:, 3], len(user_ids),
                   len(item_ids))  # fmt: skip


def preprocess_image(image: np.ndarray, pre: Preprocessing | None, layout: str | None) -> Any:
    """One image ([H, W] or [H, W, C], RGB) as a float32 tensor: grayscale (color order GRAY),
    resize (shorter side, bilinear or nearest), center crop, zero pad, scale, mean/std, BGR
    channel order, then ``layout`` (NCHW: [C, H, W])."""
    x: np.ndarray = np.asarray(image, dtype=np.float32)
    if x.ndim == 2:
        x = x[:, :, None]
    if pre is not None:
        if pre.color_order == "GRAY":
            x = _grayscale(x)
        if pre.resize is not None:
            x = (
                _resize_nearest(x, pre.resize)
                if pre.resize_mode == "nearest"
                else _resize(x, pre.resize)
            )
        if pre.center_crop is not None:
            x = _center_crop(x, pre.center_crop)
        if pre.pad is not None:
            x = np.pad(x, ((pre.pad, pre.pad), (pre.pad, pre.pad), (0, 0)))
        if pre.scale is not None:
            x = x * np.float32(pre.scale)
        if pre.mean is not None:
            x = x - np.asarray(pre.mean, dtype=np.float32)
        if pre.std is not None:
            x = x / np.asarray(pre.std, dtype=np.float32)
        if pre.color_order == "BGR":
            x = x[:, :, ::-1]
    if layout == "NCHW":
        x = x.transpose(2, 0, 1)
    elif layout == "NC":
        x = x.reshape(-1)
    return np.ascontiguousarray(x, dtype=np.float32)


def _resize(x: np.ndarray, shorter: int) -> np.ndarray:
    h, w = x.shape[:2]
    scale = shorter / min(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    ys = np.clip((np.arange(nh) + 0.5) * h / nh - 0.5, 0, h - 1)
    xs = np.clip((np.arange(nw) + 0.5) * w / nw - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    wy, wx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    top = x[y0][:, x0] * (1 - wx) + x[y0][:, x1] * wx
    bottom = x[y1][:, x0] * (1 - wx) + x[y1][:, x1] * wx
    return np.asarray(top * (1 - wy) + bottom * wy, dtype=np.float32)


def _resize_nearest(x: np.ndarray, shorter: int) -> np.ndarray:
    """Nearest neighbour: output pixel i takes source pixel floor(i * in / out), in integers
    (torch's ``interpolate(mode="nearest")``; 8 -> 20 repeats pixels 3, 2, 3, 2, ... times)."""
    h, w = x.shape[:2]
    scale = shorter / min(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    ys = np.minimum(np.arange(nh) * h // nh, h - 1)
    xs = np.minimum(np.arange(nw) * w // nw, w - 1)
    return np.asarray(x[ys][:, xs], dtype=np.float32)


def _grayscale(x: np.ndarray) -> np.ndarray:
    """[H, W, 3] RGB -> [H, W, 1] ITU-R BT.601 luma; a one-channel image is kept as it is."""
    if x.shape[2] == 1:
        return x
    if x.shape[2] != 3:
        raise ValidationError(f"color_order GRAY needs 1 or 3 channels, got {x.shape[2]}")
    luma = np.asarray([0.299, 0.587, 0.114], dtype=np.float32)
    return np.asarray(x @ luma, dtype=np.float32)[:, :, None]


def _center_crop(x: np.ndarray, side: int) -> np.ndarray:
    h, w = x.shape[:2]
    if side > h or side > w:
        raise ValidationError(f"center_crop {side} is larger than the image ({h}x{w})")
    top, left = (h - side) // 2, (w - side) // 2
    return x[top : top + side, left : left + side]


def _digits(split: str, first: Input | None) -> Iterator[Sample]:
    images, labels = digits(split)
    pre = first.preprocessing if first else None
    layout = first.layout if first else None
    for image, label in zip(images, labels, strict=True):
        yield Sample(preprocess_image(image, pre, layout), int(label))


def _movielens(split: str, first: Input | None) -> Iterator[Sample]:
    data = movielens_100k()
    train, held = data.split()
    if split == "test":
        for user in range(data.n_users):
            yield Sample(np.int64(user), held[user])
        return
    for user in range(data.n_users):
        mask = train & (data.users == user)
        yield Sample(np.int64(user), np.sort(data.items[mask]))


def _titles(split: str, first: Input | None) -> Iterator[Sample]:
    path = movielens_dir() / "ml-100k.item"
    with path.open(encoding="latin-1") as f:
        next(f)
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if len(fields) > 1 and fields[1]:
                yield Sample(fields[1], None)


def _synthetic(split: str, first: Input | None) -> Iterator[Sample]:
    if first is None:
        raise ValidationError("dataset 'synthetic' needs the manifest's inputs to shape tensors")
    if any(d < 0 for d in first.dims) or first.element_type == "BYTES":
        raise ValidationError(
            f"dataset 'synthetic' needs fixed numeric dims; input {first.name!r} has "
            f"{first.element_type} {first.dims}"
        )
    rng = np.random.default_rng(0)
    dtype = np.float32 if first.element_type.startswith("FP") else np.int64
    while True:
        yield Sample(rng.random(first.dims, dtype=np.float32).astype(dtype), None)


_LOADERS: dict[str, Callable[[str, Any], Iterator[Sample]]] = {
    "digits": _digits,
    "movielens-100k": _movielens,
    "movielens-100k-titles": _titles,
    "synthetic": _synthetic,
}
