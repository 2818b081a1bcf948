"""Details of a pipeline step that the mutation run (tools/mutation.py pipeline) found untested: a
schedule's print for one and for eleven stages, a loss scale other than 1 on the step's gradients,
parameters of a stage that its loss does not reach, parameters shared by several pairs of stages,
pipeline x data parallel over parameters of two dtypes, the words of each refusal."""
import numpy as np
import pytest

import minidl_parallel as mp
from minidl import Parameter, Tensor, backend, nn, ops
from minidl.autograd import value_and_grad
from minidl_parallel.nn import PipelineCell, PipelineGradReducer
from minidl_parallel.pipeline import PipelineError, pipeline_schedule

TIMEOUT = 60


def _context(stages, scheduler="1f1b"):
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                 pipeline_config={"pipeline_scheduler": scheduler})


def _set_weights(cells, seed):
    rng = np.random.default_rng(seed)
    for cell in cells:
        for p in cell.trainable_params():
            p.set_data(Tensor((0.5 * rng.standard_normal(p.shape)).astype(p.dtype)))


def _loss(body):
    return nn.WithLossCell(body, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))


def _numpy(grads):
    return [backend.to_numpy(g.data) for g in grads]


def _one_device_sums(net, params, x, y, micro_batches, blocks=1):
    """The gradients one device accumulates: each micro-batch's in order (within each of ``blocks``
    blocks of the batch, a data-parallel replica's shard), then the blocks' sums in block order."""
    fn = value_and_grad(net, None, params)
    total = None
    rows = x.shape[0] // blocks
    n = rows // micro_batches
    for b in range(blocks):
        block = None
        for k in range(micro_batches):
            lo = b * rows + k * n
            _, grads = fn(Tensor(x.data[lo:lo + n]), Tensor(y.data[lo:lo + n]))
            block = _numpy(grads) if block is None else [a + g for a, g in zip(block, _numpy(grads))]
        total = block if total is None else [a + g for a, g in zip(total, block)]
    return total


# --- the printed schedule -------------------------------------------------------------------------

def test_a_one_stage_schedule_prints_without_a_bubble():
    assert str(pipeline_schedule(1, 2)) == "\n".join([
        "1f1b schedule: 1 stages, 2 micro-batches; bubble 0 of the step (0 idle slots of 4 per stage)",
        "stage 0 | F0 B0 F1 B1"])


def test_stage_labels_are_padded_on_the_right_when_the_stage_numbers_reach_two_digits():
    lines = str(pipeline_schedule(11, 11, "gpipe")).splitlines()
    assert lines[0] == ("gpipe schedule: 11 stages, 11 micro-batches; bubble 10/21 of the step (20 idle slots "
                        "of 42 per stage)")
    assert lines[1].startswith("stage 0  | F0  F1  ") and lines[10].startswith("stage 9  | .   ")
    assert lines[11].startswith("stage 10 | .   ") and lines[1].endswith("B9  B10")


def test_a_schedule_made_directly_defaults_to_mindspores_1f1b():
    from minidl_parallel.pipeline import Schedule
    assert Schedule(2, 3).scheduler == "1f1b" and repr(Schedule(2, 3)) == (
        "Schedule(stages=2, micro_batches=3, scheduler='1f1b')")


def test_the_pipeline_cells_schedule_is_the_settings_scheduler():
    def body():
        _context(2, "gpipe")
        pipe = PipelineCell(_loss(nn.SequentialCell(_stages((0, 1)))), 4)
        schedule = pipe.schedule()
        return schedule.stages, schedule.micro_batches, schedule.scheduler

    assert mp.run_threads(2, body, timeout=TIMEOUT) == [(2, 4, "gpipe")] * 2


# --- the step's gradients -------------------------------------------------------------------------

class _Stage(nn.Cell):
    """A Dense layer, and optionally parameters the stage holds but its forward never reads."""

    def __init__(self, a, b, spare=False, dtype=np.float32):
        super().__init__()
        self.dense = nn.Dense(a, b, dtype=dtype)
        self.spare = nn.Dense(2, 2, dtype=dtype) if spare else None

    def construct(self, x):
        return self.dense(x)


def _stages(stages_of_layers, widths=(6, 5, 3), spare_on=None):
    layers = [_Stage(a, b, spare=(k == spare_on)) for k, (a, b) in enumerate(zip(widths[:-1], widths[1:]))]
    _set_weights(layers, 21)
    for layer, stage in zip(layers, stages_of_layers):
        layer.pipeline_stage = stage
    return layers


def _batch(rows=8, features=6, classes=3, dtype=np.float32):
    rng = np.random.default_rng(5)
    return (Tensor(rng.standard_normal((rows, features)).astype(dtype)),
            Tensor(rng.integers(0, classes, rows).astype(np.int32)))


