"""Checkpoints: safetensors round trips and cross-checks, atomic writes, corrupted files,
save/load forms, load_param_into_net semantics, networks and optimizers."""
import json
import os
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import minidl
from minidl import Parameter, Tensor, nn
from minidl.io import safetensors, save_checkpoint, load_checkpoint, load_param_into_net, load_checkpoint_metadata
from minidl.optim import Momentum

DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64]


def tensor_dicts():
    names = st.text("abcdefghij._0123456789", min_size=1, max_size=8)
    array = st.sampled_from(DTYPES).flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)))
    return st.dictionaries(names, array, max_size=5)


def assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


@given(tensors=tensor_dicts())
def test_round_trip_all_dtypes_and_shapes(tmp_path_factory, tensors):
    path = tmp_path_factory.mktemp("rt") / "t.safetensors"
    safetensors.save_file(tensors, path, {"note": "x"})
    back = safetensors.load_file(path)
    assert list(back) == sorted(tensors)
    for name, a in tensors.items():
        assert_same(back[name], a)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert n % 8 == 0  # data starts 8-byte aligned
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__")
    checksums = json.loads(metadata.pop(safetensors.CHECKSUM_KEY))
    assert metadata == {"note": "x"} and safetensors.load_metadata(path) == {"note": "x"}
    spans = [header[k]["data_offsets"] for k in sorted(header)]
    assert [s[0] for s in spans] == [0, *(s[1] for s in spans)][:len(spans)]  # sorted names, no gaps
    assert len(raw) == 8 + n + (spans[-1][1] if spans else 0)
    data = raw[8 + n:]
    assert sorted(checksums) == sorted([*header, "__metadata__"])  # each tensor, and the header
    for name, info in header.items():
        begin, end = info["data_offsets"]
        assert checksums[name] == f"{zlib.crc32(data[begin:end]):08x}"


def test_non_contiguous_big_endian_and_zero_d(tmp_path):
    a = np.arange(24, dtype=">f4").reshape(4, 6)[:, ::2]
    path = tmp_path / "x.safetensors"
    safetensors.save_file({"a": a, "s": np.float64(2.5), "e": np.zeros((0, 3), np.int32)}, path)
    back = safetensors.load_file(path)
    np.testing.assert_array_equal(back["a"], a)
    assert back["a"].dtype == np.float32 and back["s"].shape == () and back["s"] == 2.5
    assert back["e"].shape == (0, 3)


def test_interoperates_with_the_reference_library(tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    tensors = {"w": np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32), "b": np.arange(4),
               "flag": np.array([True, False]), "h": np.ones((2, 0), np.float16), "s": np.array(7, np.uint8)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    safetensors.save_file(tensors, ours, {"epoch": "3"})
    for name, a in st_numpy.load_file(str(ours)).items():
        assert_same(a, tensors[name])
    st_numpy.save_file(tensors, str(theirs), metadata={"k": "v"})
    back = safetensors.load_file(theirs)
    assert sorted(back) == sorted(tensors)
    for name, a in back.items():
        assert_same(a, tensors[name])
    assert safetensors.load_metadata(theirs) == {"k": "v"}


def test_bf16_loads_as_float32(tmp_path):
    values = np.array([1.0, -2.5, 0.15625], np.float32)
    raw = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"x": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}).encode()
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw)
    np.testing.assert_array_equal(safetensors.load_file(path)["x"], values)


# ---- atomic writes ----------------------------------------------------------------------

def _leftovers(directory):
    return [f for f in os.listdir(directory) if f.endswith(".tmp")]


@pytest.mark.parametrize("fail_at", ["os.replace", "os.fsync", "write"])
def test_interrupted_save_keeps_the_previous_file(tmp_path, monkeypatch, fail_at):
    path = tmp_path / "net.ckpt"
    save_checkpoint({"w": np.ones(3, np.float32)}, path, append_dict={"epoch": 1})
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("simulated crash")

    if fail_at == "write":  # dies with half the tensors written
        def save_half(tensors, filename, metadata=None):
            def write(f):
                f.write(b"partial bytes")
                boom()
            safetensors.atomic_write(filename, write)
        monkeypatch.setattr(safetensors, "save_file", save_half)
    else:
        monkeypatch.setattr(fail_at, boom)
    with pytest.raises(OSError, match="simulated crash"):
        save_checkpoint({"w": np.zeros(1000, np.float32)}, path, append_dict={"epoch": 2})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []
    assert load_checkpoint_metadata(path) == {"epoch": "1"}


