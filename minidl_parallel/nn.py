"""Parallel layers under MindSpore's names, for ``from minidl_parallel import nn``."""
from .sync_batchnorm import SyncBatchNorm  # noqa: F401
from .pipeline import PipelineCell, PipelineEvalCell, PipelineGradReducer  # noqa: F401

__all__ = ["SyncBatchNorm", "PipelineCell", "PipelineEvalCell", "PipelineGradReducer"]
