"""GRAPH_MODE's Dense fusion (minidl/graph_mode/): a Dense op (nn.Dense's one op) or a user's
MatMul(transpose_b) + BiasAdd, followed by a ReLU, runs as ops.DenseReLU (the BiasAdd of a MatMul
otherwise as ops.Dense), and every result equals PYNATIVE_MODE's. Each test runs the same code in
both modes (test_graph_mode.both) and compares. On reference bodies (kernels.reference_only) Dense
and DenseReLU are MatMul, BiasAdd and ReLU one after another, so values, gradients and parameters
after optimizer steps are eager's bit for bit; with the CPU kernels, within their bound. Covered: an
MLP of nn.Dense and one of user-written Dense cells trained (custom loop, Model.train; float32,
float64), which ops ran, outputs with two uses, in-place writes while an op is pending, no_grad, what
must not fuse, errors, and an output returned from the network and read later.
"""
import numpy as np
import pytest

import minidl
from minidl import Parameter, Tensor, graph_mode, kernels, nn, ops
from minidl.ops.dense import DenseReLU

# tests/minidl has no __init__.py: pytest puts it on sys.path, as tests/minidl_parallel's imports rely on
from test_graph_mode import MODES, assert_same, both, mode, node_names, state


def data(shape, seed=0, dtype=np.float32):
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


class UserDense(nn.Dense):
    """A Dense layer as a user (or MindSpore's nn.Dense) writes it: MatMul, then BiasAdd, then the
    activation, three ops; nn.Dense's own construct calls ops.Dense."""

    def construct(self, x):
        x = self.matmul(x, self.weight)
        if self.has_bias:
            x = self.bias_add(x, self.bias)
        return x if self.activation is None else self.activation(x)


LAYERS = {"nn.Dense": nn.Dense, "user": UserDense}


def mlp(dtype=np.float32, layer=nn.Dense):
    return nn.SequentialCell([layer(20, 32, dtype=dtype), nn.ReLU(), layer(32, 32, dtype=dtype), nn.ReLU(),
                              layer(32, 10, dtype=dtype)])


LABELS = np.array([1, 3, 5, 7, 9, 0, 2, 4], np.int32)
LOSS = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def train_custom_loop(dtype=np.float32, steps=3, layer=nn.Dense):
    net = mlp(dtype, layer)
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: LOSS(net(x), y), None, opt.parameters)
    x, y = data((8, 20), dtype=dtype), Tensor(LABELS)
    out = []
    for _ in range(steps):
        loss, g = grad_fn(x, y)
        opt(g)
        out.append((loss.asnumpy(), [t.asnumpy() for t in g]))
    return out, state(net)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mlp_custom_loop_equals_eager_bit_for_bit_on_reference_bodies(dtype, layer):
    with kernels.reference_only():
        eager, graph = both(lambda: train_custom_loop(dtype, layer=LAYERS[layer]))
    assert_same(eager, graph)
    assert graph[1]["0.weight"].dtype == dtype


@pytest.mark.parametrize("layer", LAYERS)
def test_mlp_custom_loop_equals_eager_within_the_kernel_bound(kernels_on, layer):
    eager, graph = both(lambda: train_custom_loop(layer=LAYERS[layer]))
    assert_same(eager, graph, exact=False)


@pytest.mark.parametrize("layer", LAYERS)
def test_mlp_model_train_equals_eager(layer):
    def train():
        net = mlp(layer=LAYERS[layer])
        opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
        images = np.random.default_rng(1).standard_normal((8, 20)).astype(np.float32)
        dataset = minidl.dataset.NumpySlicesDataset({"image": images, "label": LABELS}, shuffle=False).batch(4)
        minidl.Model(net, LOSS, opt).train(2, dataset)
        return state(net)
    with kernels.reference_only():
        eager, graph = both(train)
    assert_same(eager, graph)


def test_nn_dense_is_one_op_in_both_modes_and_fuses_its_relu_in_graph_mode():
    def forward():
        return [node_names(net(data((4, 20)))) for net in (
            mlp(), nn.SequentialCell([nn.Dense(20, 6, has_bias=False), nn.ReLU()]),  # DenseReLU(x, w)
            nn.Dense(20, 6, activation="relu"), nn.Dense(20, 6, has_bias=False))]
    eager, graph = both(forward)
    assert "DenseReLU" not in sum(eager[:2], []) and not {"MatMul", "BiasAdd"} & set(sum(eager + graph, []))
    assert sorted(eager[0]) == ["Dense"] * 3 + ["ReLU"] * 2
    assert sorted(graph[0]) == ["Dense", "DenseReLU", "DenseReLU"]   # the last layer has no ReLU
    assert graph[1] == ["DenseReLU"]
    assert eager[2] == graph[2] == ["DenseReLU"]   # activation="relu": the layer's own one op, in both modes
    assert eager[3] == graph[3] == ["Dense"]   # no bias, no ReLU: the Dense runs as eager's