def test_interrupted_first_save_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("simulated crash")))
    with pytest.raises(OSError):
        save_checkpoint({"w": np.ones(3)}, tmp_path / "new.ckpt")
    assert os.listdir(tmp_path) == []


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "a.ckpt"
    save_checkpoint({"w": np.ones(2)}, path)
    save_checkpoint({"w": np.zeros(3)}, path)
    assert load_checkpoint(path)["w"].shape == (3,)
    assert _leftovers(tmp_path) == []
    assert os.stat(path).st_mode & 0o777 == 0o644


# ---- corrupted files ----------------------------------------------------------------------

def _file(tmp_path, header, data=b"", raw_header=None):
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    path = tmp_path / "bad.ckpt"
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _raw(tmp_path, raw):
    path = tmp_path / "bad.ckpt"
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("make, message", [
    (lambda p: _raw(p, b"\x01\x02"), "2 bytes, fewer than the 8-byte"),
    (lambda p: _raw(p, struct.pack("<Q", 1000) + b"{}"), "header length 1000 runs past the end"),
    (lambda p: _file(p, None, raw_header=b"{not json"), "header is not UTF-8 JSON"),
    (lambda p: _file(p, None, raw_header=b"\xff\xfe"), "header is not UTF-8 JSON"),
    (lambda p: _file(p, None, raw_header=b"[1, 2]"), "JSON list, not an object"),
    (lambda p: _file(p, {"w": _entry(offsets=(0, 16))}, b"\0" * 8), r"data_offsets \[0, 16\] outside"),
    (lambda p: _file(p, {"w": _entry(offsets=(4, 0))}, b"\0" * 8), "outside the data section"),
    (lambda p: _file(p, {"w": _entry(dtype="F8_E9")}, b"\0" * 8), "unknown dtype 'F8_E9'"),
    (lambda p: _file(p, {"w": _entry(shape=(3,))}, b"\0" * 8), "needs 12 bytes, but its data_offsets"),
    (lambda p: _file(p, {"w": _entry(shape=(-2,))}, b"\0" * 8), "non-negative ints"),
    (lambda p: _file(p, {"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(4, 12))}, b"\0" * 12),
     "tensors 'a' and 'b' overlap"),
    (lambda p: _file(p, {"w": {"dtype": "F32"}}, b""), "needs dtype, shape and data_offsets"),
    (lambda p: _file(p, {"__metadata__": {"epoch": 3}}), "__metadata__ must map strings to strings"),
])
def test_corrupted_files_raise_naming_file_and_fault(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=message) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_truncated_checkpoint_is_detected(tmp_path):
    path = tmp_path / "t.ckpt"
    save_checkpoint({"a": np.ones(100), "b": np.ones(50)}, path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    with pytest.raises(ValueError, match="outside the data section"):
        load_checkpoint(path)
    path.write_bytes(raw[:20])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        load_checkpoint(path)


# ---- save forms, metadata, filters --------------------------------------------------------

def test_save_forms_agree(tmp_path):
    w = Parameter(np.arange(6, dtype=np.float32).reshape(2, 3), name="w")
    b = Parameter(np.ones(3, np.float32), name="b")
    forms = [[w, b], [{"name": "w", "data": w}, {"name": "b", "data": b.data}],
             {"w": w, "b": Tensor(b.data)}, {"w": w.asnumpy(), "b": b.asnumpy()}]
    for i, form in enumerate(forms):
        path = tmp_path / f"{i}.ckpt"
        save_checkpoint(form, path)
        params = load_checkpoint(path)
        assert sorted(params) == ["b", "w"]
        assert all(isinstance(p, Parameter) and p.name == n for n, p in params.items())
        assert_same(params["w"].asnumpy(), w.asnumpy())
        assert_same(params["b"].asnumpy(), b.asnumpy())


def test_append_dict_scalars_go_to_metadata_tensors_to_the_file(tmp_path):
    path = tmp_path / "m.ckpt"
    save_checkpoint({"w": np.ones(2)}, path,
                    append_dict={"epoch": 3, "lr": 0.1, "tag": "best", "ok": True, "ema": Tensor(np.zeros(2))})
    assert load_checkpoint_metadata(path) == {"epoch": "3", "lr": "0.1", "tag": "best", "ok": "True"}
    assert sorted(load_checkpoint(path)) == ["ema", "w"]


def test_load_filters(tmp_path):
    path = tmp_path / "f.ckpt"
    names = ["backbone.w", "backbone.b", "head.w", "moments.head.w"]
    save_checkpoint({n: np.ones(1) for n in names}, path)
    assert sorted(load_checkpoint(path, filter_prefix="moments")) == ["backbone.b", "backbone.w", "head.w"]
    assert sorted(load_checkpoint(path, filter_prefix=["moments", "head"])) == ["backbone.b", "backbone.w"]
    assert sorted(load_checkpoint(path, specify_prefix="head")) == ["head.w"]
    assert sorted(load_checkpoint(path, choice_func=lambda n: n.endswith(".w"))) == \
        ["backbone.w", "head.w", "moments.head.w"]
    save_checkpoint({n: np.ones(1) for n in names}, path, choice_func=lambda n: "head" in n)
    assert sorted(load_checkpoint(path)) == ["head.w", "moments.head.w"]


def test_save_errors(tmp_path):
    path = tmp_path / "e.ckpt"
    with pytest.raises(ValueError, match="Parameter 0 of the list has no name"):
        save_checkpoint([Parameter(np.ones(1))], path)
    with pytest.raises(ValueError, match="the name 'w' appears twice"):
        save_checkpoint({"w": np.ones(1)}, path, append_dict={"w": np.ones(1)})
    with pytest.raises(TypeError, match="save_obj must be a Cell"):
        save_checkpoint(42, path)
    with pytest.raises(TypeError, match="value of 'w' must be"):
        save_checkpoint({"w": "text"}, path)
    with pytest.raises(ValueError, match="dtype complex128, which safetensors cannot store"):
        save_checkpoint({"w": np.ones(2, complex)}, path)
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.ckpt")
    assert not path.exists()


# ---- load_param_into_net ------------------------------------------------------------------

class Holder:
    """The smallest 'net': anything with parameters_and_names()."""

    def __init__(self, **shapes):
        self.params = {n: Parameter(np.zeros(s, np.float32), name=n) for n, s in shapes.items()}

    def parameters_and_names(self):
        return iter(self.params.items())


def test_load_copies_in_place_and_reports_both_sides():
    net = Holder(w=(2, 3), b=(3,), extra=(1,))
    arrays = {n: p.data for n, p in net.params.items()}
    src = {"w": Parameter(np.arange(6.0).reshape(2, 3), name="w"), "b": np.ones(3), "unused": np.ones(1)}
    with pytest.warns(minidl.io.CheckpointLoadWarning, match=r"\['extra'\].*\['unused'\]"):
        param_not_load, ckpt_not_load = load_param_into_net(net, src)
    assert param_not_load == ["extra"] and ckpt_not_load == ["unused"]
    for n, p in net.params.items():
        assert p.data is arrays[n] and p.dtype == np.float32  # same array, cast to the parameter's dtype
    np.testing.assert_array_equal(net.params["w"].asnumpy(), np.arange(6.0).reshape(2, 3))
    src["w"].data[0, 0] = 99.0
    assert net.params["w"].asnumpy()[0, 0] == 0.0  # copied, not aliased


def test_load_shape_mismatch_lists_every_name_and_loads_nothing():
    net = Holder(w=(2, 3), b=(3,), c=(1,))
    with pytest.raises(ValueError, match=r"2 parameter\(s\) have a different shape.*'w': net \(2, 3\) vs "
                                         r"checkpoint \(3, 2\); 'b': net \(3,\) vs checkpoint \(4,\)"):
        load_param_into_net(net, {"w": np.ones((3, 2)), "b": np.ones(4), "c": np.ones(1)})
    assert net.params["c"].data[0] == 0.0


def test_strict_load_lists_every_missing_name():
    net = Holder(w=(1,), b=(1,), c=(1,))
    with pytest.raises(ValueError, match=r"2 parameter\(s\) are missing.*\['w', 'c'\]"):
        load_param_into_net(net, {"b": np.ones(1)}, strict_load=True)
    assert net.params["b"].data[0] == 0.0
    assert load_param_into_net(net, {"w": np.ones(1), "b": np.ones(1), "c": np.ones(1)}, strict_load=True) == ([], [])
    with pytest.raises(TypeError, match="parameters_and_names"):
        load_param_into_net(object(), {})


# ---- networks and optimizers --------------------------------------------------------------

def test_network_round_trip(tmp_path):
    minidl.set_seed(1)
    net = nn.SequentialCell(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 3))
    x = Tensor(np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32))
    y = net(x).asnumpy()
    path = tmp_path / "net.ckpt"
    save_checkpoint(net, path, append_dict={"epoch": 7})
    minidl.set_seed(2)
    other = nn.SequentialCell(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 3))
    assert not np.allclose(other(x).asnumpy(), y)
    params = load_checkpoint(path, net=other, strict_load=True)
    assert sorted(params) == sorted(n for n, _ in net.parameters_and_names())
    np.testing.assert_array_equal(other(x).asnumpy(), y)
    assert load_checkpoint_metadata(path) == {"epoch": "7"}
    wrong = nn.SequentialCell(nn.Dense(4, 6), nn.ReLU(), nn.Dense(6, 3))
    with pytest.raises(ValueError, match=r"'0.weight': net \(6, 4\) vs checkpoint \(8, 4\)"):
        load_param_into_net(wrong, params)


