"""Checkpoints you can trust: per-tensor checksums (every flipped bit is caught), temporary
files that name their writer (a killed writer's leftovers can be removed safely), and the
warning naming what a non-strict load_param_into_net left unmatched."""
import hashlib
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import warnings
import zlib

import numpy as np
import pytest

import minidl
from minidl import Parameter, nn
from minidl.io import (CheckpointLoadWarning, load_checkpoint, load_checkpoint_metadata, load_param_into_net,
                       remove_stale_temp_files, safetensors, save_checkpoint)
from minidl.io.checkpoint import load_param_into_net_quietly


def _tensors():
    rng = np.random.default_rng(0)
    return {"fc.weight": rng.normal(size=(16, 8)).astype(np.float32), "fc.bias": np.arange(16, dtype=np.int64),
            "half": rng.normal(size=(5, 3)).astype(np.float16), "flag": np.array([True, False, True]),
            "step": np.array(7, np.int32)}


def _save(path):
    save_checkpoint(_tensors(), path, append_dict={"epoch": 3, "tag": "best"})
    raw = path.read_bytes()
    return raw, 8 + struct.unpack("<Q", raw[:8])[0]  # the bytes, and where the data starts


def _flipped(path, raw, byte, bit):
    damaged = bytearray(raw)
    damaged[byte] ^= 1 << bit
    path.write_bytes(bytes(damaged))


def _loaded(path):
    return {name: p.asnumpy() for name, p in load_checkpoint(path).items()}


# ---- checksums ------------------------------------------------------------------------------

def test_every_flipped_data_bit_raises_naming_file_tensor_and_both_checksums(tmp_path):
    path = tmp_path / "net.ckpt"
    raw, start = _save(path)
    header = json.loads(raw[8:start])
    owner = {}  # data byte -> the tensor it belongs to
    for name, info in header.items():
        if name != "__metadata__":
            begin, end = info["data_offsets"]
            owner.update(dict.fromkeys(range(start + begin, start + end), name))
    rng = np.random.default_rng(1)
    for byte, bit in zip(rng.integers(start, len(raw), 200), rng.integers(0, 8, 200)):
        _flipped(path, raw, int(byte), int(bit))
        pattern = rf"{path}: checksum mismatch in tensor '{owner[int(byte)]}': its bytes have CRC32 [0-9a-f]{{8}}, " \
                  rf"but [0-9a-f]{{8}} was recorded"
        with pytest.raises(ValueError, match=pattern):
            load_checkpoint(path)


def test_a_flip_anywhere_in_a_large_tensor_raises(tmp_path):
    """The checksum covers every byte of a tensor, not a prefix: the other tests' tensors are
    all under 1 KiB, so here a 1 MiB one is damaged past its first 64 KiB."""
    path = tmp_path / "big.ckpt"
    big = np.random.default_rng(2).normal(size=(512, 512)).astype(np.float32)  # 1 MiB
    save_checkpoint({"big": big, "step": np.array(7, np.int32)}, path)
    np.testing.assert_array_equal(_loaded(path)["big"], big)  # intact, it loads
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    begin, end = (8 + struct.unpack("<Q", raw[:8])[0] + o for o in header["big"]["data_offsets"])
    assert end - begin == big.nbytes
    for offset in (64 * 1024, 64 * 1024 + 1, big.nbytes // 2, big.nbytes - 1):
        _flipped(path, raw, begin + offset, 0)
        with pytest.raises(ValueError, match=rf"{path}: checksum mismatch in tensor 'big': its bytes have CRC32"):
            load_checkpoint(path)


def test_every_flipped_header_bit_raises_or_changes_nothing(tmp_path):
    # A flip in the header may land where it means nothing (a hex digit's case); anything
    # else must raise: the header has its own checksum, and a renamed checksum key is noticed.
    path = tmp_path / "net.ckpt"
    save_checkpoint({"w": np.arange(6, dtype=np.float32), "step": np.array(7)}, path, append_dict={"epoch": 3})
    raw = path.read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    want, want_meta = safetensors.load_file(path), load_checkpoint_metadata(path)
    harmless = 0
    for byte in range(start):
        for bit in range(8):
            _flipped(path, raw, byte, bit)
            try:
                got, meta = safetensors.load_file(path), load_checkpoint_metadata(path)
            except ValueError as e:
                assert str(path) in str(e)
                continue
            harmless += 1
            assert meta == want_meta and got.keys() == want.keys(), (byte, bit)
            for name, array in want.items():
                assert got[name].dtype == array.dtype
                np.testing.assert_array_equal(got[name], array)
    assert harmless < start  # nearly every flip raised


def test_checksums_are_metadata_strings_other_readers_accept(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "net.ckpt"
    raw, start = _save(path)
    for name, array in st_numpy.load_file(str(path)).items():
        np.testing.assert_array_equal(array, _tensors()[name])
    metadata = json.loads(raw[8:start])["__metadata__"]
    checksums = json.loads(metadata[safetensors.CHECKSUM_KEY])
    assert checksums["fc.bias"] == f"{zlib.crc32(np.arange(16, dtype='<i8').tobytes()):08x}"
    # ... and minidl keeps them out of what users read as metadata.
    assert load_checkpoint_metadata(path) == safetensors.load_metadata(path) == {"epoch": "3", "tag": "best"}


def test_files_without_checksums_still_load_unchecked(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "__metadata__": {"k": "v"}}).encode()
    path = tmp_path / "other_writer.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + np.array([1.0, 2.0], "<f4").tobytes())
    np.testing.assert_array_equal(load_checkpoint(path)["w"].asnumpy(), [1.0, 2.0])
    assert load_checkpoint_metadata(path) == {"k": "v"}


def _with_checksums(tmp_path, text):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "__metadata__": {safetensors.CHECKSUM_KEY: text}}).encode()
    path = tmp_path / "bad.ckpt"
    path.write_bytes(struct.pack("<Q", len(header)) + header + np.zeros(2, "<f4").tobytes())
    return path


