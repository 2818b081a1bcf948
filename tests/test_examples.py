"""The README's main example runs as a newcomer would run it (shortened)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The checkout itself, so the examples import this minidl whether or not it is pip-installed.
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_resnet_cifar_example_runs_and_learns():
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--epochs", "2", "--num-samples", "128",
                          "--batch-size", "16", "--device", "CPU"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "synthetic" in lines[0]
    losses = [float(l.split("loss is ")[1]) for l in lines if "loss is" in l]
    assert len(losses) >= 4
    assert losses[-1] < losses[0]


def test_example_rejects_bad_arguments():
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--batch-size", "0"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--batch-size must be positive" in out.stderr
