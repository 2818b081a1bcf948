"""Test helpers: the op-test harness (forward vs reference, finite-difference gradients)."""
from .gradcheck import check_op, check_forward, check_backward, numerical_grad, assert_allclose

__all__ = ["check_op", "check_forward", "check_backward", "numerical_grad", "assert_allclose"]
