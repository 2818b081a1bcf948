"""Indexing ops: StridedSlice (MindSpore's, with its masks), GetItem (Python indexing) and Gather
(rows of a table picked by an index tensor: embedding lookups).

Backwards write ``gy`` into zeros of x's shape: by assignment when the index is basic
(slices, ints, None, Ellipsis: no element is read twice), by ``_scatter_add`` when integer
arrays may repeat an element.
"""
import numpy

from ..backend import get_array_module
from ..tensor import Tensor
from .primitive import Primitive
from .array import _check_int, _int_tuple, _check_array, _scatter_add
from .loss import host_label_checks


class StridedSlice(Primitive):
    """x[begin:end:strides] per dimension, with TensorFlow / MindSpore bit masks.

    Bit i of a mask refers to entry i of begin/end/strides:
    begin_mask / end_mask: ignore begin[i] / end[i] (take the whole range in that direction);
    shrink_axis_mask: index with begin[i] and drop the dimension; new_axis_mask: insert a
    size-1 dimension (entry i ignored); ellipsis_mask: entry i stands for all dims not named.
    Dimensions past len(begin) are taken whole. Steps may be negative.

    Example:
        >>> ops.StridedSlice()(x, (0, 3), (2, 0), (1, -1))    # x[0:2, 3:0:-1]
    """

    n_inputs = 4
    n_tensor_inputs = 1

    def __init__(self, begin_mask=0, end_mask=0, ellipsis_mask=0, new_axis_mask=0, shrink_axis_mask=0):
        super().__init__()
        for name, v in (("begin_mask", begin_mask), ("end_mask", end_mask), ("ellipsis_mask", ellipsis_mask),
                        ("new_axis_mask", new_axis_mask), ("shrink_axis_mask", shrink_axis_mask)):
            if _check_int(self.name, name, v) < 0:
                raise ValueError(f"{self.name}: {name} must be >= 0, got {v}")
        if ellipsis_mask & (ellipsis_mask - 1):
            raise ValueError(f"{self.name}: at most one bit may be set in ellipsis_mask, got {ellipsis_mask}")
        self.begin_mask, self.end_mask, self.ellipsis_mask = begin_mask, end_mask, ellipsis_mask
        self.new_axis_mask, self.shrink_axis_mask = new_axis_mask, shrink_axis_mask

    def forward(self, x, begin, end, strides):
        _check_array(self.name, "x", x)
        self.index = self._index(tuple(x.shape), begin, end, strides)
        self.x_shape = tuple(x.shape)
        return x[self.index]

    def backward(self, gy):
        gx = get_array_module(gy).zeros(self.x_shape, gy.dtype)
        gx[self.index] = gy  # a basic index reaches each element at most once
        return gx, None, None, None

    def _index(self, shape, begin, end, strides):
        op = self.name
        begin, end, strides = (_int_tuple(op, n, v) for n, v in (("begin", begin), ("end", end), ("strides", strides)))
        if not len(begin) == len(end) == len(strides):
            raise ValueError(f"{op}: begin, end and strides must have the same length, got "
                             f"{len(begin)}, {len(end)} and {len(strides)}")
        index = []
        for i, (b, e, s) in enumerate(zip(begin, end, strides)):
            bit = 1 << i
            if self.ellipsis_mask & bit:
                index.append(Ellipsis)
            elif self.new_axis_mask & bit:
                index.append(None)
            elif s == 0:
                raise ValueError(f"{op}: strides must be non-zero, got {strides}")
            elif self.shrink_axis_mask & bit:
                index.append(b)
            else:
                index.append(slice(None if self.begin_mask & bit else b, None if self.end_mask & bit else e, s))
        named = sum(1 for item in index if item is not None and item is not Ellipsis)
        if named > len(shape):
            raise ValueError(f"{op}: begin/end/strides slice {named} dimensions, but x has shape {shape}")
        dim = 0
        for item in index:
            if item is Ellipsis:
                dim += len(shape) - named
            elif item is not None:
                if isinstance(item, int) and not -shape[dim] <= item < shape[dim]:
                    raise IndexError(f"{op}: shrink_axis_mask index {item} is out of range for dimension "
                                     f"{dim} of size {shape[dim]} (x of shape {shape})")
                dim += 1
        return tuple(index)