@pytest.mark.parametrize("activation", ["relu", "sigmoid"])
def test_nn_dense_with_an_activation_equals_dense_then_the_activation_cell(activation):
    # activation="relu" runs DenseReLU in both modes; another activation runs after the Dense op.
    def forward():
        out = []
        for fused in (True, False):
            minidl.set_seed(4)
            fc = nn.Dense(20, 6, activation=activation)
            net = fc if fused else nn.SequentialCell([UserDense(20, 6), nn.get_activation(activation)])
            if not fused:
                net[0].weight.set_data(fc.weight.data.copy())
                net[0].bias.set_data(fc.bias.data.copy())
            x = data((5, 20))
            x.requires_grad = True
            y = net(x)
            y.sum().backward()
            out.append((y.asnumpy(), x.grad.asnumpy(), [p.grad.asnumpy() for p in net.trainable_params()]))
        return out
    with kernels.reference_only():
        eager, graph = both(forward)
    assert_same(eager, graph)
    assert_same(eager[0], eager[1])


def test_a_user_written_dense_fuses_in_graph_mode_only():
    def forward():
        return [node_names(net(data((4, 20)))) for net in (
            mlp(layer=UserDense), nn.SequentialCell([UserDense(20, 6, has_bias=False), nn.ReLU()]),
            UserDense(20, 6, activation="relu"), UserDense(20, 6, has_bias=False))]
    eager, graph = both(forward)
    assert not {"Dense", "DenseReLU"} & set(sum(eager, []))
    assert eager[0].count("MatMul") == 3
    assert sorted(graph[0]) == ["Dense", "DenseReLU", "DenseReLU"]   # the last layer has no ReLU
    assert graph[1] == graph[2] == ["DenseReLU"]
    assert graph[3] == ["MatMul"]   # no bias, no ReLU: the MatMul runs as eager's


def test_a_sharded_nn_dense_runs_its_two_ops():
    # shard() gives the MatMul and the BiasAdd strategies: nn.Dense then calls those two ops (the
    # tensor-parallel rules read their strategies); on the local runtime they run as eager's.
    def forward():
        fc = nn.Dense(20, 6)
        fc.shard(((1, 1), (1, 1)))
        return node_names(fc(data((4, 20))))
    eager, graph = both(forward)
    assert sorted(eager) == ["BiasAdd", "MatMul"]
    assert graph == ["Dense"]   # GRAPH_MODE's MatMul + BiasAdd rule


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_runs_one_op_and_nothing_twice(monkeypatch, layer):
    """What runs in a training step, counted at Primitive.apply: each layer's one fused op, no
    MatMul or Dense besides (a fused head must not run again when its Cell ends)."""
    from minidl.ops.primitive import Primitive
    ran, original = [], Primitive.apply

    def apply(prim, *args):
        ran.append(type(prim).__name__)
        return original(prim, *args)
    monkeypatch.setattr(Primitive, "apply", apply)

    def step():
        ran.clear()
        train_custom_loop(steps=1, layer=LAYERS[layer])
        return [name for name in ran if name in ("MatMul", "BiasAdd", "ReLU", "Dense", "DenseReLU")]
    eager, graph = both(step)
    if layer == "user":
        assert sorted(eager) == ["BiasAdd"] * 3 + ["MatMul"] * 3 + ["ReLU"] * 2
    else:
        assert sorted(eager) == ["Dense"] * 3 + ["ReLU"] * 2
    assert sorted(graph) == ["Dense", "DenseReLU", "DenseReLU"]


