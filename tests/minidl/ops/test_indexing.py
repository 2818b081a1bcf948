"""Indexing ops (StridedSlice, GetItem): forward vs NumPy, backward vs finite differences, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import shapes, arrays

small = shapes(max_dims=3, max_side=4)


def _bits(flags):
    return sum(1 << i for i, f in enumerate(flags) if f)


@st.composite
def strided_cases(draw):
    shape = draw(small)
    x = draw(arrays(shape))
    k = draw(st.integers(1, len(shape)))  # entries in begin/end/strides; the rest is taken whole
    begin, end, strides, index = [], [], [], []
    bmask, emask, smask = [], [], []
    for n in shape[:k]:
        shrink = draw(st.booleans()) and draw(st.booleans())
        b = draw(st.integers(-n, n - 1)) if shrink else draw(st.integers(-n - 2, n + 1))
        e = draw(st.integers(-n - 2, n + 1))
        s = draw(st.sampled_from([1, 2, 3, -1, -2]))
        bm, em = draw(st.booleans()), draw(st.booleans())
        begin.append(b), end.append(e), strides.append(s)
        bmask.append(bm and not shrink), emask.append(em), smask.append(shrink)
        # Python's own slicing is the reference: TensorFlow / MindSpore clamp begin/end alike.
        index.append(b if shrink else slice(None if bm else b, None if em else e, s))
    masks = dict(begin_mask=_bits(bmask), end_mask=_bits(emask), shrink_axis_mask=_bits(smask))
    return x, (tuple(begin), tuple(end), tuple(strides)), masks, tuple(index)


@given(case=strided_cases())
def test_strided_slice(case):
    x, (begin, end, strides), masks, index = case
    check_op(lambda t: ops.strided_slice(t, begin, end, strides, **masks), [x], reference=lambda a: a[index])


def test_strided_slice_mindspore_example():
    x = np.array([[[1, 1, 1], [2, 2, 2]], [[3, 3, 3], [4, 4, 4]], [[5, 5, 5], [6, 6, 6]]], np.float32)
    y = ops.StridedSlice()(Tensor(x), (1, 0, 2), (3, 1, 3), (1, 1, 1))
    np.testing.assert_array_equal(y.asnumpy(), [[[3.0]], [[5.0]]])
    y = ops.StridedSlice()(Tensor(x), (2, 1, 2), (0, 0, 0), (-1, -1, -1))  # negative strides
    np.testing.assert_array_equal(y.asnumpy(), [[[6.0, 6.0]], [[4.0, 4.0]]])  # x[2:0:-1, 1:0:-1, 2:0:-1]


def test_strided_slice_ellipsis_and_new_axis():
    x = np.arange(24.0).reshape(2, 3, 4)
    y = ops.StridedSlice(ellipsis_mask=0b1, new_axis_mask=0b100)(Tensor(x), (0, 1, 0), (0, 3, 0), (1, 1, 1))
    np.testing.assert_array_equal(y.asnumpy(), x[..., 1:3, None])
    check_op(lambda t: ops.StridedSlice(ellipsis_mask=0b1, new_axis_mask=0b100, shrink_axis_mask=0b10)(
        t, (0, -1, 0), (0, 0, 0), (1, 1, 1)), [x], reference=lambda a: a[..., -1, None])


def test_strided_slice_errors():
    x = Tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match="StridedSlice: begin, end and strides must have the same length, "
                                         "got 2, 1 and 2"):
        ops.strided_slice(x, (0, 0), (1,), (1, 1))
    with pytest.raises(ValueError, match=r"StridedSlice: strides must be non-zero, got \(1, 0\)"):
        ops.strided_slice(x, (0, 0), (1, 1), (1, 0))
    with pytest.raises(IndexError, match=r"StridedSlice: shrink_axis_mask index 3 is out of range for dimension 1 "
                                         r"of size 3 \(x of shape \(2, 3\)\)"):
        ops.strided_slice(x, (0, 3), (1, 4), (1, 1), shrink_axis_mask=0b10)
    with pytest.raises(ValueError, match=r"StridedSlice: begin/end/strides slice 3 dimensions, but x has shape"):
        ops.strided_slice(x, (0, 0, 0), (1, 1, 1), (1, 1, 1))
    with pytest.raises(ValueError, match="StridedSlice: begin_mask must be >= 0, got -1"):
        ops.StridedSlice(begin_mask=-1)
    with pytest.raises(ValueError, match="StridedSlice: at most one bit may be set in ellipsis_mask, got 3"):
        ops.StridedSlice(ellipsis_mask=3)
    with pytest.raises(TypeError, match="StridedSlice: begin must be a tuple of ints"):
        ops.strided_slice(x, "ab", (1, 1), (1, 1))


# ---- GetItem ----------------------------------------------------------------------------------

@st.composite
def basic_indices(draw, shape):
    """ints, slices (any step), None and Ellipsis, as ``x[...]`` accepts them."""
    k = draw(st.integers(0, len(shape)))
    from_end = draw(st.booleans())  # index the last k dims behind an Ellipsis
    dims = shape[len(shape) - k:] if from_end else shape[:k]
    bound = st.one_of(st.none(), st.integers(-6, 6))
    items = []
    for n in dims:
        if draw(st.booleans()):
            items.append(draw(st.integers(-n, n - 1)))
        else:
            items.append(slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1, 2, -1, -2, -3]))))
    for _ in range(draw(st.integers(0, 2))):
        items.insert(draw(st.integers(0, len(items))), None)
    if from_end:
        items.insert(0, Ellipsis)
    return items[0] if len(items) == 1 and draw(st.booleans()) else tuple(items)


@given(data=st.data())
def test_getitem_basic(data):
    shape = data.draw(small)
    x = data.draw(arrays(shape))
    index = data.draw(basic_indices(shape))
    check_op(lambda t: t[index], [x], reference=lambda a: np.asarray(a[index]))


@st.composite
def advanced_indices(draw, shape):
    """Integer arrays (with repeats), boolean masks, and either mixed with slices."""
    kind = draw(st.sampled_from(["ints", "ints2", "mask", "mask_row", "mixed"]))
    ints = lambda n: np.array(draw(st.lists(st.integers(-n, n - 1), min_size=0, max_size=5)), dtype=np.int64)
    if kind == "ints":
        return ints(shape[0])
    if kind == "ints2" and len(shape) >= 2:
        m = draw(st.integers(1, 4))
        return (np.array(draw(st.lists(st.integers(0, shape[0] - 1), min_size=m, max_size=m))),
                np.array(draw(st.lists(st.integers(-shape[1], shape[1] - 1), min_size=m, max_size=m))))
    if kind == "mask":
        return np.array(draw(st.lists(st.booleans(), min_size=int(np.prod(shape)),
                                      max_size=int(np.prod(shape))))).reshape(shape)
    if kind == "mask_row":
        return (np.array(draw(st.lists(st.booleans(), min_size=shape[0], max_size=shape[0]))), Ellipsis)
    return (slice(None, None, -1), ints(shape[1])) if len(shape) >= 2 else ints(shape[0]).tolist()


@given(data=st.data())
def test_getitem_advanced_accumulates_repeats(data):
    shape = data.draw(small)
    x = data.draw(arrays(shape))
    index = data.draw(advanced_indices(shape))
    wrap = data.draw(st.booleans())  # index arrays as Tensors too
    as_tensor = lambda i: Tensor(i) if isinstance(i, np.ndarray) else i
    t_index = (tuple(as_tensor(i) for i in index) if isinstance(index, tuple) else as_tensor(index)) if wrap else index
    check_op(lambda t: ops.getitem(t, t_index), [x], reference=lambda a: a[index])


def test_getitem_repeated_indices_sum_their_gradients():
    x = Tensor(np.zeros((3, 2)), requires_grad=True)
    y = x[np.array([0, 2, 0, 0]), np.array([1, 0, 1, 1])]
    y.backward(Tensor(np.array([1.0, 2.0, 3.0, 4.0])))
    np.testing.assert_array_equal(x.grad.asnumpy(), [[0, 8], [0, 0], [2, 0]])


def test_getitem_with_a_mask_tensor_and_the_loss_gather_pattern():
    logits = Tensor(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), requires_grad=True)
    picked = logits[np.arange(2), Tensor(np.array([2, 0], dtype=np.int32))]
    np.testing.assert_array_equal(picked.asnumpy(), [3.0, 4.0])
    big = logits[logits > 2.5]
    np.testing.assert_array_equal(big.asnumpy(), [3.0, 4.0, 5.0, 6.0])
    (picked.sum() + big.sum()).backward()
    np.testing.assert_array_equal(logits.grad.asnumpy(), [[0, 0, 2], [2, 1, 1]])


def test_getitem_errors():
    x = Tensor(np.ones((2, 3)))
    with pytest.raises(IndexError, match=r"GetItem: index 5 is out of bounds for axis 1 with size 3 "
                                         r"\(tensor of shape \(2, 3\)"):
        x[0, 5]
    with pytest.raises(IndexError, match="GetItem: index arrays must hold integers or bools, got dtype float64"):
        x[np.array([0.5])]
    with pytest.raises(TypeError, match="GetItem: unsupported index 'a' of type str"):
        x["a"]
    with pytest.raises(TypeError, match="GetItem: unsupported index 1.5 of type float"):
        x[1.5]
    with pytest.raises(IndexError, match="GetItem: .*too many indices"):
        x[0, 0, 0]


# ---- Cast, OneHot, ZerosLike, OnesLike --------------------------------------------------------


# ---- Gather ------------------------------------------------------------------------------------

@st.composite
def gather_cases(draw):
    shape = draw(small)
    params = draw(arrays(shape))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    n = shape[axis]
    index_shape = draw(shapes(min_dims=0, max_dims=2, max_side=4))
    # repeats and negative indices (counted from the end, as MindSpore's CPU Gather takes them)
    indices = np.array(draw(st.lists(st.integers(-n, n - 1), min_size=int(np.prod(index_shape)),
                                     max_size=int(np.prod(index_shape))))).reshape(index_shape)
    return params, indices.astype(draw(st.sampled_from([np.int32, np.int64]))), axis


@given(case=gather_cases())
def test_gather(case):
    params, indices, axis = case
    check_op(lambda p, i: ops.gather(p, i, axis), [params, indices],
             reference=lambda p, i: np.take(p, i, axis=axis))


def test_gather_repeated_indices_accumulate_gradients():
    table = Tensor(np.arange(12.0).reshape(4, 3), requires_grad=True)
    ids = Tensor(np.array([[0, 3, 3], [-1, 0, 2]], np.int32))
    y = ops.Gather()(table, ids, 0)
    assert y.shape == (2, 3, 3)
    np.testing.assert_array_equal(y.asnumpy()[1, 0], [9.0, 10.0, 11.0])  # -1: the last row
    y.sum().backward()
    np.testing.assert_array_equal(table.grad.asnumpy()[:, 0], [2.0, 0.0, 1.0, 3.0])
    # axis 1, a 0-d index drops the axis
    y = ops.gather(Tensor(np.arange(12.0).reshape(4, 3)), Tensor(np.array(2)), 1)
    np.testing.assert_array_equal(y.asnumpy(), [2.0, 5.0, 8.0, 11.0])


def test_gather_float32_and_integer_tables():
    y = ops.gather(Tensor(np.ones((3, 2), np.float32)), Tensor(np.array([1])), 0)
    assert y.dtype == np.float32
    y = ops.gather(Tensor(np.arange(6, dtype=np.int32).reshape(3, 2)), Tensor(np.array([2, 0])), 0)
    assert y.dtype == np.int32 and y.asnumpy().tolist() == [[4, 5], [0, 1]]


def test_gather_row_block_gives_zero_outside_its_rows(monkeypatch):
    """The vocabulary-parallel rule's local call: rows [2, 4) of a table of 6, global indices."""
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")  # the device-pinned suite checks on the host too
    full = np.arange(12.0).reshape(6, 2)
    block = Tensor(full[2:4], requires_grad=True)
    g = ops.Gather()
    g.row_block = (2, 6)
    y = g(block, Tensor(np.array([0, 2, 3, 3, 5, -3])), 0)  # -3 is row 3
    want = np.where(np.isin([0, 2, 3, 3, 5, 3], [2, 3])[:, None], full[[0, 2, 3, 3, 5, 3]], 0.0)
    np.testing.assert_array_equal(y.asnumpy(), want)
    y.sum().backward()
    np.testing.assert_array_equal(block.grad.asnumpy(), [[1.0, 1.0], [3.0, 3.0]])
    with pytest.raises(ValueError, match=r"Gather: index 6 is out of range .* \(expected -6 <= index < 6\)"):
        g(block, Tensor(np.array([6])), 0)


