"""Shape-manipulation ops: Pad, Tile, BroadcastTo (primitives); split / Split (a tuple of
StridedSlices); shape / Shape and scalar_to_tensor / ScalarToTensor (no data computed); and
``Tensor.tile``, ``Tensor.broadcast_to``, ``Tensor.split`` (``install``).

The primitives' backwards are adjoints of where the forward put each element: Pad slices
the gradient back out, Tile sums it over the tiles, BroadcastTo sums it over the broadcast
dimensions. Split, Shape and ScalarToTensor are not Primitives (a primitive returns one
Tensor computed from its inputs), so they need no sharding rule of their own.
"""
import numpy

from .. import backend
from ..backend import get_array_module
from ..tensor import Tensor, float32
from .array import _check_array, _check_int, _int_tuple, check_dtype
from .indexing import StridedSlice
from .primitive import Primitive, _check_strategy, normalize_axis, sum_to_shape


# ---- Pad ------------------------------------------------------------------------------------

def _pairs(op, paddings):
    """paddings as a tuple of (before, after) int pairs, or a TypeError naming the op."""
    if isinstance(paddings, (tuple, list)) and all(isinstance(p, (tuple, list)) for p in paddings):
        pairs = tuple(_int_tuple(op, "every pair of paddings", p) for p in paddings)
        for d, p in enumerate(pairs):
            if len(p) != 2:
                raise ValueError(f"{op}: every entry of paddings must be a (before, after) pair, got paddings[{d}] "
                                 f"= {p}")
        return pairs
    raise TypeError(f"{op}: paddings must be a tuple of (before, after) pairs of ints, got {paddings!r}")


class Pad(Primitive):
    """Pads x with zeros: ``paddings[d] = (before, after)`` for every dimension d (MindSpore's Pad).

    ``ops.pad`` runs this primitive too, with PyTorch-style pads (which may be negative: they
    crop) and a fill value. MindSpore's Pad takes only a tuple; a list is accepted as well.

    Args:
        paddings: one (before, after) pair of non-negative ints per dimension of x.

    Example:
        >>> ops.Pad(((1, 1), (0, 2)))(x)     # x (2, 3) -> (4, 5)
    """

    def __init__(self, paddings):
        super().__init__()
        self.paddings = _pairs(self.name, paddings)
        for d, (lo, hi) in enumerate(self.paddings):
            if lo < 0 or hi < 0:
                raise ValueError(f"{self.name}: every entry of paddings must be >= 0, got paddings[{d}] = "
                                 f"({lo}, {hi}) (ops.pad crops with negative pads)")
        self.value = 0

    @classmethod
    def _constant(cls, paddings, value):
        """What ops.pad runs: pairs that may be negative (crop), filled with ``value``."""
        prim = cls(())
        prim.paddings, prim.value = paddings, value
        return prim

    def windows(self, shape):
        """(x's kept block, where it goes in the output, the output shape) for an x of ``shape``.

        Output index i of a dimension reads x[i - before] where that is inside x, else the fill
        value; cropping (negative pads) just shortens the kept run. The sharding rule asks this too.
        """
        shape = tuple(shape)
        if len(self.paddings) != len(shape):
            raise ValueError(f"{self.name}: paddings has {len(self.paddings)} pair(s) but x has {len(shape)} "
                             f"dimension(s) (shape {shape}); expected one (before, after) pair per dimension")
        src, dst, out = [], [], []
        for d, (n, (lo, hi)) in enumerate(zip(shape, self.paddings)):
            if lo < -n or hi < -n or n + lo + hi < 0:
                raise ValueError(f"{self.name}: padding ({lo}, {hi}) crops more than the {n} element(s) of dimension "
                                 f"{d} of x (shape {shape}); each pad must be >= -{n} and their sum >= -{n}")
            a, b = max(-lo, 0), min(n + hi, n)
            b = max(a, b)
            src.append(slice(a, b))
            dst.append(slice(a + lo, b + lo))
            out.append(n + lo + hi)
        return tuple(src), tuple(dst), tuple(out)

    def forward(self, x):
        _check_array(self.name, "x", x)
        self.src, self.dst, out_shape = self.windows(x.shape)
        self.x_shape = tuple(x.shape)
        # NOTE: full() casts the value to x's dtype, as MindSpore does (2.5 pads an int tensor with 2).
        y = get_array_module(x).full(out_shape, self.value, dtype=x.dtype)
        y[self.dst] = x[self.src]
        return y

    def backward(self, gy):
        gx = get_array_module(gy).zeros(self.x_shape, gy.dtype)
        gx[self.src] = gy[self.dst]
        return (gx,)