@pytest.mark.cpu_only  # the CPU kernels of Dense and DenseReLU
@pytest.mark.parametrize("layer", LAYERS)
def test_kernels_tracking_shows_the_dense_kernels(kernels_on, layer):
    if not any(k.backend == "numpy" for k in kernels.registered(DenseReLU)):
        pytest.skip("no CPU kernel registered for DenseReLU")

    def forward():
        with kernels.tracking() as used:
            mlp(layer=LAYERS[layer])(data((8, 20))).sum().backward()
        return {k.op.__name__ for k in used}
    eager, graph = both(forward)
    assert {"Dense", "DenseReLU"} <= graph and "DenseReLU" not in eager
    assert ("Dense" in eager) == (layer == "nn.Dense")


def run_ops(body, x_shape=(4, 5), w_shape=(3, 5), exact_grads=True, columns=3):
    """body(x, w, b) in both modes on reference bodies: its value and the gradients (to x, w, b) of
    a weighted sum of it must equal eager's. Returns graph mode's node names of the output."""
    def forward():
        x, w = data(x_shape), Parameter(data(w_shape, 1).data, name="w")
        b = Parameter(data((columns,), 2).data, name="b")
        x.requires_grad = True
        seen = {}

        def loss(x):
            out = body(x, w, b)
            seen["out"], seen["names"] = out.asnumpy().copy(), node_names(out)
            return (out * data(out.shape, 3)).sum()
        _, (gx, (gw, gb)) = minidl.value_and_grad(loss, 0, [w, b])(x)
        return seen["out"], [gx.asnumpy(), gw.asnumpy(), gb.asnumpy()], seen["names"]
    with kernels.reference_only():
        (out_e, grads_e, _), (out_g, grads_g, names) = both(forward)
    assert_same(out_e, out_g)
    assert_same(grads_e, grads_g, exact=exact_grads)
    return names


def matmul(x, w):
    return ops.MatMul(transpose_b=True)(x, w)


def test_matmul_output_used_twice():
    # After the fusion m runs again as MatMul for "+ m". Values bit for bit; gradients to rounding:
    # eager sums m's two gradients before one MatMul backward, graph mode sums the two products.
    def body(x, w, b):
        m = matmul(x, w)
        return ops.relu(ops.bias_add(m, b)) + m
    names = run_ops(body, exact_grads=False)
    assert "DenseReLU" in names and "MatMul" in names

    def used_before_the_relu(x, w, b):
        m = matmul(x, w)
        z = ops.bias_add(m, b)
        q = m * 2.0             # computes m: nothing is left to fuse, the graph is eager's
        return ops.relu(z) + q
    names = run_ops(used_before_the_relu)
    assert "DenseReLU" not in names and "Dense" not in names and "BiasAdd" in names


def test_bias_add_output_used_by_a_relu_and_elsewhere():
    def body(x, w, b):
        z = ops.bias_add(matmul(x, w), b)
        return ops.relu(z) + z  # z computed again after the fusion (as MatMul, BiasAdd): rounding as above
    names = run_ops(body, exact_grads=False)
    assert "DenseReLU" in names and "BiasAdd" in names


def write_w(w):
    w.set_data(np.full(tuple(w.shape), 7.0, np.float32))  # a new array, as load_param_into_net


@pytest.mark.parametrize("where", ["w_before_bias_add", "w_before_relu", "w_in_place_before_relu",
                                   "b_before_relu", "input_before_relu", "w_after_relu",
                                   "w_after_dense"])
def test_in_place_write_between_matmul_and_relu(where):
    # eager computed the product at the call: a write afterwards must not reach it in graph mode
    def body(x, w, b):
        h = x * 1.0
        m = matmul(h, w)
        if where == "w_before_bias_add":
            write_w(w)
        z = ops.bias_add(m, b)
        if where == "w_before_relu":
            write_w(w)
        elif where == "w_in_place_before_relu":
            w.data[...] *= 2        # the same array: as an optimizer's update
        elif where == "b_before_relu":
            b.data[...] = 0
        elif where == "input_before_relu":
            h.data[...] = 0
        elif where == "w_after_dense":
            a = z * 2.0             # runs Dense(h, w, b); m is used after the write
            write_w(w)
            return a + m
        a = ops.relu(z)
        if where == "w_after_relu":
            write_w(w)              # z is used after it: computed from the values as of its call
            return a + z
        return a
    run_ops(body, exact_grads=not where.startswith("w_after"))  # two uses of m: see above


