"""The name a checkpoint stores a parameter under, and the mark of a name the Cell tree derived.

Both live in io/ rather than beside Cell (minidl/nn/cell.py), because the checkpoint code needs
the rule and nn/ re-exports the optimizers, which load checkpoints: io/ importing nn/ closed the
loop io/ -> nn/ -> optim/ -> io/. Cell imports them from here to name and rename its parameters.
"""
__all__ = ["checkpoint_name"]


class _AutoName(str):
    """A parameter name the Cell tree derived from attribute paths (so it may be re-prefixed)."""

    __slots__ = ()


def checkpoint_name(path, param):
    """The name a checkpoint stores ``param`` under: the name it was given, else ``path``.

    A name is given with ``Parameter(x, name="w")`` (and kept by the tree when it differs from
    the attribute name); a name the tree derived (``_AutoName``) or none means the attribute
    path from the saved cell, as ``parameters_and_names()`` yields it.

    Example:
        >>> net = nn.SequentialCell(nn.Dense(2, 2))
        >>> net[0].bias = Parameter(numpy.zeros(2, numpy.float32), name="b")
        >>> [checkpoint_name(path, p) for path, p in net.parameters_and_names()]
        ['0.weight', 'b']
    """
    name = getattr(param, "name", None)
    if isinstance(name, str) and name and not isinstance(name, _AutoName):
        return str(name)
    return path
