"""General transforms with MindSpore's names (``mindspore.dataset.transforms``): TypeCast, Compose."""
import numpy

from .. import backend
from ..tensor import Tensor

__all__ = ["TypeCast", "Compose"]


class TypeCast:
    """Casts a column to ``data_type`` (MindSpore's ``transforms.TypeCast``).

    Args:
        data_type: a NumPy dtype, a minidl dtype (``minidl.int32`` ...) or a dtype name.

    Example:
        >>> TypeCast(numpy.int32)(numpy.array([1, 2], numpy.uint8)).dtype
        dtype('int32')
    """

    def __init__(self, data_type):
        try:
            self.data_type = numpy.dtype(data_type)
        except TypeError:
            raise TypeError(f"TypeCast: data_type must be a NumPy or minidl dtype, got {data_type!r}") from None

    def __call__(self, x):
        if isinstance(x, Tensor):
            x = x.data
        if not hasattr(x, "astype"):
            x = numpy.asarray(x)
        return x.astype(self.data_type)


class Compose:
    """Applies transforms one after another, as one transform (MindSpore's ``transforms.Compose``).

    A transform that returns a tuple feeds all of its outputs to the next one. When any of the
    transforms is random, the Compose is random too and hands its ``rng`` to each random one
    in turn, so the pipeline's per-row seeding still makes the result reproducible.

    Args:
        transforms: a non-empty list of callables.

    Example:
        >>> from minidl.dataset import vision
        >>> aug = Compose([vision.RandomHorizontalFlip(), vision.HWC2CHW()])
        >>> aug(numpy.zeros((4, 8, 8, 3), numpy.uint8), rng=numpy.random.default_rng(0)).shape
        (4, 3, 8, 8)
    """

    def __init__(self, transforms):
        transforms = list(transforms)
        if not transforms:
            raise ValueError("Compose: transforms must be a non-empty list of callables, got []")
        for i, op in enumerate(transforms):
            if not callable(op):
                raise TypeError(f"Compose: transforms[{i}] is {op!r}, which is not callable")
        self.transforms = transforms
        self.random = any(getattr(op, "random", False) for op in transforms)

    def __call__(self, *args, rng=None):
        if self.random and rng is None:
            rng = backend.rng()
        for op in self.transforms:
            out = op(*args, rng=rng) if getattr(op, "random", False) else op(*args)
            args = out if isinstance(out, tuple) else (out,)
        return args[0] if len(args) == 1 else args
