"""How the GPU check judges what its stages produced: the GPU-vs-CPU training comparison
(its tolerances, measured on the spot for float32), the device-pinned suite and the example."""
import re

import numpy

# The GPU-vs-CPU training comparison (judge_training). ResNet-20 trains TRAIN_STEPS Momentum
# steps (learning rate TRAIN_LR) from seed 0 on the same batches, on each device in float32
# and in float64, and two differences are taken between runs (see training_diffs): the
# largest per-tensor relative difference (a bug confined to one small tensor shows there) and
# the relative L2 difference of all parameters together (a stable summary).
#
# float32: even two correct runs differ far beyond the last bit here. BatchNorm's beta
# gradient is a sum of many terms that nearly cancel, so float32 resolves it only to about a
# per cent (measured on the CPU, float32 vs float64, 4 seeds, batch 16: 0.002-0.016 per
# tensor, at the BatchNorm betas, and 1.6e-7-1.7e-6 for all parameters; PyTorch's float32 vs
# float64 on the same network and steps: 0.015-0.026 and 2.5e-6-1.2e-5). So the float32
# tolerance is measured on the spot: the CPU float32 run's difference from the CPU float64 run
# is this problem's float32 resolution, and the GPU float32 run may differ from the CPU float32
# run by at most TRAIN_FACTOR times it. A stand-in for the GPU's other summation order (the
# CPU with 1 intra-op thread instead of 2) differed by up to 6.3x the resolution (per tensor;
# 5x for all parameters) over those seeds, hence 50. TF32 or half-precision accumulation
# (rounding 1e3-1e4 times float32's) still fails it.
#
# float64: TRAIN_TOL64 fixed. Rounding-order differences (cuBLAS vs OpenBLAS, CuPy's
# reductions vs NumPy's) are float64 epsilons (2.2e-16) times the same amplification that
# turns float32's 6e-8 into the measured resolution (at most ~3e5), so they stay below 1e-10
# (the 1-thread stand-in: 3.5e-15); a wrong kernel, a race or a lost update changes results by
# far more than 1e-8. This is the sharp check of the GPU's arithmetic.
TRAIN_STEPS, TRAIN_BATCH, TRAIN_LR = 5, 16, 0.001
TRAIN_FACTOR = 50.0
TRAIN_FLOOR = 64 * float(numpy.finfo(numpy.float32).eps)  # a tolerance never below 64 float32 ulps
TRAIN_TOL64 = 1e-8


def training_diffs(got, want):
    """How far run ``got`` is from run ``want``: {"max_rel", "where", "global_rel"}.

    Both map names to arrays or floats (parameters, and the losses as ``loss/<step>``).
    ``max_rel`` is the largest per-entry ``max|got - want| / max|want|`` (each tensor scaled by
    its own largest value, so elements near zero do not inflate it), at ``where``;
    ``global_rel`` is ``||got - want|| / ||want||`` over all entries but the losses. Missing
    names, changed shapes or non-finite values make both ``inf``.
    """
    inf = {"max_rel": float("inf"), "global_rel": float("inf")}
    if set(got) != set(want):
        return dict(inf, where=f"names differ: {sorted(set(got) ^ set(want))}")
    worst, where, num, den = 0.0, None, 0.0, 0.0
    for key in want:
        g = numpy.asarray(got[key], dtype=numpy.float64)
        w = numpy.asarray(want[key], dtype=numpy.float64)
        if g.shape != w.shape:
            return dict(inf, where=f"{key}: shape {g.shape} != {w.shape}")
        if not (numpy.isfinite(g).all() and numpy.isfinite(w).all()):
            return dict(inf, where=f"{key}: not finite")
        if g.size == 0:
            continue
        scale = float(numpy.max(numpy.abs(w)))
        diff = float(numpy.max(numpy.abs(g - w)))
        rel = diff / scale if scale > 0 else diff
        if rel > worst or where is None:
            worst, where = rel, key
        if not key.startswith("loss/"):
            num += float(numpy.sum((g - w) ** 2))
            den += float(numpy.sum(w ** 2))
    glob = (num ** 0.5 / den ** 0.5) if den > 0 else num ** 0.5
    return {"max_rel": worst, "where": where, "global_rel": glob}


def float32_tolerance(cpu32_vs_cpu64):
    """The accepted GPU-vs-CPU float32 difference: TRAIN_FACTOR times the measured float32
    resolution (at least TRAIN_FLOOR); nan when the measurement itself is not finite."""
    if not numpy.isfinite(cpu32_vs_cpu64):
        return float("nan")  # the CPU reference is broken: nothing can be accepted
    return max(TRAIN_FACTOR * cpu32_vs_cpu64, TRAIN_FLOOR)


def judge_training(runs):
    """Compares GPU and CPU training runs; returns (passed, lines, numbers).

    ``runs`` maps (device, dtype) -> {name: values} for devices "CPU"/"GPU" and dtypes
    "float32"/"float64". GPU float32 is compared with CPU float32 against
    :func:`float32_tolerance` of the CPU's float32-vs-float64 difference, GPU float64 with CPU
    float64 against TRAIN_TOL64; both metrics of :func:`training_diffs` must be within.
    """
    ref = training_diffs(runs[("CPU", "float32")], runs[("CPU", "float64")])
    lines = [f"CPU float32 vs CPU float64 (float32's resolution here): per-tensor max rel {ref['max_rel']:.3g} "
             f"at {ref['where']}, all-parameter rel {ref['global_rel']:.3g}"]
    numbers = {"cpu32_vs_cpu64_max_rel": ref["max_rel"], "cpu32_vs_cpu64_global_rel": ref["global_rel"]}
    ok = True
    for dtype in ("float32", "float64"):
        d = training_diffs(runs[("GPU", dtype)], runs[("CPU", dtype)])
        verdicts = []
        for metric in ("max_rel", "global_rel"):
            tol = float32_tolerance(ref[metric]) if dtype == "float32" else TRAIN_TOL64
            good = bool(numpy.isfinite(d[metric]) and numpy.isfinite(tol) and d[metric] <= tol)
            ok = ok and good
            numbers[f"gpu_vs_cpu_{dtype}_{metric}"], numbers[f"tol_{dtype}_{metric}"] = d[metric], tol
            verdicts.append(f"{'per-tensor max rel' if metric == 'max_rel' else 'all-parameter rel'} "
                            f"{d[metric]:.3g} (tolerance {tol:.3g}){'' if good else ' TOO LARGE'}")
        lines.append(f"GPU vs CPU {dtype}: " + ", ".join(verdicts) + f"; largest at {d['where']}")
    return ok, lines, numbers


def judge_suite(rc, output):
    lines = [ln for ln in output.strip().splitlines() if re.search(r"\b(passed|failed|error|no tests ran)\b", ln)]
    last = lines[-1].strip(" =") if lines else "no pytest summary line"
    if rc == 0:
        return "passed", f"device-pinned pytest: {last}", {}
    return "failed", f"device-pinned pytest exited {rc}: {last}", {}


def judge_example(rc, output):
    losses = re.findall(r"loss is (\S+)", output)
    if rc != 0:
        return "failed", f"examples/resnet_cifar.py exited with status {rc}", {}
    if not losses:
        return "failed", "examples/resnet_cifar.py printed no loss (did it train?)", {}
    return "passed", f"examples/resnet_cifar.py --device GPU: {len(losses)} loss lines, last {losses[-1]}", {}
