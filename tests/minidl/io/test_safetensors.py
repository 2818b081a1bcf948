"""minidl.io.safetensors: the exact bytes written (files stay readable across versions), the
writer's argument checks, and the reader's verdict on malformed headers and checksums, with
messages naming the file, the tensor and the fault."""
import json
import os
import re
import struct

import numpy as np
import pytest

from minidl.io import safetensors, save_checkpoint

# A file written by save_file({"w": [1.0, 2.0] float32, "step": 7 int32}, metadata={"epoch": "3"}):
# compact JSON, tensors in name order, the header padded to 8 bytes, then the little-endian data.
# Its header checksum ("__metadata__") pins the canonical form the reader recomputes: a reader that
# computed it differently would reject every file written before.
GOLDEN_HEADER = (b'{"step":{"dtype":"I32","shape":[],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[2],'
                 b'"data_offsets":[4,12]},"__metadata__":{"epoch":"3","minidl.crc32":"{\\"step\\":\\"bc93e7a5\\",'
                 b'\\"w\\":\\"2e3fa576\\",\\"__metadata__\\":\\"2c47c230\\"}"}}   ')
GOLDEN = struct.pack("<Q", len(GOLDEN_HEADER)) + GOLDEN_HEADER + bytes.fromhex("070000000000803f00000040")


def _golden(tmp_path, raw=GOLDEN):
    path = tmp_path / "golden.safetensors"
    path.write_bytes(raw)
    return path


def test_the_bytes_written_are_the_format_pinned(tmp_path):
    path = tmp_path / "new.safetensors"
    safetensors.save_file({"w": np.array([1.0, 2.0], np.float32), "step": np.array(7, np.int32)}, path,
                          {"epoch": "3"})
    assert path.read_bytes() == GOLDEN


def test_a_file_written_before_loads_and_verifies(tmp_path):
    path = _golden(tmp_path)
    back = safetensors.load_file(path)
    assert list(back) == ["step", "w"]
    assert back["step"].dtype == np.int32 and back["step"].shape == () and back["step"] == 7
    assert back["w"].dtype == np.float32
    np.testing.assert_array_equal(back["w"], [1.0, 2.0])
    assert safetensors.load_metadata(path) == {"epoch": "3"}


def test_a_changed_header_fails_its_checksum_naming_the_file(tmp_path):
    path = _golden(tmp_path, GOLDEN.replace(b'"epoch":"3"', b'"epoch":"4"'))
    for read in (safetensors.load_file, safetensors.load_metadata):
        with pytest.raises(ValueError) as info:
            read(path)
        assert re.fullmatch(
            re.escape(f"{path}: checksum mismatch in the header (tensor names, dtypes, shapes, offsets or metadata): "
                      f"its bytes have CRC32 ") + "[0-9a-f]{8}" + re.escape(
                ", but 2c47c230 was recorded when the file was written; the file changed since (disk, copy or "
                "transfer damage, or an edit): restore it from a good copy"), str(info.value)), str(info.value)


def test_the_header_length_limit(tmp_path, monkeypatch):
    path = _golden(tmp_path)
    monkeypatch.setattr(safetensors, "_MAX_HEADER", len(GOLDEN_HEADER))  # a header of the limit's length is read
    assert list(safetensors.load_file(path)) == ["step", "w"]
    monkeypatch.setattr(safetensors, "_MAX_HEADER", len(GOLDEN_HEADER) - 1)
    with pytest.raises(ValueError, match=f"header length {len(GOLDEN_HEADER)} is over the format's limit of "
                                         f"{len(GOLDEN_HEADER) - 1} bytes"):
        safetensors.load_file(path)


def test_a_file_that_shrinks_while_read_names_the_truncated_tensor(tmp_path, monkeypatch):
    path = tmp_path / "big.safetensors"
    # 64 KiB, more than the reader buffers, after 4 bytes of another tensor
    safetensors.save_file({"a": np.zeros(1, np.float32), "w": np.zeros(2**14, np.float32)}, path)
    read_header = safetensors._read_header

    def read_then_shrink(f, filename):  # another process truncates the file after its header was checked
        header = read_header(f, filename)
        os.truncate(filename, os.path.getsize(filename) - 2)
        return header

    monkeypatch.setattr(safetensors, "_read_header", read_then_shrink)
    with pytest.raises(ValueError) as info:
        safetensors.load_file(path)
    assert str(info.value) == f"{path}: not a valid safetensors file: tensor 'w' is truncated (65534 of 65536 bytes)"


# ---- the writer's argument checks ---------------------------------------------------------------

