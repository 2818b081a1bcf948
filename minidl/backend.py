"""Which array module runs the ops (NumPy or CuPy), the device context and the seed.

Every op body is written once against ``xp = get_array_module(*arrays)``; this module is
the only place that knows CuPy exists. CuPy is imported lazily, so a machine without it
never pays for (or breaks on) the import.
"""
import os
import threading

import numpy

# device_target: None until first asked; chosen: set by set_context or $MINIDL_DEVICE (else defaulted)
_state = {"device_target": None, "chosen": False, "seed": None}

# MindSpore's execution modes, under its names and values (``minidl.GRAPH_MODE``). PYNATIVE_MODE runs
# every op as it is called; GRAPH_MODE defers BatchNorm until its first use so that a following
# (Add and) ReLU run fused, with eager's results (minidl/graph_mode/, docs/graph_mode.md).
GRAPH_MODE = 0
PYNATIVE_MODE = 1


def _mode_from_env():
    """The default mode: $MINIDL_MODE ("graph" or "pynative"; read once, at import), else PYNATIVE_MODE."""
    value = os.environ.get("MINIDL_MODE", "").strip().lower()
    if value in ("", "pynative"):
        return PYNATIVE_MODE
    if value == "graph":
        return GRAPH_MODE
    raise ValueError(f"MINIDL_MODE must be 'graph' or 'pynative', got {value!r}")


# What set_context stores besides the device; the values are MindSpore's defaults.
_settings = {"mode": _mode_from_env(), "save_graphs": 0, "save_graphs_path": "."}
_mode_listeners = []  # fn(mode), called by set_context(mode=...): minidl/graph_mode/ installs its runtime layer
_rng_local = threading.local()
_cupy = None  # the cupy module once imported, False when it is not importable
_cupy_error = None  # why not, when it is not: shown to the user who asks for the GPU


def _import_cupy():
    """Returns the cupy module, or None when CuPy (or a GPU) is not available."""
    global _cupy, _cupy_error
    if _cupy is None:
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("CUDA sees no device (getDeviceCount() returned 0)")
            _cupy = cupy
        except Exception as exc:  # ImportError, or CUDA present without a device/driver
            _cupy, _cupy_error = False, exc
    return _cupy or None


def gpu_available():
    """True when CuPy imports and sees at least one CUDA device."""
    return _import_cupy() is not None


def gpu_unavailable_reason():
    """Why the GPU cannot be used (the error CuPy or CUDA gave), or None when it can."""
    if gpu_available():
        return None
    exc = _cupy_error
    if isinstance(exc, ImportError):
        return f"CuPy is not installed ({exc}); pip install 'minidl[gpu]'"
    return f"CuPy is installed but CUDA failed: {type(exc).__name__}: {exc}"


def set_context(device_target=None, device_id=None, mode=None, save_graphs=None, save_graphs_path=None):
    """Sets the context, as ``mindspore.set_context``: where new tensors live, the execution mode,
    and whether to save the parallel plan.

    Args:
        device_target: "CPU" (NumPy) or "GPU" (CuPy), case-insensitive.
        device_id: the CUDA device to use on GPU (default: the current one).
        mode: ``minidl.PYNATIVE_MODE`` (1, the default; ``MINIDL_MODE=graph`` makes GRAPH_MODE the
            default) or ``minidl.GRAPH_MODE`` (0): BatchNorm waits for its first use, so that a
            following Add and ReLU run as one fused op (docs/graph_mode.md). The results do not
            depend on the mode (to the fused kernel's stated rounding). Setting it runs what the
            previous mode left deferred.
        save_graphs: False/0 (default), True or a level 1-3: under tensor parallelism, the first
            step of each network (and of each new input shape) writes its parallel plan, the text
            of ``minidl_parallel.explain``, into ``save_graphs_path``/rank_<r>/.
        save_graphs_path: the folder for saved plans (default "."; made when first written).

    Example:
        >>> minidl.set_context(mode=minidl.GRAPH_MODE, device_target="CPU")
    """
    if mode is not None and (isinstance(mode, bool) or mode not in (GRAPH_MODE, PYNATIVE_MODE)):
        raise ValueError(f"set_context: mode must be minidl.GRAPH_MODE ({GRAPH_MODE}) or minidl.PYNATIVE_MODE "
                         f"({PYNATIVE_MODE}), got {mode!r}")
    if save_graphs is not None and not (isinstance(save_graphs, bool) or
                                        (isinstance(save_graphs, int) and 0 <= save_graphs <= 3)):
        raise ValueError(f"set_context: save_graphs must be a bool or an int from 0 to 3, got {save_graphs!r}")
    if save_graphs_path is not None and not isinstance(save_graphs_path, (str, os.PathLike)):
        raise TypeError(f"set_context: save_graphs_path must be a str or a path, got {type(save_graphs_path).__name__}")
    if device_target is not None:
        target = str(device_target).upper()
        if target not in ("CPU", "GPU"):
            raise ValueError(f"set_context: device_target must be 'CPU' or 'GPU', got {device_target!r}")
        if target == "GPU" and not gpu_available():
            raise RuntimeError(f"set_context: device_target='GPU' needs CuPy and a CUDA device: "
                               f"{gpu_unavailable_reason()}")
        _state["device_target"], _state["chosen"] = target, True
    if device_id is not None:
        if get_device_target() != "GPU":
            raise ValueError("set_context: device_id is only meaningful with device_target='GPU'")
        _import_cupy().cuda.Device(int(device_id)).use()
    if mode is not None:
        _settings["mode"] = mode
        for listener in _mode_listeners:
            listener(mode)
    if save_graphs is not None:
        _settings["save_graphs"] = int(save_graphs)
    if save_graphs_path is not None:
        _settings["save_graphs_path"] = os.fspath(save_graphs_path)


