"""vision transforms against per-image NumPy references (loops are fine here), on drawn shapes."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl.dataset import vision
from minidl.dataset.vision import (HWC2CHW, Border, Inter, Normalize, RandomCrop, RandomHorizontalFlip,
                                   RandomVerticalFlip, Rescale, Resize)


@st.composite
def batches(draw, min_side=1, max_side=7, dtype=np.uint8):
    """An NHWC batch with C in {1, 3} (so no shape looks channels-first) and random values."""
    n = draw(st.integers(1, 4))
    h = draw(st.integers(min_side, max_side))
    w = draw(st.integers(min_side, max_side))
    c = draw(st.sampled_from([1, 3]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    gen = np.random.default_rng(seed)
    if dtype == np.uint8:
        return gen.integers(0, 256, (n, h, w, c), dtype=np.uint8)
    return gen.standard_normal((n, h, w, c)).astype(dtype)


def _pad_reference(img, left, top, right, bottom, mode, fill):
    """One HWC image padded channel by channel with np.pad (the per-channel fill needs the loop)."""
    fill = np.broadcast_to(np.asarray(fill), (img.shape[-1],))
    planes = []
    for ch in range(img.shape[-1]):
        kwargs = {"constant_values": fill[ch]} if mode == "constant" else {}
        planes.append(np.pad(img[..., ch], ((top, bottom), (left, right)), mode=mode, **kwargs))
    return np.stack(planes, axis=-1)


def _offsets(padded, crop):
    """Every (top, left) at which crop occurs inside padded."""
    ch, cw = crop.shape[:2]
    return [(i, j) for i in range(padded.shape[0] - ch + 1) for j in range(padded.shape[1] - cw + 1)
            if np.array_equal(padded[i:i + ch, j:j + cw], crop)]


# ---------------------------------------------------------------- RandomCrop

@given(x=batches(), data=st.data())
def test_random_crop_matches_padded_reference(x, data):
    n, h, w, c = x.shape
    padding = data.draw(st.sampled_from([None, 0, 1, 2, (1, 2), (0, 1, 2, 3)]))
    mode = data.draw(st.sampled_from([Border.CONSTANT, Border.EDGE, Border.REFLECT, Border.SYMMETRIC]))
    fill = data.draw(st.sampled_from([0, 7] + ([(1, 2, 3)] if c == 3 else [])))
    pads = vision._padding(padding)
    ph, pw = h + pads[1] + pads[3], w + pads[0] + pads[2]
    if mode == Border.REFLECT and (max(pads[1], pads[3]) >= h or max(pads[0], pads[2]) >= w):
        mode = Border.EDGE  # np.pad reflects repeatedly there; keep the reference simple
    size = (data.draw(st.integers(1, ph)), data.draw(st.integers(1, pw)))
    op = RandomCrop(size, padding=padding, fill_value=fill, padding_mode=mode)
    seed = data.draw(st.integers(0, 1000))
    out = op(x, rng=np.random.default_rng(seed))
    assert out.shape == (n,) + size + (c,) and out.dtype == x.dtype
    gen = np.random.default_rng(seed)  # the documented draw order: all tops, then all lefts
    tops, lefts = gen.integers(0, ph - size[0] + 1, n), gen.integers(0, pw - size[1] + 1, n)
    for k in range(n):
        padded = _pad_reference(x[k], *pads, mode, fill)
        expected = padded[tops[k]:tops[k] + size[0], lefts[k]:lefts[k] + size[1]]
        np.testing.assert_array_equal(out[k], expected)


def test_random_crop_padding_forms_follow_mindspore():
    x = np.arange(1, 1 + 2 * 3 * 1, dtype=np.uint8).reshape(1, 2, 3, 1)
    # (a, b): a pads left and top, b pads right and bottom.
    full = RandomCrop((2 + 1 + 4, 3 + 1 + 4), padding=(1, 4))(x, rng=np.random.default_rng(0))[0, ..., 0]
    assert full.shape == (7, 8)
    np.testing.assert_array_equal(full[1:3, 1:4], x[0, ..., 0])
    assert full[0].sum() == 0 and full[:, 0].sum() == 0 and full[3:].sum() == 0 and full[:, 4:].sum() == 0
    # (left, top, right, bottom)
    full = RandomCrop((2 + 2 + 4, 3 + 1 + 3), padding=(1, 2, 3, 4))(x, rng=np.random.default_rng(0))[0, ..., 0]
    np.testing.assert_array_equal(full[2:4, 1:4], x[0, ..., 0])
    assert full.sum() == x.sum()


def test_random_crop_pad_if_needed_pads_the_shortfall_on_both_sides():
    x = np.full((3, 2, 2, 3), 9, np.uint8)
    out = RandomCrop(4, pad_if_needed=True, fill_value=(1, 2, 3))(x, rng=np.random.default_rng(0))
    assert out.shape == (3, 4, 4, 3)
    for k in range(3):  # the 2x2 block of 9s sits inside a 6x6 canvas of fill, seen through a 4x4 window
        assert (out[k, ..., 0] == 9).sum() == 4
        assert set(np.unique(out[k, ..., 1])) <= {2, 9}


def test_random_crop_offsets_vary_per_image_and_cover_the_range():
    x = np.random.default_rng(0).integers(0, 256, (400, 6, 6, 3), dtype=np.uint8)
    out = RandomCrop(6, padding=2)(x, rng=np.random.default_rng(1))
    seen = set()
    for k in range(len(x)):
        found = _offsets(_pad_reference(x[k], 2, 2, 2, 2, "constant", 0), out[k])
        assert found, f"image {k} is not a crop of its padded input"
        seen.update(found)
    assert seen == {(i, j) for i in range(5) for j in range(5)}


def test_random_crop_single_image_equals_batch_of_one_and_is_deterministic():
    img = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    op = RandomCrop(5, padding=1)
    a = op(img, rng=np.random.default_rng(3))
    b = op(img[None], rng=np.random.default_rng(3))[0]
    np.testing.assert_array_equal(a, b)
    assert a.shape == (5, 5, 3)
    batch = np.repeat(img[None], 32, axis=0)
    np.testing.assert_array_equal(op(batch, rng=np.random.default_rng(4)), op(batch, rng=np.random.default_rng(4)))
    assert not np.array_equal(op(batch, rng=np.random.default_rng(4)), op(batch, rng=np.random.default_rng(5)))


def test_random_transforms_without_rng_use_the_framework_generator():
    batch = np.random.default_rng(0).integers(0, 256, (32, 8, 8, 3), dtype=np.uint8)
    for op in (RandomCrop(6, padding=2), RandomHorizontalFlip()):
        assert op.random is True
        minidl.set_seed(11)
        a = op(batch)
        minidl.set_seed(11)
        np.testing.assert_array_equal(op(batch), a)


def test_random_crop_errors_name_the_transform_and_the_expected_value():
    x = np.zeros((2, 4, 4, 3), np.uint8)
    with pytest.raises(ValueError, match=r"RandomCrop: crop size \(5, 5\) is larger than the image \(4, 4\)"):
        RandomCrop(5)(x)
    with pytest.raises(ValueError, match=r"RandomCrop: padding must be a non-negative int.*got \(1, 2, 3\)"):
        RandomCrop(4, padding=(1, 2, 3))
    with pytest.raises(ValueError, match=r"RandomCrop: padding must be.*got \(-1, -1, -1, -1\)"):
        RandomCrop(4, padding=-1)
    with pytest.raises(ValueError, match=r"RandomCrop: size must be positive ints, got \(0, 2\)"):
        RandomCrop((0, 2))
    with pytest.raises(TypeError, match=r"RandomCrop: size must be an int or a sequence \(h, w\)"):
        RandomCrop("big")
    with pytest.raises(ValueError, match="RandomCrop: padding_mode must be one of"):
        RandomCrop(4, padding_mode="wrap")
    with pytest.raises(ValueError, match=r"RandomCrop: fill_value \(1, 2\) has 2 values for images with 3 channels"):
        RandomCrop(4, padding=1, fill_value=(1, 2))(x)
    with pytest.raises(ValueError, match=r"RandomCrop: fill_value 300 does not fit uint8 images; expected values "
                                         r"in \[0, 255\]"):
        RandomCrop(4, padding=1, fill_value=300)(x)
    with pytest.raises(ValueError, match="RandomCrop: fill_value must be a number or one number per channel"):
        RandomCrop(4, padding=1, fill_value="red")


# ---------------------------------------------------------------- flips

@pytest.mark.parametrize("cls, axis", [(RandomHorizontalFlip, 1), (RandomVerticalFlip, 0)])
@given(x=batches(), seed=st.integers(0, 1000), prob=st.sampled_from([0.0, 0.3, 0.5, 1.0]))
def test_random_flip_flips_exactly_the_drawn_images(cls, axis, x, seed, prob):
    out = cls(prob)(x, rng=np.random.default_rng(seed))
    flipped = np.random.default_rng(seed).random(len(x)) < prob  # one draw per image
    for k in range(len(x)):
        expected = np.flip(x[k], axis=axis) if flipped[k] else x[k]
        np.testing.assert_array_equal(out[k], expected)
    assert out.dtype == x.dtype and out is not x


def test_random_flip_single_image_and_input_untouched():
    img = np.arange(2 * 3 * 3, dtype=np.float32).reshape(2, 3, 3)
    keep = img.copy()
    out = RandomHorizontalFlip(1.0)(img, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(out, img[:, ::-1])
    np.testing.assert_array_equal(img, keep)
    batch = np.repeat(img[None], 200, axis=0)
    share = (RandomHorizontalFlip(0.25)(batch, rng=np.random.default_rng(0))[:, 0, 0, 0] == img[0, 2, 0]).mean()
    assert 0.15 < share < 0.35


def test_random_flip_rejects_bad_prob():
    with pytest.raises(ValueError, match=r"RandomHorizontalFlip: prob must be a number in \[0, 1\], got 1.5"):
        RandomHorizontalFlip(1.5)


# ---------------------------------------------------------------- Resize

def _resize_reference(img, oh, ow, interpolation):
    """Pixel by pixel: OpenCV's INTER_LINEAR (half-pixel centres, edge clamp) or INTER_NEAREST."""
    h, w, c = img.shape
    src = img.astype(np.float64)
    out = np.empty((oh, ow, c))
    for i in range(oh):
        for j in range(ow):
            if interpolation == Inter.NEAREST:
                out[i, j] = src[min(int(i * h / oh), h - 1), min(int(j * w / ow), w - 1)]
                continue
            sy = min(max((i + 0.5) * h / oh - 0.5, 0.0), h - 1)
            sx = min(max((j + 0.5) * w / ow - 0.5, 0.0), w - 1)
            y0, x0 = int(np.floor(sy)), int(np.floor(sx))
            y1, x1 = min(y0 + 1, h - 1), min(x0 + 1, w - 1)
            fy, fx = sy - y0, sx - x0
            out[i, j] = ((1 - fy) * ((1 - fx) * src[y0, x0] + fx * src[y0, x1])
                         + fy * ((1 - fx) * src[y1, x0] + fx * src[y1, x1]))
    return out