def test_no_grad():
    def body(x, w, b):
        with minidl.no_grad():
            out = ops.relu(ops.bias_add(matmul(x, w), b))
            assert out._node is None
        m = matmul(x, w)
        with minidl.no_grad():    # grad mode changed in the window: runs as eager
            z = ops.bias_add(m, b)
            assert z._node is None
        z2 = ops.bias_add(matmul(x, w), b)
        with minidl.no_grad():    # changed before the ReLU: runs as eager, z2 keeps its graph
            r = ops.relu(z2)
            assert r._node is None
        return out + ops.relu(z) + ops.relu(m) + r + z2
    run_ops(body)


@pytest.mark.parametrize("ta, tb, x_shape, w_shape", [(True, True, (5, 4), (3, 5)), (True, False, (5, 4), (5, 3)),
                                                      (False, False, (4, 5), (5, 3))])
def test_other_transposes_stay_matmul(ta, tb, x_shape, w_shape):
    def body(x, w, b):
        return ops.relu(ops.bias_add(ops.MatMul(ta, tb)(x, w), b))
    names = run_ops(body, x_shape, w_shape)
    assert "MatMul" in names and "DenseReLU" not in names


@pytest.mark.parametrize("bias", ["broadcast_add", "row_add", "float64_bias", "array_bias"])
def test_a_bias_other_than_bias_add_of_a_1d_tensor_is_not_fused(bias):
    def body(x, w, b):
        m = matmul(x, w)
        return ops.relu({"broadcast_add": lambda: m + b, "row_add": lambda: m + b.reshape((1, 3)),
                         "float64_bias": lambda: ops.bias_add(m, ops.cast(b, minidl.float64)),
                         "array_bias": lambda: ops.bias_add(m, b.data + 1)}[bias]())  # a raw array, no Tensor
    names = run_ops(body)
    assert "MatMul" in names and "DenseReLU" not in names


def test_errors_come_at_the_call_with_eager_messages():
    x, w, b, messages = data((4, 5)), data((3, 5)), data((3,)), []
    for m in MODES:
        with mode(m):
            calls = [lambda: matmul(x, data((3, 6))), lambda: matmul(data((5,)), w),
                     lambda: ops.bias_add(matmul(x, w), data((4,))), lambda: ops.bias_add(matmul(x, w), data((1, 3)))]
            for call in calls:
                with pytest.raises(ValueError) as err:
                    call()
                messages.append(str(err.value))
            assert ops.relu(ops.bias_add(matmul(x, w), b)).shape == (4, 3)   # nothing left broken
    assert messages[:4] == messages[4:]
    assert "MatMul" in messages[0] and "BiasAdd" in messages[2]


def test_an_output_only_returned_from_the_network_is_computed():
    def forward():
        net = mlp()
        x, flat = data((8, 20)), nn.Dense(20, 6, activation="relu")
        out, out3d = net(x), flat(data((2, 4, 20)))   # a 3-D input is flattened around the product
        opt = nn.Momentum(net.trainable_params(), learning_rate=0.5, momentum=0.9)
        _, grads = minidl.value_and_grad(lambda x: LOSS(net(x), Tensor(LABELS)), None, opt.parameters)(x)
        opt(grads)                  # the weights change in place before out is read
        return out.asnumpy(), out3d.asnumpy(), state(net), node_names(out3d)
    with kernels.reference_only():
        eager, graph = both(forward)
    assert_same(eager[:3], graph[:3])
    assert "DenseReLU" in graph[3] and "Reshape" in graph[3]


@pytest.mark.cpu_only  # a Tensor shares a NumPy array only on the CPU
def test_a_write_into_the_input_buffer_after_the_network_returned():
    def forward():
        net, buf = nn.Dense(4, 3), np.ones((2, 4), np.float32)
        x = Tensor(buf)             # no copy: x's array is buf
        outs = []
        for v in (1.0, 2.0):
            buf[...] = v            # a reused input buffer, as a data loader's
            outs.append(net(x))
        return [o.asnumpy() for o in outs]
    assert_same(*both(forward))


def test_a_mode_change_runs_a_pending_dense_and_restores_the_classes():
    rng = np.random.default_rng(9)
    x, w, b = (Tensor(rng.standard_normal(s).astype(np.float32)) for s in ((4, 5), (3, 5), (3,)))
    with mode(minidl.GRAPH_MODE):
        y = ops.bias_add(ops.MatMul(transpose_b=True)(x, w), b)
        assert graph_mode.is_deferred(y) and y.shape == (4, 3)
        minidl.set_context(mode=minidl.PYNATIVE_MODE)
        assert not graph_mode.is_deferred(y)
    assert type(x) is Tensor and type(w) is Tensor and type(b) is Tensor and type(y) is Tensor
    with kernels.reference_only():
        expected = ops.bias_add(ops.MatMul(transpose_b=True)(x, w), b).asnumpy()
    np.testing.assert_allclose(y.asnumpy(), expected, rtol=1e-5, atol=1e-5)