_PAD_MODES = ("constant", "reflect", "replicate", "circular")


def pad(input_x, padding, mode='constant', value=None):
    """Pads (or, with negative pads, crops) the last ``len(padding) // 2`` dimensions of input_x.

    ``padding`` is PyTorch's: (before, after) of the LAST dimension first, then of the one
    before it, and so on. A negative pad crops that many elements; each pad must be >= -size
    (MindSpore's bound). Only ``mode='constant'`` is implemented. Unlike MindSpore, which refuses
    an empty result, cropping a dimension to size 0 is allowed, as in PyTorch.

    Args:
        input_x: Tensor.
        padding: tuple or list of ints, of even length <= 2 * input_x.ndim.
        mode: 'constant' ('reflect', 'replicate' and 'circular' raise NotImplementedError).
        value: the fill value (None: 0), cast to input_x's dtype.

    Example:
        >>> ops.pad(x, (1, 2))            # x (3, 4) -> (3, 7): 1 before, 2 after the last dim
        >>> ops.pad(x, (0, 0, -1, 1))     # drops the first row, adds a row of zeros at the end
    """
    if not hasattr(input_x, "shape"):
        raise TypeError(f"pad: input_x must be a Tensor, got {type(input_x).__name__}")
    if not isinstance(mode, str):
        raise TypeError(f"pad: mode must be a str, got {mode!r}")
    if mode not in _PAD_MODES:
        raise ValueError(f"pad: mode must be one of {_PAD_MODES}, got {mode!r}")
    if mode != "constant":
        if value is not None:
            raise ValueError(f"pad: mode {mode!r} takes no value, got value={value!r}")
        raise NotImplementedError(f"pad: mode {mode!r} is not implemented; only mode='constant' is")
    if value is None:
        value = 0
    elif not isinstance(value, (int, float)):
        raise TypeError(f"pad: value must be an int, a float or None, got {value!r}")
    if isinstance(padding, Tensor):
        padding = padding.asnumpy()  # a configuration value, read once at the boundary
    if not isinstance(padding, (tuple, list)) and not hasattr(padding, "tolist"):
        raise TypeError(f"pad: padding must be a tuple or list of ints, got {padding!r}")
    padding = _int_tuple("pad", "padding", padding)
    nd = len(input_x.shape)
    if len(padding) % 2:
        raise ValueError(f"pad: padding must have an even length ((before, after) per dimension), got {padding}")
    if len(padding) // 2 > nd:
        raise ValueError(f"pad: padding {padding} pads {len(padding) // 2} dimensions but input_x has only {nd} "
                         f"(shape {tuple(input_x.shape)})")
    pairs = [(0, 0)] * nd
    for k in range(len(padding) // 2):
        pairs[nd - 1 - k] = (padding[2 * k], padding[2 * k + 1])
    return Pad._constant(tuple(pairs), value)(input_x)


# ---- Tile -----------------------------------------------------------------------------------

class Tile(Primitive):
    """Repeats x ``dims[i]`` times along dimension i: output size ``x.shape[i] * dims[i]``.

    When dims is longer than x.ndim, x gets leading size-1 dimensions first; when shorter,
    dims gets leading 1s (as MindSpore 2.10, PyTorch and NumPy do). A multiple may be 0.

    Example:
        >>> ops.Tile()(x, (2, 1, 3))      # x (4, 5) -> (2, 4, 15)
    """

    n_inputs = 2
    n_tensor_inputs = 1

    def aligned(self, shape, dims):
        """(dims, x's shape), both padded with leading 1s to the output's rank; checks dims."""
        dims = _int_tuple(self.name, "dims", dims)
        for m in dims:
            if m < 0:
                raise ValueError(f"{self.name}: every entry of dims must be >= 0, got dims={dims}")
        nd = max(len(dims), len(shape))
        return (1,) * (nd - len(dims)) + dims, (1,) * (nd - len(shape)) + tuple(shape)

    def forward(self, x, dims):
        _check_array(self.name, "x", x)
        self.dims, self.shape_nd = self.aligned(x.shape, dims)
        self.x_shape = tuple(x.shape)
        return get_array_module(x).tile(x.reshape(self.shape_nd), self.dims)

    def backward(self, gy):
        # The output is (m0 tiles of n0, m1 tiles of n1, ...): viewed as (m0, n0, m1, n1, ...),
        # summing over the m axes adds the gradients of every copy of an element.
        split = tuple(v for m, n in zip(self.dims, self.shape_nd) for v in (m, n))
        gx = gy.reshape(split).sum(axis=tuple(range(0, len(split), 2)))
        return gx.reshape(self.x_shape), None


def tile(input, dims):  # noqa: A002  (MindSpore's argument name)
    """Repeats input ``dims[i]`` times along dimension i (see :class:`Tile`).

    Example:
        >>> ops.tile(x, (2, 2))           # x (2, 3) -> (4, 6)
    """
    return Tile()(input, dims)


# ---- BroadcastTo ----------------------------------------------------------------------------

class BroadcastTo(Primitive):
    """Broadcasts x to ``shape`` (NumPy's rules); an entry of -1 keeps x's size in that dimension.

    Args:
        shape: tuple of ints, at least x.ndim long; -1 only where x has a dimension.

    Returns a read-only view of x (as PyTorch's ``expand``); its gradient sums over the
    broadcast dimensions.

    Example:
        >>> ops.BroadcastTo((4, -1))(x)   # x (1, 3) -> (4, 3)
    """

    def __init__(self, shape):
        super().__init__()
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"{self.name}: shape must be a tuple of ints, got {shape!r}")
        self.shape = _int_tuple(self.name, "shape", shape)
        for n in self.shape:
            if n < -1:
                raise ValueError(f"{self.name}: every entry of shape must be >= 0 or -1, got shape={self.shape}")

    def target(self, x_shape):
        """``shape`` with its -1 entries resolved against x's shape, or a ValueError naming both."""
        x_shape, shape = tuple(x_shape), self.shape
        lead = len(shape) - len(x_shape)
        if lead < 0:
            raise ValueError(f"{self.name}: shape {shape} has {len(shape)} entries, fewer than the {len(x_shape)} "
                             f"dimensions of x (shape {x_shape})")
        out = []
        for j, t in enumerate(shape):
            if j < lead:
                if t == -1:
                    raise ValueError(f"{self.name}: shape {shape} has -1 at position {j}, a new leading dimension "
                                     f"that x (shape {x_shape}) does not have; -1 may only keep an existing one")
                out.append(t)
                continue
            n = x_shape[j - lead]
            if t != -1 and n != 1 and n != t:
                raise ValueError(f"{self.name}: cannot broadcast x of shape {x_shape} to {shape}: dimension "
                                 f"{j - lead} of x has size {n}, which is neither 1 nor {t}")
            out.append(n if t == -1 else t)
        return tuple(out)

    def forward(self, x):
        _check_array(self.name, "x", x)
        self.x_shape = tuple(x.shape)
        return get_array_module(x).broadcast_to(x, self.target(x.shape))

    def backward(self, gy):
        return (sum_to_shape(gy, self.x_shape),)


