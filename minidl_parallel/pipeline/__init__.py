"""Pipeline parallelism: the model cut by depth into stages, each batch into micro-batches.

- schedules.py: the schedules (GPipe, 1F1B) as plain data: each stage's ordered actions, the
  messages they imply, a unit-slot timeline, the bubble and the activations held.
- stages.py: which cells and parameters belong to which stage (``Cell.pipeline_stage``).
- stage_forward.py: one stage's forward of one micro-batch (the other stages' cells stood in for).
- executor.py: one step of a schedule on one rank, with the messages between stages.
- stage_cut.py: a stage's cells cut by their shard() strategies over the stage's ranks.
- cell.py, grad_reducer.py: MindSpore's ``nn.PipelineCell`` and ``nn.PipelineGradReducer``.
- evaluation.py: ``nn.PipelineEvalCell``, the forwards of an evaluation network (Model.eval's metrics).
"""
from .schedules import Action, Message, Schedule, pipeline_schedule, SCHEDULERS
from .stage_forward import PipelineError
from .cell import PipelineCell
from .grad_reducer import PipelineGradReducer
from .evaluation import PipelineEvalCell

__all__ = ["Action", "Message", "Schedule", "pipeline_schedule", "SCHEDULERS", "PipelineError", "PipelineCell",
           "PipelineGradReducer", "PipelineEvalCell"]
