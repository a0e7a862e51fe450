"""Datasets load from the installed packages; the trained-here digits classifier scores the same
through the harness (NumPy preprocessing, ONNX Runtime, our top-1) as scikit-learn's own
predict on the same weights and samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trims.errors import NotFound, ValidationError
from trims.evaluation.harness import accuracy, datasets, prepare
from trims.evaluation.harness.manifest import (
    DatasetRef,
    Input,
    Preprocessing,
    load_manifest,
    shipped_manifest_paths,
)


def shipped(name: str):  # type: ignore[no-untyped-def]
    return next(load_manifest(p) for p in shipped_manifest_paths() if p.stem == name)


def test_digits_split_and_preprocessing() -> None:
    images, labels = datasets.digits("test")
    assert images.shape == (450, 8, 8) and set(labels.tolist()) == set(range(10))
    assert len(datasets.digits("train")[0]) == datasets.DIGITS_TRAIN
    m = shipped("digits-mlp")
    samples = list(datasets.load(m.dataset, m.inputs))
    assert len(samples) == 450
    first = samples[0]
    assert first.input.shape == (64,) and first.input.dtype == np.float32
    assert np.allclose(first.input, images[0].reshape(-1) / 16.0)
    assert first.label == labels[0]


def test_sample_cap_and_order_are_fixed() -> None:
    ref = DatasetRef(name="digits", split="train", samples=5)
    a = [s.label for s in datasets.load(ref)]
    assert a == [s.label for s in datasets.load(ref)] and len(a) == 5


def test_movielens_100k_from_the_recbole_wheel() -> None:
    data = datasets.movielens_100k()
    assert (data.n_users, data.n_items, len(data.users)) == (943, 1682, 100_000)
    train, _ = data.split()
    assert int((~train).sum()) == 943 * datasets.HELD_OUT
    samples = list(datasets.load(DatasetRef(name="movielens-100k", split="test", samples=3)))
    assert [int(s.input) for s in samples] == [0, 1, 2]
    user0 = data.timestamps[data.users == 0]
    cutoff = np.sort(user0)[-datasets.HELD_OUT]
    assert all(len(s.label) == datasets.HELD_OUT for s in samples)
    assert (data.timestamps[(data.users == 0) & ~train] >= cutoff).all()


def test_text_titles() -> None:
    texts = [s.input for s in datasets.load(DatasetRef(name="movielens-100k-titles", split="all",
                                                       samples=2))]  # fmt: skip
    assert texts == ["Toy Story", "GoldenEye"]


def test_synthetic_needs_fixed_dims() -> None:
    fixed = Input(name="x", element_type="FP32", dims=[3, 4])
    ref = DatasetRef(name="synthetic", split="all", samples=2)
    samples = list(datasets.load(ref, [fixed]))
    assert [s.input.shape for s in samples] == [(3, 4), (3, 4)] and samples[0].label is None
    with pytest.raises(ValidationError, match="needs fixed numeric dims"):
        list(datasets.load(ref, [Input(name="t", element_type="BYTES", dims=[-1])]))


def test_unknown_dataset_and_split() -> None:
    with pytest.raises(NotFound, match="no dataset 'cifar10'; choose from digits"):
        datasets.check("cifar10", "test")
    with pytest.raises(ValidationError, match="has no split 'val'"):
        datasets.check("digits", "val")


def test_image_preprocessing_resize_crop_normalize() -> None:
    image = np.arange(16, dtype=np.float32).reshape(4, 4)
    same = datasets.preprocess_image(image, Preprocessing(resize=4), "NCHW")
    assert same.shape == (1, 4, 4) and np.allclose(same[0], image)
    up = datasets.preprocess_image(np.ones((2, 3, 3)), Preprocessing(resize=4), None)
    assert up.shape == (4, 6, 3) and np.allclose(up, 1.0)
    pre = Preprocessing(center_crop=2, scale=0.5, mean=[1.0], std=[2.0])
    out = datasets.preprocess_image(image, pre, "NCHW")
    assert np.allclose(out[0], (image[1:3, 1:3] * 0.5 - 1.0) / 2.0)
    rgb = np.stack([np.zeros((2, 2)), np.ones((2, 2)), 2 * np.ones((2, 2))], axis=-1)
    bgr = datasets.preprocess_image(rgb, Preprocessing(color_order="BGR"), "NCHW")
    assert bgr[:, 0, 0].tolist() == [2.0, 1.0, 0.0]
    with pytest.raises(ValidationError, match="larger than the image"):
        datasets.preprocess_image(image, Preprocessing(center_crop=5), None)


def test_digits_classifier_matches_the_framework_native_accuracy(tmp_path: Path) -> None:
    import onnxruntime as ort

    m = shipped("digits-mlp")
    assert m.accuracy is not None and m.model.sources[0].builder == "prepare:digits-mlp"
    path = prepare.build("prepare:digits-mlp", tmp_path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    samples = list(datasets.load(m.dataset, m.inputs))
    batch = np.stack([s.input for s in samples])
    (probabilities,) = session.run([m.outputs[0].name], {m.inputs[0].name: batch})
    ours = accuracy.score(m.accuracy.metric, probabilities, [s.label for s in samples])
    native = prepare.digits_reference()
    assert abs(ours - native) <= 0.005, (ours, native)
    assert ours == pytest.approx(m.accuracy.reference, abs=0.005)


def test_als_onnx_matches_its_numpy_reference(tmp_path: Path) -> None:
    import onnxruntime as ort

    m = shipped("als-ml100k")
    assert m.accuracy is not None and m.accuracy.k == 10
    session = ort.InferenceSession(str(prepare.build("prepare:als-ml100k", tmp_path)),
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    samples = list(datasets.load(m.dataset, m.inputs))
    users = np.array([s.input for s in samples], dtype=np.int64)
    (scores,) = session.run(["scores"], {"user": users})
    ours = accuracy.precision_at_k(accuracy.top_k(scores, 10), [s.label for s in samples], 10)
    assert ours == pytest.approx(m.accuracy.reference, abs=0.005)


def test_nearest_resize_zero_pad_and_grayscale() -> None:
    image = np.arange(64, dtype=np.float32).reshape(8, 8)
    pre = Preprocessing(resize=20, resize_mode="nearest", pad=4)
    out = datasets.preprocess_image(image, pre, "NCHW")
    assert out.shape == (1, 28, 28)
    # output pixel i takes source pixel floor(i * 8 / 20): each source row 3, 2, 3, 2... times
    rows = [int(i * 8 // 20) for i in range(20)]
    assert np.array_equal(out[0, 4:24, 4:24], image[rows][:, rows])
    assert np.array_equal(out[0, 4:24, 4], image[rows, 0])
    border = np.ones((28, 28), dtype=bool)
    border[4:24, 4:24] = False
    assert (out[0][border] == 0).all()
    # padding comes before scale and mean/std, so the border is normalized background
    norm = datasets.preprocess_image(image, Preprocessing(pad=1, mean=[0.5], std=[2.0]), None)
    assert norm[0, 0, 0] == pytest.approx(-0.25) and norm[1, 1, 0] == pytest.approx(-0.25)
    rgb = np.stack([np.full((2, 2), 100.0), np.zeros((2, 2)), np.zeros((2, 2))], axis=-1)
    gray = datasets.preprocess_image(rgb, Preprocessing(color_order="GRAY"), "NCHW")
    assert gray.shape == (1, 2, 2) and np.allclose(gray, 29.9)
    one = datasets.preprocess_image(image, Preprocessing(color_order="GRAY"), None)
    assert np.array_equal(one[:, :, 0], image)
    with pytest.raises(ValidationError, match="GRAY needs 1 or 3 channels"):
        datasets.preprocess_image(np.zeros((2, 2, 4)), Preprocessing(color_order="GRAY"), None)


def test_nearest_resize_matches_torch_interpolate() -> None:
    import torch
    import torch.nn.functional as F

    images, _ = datasets.digits("test")
    ours = np.stack(
        [datasets.preprocess_image(i, Preprocessing(resize=20, resize_mode="nearest"), "NCHW")
         for i in images[:32]]
    )  # fmt: skip
    theirs = F.interpolate(torch.from_numpy(images[:32]).float()[:, None], size=(20, 20),
                           mode="nearest").numpy()  # fmt: skip
    assert np.array_equal(ours, theirs)
