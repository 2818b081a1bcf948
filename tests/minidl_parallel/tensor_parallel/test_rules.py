"""Sharding rules: exact layouts, refused strategies, and every rank's local computation.

No communication: ``simulate`` plays the dispatcher for all ranks of a device matrix in one
process. Each rank takes its blocks of the global inputs (``in_layouts``), runs the primitive
locally (after ``localize`` / ``local_attrs``), and the blocks are put back together through
``out_layout`` (summing or maxing over partial axes); gradients are reassembled by the
invariant the dispatcher keeps (summed over the axes that neither cut an input nor repeat).
Both must equal the single-device op.
"""
import copy
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import ops
from minidl.tensor import Tensor

from minidl_parallel.tensor_parallel.layout import Layout
from minidl_parallel.tensor_parallel.rules import Decomposed, OpSharding, StrategyError, TensorSpec, get_rule

F64 = np.dtype(np.float64)


def spec(shape, param=False, dtype=F64):
    return TensorSpec(tuple(shape), dtype, param)


def infer(prim, args, strategy, device_num):
    return get_rule(prim).infer(prim, tuple(args), strategy, device_num)


def spec_args(args, positions):
    return tuple(spec(a.shape, dtype=a.dtype) if i in positions else a for i, a in enumerate(args))


def simulate(prim, args, positions, strategy, device_num, grad=True, seed=0):
    """Runs prim sharded on every simulated rank; asserts forward (and gradients) equal the plain op."""
    sh = infer(prim, spec_args(args, positions), strategy, device_num)
    assert isinstance(sh, OpSharding), sh
    plain = [Tensor(a, requires_grad=grad and a.dtype.kind == "f") if i in positions else a
             for i, a in enumerate(args)]
    want = prim.apply(*plain)
    out = sh.out_layout
    gy = np.random.default_rng(seed).standard_normal(want.shape)
    differentiable = grad and want.dtype.kind == "f" and want._node is not None
    if differentiable:
        want.backward(Tensor(gy))
    op = out.partial[0][1] if out.partial else None
    got = np.full(want.shape, -np.inf if op == "max" else 0.0)
    grads = {p: np.zeros(args[p].shape) for p in positions}
    seen = {}
    for rank in range(device_num):
        coords = out.coords(rank)
        local = list(args)
        for k, p in enumerate(positions):
            local[p] = args[p][sh.in_layouts[k].local_slices(rank, args[p].shape)]
        if sh.localize is not None:
            local = list(sh.localize(coords, local))
        node = copy.copy(prim)
        node.__dict__.update(sh.local_attrs or {})
        ts = [Tensor(a, requires_grad=differentiable and a.dtype.kind == "f") if i in positions else a
              for i, a in enumerate(local)]
        y = node.apply(*ts)
        block = out.local_slices(rank, want.shape)
        key = tuple(c for a, c in enumerate(coords) if a not in out.replica_axes())
        if key in seen:  # a replica: must hold the same block
            np.testing.assert_allclose(y.asnumpy(), seen[key], rtol=1e-12, atol=1e-12)
        else:
            seen[key] = y.asnumpy()
            if op == "sum":
                got[block] += y.asnumpy()
            elif op == "max":
                got[block] = np.maximum(got[block], y.asnumpy())
            else:
                got[block] = y.asnumpy()
        if differentiable and y._node is not None:
            y.backward(Tensor(np.array(gy[block])))
            if all(coords[a] == 0 for a in sh.repeat_axes):
                for k, p in enumerate(positions):
                    if ts[p].grad is not None:
                        grads[p][sh.in_layouts[k].local_slices(rank, args[p].shape)] += ts[p].grad.asnumpy()
    np.testing.assert_allclose(got, want.asnumpy().astype(np.float64), rtol=1e-10, atol=1e-10)
    if differentiable:
        for p in positions:
            if plain[p].requires_grad and plain[p].grad is not None:
                np.testing.assert_allclose(grads[p], plain[p].grad.asnumpy(), rtol=1e-9, atol=1e-10,
                                           err_msg=f"gradient of argument {p}")
    return sh


# ---- exact layouts ----------------------------------------------------------------------------

def layouts_of(sh):
    return [str(lay) for lay in sh.in_layouts], str(sh.out_layout), sh.repeat_axes


