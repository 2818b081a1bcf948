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

    @classmethod
    def of(cls, *params):
        holder = cls()
        holder.params = {p.name: p for p in params}
        return holder

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


# ---- argument checks name the function, the argument and what it got -------------------------

@pytest.mark.parametrize("call, error, message", [
    (lambda p: save_checkpoint({"w": np.ones(1)}, 42), TypeError,
     "save_checkpoint: ckpt_file_name must be a str or path, got int"),
    (lambda p: save_checkpoint({"w": np.ones(1)}, p, integrated_save="yes"), ValueError,
     "save_checkpoint: integrated_save must be None, True or False, got 'yes'"),
    (lambda p: save_checkpoint({"": np.ones(1)}, p), ValueError,
     "save_checkpoint: names must be non-empty strings, got ''"),
    (lambda p: save_checkpoint({"w": "text"}, p), TypeError,
     "save_checkpoint: value of 'w' must be a Parameter, Tensor, array or number, got str"),
    (lambda p: save_checkpoint([{"name": "w"}], p), TypeError,
     r"save_checkpoint: list element 0 must be a named Parameter or a dict {'name': ..., 'data': ...}, got dict"),
    (lambda p: save_checkpoint(42, p), TypeError,
     "save_checkpoint: save_obj must be a Cell (anything with parameters_and_names()), a list of Parameters, "
     "a list of {'name', 'data'} dicts or a dict, got int"),
    (lambda p: save_checkpoint({"w": np.ones(1)}, p, append_dict=[("epoch", 1)]), TypeError,
     "save_checkpoint: append_dict must be a dict, got list"),
    (lambda p: save_checkpoint({"w": np.ones(1)}, p, append_dict={1: "x"}), TypeError,
     "save_checkpoint: append_dict keys must be str, got 1"),
    (lambda p: load_checkpoint(p, filter_prefix=["head", 1]), TypeError,
     "load_checkpoint: filter_prefix must be a str or a list of str, got ('head', 1)"),
    (lambda p: load_checkpoint(p, specify_prefix=[None]), TypeError,
     "load_checkpoint: specify_prefix must be a str or a list of str, got (None,)"),
    (lambda p: load_param_into_net(object(), {}), TypeError,
     "load_param_into_net: net must be a Cell (anything with parameters_and_names()), got object"),
    (lambda p: load_param_into_net(Holder(w=(1,)), [("w", np.ones(1))]), TypeError,
     "load_param_into_net: parameter_dict must be a dict, got list"),
])
def test_argument_errors_name_the_function_argument_and_value(tmp_path, call, error, message):
    path = tmp_path / "a.ckpt"
    with pytest.raises(error) as info:
        call(path)
    assert str(info.value) == message
    assert not path.exists()


def test_integrated_save_changes_nothing_without_sharded_parameters(tmp_path):
    w = np.arange(3, dtype=np.float32)
    for integrated_save in (None, True, False):
        path = tmp_path / f"{integrated_save}.ckpt"
        save_checkpoint({"w": w}, path, integrated_save=integrated_save)
        assert_same(load_checkpoint(path)["w"].asnumpy(), w)
        assert load_checkpoint_metadata(path) == {}


def test_a_prefix_is_a_whole_string_not_its_characters(tmp_path):
    path = tmp_path / "p.ckpt"
    save_checkpoint({n: np.ones(1) for n in ["head.w", "h2.w", "e.w", "backbone.w"]}, path)
    assert sorted(load_checkpoint(path, specify_prefix="head")) == ["head.w"]
    assert sorted(load_checkpoint(path, filter_prefix="head")) == ["backbone.w", "e.w", "h2.w"]


# ---- load_checkpoint(net=...) ---------------------------------------------------------------