def add_mode_listener(fn):
    """Calls ``fn(mode)`` whenever set_context sets the mode (minidl/graph_mode/ installs its
    runtime layer so: this module imports nothing of the ops it steers)."""
    _mode_listeners.append(fn)


def get_context(key):
    """Returns a context value: "device_target", "mode", "save_graphs" (0-3) or "save_graphs_path"."""
    if key == "device_target":
        return get_device_target()
    if key not in _settings:
        raise ValueError(f"get_context: unknown key {key!r}; expected one of "
                         f"{['device_target'] + sorted(_settings)}")
    return _settings[key]


def get_device_target():
    """The device new tensors go to: the context, else $MINIDL_DEVICE, else GPU if seen."""
    target = _state["device_target"]
    if target is None:
        env = os.environ.get("MINIDL_DEVICE")
        if env:
            set_context(env)
        else:
            _state["device_target"] = "GPU" if gpu_available() else "CPU"
        target = _state["device_target"]
    return target


def device_target_chosen():
    """Whether the user chose the device target (set_context or $MINIDL_DEVICE), rather than
    it defaulting to the GPU when one is seen."""
    if _state["device_target"] is None and os.environ.get("MINIDL_DEVICE"):
        get_device_target()
    return _state["chosen"]


def prefer_device_target(target):
    """Makes ``target`` the default device while nothing has fixed it yet; returns the device
    target in force.

    A launcher-side choice (``minidl_parallel.init("mpi")`` prefers the CPU) must not override
    the user's (set_context, $MINIDL_DEVICE), nor move the default after it was used: tensors
    made before would be left on the other device.
    """
    target = str(target).upper()
    if target not in ("CPU", "GPU"):
        raise ValueError(f"prefer_device_target: target must be 'CPU' or 'GPU', got {target!r}")
    if _state["device_target"] is None and not device_target_chosen():
        if target == "GPU" and not gpu_available():
            target = "CPU"
        _state["device_target"] = target
    return get_device_target()


def default_xp():
    """The array module for new tensors under the current context."""
    return _import_cupy() if get_device_target() == "GPU" else numpy


def get_array_module(*xs):
    """numpy or cupy, whichever owns the given arrays (numpy for plain Python values)."""
    if _cupy:
        for x in xs:
            if isinstance(x, _cupy.ndarray):
                return _cupy
    return numpy


def to_device(array, xp=None):
    """Moves an array (or nested Python data) to the array module ``xp`` (default: the context's)."""
    xp = xp or default_xp()
    if xp is numpy:
        return to_numpy(array)
    return xp.asarray(array)


def to_numpy(array):
    """A NumPy array with the same values (copies from the GPU when needed)."""
    if _cupy and isinstance(array, _cupy.ndarray):
        return _cupy.asnumpy(array)
    return numpy.asarray(array)


def set_seed(seed):
    """Seeds parameter initialisation, dropout and shuffling, so that runs repeat exactly."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"set_seed: seed must be a non-negative int, got {seed!r}")
    _state["seed"] = seed
    _rng_local.__dict__.clear()
    _rng_local.generator = numpy.random.default_rng(seed)
    cupy = _import_cupy() if _cupy is not False else None
    if cupy is not None:
        cupy.random.seed(seed)


def get_seed():
    """The seed given to set_seed, or None."""
    return _state["seed"]


def rng():
    """The framework's NumPy random generator (per thread; seeded by set_seed)."""
    gen = getattr(_rng_local, "generator", None)
    if gen is None:
        seed = _state["seed"]
        gen = _rng_local.generator = numpy.random.default_rng(seed)
    return gen


def device_rng():
    """The CuPy RandomState for one draw on the device, seeded from rng() (per thread).

    CuPy's own ``cupy.random`` state is one per device and ``cupy.random.seed`` seeds only the
    current device's: ranks on other devices would draw unseeded numbers, thread-ranks sharing a
    device would share one stream, and a checkpoint (which saves rng()'s state) could not resume
    it. Seeding each draw from rng() costs one host integer (no transfer, no sync) and makes
    device draws follow set_seed on every device and thread, and resume exactly.
    """
    gen = getattr(_rng_local, "device_generator", None)
    if gen is None:
        gen = _rng_local.device_generator = _import_cupy().random.RandomState()
    gen.seed(int(rng().integers(2 ** 63)))
    return gen