def dense(x, w, b=None):
    return ops.Dense()(x, w) if b is None else ops.Dense()(x, w, b)


def test_a_dense_op_then_relu_fuses_and_its_output_can_be_used_again():
    names = run_ops(lambda x, w, b: ops.relu(dense(x, w, b)))
    assert names == ["DenseReLU"]
    assert run_ops(lambda x, w, b: ops.relu(dense(x, w))) == ["DenseReLU"]

    def used_twice(x, w, b):
        d = dense(x, w, b)
        return ops.relu(d) + d   # d computed again after the fusion, as Dense: rounding in the gradients
    names = run_ops(used_twice, exact_grads=False)
    assert "DenseReLU" in names and "Dense" in names

    def used_before_the_relu(x, w, b):
        d = dense(x, w, b)
        q = d * 2.0             # computes d: nothing is left to fuse, the graph is eager's
        return ops.relu(d) + q
    names = run_ops(used_before_the_relu)
    assert "DenseReLU" not in names and "Dense" in names and "ReLU" in names


@pytest.mark.parametrize("where", ["w_before_relu", "w_in_place_before_relu", "b_before_relu", "input_before_relu",
                                   "w_after_relu"])
def test_in_place_write_between_dense_and_relu(where):
    def body(x, w, b):
        h = x * 1.0
        d = dense(h, w, b)
        if where == "w_before_relu":
            write_w(w)
        elif where == "w_in_place_before_relu":
            w.data[...] *= 2
        elif where == "b_before_relu":
            b.data[...] = 0
        elif where == "input_before_relu":
            h.data[...] = 0
        a = ops.relu(d)
        if where == "w_after_relu":
            write_w(w)              # d is used after it: computed from the values as of its call
            return a + d
        return a
    run_ops(body, exact_grads=where != "w_after_relu")


def test_dense_no_grad_and_errors_as_eager():
    def body(x, w, b):
        with minidl.no_grad():
            out = ops.relu(dense(x, w, b))
            assert out._node is None
        d = dense(x, w, b)
        with minidl.no_grad():    # grad mode changed before the ReLU: runs as eager, d keeps its graph
            r = ops.relu(d)
            assert r._node is None
        return out + r + d
    run_ops(body)
    x, w, messages = data((4, 5)), data((3, 5)), []
    for m in MODES:
        with mode(m):
            for call in (lambda: dense(x, data((3, 6))), lambda: dense(x, w, data((4,)))):
                with pytest.raises(ValueError) as err:
                    call()
                messages.append(str(err.value))
    assert messages[:2] == messages[2:] and all("Dense" in m for m in messages)