def test_load_checkpoint_into_a_net_loads_and_warns_or_raises_as_load_param_into_net(tmp_path):
    path = tmp_path / "net.ckpt"
    save_checkpoint({"a": np.full(2, 3.0), "x": np.ones(2)}, path)
    net = Holder(a=(2,), b=(2,))
    with pytest.warns(minidl.io.CheckpointLoadWarning) as record:  # strict_load defaults to False, as MindSpore
        params = load_checkpoint(path, net=net)
    assert sorted(params) == ["a", "x"] and len(record) == 1
    assert str(record[0].message) == (
        "load_checkpoint: 1 parameter(s) of the net got no value and keep their current values: ['b']; "
        "1 checkpoint entry matched no parameter: ['x']; check that the network is built as when the checkpoint "
        "was saved (strict_load=True makes missing parameters an error)")
    np.testing.assert_array_equal(net.params["a"].asnumpy(), [3.0, 3.0])
    with pytest.raises(ValueError) as info:
        load_checkpoint(path, net=Holder(a=(2,), b=(2,)), strict_load=True)
    assert str(info.value) == ("load_checkpoint: strict_load is set and 1 parameter(s) are missing from the "
                               "checkpoint, nothing was loaded: ['b']")
    with pytest.raises(ValueError, match=r"^load_checkpoint: 1 checkpoint entry matches more than one parameter"):
        load_checkpoint(path, net=nn.SequentialCell(Scaled("a"), Scaled("a")))


def test_the_warning_names_every_unmatched_entry_and_advises(tmp_path):
    net = Holder(a=(2,))
    with pytest.warns(minidl.io.CheckpointLoadWarning) as record:
        assert load_param_into_net(net, {"a": np.ones(2), "x": np.ones(2), "y": np.ones(2)}) == ([], ["x", "y"])
    assert len(record) == 1 and str(record[0].message) == (
        "load_param_into_net: 2 checkpoint entries matched no parameter: ['x', 'y']; entries the net does not need "
        "(e.g. the optimizer state of a training checkpoint) can be left out with load_checkpoint's specify_prefix, "
        "filter_prefix or choice_func")


# ---- load_param_into_net: values of any form, cast, written in place --------------------------

def test_values_of_any_form_are_cast_to_the_parameter_dtype():
    ints = Parameter(np.zeros(3, np.int32), name="i")
    net = Holder(w=(2,), s=())
    net.params["i"] = ints
    noncontiguous = np.arange(8.0)[::4]  # float64, strided
    assert load_param_into_net(net, {"w": noncontiguous, "s": 2.5, "i": [1.9, -2.0, 3.0]}) == ([], [])
    assert_same(net.params["w"].asnumpy(), np.array([0.0, 4.0], np.float32))
    assert_same(net.params["s"].asnumpy(), np.array(2.5, np.float32))
    assert_same(ints.asnumpy(), np.array([1, -2, 3], np.int32))  # float -> int, as numpy's astype


@pytest.mark.cpu_only  # NumPy's read-only flag
def test_a_read_only_parameter_array_is_replaced():
    net = Holder(w=(2,))
    net.params["w"].data.flags.writeable = False  # e.g. an array mapped read-only from a file
    load_param_into_net(net, {"w": np.array([1.0, 2.0])})
    assert_same(net.params["w"].asnumpy(), np.array([1.0, 2.0], np.float32))


def test_two_ambiguous_entries_are_both_listed():
    # Scales 0 and 2 are named like the paths of scales 1 and 3 (see the test above).
    net = nn.SequentialCell(Scaled("1.scale"), Scaled("w"), Scaled("3.scale"), Scaled("v"))
    with pytest.raises(ValueError) as info:
        load_param_into_net(net, {n: np.ones(p.data.shape) for n, p in net.parameters_and_names()})
    assert str(info.value) == (
        "load_param_into_net: 2 checkpoint entries match more than one parameter, nothing was loaded: "
        "'1.scale' matches the parameters at '0.scale' (named '1.scale') and '1.scale'; "
        "'3.scale' matches the parameters at '2.scale' (named '3.scale') and '3.scale'; "
        "give the parameters names that tell them apart, or pass a dict keyed by the names wanted")


def test_the_helpers_report_as_load_param_into_net_by_default():
    from minidl.io.checkpoint import load_param_into_net_quietly, match_parameters
    net = nn.SequentialCell(Scaled("w"), Scaled("w"))
    with pytest.raises(ValueError, match=r"^load_param_into_net: 1 checkpoint entry matches"):
        match_parameters(net, {"w": np.ones(2)})
    with pytest.raises(ValueError, match=r"^load_param_into_net: strict_load is set and 1 parameter\(s\) are missing"):
        load_param_into_net_quietly(Holder(a=(1,), b=(1,)), {"a": np.ones(1)}, strict_load=True)


