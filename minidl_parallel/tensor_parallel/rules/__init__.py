"""Sharding rules, one module per operator family; importing them registers them (see base.py)."""
from .base import (TensorSpec, OpSharding, Decomposed, Site, StrategyError, NoRuleError, Rule, RULES, register,
                   get_rule)
from . import linalg, elementwise, reduce, softmax, shape, conv, norm, dropout, indexing  # noqa: F401  (registration)

__all__ = ["TensorSpec", "OpSharding", "Decomposed", "Site", "StrategyError", "NoRuleError", "Rule", "RULES",
           "register", "get_rule"]
