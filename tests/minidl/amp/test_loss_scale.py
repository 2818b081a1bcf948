"""amp.DynamicLossScaleManager / FixedLossScaleManager and their update cells: MindSpore 2.10's
defaults, errors and update rule (an overflow divides the scale, never below 1; scale_window
clean steps in a row multiply it), step by step."""
import numpy as np
import pytest

import minidl
from minidl import amp, nn

# Overflow (1) or not (0) per step, for a scale of 2^10, factor 2, window 3. It exercises a
# decrease, two in a row, growth after exactly 3 clean steps, growth twice in one clean run, an
# overflow right after growth, a long run of overflows clamped at 1, and growth from 1 again.
PATTERN = [0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1] + [1] * 10 + [0] * 7
# The scale after each step, written from the rule: step 1 is clean but only 1 step since the
# start (iter 0); steps 2-3 halve to 256; steps 4-6 make 3 clean steps: 512; ... steps 15-25
# overflow: 512, 256, ..., 1, 1; steps 26-28 clean: 2; 29-31: 4; 32: (1 of 3) 4.
# MindSpore 2.10's own DynamicLossScaleUpdateCell and DynamicLossScaleManager (CPU, PyNative)
# printed this same sequence for this pattern.
EXPECTED = [1024, 512, 256, 256, 256, 512, 256, 256, 256, 512, 512, 512, 1024, 1024, 512,
            256, 128, 64, 32, 16, 8, 4, 2, 1, 1, 1, 1, 2, 2, 2, 4, 4]


def test_the_manager_follows_mindspores_rule_step_by_step():
    manager = amp.DynamicLossScaleManager(init_loss_scale=2 ** 10, scale_factor=2, scale_window=3)
    got = []
    for overflow in PATTERN:
        manager.update_loss_scale(bool(overflow))
        got.append(manager.get_loss_scale())
    assert got == EXPECTED
    assert (manager.cur_iter, manager.last_overflow_iter, manager.bad_step) == (len(PATTERN) + 1, 25, 0)


def test_the_update_cell_follows_the_same_rule_in_float32_on_the_scale_parameter():
    cell = amp.DynamicLossScaleManager(init_loss_scale=2 ** 10, scale_factor=2, scale_window=3).get_update_cell()
    assert isinstance(cell, nn.DynamicLossScaleUpdateCell) and cell.get_loss_scale() == 2 ** 10
    scale = minidl.Parameter(np.array(2.0 ** 10, np.float32), name="scale_sense", requires_grad=False)
    got = []
    for overflow in PATTERN:
        assert cell(scale, minidl.Tensor(np.array(bool(overflow)))) is bool(overflow)  # it returns the flag
        got.append(scale.asnumpy())
    assert all(s.dtype == np.float32 and s.shape == () for s in got)
    assert [float(s) for s in got] == EXPECTED
    assert (int(cell.cur_iter.asnumpy()), int(cell.last_overflow_iter.asnumpy())) == (len(PATTERN) + 1, 31)
    assert sorted(p.name for p in cell.get_parameters()) == ["current_iterator_step", "last_overflow_iterator_step"]


def test_a_factor_of_3_divides_in_float32_as_mindspore():
    cell = nn.DynamicLossScaleUpdateCell(10.0, 3, 2)
    scale = minidl.Parameter(np.array([10.0], np.float32), requires_grad=False)  # shape (1,) works too
    cell(scale, True)
    want = np.float32(10.0) * (np.float32(1) / np.float32(3))
    assert scale.asnumpy().shape == (1,) and scale.asnumpy()[0] == want
    cell(scale, False)
    cell(scale, False)  # two clean steps after the overflow at step 1: times 3
    assert scale.asnumpy()[0] == want * np.float32(3)


def test_defaults_and_attributes_are_mindsporess():
    dynamic = amp.DynamicLossScaleManager()
    assert (dynamic.get_loss_scale(), dynamic.scale_factor, dynamic.scale_window) == (2 ** 24, 2, 2000)
    assert (dynamic.increase_ratio, dynamic.decrease_ratio, dynamic.bad_step_max) == (2, 0.5, 1000)
    assert dynamic.get_drop_overflow_update() is True
    fixed = amp.FixedLossScaleManager()
    assert (fixed.get_loss_scale(), fixed.get_drop_overflow_update()) == (128.0, True)
    cell = fixed.get_update_cell()
    assert isinstance(cell, nn.FixedLossScaleUpdateCell) and cell.get_loss_scale() == 128.0
    scale = minidl.Parameter(np.array(128.0, np.float32), requires_grad=False)
    assert cell(scale, True) is True and cell(scale, False) is False
    assert float(scale.asnumpy()) == 128.0
    fixed.update_loss_scale(True)
    assert fixed.get_loss_scale() == 128.0
    assert amp.FixedLossScaleManager(1024, drop_overflow_update=False).get_update_cell() is None
    assert isinstance(dynamic, amp.LossScaleManager) and isinstance(fixed, amp.LossScaleManager)


def test_more_than_1000_overflows_in_a_row_raise():
    manager = amp.DynamicLossScaleManager(init_loss_scale=4)
    for _ in range(1000):
        manager.update_loss_scale(True)
    assert manager.get_loss_scale() == 1
    with pytest.raises(RuntimeError, match="overflowed 1001 steps in a row, more than the maximum of 1000"):
        manager.update_loss_scale(True)


@pytest.mark.parametrize("make, error, message", [
    (lambda: amp.FixedLossScaleManager(0.5), ValueError, r"'loss_scale' must be >= 1, but got 0.5"),
    (lambda: amp.FixedLossScaleManager("8"), TypeError, r"loss_scale must be a number, got str '8'"),
    (lambda: amp.FixedLossScaleManager(8, drop_overflow_update=1), TypeError, r"drop_overflow_update must be a bool"),
    (lambda: amp.DynamicLossScaleManager(0.5), ValueError, r"'init_loss_scale' must be >= 1, but got 0.5"),
    (lambda: amp.DynamicLossScaleManager(scale_factor=0), ValueError, r"'scale_factor' must be > 0, but got 0"),
    (lambda: amp.DynamicLossScaleManager(scale_window=0), ValueError, r"'scale_window' must be a positive int, but got 0"),
    (lambda: amp.DynamicLossScaleManager(scale_window=2.0), ValueError, r"'scale_window' must be a positive int"),
    (lambda: nn.DynamicLossScaleUpdateCell(8, 2, 0), ValueError, r"scale_window must be a positive int, got 0"),
    (lambda: nn.FixedLossScaleUpdateCell(-1), ValueError, r"loss_scale_value must be a number > 0, got -1"),
])
def test_bad_arguments_raise_naming_the_argument(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_the_update_cell_refuses_a_scale_that_is_not_a_parameter():
    with pytest.raises(TypeError, match="loss_scale must be the Parameter holding the scale"):
        nn.DynamicLossScaleUpdateCell(8, 2, 2)(minidl.Tensor(np.float32(8)), False)
