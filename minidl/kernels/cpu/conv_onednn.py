"""Conv2D on oneDNN's direct convolution kernels, where the ``onednn`` extra is installed.

The tap GEMMs of conv.py sum over 16-64 input channels per BLAS call, a shape BLAS runs far
below its peak, and pay a padding copy in and a transposing copy out per chunk. oneDNN's direct
kernels (what PyTorch's CPU convolutions run) keep each output block in registers across all
kernel offsets and input channels, on activations in its blocked layout (16 channels
innermost). Here each call reorders x and w into the layouts oneDNN chose, runs the primitive,
and reorders y back to NCHW; backward runs its data and weights primitives the same way, from
the blocked x and w the forward kept. Measured per ResNet-20 shape against conv.py's routes
and PyTorch: docs/performance.md.

One plan per call geometry (shapes, stride, dilation, pads): the primitive descriptors,
primitives and reorders, made at the first call of that geometry (a few ms) and kept for the
latest ``_MAX_PLANS`` geometries (least recently used evicted; :func:`clear_plans` drops them
all). An evicted plan's oneDNN objects are destroyed when the last holder lets go of it: at once,
or when the nodes recorded for backward with it (and a call running it on another thread rank)
are done.

Threads: a batch is cut into one chunk of images per intra-op thread (threads.py: as many as
``minidl.set_num_threads`` says), and each chunk runs on its own thread through primitives made
for one OpenMP thread; the weight gradient is the chunks' partial gradients added in chunk order.
GNU OpenMP then starts no team, so no thread of its own spins on the core the next op needs (by
default it spins about 0.1-0.3 ms after each primitive; docs/performance.md has the step times
both ways). A batch smaller than the thread count runs one chunk per image, on the thread count
divided by the chunks (a single image on all of them): those primitives use GNU OpenMP's team.

Bound: oneDNN blocks and orders the sums over channels and kernel offsets otherwise than the
reference's one GEMM: float32 rounding, as conv.py's routes (the same ``BOUND``). float64,
grouped convolutions, calls from inside an intra-op thread, and a process forked after oneDNN
ran (onednn.py) take conv.py's routes.
"""
import threading
from collections import OrderedDict

import numpy

from . import buffers, threads as intra_op
from ...ops.conv import Conv2D
from ...tensor import is_grad_enabled
from .. import Kernel, declare_option, get_option, register
from . import onednn as dnnl
from .conv import BOUND, conv_cases

__all__ = ["Conv2DOneDNN", "clear_plans"]

declare_option("onednn", True, "Conv2D on oneDNN's kernels where the onednn extra is installed (float32, "
                               "ungrouped); False: conv.py's tap and im2col routes")

declare_option("onednn_chunks", True, "oneDNN's convolutions as one chunk of the batch per intra-op thread, each on "
                                      "one OpenMP thread; False: the whole batch on GNU OpenMP's team of that many "
                                      "threads (its threads spin after each primitive)")

_MAX_PLANS = 256  # a model with ever new input sizes would keep making plans: keep the latest only


