"""explain(): what tensor parallelism does to a network, operator by operator.

In the spirit of MindSpore's saved IR: for each operator, its strategy (and where it came
from: ``.shard()``, propagation or the data-parallel default), the layout each input has and
the layout the operator needs, the redistribution steps between them with the bytes each rank
sends, and the output layout.

Example (8 ranks, MindSpore's quickstart):
    >>> print(minidl_parallel.explain(net, x))
    MatMul (dense1.matmul)  strategy ((2, 4), (4, 1)) [shard]  device matrix [2, 4]
      in 0  (16, 32)  (a,) on [8] -> (a, b) on [2, 4]
            alltoall over b: dim 0 -> dim 1 ...
      in 1  (32, 16)  parameter placed as (b, -) on [2, 4]: block (8, 16)
      out   (16, 16)  (a, -) on [2, 4] +sum(b): block (8, 16)
"""
import contextlib
import os
import threading
import weakref

from minidl import backend
from minidl.tensor import Tensor, no_grad

__all__ = ["explain", "recording", "Recorder", "saving_plan"]

_tls = threading.local()


def recording():
    """The Recorder collecting on this rank (thread), or None."""
    return getattr(_tls, "recorder", None)


def _indent(text, prefix):
    return "\n".join(prefix + line for line in text.splitlines())


class Recorder:
    """Collects one text block per operator call."""

    def __init__(self):
        self.blocks = []

    def operator(self, who, strategy, origin, sharding, moves, out_shape, out_local):
        lines = [f"{who}  strategy {strategy} [{origin}]  device matrix {list(sharding.device_matrix)}"]
        for k, (spec, have, need, plan) in enumerate(moves):
            kind = "parameter" if spec.is_parameter else "tensor"
            if have is None:
                lines.append(f"  in {k}  {spec.shape}  {kind} placed as {need}: block {need.local_shape(spec.shape)}")
                continue
            if plan is None or not plan.moves_data:
                lines.append(f"  in {k}  {spec.shape}  {need}: no communication")
                continue
            lines.append(f"  in {k}  {spec.shape}  {have} -> {need}: {plan.num_collectives} collective(s), "
                         f"{plan.bytes_per_rank} B/rank")
            # Relabels only rename device axes between matrices ([2, 4, 1] -> [2, 4]): not worth a line.
            steps = [str(step) for step in plan.steps if step.kind != "relabel"]
            lines.append(_indent("\n".join(steps), "        "))
        lines.append(f"  out   {out_shape}  {sharding.out_layout}: block {out_local}")
        self.blocks.append("\n".join(lines))

    def decomposed(self, who, strategy, origin, description):
        self.blocks.append(f"{who}  strategy {strategy} [{origin}]  runs as: {description or 'a composition'}")

    def text(self):
        return "\n".join(self.blocks)


def explain(net, *inputs, rank0_only=True):
    """Runs ``net(*inputs)`` once (without gradients) and returns the per-operator plan as text.

    Every rank must call it (the forward communicates). Parameters take their layouts as
    they would in the first training step. With ``rank0_only`` the text is printed on rank 0
    only; it is returned on every rank.
    """
    from .. import context
    recorder = Recorder()
    previous = recording()
    _tls.recorder = recorder
    try:
        with no_grad():
            net(*inputs)
    finally:
        _tls.recorder = previous
    text = recorder.text()
    if not rank0_only or context.get_rank() == 0:
        print(text)
    return text


@contextlib.contextmanager
def saving_plan(cell, args, rank, settings):
    """Around the outermost call of ``cell``: with ``set_context(save_graphs=True)``, records the plan
    of its first call (and of each new input signature) and writes it to
    ``save_graphs_path/rank_<rank>/``, as MindSpore saves its IR when a graph is first compiled.

    The context is read here, at the moment of use: setting save_graphs between steps takes effect.
    """
    if not backend.get_context("save_graphs") or recording() is not None:
        yield
        return
    signature = tuple((tuple(a.shape), str(a.dtype)) for a in args if isinstance(a, Tensor))
    saved = _tls.__dict__.setdefault("saved", weakref.WeakKeyDictionary())  # per rank (thread)
    seen = saved.setdefault(cell, set())
    if signature in seen:
        yield
        return
    recorder = _tls.recorder = Recorder()
    try:
        yield
    finally:
        _tls.recorder = None
    seen.add(signature)
    _tls.count = getattr(_tls, "count", 0) + 1
    folder = os.path.join(backend.get_context("save_graphs_path"), f"rank_{rank}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"parallel_plan_{_tls.count:02d}_{type(cell).__name__}.txt")
    header = (f"# {type(cell).__name__} on rank {rank}: {settings['parallel_mode']}, inputs "
              f"{', '.join(f'{shape} {dtype}' for shape, dtype in signature)}\n")
    with open(path, "w") as f:
        f.write(header + recorder.text() + "\n")
