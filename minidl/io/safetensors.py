"""The safetensors file format, read and written with NumPy alone; writes are atomic.

Layout (https://github.com/huggingface/safetensors): 8 bytes, the little-endian u64 length N
of the header; N bytes of UTF-8 JSON
``{name: {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, padded with spaces so that the data starts 8-byte aligned;
then the tensors' raw little-endian C-order bytes, offsets counted from the end of the
header. We lay tensors out in sorted name order, with no gaps.

Reading validates everything a truncated or corrupted file can get wrong and raises
ValueError naming the file and the fault. BF16 tensors (no NumPy dtype) load as float32.

Checksums: ``save_file`` stores, under the metadata key "minidl.crc32", compact JSON
``{name: "8 hex digits"}`` holding the CRC32 of each tensor's stored bytes, plus one entry
under "__metadata__" (the one name no tensor can have) for the rest of the header: every
tensor's name, dtype, shape and offsets and the other metadata. Metadata values must be
strings, so other safetensors readers still read the file (and show the key). Reading a file
that has the key verifies the header on open and each tensor as it is read, and raises
ValueError naming the file, the tensor and both checksums on a mismatch; files without it
(older ones, other writers) load unchecked. ``load_metadata`` leaves the key out.

Temporary files: ``atomic_write`` writes to ``.{basename}.{host}.{pid}.{random}.tmp`` beside
the target, so that ``remove_stale_temp_files`` can tell the leftovers of a killed writer
(same host, process gone) from the file of a writer still at work.

Example:
    >>> save_file({"w": numpy.ones((2, 3), numpy.float32)}, "w.safetensors", {"epoch": "3"})
    >>> load_file("w.safetensors")["w"].shape
    (2, 3)
"""
import hashlib
import json
import math
import os
import re
import socket
import string
import tempfile
import warnings
import zlib

import numpy

__all__ = ["save_file", "load_file", "load_metadata", "atomic_write", "remove_stale_temp_files", "DTYPES",
           "CHECKSUM_KEY"]

# safetensors code -> little-endian NumPy dtype
DTYPES = {"BOOL": numpy.dtype("bool"), "U8": numpy.dtype("u1"), "I8": numpy.dtype("i1"),
          "I16": numpy.dtype("<i2"), "U16": numpy.dtype("<u2"), "I32": numpy.dtype("<i4"),
          "U32": numpy.dtype("<u4"), "I64": numpy.dtype("<i8"), "U64": numpy.dtype("<u8"),
          "F16": numpy.dtype("<f2"), "F32": numpy.dtype("<f4"), "F64": numpy.dtype("<f8"),
          "BF16": numpy.dtype("<u2")}  # read as raw u16, then widened to float32
_CODES = {(dt.kind, dt.itemsize): code for code, dt in DTYPES.items() if code != "BF16"}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit
CHECKSUM_KEY = "minidl.crc32"  # metadata key of the checksums (see the module docstring)
_HEADER_ENTRY = "__metadata__"  # the checksum map's entry for the header; no tensor has this name


# ---- writing ------------------------------------------------------------------------------

def _prepare(tensors, metadata):
    """Validates the inputs; returns (header bytes, [(name, little-endian C-order array)])."""
    if not isinstance(tensors, dict):
        raise TypeError(f"save_file: tensors must be a dict name -> numpy array, got {type(tensors).__name__}")
    for name in tensors:
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"save_file: tensor names must be non-empty strings other than '__metadata__', "
                             f"got {name!r}")
    header, arrays, checksums, offset = {}, [], {}, 0
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
        checksums[name] = zlib.crc32(a.view(numpy.uint8).data) if a.size else 0
        offset += a.nbytes
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise TypeError(f"save_file: metadata must be a dict str -> str, got {metadata!r}")
    if CHECKSUM_KEY in metadata:
        raise ValueError(f"save_file: the metadata key {CHECKSUM_KEY!r} is reserved: save_file writes the "
                         f"tensors' checksums there; drop it from the metadata passed in")
    layout = {name: (h["dtype"], tuple(h["shape"]), *h["data_offsets"]) for name, h in header.items()}
    checksums[_HEADER_ENTRY] = _header_checksum(layout, metadata)
    header["__metadata__"] = {**metadata, CHECKSUM_KEY: json.dumps(
        {name: f"{crc:08x}" for name, crc in checksums.items()}, separators=(",", ":"))}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw, arrays


def _header_checksum(entries, metadata):
    """CRC32 of a canonical form of the header (every tensor's name, dtype, shape and offsets,
    and the metadata other than the checksums), so that it does not depend on how a writer
    formatted or ordered the JSON."""
    canonical = json.dumps([sorted([name, code, list(shape), begin, end]
                                   for name, (code, shape, begin, end) in entries.items()),
                            sorted(metadata.items())], separators=(",", ":"))
    return zlib.crc32(canonical.encode("utf-8"))


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