class _Plan:
    """The oneDNN primitives and reorders of one convolution geometry (module docstring), made for
    ``threads`` OpenMP threads."""

    def __init__(self, x_shape, w_shape, y_shape, stride, dilation, pads, threads):
        self.threads = threads
        with dnnl.openmp_threads(threads):
            self._make(x_shape, w_shape, y_shape, stride, dilation, pads)

    def _make(self, x_shape, w_shape, y_shape, stride, dilation, pads):
        pt, pb, pl, pr = pads
        geometry = (dnnl.dims(stride), dnnl.dims(d - 1 for d in dilation), dnnl.dims((pt, pl)), dnnl.dims((pb, pr)))
        self.plain = {"x": dnnl.Desc(x_shape), "w": dnnl.Desc(w_shape), "y": dnnl.Desc(y_shape)}
        self.shapes = {"x": x_shape, "w": w_shape, "y": y_shape}
        self._free = [dnnl.Desc(s, dnnl.TAG_ANY) for s in (x_shape, w_shape, y_shape)]  # "any": oneDNN chooses
        free = [d.handle for d in self._free]
        fwd = dnnl.primitive_desc("dnnl_convolution_forward_primitive_desc_create", dnnl.FORWARD_TRAINING,
                                  dnnl.CONVOLUTION_DIRECT, free[0], free[1], None, free[2], *geometry)
        self.fwd = dnnl.Primitive.chosen(fwd, {dnnl.ARG_SRC: dnnl.SRC_MD, dnnl.ARG_WEIGHTS: dnnl.WEIGHTS_MD,
                                               dnnl.ARG_DST: dnnl.DST_MD})
        # The backward descriptors are made with the forward one as a hint: they keep it alive.
        data = dnnl.primitive_desc("dnnl_convolution_backward_data_primitive_desc_create", dnnl.CONVOLUTION_DIRECT,
                                   free[0], free[1], free[2], *geometry, fwd.handle, keep=[fwd])
        self.data = dnnl.Primitive.chosen(data, {dnnl.ARG_DIFF_SRC: dnnl.DIFF_SRC_MD, dnnl.ARG_WEIGHTS: dnnl.WEIGHTS_MD,
                                                 dnnl.ARG_DIFF_DST: dnnl.DIFF_DST_MD})
        weights = dnnl.primitive_desc("dnnl_convolution_backward_weights_primitive_desc_create",
                                      dnnl.CONVOLUTION_DIRECT, free[0], free[1], None, free[2], *geometry, fwd.handle,
                                      keep=[fwd])
        self.weights = dnnl.Primitive.chosen(weights, {dnnl.ARG_SRC: dnnl.SRC_MD,
                                                       dnnl.ARG_DIFF_WEIGHTS: dnnl.DIFF_WEIGHTS_MD,
                                                       dnnl.ARG_DIFF_DST: dnnl.DIFF_DST_MD})
        self._reorders = {}
        self._reorders_lock = threading.Lock()  # chunks on several threads make a new reorder at once

    def into(self, name, array, desc, slot=0):
        """``array`` (plain NCHW or OIHW, C-contiguous) laid out as ``desc``: itself where they agree."""
        if desc == self.plain[name]:
            return array
        return self._reorder(self.plain[name], desc)(array, dnnl.buffer(desc), slot)

    def out_of(self, name, array, desc, slot=0, out=None):
        """An array laid out as ``desc`` back in plain NCHW or OIHW, written into ``out`` where given."""
        if out is None:
            if desc == self.plain[name]:
                return array.view(numpy.float32).reshape(self.shapes[name])
            out = buffers.empty(self.shapes[name], numpy.float32)
        if desc == self.plain[name]:
            out[...] = array.view(numpy.float32).reshape(self.shapes[name])
        else:
            self._reorder(desc, self.plain[name])(array, out, slot)
        return out

    def _reorder(self, src, dst):
        key = (id(src), id(dst))
        with self._reorders_lock:
            if key not in self._reorders:
                with dnnl.openmp_threads(self.threads):
                    self._reorders[key] = dnnl.Reorder(src, dst)
            return self._reorders[key]


class _Plans:
    """The plans of the latest ``size`` geometries, least recently used evicted first. Evicting
    drops the cache's reference only: the plan's oneDNN objects go when its last holder lets go."""

    def __init__(self, size):
        self.size, self._plans = size, OrderedDict()
        self._lock = threading.Lock()  # thread ranks look up and make plans at once

    def get(self, key, make):
        """The plan of ``key``, made by ``make()`` where there is none."""
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
                return self._plans[key]
            plan = self._plans[key] = make()
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
            return plan

    def clear(self):
        with self._lock:
            self._plans.clear()

    def __len__(self):
        return len(self._plans)

    def values(self):
        with self._lock:
            return list(self._plans.values())


_plans = _Plans(_MAX_PLANS)  # call geometry -> _Plan, or None where oneDNN has no primitive for it


def clear_plans():
    """Drops every kept plan (nodes recorded for backward keep theirs until they are done)."""
    _plans.clear()


def _plan(node, x_shape, w_shape, threads):
    (oh, ow), pads = node.geometry(x_shape)

    def make():
        try:
            return _Plan(x_shape, w_shape, (x_shape[0], w_shape[0], oh, ow), node.stride, node.dilation, pads, threads)
        except dnnl.Error:
            return None  # no oneDNN primitive for this geometry: conv.py's routes take it
    return _plans.get((x_shape, w_shape, node.stride, node.dilation, pads, threads), make)