def test_optimizer_state_round_trip(tmp_path):
    params = [Parameter(np.ones(3), name="w"), Parameter(np.ones(2), name="b")]
    opt = Momentum(params, learning_rate=[0.1, 0.01], momentum=0.9)
    for _ in range(3):
        opt((Tensor(np.ones(3)), Tensor(np.full(2, 0.5))))
    path = tmp_path / "opt.ckpt"
    save_checkpoint({**dict(opt.parameters_and_names()), **{p.name: p for p in params}}, path)
    fresh_params = [Parameter(np.zeros(3), name="w"), Parameter(np.zeros(2), name="b")]
    fresh = Momentum(fresh_params, learning_rate=[0.1, 0.01], momentum=0.9)
    state = load_checkpoint(path)
    assert fresh.load_state_dict(state) == []
    assert fresh.global_step == 3 and fresh.get_lr() == 0.01
    for (name, buf), (_, ref) in zip(fresh.parameters_and_names(), opt.parameters_and_names()):
        np.testing.assert_array_equal(buf.asnumpy(), ref.asnumpy())


# ---- names: the given name, else the path ---------------------------------------------------

class Scaled(nn.Cell):
    """A Dense layer (names derived from paths) and a scale the user named."""

    def __init__(self, scale_name="my_scale"):
        super().__init__()
        self.fc = nn.Dense(3, 2)
        self.scale = Parameter(np.ones(2, np.float32), name=scale_name)


