"""minidl.runtime: the one seam, its scopes, and the local runtime's refusal of sharded state."""
import threading

import numpy as np
import pytest

import minidl
from minidl import nn, ops, Parameter, Tensor
from minidl.runtime import LOCAL, Runtime, get_runtime, set_runtime


class Recording(Runtime):
    def __init__(self):
        self.ops, self.cells = [], []

    def call_op(self, prim, args):
        self.ops.append(prim.name)
        return prim.apply(*args)

    def call_cell(self, cell, args, kwargs):
        self.cells.append(type(cell).__name__)
        return cell.construct(*args, **kwargs)


def test_the_local_runtime_is_the_default_and_single_device():
    assert get_runtime().placing is LOCAL
    assert (LOCAL.rank(), LOCAL.group_size(), LOCAL.grad_reducer([]), LOCAL.agree(True)) == (0, 1, None, True)
    np.testing.assert_array_equal(LOCAL.sum_over_ranks(np.array([1.0, 2.0])), [1.0, 2.0])


def test_a_thread_scoped_runtime_sees_ops_and_cells_only_inside_its_block():
    rec = Recording()
    net = nn.Dense(3, 2)
    x = Tensor(np.ones((1, 3), np.float32))
    with rec:
        assert get_runtime().placing is rec
        net(x)
    net(x)
    # under GRAPH_MODE its layer runs the two as one Dense (the rule MatMul + BiasAdd), through rec
    graph = minidl.get_context("mode") == minidl.GRAPH_MODE
    assert rec.cells == ["Dense"] and rec.ops == (["Dense"] if graph else ["MatMul", "BiasAdd"])
    assert get_runtime().placing is LOCAL


def test_thread_scope_is_per_thread_and_wins_over_the_process_scope():
    process, mine = Recording(), Recording()
    seen = {}
    previous = set_runtime(process, scope="process")
    try:
        with mine:
            other = threading.Thread(target=lambda: seen.setdefault("other", get_runtime().placing))
            other.start()
            other.join()
            seen["mine"] = get_runtime().placing
        seen["after"] = get_runtime().placing
    finally:
        set_runtime(previous, scope="process")
    assert seen == {"other": process, "mine": mine, "after": process}
    assert get_runtime().placing is LOCAL


def test_one_runtime_entered_by_two_threads_at_once_and_nested_restores_each_threads_own():
    shared, outer = Recording(), Recording()
    inside, release = threading.Barrier(2, timeout=10), threading.Event()
    seen = {}

    def worker(name, own):
        with own:
            with shared:  # both threads hold `shared` at the same time
                with shared:
                    inside.wait()
                    release.wait(10)
                seen[name + " inner exit"] = get_runtime().placing
            seen[name + " outer exit"] = get_runtime().placing
        seen[name + " done"] = get_runtime().placing

    threads = [threading.Thread(target=worker, args=("a", outer)), threading.Thread(target=worker, args=("b", LOCAL))]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert seen == {"a inner exit": shared, "a outer exit": outer, "a done": LOCAL,
                    "b inner exit": shared, "b outer exit": LOCAL, "b done": LOCAL}


def test_dataset_map_functions_run_under_the_local_runtime_whatever_the_process_runtime():
    from minidl import dataset as ds
    process = Recording()
    data = ds.NumpySlicesDataset({"x": np.arange(4, dtype=np.float32)}, shuffle=False)
    data = data.map(lambda x: ops.relu(Tensor(x)).asnumpy(), input_columns=["x"])
    previous = set_runtime(process, scope="process")
    try:
        rows = [row["x"] for row in data.create_dict_iterator(num_epochs=1, output_numpy=True)]
    finally:
        set_runtime(previous, scope="process")
    np.testing.assert_array_equal(rows, [0, 1, 2, 3])
    assert process.ops == []  # the prefetch thread ran ReLU locally, never through the process's runtime


def test_set_runtime_checks_its_arguments():
    with pytest.raises(TypeError, match="runtime must be a minidl.runtime.Runtime or None, got int"):
        set_runtime(3)
    with pytest.raises(ValueError, match="scope must be 'thread' or 'process', got 'global'"):
        set_runtime(None, scope="global")


class _Placement:
    shape = (8, 4)

    def __str__(self):
        return "(a, -) on [2]"


def test_the_local_runtime_refuses_a_block_of_a_sharded_tensor():
    """After release() a sharded parameter cannot be saved as if it were whole: never silently wrong."""
    p = Parameter(np.zeros((4, 4)), name="w")
    p.placement = _Placement()
    assert p.shape == (8, 4) and p.data.shape == (4, 4) and p.is_sharded and p.size == 32
    with pytest.raises(RuntimeError, match=r"full_value: tensor 'w' holds one rank's block \(4, 4\) of a sharded "
                                           r"tensor \(a, -\) on \[2\], but no parallel runtime is active"):
        LOCAL.full_value(p)
    with pytest.raises(ValueError, match="integrated_save=True on every rank"):
        minidl.save_checkpoint([p], "unused.ckpt")


def test_a_layer_passes_every_question_it_does_not_change_to_the_runtime_it_wraps():
    from minidl.runtime import Layered, set_mode_layer

    class Placing(Runtime):
        name = "placing"
        world = "the parallel runtime's own attribute"

        def rank(self):
            return 3

        def group_size(self):
            return 4

        def agree(self, value):
            return ("agreed", value)

    class Tagging(Layered):
        calls = []

        def call_op(self, prim, args):
            Tagging.calls.append(prim.name)
            return self.inner.call_op(prim, args)

    layers = {}
    previous = set_mode_layer(lambda inner: layers.setdefault(inner, Tagging(inner)))
    try:
        with Placing() as placing:
            layer = get_runtime()
            assert type(layer) is Tagging and layer.inner is placing and layer.placing is placing
            assert (layer.rank(), layer.group_size(), layer.agree(1)) == (3, 4, ("agreed", 1))
            assert layer.world == "the parallel runtime's own attribute" and layer.intercepts_ops
            ops.relu(Tensor([1.0, -1.0]))
        assert Tagging.calls == ["ReLU"]
        assert get_runtime().placing is previous_placing(previous)
    finally:
        set_mode_layer(previous)
    with pytest.raises(TypeError, match="set_mode_layer: layer must be callable .* got int"):
        set_mode_layer(3)


def previous_placing(previous):
    return LOCAL if previous is None else previous(LOCAL).placing
