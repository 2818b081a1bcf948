"""The engine: accumulation, shared subgraphs, no_grad, value_and_grad semantics, freeing the graph."""
import tracemalloc
import weakref

import numpy as np
import pytest

from minidl import Tensor, Parameter, nn, ops, no_grad, value_and_grad, grad


def test_gradient_accumulates_over_uses_and_calls():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = x * x + x * 3.0  # x used three times
    y.backward(Tensor(np.ones(2)))
    np.testing.assert_allclose(x.grad.asnumpy(), 2 * np.array([1.0, 2.0]) + 3)
    (x * 2.0).backward(Tensor(np.ones(2)))  # a second backward adds, as in PyTorch
    np.testing.assert_allclose(x.grad.asnumpy(), 2 * np.array([1.0, 2.0]) + 5)


def test_shared_gradient_buffers_are_not_corrupted():
    # Add returns gy itself for both inputs; accumulating into one must not touch the other.
    a = Tensor(np.ones(2), requires_grad=True)
    b = Tensor(np.ones(2), requires_grad=True)
    s = a + b
    out = s * 1.0 + a  # a receives two contributions, b one
    out.backward(Tensor(np.ones(2)))
    np.testing.assert_array_equal(a.grad.asnumpy(), [2.0, 2.0])
    np.testing.assert_array_equal(b.grad.asnumpy(), [1.0, 1.0])


def test_diamond_graph():
    x = Tensor(np.array(3.0), requires_grad=True)
    h = x * x
    y = h * h  # x ** 4
    y.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), 4 * 27.0)


def test_deep_chain_does_not_recurse():
    x = Tensor(np.array(1.0), requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0
    y.backward()
    assert x.grad.item() == 1.0


def test_backward_of_non_scalar_needs_a_gradient():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"only for a one-element output, got shape \(3,\)"):
        (x * 2.0).backward()


def test_backward_gradient_shape_is_checked():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(ValueError, match=r"gradient of shape \(2,\) does not match the output shape \(3,\)"):
        (x * 2.0).backward(Tensor(np.ones(2)))


def test_backward_without_graph_is_an_error():
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor(np.ones(1)).backward()


def test_no_grad_records_nothing():
    x = Tensor(np.ones(2), requires_grad=True)
    with no_grad():
        y = x * 2.0
    assert not y.requires_grad and y.is_leaf

    @no_grad()
    def f(t):
        return t * 2.0
    assert not f(x).requires_grad
    assert (x * 2.0).requires_grad


def test_value_and_grad_inputs_default_to_position_0():
    fn = value_and_grad(lambda x, y: (x * y).sum())
    v, g = fn(Tensor(np.array([1.0, 2.0])), Tensor(np.array([3.0, 4.0])))
    assert v.item() == 11.0
    np.testing.assert_array_equal(g.asnumpy(), [3.0, 4.0])


def test_value_and_grad_weights_and_aux():
    w = Parameter(np.array([[2.0], [3.0]]), name="w")
    b = Parameter(np.array([1.0]), name="b")
    unused = Parameter(np.array([7.0]), name="unused")

    def forward(x):
        out = ops.matmul(x, w) + b
        loss = ops.matmul(ops.reshape(out, (1, -1)), ops.reshape(out, (-1, 1)))
        return ops.reshape(loss, ()), out

    grad_fn = value_and_grad(forward, None, [w, b, unused], has_aux=True)
    x = Tensor(np.array([[1.0, 1.0]]))
    (loss, out), (gw, gb, gu) = grad_fn(x)
    assert loss.item() == 36.0 and out.shape == (1, 1)
    np.testing.assert_allclose(gw.asnumpy(), [[12.0], [12.0]])
    np.testing.assert_allclose(gb.asnumpy(), [12.0])
    np.testing.assert_array_equal(gu.asnumpy(), [0.0])  # unreached weight: zeros, as MindSpore
    assert w.grad is None  # functional gradients do not touch .grad


def test_value_and_grad_positions_and_weights_together():
    w = Parameter(np.array([2.0]), name="w")
    fn = value_and_grad(lambda x, y: ops.reshape(x * y * w, ()), (0, 1), w)
    v, ((gx, gy), gw) = fn(np.array([3.0]), np.array([5.0]))
    assert v.item() == 30.0
    assert (gx.item(), gy.item(), gw.item()) == (10.0, 6.0, 15.0)


def test_grad_returns_only_gradients():
    g = grad(lambda x: ops.reshape(x * x, ()))(Tensor(np.array([3.0])))
    assert g.item() == 6.0


def test_value_and_grad_errors():
    with pytest.raises(IndexError, match="grad_position 2 is out of range for 1"):
        value_and_grad(lambda x: x, 2)(Tensor(np.ones(1)))
    with pytest.raises(TypeError, match="has_aux=True needs fn to return"):
        value_and_grad(lambda x: ops.reshape(x, ()), has_aux=True)(Tensor(np.ones(1)))
    with pytest.raises(TypeError, match="weights must be Parameters"):
        value_and_grad(lambda x: x, None, [1.0])


