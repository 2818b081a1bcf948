"""The communication-saving options side by side: bytes each rank sends per step, step time, and
loss / accuracy after a fixed number of epochs (the table in SINGA's distributed-training
tutorial), for SINGA's CNN and MLP under mpirun.

    python benchmarks/bench_dist_options.py                       # -n 2 and 4, both models, 3 epochs
    python benchmarks/bench_dist_options.py --ranks 2 --models cnn --epochs 2

Each row is one ``mpirun -n N python examples/dist_options.py --dist-option X --summary F``
run (the example is the one implementation; this script only launches and tabulates). Bytes
are what CommCounter saw of the gradient traffic (phase "gradients": the all-reduce, or the
all-gathers of Adasum and the sparse options) by the conventions of minidl_parallel's
``comm_bytes`` (a ring all-reduce sends 2(n-1)/n of the buffer). Step time at -n 4 on a
2-core machine measures oversubscription, not the option.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = [("fp32", None), ("fp16", None), ("bf16", None), ("accumulate4", None), ("sparseTopK", 0.01),
        ("sparseThreshold", 0.05), ("partialUpdate", None), ("adasum", None)]
# partialUpdate's chunks: with SINGA's default threshold (2,097,152 elements) each model is one
# chunk, averaged every step, which for SGD with momentum is exactly fp32's update; 100,000
# elements gives the CNN 5 chunks and the MLP 4, so each step averages one of them.
PARTIAL_THRESHOLD = 100_000


def mpirun():
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else "mpirun"


def run(n, model, option, spars, epochs, summary):
    cmd = [mpirun(), "--oversubscribe", "-n", str(n), sys.executable, str(ROOT / "examples" / "dist_options.py"),
           "--dist-option", option, "--model", model, "--epochs", str(epochs), "--summary", summary]
    if spars is not None:
        cmd += ["--spars", str(spars)]
    if option == "partialUpdate":
        cmd += ["--threshold", str(PARTIAL_THRESHOLD)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    with open(summary) as f:
        return json.loads(f.readlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--models", nargs="+", choices=["cnn", "mlp"], default=["cnn", "mlp"])
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(argv)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"machine: {cpu}, {os.cpu_count()} cores; {args.epochs} epochs of 1024 synthetic MNIST-shaped images, "
          f"batch 32 per rank")
    print("| model | ranks | option | bytes sent / step / rank | vs fp32 | ms / step | loss | test accuracy |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for n in args.ranks:
                base = None
                for option, spars in ROWS:
                    r = run(n, model, option, spars, args.epochs, os.path.join(tmp, f"{model}{n}{option}.jsonl"))
                    base = base or r["bytes_per_step"]
                    name = option + (f" {spars}" if spars is not None else "") + \
                        (f" (chunks of {PARTIAL_THRESHOLD:,})" if option == "partialUpdate" else "")
                    print(f"| {model} | {n} | {name} | {r['bytes_per_step']:,.0f} | {r['bytes_per_step'] / base:.3f} | "
                          f"{r['ms_per_step']:.1f} | {r['loss']:.4f} | {r['accuracy']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