@given(x=batches(), data=st.data())
def test_resize_matches_per_pixel_reference(x, data):
    oh, ow = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    interpolation = data.draw(st.sampled_from([Inter.LINEAR, Inter.NEAREST]))
    out = Resize((oh, ow), interpolation)(x)
    assert out.shape == (len(x), oh, ow, x.shape[-1]) and out.dtype == np.uint8
    for k in range(len(x)):
        expected = _resize_reference(x[k], oh, ow, interpolation)
        # float32 weights may flip a .5 rounding: allow one grey level
        assert np.abs(out[k].astype(np.int32) - np.rint(expected)).max() <= 1


@given(x=batches(dtype=np.float64), oh=st.integers(1, 9), ow=st.integers(1, 9))
def test_resize_float_images_stay_float_and_exact(x, oh, ow):
    out = Resize((oh, ow))(x)
    assert out.dtype == np.float64
    for k in range(len(x)):
        np.testing.assert_allclose(out[k], _resize_reference(x[k], oh, ow, Inter.LINEAR), rtol=1e-12, atol=1e-12)


def test_resize_int_size_sets_the_shorter_side():
    assert Resize(16)(np.zeros((32, 48, 3), np.uint8)).shape == (16, 24, 3)
    assert Resize(16)(np.zeros((2, 50, 32, 1), np.uint8)).shape == (2, 25, 16, 1)
    assert Resize(7)(np.zeros((10, 10, 3), np.uint8)).shape == (7, 7, 3)
    assert Resize((5, 9)).output_size(100, 3) == (5, 9)


