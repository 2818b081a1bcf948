"""The double's ``cupy.random``: one generator per device, as CuPy keeps them.

CuPy's ``cupy.random.seed(s)`` seeds only the *current* device's RandomState
(``cupy/random/_generator.py``: ``_random_states[device_id]``); a device never seeded
starts from ``CUPY_SEED`` or, without it, from fresh OS entropy. The double keeps that, so a
framework that seeds one device and draws on another draws unrepeatable numbers here too.
The streams are NumPy's, not cuRAND's: values differ from a GPU's; only their ownership,
seeding and shapes/dtypes are modelled.
"""
import os
import threading

import numpy

from . import names
from .names import StrictNamespace
from .ndarray import refuse_host_arrays, unwrap, wrap

_lock = threading.Lock()
_states = {}  # device id -> RandomState


def _seed_words(seed):
    """Any non-negative int (CuPy takes 64-bit seeds) as NumPy's legacy seed words."""
    if seed is None:
        return numpy.random.SeedSequence().generate_state(4)  # fresh OS entropy
    if isinstance(seed, ndarray_types()):
        raise TypeError("cupy_double: array seeds are not modelled")
    seed = int(seed)
    if seed < 0:
        raise ValueError("Seed must be non-negative")
    return numpy.random.SeedSequence(seed).generate_state(4)


def ndarray_types():
    from .ndarray import ndarray
    return (ndarray, numpy.ndarray)


class RandomState:
    """CuPy's RandomState API over NumPy's legacy generator; results are device arrays."""

    def __init__(self, seed=None, method=None):
        self._state = numpy.random.RandomState(_seed_words(seed))

    def seed(self, seed=None):
        self._state = numpy.random.RandomState(_seed_words(seed))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in names.allowed("cupy.random.RandomState"):
            raise names.absent("cupy.random.RandomState", name)
        draw = getattr(self._state, name, None)
        if draw is None:
            raise names.not_modelled("cupy.random.RandomState", name)

        def device_draw(*args, dtype=None, **kwargs):
            refuse_host_arrays(args)
            refuse_host_arrays(kwargs)
            if name in ("rand", "randn") and len(args) == 1 and isinstance(args[0], tuple):
                raise TypeError(f"{name}() takes the shape as separate ints")
            result = numpy.asarray(draw(*unwrap(args), **unwrap(kwargs)))
            if dtype is not None:
                result = result.astype(dtype)
            return wrap(result)
        device_draw.__name__ = name
        return device_draw


class Generator:
    """``cupy.random.default_rng(seed)``: NumPy's Generator API; results are device arrays."""

    def __init__(self, bit_generator=None):
        self._gen = numpy.random.default_rng(bit_generator)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in names.allowed("cupy.random.Generator"):
            raise names.absent("cupy.random.Generator", name)
        draw = getattr(self._gen, name)

        def device_draw(*args, **kwargs):
            refuse_host_arrays(args)
            refuse_host_arrays(kwargs)
            return wrap(numpy.asarray(draw(*unwrap(args), **unwrap(kwargs))))
        device_draw.__name__ = name
        return device_draw


def default_rng(seed=None):
    return Generator(None if seed is None else numpy.random.SeedSequence(int(seed)))


def get_random_state():
    """The current device's RandomState, created unseeded (CUPY_SEED or OS entropy) on first use."""
    from .cuda import current_device_id
    device_id = current_device_id()
    with _lock:
        state = _states.get(device_id)
        if state is None:
            env_seed = os.environ.get("CUPY_SEED")
            state = _states[device_id] = RandomState(None if env_seed is None else int(env_seed))
        return state


def set_random_state(rs):
    from .cuda import current_device_id
    with _lock:
        _states[current_device_id()] = rs


def seed(seed=None):
    """Seeds the current device's generator only (CuPy's behaviour, issue 16 bug 3)."""
    get_random_state().seed(seed)


def reset():
    """Forgets every device's generator (tests start from unseeded devices)."""
    with _lock:
        _states.clear()


def _resolve(name):
    members = {"RandomState": RandomState, "Generator": Generator, "default_rng": default_rng,
               "get_random_state": get_random_state, "set_random_state": set_random_state,
               "seed": seed}
    if name in members:
        return members[name]
    if name in names.allowed("cupy.random.RandomState"):
        # module-level draws (random_sample, normal, ...) use the current device's state
        def draw(*args, **kwargs):
            return getattr(get_random_state(), name)(*args, **kwargs)
        draw.__name__ = name
        return draw
    raise names.not_modelled("cupy.random", name)


_module = StrictNamespace("cupy.random", "cupy.random", _resolve)


def module():
    return _module