def test_quickstart_matmul_layouts():
    sh = infer(ops.MatMul(), (spec((16, 32)), spec((32, 16), True)), ((2, 4), (4, 1)), 8)
    assert layouts_of(sh) == (["(a, b) on [2, 4, 1]", "(b, -) on [2, 4, 1]"], "(a, -) on [2, 4, 1] +sum(b)", ())
    assert sh.device_matrix == (2, 4, 1)


def test_matmul_on_fewer_devices_repeats_on_a_first_axis():
    sh = infer(ops.MatMul(), (spec((16, 32)), spec((32, 16))), ((2, 2), (2, 1)), 8)
    assert layouts_of(sh) == (["(b, c) on [2, 2, 2, 1]", "(c, -) on [2, 2, 2, 1]"],
                              "(b, -) on [2, 2, 2, 1] +sum(c)", (0,))
    sh = infer(ops.MatMul(), (spec((16, 32)), spec((32, 16))), ((1, 1), (1, 4)), 8)
    assert layouts_of(sh) == (["(-, -) on [2, 1, 1, 4]", "(-, d) on [2, 1, 1, 4]"], "(-, d) on [2, 1, 1, 4]", (0,))


def test_matmul_transposes_read_the_stored_orientation():
    # Dense: w stored (out, in) with transpose_b; the strategy describes it as stored.
    sh = infer(ops.MatMul(transpose_b=True), (spec((16, 32)), spec((16, 32))), ((2, 4), (1, 4)), 8)
    assert layouts_of(sh) == (["(a, b) on [2, 4, 1]", "(-, b) on [2, 4, 1]"], "(a, -) on [2, 4, 1] +sum(b)", ())
    sh = infer(ops.MatMul(transpose_a=True), (spec((32, 16)), spec((32, 8))), ((4, 2), (4, 1)), 8)
    assert layouts_of(sh) == (["(b, a) on [2, 4, 1]", "(b, -) on [2, 4, 1]"], "(a, -) on [2, 4, 1] +sum(b)", ())


def test_elementwise_bias_reduce_conv_layouts():
    sh = infer(ops.Add(), (spec((16, 16)), spec((16,), True)), ((2, 4), (4,)), 8)
    assert layouts_of(sh) == (["(a, b) on [2, 4]", "(b,) on [2, 4]"], "(a, b) on [2, 4]", ())
    sh = infer(ops.ReduceSum(), (spec((16, 16)), 1), ((2, 4),), 8)
    assert str(sh.out_layout) == "(a,) on [2, 4] +sum(b)"
    sh = infer(ops.ReduceSum(keep_dims=True), (spec((16, 16)), 1), ((2, 2),), 8)
    assert str(sh.out_layout) == "(b, -) on [2, 2, 2] +sum(c)" and sh.repeat_axes == (0,)
    sh = infer(ops.BiasAdd(), (spec((4, 8, 3, 3)), spec((8,), True)), ((2, 4, 1, 1), (4,)), 8)
    assert [str(x) for x in sh.in_layouts][1] == "(b,) on [2, 4, 1, 1]"
    conv = ops.Conv2D(8, 1)
    sh = infer(conv, (spec((4, 6, 5, 5)), spec((8, 6, 1, 1))), ((2, 2, 1, 1), (2, 2, 1, 1)), 8)
    assert layouts_of(sh) == (["(a, b, -, -) on [2, 2, 2]", "(c, b, -, -) on [2, 2, 2]"],
                              "(a, c, -, -) on [2, 2, 2] +sum(b)", ())
    assert sh.local_attrs == {"out_channel": 4}


def test_shape_ops_rewrite_the_map():
    sh = infer(ops.Transpose(), (spec((4, 8)), (1, 0)), ((2, 4),), 8)
    assert str(sh.out_layout) == "(b, a) on [2, 4]"
    sh = infer(ops.ExpandDims(), (spec((4, 8)), -1), ((2, 4),), 8)
    assert str(sh.out_layout) == "(a, b, -) on [2, 4]"
    sh = infer(ops.Squeeze(1), (spec((4, 1, 8)),), ((2, 1, 4),), 8)
    assert str(sh.out_layout) == "(a, c) on [2, 1, 4]"
    sh = infer(ops.Reshape(), (spec((8, 6)), (4, -1, 6)), ((2, 1),), 2)
    assert str(sh.out_layout) == "(a, -, -) on [2, 1]"
    assert sh.localize((1, 0), [np.zeros((4, 6)), (4, -1, 6)])[1] == (2, 2, 6)
    sh = infer(ops.Flatten(), (spec((4, 2, 3)),), ((2, 2, 1),), 4)
    assert str(sh.out_layout) == "(a, b) on [2, 2, 1]"