def _randomise(net, seed):
    gen = np.random.default_rng(seed)
    for _, p in net.parameters_and_names():
        p.set_data(gen.normal(size=p.data.shape).astype(p.dtype))


def _values(net):
    return [p.asnumpy().copy() for _, p in net.parameters_and_names()]


def test_a_given_name_is_the_checkpoint_key(tmp_path):
    net = nn.SequentialCell(Scaled())
    assert [n for n, _ in net.parameters_and_names()] == ["0.scale", "0.fc.weight", "0.fc.bias"]
    _randomise(net, 0)
    path = tmp_path / "named.ckpt"
    save_checkpoint(net, path)
    assert sorted(load_checkpoint(path)) == ["0.fc.bias", "0.fc.weight", "my_scale"]  # as MindSpore: param.name
    other = nn.SequentialCell(Scaled())
    assert load_param_into_net(other, load_checkpoint(path), strict_load=True) == ([], [])
    for got, want in zip(_values(other), _values(net)):
        assert_same(got, want)


def test_load_matches_by_name_first_then_by_path():
    net = nn.SequentialCell(Scaled())
    fc = {"0.fc.weight": np.ones((2, 3)), "0.fc.bias": np.ones(2)}
    # Keyed by path (files written before names were honoured, or by another tool).
    assert load_param_into_net(net, {**fc, "0.scale": np.full(2, 3.0)}, strict_load=True) == ([], [])
    np.testing.assert_array_equal(net[0].scale.asnumpy(), [3.0, 3.0])
    # Keyed by name; with both present the name wins and the path entry is left over.
    with pytest.warns(minidl.io.CheckpointLoadWarning):
        assert load_param_into_net(net, {"my_scale": np.full(2, 4.0), "0.scale": np.full(2, 5.0)}) == \
            (["0.fc.weight", "0.fc.bias"], ["0.scale"])
    np.testing.assert_array_equal(net[0].scale.asnumpy(), [4.0, 4.0])
    # Missing parameters are reported by the names a checkpoint of this net would hold.
    with pytest.raises(ValueError, match=r"1 parameter\(s\) are missing.*\['my_scale'\]"):
        load_param_into_net(net, fc, strict_load=True)