class CellsInConstruct(nn.Cell):
    """nn.Dense and nn.ReLU cells called from a construct (no SequentialCell): the deferred route."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Dense(20, 32), nn.ReLU(), nn.Dense(32, 10)

    def construct(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_a_sequential_cell_and_cells_in_a_construct_fuse_alike():
    # In a SequentialCell, GRAPH_MODE runs a Dense cell and the ReLU cell after it as one
    # DenseReLU without deferring (graph_mode._sequence); called from a construct, the Dense op is
    # deferred and fused at the ReLU. Same op, same values, eager's bit for bit on reference bodies.
    def forward():
        minidl.set_seed(3)
        seq = nn.SequentialCell([nn.Dense(20, 32), nn.ReLU(), nn.Dense(32, 10)])
        minidl.set_seed(3)
        plain = CellsInConstruct()
        out = []
        for net in (seq, plain):
            x = data((6, 20))
            x.requires_grad = True
            y = net(x)
            names = node_names(y)
            y.sum().backward()
            out.append((y.asnumpy(), x.grad.asnumpy(), [p.grad.asnumpy() for p in net.trainable_params()], names))
        return out
    with kernels.reference_only():
        eager, graph = both(forward)
    assert_same([o[:3] for o in eager], [o[:3] for o in graph])
    assert_same(graph[0][:3], graph[1][:3])
    assert sorted(graph[0][3]) == sorted(graph[1][3]) == ["Dense", "DenseReLU"]


def test_the_sequential_route_leaves_what_it_cannot_fuse_to_the_cells():
    class MySequence(nn.SequentialCell):   # a subclass's own construct runs as written
        def construct(self, x):
            for cell in self._cells.values():
                x = cell(x)
            return x

    def forward():
        outs = []
        for net, x in ((nn.SequentialCell([nn.Dense(20, 6), nn.ReLU()]), data((2, 3, 20))),  # 3-D: reshaped
                       (nn.SequentialCell([nn.Dense(20, 6, activation="relu"), nn.ReLU()]), data((4, 20))),
                       (MySequence([nn.Dense(20, 6), nn.ReLU()]), data((4, 20))),
                       (nn.SequentialCell([nn.Dense(20, 6), nn.Sigmoid()]), data((4, 20))),
                       (nn.SequentialCell([nn.Dense(20, 6), nn.ReLU()]), data((2, 20, 20))),  # 3-D, 20 rows
                       (nn.SequentialCell([nn.Dense(20, 6), nn.ReLU(), nn.Dense(6, 4), nn.Sigmoid()]),
                        data((4, 20)))):
            y = net(x)
            outs.append((y.asnumpy(), node_names(y)))
        return outs
    with kernels.reference_only():
        eager, graph = both(forward)
    assert_same([o[0] for o in eager], [o[0] for o in graph])
    assert "Reshape" in graph[0][1] and "DenseReLU" not in graph[0][1]   # the ReLU sees the reshaped output
    assert graph[1][1].count("ReLU") == 1 and "DenseReLU" in graph[1][1]   # Dense's own ReLU fused; the next runs
    assert graph[2][1] == ["DenseReLU"]                                    # deferred and fused instead
    assert "DenseReLU" not in graph[3][1] and "Dense" in graph[3][1]
    assert "Reshape" in graph[4][1] and "DenseReLU" not in graph[4][1]
    assert sorted(graph[5][1]) == ["Dense", "DenseReLU", "Sigmoid"]   # a ReLU fuses with the Dense before it only


def test_the_sequential_route_raises_eagers_errors():
    messages = []
    for m in MODES:
        with mode(m):
            net = nn.SequentialCell([nn.Dense(20, 6), nn.ReLU()])
            for x in (data((4, 20), dtype=np.float64), data((4, 21))):
                with pytest.raises((TypeError, ValueError)) as err:
                    net(x)
                messages.append(f"{type(err.value).__name__}: {err.value}")
    assert messages[:2] == messages[2:]
    assert messages[0].startswith("TypeError: Dense:") and messages[1].startswith("ValueError: Dense:")


def test_a_pending_output_knows_its_shape_and_dtype():
    x, w, b = data((4, 5)), data((3, 5), 1), data((3,), 2)
    with mode(minidl.GRAPH_MODE):
        for make in (lambda: dense(x, w, b), lambda: ops.bias_add(matmul(x, w), b), lambda: matmul(x, w)):
            y = make()
            assert graph_mode.is_deferred(y)
            assert (y.shape, y.dtype, y.ndim, y.size) == ((4, 3), np.float32, 2, 12)
            assert graph_mode.is_deferred(y)   # none of them ran it


@pytest.mark.parametrize("case", ["gram", "dense_of_x_and_x", "two_products_of_one_input"])
def test_one_tensor_used_twice_while_pending(case):
    """x @ x.T (one tensor as both inputs) fuses, and a write into the bias of Dense(x, x, b)
    before its ReLU computes it first, as eager. Two pending products of one input, then a
    write into it: both computed before the write, as eager."""
    def forward():
        x, w = data((4, 5)), data((3, 5), 1)
        b = Parameter(data((4,), 2).data, name="b")
        h = x * 1.0
        if case == "gram":
            out = ops.relu(ops.bias_add(matmul(h, h), b))
        elif case == "dense_of_x_and_x":
            d = dense(h, h, b)
            b.data[...] = 0
            out = ops.relu(d)
        else:
            m1, m2 = matmul(h, w), matmul(h, w * 2.0)
            h.data[...] = 0
            out = ops.relu(m1) + ops.relu(m2)
        return out.asnumpy(), node_names(out)
    with kernels.reference_only():
        (out_e, _), (out_g, names) = both(forward)
    assert_same(out_e, out_g)
    if case == "gram":
        assert names == ["DenseReLU"]
    elif case == "dense_of_x_and_x":
        assert names == ["ReLU", "Dense"]   # the write into b computed the Dense first


def test_calls_with_the_wrong_number_of_inputs_raise_eagers_errors():
    x, w, b = data((4, 5)), data((3, 5), 1), data((3,), 2)
    messages = []
    for m in MODES:
        with mode(m):
            for call in (lambda: ops.Add()(x), lambda: ops.BiasAdd()(matmul(x, w), b, b)):
                with pytest.raises(TypeError) as err:
                    call()
                messages.append(str(err.value))
    assert messages[:2] == messages[2:]
    assert messages[0] == "Add: expected 2 input(s), got 1" and messages[1] == "BiasAdd: expected 2 input(s), got 3"


@pytest.mark.parametrize("case", ["bias_add_after_a_dense_op", "matmul_plus_a_tensor_of_its_shape"])
def test_only_a_matmul_takes_a_deferred_bias(case):
    """A BiasAdd after a Dense op (which has its bias), or an Add of a MatMul's output and a
    (4, 3) tensor (not a bias), runs as eager's ops."""
    def body(x, w, b):
        if case == "bias_add_after_a_dense_op":
            b2 = b * 2.0
            return ops.relu(ops.bias_add(dense(x, w, b), b2))
        return ops.relu(b.reshape((1, 3)).broadcast_to((4, 3)) * 1.0 + matmul(x, w))
    names = run_ops(body)
    assert "DenseReLU" not in names and "ReLU" in names


