"""GRAPH_MODE: a user's separate ops run as one fused op where a rule says they may, with eager's results.

Under ``minidl.set_context(mode=minidl.GRAPH_MODE)`` the model's Python runs on every step as in
PYNATIVE_MODE. What changes is the runtime every op and Cell call goes through: GRAPH_MODE
installs its layer (layer.py) over the runtime that places the work (minidl/runtime.py's
``set_mode_layer``), local or parallel. The layer applies a table of rules (rules.py), one row
per fusion:

    BatchNorm + ReLU            -> BatchNormReLU
    BatchNorm + Add + ReLU      -> BatchNormReLU (with the residual)
    Dense + ReLU                -> DenseReLU
    MatMul + ReLU               -> DenseReLU     (x @ w.T, nn.Dense's product)
    MatMul + BiasAdd + ReLU     -> DenseReLU
    MatMul + BiasAdd            -> Dense         (when they must run without a ReLU)

A call of a row's head (BatchNorm, MatMul, Dense; exact classes) whose guards hold checks its
arguments as eager would (eager's errors, at the call) and returns a *pending* tensor
(pending.py): the op and its arguments, not computed. Then:

- the pattern's next op (an Add of a residual of the same shape, a BiasAdd of the columns) is
  deferred too; its tail (a ReLU) runs the row's replacement and returns its output;
- any other use of a pending value (another op, ``asnumpy``, printing, backward) computes it
  first, as eager ran it; so does reading or writing one of its arguments (``bn.moving_mean``
  read before the ReLU): Tensor's ``data`` asks the pending op to run first;
- each Cell call is a window: when it returns, what it left pending and does not return runs
  (a training BatchNorm updates its moving statistics even when its output is unused); the
  outermost Cell, the end of a function under ``value_and_grad`` / ``grad`` and a mode change
  run the rest.

So the values, the graph and the side effects are eager's. After fusion a head's own output
may still be used (``a = relu(y); b = y * 2``): it is computed then without a second update of
the moving statistics, on the values its arguments had at fusion (they stay watched until then
or until it is garbage-collected). Its node and the fused one send gradients that sum to
eager's. Anything a guard refuses (NHWC, a residual that broadcasts, a grad mode changed in the
window, a subclass such as SyncBatchNorm's op, an op with a user's strategy) runs eagerly:
never a replayed guess. :func:`explain` prints, for one call of a network, what fused, what did
not and why. Why deferral rather than record and replay: docs/graph_mode.md.

No user object changes class, and nothing is patched into the core: the core asks the runtime
(its one seam), and Tensor asks a pending value's record.
"""
from .. import backend, runtime
from .explain import explain
from .layer import GraphLayer, flush, is_deferred
from .rules import RULES, Rule

__all__ = ["explain", "flush", "is_deferred", "GraphLayer", "RULES", "Rule"]


def _on_mode(mode):
    flush()
    runtime.set_mode_layer(GraphLayer.over if mode == backend.GRAPH_MODE else None)


backend.add_mode_listener(_on_mode)
_on_mode(backend.get_context("mode"))  # MINIDL_MODE=graph: the default mode is GRAPH_MODE