def test_an_entry_matching_two_parameters_is_refused():
    # Scale 0 is named like scale 1's path: a file keyed by paths is ambiguous for it.
    net = nn.SequentialCell(Scaled("1.scale"), Scaled("w"))
    before = _values(net)
    by_path = {n: np.full(p.data.shape, 7.0) for n, p in net.parameters_and_names()}
    with pytest.raises(ValueError, match=r"1 checkpoint entry matches more than one parameter, nothing was loaded: "
                                         r"'1.scale' matches the parameters at '0.scale' \(named '1.scale'\) "
                                         r"and '1.scale'"):
        load_param_into_net(net, by_path)
    for got, want in zip(_values(net), before):
        assert_same(got, want)


def test_two_parameters_with_one_name(tmp_path):
    net = nn.SequentialCell(Scaled("w"), Scaled("w"))
    with pytest.raises(ValueError, match=r"parameters '0.scale' and '1.scale' would both be saved as 'w'"):
        save_checkpoint(net, tmp_path / "dup.ckpt")
    assert not (tmp_path / "dup.ckpt").exists()
    with pytest.raises(ValueError, match=r"'w' matches the parameters at '0.scale' \(named 'w'\) and "
                                         r"'1.scale' \(named 'w'\)"):
        load_param_into_net(net, {"w": np.ones(2)})
    # Keyed by path, each finds its own entry.
    with pytest.warns(minidl.io.CheckpointLoadWarning, match="0.fc.weight"):  # the Dense layers are not in it
        assert load_param_into_net(net, {"0.scale": np.full(2, 1.5), "1.scale": np.full(2, 2.5)})[1] == []
    assert net[0].scale.asnumpy()[0] == 1.5 and net[1].scale.asnumpy()[0] == 2.5


def test_training_state_keeps_given_names_and_resumes_from_either_keying(tmp_path):
    from minidl.train import restore_train_state, save_train_state
    net = nn.SequentialCell(Scaled())
    _randomise(net, 1)
    opt = Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    opt(tuple(Tensor(np.full(p.data.shape, 0.5, np.float32)) for p in net.trainable_params()))
    path = tmp_path / "state.ckpt"
    save_train_state(path, net, opt, epoch_num=1, step_num=1, step_in_epoch=1, batch_num=4)
    saved = load_checkpoint(path)
    assert {"my_scale", "moments.my_scale", "0.fc.weight", "moments.0.fc.weight"} <= set(saved)
    assert "0.scale" not in saved
    # The same state keyed by the network's paths (as files were written before) resumes too.
    old = tmp_path / "old.ckpt"
    save_checkpoint({("0.scale" if n == "my_scale" else n): p for n, p in saved.items()}, old,
                    append_dict=load_checkpoint_metadata(path))
    for source in (path, old):
        fresh = nn.SequentialCell(Scaled())
        fresh_opt = Momentum(fresh.trainable_params(), learning_rate=0.1, momentum=0.9)
        assert restore_train_state(source, fresh, fresh_opt) == (0, 1, 1, 4)
        for got, want in zip(_values(fresh) + _values(fresh_opt), _values(net) + _values(opt)):
            assert_same(got, want)