class GetItem(Primitive):
    """``x[index]`` with Python / NumPy indexing: ints, slices (any step), None, Ellipsis,
    integer arrays (repeats allowed: their gradients add up) and boolean masks.

    Index arrays may be Tensors, NumPy/CuPy arrays or lists.
    """

    n_inputs = 2
    n_tensor_inputs = 1

    def forward(self, x, index):
        _check_array(self.name, "x", x)
        xp = get_array_module(x)
        self.index, self.basic = _normalize_index(self.name, xp, index)
        self.x_shape = tuple(x.shape)
        try:
            return xp.asarray(x[self.index])
        except IndexError as e:
            raise IndexError(f"{self.name}: {e} (tensor of shape {self.x_shape}, index {index!r})") from None

    def backward(self, gy):
        xp = get_array_module(gy)
        gx = xp.zeros(self.x_shape, gy.dtype)
        if self.basic:
            gx[self.index] = gy
        else:
            _scatter_add(gx, self.index, gy)
        return gx, None


def _normalize_index(op, xp, index):
    """(index as a tuple x[...] accepts, whether it is basic: no index arrays)."""
    items = index if isinstance(index, tuple) else (index,)
    out, basic = [], True
    for item in items:
        if isinstance(item, Tensor):
            item = item.data
        if item is None or item is Ellipsis or isinstance(item, slice):
            out.append(item)
        elif isinstance(item, (int, numpy.integer)) and not isinstance(item, (bool, numpy.bool_)):
            out.append(int(item))
        elif isinstance(item, (list, bool, numpy.bool_)) or hasattr(item, "dtype"):
            array = xp.asarray(item)
            if array.dtype.kind == "f" and array.size == 0:
                array = array.astype(numpy.intp)  # [] parses as float64; it selects nothing
            if array.dtype.kind not in "iub":
                raise IndexError(f"{op}: index arrays must hold integers or bools, got dtype {array.dtype}")
            out.append(array)
            basic = False
        else:
            raise TypeError(f"{op}: unsupported index {item!r} of type {type(item).__name__}; expected "
                            f"int, slice, None, Ellipsis, or an integer / bool array")
    return tuple(out), basic


