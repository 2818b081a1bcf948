"""Diagnostics that check an installation of minidl, kept beside it rather than inside it.

``gpu``: the GPU check, ``python -m minidl.gpu_check`` (docs/gpu.md). Neither ``minidl`` nor
``minidl_parallel`` imports this package: a diagnostic with its own PyTorch network, worker
processes and report is no part of the framework, and importing the framework must not load it.
"""