@pytest.mark.parametrize("scale", [1.0, 2.0, 0.25])
def test_the_step_gradients_are_the_micro_batch_sums_times_the_losss_incoming_gradient(scale):
    """Differentiating scale * pipe(x, y): each of the stage's parameters gets the sum of its
    micro-batch gradients times the scale, in its own dtype (powers of two: exact); a parameter of
    the stage that its loss does not reach gets zeros; other stages' parameters get zeros."""
    x, y = _batch()
    reference_net = _loss(nn.SequentialCell(_stages((0, 0), spare_on=1)))
    params = reference_net.trainable_params()
    expected = _one_device_sums(reference_net, params, x, y, 4)

    def body():
        _context(2)
        net = _loss(nn.SequentialCell(_stages((0, 1), spare_on=1)))
        pipe = PipelineCell(net, 4)
        fn = value_and_grad(lambda a, b: pipe(a, b) * scale, None, net.trainable_params())
        _, grads = fn(x, y)
        return [(name, g.dtype, backend.to_numpy(g.data)) for (name, _), g in zip(net.parameters_and_names(), grads)]

    for rank, grads in enumerate(mp.run_threads(2, body, timeout=TIMEOUT)):
        assert [name for name, _, _ in grads] == ["_backbone.0.dense.weight", "_backbone.0.dense.bias",
                                                  "_backbone.1.dense.weight", "_backbone.1.dense.bias",
                                                  "_backbone.1.spare.weight", "_backbone.1.spare.bias"]
        for k, (name, dtype, g) in enumerate(grads):
            assert dtype == np.float32, (name, dtype)
            mine = (k < 2) == (rank == 0) and "spare" not in name
            want = expected[k] * np.float32(scale) if mine else np.zeros_like(expected[k])
            np.testing.assert_array_equal(g, want, err_msg=f"{name} on rank {rank}")
        assert not grads[4][2].any() and not grads[5][2].any()  # the spare layer: no gradient reached it


# --- shared parameters ----------------------------------------------------------------------------

class _Holder(nn.Cell):
    """Holds a parameter and never reads it."""

    def __init__(self, param):
        super().__init__()
        self.held = param


class _Tied(nn.Cell):
    """Three stages of 4 x 4 Dense layers, stage 0's bias also used by stage 2 and its weight by
    stage 1; stage 2 also holds stage 0's weight without reading it. The cells are declared in the
    order a, c, b, so the bias shared by stages 0 and 2 is found first (stage 1 skips it, then
    takes part in the weight's sum), and run as a, b, c."""

    def __init__(self, dtype=np.float64):
        super().__init__()
        self.a = nn.Dense(4, 4, dtype=dtype)
        self.c = _Stage(4, 4, dtype=dtype)
        self.b = nn.Dense(4, 4, dtype=dtype)
        _set_weights([self.a, self.b, self.c], 31)
        self.b.weight = self.a.weight
        self.c.dense.bias = self.a.bias
        self.c.extra = _Holder(self.a.weight)  # (after c.dense: the weight's entry comes second)

    def construct(self, x):
        return self.c(self.b(self.a(x)))


def _tied(stages, dtype=np.float64):
    net = _Tied(dtype)
    net.a.pipeline_stage, net.b.pipeline_stage, net.c.pipeline_stage = (0, 1, 2) if stages == 3 else (0, 0, 0)
    return _loss(net)


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_parameters_shared_by_different_pairs_of_stages_get_the_one_device_gradients(dtype, rtol):
    x, y = _batch(rows=6, features=4, classes=4, dtype=dtype)
    reference = _tied(1, dtype)
    expected = dict(zip([name for name, _ in reference.parameters_and_names()],
                        _one_device_sums(reference, reference.trainable_params(), x, y, 3)))

    def body():
        _context(3, "gpipe")
        net = _tied(3, dtype)
        pipe = PipelineCell(net, 3)
        _, grads = value_and_grad(lambda a, b: pipe(a, b), None, net.trainable_params())(x, y)
        return {name: (g.dtype, backend.to_numpy(g.data)) for (name, _), g in zip(net.parameters_and_names(), grads)}

    used_on = {"_backbone.a.weight": (0, 1, 2), "_backbone.a.bias": (0, 2), "_backbone.c.dense.weight": (2,),
               "_backbone.b.bias": (1,)}
    for rank, grads in enumerate(mp.run_threads(3, body, timeout=TIMEOUT)):
        assert sorted(grads) == sorted(used_on)
        for name, (g_dtype, g) in grads.items():
            assert g_dtype == dtype, (name, g_dtype)
            if rank in used_on[name]:  # the same sum on every stage that holds it
                np.testing.assert_allclose(g, expected[name], rtol=rtol, atol=rtol * 1e-3, err_msg=f"{name} on {rank}")
            else:
                assert not g.any(), (name, rank)


# --- pipeline x data parallel ---------------------------------------------------------------------

