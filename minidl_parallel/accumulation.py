"""Gradient accumulation (Horovod's ``backward_passes_per_step``): the gradients of k calls are
summed locally and reduced once, on the k-th; the other calls communicate nothing.

Example:
    >>> acc = GradientAccumulator(count=1, passes_per_step=2)
    >>> acc.only_accumulates()          # the first of 2 calls
    True
"""
__all__ = ["GradientAccumulator"]


class GradientAccumulator:
    """The running sum of each parameter's gradient over the calls that only accumulate.

    Args:
        count: the number of parameters.
        passes_per_step: k >= 1, the calls summed per reduction.
    """

    def __init__(self, count, passes_per_step):
        self.passes_per_step = passes_per_step
        self.passes = 0  # calls accumulated since the last reduction
        self._sums = [None] * count

    def only_accumulates(self):
        """Whether the call now starting only accumulates (it is not the k-th)."""
        return self.passes < self.passes_per_step - 1

    def call_done(self, reduced):
        """Counts a finished call: one more accumulated, or, after a reduction, none."""
        self.passes = 0 if reduced else self.passes + 1

    def add(self, index, grad):
        """Adds parameter ``index``'s gradient (an array, or None: nothing) to its sum."""
        if grad is None:
            return
        acc = self._sums[index]
        if acc is None:
            self._sums[index] = grad.copy()
        else:
            acc += grad

    def take(self, index, grad):
        """grad plus what earlier calls accumulated for parameter index (which is then cleared)."""
        acc, self._sums[index] = self._sums[index], None
        if acc is None:
            return grad
        if grad is not None:
            acc += grad
        return acc
