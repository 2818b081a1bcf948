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
are done. oneDNN runs its primitives on its own OpenMP threads, as many as
``onednn.set_num_threads`` says (minidl.set_num_threads calls it).

Bound: oneDNN blocks and orders the sums over channels and kernel offsets otherwise than the
reference's one GEMM: float32 rounding, as conv.py's routes (the same ``BOUND``). float64,
grouped convolutions, calls from inside an intra-op thread, and a process forked after oneDNN
ran (onednn.py) take conv.py's routes.
"""
import threading
from collections import OrderedDict

import numpy

from . import threads as intra_op
from ...ops.conv import Conv2D
from ...tensor import is_grad_enabled
from .. import Kernel, declare_option, get_option, register
from . import onednn as dnnl
from .conv import BOUND, conv_cases

__all__ = ["Conv2DOneDNN", "clear_plans"]

declare_option("onednn", True, "Conv2D on oneDNN's kernels where the onednn extra is installed (float32, "
                               "ungrouped); False: conv.py's tap and im2col routes")

_MAX_PLANS = 256  # a model with ever new input sizes would keep making plans: keep the latest only


class _Plan:
    """The oneDNN primitives and reorders of one convolution geometry (module docstring)."""

    def __init__(self, x_shape, w_shape, y_shape, stride, dilation, pads):
        pt, pb, pl, pr = pads
        geometry = (dnnl.dims(stride), dnnl.dims(d - 1 for d in dilation), dnnl.dims((pt, pl)), dnnl.dims((pb, pr)))
        self.plain = {"x": dnnl.Desc(x_shape), "w": dnnl.Desc(w_shape), "y": dnnl.Desc(y_shape)}
        self.shapes = {"x": x_shape, "w": w_shape, "y": y_shape}
        self._free = [dnnl.Desc(s, dnnl.TAG_ANY) for s in (x_shape, w_shape, y_shape)]  # "any": oneDNN chooses
        free = [d.handle for d in self._free]
        fwd = dnnl.primitive_desc("dnnl_convolution_forward_primitive_desc_create", dnnl.FORWARD_TRAINING,
                                  dnnl.CONVOLUTION_DIRECT, free[0], free[1], None, free[2], *geometry, None)
        self.fwd = dnnl.Primitive.chosen(fwd, {dnnl.ARG_SRC: dnnl.SRC_MD, dnnl.ARG_WEIGHTS: dnnl.WEIGHTS_MD,
                                               dnnl.ARG_DST: dnnl.DST_MD})
        # The backward descriptors are made with the forward one as a hint: they keep it alive.
        data = dnnl.primitive_desc("dnnl_convolution_backward_data_primitive_desc_create", dnnl.CONVOLUTION_DIRECT,
                                   free[0], free[1], free[2], *geometry, fwd.handle, None, keep=[fwd])
        self.data = dnnl.Primitive.chosen(data, {dnnl.ARG_DIFF_SRC: dnnl.DIFF_SRC_MD, dnnl.ARG_WEIGHTS: dnnl.WEIGHTS_MD,
                                                 dnnl.ARG_DIFF_DST: dnnl.DIFF_DST_MD})
        weights = dnnl.primitive_desc("dnnl_convolution_backward_weights_primitive_desc_create",
                                      dnnl.CONVOLUTION_DIRECT, free[0], free[1], None, free[2], *geometry, fwd.handle,
                                      None, keep=[fwd])
        self.weights = dnnl.Primitive.chosen(weights, {dnnl.ARG_SRC: dnnl.SRC_MD,
                                                       dnnl.ARG_DIFF_WEIGHTS: dnnl.DIFF_WEIGHTS_MD,
                                                       dnnl.ARG_DIFF_DST: dnnl.DIFF_DST_MD})
        self._reorders = {}

    def into(self, name, array, desc):
        """``array`` (plain NCHW or OIHW, C-contiguous) laid out as ``desc``: itself where they agree."""
        if desc == self.plain[name]:
            return array
        return self._reorder(self.plain[name], desc)(array, dnnl.buffer(desc))

    def out_of(self, name, array, desc):
        """An array laid out as ``desc`` back in plain NCHW or OIHW."""
        if desc == self.plain[name]:
            return array.view(numpy.float32).reshape(self.shapes[name])
        out = numpy.empty(self.shapes[name], dtype=numpy.float32)
        self._reorder(desc, self.plain[name])(array, out)
        return out

    def _reorder(self, src, dst):
        key = (id(src), id(dst))
        if key not in self._reorders:
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


def _plan(node, x_shape, w_shape):
    (oh, ow), pads = node.geometry(x_shape)

    def make():
        try:
            return _Plan(x_shape, w_shape, (x_shape[0], w_shape[0], oh, ow), node.stride, node.dilation, pads)
        except dnnl.Error:
            return None  # no oneDNN primitive for this geometry: conv.py's routes take it
    return _plans.get((x_shape, w_shape, node.stride, node.dilation, pads), make)


@register
class Conv2DOneDNN(Kernel):
    op, backend = Conv2D, "numpy"
    bound = {"float32": BOUND["float32"]}
    available, extra = dnnl.installed(), "onednn"
    priority = 1  # asked before conv.py's Conv2DRoutes, which takes what this one does not

    def applies(self, node, x, w):
        return (x.dtype == w.dtype == numpy.float32 and x.ndim == 4 and w.ndim == 4 and node.group == 1
                and x.shape[1] == w.shape[1] and min(x.shape) > 0 and get_option("onednn")
                and not intra_op.in_worker() and dnnl.available() and _plan(node, x.shape, w.shape) is not None)

    def forward(self, node, x, w):
        node._check(x, w)
        plan = _plan(node, x.shape, w.shape)
        x, w = numpy.ascontiguousarray(x), numpy.ascontiguousarray(w)
        fwd = plan.fwd.descs
        xb = plan.into("x", x, fwd[dnnl.ARG_SRC])
        wb = plan.into("w", w, fwd[dnnl.ARG_WEIGHTS])
        yb = dnnl.buffer(fwd[dnnl.ARG_DST])
        plan.fwd({dnnl.ARG_SRC: xb, dnnl.ARG_WEIGHTS: wb, dnnl.ARG_DST: yb})
        if is_grad_enabled():
            node.plan, node.x, node.w, node.xb, node.wb = plan, x, w, xb, wb
        return plan.out_of("y", yb, fwd[dnnl.ARG_DST])

    def backward(self, node, gy):
        plan, (need_x, need_w) = node.plan, node.needs_grad
        gy = numpy.ascontiguousarray(gy)
        fwd, data, weights = plan.fwd.descs, plan.data.descs, plan.weights.descs
        gx = gw = gyb = None
        if need_x:
            gyb = plan.into("y", gy, data[dnnl.ARG_DIFF_DST])
            wb = node.wb if data[dnnl.ARG_WEIGHTS] == fwd[dnnl.ARG_WEIGHTS] else plan.into("w", node.w, data[dnnl.ARG_WEIGHTS])
            gxb = dnnl.buffer(data[dnnl.ARG_DIFF_SRC])
            plan.data({dnnl.ARG_DIFF_DST: gyb, dnnl.ARG_WEIGHTS: wb, dnnl.ARG_DIFF_SRC: gxb})
            gx = plan.out_of("x", gxb, data[dnnl.ARG_DIFF_SRC])
        if need_w:
            if gyb is None or weights[dnnl.ARG_DIFF_DST] != data[dnnl.ARG_DIFF_DST]:
                gyb = plan.into("y", gy, weights[dnnl.ARG_DIFF_DST])
            xb = node.xb if weights[dnnl.ARG_SRC] == fwd[dnnl.ARG_SRC] else plan.into("x", node.x, weights[dnnl.ARG_SRC])
            gwb = dnnl.buffer(weights[dnnl.ARG_DIFF_WEIGHTS])
            plan.weights({dnnl.ARG_SRC: xb, dnnl.ARG_DIFF_DST: gyb, dnnl.ARG_DIFF_WEIGHTS: gwb})
            gw = plan.out_of("w", gwb, weights[dnnl.ARG_DIFF_WEIGHTS])
        return gx, gw

    def cases(self):
        return [(make, arrays) for make, arrays in conv_cases(numpy.random.default_rng(12))
                if arrays[0].dtype == numpy.float32 and make().group == 1]