def test_keyed_parameters_reports_as_save_checkpoint_by_default():
    from minidl.io.checkpoint import keyed_parameters
    with pytest.raises(ValueError, match=r"^save_checkpoint: parameters '0.scale' and '1.scale' would both be saved"):
        keyed_parameters(nn.SequentialCell(Scaled("w"), Scaled("w")))


# ---- sharded parameters (tensor parallelism), through a stand-in runtime ----------------------

class _RowBlock:
    """Placement of rank 1's half of an (8, 4) tensor split by rows."""
    shape = (8, 4)

    def __str__(self):
        return "(a, -) on [2]"


class _Rank1(minidl.runtime.Runtime):
    """Rank 1 of two that split tensors by rows; rank 0's block holds -1 everywhere."""

    def full_value(self, tensor):
        if not tensor.is_sharded:
            return tensor.data
        return np.concatenate([np.full_like(tensor.data, -1.0), tensor.data])

    def local_value(self, tensor, value):
        return np.asarray(value)[4:] if tensor.is_sharded else value


def _sharded(name, value=0.0):
    p = Parameter(np.full((4, 4), value, np.float32), name=name)
    p.placement = _RowBlock()
    return p


def test_sharded_parameters_need_integrated_save_named_in_the_message(tmp_path):
    for count, shown in [(3, "'p0', 'p1', 'p2'"), (4, "'p0', 'p1', 'p2', ...")]:
        with pytest.raises(ValueError) as info:
            save_checkpoint([_sharded(f"p{i}") for i in range(count)] + [Parameter(np.ones(1), name="u")],
                            tmp_path / "s.ckpt")
        assert str(info.value) == (
            f"save_checkpoint: {count} parameter(s) ({shown}) hold this rank's block of a sharded tensor; pass "
            f"integrated_save=True on every rank to gather and save whole tensors (a collective), or "
            f"integrated_save=False to save this rank's blocks")
    assert not (tmp_path / "s.ckpt").exists()


@pytest.mark.cpu_only  # the stand-in runtime's blocks are NumPy arrays
def test_sharded_parameters_save_whole_or_as_blocks_and_load_back(tmp_path):
    whole, blocks = tmp_path / "whole.ckpt", tmp_path / "blocks.ckpt"
    with _Rank1():
        save_checkpoint([_sharded("w", 2.0), Parameter(np.ones(2, np.float32), name="u")], whole,
                        integrated_save=True)
        save_checkpoint([_sharded("w", 2.0)], blocks, integrated_save=False)
    expected = np.concatenate([np.full((4, 4), -1.0), np.full((4, 4), 2.0)]).astype(np.float32)
    assert_same(load_checkpoint(whole)["w"].asnumpy(), expected)
    assert load_checkpoint_metadata(whole) == {"layout.w": "(a, -) on [2]"}
    assert_same(load_checkpoint(blocks)["w"].asnumpy(), np.full((4, 4), 2.0, np.float32))
    assert load_checkpoint_metadata(blocks) == {"layout.w": "(a, -) on [2]", "block.w": "(4, 4)"}
    for path, values in [(whole, expected), (blocks, np.full((4, 4), 2.0, np.float32))]:
        param = _sharded("w")
        with _Rank1():
            assert load_param_into_net(Holder.of(param), {"w": values}, strict_load=True) == ([], [])
        assert_same(param.data, np.full((4, 4), 2.0, np.float32))  # this rank's block, from either file
    with _Rank1(), pytest.raises(ValueError) as info:
        load_param_into_net(Holder.of(_sharded("w")), {"w": np.ones((3, 4))})
    assert str(info.value) == ("load_param_into_net: 1 parameter(s) have a different shape in the checkpoint, "
                               "nothing was loaded: 'w': net (8, 4) (block (4, 4)) vs checkpoint (3, 4)")
