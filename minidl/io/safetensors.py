"""The safetensors file format, read and written with NumPy alone; writes are atomic.

Layout (https://github.com/huggingface/safetensors): 8 bytes, the little-endian u64 length N
of the header; N bytes of UTF-8 JSON
``{name: {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, padded with spaces so that the data starts 8-byte aligned;
then the tensors' raw little-endian C-order bytes, offsets counted from the end of the
header. We lay tensors out in sorted name order, with no gaps.

Reading validates everything a truncated or corrupted file can get wrong and raises
ValueError naming the file and the fault. BF16 tensors (no NumPy dtype) load as float32.

Example:
    >>> save_file({"w": numpy.ones((2, 3), numpy.float32)}, "w.safetensors", {"epoch": "3"})
    >>> load_file("w.safetensors")["w"].shape
    (2, 3)
"""
import json
import math
import os
import tempfile

import numpy

__all__ = ["save_file", "load_file", "load_metadata", "atomic_write", "DTYPES"]

# safetensors code -> little-endian NumPy dtype
DTYPES = {"BOOL": numpy.dtype("bool"), "U8": numpy.dtype("u1"), "I8": numpy.dtype("i1"),
          "I16": numpy.dtype("<i2"), "U16": numpy.dtype("<u2"), "I32": numpy.dtype("<i4"),
          "U32": numpy.dtype("<u4"), "I64": numpy.dtype("<i8"), "U64": numpy.dtype("<u8"),
          "F16": numpy.dtype("<f2"), "F32": numpy.dtype("<f4"), "F64": numpy.dtype("<f8"),
          "BF16": numpy.dtype("<u2")}  # read as raw u16, then widened to float32
_CODES = {(dt.kind, dt.itemsize): code for code, dt in DTYPES.items() if code != "BF16"}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit


# ---- writing ------------------------------------------------------------------------------

def _prepare(tensors, metadata):
    """Validates the inputs; returns (header bytes, [(name, little-endian C-order array)])."""
    if not isinstance(tensors, dict):
        raise TypeError(f"save_file: tensors must be a dict name -> numpy array, got {type(tensors).__name__}")
    for name in tensors:
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"save_file: tensor names must be non-empty strings other than '__metadata__', "
                             f"got {name!r}")
    header, arrays, offset = {}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        if isinstance(a, numpy.generic):
            a = numpy.asarray(a)
        if not isinstance(a, numpy.ndarray):
            raise TypeError(f"save_file: tensor {name!r} must be a numpy.ndarray, got {type(a).__name__}")
        code = _CODES.get((a.dtype.kind, a.dtype.itemsize))
        if code is None:
            raise ValueError(f"save_file: tensor {name!r} has dtype {a.dtype}, which safetensors cannot store; "
                             f"supported: {sorted(_CODES.values())}")
        shape = [int(d) for d in a.shape]
        a = numpy.require(a.reshape(-1), DTYPES[code], "C")  # 1-D: also covers 0-d arrays
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    if metadata:
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in metadata.items()):
            raise TypeError(f"save_file: metadata must be a dict str -> str, got {metadata!r}")
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw, arrays


def _fsync_dir(directory):
    """Makes a rename durable; some platforms (Windows) cannot open a directory: skip there."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(filename, write):
    """Calls ``write(f)`` on a temporary file beside ``filename``, then renames it over.

    The data is flushed and fsync'ed before ``os.replace``, and the directory after it, so a
    crash at any point leaves either the previous file or the complete new one under
    ``filename``, never a torn one; on error the temporary file is removed.
    """
    filename = os.fspath(filename)
    directory = os.path.dirname(os.path.abspath(filename))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(filename)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files
        os.replace(tmp, filename)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def save_file(tensors, filename, metadata=None):
    """Writes ``tensors`` (dict name -> numpy.ndarray) to ``filename`` atomically.

    Args:
        tensors: name -> NumPy array of a dtype safetensors stores (bool, (u)int8..64,
            float16/32/64); any shape, 0-d and empty included.
        filename: the path; an existing file is replaced only once the new one is complete.
        metadata: optional dict str -> str, stored under "__metadata__".
    """
    header, arrays = _prepare(tensors, metadata)

    def write(f):
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for a in arrays:
            if a.size:
                f.write(a.view(numpy.uint8).data)

    atomic_write(filename, write)


# ---- reading ------------------------------------------------------------------------------

def _bad(filename, what):
    return ValueError(f"{filename}: not a valid safetensors file: {what}")


def _read_header(f, filename):
    """Returns ({name: (code, shape, begin, end)}, metadata, data start)."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise _bad(filename, f"the file has {size} bytes, fewer than the 8-byte header length")
    n = int.from_bytes(f.read(8), "little")
    if n > _MAX_HEADER or 8 + n > size:
        raise _bad(filename, f"header length {n} runs past the end of the file ({size} bytes)")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(filename, f"the header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(filename, f"the header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(filename, "__metadata__ must map strings to strings")
    data_len = size - 8 - n
    entries = {}
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise _bad(filename, f"tensor {name!r} needs dtype, shape and data_offsets, got {info!r}")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if code not in DTYPES:
            raise _bad(filename, f"tensor {name!r} has unknown dtype {code!r}; expected one of {sorted(DTYPES)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _bad(filename, f"tensor {name!r} has shape {shape!r}; expected a list of non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_len):
            raise _bad(filename, f"tensor {name!r} has data_offsets {offsets!r} outside the data section "
                                 f"[0, {data_len}]")
        nbytes = math.prod(shape) * DTYPES[code].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise _bad(filename, f"tensor {name!r} of dtype {code} and shape {shape} needs {nbytes} bytes, "
                                 f"but its data_offsets {offsets} span {offsets[1] - offsets[0]}")
        entries[name] = (code, tuple(shape), offsets[0], offsets[1])
    previous = None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda e: e[1][2:]):
        if begin == end:
            continue
        if previous is not None and begin < previous[1]:
            raise _bad(filename, f"tensors {previous[0]!r} and {name!r} overlap "
                                 f"(bytes {previous[1]} and {begin})")
        previous = (name, end)
    return entries, metadata, 8 + n


def load_file(filename):
    """Reads a safetensors file into a dict name -> numpy.ndarray (sorted by name)."""
    filename = os.fspath(filename)
    with open(filename, "rb") as f:
        entries, _, start = _read_header(f, filename)
        out = {}
        for name, (code, shape, begin, end) in sorted(entries.items(), key=lambda e: e[1][2]):
            a = numpy.empty(shape, DTYPES[code])
            if a.size:
                f.seek(start + begin)
                got = f.readinto(a.reshape(-1).view(numpy.uint8).data)
                if got != end - begin:
                    raise _bad(filename, f"tensor {name!r} is truncated ({got} of {end - begin} bytes)")
            if code == "BF16":
                a = (a.astype(numpy.uint32) << 16).view(numpy.float32)
            out[name] = a.astype(a.dtype.newbyteorder("="), copy=False)
    return dict(sorted(out.items()))


def load_metadata(filename):
    """The "__metadata__" dict (str -> str) of a safetensors file ({} when absent)."""
    filename = os.fspath(filename)
    with open(filename, "rb") as f:
        return _read_header(f, filename)[1]
