"""The Primitive base: shard() stores and validates arity, calls clone, the call hook."""
import numpy as np
import pytest

from minidl import ops, Tensor
from minidl.runtime import Runtime


def test_shard_stores_and_returns_self():
    mm = ops.MatMul()
    assert mm.shard(((2, 4), (4, 1))) is mm
    assert mm.in_strategy == ((2, 4), (4, 1)) and mm.out_strategy is None
    assert "shard(((2, 4), (4, 1)))" in repr(mm)


def test_shard_counts_only_tensor_inputs():
    assert ops.ReduceSum().shard(((2, 1),)).in_strategy == ((2, 1),)  # axis is an attribute
    with pytest.raises(ValueError, match=r"ReduceSum.shard: in_strategy has 2 tuple\(s\), but ReduceSum takes 1"):
        ops.ReduceSum().shard(((2, 1), (1,)))


def test_shard_rejects_wrong_arity_and_values():
    with pytest.raises(ValueError, match=r"MatMul.shard: in_strategy has 1 tuple\(s\), but MatMul takes 2"):
        ops.MatMul().shard(((2, 4),))
    with pytest.raises(TypeError, match="must be a tuple of tuples"):
        ops.ReLU().shard((2, 4))
    with pytest.raises(ValueError, match="every cut in in_strategy must be a positive int"):
        ops.ReLU().shard(((0, 1),))


def test_shard_does_not_change_single_device_results():
    x, w = np.arange(8.0).reshape(2, 4), np.ones((4, 3))
    out = ops.MatMul().shard(((2, 1), (1, 1)))(Tensor(x), Tensor(w))
    np.testing.assert_array_equal(out.asnumpy(), x @ w)


def test_one_primitive_called_twice_keeps_separate_saved_state():
    relu = ops.ReLU()
    a = Tensor(np.array([-1.0, 2.0]), requires_grad=True)
    b = Tensor(np.array([3.0, -4.0]), requires_grad=True)
    (relu(a) * 1.0 + relu(b) * 2.0).sum().backward()
    np.testing.assert_array_equal(a.grad.asnumpy(), [0.0, 1.0])
    np.testing.assert_array_equal(b.grad.asnumpy(), [2.0, 0.0])


def test_the_active_runtime_sees_every_primitive_call():
    seen = []

    class Seeing(Runtime):
        def call_op(self, prim, args):
            seen.append(prim.name)
            return prim.apply(*args)

    with Seeing():
        y = ops.relu(Tensor(np.array([1.0, -1.0]))) + 1.0
    ops.relu(Tensor(np.array([1.0])))  # after the block: the local runtime again
    assert seen == ["ReLU", "Add"]
    np.testing.assert_array_equal(y.asnumpy(), [2.0, 1.0])