class _Scaled(nn.Cell):
    """A float32 Dense layer times a float64 scalar (cast to float32): a stage whose parameters have two
    dtypes, one of them held by a single parameter; and a spare layer that no loss reaches."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(5, 3)
        self.scale = Parameter(Tensor(np.array([1.5])), name="scale")
        self.spare = nn.Dense(2, 2)
        self.cast = ops.Cast()

    def construct(self, x):
        return self.dense(x) * self.cast(self.scale, np.float32)


def _two_dtypes(stages):
    first, second = _Stage(6, 5), _Scaled()
    _set_weights([first, second.dense, second.spare], 41)
    first.pipeline_stage, second.pipeline_stage = 0, stages - 1
    return _loss(nn.SequentialCell([first, second]))


def test_pipeline_times_data_parallel_reduces_each_dtype_and_counts_an_unreached_parameter_as_zeros():
    x, y = _batch()
    reference = _two_dtypes(1)
    names = [name for name, _ in reference.parameters_and_names()]
    expected = dict(zip(names, _one_device_sums(reference, reference.trainable_params(), x, y, 2, blocks=2)))

    def body():
        _context(2)
        rank = mp.get_rank()
        rows = slice(4 * (rank % 2), 4 * (rank % 2) + 4)  # replica j (ranks j and 2 + j) trains on block j
        net = _two_dtypes(2)
        pipe = PipelineCell(net, 2)
        _, grads = value_and_grad(lambda a, b: pipe(a, b), None, net.trainable_params())(
            Tensor(x.data[rows]), Tensor(y.data[rows]))
        return {name: (g.dtype, backend.to_numpy(g.data)) for (name, _), g in zip(net.parameters_and_names(), grads)}

    for rank, grads in enumerate(mp.run_threads(4, body, timeout=TIMEOUT)):
        stage = rank // 2
        assert sorted(grads) == sorted(names)
        for name, (dtype, g) in grads.items():
            assert dtype == (np.float64 if name.endswith("scale") else np.float32), (name, dtype)
            if name.startswith(f"_backbone.{stage}.") and "spare" not in name:
                np.testing.assert_array_equal(g, expected[name], err_msg=f"{name} on rank {rank}")
            else:
                assert not g.any(), (name, rank)


# --- refusals, word for word ----------------------------------------------------------------------

class _Returns(nn.Cell):
    """Two stages; the construct returns ``what(loss, labels)`` instead of the loss."""

    def __init__(self, what):
        super().__init__()
        self.a, self.b = _stages((0, 1))
        self.ce = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        self.what = what

    def construct(self, x, y):
        return self.what(self.ce(self.b(self.a(x)), y), y)


@pytest.mark.parametrize("what, got", [
    (lambda loss, y: y, "a Tensor of shape (2,) made from the data only"),
    (lambda loss, y: y[:1], "a Tensor of shape (1,) made from the data only"),
    (lambda loss, y: (loss, y), "a tuple of 2 values"),
    (lambda loss, y: [loss], "a list of 1 values"),
    (lambda loss, y: 3, "3"),
])
def test_a_last_stage_output_that_is_not_its_loss_is_described_in_the_error(what, got):
    def body():
        _context(2)
        return PipelineCell(_Returns(what), 4)(*_batch())

    with pytest.raises(PipelineError) as info:
        mp.run_threads(2, body, timeout=TIMEOUT)
    assert str(info.value) == (f"rank 1 of 2: the network's output on the last stage (1) must be the loss, a "
                               f"one-element Tensor computed on it; got {got}: wrap the network and its loss in "
                               f"nn.WithLossCell, with the loss after the last stage's cells")


def test_the_grad_reducers_refusals_name_the_value_and_what_to_pass():
    params = _Stage(3, 2).trainable_params()
    with pytest.raises(NotImplementedError) as info:
        PipelineGradReducer(params, opt_shard=True)
    assert str(info.value) == ("PipelineGradReducer: opt_shard=True (optimizer parallelism inside a pipeline) is not "
                               "built in minidl; pass opt_shard=None or False")
    with pytest.raises(ValueError) as info:
        PipelineGradReducer(params, scale_sense=Tensor(np.ones((2, 1), np.float32)))
    assert str(info.value) == "PipelineGradReducer: scale_sense must be one number, got a Tensor of shape (2, 1)"
    grads = tuple(Tensor(np.full(p.shape, 3.0, np.float32)) for p in params)
    for one in (Tensor(np.full((1, 1), 4.0, np.float32)), Tensor(np.full((1,), 4.0, np.float32)), 4, 4.0):
        reduced = PipelineGradReducer(params, scale_sense=one)(grads)
        assert [g.asnumpy().tolist() for g in reduced] == [np.full(p.shape, 0.75).tolist() for p in params]


# --- what the step sends: every send waited for, labelled and logged --------------------------------

def _watch_sends(comm):
    """Wraps the threads communicator's sends: each started send's CallInfo (what a stall of its wait
    would print) in ``started``, and its index in ``waited`` once its request is waited for."""
    started, waited = [], []
    send = comm._isend

    def watched(buf, dest, tag, call, fingerprint):
        send(buf, dest, tag, call, fingerprint)
        k = len(started)
        started.append(str(call))
        return lambda: waited.append(k)

    comm._isend = watched
    return started, waited


def test_every_send_of_a_step_is_waited_for_by_its_end_and_named_by_the_action_it_waits_on():
    def body():
        _context(2)
        net = _loss(nn.SequentialCell(_stages((0, 1))))
        started, waited = _watch_sends(mp.get_communicator())
        pipe = PipelineCell(net, 2)
        pipe(*_batch(rows=4))
        records = [(str(m.action), m.direction, m.peer, m.payload, m.nbytes) for m in pipe.last_step.messages]
        return started, sorted(waited), records

    (started0, waited0, records0), (started1, waited1, records1) = mp.run_threads(2, body, timeout=TIMEOUT)
    # (a send starts with the next receive, in one batch: it carries that receive's label)
    assert started0 == [
        "send #0 to rank 1 (tag 2, shape=(10,), dtype=int64) (pipeline stage 0, B0: the gradient from stage 1)",
        "send #0 to rank 1 (tag 1, shape=(2, 5), dtype=float32) (pipeline stage 0, B0: the gradient from stage 1)",
        "send #1 to rank 1 (tag 2, shape=(10,), dtype=int64) (pipeline stage 0, B0: the gradient from stage 1)",
        "send #1 to rank 1 (tag 1, shape=(2, 5), dtype=float32) (pipeline stage 0, B0: the gradient from stage 1)"]
    assert started1 == [  # the last send starts at the end of the step, with its own label
        "send #0 to rank 0 (tag 3, shape=(2, 5), dtype=float32) (pipeline stage 1, F1: the header from stage 0)",
        "send #1 to rank 0 (tag 3, shape=(2, 5), dtype=float32) (pipeline stage 1, B1: its gradient for stage 0)"]
    assert waited0 == list(range(4)) and waited1 == list(range(2))
    assert records0 == [("F0", "send", 1, "header", 80), ("F0", "send", 1, "activation", 40),
                        ("F1", "send", 1, "header", 80), ("F1", "send", 1, "activation", 40),
                        ("B0", "recv", 1, "gradient", 40), ("B1", "recv", 1, "gradient", 40)]
    assert records1 == [("F0", "recv", 0, "header", 80), ("F0", "recv", 0, "activation", 40),
                        ("B0", "send", 0, "gradient", 40), ("F1", "recv", 0, "header", 80),
                        ("F1", "recv", 0, "activation", 40), ("B1", "send", 0, "gradient", 40)]


# --- activations: what may cross a boundary, and a stage that ignores its input ---------------------

class _Reshaped(nn.Cell):
    """A Dense layer (of its input cast to float32) whose output leaves as ``shape`` (and, optionally,
    as ``dtype``)."""

    def __init__(self, a, b, shape, dtype=None):
        super().__init__()
        self.dense, self.shape, self.dtype = nn.Dense(a, b), shape, dtype
        self.cast = ops.Cast()

    def construct(self, x):
        h = self.dense(self.cast(x, np.float32).reshape(x.shape[0], -1)).reshape(self.shape)
        return h if self.dtype is None else self.cast(h, self.dtype)


def _shaped(stages, shape, dtype=None):
    first, second = _Reshaped(6, 5, shape, dtype), _Reshaped(5, 3, (2, 3))
    _set_weights([first, second], 51)
    first.pipeline_stage, second.pipeline_stage = 0, stages - 1
    return _loss(nn.SequentialCell([first, second]))


def test_an_activation_of_eight_dimensions_crosses_a_boundary():
    shape = (2, 1, 1, 1, 1, 1, 1, 5)
    x, y = _batch()
    reference = _shaped(1, shape)
    want = sum(float(reference(Tensor(x.data[k:k + 2]), Tensor(y.data[k:k + 2])).asnumpy()) for k in (0, 2, 4, 6))

    def body():
        _context(2)
        pipe = PipelineCell(_shaped(2, shape), 4)
        return float(pipe(x, y).asnumpy()), pipe.last_step.count("send", "header")

    (loss0, headers0), (loss1, _) = mp.run_threads(2, body, timeout=TIMEOUT)
    assert loss0 == loss1 and abs(loss0 - want) <= 1e-5 * abs(want)
    assert headers0 == (4, 4 * 80)


@pytest.mark.parametrize("shape, dtype, described", [
    ((2, 1, 1, 1, 1, 1, 1, 1, 5), None, "shape (2, 1, 1, 1, 1, 1, 1, 1, 5) and dtype float32"),
    ((2, 5), np.uint16, "shape (2, 5) and dtype uint16"),
])
def test_an_activation_that_cannot_cross_a_boundary_is_refused_naming_it(shape, dtype, described):
    def body():
        _context(2)
        return PipelineCell(_shaped(2, shape, dtype), 4)(*_batch())

    with pytest.raises(PipelineError) as info:
        mp.run_threads(2, body, timeout=TIMEOUT)
    assert str(info.value) == (f"rank 0 of 2: an activation of {described} cannot cross a stage boundary: at most 8 "
                               f"dimensions, dtypes ('float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64', "
                               f"'int8', 'uint8', 'int16', 'bool')")


class _IgnoresInput(nn.Cell):
    """Takes the previous stage's output and does not use it: its Dense reads a constant."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(5, 3)
        self.constant = Tensor(np.linspace(-1.0, 1.0, 10, dtype=np.float32).reshape(2, 5))

    def construct(self, x):
        return self.dense(self.constant)


