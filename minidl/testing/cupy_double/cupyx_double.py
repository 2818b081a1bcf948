"""The double's ``cupyx`` (``cupyx.scatter_add``, which minidl's index backward uses)."""
from . import names
from .names import StrictNamespace
from .ndarray import ndarray, unsupported, unwrap


def _scatter(numpy_ufunc):
    def scatter(a, slices, value):
        if not isinstance(a, ndarray):
            raise unsupported(a)
        # CuPy uploads host indices and values here (``_scatter_op``); device ones stay
        numpy_ufunc.at(a._a, unwrap(slices), unwrap(value))
    return scatter


def _resolve(name):
    import numpy
    members = {"scatter_add": _scatter(numpy.add), "scatter_max": _scatter(numpy.maximum),
               "scatter_min": _scatter(numpy.minimum)}
    if name in members:
        return members[name]
    raise names.not_modelled("cupyx", name)


_module = StrictNamespace("cupyx", "cupyx", _resolve)


def module():
    return _module
