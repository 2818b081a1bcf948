"""Draws training curves from a metrics log written by ``Model.train(..., log_file=...)``.

    python -m minidl.plot train.jsonl -o curve.png

The loss is drawn against the global step; evaluation results recorded at epoch ends
(``Model.fit``) are drawn too: the evaluation loss beside the training loss, accuracies
in a second panel. Needs matplotlib (``pip install matplotlib``, or the "plot" extra).
A log that a resumed run appended to may repeat steps; the later record wins.
"""
import argparse
import json
import math
import os
import sys

__all__ = ["read_log", "plot_log", "main"]

_MATPLOTLIB_HINT = "minidl.plot needs matplotlib: pip install matplotlib (or pip install 'minidl[plot]')"


def read_log(path):
    """Parses a metrics log.

    Returns:
        (steps, losses, evals): the step records' global steps and losses, sorted by step,
        and a list of (step, {metric: value}) from the epoch records that hold "eval".

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object (the line number is named).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"minidl.plot: log file {os.fspath(path)!r} does not exist")
    losses, evals = {}, {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"minidl.plot: {path}:{lineno} is not valid JSON ({e.msg}); expected one JSON "
                                 f"object per line as Model.train(log_file=...) writes") from None
            if not isinstance(rec, dict) or "step" not in rec:
                raise ValueError(f"minidl.plot: {path}:{lineno} is not a metrics record (a JSON object with 'step')")
            step = int(rec["step"])
            if rec.get("loss") is not None:
                losses[step] = float(rec["loss"])
            if isinstance(rec.get("eval"), dict):
                evals[step] = {k: float(v) for k, v in rec["eval"].items() if isinstance(v, (int, float))}
    steps = sorted(losses)
    return steps, [losses[s] for s in steps], sorted(evals.items())


def _import_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ImportError(_MATPLOTLIB_HINT) from None
    return Figure, FigureCanvasAgg, MaxNLocator


def plot_log(path, output, title=None):
    """Draws the curves of the log at ``path`` into the image file ``output`` (PNG, SVG, PDF...).

    Returns:
        the names of the curves drawn, e.g. ["loss", "eval loss", "accuracy"].
    """
    steps, losses, evals = read_log(path)
    if not steps and not evals:
        raise ValueError(f"minidl.plot: {path} holds no step or evaluation records")
    # Imported after reading, so that a bad log is reported even without matplotlib.
    Figure, FigureCanvasAgg, MaxNLocator = _import_matplotlib()
    eval_loss = [(s, m["loss"]) for s, m in evals if "loss" in m]
    acc_names = sorted({k for _, m in evals for k in m if k != "loss"})
    fig = Figure(figsize=(11 if acc_names else 6.5, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if acc_names else 1, 1)
    drawn = []
    if steps:
        ax.plot(steps, losses, lw=1, label="train loss")
        drawn.append("loss")
    if eval_loss:
        ax.plot(*zip(*eval_loss), "o-", label="eval loss")
        drawn.append("eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    finite = [v for v in losses if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 100:
        ax.set_yscale("log")  # early losses would flatten the rest of the curve
    ax.grid(alpha=0.3)
    ax.legend()
    if acc_names:
        ax2 = fig.add_subplot(1, 2, 2)
        for name in acc_names:
            pts = [(s, m[name]) for s, m in evals if name in m]
            ax2.plot(*zip(*pts), "o-", label=name)
            drawn.append(name)
        ax2.set_xlabel("step")
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax2.set_ylabel("evaluation")
        ax2.grid(alpha=0.3)
        ax2.legend()
    fig.suptitle(title or os.path.basename(os.fspath(path)))
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    return drawn


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minidl.plot",
                                     description="Draw loss and accuracy curves from a minidl metrics log.")
    parser.add_argument("log", help="JSON-lines log written by Model.train(..., log_file=...)")
    parser.add_argument("-o", "--output", default="curve.png", help="image to write (default: curve.png)")
    parser.add_argument("--title", default=None, help="figure title (default: the log's file name)")
    args = parser.parse_args(argv)
    try:
        drawn = plot_log(args.log, args.output, args.title)
    except (ImportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