def broadcast_to(input, shape):  # noqa: A002  (MindSpore's argument name)
    """Broadcasts input to ``shape``; -1 keeps a dimension (see :class:`BroadcastTo`).

    Example:
        >>> ops.broadcast_to(x, (2, -1))  # x (1, 3) -> (2, 3)
    """
    return BroadcastTo(shape)(input)


# ---- Split ----------------------------------------------------------------------------------

class Split:
    """Splits x along ``axis`` into ``output_num`` equal parts: a tuple of Tensors (MindSpore's Split).

    Not a Primitive (a primitive returns one Tensor): each part is a :class:`StridedSlice` of
    x, so each part's gradient lands in its slice and parts left out of the loss give zeros.
    Under tensor parallelism the parts run by StridedSlice's rule: the split axis whole, the
    other dimensions keep their cuts. ``shard`` gives each slice the strategy.

    Args:
        axis: the dimension to split (negative counts from the end).
        output_num: how many parts; must divide x.shape[axis].

    Example:
        >>> a, b = ops.Split(1, 2)(x)     # x (4, 6) -> two (4, 3)
    """

    def __init__(self, axis=0, output_num=1):
        self.axis = _check_int(self.name, "axis", axis)
        self.output_num = _check_int(self.name, "output_num", output_num)
        if self.output_num < 1:
            raise ValueError(f"{self.name}: output_num must be >= 1, got {output_num}")
        self.in_strategy = None
        self._slices = {}  # axis -> its StridedSlice, kept so a parallel run decides its layout once

    name = "Split"

    def shard(self, in_strategy, out_strategy=None):
        """Gives every part's StridedSlice this strategy (one tuple of cuts for x). Returns self.

        Example:
            >>> split = ops.Split(1, 2).shard(((4, 1),))
        """
        in_strategy = _check_strategy(self.name, "in_strategy", in_strategy, 1)
        if out_strategy is not None:
            _check_strategy(self.name, "out_strategy", out_strategy, None)
        cuts = in_strategy[0]
        if -len(cuts) <= self.axis < len(cuts) and cuts[self.axis] != 1:
            raise ValueError(f"{self.name}.shard: in_strategy {in_strategy} cuts the split axis {self.axis} "
                             f"{cuts[self.axis]} ways; it must be whole (cut 1)")
        self.in_strategy = in_strategy
        self._slices = {}
        return self

    def __call__(self, x):
        axis, n = _split_axis(self.name, x, self.axis)
        if n % self.output_num:
            raise ValueError(f"{self.name}: dimension {axis} of x (shape {tuple(x.shape)}) has size {n}, not "
                             f"divisible by output_num={self.output_num}")
        return self.parts(x, axis, [n // self.output_num] * self.output_num)

    def parts(self, x, axis, sizes):
        """The consecutive slices of x along ``axis`` (non-negative) with the given sizes."""
        sl = self._slices.get(axis)
        if sl is None:
            lead = (1 << axis) - 1  # dimensions before the axis are taken whole, as are those after it
            sl = self._slices[axis] = StridedSlice(begin_mask=lead, end_mask=lead)
            if self.in_strategy is not None:
                sl.shard(self.in_strategy)
        out, start = [], 0
        for size in sizes:
            begin, end = (0,) * axis + (start,), (0,) * axis + (start + size,)
            out.append(sl(x, begin, end, (1,) * (axis + 1)))
            start += size
        return tuple(out)

    def __repr__(self):
        strategy = f".shard({self.in_strategy})" if self.in_strategy is not None else ""
        return f"Split(axis={self.axis}, output_num={self.output_num}){strategy}"


def _split_axis(op, x, axis):
    """(axis made non-negative, x's size along it), checking x and axis."""
    if not hasattr(x, "shape") or not hasattr(x, "ndim"):
        raise TypeError(f"{op}: x must be a Tensor, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError(f"{op}: cannot split a 0-d tensor (x has shape ())")
    axis = normalize_axis(op, _check_int(op, "axis", axis), x.ndim)[0]
    return axis, x.shape[axis]


def split(tensor, split_size_or_sections, axis=0):
    """Splits tensor along ``axis``: into chunks of ``split_size_or_sections`` (an int; the last
    chunk is smaller when the size does not divide), or into sections of the listed sizes
    (zero-length sections allowed, summing to tensor.shape[axis]). Returns a tuple of Tensors.

    A chunk size must be > 0 (MindSpore's rule; PyTorch accepts 0 for an empty dimension).
    Gradients: each part's lands in its slice; parts not used in the loss give zeros.

    Example:
        >>> ops.split(x, 2)               # x (5, 3) -> (2, 3), (2, 3), (1, 3)
        >>> ops.split(x, [1, 0, 4], 0)    # -> (1, 3), (0, 3), (4, 3)
    """
    axis, n = _split_axis("split", tensor, axis)
    s = split_size_or_sections
    if isinstance(s, (int, numpy.integer)) and not isinstance(s, (bool, numpy.bool_)):
        if s <= 0:
            raise ValueError(f"split: split_size_or_sections must be > 0 when it is an int, got {s}")
        sizes = [min(s, n - start) for start in range(0, n, s)] or [0]
    elif isinstance(s, (tuple, list)):
        sizes = list(_int_tuple("split", "split_size_or_sections", s))
        if any(k < 0 for k in sizes):
            raise ValueError(f"split: every section in split_size_or_sections must be >= 0, got {tuple(s)}")
        if sum(sizes) != n:
            raise ValueError(f"split: the sections {tuple(s)} sum to {sum(sizes)}, but dimension {axis} of the tensor "
                             f"(shape {tuple(tensor.shape)}) has size {n}")
    else:
        raise TypeError(f"split: split_size_or_sections must be an int or a tuple/list of ints, got {s!r}")
    return Split(axis).parts(tensor, axis, sizes)


# ---- Shape and ScalarToTensor: no data computed ---------------------------------------------

class Shape:
    """The shape of a Tensor, as a tuple of ints (MindSpore's Shape).

    Not a Primitive: it reads ``x.shape``, which under tensor parallelism is the GLOBAL shape
    of a sharded tensor (its block's is ``x.data.shape``), so it needs no sharding rule.

    Example:
        >>> ops.Shape()(x)                # (2, 3)
    """

    name = "Shape"

    def __call__(self, input_x):
        if not isinstance(input_x, Tensor):
            raise TypeError(f"{self.name}: input_x must be a Tensor, got {type(input_x).__name__}")
        return tuple(input_x.shape)

    def __repr__(self):
        return "Shape()"


def shape(input_x):
    """The shape of input_x as a tuple of ints (the global shape of a sharded tensor).

    Example:
        >>> ops.shape(minidl.Tensor(np.ones((2, 3))))    # (2, 3)
    """
    return Shape()(input_x)


class ScalarToTensor:
    """A 0-d Tensor holding a Python scalar, on the current device (MindSpore's ScalarToTensor).

    Called as ``ScalarToTensor()(input_x, dtype=float32)``: the scalar (bool, int or float;
    MindSpore refuses NumPy scalars and Tensors, and so does this) is converted to ``dtype``,
    so the default turns an int or a bool into a float32. It records no graph.

    Example:
        >>> ops.ScalarToTensor()(1)       # Tensor(1.0, dtype=float32)
    """

    name = "ScalarToTensor"

    def __call__(self, input_x, dtype=float32):
        if not isinstance(input_x, (bool, int, float)):
            raise TypeError(f"{self.name}: input_x must be a Python bool, int or float, got "
                            f"{type(input_x).__name__} {input_x!r}")
        target = check_dtype(self.name, dtype)
        # astype on the host, not asarray(input_x, dtype): NumPy 2 refuses out-of-range Python ints there.
        return Tensor._wrap(backend.to_device(numpy.asarray(input_x).astype(target)))

    def __repr__(self):
        return "ScalarToTensor()"


def scalar_to_tensor(input_x, dtype=float32):
    """A 0-d Tensor holding ``input_x`` (bool, int or float) as ``dtype``, on the current device.

    Example:
        >>> ops.scalar_to_tensor(3)                       # Tensor(3.0, dtype=float32)
        >>> ops.scalar_to_tensor(3, minidl.int32)         # Tensor(3, dtype=int32)
    """
    return ScalarToTensor()(input_x, dtype)


# ---- Tensor methods -------------------------------------------------------------------------

def _varargs(values):
    """``f((2, 3))``, ``f([2, 3])`` and ``f(2, 3)`` alike: MindSpore's Tensor methods take all three."""
    return tuple(values[0]) if len(values) == 1 and isinstance(values[0], (tuple, list)) else values


def _tensor_split(self, split_size, dim=0, *, axis=None):
    # MindSpore 2.10 names the dimension ``dim`` here; ``axis`` is its older overload.
    return split(self, split_size, dim if axis is None else axis)


def install():
    """Attaches ``tile``, ``broadcast_to`` and ``split`` to Tensor (called once by minidl.ops)."""
    Tensor.tile = lambda self, *dims: tile(self, _varargs(dims))
    Tensor.broadcast_to = lambda self, *shape: broadcast_to(self, _varargs(shape))
    Tensor.split = _tensor_split


__all__ = ['Pad', 'Tile', 'BroadcastTo', 'Split', 'Shape', 'ScalarToTensor',
           'pad', 'tile', 'broadcast_to', 'split', 'shape', 'scalar_to_tensor']
