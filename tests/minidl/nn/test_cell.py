"""Cell, SequentialCell and CellList: registration, names, traversal, modes, errors."""
import copy
import pickle
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Parameter, Tensor, nn, ops


class Leaf(nn.Cell):
    """y = x * weight: one parameter, no op beyond Mul (so these tests need no layer ops)."""

    def __init__(self, value=2.0, name=None):
        super().__init__()
        self.weight = Parameter(np.full((1,), value, np.float32), name=name)
        self.mul = ops.Mul()

    def construct(self, x):
        return self.mul(x, self.weight)


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = Leaf()
        self.bn = Leaf()
        self.bn.weight.requires_grad = False

    def construct(self, x):
        return self.bn(self.conv(x))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.stem = Leaf()
        self.layer1 = nn.SequentialCell(Block(), Block())
        self.head = Leaf()
        self.bias = Parameter(np.zeros(1, np.float32))

    def construct(self, x):
        return self.head(self.layer1(self.stem(x))) + self.bias


def test_registration_order_and_full_names():
    net = Net()
    names = [name for name, _ in net.parameters_and_names()]
    assert names == ["bias", "stem.weight", "layer1.0.conv.weight", "layer1.0.bn.weight",
                     "layer1.1.conv.weight", "layer1.1.bn.weight", "head.weight"]
    # Parameter.name is the same full path, fixed when the tree was built.
    assert [p.name for p in net.get_parameters()] == names
    assert list(net.name_cells()) == ["stem", "layer1", "head"]
    assert [n for n, _ in net.cells_and_names()] == ["", "stem", "layer1", "layer1.0", "layer1.0.conv",
                                                     "layer1.0.bn", "layer1.1", "layer1.1.conv", "layer1.1.bn",
                                                     "head"]
    assert list(net.parameters_dict()) == names
    assert net.cells() == [net.stem, net.layer1, net.head]


def test_trainable_and_untrainable_params():
    net = Net()
    trainable = [p.name for p in net.trainable_params()]
    assert trainable == ["bias", "stem.weight", "layer1.0.conv.weight", "layer1.1.conv.weight", "head.weight"]
    assert [p.name for p in net.untrainable_params()] == ["layer1.0.bn.weight", "layer1.1.bn.weight"]
    assert [p.name for p in net.trainable_params(recurse=False)] == ["bias"]
    assert isinstance(net.trainable_params(), list)
    gen = net.get_parameters()
    assert next(gen) is net.bias
    # PyTorch spellings give the same things.
    assert list(net.parameters()) == list(net.get_parameters())
    assert [n for n, _ in net.named_parameters()] == [n for n, _ in net.parameters_and_names()]
    assert [n for n, _ in net.named_parameters(prefix="net")][0] == "net.bias"


def test_sequential_names_and_forward():
    seq = nn.SequentialCell(Leaf(2.0), Leaf(3.0))
    assert [p.name for p in seq.trainable_params()] == ["0.weight", "1.weight"]
    y = seq(Tensor(np.array([1.0], np.float32)))
    np.testing.assert_allclose(y.asnumpy(), [6.0])
    seq.append(Leaf(0.5))
    assert len(seq) == 3 and seq[-1].weight.name == "2.weight"
    np.testing.assert_allclose(seq(Tensor(np.array([1.0], np.float32))).asnumpy(), [3.0])
    assert [c.weight.data[0] for c in seq] == [2.0, 3.0, 0.5]
    assert isinstance(seq[1:], nn.SequentialCell) and len(seq[1:]) == 2


def test_sequential_from_list_and_ordered_dict():
    listed = nn.SequentialCell([Leaf(), Leaf()])
    assert list(listed.name_cells()) == ["0", "1"]
    named = nn.SequentialCell(OrderedDict([("first", Leaf()), ("second", Leaf())]))
    assert [p.name for p in named.get_parameters()] == ["first.weight", "second.weight"]


def test_sequential_rejects_non_cells():
    with pytest.raises(TypeError, match=r"SequentialCell: item 1 must be a Cell, got ReLU"):
        nn.SequentialCell(Leaf(), ops.ReLU())
    seq = nn.SequentialCell(Leaf())
    with pytest.raises(TypeError, match="must be a Cell, got int"):
        seq.append(3)
    with pytest.raises(IndexError, match="index 5 is out of range for 1 cell"):
        seq[5]


