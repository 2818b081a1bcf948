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


def test_the_smallest_values_mindspore_accepts_are_accepted():
    assert amp.FixedLossScaleManager(1).get_loss_scale() == 1
    manager = amp.DynamicLossScaleManager(init_loss_scale=1, scale_factor=1, scale_window=1)
    manager.update_loss_scale(False)  # a window of 1: every clean step grows the scale (by 1 here)
    assert (manager.get_loss_scale(), manager.cur_iter) == (1, 2)
    growing = amp.DynamicLossScaleManager(init_loss_scale=1.0, scale_factor=0.5, scale_window=1)
    growing.update_loss_scale(False)  # (a factor below 1 is allowed, as MindSpore's check is > 0)
    assert growing.get_loss_scale() == 0.5


@pytest.mark.parametrize("make, error, message", [
    (lambda: amp.FixedLossScaleManager("8"), TypeError,
     "FixedLossScaleManager: loss_scale must be a number, got str '8'"),
    (lambda: amp.DynamicLossScaleManager("8"), TypeError,
     "DynamicLossScaleManager: init_loss_scale must be a number, got str '8'"),
    (lambda: amp.DynamicLossScaleManager(scale_factor=None), TypeError,
     "DynamicLossScaleManager: scale_factor must be a number, got NoneType None"),
    (lambda: amp.DynamicLossScaleManager(scale_factor=-2), ValueError,
     "DynamicLossScaleManager: the argument 'scale_factor' must be > 0, but got -2"),
])
def test_each_message_names_the_class_and_the_argument_in_full(make, error, message):
    with pytest.raises(error) as raised:
        make()
    assert str(raised.value) == message


@pytest.mark.parametrize("cell, args, message", [
    (nn.DynamicLossScaleUpdateCell, ("8", 2, 2), "loss_scale_value must be a number > 0, got '8'"),
    (nn.DynamicLossScaleUpdateCell, (8, True, 2), "scale_factor must be a number > 0, got True"),
    (nn.DynamicLossScaleUpdateCell, (8, 0, 2), "scale_factor must be a number > 0, got 0"),
    (nn.DynamicLossScaleUpdateCell, (8, 2, 2.0), "scale_window must be a positive int, got 2.0"),
    (nn.FixedLossScaleUpdateCell, (True,), "loss_scale_value must be a number > 0, got True"),
    (nn.FixedLossScaleUpdateCell, (0,), "loss_scale_value must be a number > 0, got 0"),
])
def test_the_update_cells_messages_name_the_cell_the_argument_and_the_value(cell, args, message):
    with pytest.raises(ValueError) as raised:
        cell(*args)
    assert str(raised.value) == f"{cell.__name__}: {message}"


def test_the_update_cells_accept_scales_and_factors_below_one_and_a_window_of_one():
    cell = nn.DynamicLossScaleUpdateCell(0.5, 0.5, 1)
    assert cell.get_loss_scale() == 0.5 and nn.FixedLossScaleUpdateCell(0.5).get_loss_scale() == 0.5
    scale = minidl.Parameter(np.array(4.0, np.float32), requires_grad=False)
    cell(scale, False)  # a window of 1: every clean step multiplies
    assert float(scale.asnumpy()) == 2.0


def test_the_update_cells_step_counters_are_int32_parameters_that_are_not_trained():
    cell = nn.DynamicLossScaleUpdateCell(8, 2, 2)
    assert cell.trainable_params() == []
    assert [(p.dtype, p.requires_grad) for p in cell.get_parameters()] == [(np.dtype(np.int32), False)] * 2
    with pytest.raises(TypeError, match=r"^DynamicLossScaleUpdateCell: loss_scale must be the Parameter holding the "
                                        r"scale \(the step cell's scale_sense\), got Tensor$"):
        cell(minidl.Tensor(np.float32(8)), False)


def test_a_manager_of_ones_own_must_define_the_three_methods():
    class Mine(amp.LossScaleManager):
        pass

    for call, name in ((lambda m: m.get_loss_scale(), "get_loss_scale"), (lambda m: m.update_loss_scale(True),
                       "update_loss_scale"), (lambda m: m.get_update_cell(), "get_update_cell")):
        with pytest.raises(NotImplementedError, match=f"^Mine.{name} is not defined$"):
            call(Mine())