@pytest.mark.parametrize("tensors, metadata, error, message", [
    ([np.ones(1)], None, TypeError, "save_file: tensors must be a dict name -> numpy array, got list"),
    ({"__metadata__": np.ones(1)}, None, ValueError,
     "save_file: tensor names must be non-empty strings other than '__metadata__', got '__metadata__'"),
    ({1: np.ones(1)}, None, ValueError,
     "save_file: tensor names must be non-empty strings other than '__metadata__', got 1"),
    ({"w": [1.0]}, None, TypeError, "save_file: tensor 'w' must be a numpy.ndarray, got list"),
    ({"w": np.ones(1)}, ["epoch"], TypeError, "save_file: metadata must be a dict str -> str, got ['epoch']"),
    ({"w": np.ones(1)}, {"epoch": 3}, TypeError, "save_file: metadata must be a dict str -> str, got {'epoch': 3}"),
    ({"w": np.ones(1)}, {3: "epoch"}, TypeError, "save_file: metadata must be a dict str -> str, got {3: 'epoch'}"),
])
def test_save_file_argument_errors(tmp_path, tensors, metadata, error, message):
    path = tmp_path / "x.safetensors"
    with pytest.raises(error) as info:
        safetensors.save_file(tensors, path, metadata)
    assert str(info.value) == message
    assert not path.exists()


# ---- malformed headers --------------------------------------------------------------------------

def _file(tmp_path, header, data):
    body = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _f32(shape, offsets):
    return {"dtype": "F32", "shape": list(shape), "data_offsets": offsets}


@pytest.mark.parametrize("header, data, fault", [
    ({"w": _f32([2], [0, 8, 8])}, 8, "tensor 'w' has data_offsets [0, 8, 8] outside the data section [0, 8]"),
    ({"w": _f32([2], 8)}, 8, "tensor 'w' has data_offsets 8 outside the data section [0, 8]"),
    ({"w": _f32([2], [4, 8])}, 8,
     "tensor 'w' of dtype F32 and shape [2] needs 8 bytes, but its data_offsets [4, 8] span 4"),
    # one tensor inside another
    ({"a": _f32([3], [0, 12]), "b": _f32([1], [4, 8])}, 12, "tensors 'a' and 'b' overlap (bytes 12 and 4)"),
    # an empty tensor (no bytes) does not end the search for overlaps
    ({"e": _f32([0], [0, 0]), "a": _f32([2], [0, 8]), "b": _f32([2], [4, 12])}, 12,
     "tensors 'a' and 'b' overlap (bytes 8 and 4)"),
])
def test_malformed_headers_raise_naming_file_and_fault(tmp_path, header, data, fault):
    path = _file(tmp_path, header, b"\0" * data)
    with pytest.raises(ValueError) as info:
        safetensors.load_file(path)
    assert str(info.value) == f"{path}: not a valid safetensors file: {fault}"


def test_an_eight_byte_file_has_an_empty_header(tmp_path):
    path = _golden(tmp_path, struct.pack("<Q", 0))
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a valid safetensors file: the header is not UTF-8 "
                                                   f"JSON")):
        safetensors.load_file(path)


# ---- malformed checksums ------------------------------------------------------------------------

@pytest.mark.parametrize("checksums, faults", [
    ('{"gone": "00000000", "__metadata__": "00000000"}',
     "checksums for tensors the file does not have: ['gone']; tensors without a checksum: ['w']"),
    ('{"__metadata__": "00000000"}', "tensors without a checksum: ['w']"),
    ('{"w": "00000000"}', "no checksum of the header ('__metadata__')"),
])
def test_checksums_that_do_not_describe_the_tensors_name_each_fault(tmp_path, checksums, faults):
    path = _file(tmp_path, {"w": _f32([2], [0, 8]), "__metadata__": {safetensors.CHECKSUM_KEY: checksums}},
                 b"\0" * 8)
    for read in (safetensors.load_file, safetensors.load_metadata):
        with pytest.raises(ValueError) as info:
            read(path)
        assert str(info.value) == (
            f"{path}: not a valid safetensors file: its checksums ('minidl.crc32') do not describe its tensors: "
            f"{faults}; the file changed after it was written (if another tool rewrote it copying minidl's metadata, "
            f"remove 'minidl.crc32' from that metadata)")


def test_metadata_that_merely_looks_like_checksums_is_user_metadata(tmp_path):
    metadata = {"cfg": '{"nested": {"__metadata__":"x"}}', "spaced": ' {"__metadata__":"x"}',
                "broken": '{"__metadata__":"x'}
    path = _file(tmp_path, {"w": _f32([2], [0, 8]), "__metadata__": metadata}, b"\0" * 8)  # another writer's
    assert safetensors.load_metadata(path) == metadata
    np.testing.assert_array_equal(safetensors.load_file(path)["w"], [0.0, 0.0])


def test_a_renamed_checksum_key_is_found_after_lookalike_metadata(tmp_path):
    path = tmp_path / "net.ckpt"
    save_checkpoint({"w": np.ones(2)}, path, append_dict={"broken": '{"__metadata__":"x'})
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"minidl.crc32"', b'"minidl.crc33"'))
    with pytest.raises(ValueError, match="the metadata key 'minidl.crc33' holds checksums but is not named"):
        safetensors.load_file(path)
