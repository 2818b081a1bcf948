"""Image transforms with MindSpore's names (``mindspore.dataset.vision``), vectorised over a batch.

Every transform takes one image in HWC layout (H, W, C) or a batch in NHWC (N, H, W, C) and
works on the whole batch with array operations, so mapping them after ``.batch()`` keeps
augmentation cheap next to a training step. Random transforms have ``random = True`` and take
``rng=`` (a ``numpy.random.Generator``): the dataset pipeline passes one derived from (seed,
epoch, index), so every rank and every resumed run draws the same crops and flips. Called
without ``rng`` they draw from ``minidl.backend.rng()``.

    >>> from minidl.dataset import vision
    >>> ops = [vision.RandomCrop(32, padding=4), vision.RandomHorizontalFlip(),
    ...        vision.Normalize(mean=[125.3, 123.0, 113.9], std=[63.0, 62.1, 66.7]), vision.HWC2CHW()]
"""
import numbers

import numpy

from .. import backend
from ..backend import get_array_module
from ..tensor import Tensor

__all__ = ["Inter", "Border", "RandomCrop", "RandomHorizontalFlip", "RandomVerticalFlip", "Resize",
           "Rescale", "Normalize", "HWC2CHW"]


class Inter:
    """Interpolation modes for Resize (MindSpore's ``vision.Inter``)."""
    NEAREST = "nearest"
    LINEAR = "linear"
    BILINEAR = "linear"


class Border:
    """Padding modes for RandomCrop (MindSpore's ``vision.Border``; NumPy's ``pad`` mode names)."""
    CONSTANT = "constant"
    EDGE = "edge"
    REFLECT = "reflect"
    SYMMETRIC = "symmetric"


def _as_batch(name, img):
    """Checks that img is HWC or NHWC; returns (the NHWC batch, whether img was one image)."""
    if isinstance(img, Tensor):
        img = img.data
    if not hasattr(img, "ndim"):
        img = numpy.asarray(img)
    if img.ndim not in (3, 4):
        raise ValueError(f"{name}: got an array of shape {tuple(img.shape)}; expected one image in HWC "
                         f"layout (H, W, C) or a batch in NHWC layout (N, H, W, C)")
    h, c = img.shape[-3], img.shape[-1]
    # A channels-first array has its 1 or 3 channels where H should be; an HWC image whose
    # last axis is not a channel count is the giveaway.
    if h in (1, 3) and c not in (1, 3, 4):
        raise ValueError(f"{name}: got shape {tuple(img.shape)}, which looks channels-first (CHW/NCHW); "
                         f"expected HWC (H, W, C) or NHWC (N, H, W, C): apply HWC2CHW after this transform")
    return (img[None] if img.ndim == 3 else img), img.ndim == 3


def _pair(value, name, arg):
    """(h, w) from an int or a 2-sequence of positive ints."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value, value)
    try:
        h, w = value
    except (TypeError, ValueError):
        raise TypeError(f"{name}: {arg} must be an int or a sequence (h, w), got {value!r}") from None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in (h, w)):
        raise ValueError(f"{name}: {arg} must be positive ints, got {value!r}")
    return int(h), int(w)


def _padding(padding):
    """(left, top, right, bottom) from MindSpore's int / 2-sequence / 4-sequence forms."""
    if padding is None:
        return (0, 0, 0, 0)
    if isinstance(padding, numbers.Integral) and not isinstance(padding, bool):
        padding = (padding,) * 4
    padding = tuple(padding)
    if len(padding) == 2:  # MindSpore: the first value pads left and top, the second right and bottom
        padding = (padding[0], padding[0], padding[1], padding[1])
    if len(padding) != 4 or not all(isinstance(p, numbers.Integral) and not isinstance(p, bool) and p >= 0
                                    for p in padding):
        raise ValueError(f"RandomCrop: padding must be a non-negative int or a sequence of 2 or 4 of them "
                         f"(left, top, right, bottom), got {padding!r}")
    return tuple(int(p) for p in padding)


def _rng(rng):
    return backend.rng() if rng is None else rng


