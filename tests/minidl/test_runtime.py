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
    assert get_runtime() is LOCAL
    assert (LOCAL.rank(), LOCAL.group_size(), LOCAL.grad_reducer([]), LOCAL.agree(True)) == (0, 1, None, True)
    np.testing.assert_array_equal(LOCAL.sum_over_ranks(np.array([1.0, 2.0])), [1.0, 2.0])


def test_a_thread_scoped_runtime_sees_ops_and_cells_only_inside_its_block():
    rec = Recording()
    net = nn.Dense(3, 2)
    x = Tensor(np.ones((1, 3), np.float32))
    with rec:
        assert get_runtime() is rec
        net(x)
    net(x)
    assert rec.cells == ["Dense"] and rec.ops == ["MatMul", "BiasAdd"]
    assert get_runtime() is LOCAL


def test_thread_scope_is_per_thread_and_wins_over_the_process_scope():
    process, mine = Recording(), Recording()
    seen = {}
    previous = set_runtime(process, scope="process")
    try:
        with mine:
            other = threading.Thread(target=lambda: seen.setdefault("other", get_runtime()))
            other.start()
            other.join()
            seen["mine"] = get_runtime()
        seen["after"] = get_runtime()
    finally:
        set_runtime(previous, scope="process")
    assert seen == {"other": process, "mine": mine, "after": process}
    assert get_runtime() is LOCAL


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
                seen[name + " inner exit"] = get_runtime()
            seen[name + " outer exit"] = get_runtime()
        seen[name + " done"] = get_runtime()

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
