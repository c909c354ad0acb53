"""shardwise: run a single-device PyTorch model sharded across a mesh of devices."""
from .errors import (AttentionError, CollectiveError, ConfigError, MemoryBudgetError, RankFailedError, RuleError,
                     ShardingError, UnsupportedOpError)
from .layout import Layout, Partial, Replicate, Shard
from .mesh import Mesh

__version__ = "0.1.0"
from .api_layout import collect, distribute, redistribute
from .plan.paths import plan_redistribute
from .api import ParallelModule, parallelize
from .optim import ShardedOptimizer
from .rules.registry import registered_ops, rule
from .verify import verify_rule
from .cost import CostModel
from .attention import AttentionSettings, attention
from . import recipes

__all__ = ["AttentionError", "AttentionSettings", "CollectiveError", "ConfigError", "CostModel", "Layout",
           "MemoryBudgetError", "Mesh", "ParallelModule", "Partial", "RankFailedError", "Replicate", "RuleError", "Shard",
           "ShardedOptimizer", "ShardingError", "UnsupportedOpError", "attention", "collect", "distribute",
           "parallelize", "plan_redistribute", "recipes", "redistribute", "registered_ops", "rule", "verify_rule"]