@pytest.mark.cpu_only
def test_gather_matches_torch_index_select_and_embedding():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    rng = np.random.default_rng(0)
    table, ids = rng.standard_normal((7, 3)), rng.integers(0, 7, (4, 5))
    np.testing.assert_array_equal(ops.gather(Tensor(table), Tensor(ids), 0).asnumpy(),
                                  torch.nn.functional.embedding(torch.tensor(ids), torch.tensor(table)).numpy())
    t = Tensor(table, requires_grad=True)
    tt = torch.tensor(table, requires_grad=True)
    g = rng.standard_normal((3, 4))
    (ops.gather(t, Tensor(ids[0, :4]), 0).T * Tensor(g)).sum().backward()
    (torch.index_select(tt, 0, torch.tensor(ids[0, :4])).T * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(t.grad.asnumpy(), tt.grad.numpy(), rtol=1e-12)


def test_gather_device_indices_out_of_range_give_nan_without_a_host_sync(on_the_double, monkeypatch):
    import sys
    from minidl.testing import cupy_double
    monkeypatch.setitem(sys.modules, "cupyx", cupy_double.cupyx_module())  # backward's scatter_add
    table = Tensor(np.arange(8.0).reshape(4, 2), requires_grad=True)
    with cupy_double.count_host_syncs() as syncs:
        y = ops.gather(table, Tensor(np.array([1, 4, -5, 3])), 0)
        y.sum().backward()
    assert syncs.total == 0, syncs.by_reason
    out, grad = y.asnumpy(), table.grad.asnumpy()
    assert np.isnan(out[[1, 2]]).all() and not np.isnan(out[[0, 3]]).any()
    np.testing.assert_array_equal(out[[0, 3]], [[2.0, 3.0], [6.0, 7.0]])
    assert np.isnan(grad).any()  # the bad slices' NaN reach the clipped rows: never a silently wrong update


def test_gather_device_indices_are_checked_on_the_host_when_asked(on_the_double, monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")
    with pytest.raises(ValueError, match=r"Gather: index 4 is out of range"):
        ops.gather(Tensor(np.zeros((4, 2))), Tensor(np.array([0, 4])), 0)


def test_gather_errors(monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")  # the device-pinned suite checks on the host too
    table = Tensor(np.zeros((4, 3)))
    with pytest.raises(ValueError, match=r"Gather: index 4 is out of range for params of shape \(4, 3\) along axis 0 "
                                         r"\(expected -4 <= index < 4\)"):
        ops.gather(table, Tensor(np.array([0, 4])), 0)
    with pytest.raises(ValueError, match=r"Gather: index -5 is out of range"):
        ops.gather(table, Tensor(np.array([-5])), 0)
    with pytest.raises(ValueError, match=r"Gather: axis 2 is out of range for params of rank 2"):
        ops.gather(table, Tensor(np.array([0])), 2)
    with pytest.raises(TypeError, match=r"Gather: input_indices must be an integer tensor, got dtype float64"):
        ops.gather(table, Tensor(np.array([0.0])), 0)
    with pytest.raises(TypeError, match=r"Gather: axis must be an int, got 0.0"):
        ops.gather(table, Tensor(np.array([0])), 0.0)
    with pytest.raises(NotImplementedError, match=r"Gather: batch_dims=1 is not supported \(only 0\)"):
        ops.gather(table, Tensor(np.array([[0]])), 1, batch_dims=1)