def test_one_hot_class_cut_localizes_depth_and_indices():
    prim = ops.OneHot()
    sh = infer(prim, (spec((4,), dtype=np.dtype(np.int32)), 8, 1.0, 0.0), ((2, 4), (), ()), 8)
    assert layouts_of(sh) == (["(a,) on [2, 4]"], "(a, b) on [2, 4]", ())
    local = sh.localize((1, 3), [np.array([7, 6], np.uint8), 8, 1.0, 0.0])
    assert local[1] == 2 and local[0].tolist() == [1, 0]


def test_softmax_decomposes_only_over_cut_axes():
    x = spec((4, 8))
    assert isinstance(infer(ops.Softmax(), (x,), ((4, 1),), 4), OpSharding)
    assert isinstance(infer(ops.Softmax(), (x,), ((1, 4),), 4), Decomposed)
    assert isinstance(infer(ops.LogSoftmax(0), (x,), ((4, 1),), 4), Decomposed)
    assert isinstance(infer(ops.ReduceMean(), (x, 0), ((1, 2),), 4), OpSharding)
    assert isinstance(infer(ops.ReduceMean(), (x, 1), ((1, 2),), 4), Decomposed)
    with minidl.no_grad():  # no gradient: the local max is a partial max
        assert str(infer(ops.ReduceMax(), (x, 1), ((1, 2),), 4).out_layout) == "(-,) on [2, 1, 2] +max(c)"
    assert isinstance(infer(ops.ReduceMax(), (x, 1), ((1, 2),), 4), Decomposed)


# ---- refused strategies -----------------------------------------------------------------------