class RandomCrop:
    """Crops each image at a random place, after optional padding (MindSpore's ``vision.RandomCrop``).

    Args:
        size: output (h, w), or an int for a square crop.
        padding: pixels added before cropping: an int (all sides), (left/top, right/bottom) or
            (left, top, right, bottom).
        pad_if_needed: pad an image smaller than ``size`` up to it (by the shortfall on both sides).
        fill_value: the constant for ``padding_mode=Border.CONSTANT``: one number or one per channel.
        padding_mode: Border.CONSTANT, EDGE, REFLECT or SYMMETRIC.

    Example:
        >>> crop = RandomCrop(32, padding=4)            # the CIFAR-10 augmentation
        >>> crop(numpy.zeros((8, 32, 32, 3), numpy.uint8), rng=numpy.random.default_rng(0)).shape
        (8, 32, 32, 3)
    """
    random = True

    def __init__(self, size, padding=None, pad_if_needed=False, fill_value=0, padding_mode=Border.CONSTANT):
        self.size = _pair(size, "RandomCrop", "size")
        self.padding = _padding(padding)
        self.pad_if_needed = bool(pad_if_needed)
        if padding_mode not in (Border.CONSTANT, Border.EDGE, Border.REFLECT, Border.SYMMETRIC):
            raise ValueError(f"RandomCrop: padding_mode must be one of 'constant', 'edge', 'reflect', "
                             f"'symmetric', got {padding_mode!r}")
        self.padding_mode = padding_mode
        fill = numpy.asarray(fill_value)
        if fill.ndim > 1 or fill.size == 0 or fill.dtype.kind not in "biuf":
            raise ValueError(f"RandomCrop: fill_value must be a number or one number per channel, got {fill_value!r}")
        self.fill_value = fill_value

    def _pad(self, x, top, bottom, left, right):
        xp = get_array_module(x)
        n, h, w, c = x.shape
        if self.padding_mode != Border.CONSTANT:
            return xp.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)), mode=self.padding_mode)
        fill = numpy.asarray(self.fill_value)
        if fill.ndim == 1 and fill.size not in (1, c):
            raise ValueError(f"RandomCrop: fill_value {self.fill_value!r} has {fill.size} values for images "
                             f"with {c} channels; expected 1 or {c}")
        if numpy.issubdtype(x.dtype, numpy.integer):
            info = numpy.iinfo(x.dtype)
            if fill.min() < info.min or fill.max() > info.max:
                raise ValueError(f"RandomCrop: fill_value {self.fill_value!r} does not fit {x.dtype} images; "
                                 f"expected values in [{info.min}, {info.max}]")
        out = xp.empty((n, h + top + bottom, w + left + right, c), dtype=x.dtype)
        out[...] = xp.asarray(fill.astype(x.dtype))  # broadcasts along the channel axis
        out[:, top:top + h, left:left + w] = x
        return out

    def __call__(self, img, rng=None):
        x, single = _as_batch("RandomCrop", img)
        xp = get_array_module(x)
        n, h, w, c = x.shape
        left, top, right, bottom = self.padding
        ch, cw = self.size
        if self.pad_if_needed:
            short_h, short_w = ch - (h + top + bottom), cw - (w + left + right)
            if short_h > 0:
                top, bottom = top + short_h, bottom + short_h
            if short_w > 0:
                left, right = left + short_w, right + short_w
        if top or bottom or left or right:
            x = self._pad(x, top, bottom, left, right)
        ph, pw = x.shape[1:3]
        if ph < ch or pw < cw:
            raise ValueError(f"RandomCrop: crop size {self.size} is larger than the image {(ph, pw)} "
                             f"(after padding {self.padding}); pass a larger padding or pad_if_needed=True")
        rng = _rng(rng)
        ty = rng.integers(0, ph - ch + 1, size=n)
        tx = rng.integers(0, pw - cw + 1, size=n)
        # Every (ch, cw) window as a view, then one gather of the chosen window per image.
        s = x.strides
        windows = xp.lib.stride_tricks.as_strided(x, shape=(n, ph - ch + 1, pw - cw + 1, ch, cw, c),
                                                  strides=(s[0], s[1], s[2], s[1], s[2], s[3]))
        out = windows[xp.arange(n), xp.asarray(ty), xp.asarray(tx)]
        return out[0] if single else out


