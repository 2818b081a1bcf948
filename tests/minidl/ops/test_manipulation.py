"""pad / Pad, split / Split, tile / Tile, broadcast_to / BroadcastTo, shape / Shape and
scalar_to_tensor / ScalarToTensor: forward vs NumPy, backward vs finite differences, edges, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Tensor, backend, ops
from minidl.testing import check_op
from minidl.testing.strategies import arrays, shapes

small = shapes(max_dims=3, max_side=4)


def host(t):
    return backend.to_numpy(t.data)


# ---- pad / Pad --------------------------------------------------------------------------------

def pad_reference(a, padding, value=0.0):
    """PyTorch-style pads (last dimension first; negative crops): np.pad, then crop."""
    pairs = [(0, 0)] * a.ndim
    for k in range(len(padding) // 2):
        pairs[a.ndim - 1 - k] = (padding[2 * k], padding[2 * k + 1])
    y = np.pad(a, [(max(lo, 0), max(hi, 0)) for lo, hi in pairs], constant_values=value)
    return y[tuple(slice(max(-lo, 0), y.shape[d] - max(-hi, 0)) for d, (lo, hi) in enumerate(pairs))]


@st.composite
def paddings(draw, shape):
    """PyTorch-style pads for some trailing dims of ``shape``: positive, zero or cropping."""
    k = draw(st.integers(0, len(shape)))
    out = []
    for n in reversed(shape[len(shape) - k:]):
        lo = draw(st.integers(-n, 2))
        hi = draw(st.integers(max(-n, -n - lo), 2))
        out += [lo, hi]
    return tuple(out)


@given(data=st.data())
def test_pad(data):
    shape = data.draw(small)
    x = data.draw(arrays(shape))
    padding = data.draw(paddings(shape))
    value = data.draw(st.sampled_from([None, 0.0, 1.5, -2]))
    check_op(lambda t: ops.pad(t, padding, value=value), [x],
             reference=lambda a: pad_reference(a, padding, 0.0 if value is None else value))


@given(data=st.data())
def test_pad_primitive_pads_every_dimension(data):
    shape = data.draw(small)
    x = data.draw(arrays(shape))
    pairs = tuple(data.draw(st.tuples(st.integers(0, 2), st.integers(0, 2))) for _ in shape)
    check_op(lambda t: ops.Pad(pairs)(t), [x], reference=lambda a: np.pad(a, pairs))


def test_pad_on_every_side_crops_with_negative_pads():
    x = np.arange(12.0).reshape(3, 4)
    y = ops.pad(Tensor(x), (1, 2, -1, 1), value=9.0)      # last dim: +1 / +2; first: crop 1 / +1
    expected = np.array([[9, 4, 5, 6, 7, 9, 9], [9, 8, 9, 10, 11, 9, 9], [9, 9, 9, 9, 9, 9, 9]], float)
    np.testing.assert_array_equal(host(y), expected)
    np.testing.assert_array_equal(host(ops.pad(Tensor(x), (-1, -2))), x[:, 1:2])
    # cropping everything a side holds, then padding past it: only fill values are left
    np.testing.assert_array_equal(host(ops.pad(Tensor(np.arange(4.0)), (-4, 1), value=7.0)), [7.0])
    assert ops.pad(Tensor(x), (-2, -2)).shape == (3, 0)  # MindSpore refuses an empty result; PyTorch allows it
    assert ops.pad(Tensor(x), ()).shape == (3, 4)
    assert ops.pad(Tensor(x), [0, 0, 0, 0]).shape == (3, 4)  # a list is a padding too, and so is a Tensor
    assert ops.pad(Tensor(x), Tensor(np.array([1, 1]))).shape == (3, 6)


def test_pad_gradient_slices_back_and_crops_give_zeros():
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    y = ops.pad(x, (-1, 2, 1, 0))                         # (3, 4): row 0 fill, columns 1..2 of x, 2 fill
    gy = np.arange(12.0).reshape(3, 4)
    y.backward(Tensor(gy))
    np.testing.assert_array_equal(host(x.grad), [[0, 4, 5], [0, 8, 9]])


def test_pad_keeps_the_dtype_and_casts_the_value():
    y = ops.pad(Tensor(np.arange(4, dtype=np.int32)), (1, 1), value=2.5)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(host(y), [2, 0, 1, 2, 3, 2])  # as MindSpore: 2.5 -> 2 in an int tensor
    assert ops.Pad(((1, 0),))(Tensor(np.ones(2, np.float32))).dtype == np.float32


def test_pad_errors():
    x = Tensor(np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"pad: padding must have an even length .*got \(1,\)"):
        ops.pad(x, (1,))
    with pytest.raises(ValueError, match=r"pad: padding \(1, 1, 1, 1, 1, 1\) pads 3 dimensions but input_x has "
                                         r"only 2 \(shape \(3, 4\)\)"):
        ops.pad(x, (1, 1, 1, 1, 1, 1))
    with pytest.raises(NotImplementedError, match="pad: mode 'reflect' is not implemented; only mode='constant'"):
        ops.pad(x, (1, 1), mode="reflect")
    with pytest.raises(ValueError, match="pad: mode must be one of .*got 'edge'"):
        ops.pad(x, (1, 1), mode="edge")
    with pytest.raises(ValueError, match="pad: mode 'circular' takes no value, got value=1"):
        ops.pad(x, (1, 1), mode="circular", value=1)
    with pytest.raises(TypeError, match=r"pad: every entry of padding must be an int, got 1.0"):
        ops.pad(x, (1.0, 1))
    with pytest.raises(TypeError, match="pad: padding must be a tuple or list of ints, got 2"):
        ops.pad(x, 2)
    with pytest.raises(TypeError, match="pad: value must be an int, a float or None, got '0'"):
        ops.pad(x, (1, 1), value="0")
    with pytest.raises(TypeError, match="pad: input_x must be a Tensor, got list"):
        ops.pad([1.0, 2.0], (1, 1))
    with pytest.raises(ValueError, match=r"Pad: padding \(-5, 1\) crops more than the 4 element\(s\) of dimension 1 "
                                         r"of x \(shape \(3, 4\)\)"):
        ops.pad(x, (-5, 1))
    with pytest.raises(ValueError, match=r"Pad: padding \(-3, -2\) crops more than the 4 element"):
        ops.pad(x, (-3, -2))
    with pytest.raises(ValueError, match=r"Pad: every entry of paddings must be >= 0, got paddings\[0\] = \(-1, 2\)"):
        ops.Pad(((-1, 2), (0, 1)))
    with pytest.raises(ValueError, match=r"Pad: paddings has 1 pair\(s\) but x has 2 dimension\(s\) \(shape \(3, 4\)\)"):
        ops.Pad(((1, 2),))(x)
    with pytest.raises(ValueError, match=r"Pad: every entry of paddings must be a \(before, after\) pair, got "
                                         r"paddings\[1\] = \(0, 1, 2\)"):
        ops.Pad(((1, 2), (0, 1, 2)))
    with pytest.raises(TypeError, match=r"Pad: paddings must be a tuple of \(before, after\) pairs of ints, got 1"):
        ops.Pad(1)


# ---- split / Split ----------------------------------------------------------------------------

@st.composite
def split_cases(draw):
    shape = draw(shapes(max_dims=3, min_side=0, max_side=5))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    n = shape[axis]
    if draw(st.booleans()):
        sections = draw(st.integers(1, 6))
    else:  # sizes summing to n, zero-length sections included
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        bounds = [0] + cuts + [n]
        sections = [b - a for a, b in zip(bounds, bounds[1:])]
        if draw(st.booleans()):
            sections = tuple(sections)
    return shape, axis, sections


def split_reference(a, sections, axis):
    n = a.shape[axis]
    if isinstance(sections, int):
        sizes = [min(sections, n - s) for s in range(0, n, sections)] or [0]
    else:
        sizes = list(sections)
    return np.split(a, np.cumsum(sizes)[:-1], axis=axis)


@given(case=split_cases(), data=st.data())
def test_split(case, data):
    shape, axis, sections = case
    x = data.draw(arrays(shape))
    want = split_reference(x, sections, axis)
    parts = ops.split(Tensor(x), sections, axis)
    assert isinstance(parts, tuple) and len(parts) == len(want)
    for got, w in zip(parts, want):
        assert got.shape == w.shape
        np.testing.assert_array_equal(host(got), w)
    # Gradients through a weighted subset of the parts: the parts left out get zeros.
    used = data.draw(st.lists(st.integers(0, len(want) - 1), min_size=1, max_size=3, unique=True))

    def fn(t):
        ps = ops.split(t, sections, axis)
        return ops.concat([ps[k] * float(k + 1) for k in used], axis)
    check_op(fn, [x], reference=lambda a: np.concatenate([split_reference(a, sections, axis)[k] * (k + 1)
                                                           for k in used], axis))


def test_split_chunks_and_zero_length_sections():
    x = np.arange(12.0).reshape(6, 2)
    assert [p.shape for p in ops.split(Tensor(x), 4)] == [(4, 2), (2, 2)]   # the last chunk is smaller
    assert [p.shape for p in ops.split(Tensor(x), 7)] == [(6, 2)]
    assert [p.shape for p in ops.split(Tensor(x), [2, 0, 4])] == [(2, 2), (0, 2), (4, 2)]
    assert [p.shape for p in ops.split(Tensor(x), (0, 6))] == [(0, 2), (6, 2)]
    assert [p.shape for p in ops.split(Tensor(np.zeros((0, 2))), 2)] == [(0, 2)]  # one empty chunk
    assert [p.shape for p in ops.split(Tensor(x), 1, axis=-1)] == [(6, 1), (6, 1)]


def test_split_unused_outputs_give_zero_gradients():
    x = Tensor(np.arange(6.0), requires_grad=True)
    a, b, c = ops.split(x, [2, 0, 4])
    (c * 3.0).sum().backward()
    np.testing.assert_array_equal(host(x.grad), [0, 0, 3, 3, 3, 3])


@given(data=st.data())
def test_split_primitive(data):
    shape = data.draw(shapes(max_dims=3, max_side=4))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    num = data.draw(st.sampled_from([k for k in range(1, shape[axis] + 1) if shape[axis] % k == 0]))
    x = data.draw(arrays(shape))
    parts = ops.Split(axis, num)(Tensor(x))
    assert len(parts) == num
    for got, want in zip(parts, np.split(x, num, axis=axis)):
        np.testing.assert_array_equal(host(got), want)
    check_op(lambda t: ops.Split(axis, num)(t)[-1], [x], reference=lambda a: np.split(a, num, axis=axis)[-1])


def test_split_errors():
    x = Tensor(np.ones((6, 2)))
    with pytest.raises(ValueError, match="split: split_size_or_sections must be > 0 when it is an int, got 0"):
        ops.split(x, 0)
    with pytest.raises(ValueError, match=r"split: every section in split_size_or_sections must be >= 0, got \(2, -1, 5\)"):
        ops.split(x, [2, -1, 5])
    with pytest.raises(ValueError, match=r"split: the sections \(2, 3\) sum to 5, but dimension 0 of the tensor "
                                         r"\(shape \(6, 2\)\) has size 6"):
        ops.split(x, [2, 3])
    with pytest.raises(TypeError, match="split: split_size_or_sections must be an int or a tuple/list of ints, got 2.0"):
        ops.split(x, 2.0)
    with pytest.raises(ValueError, match=r"split: axis 2 is out of range for a tensor of rank 2"):
        ops.split(x, 2, axis=2)
    with pytest.raises(ValueError, match=r"split: cannot split a 0-d tensor"):
        ops.split(Tensor(np.float64(1.0)), 1)
    with pytest.raises(ValueError, match=r"Split: dimension 0 of x \(shape \(6, 2\)\) has size 6, not divisible by "
                                         r"output_num=4"):
        ops.Split(0, 4)(x)
    with pytest.raises(ValueError, match="Split: output_num must be >= 1, got 0"):
        ops.Split(0, 0)
    with pytest.raises(TypeError, match="Split: axis must be an int, got 0.5"):
        ops.Split(0.5)
    with pytest.raises(ValueError, match=r"Split.shard: in_strategy \(\(1, 2\),\) cuts the split axis -1 2 ways"):
        ops.Split(-1, 2).shard(((1, 2),))
    assert repr(ops.Split(1, 2).shard(((2, 1),))) == "Split(axis=1, output_num=2).shard(((2, 1),))"


# ---- tile / Tile ------------------------------------------------------------------------------

@given(data=st.data())
def test_tile(data):
    shape = data.draw(shapes(min_dims=0, max_dims=3, max_side=3))
    x = data.draw(arrays(shape))
    dims = tuple(data.draw(st.lists(st.integers(0, 3), max_size=len(shape) + 2)))
    fn = data.draw(st.sampled_from([ops.tile, lambda t, d: ops.Tile()(t, d)]))
    check_op(lambda t: fn(t, dims), [x], reference=lambda a: np.tile(a, dims))


def test_tile_with_more_dims_than_x_prepends_axes_and_sums_the_gradient():
    x = Tensor(np.array([[1.0, 2.0]]), requires_grad=True)
    y = ops.tile(x, (3, 2, 2))
    assert y.shape == (3, 2, 4)
    np.testing.assert_array_equal(host(y)[2, 1], [1, 2, 1, 2])
    y.sum().backward()
    np.testing.assert_array_equal(host(x.grad), [[12.0, 12.0]])  # 3 * 2 * 2 copies of each
    assert ops.tile(x, (2,)).shape == (1, 4)  # fewer dims than x: leading 1s (MindSpore 2.10, NumPy)
    assert ops.tile(x, (0, 1)).shape == (0, 2)


def test_tile_errors():
    x = Tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"Tile: every entry of dims must be >= 0, got dims=\(-1, 2\)"):
        ops.tile(x, (-1, 2))
    with pytest.raises(TypeError, match="Tile: every entry of dims must be an int, got 2.0"):
        ops.tile(x, (2.0, 2))
    with pytest.raises(TypeError, match="Tile: x must be a Tensor, got list"):
        ops.tile([1.0], (2,))


# ---- broadcast_to / BroadcastTo ---------------------------------------------------------------

@st.composite
def broadcast_cases(draw):
    shape = draw(shapes(min_dims=0, max_dims=3, min_side=1, max_side=3))
    target, resolved = [], []
    for n in shape:
        if n == 1 and draw(st.booleans()):
            t = draw(st.integers(0, 3))
            target.append(t)
            resolved.append(t)
        else:
            target.append(draw(st.sampled_from([n, -1])))
            resolved.append(n)
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    return shape, tuple(lead + target), tuple(lead + resolved)


@given(case=broadcast_cases(), data=st.data())
def test_broadcast_to(case, data):
    shape, target, resolved = case
    x = data.draw(arrays(shape))
    fn = data.draw(st.sampled_from([ops.broadcast_to, lambda t, s: ops.BroadcastTo(s)(t)]))
    check_op(lambda t: fn(t, target), [x], reference=lambda a: np.broadcast_to(a, resolved))


def test_broadcast_to_keeps_dims_with_minus_one():
    x = Tensor(np.arange(3.0).reshape(1, 3), requires_grad=True)
    assert ops.broadcast_to(x, (-1, 3)).shape == (1, 3)
    y = ops.broadcast_to(x, (4, 2, -1))
    assert y.shape == (4, 2, 3)
    y.sum().backward()
    np.testing.assert_array_equal(host(x.grad), [[8.0, 8.0, 8.0]])
    assert ops.broadcast_to(Tensor(np.ones((1, 3))), (0, 3)).shape == (0, 3)


def test_broadcast_to_errors():
    x = Tensor(np.ones((1, 3)))
    with pytest.raises(ValueError, match=r"BroadcastTo: cannot broadcast x of shape \(1, 3\) to \(2, 4\): dimension 1 "
                                         r"of x has size 3, which is neither 1 nor 4"):
        ops.broadcast_to(x, (2, 4))
    with pytest.raises(ValueError, match=r"BroadcastTo: shape \(-1, 2, 3\) has -1 at position 0, a new leading "
                                         r"dimension"):
        ops.broadcast_to(x, (-1, 2, 3))
    with pytest.raises(ValueError, match=r"BroadcastTo: shape \(3,\) has 1 entries, fewer than the 2 dimensions of x"):
        ops.broadcast_to(x, (3,))
    with pytest.raises(ValueError, match=r"BroadcastTo: every entry of shape must be >= 0 or -1, got shape=\(1, -2\)"):
        ops.BroadcastTo((1, -2))
    with pytest.raises(TypeError, match="BroadcastTo: shape must be a tuple of ints, got 3"):
        ops.BroadcastTo(3)
    with pytest.raises(TypeError, match="BroadcastTo: every entry of shape must be an int, got 3.0"):
        ops.BroadcastTo((2, 3.0))


# ---- shape / Shape, scalar_to_tensor / ScalarToTensor -------------------------------------------

def test_shape_returns_a_tuple():
    x = Tensor(np.ones((2, 3, 1)))
    assert ops.shape(x) == (2, 3, 1) and type(ops.shape(x)) is tuple
    assert ops.Shape()(Tensor(np.float32(1))) == ()
    with pytest.raises(TypeError, match="Shape: input_x must be a Tensor, got ndarray"):
        ops.shape(np.ones(2))


def test_scalar_to_tensor_defaults_to_float32_on_the_current_device():
    for v, want in ((1, 1.0), (True, 1.0), (2.5, 2.5)):
        t = ops.scalar_to_tensor(v)
        assert t.shape == () and t.dtype == np.float32 and host(t) == want
        assert backend.get_array_module(t.data) is backend.default_xp()
        assert not t.requires_grad
    t = ops.ScalarToTensor()(2.5, minidl.int32)
    assert t.dtype == np.int32 and host(t) == 2
    assert ops.scalar_to_tensor(True, minidl.bool_).dtype == np.bool_


def test_scalar_to_tensor_errors():
    with pytest.raises(TypeError, match=r"ScalarToTensor: input_x must be a Python bool, int or float, got Tensor"):
        ops.scalar_to_tensor(Tensor(1.0))
    with pytest.raises(TypeError, match=r"ScalarToTensor: input_x must be a Python bool, int or float, got float32"):
        ops.scalar_to_tensor(np.float32(1.0))
    with pytest.raises(TypeError, match="ScalarToTensor: dtype must be a dtype such as minidl.float32, got None"):
        ops.scalar_to_tensor(1, None)


def test_scalar_to_tensor_on_the_device_double(on_the_double):
    with_gpu = backend.get_device_target() == "GPU"
    assert with_gpu
    t = ops.scalar_to_tensor(3)
    assert isinstance(t.data, on_the_double.ndarray) and t.dtype == np.float32


# ---- Tensor methods ---------------------------------------------------------------------------

def test_tensor_methods():
    x = Tensor(np.arange(6.0).reshape(2, 3))
    assert x.tile((2, 2)).shape == x.tile(2, 2).shape == x.tile([2, 2]).shape == (4, 6)
    assert x.tile(2).shape == (2, 6)
    y = Tensor(np.ones((1, 3)))
    assert y.broadcast_to((4, 3)).shape == y.broadcast_to(4, -1).shape == (4, 3)
    assert [p.shape for p in x.split(1, 1)] == [(2, 1)] * 3
    assert [p.shape for p in x.split([1, 2], dim=1)] == [(2, 1), (2, 2)]
    assert [p.shape for p in x.split(1, axis=0)] == [(1, 3), (1, 3)]


# ---- PyTorch cross-check ------------------------------------------------------------------------

@pytest.mark.cpu_only
def test_against_torch():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    F = torch.nn.functional
    a = np.random.default_rng(0).standard_normal((3, 4, 5))
    t = torch.tensor(a)
    for padding in [(1, 2), (-1, 2, 0, -3), (2, -2, 1, 1, -1, 0)]:
        np.testing.assert_array_equal(ops.pad(Tensor(a), padding, value=0.5).asnumpy(),
                                      F.pad(t, padding, value=0.5).numpy())
    for s, axis in [(2, 1), ([1, 0, 3], 1), (4, -1)]:
        for got, want in zip(ops.split(Tensor(a), s, axis), torch.split(t, s, axis)):
            np.testing.assert_array_equal(got.asnumpy(), want.numpy())
    for dims in [(2,), (1, 2, 1), (2, 1, 1, 3)]:
        np.testing.assert_array_equal(ops.tile(Tensor(a), dims).asnumpy(), torch.tile(t, dims).numpy())
    b = a[:, :1]
    np.testing.assert_array_equal(ops.broadcast_to(Tensor(b), (2, -1, 4, 5)).asnumpy(),
                                  torch.broadcast_to(torch.tensor(b), (2, -1, 4, 5)).numpy())