@pytest.mark.parametrize("text, message", [
    ("{not json", "'minidl.crc32' is not JSON"),
    ('["00000000"]', "must map names to 8 hex digits"),
    ('{"w": "xyz", "__metadata__": "00000000"}', "must map names to 8 hex digits"),
    ('{"w": "00000000", "gone": "00000000", "__metadata__": "00000000"}',
     r"checksums for tensors the file does not have: \['gone'\]"),
    ('{"__metadata__": "00000000"}', r"tensors without a checksum: \['w'\]"),
    ('{"w": "00000000"}', "no checksum of the header"),
])
def test_malformed_checksums_raise_naming_the_file(tmp_path, text, message):
    path = _with_checksums(tmp_path, text)
    with pytest.raises(ValueError, match=message) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match=message):
        load_checkpoint_metadata(path)


def test_a_renamed_checksum_key_is_refused(tmp_path):
    path = tmp_path / "net.ckpt"
    raw, start = _save(path)
    at = raw.index(safetensors.CHECKSUM_KEY.encode())
    _flipped(path, raw, at + len("minidl.crc3"), 0)  # "minidl.crc32" -> "minidl.crc33"
    with pytest.raises(ValueError, match=r"the metadata key 'minidl.crc33' holds checksums but is not named "
                                         r"'minidl.crc32': the header is damaged"):
        load_checkpoint(path)


def test_the_checksum_key_is_reserved(tmp_path):
    with pytest.raises(ValueError, match="'minidl.crc32' is reserved"):
        safetensors.save_file({"w": np.ones(2)}, tmp_path / "x", {safetensors.CHECKSUM_KEY: "{}"})
    with pytest.raises(ValueError, match="'minidl.crc32' is reserved"):
        save_checkpoint({"w": np.ones(2)}, tmp_path / "x", append_dict={safetensors.CHECKSUM_KEY: "{}"})
    assert not (tmp_path / "x").exists()