def _ignoring(stages):
    first, second = _Stage(6, 5), _IgnoresInput()
    _set_weights([first, second], 61)
    first.pipeline_stage, second.pipeline_stage = 0, stages - 1
    return _loss(nn.SequentialCell([first, second]))


def test_a_stage_whose_output_ignores_its_input_sends_back_a_zero_gradient_of_the_inputs_shape_and_dtype():
    x, y = _batch()
    reference = _ignoring(1)
    expected = _one_device_sums(reference, reference.trainable_params(), x, y, 4)

    def body():
        _context(2)
        net = _ignoring(2)
        pipe = PipelineCell(net, 4)
        _, grads = value_and_grad(lambda a, b: pipe(a, b), None, net.trainable_params())(x, y)
        return [(g.dtype, backend.to_numpy(g.data)) for g in grads], pipe.last_step.count("recv", "gradient")

    (grads0, received0), (grads1, _) = mp.run_threads(2, body, timeout=TIMEOUT)
    assert received0 == (4, 4 * 40)  # stage 0 still receives a (2, 5) float32 gradient per micro-batch
    assert not expected[0].any() and not expected[1].any()
    for k, want in enumerate(expected):
        assert grads0[k][0] == grads1[k][0] == np.float32
        np.testing.assert_array_equal(grads0[k][1] if k < 2 else grads1[k][1], want)