def test_a_cell_end_runs_every_op_it_left_pending():
    """An unused MatMul + BiasAdd, then an unused BatchNorm: when the cell returns both have run
    (the moving statistics updated in place, as their array, taken before, shows)."""
    def forward():
        bn = nn.BatchNorm1d(3)
        bn.set_train(True)
        moving_mean = bn.moving_mean.data

        class Net(nn.Cell):
            def construct(self, x, w, b, h):
                ops.bias_add(matmul(x, w), b)
                bn(h * 1.0)
                return h * 2.0
        Net()(data((4, 5)), data((3, 5), 1), data((3,), 2), data((4, 3), 3))
        return minidl.backend.to_numpy(moving_mean).copy()  # (on the device double too)
    eager, graph = both(forward)
    assert_same(eager, graph)
    assert not np.array_equal(graph, np.zeros(3))


@pytest.mark.cpu_only  # the raw input is a host NumPy array, which a GPU op refuses
def test_sharded_or_raw_inputs_are_not_deferred():
    """A weight tensor parallelism left a layout on (here a whole block of a world of one), or an
    input given as a NumPy array: the ops run as eager's, no fusion."""
    from test_graph_mode import sharded

    def forward():
        x, w, b = data((4, 5)), sharded(Parameter(data((3, 5), 1).data, name="w")), data((3,), 2)
        fc = nn.Dense(5, 3)
        fc.weight = w
        outs = [ops.relu(ops.bias_add(matmul(x, w), b)), ops.relu(dense(x, w, b)),
                nn.SequentialCell([fc, nn.ReLU()])(x),
                ops.relu(ops.bias_add(matmul(x, data((3, 5), 1)), sharded(Parameter(data((3,), 2).data, name="b"))))]
        w = data((3, 5), 1)
        outs += [ops.relu(ops.bias_add(matmul(x.asnumpy(), w), b)), ops.relu(dense(x.asnumpy(), w, b))]
        return [(out.asnumpy(), node_names(out)) for out in outs]
    with kernels.reference_only():
        eager, graph = both(forward)
    assert_same(eager, graph)
    assert all("DenseReLU" not in names for _, names in graph)
    assert graph[3][1] == ["ReLU", "BiasAdd"]   # the sharded bias: MatMul and BiasAdd as eager's


def test_a_pending_product_given_as_the_bias_raises_eagers_error():
    """bias_add(b, x @ w.T): the product is BiasAdd's bias, not its input. Eager raises at the
    call; GRAPH_MODE must not defer it as the MatMul + BiasAdd pattern (it used to compute
    x @ w.T + b instead)."""
    x, w, b = data((4, 5)), data((3, 5), 1), data((3,), 2)
    messages = []
    for m in MODES:
        with mode(m):
            with pytest.raises(ValueError) as err:
                ops.bias_add(b, matmul(x, w))
            messages.append(str(err.value))
    assert messages[0] == messages[1] and messages[0].startswith("BiasAdd: x must have rank >= 2")