def test_on_grad_ready_fires_once_per_weight_with_its_final_gradient():
    w1 = Parameter(np.array([[2.0]]), name="w1")
    w2 = Parameter(np.array([[3.0]]), name="w2")
    order = []

    def forward(x):
        h = ops.matmul(x, w1)
        return (ops.matmul(h, w2) + ops.matmul(x, w1)).sum()  # w1 is used twice

    grad_fn = value_and_grad(forward, None, [w1, w2],
                             on_grad_ready=lambda i, g: order.append((i, g.asnumpy().item())))
    _, (g1, g2) = grad_fn(Tensor(np.array([[1.0]])))
    # w2 is produced later in forward, so its gradient is final first; w1's only once both uses are in.
    assert order == [(1, 2.0), (0, 4.0)]
    assert (g1.item(), g2.item()) == (4.0, 2.0)


# ---- the graph is freed by backward, unless retain_graph ----------------------------------

SECOND_BACKWARD = r"Trying to backward through the graph a second time.*Specify retain_graph=True"


def test_value_and_grad_frees_the_graph_while_the_loss_lives():
    rng = np.random.default_rng(0)
    w1, w2 = Parameter(rng.normal(size=(4, 8)), name="w1"), Parameter(rng.normal(size=(8, 1)), name="w2")
    x = Tensor(rng.normal(size=(16, 4)))
    refs = {}

    def forward(x):
        h = ops.relu(ops.matmul(x, w1))
        refs["activation"], refs["node"] = weakref.ref(h.data), weakref.ref(h.grad_fn)  # saved for backward
        return ops.matmul(h, w2).sum()

    loss, (g1, g2) = value_and_grad(forward, None, [w1, w2])(x)
    assert refs["activation"]() is None and refs["node"]() is None  # freed, though loss is alive
    h = np.maximum(x.asnumpy() @ w1.asnumpy(), 0)
    np.testing.assert_allclose(loss.asnumpy(), (h @ w2.asnumpy()).sum())
    np.testing.assert_allclose(g2.asnumpy(), h.sum(0, keepdims=True).T)
    with pytest.raises(RuntimeError, match=SECOND_BACKWARD):
        loss.backward()


def test_a_kept_loss_holds_no_activations():
    # The reported case, scaled down: a Dense net whose loss is kept (for logging) while the
    # next step runs must not keep the step's activations alive.
    net = nn.SequentialCell(nn.Dense(64, 512), nn.ReLU(), nn.Dense(512, 10))
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    rng = np.random.default_rng(0)
    x = Tensor(rng.normal(size=(256, 64)).astype(np.float32))
    y = Tensor(rng.integers(0, 10, 256).astype(np.int32))
    grad_fn = value_and_grad(lambda x, y: loss_fn(net(x), y), None, net.trainable_params())
    tracemalloc.start()
    try:
        loss, _ = grad_fn(x, y)
        kept = tracemalloc.get_traced_memory()[0]
        del loss
        released = kept - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    activation = 256 * 512 * 4  # one (256, 512) float32 array
    assert released < activation // 8, f"the loss kept {released} bytes alive"


def test_backward_frees_the_graph_and_a_second_backward_raises():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (x * x).sum()
    product = y.grad_fn.__dict__["inputs"][0][1]  # x * x, which ReduceSum saved
    ref = weakref.ref(product.data)
    del product
    y.backward()
    assert ref() is None and y.grad_fn.inputs == ()
    with pytest.raises(RuntimeError, match=SECOND_BACKWARD):
        y.backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), [2.0, 4.0])  # the refused call added nothing


def test_retain_graph_allows_backward_again_with_equal_gradients():
    x = Tensor(np.array([1.0, -2.0, 3.0]), requires_grad=True)
    y = (ops.relu(x) * x * 3.0).sum()
    y.backward(retain_graph=True)
    first = x.grad.asnumpy().copy()
    x.grad = None
    y.backward(retain_graph=True)
    np.testing.assert_array_equal(x.grad.asnumpy(), first)
    np.testing.assert_array_equal(first, [6.0, 0.0, 18.0])
    x.grad = None
    y.backward()  # the last one frees
    np.testing.assert_array_equal(x.grad.asnumpy(), first)
    with pytest.raises(RuntimeError, match=SECOND_BACKWARD):
        y.backward()


def test_a_shared_subgraph_is_freed_by_the_first_backward():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    h = x * x
    a, b = (h * 2.0).sum(), (h * 3.0).sum()
    a.backward()
    with pytest.raises(RuntimeError, match=SECOND_BACKWARD + r".*freed node: Mul"):
        b.backward()  # as in PyTorch: a.backward(retain_graph=True) would have allowed it
    np.testing.assert_array_equal(x.grad.asnumpy(), [4.0, 8.0])


def test_freeing_drops_an_instance_backward_and_keeps_the_configuration():
    # minidl_parallel wraps a node's backward in a closure set on the instance: it goes too.
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    y = ops.ReduceSum(keep_dims=True)(x * 2.0, 1)
    node = y.grad_fn
    captured = np.ones(1000)
    ref = weakref.ref(captured)
    inner = node.backward
    node.backward = lambda gy, captured=captured: inner(gy)
    del captured
    y.backward(np.ones((2, 1)))
    assert ref() is None and "backward" not in vars(node)
    assert node.keep_dims is True and repr(node).startswith("ReduceSum(")
    np.testing.assert_array_equal(x.grad.asnumpy(), np.full((2, 3), 2.0))