# ---- temporary files ----------------------------------------------------------------------

_HOST_CHARS = frozenset(string.ascii_letters + string.digits + "-_")
_MAX_HOST_TOKEN = 64  # longer host tokens are hashed, to keep file names under NAME_MAX (255 bytes)
_NAME_MAX = 255
# .{basename}.{host}.{pid}.{random}.tmp; the host token never holds a dot, so the last four
# dot-separated fields parse unambiguously whatever dots the basename has.
_TEMP_NAME = re.compile(r"\.(?P<base>.*)\.(?P<host>[^./]+)\.(?P<pid>[0-9]+)\.[^./]+\.tmp", re.DOTALL)


def _host_token():
    """This machine as it appears in temporary file names.

    The hostname is percent-encoded outside [A-Za-z0-9_-], which keeps dots out and keeps
    different hostnames different. On Linux the PID namespace is appended: containers that
    share a hostname (e.g. docker --network=host) do not share process ids, so one must not
    judge the other's writers dead. Long tokens are replaced by "~" and a hash ("~" never
    occurs in an encoded hostname, so a hash never equals a real one).
    """
    token = "".join(c if c in _HOST_CHARS else "".join(f"%{b:02X}" for b in c.encode("utf-8"))
                    for c in socket.gethostname())
    try:
        token += "+" + re.sub(r"[^0-9]", "", os.readlink("/proc/self/ns/pid"))
    except OSError:  # not Linux, or /proc not mounted: the hostname alone
        pass
    if len(token) > _MAX_HOST_TOKEN:
        token = "~" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:24]
    return token


def _temp_prefix(filename):
    """".{basename}.{host}.{pid}." for mkstemp, which appends random characters and ".tmp"."""
    tail = f".{_host_token()}.{os.getpid()}."
    # mkstemp adds 8 random characters and the suffix; the basename only helps people see
    # which file it was, so it is what gets shortened when the whole would be too long.
    room = _NAME_MAX - 1 - len(tail.encode("utf-8")) - 8 - len(".tmp")
    base = os.path.basename(filename).encode("utf-8")[:room].decode("utf-8", errors="ignore")
    return f".{base}{tail}"


def _process_alive(pid):
    """False only when no process ``pid`` exists on this machine; True when it does or when
    that cannot be known, so that a live writer's file is never taken for a leftover."""
    if pid <= 0:  # not a process: os.kill(0, ...) would signal our own process group
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):  # another user's process, or not a valid id
        return True
    return True


def remove_stale_temp_files(directory):
    """Removes the temporary files that killed writers left in ``directory``; returns their paths.

    A writer that dies without running its clean-up (``kill -9``, power loss, a node lost)
    leaves its ``.{basename}.{host}.{pid}.{random}.tmp`` behind (the final file is intact:
    either the previous version or the complete new one). Such a file is removed only when its
    writer ran on this host and process ``pid`` no longer exists. Left alone: files of live
    writers (they are being written right now), of other hosts (whether their writer still
    runs cannot be known from here), and temporary files named before writers were recorded
    (``.{basename}.{random}.tmp``, no host or pid; remove them by hand once no job runs).
    On Windows nothing is removed: there, probing a process with ``os.kill`` would stop it.

    A file that vanishes meanwhile (another cleaner, or its writer's own clean-up) is skipped
    silently; one that cannot be removed (e.g. another user's) is skipped with a warning.

    Raises:
        FileNotFoundError, NotADirectoryError: ``directory`` is not an existing directory.
    """
    if os.name == "nt":
        return []
    host = _host_token()
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _TEMP_NAME.fullmatch(entry.name)
            if match is None or match["host"] != host or _process_alive(int(match["pid"])):
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            except OSError as e:
                warnings.warn(f"remove_stale_temp_files: cannot remove the stale temporary file {entry.path!r} "
                              f"(its writer, process {match['pid']} on this host, is gone): {e}", stacklevel=2)
                continue
            removed.append(entry.path)
    return removed


