"""``explain(net, *inputs)``: what GRAPH_MODE fused in one call of ``net``, what it did not, and why.

It runs a copy of ``net`` (so its moving statistics and parameters stay as they were) once under
GRAPH_MODE with a journal, in which the layer (layer.py) and the pending values (pending.py)
note each head deferred or not, each pattern fused by its rule, and each pending op that ran
on its own with the reason: the use that broke the pattern, the guard that failed, or the
window that ended.
"""
import copy

from .. import backend
from ..tensor import no_grad
from . import layer as _layer
from .rules import RULES

__all__ = ["explain"]


class Journal:
    """The notes of one explained call: rows of (what, pattern, where, why)."""

    def __init__(self, names):
        self.names = names  # id(cell) -> its path in the network
        # Keyed by the records themselves, not their id(): a record that ran is freed, and a later
        # one could take its id and inherit its place or reason.
        self.where = {}  # record -> the cell path its head was called in
        self.why = {}  # record -> why its pattern broke (before it ran)
        self.rows = []

    def _path(self, cell):  # (never None: explain's ops all run inside its copy of the network)
        return self.names.get(id(cell)) or type(cell).__name__

    def deferred(self, record, cell):
        self.where[record] = self._path(cell)

    def continued(self, record, head_record):
        """``record``, the op after a pending head, is reported where its head was called."""
        self.where[record] = self.where[head_record]

    def broke(self, record, reason):
        self.why.setdefault(record, reason)

    def fused(self, head_record, rule):
        self.rows.append({"what": "fused", "ops": rule.describe(), "where": self.where[head_record],
                          "why": "its guards held"})

    def ran(self, record, rule, why):
        ops = record.op.name if rule is None else rule.describe()
        reason = self.why.get(record, why)
        what = "fused" if rule is not None else "not fused"
        self.rows.append({"what": what, "ops": ops, "where": self.where[record], "why": reason})

    def note(self, what, name, cell, reason):
        self.rows.append({"what": what, "ops": name, "where": self._path(cell), "why": reason})

    def sequence(self, dense):
        self.rows.append({"what": "fused", "ops": "Dense + ReLU -> DenseReLU", "where": self._path(dense),
                          "why": "an nn.Dense cell then an nn.ReLU cell in a SequentialCell"})


def explain(net, *inputs, file=None, grad=True):
    """Runs a copy of ``net`` on ``inputs`` once under GRAPH_MODE and prints what fused and what
    did not, and why; returns the rows (dicts with what, ops, where, why).

    Args:
        net: a Cell (it is copied: its state does not change).
        inputs: its inputs, as for a call.
        file: where to print (default stdout); None prints, False prints nothing.
        grad: run with gradients recorded (as a training step does; the fusion guards check the
            grad mode), or not (inference).

    Example:
        >>> minidl.graph_mode.explain(net, x)
        GRAPH_MODE over one call of ResNet: 19 fused, 1 not fused
          fused      BatchNorm + ReLU -> BatchNormReLU         at layer1.0.bn1  (its guards held)
          ...
    """
    twin = copy.deepcopy(net)
    journal = Journal({id(cell): name for name, cell in twin.cells_and_names() if name})
    mode = backend.get_context("mode")
    before = _layer._thread.journal
    try:
        backend.set_context(mode=backend.GRAPH_MODE)
        _layer._thread.journal = journal
        if grad:
            twin(*inputs)
        else:
            with no_grad():
                twin(*inputs)
        _layer.flush()
    finally:
        _layer._thread.journal = before
        backend.set_context(mode=mode)
    rows = journal.rows
    if file is not False:
        print(_render(type(net).__name__, rows), file=file)
    return rows


def _render(name, rows):
    fused = sum(r["what"] == "fused" for r in rows)
    lines = [f"GRAPH_MODE over one call of {name}: {fused} fused, {len(rows) - fused} not fused"]
    width = max([len(r["ops"]) for r in rows] + [10])
    for r in rows:
        lines.append(f"  {r['what']:<13} {r['ops']:<{width}}  at {r['where']}: {r['why']}")
    lines.append("rules:")
    lines += [f"  {rule.describe()}" for rule in RULES]
    return "\n".join(lines)