def test_training_state_in_metadata_still_resumes(tmp_path):
    from minidl.optim import Momentum
    from minidl.train import restore_train_state, save_train_state
    net = nn.Dense(3, 2)
    opt = Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    path = tmp_path / "state.ckpt"
    save_train_state(path, net, opt, epoch_num=2, step_num=8, step_in_epoch=4, batch_num=4)
    assert safetensors.CHECKSUM_KEY not in load_checkpoint_metadata(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resuming loads on purpose in parts: no warning
        assert tuple(restore_train_state(path, net, opt)) == (2, 0, 8, 4)


# ---- temporary files name their writer ------------------------------------------------------

def _temp_files(directory):
    return sorted(f for f in os.listdir(directory) if f.endswith(".tmp"))


def test_the_temporary_file_names_host_and_pid(tmp_path):
    seen = []

    def write(f):
        seen.extend(_temp_files(tmp_path))
        f.write(b"x")

    safetensors.atomic_write(tmp_path / "net.ckpt", write)
    assert len(seen) == 1 and seen[0].startswith(".net.ckpt.")
    match = safetensors._TEMP_NAME.fullmatch(seen[0])
    assert match["host"] == safetensors._host_token() and int(match["pid"]) == os.getpid()
    assert _temp_files(tmp_path) == []


def test_host_tokens_have_no_dots_and_stay_distinct(monkeypatch):
    tokens = set()
    for host in ["node1", "node1.cluster", "node1_cluster", "node1%2Ecluster", "a/b", "nœud", "x" * 300]:
        monkeypatch.setattr(safetensors.socket, "gethostname", lambda host=host: host)
        token = safetensors._host_token()
        assert "." not in token and "/" not in token and len(token) <= 64
        assert safetensors._TEMP_NAME.fullmatch(f".net.ckpt.{token}.123.abcdefgh.tmp")["host"] == token
        tokens.add(token)
    assert len(tokens) == 7


def test_a_long_file_name_still_saves(tmp_path):
    path = tmp_path / ("n" * 250)  # the temporary name must still fit in 255 bytes
    save_checkpoint({"w": np.ones(2)}, path)
    np.testing.assert_array_equal(load_checkpoint(path)["w"].asnumpy(), [1.0, 1.0])


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_remove_stale_temp_files_removes_only_dead_writers_of_this_host(tmp_path):
    host = safetensors._host_token()
    dead = _dead_pid()
    names = {"live": f".net.ckpt.{host}.{os.getpid()}.abcdefgh.tmp",
             "dead": f".net.ckpt.{host}.{dead}.abcdefgh.tmp",
             "dead, dotted name": f".net.v2.ckpt.{host}.{dead}.zz_9x0yq.tmp",
             "other host": f".net.ckpt.otherhost.{dead}.abcdefgh.tmp",
             "old style": ".net.ckpt.abcdefgh.tmp",
             "checkpoint": "net.ckpt", "unrelated": ".hidden.tmp"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f".dir.{host}.{dead}.abcdefgh.tmp").mkdir()  # not a file: left alone
    removed = remove_stale_temp_files(tmp_path)
    assert sorted(removed) == sorted(str(tmp_path / names[k]) for k in ("dead", "dead, dotted name"))
    assert sorted(os.listdir(tmp_path)) == sorted([f".dir.{host}.{dead}.abcdefgh.tmp"]
                                                  + [n for k, n in names.items() if not k.startswith("dead")])
    assert remove_stale_temp_files(tmp_path) == []


def test_remove_stale_temp_files_skips_a_file_that_vanished(tmp_path, monkeypatch):
    stale = tmp_path / f".net.ckpt.{safetensors._host_token()}.{_dead_pid()}.abcdefgh.tmp"
    stale.write_bytes(b"x")
    real_unlink = os.unlink

    def another_cleaner_was_first(path):
        real_unlink(path)
        real_unlink(path)  # raises FileNotFoundError, as when someone else removed it meanwhile

    monkeypatch.setattr(safetensors.os, "unlink", another_cleaner_was_first)
    assert remove_stale_temp_files(tmp_path) == []
    assert not stale.exists()


def _pid_namespace():
    try:
        return "+" + re.sub(r"[^0-9]", "", os.readlink("/proc/self/ns/pid"))
    except OSError:  # not Linux
        return ""


def test_the_host_token_is_the_percent_encoded_hostname_and_pid_namespace(monkeypatch):
    # Pinned: processes of other minidl versions on this host read these names too.
    ns = _pid_namespace()
    for host, token in [("node1", "node1"), ("nœud.x", "n%C5%93ud%2Ex"), ("h" * (64 - len(ns)), "h" * (64 - len(ns)))]:
        monkeypatch.setattr(safetensors.socket, "gethostname", lambda host=host: host)
        assert safetensors._host_token() == token + ns  # 64 characters are still the hostname itself
    long = "h" * (65 - len(ns))
    monkeypatch.setattr(safetensors.socket, "gethostname", lambda: long)
    assert safetensors._host_token() == "~" + hashlib.sha256((long + ns).encode()).hexdigest()[:24]


def _temp_name(path):
    seen = []
    safetensors.atomic_write(path, lambda f: seen.extend(_temp_files(path.parent)))
    assert len(seen) == 1
    return seen[0]


def test_a_long_basename_is_shortened_just_enough(tmp_path):
    name = _temp_name(tmp_path / ("n" * 250))
    assert len(name.encode()) == 255 and name.startswith(".nnnn") and name.endswith(".tmp")
    # A cut inside a multi-byte character drops the partial character (whichever byte the cut falls on).
    for base in ("é" * 120, "x" + "é" * 120):
        name = _temp_name(tmp_path / base)
        assert len(name.encode()) in (254, 255) and base.startswith(name[1:name.index(".", 1)])


def test_remove_stale_temp_files_leaves_files_it_cannot_judge(tmp_path):
    host = safetensors._host_token()
    target = tmp_path / "net.ckpt"
    target.write_bytes(b"x")
    kept = [f".net.ckpt.{host}.0.abcdefgh.tmp",  # pid 0 is no process (os.kill(0) would signal our group)
            f".net.ckpt.{host}.{2**70}.abcdefgh.tmp"]  # not a valid pid
    for name in kept:
        (tmp_path / name).write_bytes(b"x")
    link = f".link.{host}.{_dead_pid()}.abcdefgh.tmp"
    os.symlink(target, tmp_path / link)  # not a regular file of a writer
    assert remove_stale_temp_files(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == sorted(kept + [link, "net.ckpt"])


def test_remove_stale_temp_files_removes_nothing_on_windows(tmp_path, monkeypatch):
    stale = tmp_path / f".net.ckpt.{safetensors._host_token()}.{_dead_pid()}.abcdefgh.tmp"
    stale.write_bytes(b"x")
    monkeypatch.setattr(safetensors.os, "name", "nt")  # there os.kill(pid, 0) would stop the process
    assert remove_stale_temp_files(tmp_path) == []
    monkeypatch.undo()
    assert stale.exists()


def _two_stale(tmp_path):
    dead = _dead_pid()
    paths = [tmp_path / f".{n}.ckpt.{safetensors._host_token()}.{dead}.abcdefgh.tmp" for n in ("a", "b")]
    for path in paths:
        path.write_bytes(b"x")
    return dead, paths


def _first_unlink_fails(monkeypatch, error, remove=False):
    """os.unlink raising ``error`` on its first call (after removing the file when ``remove``)."""
    real_unlink, calls = os.unlink, []

    def unlink(path):
        calls.append(path)
        if len(calls) == 1:
            if remove:
                real_unlink(path)
            raise error
        real_unlink(path)

    monkeypatch.setattr(safetensors.os, "unlink", unlink)
    return calls


def test_a_vanished_file_does_not_stop_the_clean_up(tmp_path, monkeypatch):
    dead, paths = _two_stale(tmp_path)
    calls = _first_unlink_fails(monkeypatch, FileNotFoundError("gone"), remove=True)
    assert remove_stale_temp_files(tmp_path) == [calls[1]]
    assert not any(p.exists() for p in paths)


def _check_unremovable_skipped(record, dead, calls):
    assert len(record) == 1 and str(record[0].message) == (
        f"remove_stale_temp_files: cannot remove the stale temporary file {calls[0]!r} (its writer, process {dead} "
        f"on this host, is gone): not yours")
    assert os.path.exists(calls[0]) and not os.path.exists(calls[1])


def test_a_file_that_cannot_be_removed_is_named_in_a_warning(tmp_path, monkeypatch):
    dead, _ = _two_stale(tmp_path)
    calls = _first_unlink_fails(monkeypatch, PermissionError("not yours"))
    with pytest.warns(UserWarning) as record:
        assert remove_stale_temp_files(tmp_path) == [calls[1]]
    _check_unremovable_skipped(record, dead, calls)


@pytest.mark.call_site
def test_the_clean_up_warning_is_attributed_to_the_caller(tmp_path, monkeypatch):
    dead, _ = _two_stale(tmp_path)
    calls = _first_unlink_fails(monkeypatch, PermissionError("not yours"))
    with pytest.warns(UserWarning) as record:
        remove_stale_temp_files(tmp_path)
    _check_unremovable_skipped(record, dead, calls)
    assert record[0].filename == __file__


def test_remove_stale_temp_files_needs_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        remove_stale_temp_files(tmp_path / "absent")


_SAVE_FOREVER = """
import sys
import numpy as np
import minidl
zeros = np.zeros(16 * 2**20, np.float32)  # 64 MiB: each save spends most of its time writing
while True:
    minidl.save_checkpoint({"w": zeros}, sys.argv[1])
"""


def test_a_writer_killed_mid_save_leaves_a_removable_temp_file_and_an_intact_checkpoint(tmp_path):
    path = tmp_path / "net.ckpt"
    for _ in range(5):  # the kill can land between two saves, when no temporary file exists
        writer = subprocess.Popen([sys.executable, "-c", _SAVE_FOREVER, str(path)])
        try:  # wait until one save is complete and the next one is being written
            deadline = time.monotonic() + 30
            while not (path.exists() and _temp_files(tmp_path)) and time.monotonic() < deadline \
                    and writer.poll() is None:
                time.sleep(0.002)
            assert path.exists() and _temp_files(tmp_path), f"the writer saved nothing (exit code {writer.poll()})"
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait()
        if _temp_files(tmp_path):
            break
    leftovers = _temp_files(tmp_path)
    assert len(leftovers) == 1
    w = load_checkpoint(path)["w"].asnumpy()  # the previous save, complete: its checksums verify
    assert w.shape == (16 * 2**20,) and not np.any(w)
    assert remove_stale_temp_files(tmp_path) == [str(tmp_path / leftovers[0])]
    assert _temp_files(tmp_path) == [] and path.exists()


# ---- load_param_into_net names what did not match --------------------------------------------

class Holder:
    """The smallest 'net': anything with parameters_and_names()."""

    def __init__(self, *names):
        self.params = {n: Parameter(np.zeros(2, np.float32), name=n) for n in names}

    def parameters_and_names(self):
        return iter(self.params.items())


@pytest.mark.call_site
def test_a_partial_load_warns_once_naming_every_missing_parameter_and_unused_entry():
    net = Holder("a", "b", "c")
    with pytest.warns(CheckpointLoadWarning) as record:
        result = load_param_into_net(net, {"a": np.ones(2), "x": np.ones(2), "y": np.ones(2)})
    assert result == (["b", "c"], ["x", "y"])
    assert len(record) == 1 and issubclass(record[0].category, UserWarning)
    message = str(record[0].message)
    assert "2 parameter(s) of the net got no value" in message and "['b', 'c']" in message
    assert "2 checkpoint entries matched no parameter: ['x', 'y']" in message
    assert record[0].filename == __file__  # attributed to the caller
    np.testing.assert_array_equal(net.params["a"].asnumpy(), [1.0, 1.0])


def test_one_kind_alone_is_named_too():
    with pytest.warns(CheckpointLoadWarning, match=r"1 checkpoint entry matched no parameter: \['x'\]") as record:
        load_param_into_net(Holder("a"), {"a": np.ones(2), "x": np.ones(2)})
    assert "got no value" not in str(record[0].message) and "specify_prefix" in str(record[0].message)
    with pytest.warns(CheckpointLoadWarning, match=r"1 parameter\(s\) of the net got no value .*\['b'\]") as record:
        load_param_into_net(Holder("a", "b"), {"a": np.ones(2)})
    assert "matched no parameter" not in str(record[0].message) and "strict_load=True" in str(record[0].message)


def test_no_warning_when_everything_matches_or_for_internal_partial_loads():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_param_into_net(Holder("a", "b"), {"a": np.ones(2), "b": np.ones(2)}) == ([], [])
        assert load_param_into_net_quietly(Holder("a", "b"), {"a": np.ones(2), "x": np.ones(2)}) == (["b"], ["x"])
        # strict: missing parameters raise; extra entries (e.g. optimizer state) are only returned
        assert load_param_into_net(Holder("a"), {"a": np.ones(2), "x": np.ones(2)}, strict_load=True) == ([], ["x"])
    with pytest.raises(ValueError, match=r"strict_load is set and 1 parameter\(s\) are missing.*\['b'\]"):
        load_param_into_net(Holder("a", "b"), {"a": np.ones(2)}, strict_load=True)


@pytest.mark.call_site
def test_load_checkpoint_into_a_net_warns_at_the_caller(tmp_path):
    path = tmp_path / "net.ckpt"
    save_checkpoint({"a": np.ones(2), "x": np.ones(2)}, path)
    with pytest.warns(CheckpointLoadWarning, match=r"load_checkpoint: .*\['b'\].*\['x'\]") as record:
        load_checkpoint(path, net=Holder("a", "b"))
    assert len(record) == 1 and record[0].filename == __file__
    assert issubclass(minidl.io.CheckpointLoadWarning, UserWarning)
