"""Runs examples/dist_options.py with the arguments in $DIST_OPTIONS_ARGS (a JSON list): the
suite's mpirun runner starts scripts without arguments."""
import json
import os
import runpy
import sys
from pathlib import Path

sys.argv = [str(Path(__file__).resolve().parents[2] / "examples" / "dist_options.py")] + \
    json.loads(os.environ["DIST_OPTIONS_ARGS"])
runpy.run_path(sys.argv[0], run_name="__main__")
