"""Pipeline parallelism: the model cut by depth into stages, each batch into micro-batches.

- schedules.py: the schedules (GPipe, 1F1B) as plain data: each stage's ordered actions, the
  messages they imply, a unit-slot timeline, the bubble and the activations held.
"""
from .schedules import Action, Message, Schedule, pipeline_schedule, SCHEDULERS

__all__ = ["Action", "Message", "Schedule", "pipeline_schedule", "SCHEDULERS"]