class _RandomFlip:
    random = True
    name = None
    axis = None  # of the NHWC batch

    def __init__(self, prob=0.5):
        if not isinstance(prob, numbers.Real) or not 0 <= prob <= 1:
            raise ValueError(f"{self.name}: prob must be a number in [0, 1], got {prob!r}")
        self.prob = float(prob)

    def __call__(self, img, rng=None):
        x, single = _as_batch(self.name, img)
        xp = get_array_module(x)
        chosen = numpy.flatnonzero(_rng(rng).random(len(x)) < self.prob)
        out = x.copy()
        if chosen.size:
            idx = xp.asarray(chosen)
            flipped = xp.flip(x[idx], axis=self.axis)
            if self.axis == 2:
                # Reversed columns of whole pixels leave NumPy an inner loop of C (1-4) values;
                # channel by channel it runs along a row, about 2.5x faster.
                for ch in range(x.shape[-1]):
                    out[idx, ..., ch] = flipped[..., ch]
            else:
                out[idx] = flipped
        return out[0] if single else out


class RandomHorizontalFlip(_RandomFlip):
    """Mirrors each image left-right with probability ``prob``, independently per image.

    Args:
        prob: probability of flipping an image (default 0.5).
    """
    name = "RandomHorizontalFlip"
    axis = 2


class RandomVerticalFlip(_RandomFlip):
    """Mirrors each image top-bottom with probability ``prob``, independently per image.

    Args:
        prob: probability of flipping an image (default 0.5).
    """
    name = "RandomVerticalFlip"
    axis = 1


def _linear_taps(out_size, in_size, xp):
    """Source indices and weights of bilinear resizing along one axis (half-pixel centres, as OpenCV)."""
    src = (numpy.arange(out_size, dtype=numpy.float64) + 0.5) * (in_size / out_size) - 0.5
    src = numpy.clip(src, 0, in_size - 1)
    i0 = numpy.floor(src).astype(numpy.intp)
    i1 = numpy.minimum(i0 + 1, in_size - 1)
    return xp.asarray(i0), xp.asarray(i1), src - i0