def test_cell_list_registers_its_cells():
    class Tower(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Leaf(2.0), Leaf(3.0)])

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    tower = Tower()
    assert [p.name for p in tower.trainable_params()] == ["blocks.0.weight", "blocks.1.weight"]
    tower.blocks.append(Leaf(4.0))
    assert len(tower.blocks) == 3 and tower.blocks[2].weight.name == "blocks.2.weight"
    np.testing.assert_allclose(tower(Tensor(np.ones(1, np.float32))).asnumpy(), [24.0])
    with pytest.raises(TypeError, match="CellList: item 3 must be a Cell"):
        tower.blocks.append("dense")
    with pytest.raises(NotImplementedError, match="CellList"):
        tower.blocks(Tensor(np.ones(1, np.float32)))


def test_shared_parameter_counted_once_and_named_by_first_path():
    shared = Parameter(np.ones(2, np.float32))

    class Holder(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = shared

    class Twin(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = Holder()
            self.b = Holder()

    twin = Twin()
    assert twin.trainable_params() == [shared]
    assert shared.name == "a.w"
    assert [n for n, _ in twin.parameters_and_names()] == ["a.w"]


def test_shared_cell_counted_once():
    leaf = Leaf()

    class Twice(nn.Cell):
        def __init__(self):
            super().__init__()
            self.first = leaf
            self.again = leaf

    net = Twice()
    assert len(net.trainable_params()) == 1
    assert [n for n, _ in net.cells_and_names()] == ["", "first"]
    assert leaf.weight.name == "first.weight"


def test_explicit_names_are_kept():
    net = nn.SequentialCell(Leaf(name="my_scale"), Leaf(name="weight"))
    # A name different from the attribute is the user's choice; one equal to it is a default.
    assert [p.name for p in net.get_parameters()] == ["my_scale", "1.weight"]


def test_checkpoint_name_is_the_given_name_else_the_path():
    from minidl.nn.cell import checkpoint_name
    shared = Leaf()
    net = nn.SequentialCell(Leaf(name="my_scale"), Leaf(name="weight"), shared)
    other = nn.SequentialCell(Leaf(), shared)  # shared keeps its first name, "2.weight"
    assert [checkpoint_name(path, p) for path, p in net.parameters_and_names()] == \
        ["my_scale", "1.weight", "2.weight"]
    # A derived name is not a given one: the path of the cell being saved wins over it.
    assert [checkpoint_name(path, p) for path, p in other.parameters_and_names()] == ["0.weight", "1.weight"]
    assert checkpoint_name("a.w", Parameter(np.ones(1), name="given")) == "given"
    assert checkpoint_name("a.w", Parameter(np.ones(1))) == "a.w"


def test_auto_prefix_false_keeps_inner_names():
    class Wrapper(nn.Cell):
        def __init__(self, network):
            super().__init__(auto_prefix=False)
            self._backbone = network

        def construct(self, x):
            return self._backbone(x)

    net = Net()
    before = [p.name for p in net.get_parameters()]
    wrapped = Wrapper(net)
    assert [p.name for p in wrapped.get_parameters()] == before
    # The traversal path still shows where each parameter sits.
    assert next(iter(wrapped.parameters_and_names()))[0] == "_backbone.bias"


def test_set_train_recurses_and_defaults_to_inference():
    net = Net()
    assert not any(c.training for _, c in net.cells_and_names())  # MindSpore: inference by default
    assert net.set_train() is net
    assert all(c.training for _, c in net.cells_and_names())
    net.set_train(False)
    assert not any(c.training for _, c in net.cells_and_names())
    assert net.train() is net and net.layer1[1].bn.training
    assert net.eval() is net and not net.layer1[1].bn.training


def test_replacing_and_clearing_attributes():
    net = Net()
    net.head = Leaf(5.0)
    assert net.head.weight.name == "head.weight"
    assert len(net.trainable_params()) == 5
    net.head = None
    assert "head" not in net.name_cells()
    assert [p.name for p in net.get_parameters()][-1] == "layer1.1.bn.weight"
    net.bias = None
    assert net.bias is None and "bias" not in [n for n, _ in net.parameters_and_names()]
    net.bias = Parameter(np.ones(1, np.float32))
    assert net.bias.name == "bias" and net.trainable_params()[0] is net.bias
    with pytest.raises(TypeError, match="cannot assign Tensor to parameter 'bias'"):
        net.bias = Tensor(np.ones(1, np.float32))
    with pytest.raises(TypeError, match="cannot assign int to child cell 'stem'"):
        net.stem = 3
    del net.stem
    assert "stem" not in net.name_cells()
    net.plain = 3  # ordinary attributes stay ordinary
    assert net.plain == 3 and "plain" not in net.name_cells()


def test_insert_child_and_param():
    cell = nn.Cell()
    cell.insert_child_to_cell("leaf", Leaf())
    cell.insert_param_to_cell("scale", Parameter(np.ones(1, np.float32)))
    assert [n for n, _ in cell.parameters_and_names()] == ["scale", "leaf.weight"]
    assert cell.leaf.weight.name == "leaf.weight" and cell.scale.name == "scale"
    with pytest.raises(ValueError, match=r"child name 'a\.b' must not contain '\.'"):
        cell.insert_child_to_cell("a.b", Leaf())
    with pytest.raises(ValueError, match=r"must not contain '\.'"):
        cell.insert_param_to_cell("x.y", Parameter(np.ones(1, np.float32)))
    with pytest.raises(TypeError, match="insert_param_to_cell: 'p' must be a Parameter, got ndarray"):
        cell.insert_param_to_cell("p", np.ones(1))
    with pytest.raises(TypeError, match="insert_child_to_cell: 'c' must be a Cell, got ReLU"):
        cell.insert_child_to_cell("c", ops.ReLU())
    with pytest.raises(ValueError, match="'scale' is already a parameter"):
        cell.insert_child_to_cell("scale", Leaf())


def test_missing_construct_and_missing_super_init():
    class NoConstruct(nn.Cell):
        pass

    with pytest.raises(NotImplementedError, match="NoConstruct: construct is not defined"):
        NoConstruct()(Tensor(np.ones(1, np.float32)))

    class NoSuper(nn.Cell):
        def __init__(self):
            self.fc = Leaf()

    with pytest.raises(AttributeError, match=r"call super\(\).__init__\(\) first in NoSuper.__init__"):
        NoSuper()


def test_repr_is_nested():
    text = repr(Net())
    assert text.startswith("Net(\n")
    assert "  (layer1): SequentialCell(\n    (0): Block(\n      (conv): Leaf()" in text
    assert text.endswith(")")
    assert repr(Leaf()) == "Leaf()"


def test_zero_grad_and_apply():
    net = Net()
    loss = net(Tensor(np.ones(1, np.float32))).sum()
    loss.backward()
    assert net.stem.weight.grad is not None
    net.zero_grad()
    assert all(p.grad is None for p in net.get_parameters())
    visited = []
    assert net.apply(lambda c: visited.append(type(c).__name__)) is net
    assert visited[-1] == "Net" and visited.count("Leaf") == 6


def test_gradients_reach_parameters_through_nested_cells():
    net = Net()
    x = Tensor(np.array([1.5], np.float32))
    _, grads = minidl.value_and_grad(lambda x: net(x).sum(), None, net.trainable_params())(x)
    # y = x * 2^6 (six Leafs of value 2) + bias: d/d(stem) = x * 2^5, d/d(bias) = 1.
    np.testing.assert_allclose(grads[0].asnumpy(), [1.0])
    np.testing.assert_allclose(grads[1].asnumpy(), [1.5 * 32])


def test_deepcopy_and_pickle_keep_names_and_sharing():
    net = Net()
    net.shared = net.stem  # one cell reachable twice
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert [p.name for p in clone.get_parameters()] == [p.name for p in net.get_parameters()]
        assert clone.shared is clone.stem and clone.stem is not net.stem
        clone.layer1.append(Leaf())
        assert clone.layer1[2].weight.name == "layer1.2.weight"


# A random tree of SequentialCells over Leafs: every parameter's name is its path.
trees = st.recursive(st.just("leaf"), lambda kids: st.lists(kids, min_size=1, max_size=3), max_leaves=8)


def _build(tree):
    if tree == "leaf":
        return Leaf()
    return nn.SequentialCell([_build(t) for t in tree])


def _count(tree):
    return 1 if tree == "leaf" else sum(_count(t) for t in tree)


@given(tree=trees)
def test_names_equal_paths_for_any_tree(tree):
    class Root(nn.Cell):
        def __init__(self):
            super().__init__()
            self.body = _build(tree)

        def construct(self, x):
            return self.body(x)

    root = Root()
    pairs = list(root.parameters_and_names())
    assert len(pairs) == _count(tree)
    assert all(p.name == path for path, p in pairs)
    assert all(path.startswith("body.") and path.endswith("weight") for path, _ in pairs)
    y = root(Tensor(np.ones(1, np.float32)))
    np.testing.assert_allclose(y.asnumpy(), [2.0 ** _count(tree)])