def atomic_write(filename, write):
    """Calls ``write(f)`` on a temporary file beside ``filename``, then renames it over.

    The data is flushed and fsync'ed before ``os.replace``, and the directory after it, so a
    crash at any point leaves either the previous file or the complete new one under
    ``filename``, never a torn one; on error the temporary file is removed. The temporary
    file is named ``.{basename}.{host}.{pid}.{random}.tmp`` (see remove_stale_temp_files).
    """
    filename = os.fspath(filename)
    directory = os.path.dirname(os.path.abspath(filename))
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(filename), suffix=".tmp", dir=directory)
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
        metadata: optional dict str -> str, stored under "__metadata__" together with the
            checksums (key "minidl.crc32", reserved).
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
    """Returns ({name: (code, shape, begin, end)}, metadata without the checksums, data start,
    {name: CRC32} or None when the file has no checksums); the header's own checksum is
    verified here."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise _bad(filename, f"the file has {size} bytes, fewer than the 8-byte header length")
    n = int.from_bytes(f.read(8), "little")
    if n > _MAX_HEADER:
        raise _bad(filename, f"header length {n} is over the format's limit of {_MAX_HEADER} bytes")
    if 8 + n > size:
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
    if CHECKSUM_KEY not in metadata:
        _refuse_renamed_checksums(metadata, filename)
        return entries, metadata, 8 + n, None
    metadata = dict(metadata)
    checksums = _parse_checksums(metadata.pop(CHECKSUM_KEY), entries, filename)
    got = _header_checksum(entries, metadata)
    if got != checksums[_HEADER_ENTRY]:
        raise _corrupt(filename, "the header (tensor names, dtypes, shapes, offsets or metadata)",
                       got, checksums[_HEADER_ENTRY])
    return entries, metadata, 8 + n, checksums


def _refuse_renamed_checksums(metadata, filename):
    """Raises when a flipped bit renamed the checksum key: the file would otherwise load
    unchecked, with the checksums shown as user metadata. Recognised by the value, a JSON
    object with the header's entry, which no other writer produces by chance."""
    for key, value in metadata.items():
        if value.startswith("{") and f'"{_HEADER_ENTRY}":"' in value:
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if isinstance(parsed, dict) and _HEADER_ENTRY in parsed:
                raise _bad(filename, f"the metadata key {key!r} holds checksums but is not named {CHECKSUM_KEY!r}: "
                                     f"the header is damaged")


def _parse_checksums(text, entries, filename):
    """The checksum map of a header: {name: int}, naming exactly the tensors and the header."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise _bad(filename, f"the metadata key {CHECKSUM_KEY!r} is not JSON ({e})") from None
    if not isinstance(raw, dict) or not all(isinstance(v, str) and len(v) == 8
                                            and all(c in string.hexdigits for c in v) for v in raw.values()):
        raise _bad(filename, f"the metadata key {CHECKSUM_KEY!r} must map names to 8 hex digits, got {text!r}")
    # A tensor without an entry, or an entry without a tensor, means the header changed
    # after the checksums were written (a flipped bit in a name, or another tool's edit).
    unknown = sorted(set(raw) - set(entries) - {_HEADER_ENTRY})
    unlisted = sorted(set(entries) - set(raw))
    if unknown or unlisted or _HEADER_ENTRY not in raw:
        faults = ([f"checksums for tensors the file does not have: {unknown}"] if unknown else []) \
            + ([f"tensors without a checksum: {unlisted}"] if unlisted else []) \
            + ([f"no checksum of the header ({_HEADER_ENTRY!r})"] if _HEADER_ENTRY not in raw else [])
        raise _bad(filename, f"its checksums ({CHECKSUM_KEY!r}) do not describe its tensors: " + "; ".join(faults)
                   + f"; the file changed after it was written (if another tool rewrote it copying minidl's "
                     f"metadata, remove {CHECKSUM_KEY!r} from that metadata)")
    return {name: int(v, 16) for name, v in raw.items()}


def _corrupt(filename, what, got, want):
    return ValueError(f"{filename}: checksum mismatch in {what}: its bytes have CRC32 {got:08x}, but "
                      f"{want:08x} was recorded when the file was written; the file changed since (disk, "
                      f"copy or transfer damage, or an edit): restore it from a good copy")


def load_file(filename):
    """Reads a safetensors file into a dict name -> numpy.ndarray (sorted by name)."""
    filename = os.fspath(filename)
    with open(filename, "rb") as f:
        entries, _, start, checksums = _read_header(f, filename)
        out = {}
        for name, (code, shape, begin, end) in sorted(entries.items(), key=lambda e: e[1][2]):
            a = numpy.empty(shape, DTYPES[code])
            if a.size:
                f.seek(start + begin)
                got = f.readinto(a.reshape(-1).view(numpy.uint8).data)
                if got != end - begin:
                    raise _bad(filename, f"tensor {name!r} is truncated ({got} of {end - begin} bytes)")
            if checksums is not None:
                crc = zlib.crc32(a.reshape(-1).view(numpy.uint8).data) if a.size else 0
                if crc != checksums[name]:
                    raise _corrupt(filename, f"tensor {name!r}", crc, checksums[name])
            if code == "BF16":
                a = (a.astype(numpy.uint32) << 16).view(numpy.float32)
            out[name] = a.astype(a.dtype.newbyteorder("="), copy=False)
    return dict(sorted(out.items()))


def load_metadata(filename):
    """The "__metadata__" dict (str -> str) of a safetensors file ({} when absent), without
    minidl's checksums (key "minidl.crc32"); the header's checksum is verified."""
    filename = os.fspath(filename)
    with open(filename, "rb") as f:
        return _read_header(f, filename)[1]