X, W = spec((16, 32)), spec((32, 16), True)
IMG, KER = spec((4, 6, 8, 8)), spec((8, 6, 1, 1), True)
I32 = np.dtype(np.int32)
INVALID = [  # (operator, args, strategy, device_num, what the message must say)
    (ops.MatMul(), (X, W), ((3, 1), (1, 1)), 8,
     r"dimension 0 of input 0 has size 16, not divisible by its cut 3"),
    (ops.MatMul(), (X, W), ((4, 4), (4, 1)), 8,
     r"uses 16 devices .* more than device_num 8"),
    (ops.MatMul(), (spec((12, 32)), W), ((3, 1), (1, 1)), 8,
     r"uses 3 devices .* does not divide device_num 8"),
    (ops.MatMul(), (X, W), ((2, 4), (2, 1)), 8,
     r"K cut differently .* x's K \(dimension 1\) is cut 4 but w's K \(dimension 0\) is cut 2"),
    (ops.MatMul(transpose_b=True), (X, spec((16, 32))), ((1, 2), (1, 4)), 8,
     r"x's K \(dimension 1\) is cut 2 but w's K \(dimension 1\) is cut 4"),
    (ops.MatMul(), (X, W), ((2, 4),), 8,
     r"the strategy has 1 tuple\(s\) but the operator takes 2 tensor input"),
    (ops.MatMul(), (X, W), ((2, 4, 1), (4, 1)), 8,
     r"input 0 has rank 2 .* has 3 cut\(s\)"),
    (ops.Add(), (spec((4, 1)), spec((4, 8))), ((2, 2), (2, 2)), 4,
     r"dimension 1 of input 0 has size 1 and is broadcast against size 8"),
    (ops.Mul(), (spec((4, 8)), spec((8,))), ((2, 2), (4,)), 8,
     r"dimension 1 of the output .* cut 2 in input 0 but 4 in input 1"),
    (ops.BatchMatMul(), (spec((4, 1, 6, 8)), spec((3, 8, 5))), ((2, 2, 1, 1), (3, 1, 1)), 12,
     r"dimension 1 of x has size 1 and is broadcast against size 3"),
    (ops.Conv2D(8, 1), (IMG, KER), ((1, 1, 2, 1), (1, 1, 1, 1)), 8,
     r"cut on H or W is not supported \(no halo exchange\)"),
    (ops.Conv2D(8, 3), (IMG, spec((8, 6, 3, 3))), ((1, 1, 1, 1), (1, 1, 3, 1)), 3,
     r"kernel dimensions must have cut 1"),
    (ops.Conv2D(8, 1), (IMG, KER), ((1, 2, 1, 1), (1, 3, 1, 1)), 6,
     r"input channels are cut 2 in x .* but 3 in w"),
    (ops.Conv2D(8, 1, group=2), (IMG, spec((8, 3, 1, 1))), ((1, 1, 1, 1), (2, 1, 1, 1)), 2,
     r"channel cuts of a grouped convolution \(group=2\) are not supported"),
    (ops.MaxPool(2, 2), (IMG,), ((1, 1, 1, 2),), 2,
     r"cuts H by 1 and W by 2: a cut on H or W is not supported"),
    (ops.Reshape(), (spec((8, 6)), (2, 4, 6)), ((4, 1),), 4,
     r"the cut of dimension 0 \(4\) does not survive reshape from \(8, 6\) to \(2, 4, 6\)"),
    (ops.Reshape(), (spec((4, 6)), (24,)), ((1, 2),), 2,
     r"the cut of dimension 1 \(2\) does not survive reshape"),
    (ops.Flatten(), (spec((4, 2, 3)),), ((1, 1, 3),), 3,
     r"the cut of dimension 2 \(3\) does not survive reshape from \(4, 2, 3\) to \(4, 6\)"),
    (ops.BiasAdd(), (spec((4, 8)), spec((8,))), ((1, 4), (2,)), 4,
     r"bias's cut 2 must equal the cut 4 of x's channel dimension 1"),
    (ops.SoftmaxCrossEntropyWithLogits(), (spec((4, 8)), spec((4, 8))), ((2, 1), (1, 2)), 4,
     r"logits and labels must be cut the same way"),
    (ops.SparseSoftmaxCrossEntropyWithLogits(), (spec((4, 8)), spec((4,), dtype=I32)), ((2, 1), (4,)), 4,
     r"labels' cut 4 must equal the cut 2 of the logits' batch"),
    (ops.OneHot(), (spec((4,), dtype=I32), 6, 1.0, 0.0), ((1, 4), (), ()), 4,
     r"depth 6 is not divisible by its cut 4"),
    (ops.OneHot(), (spec((4,), dtype=I32), 8, 1.0, 0.0), ((1, 4), (2,), ()), 4,
     r"on_value and off_value are scalars"),
    (ops.RealDiv(), (spec((4, 8)), 2.0), ((2, 1), (2,)), 2,
     r"argument 1 is not a tensor"),
]


@pytest.mark.parametrize("prim, args, strategy, device_num, message", INVALID,
                         ids=[f"{p.name}-{i}" for i, (p, *_) in enumerate(INVALID)])
def test_invalid_strategies_name_the_rule(prim, args, strategy, device_num, message):
    with pytest.raises(StrategyError, match=message):
        infer(prim, args, strategy, device_num)


# ---- every rank's local computation ----------------------------------------------------------

DEVICE_NUMS = st.sampled_from([1, 2, 4, 6, 8])


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def draw_cuts(data, shape, device_num, budget=None, whole=()):
    """Cuts of ``shape`` whose product divides ``budget`` (default device_num); dims in ``whole`` stay 1."""
    budget = device_num if budget is None else budget
    cuts = []
    for d, n in enumerate(shape):
        options = [c for c in divisors(budget) if n % c == 0] if d not in whole else [1]
        c = data.draw(st.sampled_from(options))
        budget //= c
        cuts.append(c)
    return tuple(cuts)


def rand(rng, *shape):
    return rng.standard_normal(shape)


@given(data=st.data(), device_num=DEVICE_NUMS, ta=st.booleans(), tb=st.booleans(), m=st.sampled_from([2, 4, 6]),
       k=st.sampled_from([4, 6]), n=st.sampled_from([2, 3, 4]))