class _Chunks:
    """A batch of ``x_shape[0]`` images cut into one chunk per intra-op thread (fewer where there
    are fewer images), each chunk's plan made for ``threads // chunks`` OpenMP threads: one,
    unless the batch is smaller than the thread count (module docstring)."""

    def __init__(self, node, x_shape, w_shape):
        threads = intra_op.get_num_threads()
        n = min(x_shape[0], threads) if get_option("onednn_chunks") else 1
        self.bounds = intra_op.split(x_shape[0], -(-x_shape[0] // n), n)
        self.plans = [_plan(node, (b - a,) + tuple(x_shape[1:]), w_shape, threads // n) for a, b in self.bounds]

    def usable(self):
        return all(plan is not None for plan in self.plans)

    def run(self, fn):
        """[fn(k, plan, slice of the batch) for each chunk k], on the intra-op threads."""
        return intra_op.parallel_map(lambda k: fn(k, self.plans[k], slice(*self.bounds[k])), len(self.bounds),
                                     calls_blas=False)

    def per_plan(self, fn):
        """{id(plan): fn(plan)} once per distinct plan (chunks of one size share theirs)."""
        return {id(plan): fn(plan) for plan in self.plans}


@register
class Conv2DOneDNN(Kernel):
    op, backend = Conv2D, "numpy"
    bound = {"float32": BOUND["float32"]}
    available, extra = dnnl.installed(), "onednn"
    priority = 1  # asked before conv.py's Conv2DRoutes, which takes what this one does not

    def applies(self, node, x, w):
        return (x.dtype == w.dtype == numpy.float32 and x.ndim == 4 and w.ndim == 4 and node.group == 1
                and x.shape[1] == w.shape[1] and min(x.shape) > 0 and get_option("onednn")
                and not intra_op.in_worker() and dnnl.available() and _Chunks(node, x.shape, w.shape).usable())

    def forward(self, node, x, w):
        node._check(x, w)
        chunks = _Chunks(node, x.shape, w.shape)
        x, w = numpy.ascontiguousarray(x), numpy.ascontiguousarray(w)
        wbs = chunks.per_plan(lambda plan: plan.into("w", w, plan.fwd.descs[dnnl.ARG_WEIGHTS]))
        y = buffers.empty((x.shape[0],) + chunks.plans[0].shapes["y"][1:], numpy.float32)

        def run(k, plan, rows):
            fwd = plan.fwd.descs
            xb = plan.into("x", x[rows], fwd[dnnl.ARG_SRC], k)
            yb = dnnl.buffer(fwd[dnnl.ARG_DST])
            plan.fwd({dnnl.ARG_SRC: xb, dnnl.ARG_WEIGHTS: wbs[id(plan)], dnnl.ARG_DST: yb}, k)
            plan.out_of("y", yb, fwd[dnnl.ARG_DST], k, out=y[rows])
            return xb
        xbs = chunks.run(run)
        if is_grad_enabled():
            node.chunks, node.x, node.w, node.xbs, node.wbs = chunks, x, w, xbs, wbs
        return y

    def backward(self, node, gy):
        chunks, (need_x, need_w) = node.chunks, node.needs_grad
        gy = numpy.ascontiguousarray(gy)
        gx = buffers.empty(node.x.shape, numpy.float32) if need_x else None

        def w_for_data(plan):  # the weights as the data primitive wants them: the forward's where they agree
            fwd, data = plan.fwd.descs, plan.data.descs
            return node.wbs[id(plan)] if data[dnnl.ARG_WEIGHTS] == fwd[dnnl.ARG_WEIGHTS] else \
                plan.into("w", node.w, data[dnnl.ARG_WEIGHTS])
        wbs = chunks.per_plan(w_for_data) if need_x else None

        def run(k, plan, rows):
            fwd, data, weights = plan.fwd.descs, plan.data.descs, plan.weights.descs
            gyb = gwb = None
            if need_x:
                gyb = plan.into("y", gy[rows], data[dnnl.ARG_DIFF_DST], k)
                gxb = dnnl.buffer(data[dnnl.ARG_DIFF_SRC])
                plan.data({dnnl.ARG_DIFF_DST: gyb, dnnl.ARG_WEIGHTS: wbs[id(plan)], dnnl.ARG_DIFF_SRC: gxb}, k)
                plan.out_of("x", gxb, data[dnnl.ARG_DIFF_SRC], k, out=gx[rows])
            if need_w:
                if gyb is None or weights[dnnl.ARG_DIFF_DST] != data[dnnl.ARG_DIFF_DST]:
                    gyb = plan.into("y", gy[rows], weights[dnnl.ARG_DIFF_DST], k)
                xb = node.xbs[k] if weights[dnnl.ARG_SRC] == fwd[dnnl.ARG_SRC] else \
                    plan.into("x", node.x[rows], weights[dnnl.ARG_SRC], k)
                gwb = dnnl.buffer(weights[dnnl.ARG_DIFF_WEIGHTS])
                plan.weights({dnnl.ARG_SRC: xb, dnnl.ARG_DIFF_DST: gyb, dnnl.ARG_DIFF_WEIGHTS: gwb}, k)
                gwb = plan.out_of("w", gwb, weights[dnnl.ARG_DIFF_WEIGHTS], k)
            return gwb
        parts = chunks.run(run)
        # Each chunk's weight gradient, added in chunk order: the sum does not depend on which
        # thread finished first.
        gw = intra_op.sum_in_order(parts) if need_w else None
        return gx, gw

    def cases(self):
        return [(make, arrays) for make, arrays in conv_cases(numpy.random.default_rng(12))
                if arrays[0].dtype == numpy.float32 and make().group == 1]