class Gather(Primitive):
    """Slices of ``params`` along ``axis`` picked by integer ``indices``:
    ``out.shape = params.shape[:axis] + indices.shape + params.shape[axis + 1:]``.

    Called as MindSpore's: ``ops.Gather()(params, indices, axis)``. Indices may repeat (their
    gradients add up) and be negative down to ``-params.shape[axis]`` (counted from the end, as
    MindSpore's CPU kernel does). An index outside ``[-n, n)`` raises on the host (MindSpore
    raises on CPU and GPU); on the GPU that check would read the indices back, a host
    synchronisation every step, so there (unless ``host_label_checks()``) its slice is NaN
    instead, in the output and in the gradient it sends back.

    Args:
        batch_dims: only 0 is supported.

    ``row_block``, set by the vocabulary-parallel sharding rule and None otherwise, is
    ``(start, total)``: params holds rows ``[start, start + n)`` of a table of ``total`` rows
    along axis; indices are global, and those outside this block give zero slices (another
    rank holds them; the ranks' outputs are then summed).

    Example:
        >>> ops.Gather()(table, minidl.Tensor(np.array([[1, 0, 1]])), 0)     # (1, 3, D)
    """

    n_inputs = 3
    n_tensor_inputs = 2
    row_block = None

    def __init__(self, batch_dims=0):
        super().__init__()
        if _check_int(self.name, "batch_dims", batch_dims) != 0:
            raise NotImplementedError(f"{self.name}: batch_dims={batch_dims} is not supported (only 0)")
        self.batch_dims = 0

    def forward(self, params, indices, axis):
        op = self.name
        _check_array(op, "params", params)
        _check_array(op, "input_indices", indices)
        if params.ndim == 0:
            raise ValueError(f"{op}: params must have at least 1 dimension, got a 0-d tensor")
        if indices.dtype.kind not in "iu":
            raise TypeError(f"{op}: input_indices must be an integer tensor, got dtype {indices.dtype}")
        axis = _check_int(op, "axis", axis)
        if not -params.ndim <= axis < params.ndim:
            raise ValueError(f"{op}: axis {axis} is out of range for params of rank {params.ndim} "
                             f"(expected {-params.ndim} <= axis < {params.ndim})")
        xp = get_array_module(params, indices)
        self.axis, self.shape = axis % params.ndim, tuple(params.shape)
        n = params.shape[self.axis]
        start, total = (0, n) if self.row_block is None else self.row_block
        on_host = isinstance(indices, numpy.ndarray)
        if indices.size and (on_host or host_label_checks()):
            bad = (indices < -total) | (indices >= total)
            if bool(bad.any()):
                raise ValueError(f"{op}: index {int(indices[bad].reshape(-1)[0])} is out of range for "
                                 f"params of shape {self.shape} along axis {self.axis} (expected {-total} <= index "
                                 f"< {total})")
        # int64 first: a small or unsigned index dtype would wrap when shifted
        local = xp.where(indices < 0, indices.astype(xp.int64) + total, indices) - start
        # keep: where an index picks a slice of this params (None: all do); invalid: NaN slices
        keep = invalid = None
        if self.row_block is not None:
            keep = (local >= 0) & (local < n)
        if not on_host:
            invalid = (indices < -total) | (indices >= total)
        if keep is not None or invalid is not None:
            local = xp.where(keep, local, 0) if keep is not None else xp.clip(local, 0, n - 1)
        self.index = (slice(None),) * self.axis + (local,)
        self.keep, self.invalid = keep, invalid
        y = xp.take(params, local, axis=self.axis)
        return self._mask(xp, y)

    def backward(self, gy):
        xp = get_array_module(gy)
        gx = xp.zeros(self.shape, gy.dtype)
        _scatter_add(gx, self.index, self._mask(xp, gy))
        return gx, None, None

    def _mask(self, xp, a):
        """a (laid out as the output) with zeros where the index is outside this block, NaN where
        it is out of range (device indices)."""
        if self.keep is None and self.invalid is None:
            return a
        lead = (1,) * self.axis
        tail = (1,) * (len(self.shape) - self.axis - 1)
        if self.keep is not None:
            a = xp.where(self.keep.reshape(lead + self.keep.shape + tail), a, a.dtype.type(0))
        if self.invalid is not None and a.dtype.kind == "f":  # integer tables: the clipped index's slice
            a = xp.where(self.invalid.reshape(lead + self.invalid.shape + tail), float("nan"), a)
        return a


def strided_slice(x, begin, end, strides, begin_mask=0, end_mask=0, ellipsis_mask=0, new_axis_mask=0,
                  shrink_axis_mask=0):
    return StridedSlice(begin_mask, end_mask, ellipsis_mask, new_axis_mask, shrink_axis_mask)(x, begin, end, strides)


def getitem(x, index):
    return GetItem()(x, index)


def gather(input_params, input_indices, axis, batch_dims=0):
    """Slices of input_params along axis picked by input_indices (see Gather).

    Example:
        >>> ops.gather(table, ids, 0)        # ids (N, T) -> (N, T, D) for a (V, D) table
    """
    return Gather(batch_dims)(input_params, input_indices, axis)


__all__ = ['StridedSlice', 'GetItem', 'Gather', 'strided_slice', 'getitem', 'gather']