def test_matmul_blocks_reassemble(data, device_num, ta, tb, m, k, n):
    rng = np.random.default_rng(0)
    x = rand(rng, *((k, m) if ta else (m, k)))
    w = rand(rng, *((n, k) if tb else (k, n)))
    s_x = draw_cuts(data, x.shape, device_num)
    xk = s_x[0] if ta else s_x[1]
    xm = s_x[1] if ta else s_x[0]
    wn = data.draw(st.sampled_from([c for c in divisors(device_num // (xm * xk)) if n % c == 0]))
    s_w = (wn, xk) if tb else (xk, wn)
    simulate(ops.MatMul(ta, tb), [x, w], (0, 1), (s_x, s_w), device_num)


@given(data=st.data(), device_num=DEVICE_NUMS)
def test_batch_matmul_broadcast_blocks_reassemble(data, device_num):
    rng = np.random.default_rng(1)
    x, w = rand(rng, 2, 1, 4, 6), rand(rng, 3, 6, 2)
    s_x = draw_cuts(data, x.shape, device_num)
    rest = device_num // int(np.prod(s_x))
    b = data.draw(st.sampled_from([c for c in divisors(rest) if 3 % c == 0]))
    wn = data.draw(st.sampled_from([c for c in divisors(rest // b) if 2 % c == 0]))
    simulate(ops.BatchMatMul(), [x, w], (0, 1), (s_x, (b, s_x[3], wn)), device_num)


BINARY = [ops.Add, ops.Sub, ops.Mul, ops.RealDiv, ops.Maximum, ops.Minimum, ops.Greater, ops.Equal]


@given(data=st.data(), device_num=DEVICE_NUMS, op=st.sampled_from(BINARY),
       y_shape=st.sampled_from([(4, 6), (6,), (1, 6), (4, 1), ()]))
def test_broadcast_binary_blocks_reassemble(data, device_num, op, y_shape):
    rng = np.random.default_rng(2)
    x, y = rand(rng, 4, 6) + 4.0, rand(rng, *y_shape) + 4.0
    s_x = draw_cuts(data, x.shape, device_num)
    s_y = tuple(1 if n == 1 else s_x[2 - len(y_shape) + d] for d, n in enumerate(y_shape))
    simulate(op(), [x, np.asarray(y)], (0, 1), (s_x, s_y), device_num)
    # A constant (raw) array operand is sliced to each rank's block by localize; raw, it must
    # already live on the tensors' device (the suite also runs pinned to the GPU).
    simulate(op(), [x, minidl.backend.to_device(np.asarray(y))], (0,), (s_x, ()), device_num)


@given(data=st.data(), device_num=DEVICE_NUMS, op=st.sampled_from([ops.ReLU, ops.Exp, ops.Tanh, ops.Square]))
def test_unary_blocks_reassemble(data, device_num, op):
    x = rand(np.random.default_rng(3), 4, 6)
    simulate(op(), [x], (0,), (draw_cuts(data, x.shape, device_num),), device_num)
    cast = simulate(ops.Cast(), [x, np.float32], (0,), (draw_cuts(data, x.shape, device_num),), device_num,
                    grad=False)
    assert isinstance(cast, OpSharding)


@given(data=st.data(), device_num=DEVICE_NUMS, op=st.sampled_from([ops.ReduceSum, ops.ReduceMean, ops.ReduceMax]),
       keep_dims=st.booleans(), axis=st.sampled_from([0, 1, -1, (0, 2), ()]))
def test_reductions_blocks_reassemble(data, device_num, op, keep_dims, axis):
    x = rand(np.random.default_rng(4), 2, 6, 4)
    prim = op(keep_dims)
    axes = {a % 3 for a in ((axis,) if isinstance(axis, int) else axis or (0, 1, 2))}
    sum_like = op is ops.ReduceSum
    s = draw_cuts(data, x.shape, device_num, whole=() if sum_like else axes)
    simulate(prim, [x, axis], (0,), (s,), device_num)
    if op is ops.ReduceMax:  # without gradient, cut reduced axes leave a partial max
        with minidl.no_grad():
            simulate(prim, [x, axis], (0,), (draw_cuts(data, x.shape, device_num),), device_num, grad=False)


@given(data=st.data(), device_num=DEVICE_NUMS)
def test_softmax_and_losses_with_uncut_classes_reassemble(data, device_num):
    rng = np.random.default_rng(5)
    logits = rand(rng, 6, 4)
    s = draw_cuts(data, logits.shape, device_num, whole=(1,))
    simulate(ops.Softmax(), [logits], (0,), (s,), device_num)
    simulate(ops.LogSoftmax(0), [logits.T.copy()], (0,), ((1, s[0]),), device_num)
    labels = rng.dirichlet(np.ones(4), 6)
    simulate(ops.SoftmaxCrossEntropyWithLogits(), [logits, labels], (0, 1), (s, s), device_num)
    index = rng.integers(0, 4, 6).astype(np.int32)
    simulate(ops.SparseSoftmaxCrossEntropyWithLogits(), [logits, index], (0, 1), (s, (s[0],)), device_num)


@given(data=st.data(), device_num=DEVICE_NUMS, axis=st.sampled_from([-1, 0, 1]))
def test_one_hot_blocks_reassemble(data, device_num, axis):
    index = np.array([[0, 5, 3], [7, -1, 2], [11, 4, 12], [6, 1, 9]], np.int64)  # -1, 12: off_value rows
    depth = 12
    prim = ops.OneHot(axis)
    k = 2 if axis == -1 else axis
    out_shape = list(index.shape)
    out_shape.insert(k, depth)
    s = draw_cuts(data, out_shape, device_num)
    simulate(prim, [index, depth, 2.0, -1.0], (0,), (s, (), ()), device_num, grad=False)
    on, off = np.array(2.0), np.array(-0.5)
    simulate(prim, [index.astype(np.uint8) % 16, depth, on, off], (0, 2, 3), (s, (), ()), device_num)


@given(data=st.data(), device_num=DEVICE_NUMS,
       target=st.sampled_from([(4, 2, 6), (8, 6), (48,), (2, 4, 3, 2), (-1, 3), (8, 1, 6, 1), (2, 24)]))
def test_reshape_blocks_reassemble_where_the_cut_survives(data, device_num, target):
    x = rand(np.random.default_rng(6), 8, 6)
    s = draw_cuts(data, x.shape, device_num)
    try:
        infer(ops.Reshape(), (spec(x.shape), target), (s,), device_num)
    except StrategyError as e:
        assert "does not survive reshape from (8, 6)" in str(e)
        return
    simulate(ops.Reshape(), [x, target], (0,), (s,), device_num)


@given(data=st.data(), device_num=DEVICE_NUMS)
def test_transpose_expand_squeeze_flatten_blocks_reassemble(data, device_num):
    x = rand(np.random.default_rng(7), 4, 1, 6)
    s = draw_cuts(data, x.shape, device_num)
    simulate(ops.Transpose(), [x, (2, 0, 1)], (0,), (s,), device_num)
    simulate(ops.ExpandDims(), [x, 1], (0,), (s,), device_num)
    simulate(ops.Squeeze(), [x], (0,), (s,), device_num)
    simulate(ops.Flatten(), [x], (0,), ((s[0], 1, 1),), device_num)


@given(data=st.data(), device_num=DEVICE_NUMS)
def test_conv_pool_bias_blocks_reassemble(data, device_num):
    rng = np.random.default_rng(8)
    x, w, b = rand(rng, 2, 6, 4, 4), rand(rng, 4, 6, 1, 1), rand(rng, 4)
    n, ci = draw_cuts(data, (2, 6), device_num)
    co = data.draw(st.sampled_from([c for c in divisors(device_num // (n * ci)) if 4 % c == 0]))
    simulate(ops.Conv2D(4, 1, stride=2), [x, w], (0, 1), ((n, ci, 1, 1), (co, ci, 1, 1)), device_num)
    w3 = rand(rng, 4, 3, 3, 3)
    simulate(ops.Conv2D(4, 3, pad_mode="same", group=2), [x, w3], (0, 1), ((n, 1, 1, 1), (1, 1, 1, 1)), device_num)
    s = (n, ci, 1, 1)
    simulate(ops.MaxPool(2, 2), [x], (0,), (s,), device_num)
    simulate(ops.AvgPool(3, 1, pad_mode="same"), [x], (0,), (s,), device_num)
    simulate(ops.BiasAdd(), [x, np.resize(b, 6)], (0, 1), (s, (ci,)), device_num)


# ---- data parallel and propagation -------------------------------------------------------------

def test_quickstart_propagation_chain():
    """DESIGN's worked example: Add and ReLU after MatMul((2, 4), (4, 1)), then the second MatMul."""
    mm = infer(ops.MatMul(), (spec((16, 32)), spec((32, 16), True)), ((2, 4), (4, 1)), 8)
    add_args = (spec((16, 16)), spec((16,), True))
    add = get_rule(ops.Add()).propagate(ops.Add(), add_args, (mm.out_layout, Layout.replicated(1, 8)), 8)
    assert add == ((2, 4), (4,))
    relu_in = infer(ops.Add(), add_args, add, 8).out_layout
    relu = get_rule(ops.ReLU()).propagate(ops.ReLU(), (spec((16, 16)),), (relu_in,), 8)
    assert relu == ((2, 4),)
    relu_out = infer(ops.ReLU(), (spec((16, 16)),), relu, 8).out_layout
    mm2 = get_rule(ops.MatMul()).propagate(ops.MatMul(), (spec((16, 16)), spec((16, 16), True)),
                                           (relu_out, Layout.replicated(2, 8)), 8)
    assert mm2 == ((2, 4), (4, 1))


def test_data_parallel_defaults():
    assert get_rule(ops.MatMul()).data_parallel(ops.MatMul(True), (spec((32, 16)), spec((32, 8), True)), 8) == \
        ((1, 8), (1, 1))
    dense = ops.MatMul(transpose_b=True)
    assert get_rule(dense).data_parallel(dense, (spec((12, 32)), spec((16, 32), True)), 8) == ((4, 1), (1, 1))
    assert get_rule(ops.Add()).data_parallel(ops.Add(), (spec((16, 8)), spec((8,))), 8) == ((8, 1), (1,))
    conv = ops.Conv2D(8, 1)
    assert get_rule(conv).data_parallel(conv, (IMG, spec((8, 6, 1, 1))), 8) == ((4, 1, 1, 1), (1, 1, 1, 1))
    assert get_rule(ops.Softmax(0)).data_parallel(ops.Softmax(0), (spec((8, 4)),), 8) == ((1, 1),)
    assert get_rule(ops.OneHot()).data_parallel(ops.OneHot(), (spec((8,), dtype=I32), 4, 1.0, 0.0), 8) == \
        ((8, 1), (), ())
    assert get_rule(ops.Reshape()).data_parallel(ops.Reshape(), (spec((8, 6)), (2, 24)), 8) == ((2, 1),)


def prime_factors(n):
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def draw_layout(data, shape, device_num):
    """Any layout of ``shape`` on ``device_num`` ranks: random grid, cuts, partial and replica axes."""
    factors = data.draw(st.permutations(prime_factors(device_num)))
    dm, i = [], 0
    while i < len(factors):
        take = data.draw(st.integers(1, len(factors) - i))
        dm.append(int(np.prod(factors[i:i + take])))
        i += take
    dm = dm or [1]
    tmap, partial = [[] for _ in shape], []
    for a in data.draw(st.permutations(range(len(dm)))):
        cuts = [int(np.prod([dm[b] for b in tmap[d]])) for d in range(len(shape))]
        options = [d for d, n in enumerate(shape) if n % (cuts[d] * dm[a]) == 0] + ["sum", "max", None]
        choice = data.draw(st.sampled_from(options))
        if isinstance(choice, int):
            tmap[choice].append(a)
        elif choice is not None:
            partial.append((a, choice))
    return Layout(tuple(dm), tuple(tuple(t) for t in tmap), tuple(partial))


I64 = np.dtype(np.int64)
CASES = [
    (ops.MatMul(), (spec((12, 8)), spec((8, 6), True))),
    (ops.MatMul(transpose_b=True), (spec((12, 8)), spec((6, 8), True))),
    (ops.MatMul(True, False), (spec((8, 12)), spec((8, 6)))),
    (ops.MatMul(), (spec((12, 8), True), spec((8, 6)))),
    (ops.BatchMatMul(), (spec((2, 1, 4, 6)), spec((3, 6, 2)))),
    (ops.BatchMatMul(False, True), (spec((6, 4, 6)), spec((6, 2, 6)))),
    (ops.BiasAdd(), (spec((4, 6, 2, 2)), spec((6,), True))),
    (ops.Add(), (spec((12, 6)), spec((6,), True))),
    (ops.Mul(), (spec((12, 1, 6)), spec((4, 1)))),
    (ops.Sub(), (spec((12, 6)), spec((12, 6)))),
    (ops.RealDiv(), (spec((12, 6)), 3.0)),
    (ops.Mul(), (spec((12, 6)), np.ones((12, 1)))),
    (ops.Equal(), (spec((12, 6)), spec(()))),
    (ops.ReLU(), (spec((12, 6)),)),
    (ops.Cast(), (spec((12, 6)), np.float32)),
    (ops.ReduceSum(), (spec((12, 6)), 1)),
    (ops.ReduceMean(True), (spec((12, 6, 4)), (0, 2))),
    (ops.ReduceMax(), (spec((12, 6)), ())),
    (ops.ReduceMin(), (spec((12, 6)), 0)),
    (ops.Softmax(), (spec((12, 6)),)),
    (ops.LogSoftmax(0), (spec((12, 6)),)),
    (ops.SoftmaxCrossEntropyWithLogits(), (spec((12, 6)), spec((12, 6)))),
    (ops.SoftmaxCrossEntropyWithLogits(), (spec((12, 6)), spec((12, 6), True))),
    (ops.SparseSoftmaxCrossEntropyWithLogits(), (spec((12, 6)), spec((12,), dtype=I64))),
    (ops.SparseSoftmaxCrossEntropyWithLogits(), (spec((12, 6), True), spec((12,), dtype=I64))),
    (ops.OneHot(), (spec((12,), dtype=I64), 6, 1.0, 0.0)),
    (ops.OneHot(0), (spec((12, 2), dtype=I64), 6, spec(()), spec(()))),
    (ops.Reshape(), (spec((12, 6)), (3, 4, 6))),
    (ops.Reshape(), (spec((12, 6)), (-1,))),
    (ops.Reshape(), (spec((4, 6, 3)), (2, 36))),
    (ops.Transpose(), (spec((12, 6, 2)), (2, 0, 1))),
    (ops.ExpandDims(), (spec((12, 6)), 0)),
    (ops.Squeeze(), (spec((12, 1, 6)),)),
    (ops.Flatten(), (spec((12, 2, 3)),)),
    (ops.Conv2D(6, 1), (spec((4, 6, 3, 3)), spec((6, 6, 1, 1), True))),
    (ops.Conv2D(6, 3, group=3), (spec((4, 6, 3, 3)), spec((6, 2, 3, 3), True))),
    (ops.MaxPool(2, 1), (spec((4, 6, 3, 3)),)),
    (ops.AvgPool(1, 1), (spec((12, 6, 2, 2)),)),
]


def accepted(prim, args, strategy, device_num):
    try:
        return infer(prim, args, strategy, device_num)
    except StrategyError as e:
        raise AssertionError(f"{prim.name}: strategy {strategy} refused on {device_num} devices: {e}") from None


@given(data=st.data(), case=st.sampled_from(CASES), device_num=st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
def test_propagate_and_data_parallel_give_valid_strategies(data, case, device_num):
    prim, args = case
    rule = get_rule(prim)
    accepted(prim, args, rule.data_parallel(prim, args, device_num), device_num)
    layouts = tuple(Layout.replicated(a.ndim, device_num) if a.is_parameter else draw_layout(data, a.shape, device_num)
                    for a in args if isinstance(a, TensorSpec))
    accepted(prim, args, rule.propagate(prim, args, layouts, device_num), device_num)


@given(data=st.data(), device_num=st.sampled_from([2, 4, 6, 8]))
def test_propagation_keeps_cuts_and_moves_partial_axes(data, device_num):
    """A unary op follows its input's cuts, and takes each partial axis as a cut of a whole dimension."""
    x = spec((12, 24))
    lay = draw_layout(data, x.shape, device_num)
    (got,) = get_rule(ops.ReLU()).propagate(ops.ReLU(), (x,), (lay,), device_num)
    want = list(lay.cuts())
    for a, _ in lay.partial:
        whole = [d for d in (1, 0) if want[d] == 1 and x.shape[d] % lay.device_matrix[a] == 0]
        if whole:
            want[whole[0]] = lay.device_matrix[a]
    assert got == tuple(want)
