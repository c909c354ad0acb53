"""shardwise: run a single-device PyTorch model sharded across a mesh of devices."""
from .core.errors import (AttentionError, CheckpointCorruptError, CheckpointError, CollectiveError, ConfigError,
                          MemoryBudgetError, MicrobatchError, PlanMismatchError, RankFailedError, RuleError,
                          ShardingError, UnsupportedOpError)
from .core.layout import Layout, Partial, Replicate, Shard
from .core.mesh import Mesh
from .core.precision import MixedPrecision

__version__ = "0.1.0"
from .run.shards import collect, distribute, redistribute
from .search.paths import plan_redistribute
from .module.parallel_module import ParallelModule, parallelize
from .module.pipeline import Pipeline
from .module.optim import ShardedOptimizer
from .module.checkpoint import Checkpointer, CheckpointWarning
from .rules import registered_ops, rule
from .tools.verify import verify_rule
from .core.cost import CostModel
from .ops.attention import AttentionSettings, attention
from .module import recipes

__all__ = ["AttentionError", "AttentionSettings", "CheckpointCorruptError", "CheckpointError", "CheckpointWarning",
           "Checkpointer", "CollectiveError", "ConfigError", "CostModel", "Layout", "MemoryBudgetError", "Mesh",
           "MicrobatchError", "MixedPrecision", "ParallelModule", "Partial", "Pipeline", "PlanMismatchError",
           "RankFailedError",
           "Replicate", "RuleError", "Shard",
           "ShardedOptimizer", "ShardingError", "UnsupportedOpError", "attention", "collect", "distribute",
           "parallelize", "plan_redistribute", "recipes", "redistribute", "registered_ops", "rule", "verify_rule"]
