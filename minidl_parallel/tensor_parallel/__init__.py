"""Operator-level tensor parallelism: ``ops.MatMul().shard(((2, 4), (4, 1)))`` under SEMI_AUTO_PARALLEL
or AUTO_PARALLEL.

- layout.py: Layout (device matrix, tensor map, partial axes);
- plan.py: a redistribution plan as plain data (steps, bytes);
- redistribution.py: the planner (layout -> layout as a list of steps);
- executor.py: runs plans on a communicator, as autograd ops;
- rules/: per-operator sharding rules (strategy -> layouts), validation, propagation;
- dispatch.py: the hooks that run every operator on this rank's blocks;
- parameters.py: sharded Parameters, checkpoints and optimizer state;
- strategy_file.py: the plan saved as a JSON strategy checkpoint, and loaded back;
- explain.py, counter.py: seeing what happens.
"""
from .layout import Layout
from .counter import CommCounter
from .explain import explain
from .rules.base import StrategyError, NoRuleError
from .dispatch import redistribute, full_value
from .tensors import get_layout

__all__ = ["Layout", "CommCounter", "explain", "StrategyError", "NoRuleError", "redistribute", "full_value",
           "get_layout"]
