"""Cell.pipeline_stage: MindSpore's attribute, stored per cell and checked when set; minidl's core
never acts on it (minidl_parallel's pipeline reads it). MindSpore 2.10's answers, where quoted, were
read from its nn.Dense(2, 2)."""
import numpy as np
import pytest

from minidl import Tensor, nn


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(3, 4)
        self.fc2 = nn.Dense(4, 2)

    def construct(self, x):
        return self.fc2(self.fc1(x))


def test_a_cell_starts_with_no_stage_and_keeps_the_stage_it_is_given():
    # MindSpore: reading it before it was set raises AttributeError; minidl starts at None
    block = Block()
    assert block.pipeline_stage is None and block.fc1.pipeline_stage is None
    block.fc1.pipeline_stage = 0
    block.fc2.pipeline_stage = 3
    assert (block.pipeline_stage, block.fc1.pipeline_stage, block.fc2.pipeline_stage) == (None, 0, 3)
    assert nn.Dense(3, 4).pipeline_stage is None  # per instance: another cell of the class has none
    block.fc2.pipeline_stage = None  # back to no stage (MindSpore refuses None)
    assert block.fc2.pipeline_stage is None


def test_a_stage_on_a_parent_is_not_copied_to_its_children():
    # (MindSpore the same: the pipeline gives the cells inside a staged cell its stage when it runs)
    block = Block()
    block.pipeline_stage = 1
    assert block.fc1.pipeline_stage is None and block.fc2.pipeline_stage is None


@pytest.mark.parametrize("value, error, message", [
    # MindSpore: ValueError "For 'Cell', the property 'pipeline_stage' can not be less than 0, but got -1"
    (-1, ValueError, "Block: pipeline_stage must be an int >= 0 (or None for no stage), got -1"),
    # MindSpore: TypeError "For 'Cell', the property 'pipeline_stage' must be int type, but got type : <class 'bool'>"
    (True, TypeError, "Block: pipeline_stage must be an int >= 0 (or None for no stage), got bool True"),
    (False, TypeError, "Block: pipeline_stage must be an int >= 0 (or None for no stage), got bool False"),
    (1.5, TypeError, "Block: pipeline_stage must be an int >= 0 (or None for no stage), got float 1.5"),
    ("1", TypeError, "Block: pipeline_stage must be an int >= 0 (or None for no stage), got str '1'"),
    (np.int64(1), TypeError,  # (MindSpore refuses NumPy integers too; their repr depends on NumPy's version)
     f"Block: pipeline_stage must be an int >= 0 (or None for no stage), got int64 {np.int64(1)!r}"),
])
def test_a_stage_that_is_not_an_int_of_at_least_zero_is_refused_naming_the_cell(value, error, message):
    block = Block()
    block.pipeline_stage = 2
    with pytest.raises(error) as info:
        block.pipeline_stage = value
    assert str(info.value) == message
    assert block.pipeline_stage == 2  # a refused value changes nothing


def test_the_stage_is_neither_a_parameter_nor_a_child_and_leaves_the_forward_unchanged():
    block = Block()
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    before = block(x).asnumpy()
    names = [name for name, _ in block.parameters_and_names()]
    block.fc1.pipeline_stage, block.fc2.pipeline_stage = 0, 1
    assert [name for name, _ in block.parameters_and_names()] == names
    assert list(block.name_cells()) == ["fc1", "fc2"]
    np.testing.assert_array_equal(block(x).asnumpy(), before)