class Resize:
    """Resizes images (MindSpore's ``vision.Resize``), bilinear by default.

    Args:
        size: (h, w), or an int: the shorter side becomes ``size`` and the longer keeps the
            aspect ratio (rounded down), as in MindSpore and torchvision.
        interpolation: Inter.LINEAR (bilinear with half-pixel centres, as OpenCV, no
            antialiasing) or Inter.NEAREST.

    Integer images are rounded and clipped back to their dtype; float images stay float.

    Example:
        >>> Resize(16)(numpy.zeros((32, 48, 3), numpy.uint8)).shape
        (16, 24, 3)
    """

    def __init__(self, size, interpolation=Inter.LINEAR):
        if isinstance(size, numbers.Integral) and not isinstance(size, bool):
            if size <= 0:
                raise ValueError(f"Resize: size must be positive, got {size!r}")
            self.size = int(size)
        else:
            self.size = _pair(size, "Resize", "size")
        if interpolation not in (Inter.LINEAR, Inter.NEAREST):
            raise ValueError(f"Resize: interpolation must be Inter.LINEAR or Inter.NEAREST, got {interpolation!r}")
        self.interpolation = interpolation

    def output_size(self, h, w):
        """The (h, w) an image of (h, w) is resized to."""
        if isinstance(self.size, tuple):
            return self.size
        if h <= w:
            return self.size, max(1, int(self.size * w / h))
        return max(1, int(self.size * h / w)), self.size

    def __call__(self, img):
        x, single = _as_batch("Resize", img)
        xp = get_array_module(x)
        n, h, w, c = x.shape
        oh, ow = self.output_size(h, w)
        if (oh, ow) == (h, w):
            out = x.copy()
        elif self.interpolation == Inter.NEAREST:
            rows = xp.asarray(numpy.arange(oh) * h // oh)  # floor(i * h / oh), exact in integers
            cols = xp.asarray(numpy.arange(ow) * w // ow)
            out = x[:, rows][:, :, cols]
        else:
            work = numpy.float64 if x.dtype == numpy.float64 else numpy.float32
            y0, y1, wy = _linear_taps(oh, h, xp)
            x0, x1, wx = _linear_taps(ow, w, xp)
            wy = xp.asarray(wy.astype(work))[:, None, None]
            wx = xp.asarray(wx.astype(work))[:, None]
            top, bottom = x[:, y0].astype(work), x[:, y1].astype(work)
            rows = top + (bottom - top) * wy
            left, right = rows[:, :, x0], rows[:, :, x1]
            out = left + (right - left) * wx
            if numpy.issubdtype(x.dtype, numpy.integer):
                info = numpy.iinfo(x.dtype)
                out = xp.clip(xp.rint(out), info.min, info.max)
            out = out.astype(x.dtype, copy=False)
        return out[0] if single else out


class Rescale:
    """``x * rescale + shift`` as float32 (MindSpore's ``vision.Rescale``); any shape.

    Args:
        rescale: the scale, e.g. 1 / 255.
        shift: added after scaling.

    Example:
        >>> Rescale(1 / 255, 0.0)(numpy.full((2, 2, 3), 255, numpy.uint8)).max()
        np.float32(1.0)
    """

    def __init__(self, rescale, shift):
        self.rescale, self.shift = float(rescale), float(shift)

    def __call__(self, img):
        if isinstance(img, Tensor):
            img = img.data
        xp = get_array_module(img)
        out = xp.asarray(img).astype(numpy.float32)  # always a copy, so the in-place ops are safe
        out *= self.rescale
        out += self.shift
        return out


class Normalize:
    """``(x - mean) / std`` per channel, as float32 (MindSpore's ``vision.Normalize``).

    Args:
        mean: one value per channel (in the image's own scale: 0..255 for uint8 images).
        std: one positive value per channel.
        is_hwc: channels are the last axis (HWC / NHWC, default) or the third from last (CHW / NCHW).

    The HWC result is a transposed view of channels-first memory (not C-contiguous): the
    arithmetic runs faster there and a following HWC2CHW needs no copy.

    Example:
        >>> norm = Normalize(mean=[125.3, 123.0, 113.9], std=[63.0, 62.1, 66.7])
        >>> norm(numpy.zeros((4, 32, 32, 3), numpy.uint8)).dtype
        dtype('float32')
    """

    def __init__(self, mean, std, is_hwc=True):
        mean = numpy.atleast_1d(numpy.asarray(mean, dtype=numpy.float64))
        std = numpy.atleast_1d(numpy.asarray(std, dtype=numpy.float64))
        if mean.ndim != 1 or std.ndim != 1 or mean.shape != std.shape:
            raise ValueError(f"Normalize: mean and std must be sequences of one value per channel with the "
                             f"same length, got mean {mean.tolist()} and std {std.tolist()}")
        if not (std > 0).all():
            raise ValueError(f"Normalize: std must be positive, got {std.tolist()}")
        self.mean, self.std, self.is_hwc = mean, std, bool(is_hwc)
        # x * (1/std) + (-mean/std): one multiply-add instead of a subtract and a divide.
        self._scale = (1.0 / std).astype(numpy.float32)
        self._bias = (-mean / std).astype(numpy.float32)

    def __call__(self, img):
        if self.is_hwc:
            x, single = _as_batch("Normalize", img)
            x = x.transpose(0, 3, 1, 2)
        else:
            x = img.data if isinstance(img, Tensor) else img
            if x.ndim not in (3, 4):
                raise ValueError(f"Normalize: got an array of shape {tuple(x.shape)}; expected CHW (C, H, W) "
                                 f"or NCHW (N, C, H, W) with is_hwc=False")
            single = x.ndim == 3
            x = x[None] if single else x
        c = x.shape[1]
        if len(self.mean) not in (1, c):
            layout = "HWC" if self.is_hwc else "CHW"
            raise ValueError(f"Normalize: {len(self.mean)} mean/std values for an image of shape "
                             f"{tuple(img.shape)} with {c} channels ({layout}); expected {c}")
        xp = get_array_module(x)
        # Computed in channels-first memory whatever the layout: a per-channel 3-vector on the
        # last axis would make NumPy's inner loop 3 elements long (several times slower), and
        # an HWC result that is a transposed view of NCHW memory makes a following HWC2CHW free.
        out = x.astype(numpy.float32, order="C")
        out *= xp.asarray(self._scale.reshape(-1, 1, 1))
        out += xp.asarray(self._bias.reshape(-1, 1, 1))
        if self.is_hwc:
            out = out.transpose(0, 2, 3, 1)
        return out[0] if single else out


class HWC2CHW:
    """Moves the channel axis first: HWC -> CHW, NHWC -> NCHW (MindSpore's ``vision.HWC2CHW``).

    The result is C-contiguous. An input already channels-first in memory (Normalize's
    output is) is returned as a view, without a copy.

    Example:
        >>> HWC2CHW()(numpy.zeros((8, 32, 32, 3), numpy.uint8)).shape
        (8, 3, 32, 32)
    """

    def __call__(self, img):
        x, single = _as_batch("HWC2CHW", img)
        xp = get_array_module(x)
        out = xp.ascontiguousarray(x.transpose(0, 3, 1, 2))
        return out[0] if single else out