class _TwoOutputs(nn.Cell):
    """Stage 0 has two cells whose outputs both go to stage 1."""

    def __init__(self):
        super().__init__()
        self.a, self.a2 = nn.Dense(6, 5), nn.Dense(6, 4)
        self.b = _Pair()
        self.a.pipeline_stage = self.a2.pipeline_stage = 0
        self.b.pipeline_stage = 1

    def construct(self, x):
        return self.b(self.a(x), self.a2(x))


class _Pair(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(9, 3)
        self.concat = ops.Concat(axis=1)

    def construct(self, h, h2):
        return self.dense(self.concat((h, h2)))


def test_two_tensors_sent_across_one_boundary_are_refused_naming_their_shapes():
    def body():
        _context(2)
        try:
            PipelineCell(_loss(_TwoOutputs()), 4)(*_batch())
        except Exception as exc:  # noqa: B902 - each rank's own error, compared below
            return type(exc).__name__, str(exc)
        return None

    sender, receiver = mp.run_threads(2, body, timeout=TIMEOUT)
    assert sender == ("PipelineError", "stage 0 of micro-batch 0 sent 2 tensors ((2, 5), (2, 4)) across its stage "
                                       "boundary; minidl's pipeline moves one tensor per boundary: return one tensor "
                                       "from the last cell of each stage")
    assert receiver[0] == "CollectiveAborted"  # (the sends never started: stage 0 raised first)


# --- code between the stages ----------------------------------------------------------------------

class _Glue(nn.Cell):
    """Ops on the data alone before stage 0 and a plain-op loss after the last stage (no loss cell)."""

    def __init__(self, stages):
        super().__init__()
        self.a, self.b = _stages((0, stages - 1))
        self.mean, self.mul = ops.ReduceMean(), ops.Mul()

    def construct(self, x, y):
        h = self.b(self.a(x * 0.5))  # (an operator on a Remote would raise: ops route it)
        return self.mean(self.mul(h, h))


def test_ops_on_the_data_alone_run_on_every_stage_and_a_plain_op_loss_gives_gradients_in_the_params_dtype():
    x, y = _batch()
    reference = _Glue(1)
    expected = _one_device_sums(reference, reference.trainable_params(), x, y, 4)

    def body():
        _context(2)
        net = _Glue(2)
        pipe = PipelineCell(net, 4)
        loss, grads = value_and_grad(lambda a, b: pipe(a, b), None, net.trainable_params())(x, y)
        return loss.dtype, [(g.dtype, backend.to_numpy(g.data)) for g in grads]

    for rank, (dtype, grads) in enumerate(mp.run_threads(2, body, timeout=TIMEOUT)):
        assert dtype == np.float32
        for k, (g_dtype, g) in enumerate(grads):
            assert g_dtype == np.float32, (k, g_dtype)
            if k // 2 == rank:
                np.testing.assert_array_equal(g, expected[k], err_msg=f"{k} on rank {rank}")


def test_a_bfloat16_activation_crosses_a_boundary_as_bfloat16():
    """NumPy has no bfloat16: the receiving stage makes its buffer's dtype from ml_dtypes."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, y = _batch()
    reference = _shaped(1, (2, 5), ml_dtypes.bfloat16)
    want = sum(float(reference(Tensor(x.data[k:k + 2]), Tensor(y.data[k:k + 2])).asnumpy()) for k in (0, 2, 4, 6))

    def body():
        _context(2)
        pipe = PipelineCell(_shaped(2, (2, 5), ml_dtypes.bfloat16), 4)
        loss = float(pipe(x, y).asnumpy())
        return loss, pipe.last_step.count("recv", "activation")

    (loss0, _), (loss1, received1) = mp.run_threads(2, body, timeout=TIMEOUT)
    assert loss0 == loss1 and abs(loss1 - want) <= 1e-6 * abs(want)
    assert received1 == (4, 4 * 2 * 5 * 2)  # 2 bytes an element


# --- how the construct may hand activations to a stage ----------------------------------------------

class _Handover(nn.Cell):
    """Stage 0: a Dense layer; stage 1: a ReLU cell (no parameters); stage 2: a Dense layer without a
    bias (one parameter), called as ``how`` says (keyword, dict, list, data first, twice)."""

    def __init__(self, stages, how):
        super().__init__()
        self.a, self.relu, self.c = nn.Dense(6, 5), _Relu(), _Takes(how)
        _set_weights([self.a, self.c], 71)
        self.a.pipeline_stage, self.relu.pipeline_stage, self.c.pipeline_stage = (0, 1, 2) if stages == 3 else (0,) * 3
        self.how = how
        self.mul = ops.Mul()

    def construct(self, x, y, factor):
        h = self.relu(self.a(self.mul(x, factor)))
        if self.how == "keyword":
            return self.c(h=h, x=x)
        if self.how == "dict":
            return self.c({"h": h}, x)
        if self.how == "list":
            return self.c([x, [h]], x)
        return self.c(x, h)  # "data first"


class _Relu(nn.Cell):
    def __init__(self):
        super().__init__()
        self.relu = ops.ReLU()

    def construct(self, h):
        return self.relu(h)


class _Takes(nn.Cell):
    def __init__(self, how):
        super().__init__()
        self.dense, self.how = nn.Dense(5, 3, has_bias=False), how

    def construct(self, first=None, x=None, h=None):
        if self.how == "keyword":
            return self.dense(h)
        if self.how == "dict":
            return self.dense(first["h"])
        if self.how == "list":
            return self.dense(first[1][0])
        return self.dense(x)


@pytest.mark.parametrize("how", ["keyword", "dict", "list", "data first"])
def test_activations_reach_their_stage_as_keywords_in_dicts_in_lists_or_after_data(how):
    """Three stages, the middle one without parameters (on a device, it receives onto the device: the
    double caught it receiving into NumPy) and the last with one; a non-Tensor input (the factor) goes to
    every micro-batch as it is."""
    x, y = _batch()
    reference = _loss_of_handover(1, how)
    expected = _one_device_sums(_Fixed(reference, 0.5), reference.trainable_params(), x, y, 4)

    def body():
        _context(3)
        net = _loss_of_handover(3, how)
        pipe = PipelineCell(net, 4)
        assert pipe.last_step is None
        _, grads = value_and_grad(lambda a, b: pipe(a, b, 0.5), None, net.trainable_params())(x, y)
        return [backend.to_numpy(g.data) for g in grads]

    grads = mp.run_threads(3, body, timeout=TIMEOUT)
    np.testing.assert_array_equal(grads[0][0], expected[0])
    np.testing.assert_array_equal(grads[0][1], expected[1])
    np.testing.assert_array_equal(grads[2][2], expected[2])


class _LossOf(nn.Cell):
    def __init__(self, body):
        super().__init__()
        self.body = body
        self.ce = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def construct(self, x, y, factor):
        # (keywords: to a container of staged cells, and to a loss cell that runs where its inputs live)
        return self.ce(self.body(x, y, factor=factor), labels=y)


class _Fixed(nn.Cell):
    """``net(x, y, factor)`` with the factor fixed, for the one-device reference."""

    def __init__(self, net, factor):
        super().__init__()
        self.net, self.factor = net, factor

    def construct(self, x, y):
        return self.net(x, y, self.factor)


def _loss_of_handover(stages, how):
    return _LossOf(_Handover(stages, how))


class _Shares(nn.Cell):
    """Stage 0's output goes to two cells of stage 1: it crosses once."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.b2 = nn.Dense(6, 5), nn.Dense(5, 3), nn.Dense(5, 3)
        _set_weights([self.a, self.b, self.b2], 81)
        self.a.pipeline_stage, self.b.pipeline_stage, self.b2.pipeline_stage = 0, 1, 1
        self.add = ops.Add()

    def construct(self, x):
        h = self.a(x)
        return self.add(self.b(h), self.b2(h))


def test_an_output_taken_by_two_cells_of_the_next_stage_crosses_once():
    def body():
        _context(2)
        pipe = PipelineCell(_loss(_Shares()), 4)
        loss = float(pipe(*_batch()).asnumpy())
        return loss, pipe.last_step.count("send", "activation"), pipe.last_step.count("recv", "activation")

    (loss0, sent, _), (loss1, _, received) = mp.run_threads(2, body, timeout=TIMEOUT)
    assert loss0 == loss1 and sent == received == (4, 4 * 40)


# --- more refusals, word for word -----------------------------------------------------------------

class _Skipped(nn.Cell):
    """Stage 1 reads the data, not stage 0's output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Dense(6, 5), nn.Dense(6, 3)
        self.a.pipeline_stage, self.b.pipeline_stage = 0, 1

    def construct(self, x):
        self.a(x)
        return self.b(x)


def test_stages_that_exchange_nothing_are_refused_on_both_sides():
    def body():
        _context(2)
        try:
            PipelineCell(_loss(_Skipped()), 4)(*_batch())
        except PipelineError as exc:
            return str(exc)
        return None

    assert mp.run_threads(2, body, timeout=TIMEOUT) == [
        "stage 0 sent nothing to stage 1 in micro-batch 0: no cell of a later stage takes an output of stage 0",
        "stage 1 received nothing from stage 0 in micro-batch 0: none of its cells takes an output of the stage "
        "before it"]


class _ReadsParameters(nn.Cell):
    """The construct's own op reads ``which`` parameters: none of a staged cell, or two stages'."""

    def __init__(self, which):
        super().__init__()
        self.a, self.b = nn.Dense(6, 5), nn.Dense(5, 5)
        self.a.pipeline_stage, self.b.pipeline_stage = 0, 1
        self.add = ops.Add()
        self.loose = [Parameter(Tensor(np.ones(5, np.float32)), name="loose")]  # (a list: not the cell's)
        self.which = which

    def construct(self, x):
        # (first, so both ranks raise it before any message)
        if self.which == "loose":
            self.add(self.a.bias, self.loose[0])
        else:
            self.add(self.a.bias, self.b.bias)
        return self.b(self.a(x))


@pytest.mark.parametrize("which, message", [
    ("loose", "Add reads parameter 'loose', which belongs to no cell with a pipeline_stage"),
    ("two stages", "Add reads parameters of stages [0, 1]: an op runs on one stage"),
])
def test_an_op_of_the_construct_that_reads_parameters_of_no_stage_or_of_two_is_refused(which, message):
    def body():
        _context(2)
        try:
            PipelineCell(_loss(_ReadsParameters(which)), 4)(*_batch())
        except PipelineError as exc:
            return str(exc)
        return None

    assert mp.run_threads(2, body, timeout=TIMEOUT) == [message, message]


class _ScalesByAParameter(nn.Cell):
    """An op of the construct reads a stage-0 parameter and the data: it runs on stage 0."""

    def __init__(self, stages):
        super().__init__()
        self.a, self.b = _stages((0, stages - 1))
        self.scale = nn.Dense(6, 6)  # (its weight's first row scales the data)
        self.scale.pipeline_stage = 0
        _set_weights([self.scale], 91)
        self.mul = ops.Mul()

    def construct(self, x):
        return self.b(self.a(self.mul(x, self.scale.bias)))


def test_an_op_of_the_construct_reading_a_parameter_and_the_data_runs_on_the_parameters_stage():
    x, y = _batch()
    reference = _loss(_ScalesByAParameter(1))
    expected = _one_device_sums(reference, reference.trainable_params(), x, y, 4)

    def body():
        _context(2)
        net = _loss(_ScalesByAParameter(2))
        pipe = PipelineCell(net, 4)
        _, grads = value_and_grad(lambda a, b: pipe(a, b), None, net.trainable_params())(x, y)
        return [backend.to_numpy(g.data) for g in grads]

    grads0, grads1 = mp.run_threads(2, body, timeout=TIMEOUT)
    for k in (0, 1, 4, 5):  # a's and the scale's: stage 0
        np.testing.assert_array_equal(grads0[k], expected[k])
    for k in (2, 3):
        np.testing.assert_array_equal(grads1[k], expected[k])


def test_the_plans_refusals_name_the_cells_path_or_its_class_at_the_root():
    from minidl_parallel.pipeline.stages import StagePlan
    a, b = nn.Dense(4, 4), nn.Dense(4, 4)
    a.pipeline_stage, b.pipeline_stage = 0, 1
    norm_a, norm_b = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    norm_a.pipeline_stage, norm_b.pipeline_stage = 1, 0
    norm_b.moving_mean = norm_a.moving_mean
    holder = nn.Cell()
    holder.first, holder.second = norm_a, norm_b
    with pytest.raises(PipelineError) as info:
        StagePlan(holder, 2)
    assert str(info.value) == (f"parameter {norm_a.moving_mean.name!r} is held by 'first' (stage 1) and by 'second' "
                               f"(stage 0): only trainable parameters can be shared by stages (their gradients are "
                               f"summed)")
    root = nn.SequentialCell([a, b])
    root.pipeline_stage = 3
    with pytest.raises(PipelineError) as info:
        StagePlan(root, 2)
    assert str(info.value) == "cell 'SequentialCell' has pipeline_stage 3, but pipeline_stages is 2: stages are 0..1"
    norm = nn.BatchNorm1d(4)
    twice = nn.Cell()
    twice.first, twice.again = norm, norm  # one cell reached twice on one stage: not shared
    twice.pipeline_stage = 0
    plan = StagePlan(twice, 1)
    assert plan.shared == {} and plan.parameters == [[norm.gamma, norm.beta]]
    top = nn.SequentialCell([a, b])
    top.matmul_op = ops.MatMul().shard(((1, 1), (1, 2)))
    top[0].matmul.shard(((1, 1), (2, 1)))
    assert StagePlan(top, 2).sharded == ["matmul_op", "0.matmul"]  # (the stages' cells run cut: stage_cut.py)


def test_the_argument_checks_name_the_type_of_the_value():
    with pytest.raises(TypeError) as info:
        PipelineCell(_loss(nn.SequentialCell(_stages((0, 1)))), 2.0)
    assert str(info.value) == "PipelineCell: micro_size must be an int, got float: 2.0"
    with pytest.raises(TypeError) as info:
        pipeline_schedule(2, 2, 3)
    assert str(info.value) == "pipeline_schedule: scheduler must be one of ('1f1b', 'gpipe'), got 3 (int)"
    with pytest.raises(ValueError) as info:
        pipeline_schedule(2, 2, "interleaved")
    assert str(info.value) == "pipeline_schedule: scheduler must be one of ('1f1b', 'gpipe'), got 'interleaved'"
    with pytest.raises(TypeError) as info:
        pipeline_schedule(3, 3).actions("1")
    assert str(info.value) == "stage must be an int in 0..2, got '1' (str)"


def test_a_zero_dimensional_input_cannot_be_cut_into_micro_batches():
    def body():
        _context(2)
        PipelineCell(_loss(nn.SequentialCell(_stages((0, 1)))), 2)(Tensor(np.float32(1.0)), Tensor(np.int32(0)))

    with pytest.raises(ValueError) as info:
        mp.run_threads(2, body, timeout=TIMEOUT)
    assert str(info.value).endswith("PipelineCell: input 0 of shape () cannot be cut into micro_size=2 micro-batches "
                                    "along axis 0 (its length must be a multiple of 2)")


def test_one_stage_may_be_set_again_after_more():
    mp.reset_auto_parallel_context()
    try:
        mp.set_auto_parallel_context(pipeline_stages=2)
        mp.set_auto_parallel_context(pipeline_stages=1)
        assert mp.get_auto_parallel_context("pipeline_stages") == 1
    finally:
        mp.reset_auto_parallel_context()


def test_the_copies_of_shared_parameters_are_compared_in_the_first_step_only():
    x, y = _batch(rows=6, features=4, classes=4, dtype=np.float64)

    def body():
        _context(3, "gpipe")
        pipe = PipelineCell(_tied(3), 3)
        comm = mp.get_communicator()
        sent = []
        for _ in range(3):
            before = comm.sent_messages
            pipe(x, y)
            sent.append(comm.sent_messages - before)
        return sent

    # one message to each other stage holding a shared parameter, per parameter: stage 0 shares the
    # weight with stages 1 and 2 and the bias with stage 2; stage 1 the weight; stage 2 both
    for sent, compared in zip(mp.run_threads(3, body, timeout=TIMEOUT), (3, 2, 3)):
        assert sent[0] - sent[1] == compared and sent[1] == sent[2], sent


class _OneElementLoss(nn.Cell):
    """The last stage's loss has shape (1, 1)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _stages((0, 1))
        self.mean, self.mul = ops.ReduceMean(keep_dims=True), ops.Mul()

    def construct(self, x, y):
        h = self.b(self.a(x))
        return self.mean(self.mul(h, h))


def test_a_one_element_loss_of_any_shape_is_summed_over_the_micro_batches_as_a_scalar():
    x, y = _batch()
    want = sum(float(_OneElementLoss()(Tensor(x.data[k:k + 2]), Tensor(y.data[k:k + 2])).asnumpy().reshape(()))
               for k in (0, 2, 4, 6))

    def body():
        _context(2)
        loss = PipelineCell(_OneElementLoss(), 4)(x, y)
        return loss.shape, float(loss.asnumpy())

    for shape, loss in mp.run_threads(2, body, timeout=TIMEOUT):
        assert shape == () and abs(loss - want) <= 1e-6 * abs(want)


class _GlueAcrossTwoStages(nn.Cell):
    """A cell without parameters takes stage 0's and stage 2's outputs: it runs on stage 2, which
    may take stage 1's outputs only."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Dense(6, 3), nn.Dense(3, 3), nn.Dense(3, 3)
        self.a.pipeline_stage, self.b.pipeline_stage, self.c.pipeline_stage = 0, 1, 2
        self.join = _Join()

    def construct(self, x):
        h = self.a(x)
        join = self.join if self.join is not None else self.join_op
        return join(h, self.c(self.b(h)))


class _Join(nn.Cell):
    def __init__(self):
        super().__init__()
        self.add = ops.Add()

    def construct(self, h, g):
        return self.add(h, g)


@pytest.mark.parametrize("join, name", [("cell", "_Join cell"), ("op", "op Add")])
def test_a_cell_without_parameters_or_an_op_against_the_stage_order_is_named_by_its_class(join, name):
    def body():
        _context(3)
        net = _GlueAcrossTwoStages()
        if join == "op":
            net.join = None
            net.join_op = ops.Add()
        try:
            PipelineCell(_loss(net), 4)(*_batch())
        except Exception as exc:  # noqa: B902 - each rank's own error, compared below
            return type(exc).__name__, str(exc)
        return None

    out = mp.run_threads(3, body, timeout=TIMEOUT)
    message = (f"{name} (pipeline stage 2) takes an output of stage 0, but stage 2 takes the data and the outputs "
               "of stage 1 only: set pipeline_stage so that the stages follow the order of the forward")
    assert out[0] == ("PipelineError", message)  # (it raises before sending: the others are aborted)
    assert out[1][0] == out[2][0] == "CollectiveAborted"


def test_testing_the_output_of_another_stage_raises_naming_the_cell_that_made_it():
    from minidl_parallel.pipeline.stage_forward import Remote
    with pytest.raises(PipelineError) as info:
        bool(Remote(1, "cell 'a' (Dense)"))
    assert str(info.value) == ("the construct tests the output of cell 'a' (Dense), which lives on pipeline stage 1 "
                               "(another rank): move this code into a cell of that stage")