def test_resize_keeps_constants_and_same_size_is_a_copy():
    x = np.full((2, 5, 7, 3), 200, np.uint8)
    np.testing.assert_array_equal(Resize((11, 3))(x), 200)
    y = np.random.default_rng(0).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    same = Resize((5, 7))(y)
    np.testing.assert_array_equal(same, y)
    assert same is not y


def test_resize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="Resize: size must be positive, got 0"):
        Resize(0)
    with pytest.raises(ValueError, match="Resize: interpolation must be Inter.LINEAR or Inter.NEAREST"):
        Resize(4, interpolation="cubic")


# ---------------------------------------------------------------- Rescale, Normalize, HWC2CHW

@given(x=batches())
def test_rescale(x):
    out = Rescale(1 / 255, -0.5)(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, x.astype(np.float64) / 255 - 0.5, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(Rescale(2.0, 1.0)(x[0, :, :, 0]), 2.0 * x[0, :, :, 0] + 1.0)  # any shape


@given(x=batches())
def test_normalize_matches_per_pixel_reference(x):
    c = x.shape[-1]
    mean, std = [10.0, 120.5, 255.0][:c], [2.0, 60.0, 0.5][:c]
    out = Normalize(mean, std)(x)
    assert out.dtype == np.float32 and out.shape == x.shape
    expected = np.empty(x.shape)
    for idx in np.ndindex(*x.shape[:-1]):
        for ch in range(c):
            expected[idx + (ch,)] = (float(x[idx + (ch,)]) - mean[ch]) / std[ch]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(Normalize(mean, std)(x[0]), expected[0], rtol=1e-5, atol=1e-4)
    chw = Normalize(mean, std, is_hwc=False)(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    np.testing.assert_allclose(chw, expected.transpose(0, 3, 1, 2), rtol=1e-5, atol=1e-4)


def test_normalize_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"Normalize: std must be positive, got \[1.0, 0.0, 1.0\]"):
        Normalize([0, 0, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="Normalize: mean and std must be sequences .* same length"):
        Normalize([0, 0, 0], [1, 1])
    with pytest.raises(ValueError, match=r"Normalize: 3 mean/std values for an image of shape \(4, 4, 1\) "
                                         r"with 1 channels \(HWC\); expected 1"):
        Normalize([0, 0, 0], [1, 1, 1])(np.zeros((4, 4, 1), np.uint8))
    with pytest.raises(ValueError, match=r"Normalize: got an array of shape \(4, 4\); expected CHW"):
        Normalize([0], [1], is_hwc=False)(np.zeros((4, 4)))


@given(x=batches())
def test_hwc2chw(x):
    out = HWC2CHW()(x)
    assert out.shape == (x.shape[0], x.shape[3], x.shape[1], x.shape[2]) and out.flags.c_contiguous
    for k, i, j, ch in np.ndindex(*x.shape):
        assert out[k, ch, i, j] == x[k, i, j, ch]
    np.testing.assert_array_equal(HWC2CHW()(x[0]), out[0])
    np.testing.assert_array_equal(HWC2CHW()(x[:, ::-1]), out[:, :, ::-1])  # strided input


def test_normalize_then_hwc2chw_is_contiguous_and_exact():
    x = np.random.default_rng(0).integers(0, 256, (5, 6, 7, 3), dtype=np.uint8)
    norm = Normalize([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    hwc = norm(x)
    chw = HWC2CHW()(hwc)
    assert chw.flags.c_contiguous and chw.shape == (5, 3, 6, 7)
    expected = (x.astype(np.float64) - [1.0, 2.0, 3.0]) / [4.0, 5.0, 6.0]
    np.testing.assert_allclose(chw, expected.transpose(0, 3, 1, 2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(HWC2CHW()(norm(x[0])), expected[0].transpose(2, 0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", [RandomCrop(2), RandomHorizontalFlip(), RandomVerticalFlip(), Resize(2),
                                Normalize([0], [1]), HWC2CHW()], ids=lambda op: type(op).__name__)
def test_wrong_layout_names_the_transform_and_the_shape(op):
    name = type(op).__name__
    kwargs = {"rng": np.random.default_rng(0)} if getattr(op, "random", False) else {}
    with pytest.raises(ValueError, match=rf"{name}: got an array of shape \(4, 4\); expected one image in HWC"):
        op(np.zeros((4, 4), np.uint8), **kwargs)
    with pytest.raises(ValueError, match=rf"{name}: got an array of shape \(1, 2, 4, 4, 3\)"):
        op(np.zeros((1, 2, 4, 4, 3), np.uint8), **kwargs)
    with pytest.raises(ValueError, match=rf"{name}: got shape \(2, 3, 32, 32\), which looks channels-first"):
        op(np.zeros((2, 3, 32, 32), np.uint8), **kwargs)
    with pytest.raises(ValueError, match=rf"{name}: got shape \(3, 32, 32\), which looks channels-first"):
        op(np.zeros((3, 32, 32), np.uint8), **kwargs)


def test_cifar_augmentation_chain_shapes_and_types():
    x = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
    gen = np.random.default_rng(0)
    y = RandomCrop(32, padding=4)(x, rng=gen)
    y = RandomHorizontalFlip()(y, rng=gen)
    y = Normalize([125.3, 123.0, 113.9], [63.0, 62.1, 66.7])(y)
    y = HWC2CHW()(y)
    assert y.shape == (16, 3, 32, 32) and y.dtype == np.float32 and y.flags.c_contiguous
