"""The op lists of mixed-precision levels O1 and "auto": MindSpore 2.10's (mindspore/train/amp.py),
mapped onto minidl's primitives and cells.

Each list names what minidl has; MindSpore's entries with no minidl counterpart (Conv3D, the
RNN cells, Einsum, most of the auto black list's losses, ...) are left out, and docs/parallel.md
("Mixed precision") maps every entry. A subclass of a listed op or cell is treated as it
(minidl_parallel's SyncBatchNormOp as BatchNorm), as O2's black list in auto.py; MindSpore
matches the exact type (O1) or the primitive's name ("auto").

minidl's fused ops stand for the ops they fuse (``PARTS``): DenseReLU is Dense then ReLU,
BatchNormReLU is BatchNorm, the residual's Add, then ReLU. ``ops.Dense`` is MindSpore's own
``ops.Dense`` primitive and is listed as such; ``nn.Dense`` calls it where MindSpore's layer
calls MatMul then BiasAdd, so inside an ``nn.Dense`` it stands for those two (auto.py gives the
layer's calls that policy).
"""
from .. import nn, ops

# O1 (MindSpore's AMP_WHITE_LIST): these ops run in the low type, their float inputs cast to it
# and their float outputs cast back to float32; every other op runs on the types it is given.
O1_WHITE_OPS = (ops.MatMul, ops.BatchMatMul, ops.Conv2D, ops.Conv2DTranspose, ops.ReLU)
# ... and every op these cells run (their construct and the cells it calls: Dense's activation)
# runs so, as MindSpore's rewrite casts every primitive call inside a white-listed cell.
O1_WHITE_CELLS = (nn.Dense, nn.Conv2d, nn.Conv2dTranspose)

# "auto" (AMP_AUTO_WHITE_LIST): float inputs cast to the low type, the output left in it.
AUTO_WHITE_OPS = (ops.MatMul, ops.BatchMatMul, ops.Conv2D, ops.Conv2DTranspose, ops.Dense)
# (AMP_AUTO_BLACK_LIST): float inputs cast to float32 (float64 too, as MindSpore's).
AUTO_BLACK_OPS = (ops.Pow, ops.Exp, ops.Log, ops.LayerNorm, ops.BatchNorm, ops.GroupNorm, ops.Softmax,
                  ops.LogSoftmax, ops.CumSum, ops.NLLLoss)
# (the promote list in auto_mixed_precision's docstring): float inputs cast to the widest float
# type among them. Every op on no list runs on the types it is given.
AUTO_PROMOTE_OPS = (ops.BiasAdd, ops.Concat)

# minidl's fused ops, as the ops they fuse (in order): each is cast as one op when its parts
# would all be cast alike, and run as its parts otherwise.
PARTS = {
    ops.DenseReLU: (ops.Dense, ops.ReLU),
    ops.BatchNormReLU: (ops.BatchNorm, ops.Add, ops.ReLU),
}

# Arguments an op writes in place (BatchNorm's moving mean and variance, in training): never
# cast, since the op would update a cast copy and the statistics would be lost.
IN_PLACE_ARGS = {ops.BatchNorm: (3, 4)}
