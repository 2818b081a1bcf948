"""Training-step throughput: minidl vs PyTorch (CPU), same model, same batch, same threads.

    python benchmarks/bench_train.py                 # ResNet-20 (batch 64) and MLP (batch 256)
    python benchmarks/bench_train.py --model mlp --steps 20 --threads 1

Prints images/s for each framework and the ratio minidl / PyTorch (PyTorch runs only when
it is installed: `pip install torch==2.13.0`). Also prints the framework overhead of one
tiny op (the cost of the Python layer around a 1-element NumPy add).

Each framework runs in its own worker process, and the workers alternate for ``--repeats``
rounds; each round reports the median step time of its ``--steps`` steps (as
bench_conv.py does), and the best round of each framework is kept. In one process the spin-waiting worker threads of
OpenBLAS (NumPy) and OpenMP (PyTorch) take the 2 cores from each other and slow minidl
down by 2x or more, which would measure the neighbour, not the framework.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet20", "mlp", "all"], default="all")
    p.add_argument("--steps", type=int, default=10, help="timed steps per framework")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS / intra-op threads for both")
    p.add_argument("--repeats", type=int, default=3, help="alternating timing rounds; the best is kept")
    p.add_argument("--worker", choices=["minidl", "pytorch"], help=argparse.SUPPRESS)
    return p.parse_args()


args = parse_args()
# Thread counts must be fixed before NumPy's BLAS is loaded.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import minidl  # noqa: E402
from minidl import nn, ops, Tensor  # noqa: E402
from minidl.models import resnet20, MLP  # noqa: E402

torch = None
if args.worker == "pytorch":
    import torch
    torch.set_num_threads(args.threads)

CONFIGS = {
    "resnet20": dict(batch=64, input=(3, 32, 32), classes=10),
    "mlp": dict(batch=256, input=(784,), classes=10),
}


def minidl_step_fn(name):
    minidl.set_seed(0)
    net = resnet20() if name == "resnet20" else MLP((784, 512, 512, 10))
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss
    return step, lambda x, y: (Tensor(x), Tensor(y))


def torch_step_fn(name):
    torch.manual_seed(0)
    tnn = torch.nn
    if name == "mlp":
        net = tnn.Sequential(tnn.Linear(784, 512), tnn.ReLU(), tnn.Linear(512, 512), tnn.ReLU(), tnn.Linear(512, 10))
    else:
        class Block(tnn.Module):
            def __init__(self, cin, cout, stride):
                super().__init__()
                self.c1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
                self.b1 = tnn.BatchNorm2d(cout)
                self.c2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
                self.b2 = tnn.BatchNorm2d(cout)
                self.down = None
                if stride != 1 or cin != cout:
                    self.down = tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False), tnn.BatchNorm2d(cout))

            def forward(self, x):
                idt = x if self.down is None else self.down(x)
                out = torch.relu(self.b1(self.c1(x)))
                return torch.relu(self.b2(self.c2(out)) + idt)

        layers, cin = [tnn.Conv2d(3, 16, 3, 1, 1, bias=False), tnn.BatchNorm2d(16), tnn.ReLU()], 16
        for i, w in enumerate((16, 32, 64)):
            for j in range(3):
                layers.append(Block(cin, w, 2 if i > 0 and j == 0 else 1))
                cin = w
        layers += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(64, 10)]
        net = tnn.Sequential(*layers)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = tnn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        return loss
    return step, lambda x, y: (torch.from_numpy(x), torch.from_numpy(y))


def time_steps(step, x, y, steps):
    """The median seconds of ``steps`` steps: a few steps slowed by a neighbour on a shared host
    do not move it, where they move a mean."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def worker(framework, name):
    """Runs in a child process: prints the seconds per step of one round as JSON."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((cfg["batch"],) + cfg["input"]).astype(np.float32)
    y = rng.integers(0, cfg["classes"], cfg["batch"]).astype(np.int64)
    step, convert = (minidl_step_fn if framework == "minidl" else torch_step_fn)(name)
    bx, by = convert(x, y)
    time_steps(step, bx, by, args.warmup)
    print(json.dumps({"seconds": time_steps(step, bx, by, args.steps)}), flush=True)


def run_worker(framework, name):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--model", name,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def torch_installed():
    try:
        import importlib.util
        return importlib.util.find_spec("torch") is not None
    except ImportError:
        return False


def bench(name):
    cfg = CONFIGS[name]
    frameworks = ["minidl"] + (["pytorch"] if torch_installed() else [])
    best = {k: float("inf") for k in frameworks}
    for _ in range(args.repeats):
        for k in frameworks:
            best[k] = min(best[k], run_worker(k, name))
    line = f"{name:9s} batch {cfg['batch']:4d}"
    for k, t in best.items():
        line += f" | {k}: {t * 1e3:8.1f} ms/step {cfg['batch'] / t:8.1f} img/s"
    if "pytorch" in best:
        line += f" | ratio minidl/pytorch = {best['pytorch'] / best['minidl']:.2f}"
    print(line, flush=True)


def op_overhead():
    a, b = Tensor(np.ones(1, np.float32)), Tensor(np.ones(1, np.float32))
    na, nb = a.data, b.data
    n = 20000

    def timeit(fn):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6
    raw = min(timeit(lambda: na + nb) for _ in range(3))
    ours = min(timeit(lambda: ops.add(a, b)) for _ in range(3))
    ar = Tensor(np.ones(1, np.float32), requires_grad=True)
    rec = min(timeit(lambda: ops.add(ar, b)) for _ in range(3))
    print(f"tiny-op overhead: numpy add {raw:.2f} us; minidl ops.add {ours:.2f} us (+{ours - raw:.2f}); "
          f"recorded for backward {rec:.2f} us (+{rec - raw:.2f})")


if __name__ == "__main__" and args.worker:
    worker(args.worker, args.model)
elif __name__ == "__main__":
    import platform
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; threads={args.threads}; "
          f"numpy {np.__version__}; torch {'installed' if torch_installed() else 'not installed'}")
    for name in (["resnet20", "mlp"] if args.model == "all" else [args.model]):
        bench(name)
    op_overhead()
