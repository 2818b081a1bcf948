"""``python -m minidl.gpu_check``: the GPU check for GPU owners (docs/gpu.md).

The tool lives in the ``minidl_checks`` package beside ``minidl`` (minidl_checks/gpu.py: its
stages, workers, PyTorch comparison and report): a diagnostic is no part of the framework, and
``import minidl`` must not load it. This module keeps the command's name only: run, it runs
the tool; imported, it does nothing.
"""
if __name__ == "__main__":
    import importlib.util
    import runpy
    import sys

    if importlib.util.find_spec("minidl_checks") is None:
        sys.exit("python -m minidl.gpu_check: the minidl_checks package, which minidl installs beside itself, "
                 "is missing; reinstall minidl (python3 -m pip install -e . in a clone)")
    runpy.run_module("minidl_checks.gpu", run_name="__main__", alter_sys=True)
