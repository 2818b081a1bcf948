"""The double's ``cupy.cuda``: devices, streams and events as minidl and minidl_parallel use them.

The current device is per host thread, as CUDA's is (``cudaSetDevice``). The double runs
work eagerly, so every event is done as soon as it is recorded; ``synchronize()`` calls are
counted as host synchronisations all the same, because on a GPU they make the host wait.
"""
import itertools
import threading

from . import names, syncs
from .names import StrictNamespace

_local = threading.local()
_config = {"device_count": 1}
_handles = itertools.count(0x7000)  # fake stream / event handles, unique in a process


def configure(device_count=1):
    """How many GPUs the double pretends to have (1 unless a test asks for more)."""
    if device_count < 1:
        raise ValueError("cupy_double: device_count must be >= 1")
    _config["device_count"] = int(device_count)


def current_device_id():
    return getattr(_local, "device_id", 0)


def _check_device(device_id):
    if not 0 <= device_id < _config["device_count"]:
        # CUDA's error for a device ordinal that this process cannot see
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal ({device_id}; "
                               f"{_config['device_count']} visible)")


class CUDARuntimeError(RuntimeError):
    pass


class Device:
    """``cupy.cuda.Device(i)``: ``use()``, ``synchronize()``, and a context manager."""

    def __init__(self, device=None):
        self.id = current_device_id() if device is None else int(device)
        _check_device(self.id)

    def use(self):
        _local.device_id = self.id

    def synchronize(self):
        syncs.record("Device.synchronize")

    def __enter__(self):
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(current_device_id())
        self.use()
        return self

    def __exit__(self, *exc):
        _local.device_id = _local.stack.pop()

    @property
    def compute_capability(self):
        return "90"

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id}>"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in names.allowed("cupy.cuda.Device"):
            raise names.not_modelled("cupy.cuda.Device", name)
        raise names.absent("cupy.cuda.Device", name)


class Event:
    """Recorded work is already finished in the double, so ``done`` is True once recorded."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.ptr = next(_handles)
        self._recorded = False

    @property
    def done(self):
        return True

    def record(self, stream=None):
        self._recorded = True

    def synchronize(self):
        syncs.record("Event.synchronize")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise names.absent("cupy.cuda.Event", name)


class Stream:
    """A stream on the current device; the double runs everything in order, at once."""

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0 if null else next(_handles)
        self.device_id = current_device_id()
        self.is_non_blocking = bool(non_blocking)

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event):
        pass

    def synchronize(self):
        syncs.record("Stream.synchronize")

    @property
    def done(self):
        return True

    def use(self):
        _streams()[current_device_id()] = self
        return self

    def __enter__(self):
        stack = getattr(_local, "stream_stack", None)
        if stack is None:
            stack = _local.stream_stack = []
        stack.append(get_current_stream())
        return self.use()

    def __exit__(self, *exc):
        _local.stream_stack.pop().use()

    def __eq__(self, other):
        return isinstance(other, Stream) and other.ptr == self.ptr and other.device_id == self.device_id

    def __hash__(self):
        return self.ptr

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in names.allowed("cupy.cuda.Stream"):
            raise names.not_modelled("cupy.cuda.Stream", name)
        raise names.absent("cupy.cuda.Stream", name)


def _streams():
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    return streams


def get_current_stream(device_id=-1):
    device_id = current_device_id() if device_id < 0 else device_id
    stream = _streams().get(device_id)
    if stream is None:
        stream = Stream(null=True)
        stream.device_id = device_id
        _streams()[device_id] = stream
    return stream


def get_device_id():
    return current_device_id()


def _runtime_resolve(name):
    functions = {
        "getDeviceCount": lambda: _config["device_count"],
        "getDevice": current_device_id,
        "setDevice": lambda i: Device(i).use(),
        "deviceSynchronize": lambda: syncs.record("deviceSynchronize"),
        "runtimeGetVersion": lambda: 12080,
        "driverGetVersion": lambda: 12080,
        "CUDARuntimeError": CUDARuntimeError,
    }
    if name in functions:
        return functions[name]
    raise names.not_modelled("cupy.cuda.runtime", name)


def _cuda_resolve(name):
    if name == "runtime":
        return _runtime
    members = {"Device": Device, "Event": Event, "Stream": Stream,
               "get_current_stream": get_current_stream, "get_device_id": get_device_id,
               "is_available": lambda: True}
    if name in members:
        return members[name]
    raise names.not_modelled("cupy.cuda", name)


_runtime = StrictNamespace("cupy.cuda.runtime", "cupy.cuda.runtime", _runtime_resolve)
_module = StrictNamespace("cupy.cuda", "cupy.cuda", _cuda_resolve)


def module():
    return _module
