"""python -m minidl.plot: reading the metrics log, drawing it, and its errors."""
import json
import subprocess
import sys

import pytest

from minidl import plot

from .helpers import blobs, ce_loss, mlp, momentum, slices


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_read_log_sorts_steps_later_records_win_and_collects_evals(tmp_path):
    log = _write(tmp_path / "l.jsonl", [
        {"epoch": 1, "step": 1, "loss": 2.0, "time": 0.0},
        {"epoch": 1, "step": 2, "loss": 1.5, "time": 0.1},
        {"epoch": 1, "step": 2, "time": 0.2, "epoch_time": 0.2, "eval": {"accuracy": 0.5, "loss": 1.4}},
        {"epoch": 1, "step": 2, "loss": 1.25, "time": 0.3},  # a resumed run repeats step 2
        {"epoch": 2, "step": 3, "loss": 1.0, "time": 0.4},
    ])
    steps, losses, evals = plot.read_log(log)
    assert steps == [1, 2, 3] and losses == [2.0, 1.25, 1.0]
    assert evals == [(2, {"accuracy": 0.5, "loss": 1.4})]


def test_read_log_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 1.0}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        plot.read_log(str(bad))
    bad.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r":1 is not a metrics record"):
        plot.read_log(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plot.read_log(str(tmp_path / "none.jsonl"))


def test_missing_matplotlib_names_the_install(tmp_path, monkeypatch, capsys):
    log = _write(tmp_path / "l.jsonl", [{"epoch": 1, "step": 1, "loss": 2.0, "time": 0.0}])
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        plot.plot_log(log, str(tmp_path / "c.png"))
    assert plot.main([log, "-o", str(tmp_path / "c.png")]) == 1
    assert "pip install matplotlib" in capsys.readouterr().err


def test_plot_from_a_real_training_log(tmp_path):
    pytest.importorskip("matplotlib")
    x, y = blobs(n=12)
    ds = slices((x, y), ["x", "y"], 4)
    net = mlp()
    from minidl.train import Model
    log = str(tmp_path / "train.jsonl")
    Model(net, ce_loss(), momentum(net), metrics={"accuracy", "loss"}).fit(2, ds, ds, log_file=log)
    out = tmp_path / "curve.png"
    assert plot.plot_log(log, str(out)) == ["loss", "eval loss", "accuracy"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line(tmp_path):
    pytest.importorskip("matplotlib")
    log = _write(tmp_path / "l.jsonl", [{"epoch": 1, "step": s, "loss": 1.0 / s, "time": 0.0} for s in (1, 2, 3)])
    out = tmp_path / "c.png"
    r = subprocess.run([sys.executable, "-m", "minidl.plot", log, "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {out} (loss)"
    assert out.stat().st_size > 1000
    empty = _write(tmp_path / "e.jsonl", [])
    assert plot.main([empty, "-o", str(out)]) == 1
