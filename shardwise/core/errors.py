"""Typed errors. Each names what was given, what was expected, and a fix."""
from __future__ import annotations


class ShardingError(ValueError):
    """A sharding spec, layout or plan that cannot be honoured.

    Raised early (at ``parallelize`` or when a placement/layout is built), with a
    message that names the offending input, what was given, what the mesh or the
    tensor expects, and how to fix it.
    """

    def __init__(self, message: str, *, fix: str | None = None):
        self.message, self.fix = message, fix  # read these; never parse str(error)
        super().__init__(message if fix is None else f"{message}\n  fix: {fix}")


class UnsupportedOpError(ShardingError):
    """An aten op in the traced graph has no sharding rule."""

    def __init__(self, op, *, node: str | None = None, source: str | None = None):
        self.op, self.node, self.source = op, node, source
        where = f" at node '{node}'" if node else ""
        line = f"\n  source: {source}" if source else ""
        super().__init__(f"no sharding rule for aten op {op}{where}{line}",
                         fix="register a rule with @shardwise.rule(<op>) (check it with shardwise.verify_rule), or "
                         "allow the replicate fallback for this op with parallelize(..., replicate_fallback={'"
                         + str(op) + "'}), which gathers its inputs and is reported in the plan")


class RuleError(ShardingError):
    """A rule row missing a property, a rule that returned something malformed, or local args that raised."""


class ConfigError(ShardingError):
    """An option or environment setting shardwise cannot use (a timeout, a process count, a reduce op)."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting of the wrong type (still a TypeError for callers that catch one)."""


class CliError(ShardingError):
    """A command-line argument that cannot be honoured."""


class AttentionError(ShardingError):
    """q, k, v, the mask, the settings or the sequence blocks given to shardwise.attention do not fit."""


class MicrobatchError(ConfigError):
    """An op whose result changes when the batch is split into a pipeline's microbatches (batch
    statistics, a normaliser over activations of the whole batch): names the op and the way out."""

    def __init__(self, message: str, *, op=None, node: str | None = None, fix: str | None = None):
        super().__init__(message, fix=fix)
        self.op, self.node = op, node


class MemoryBudgetError(ShardingError):
    """No plan meets ``memory_budget``: says the smallest estimate found and how to get there."""


class CheckpointError(ShardingError):
    """A checkpoint that cannot be written, found or loaded as asked (no complete checkpoint, a
    failed background save, generators saved for other ranks)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose files do not match its manifest (truncated, changed, missing). ``path``
    is the checkpoint directory and ``file`` the first damaged file (relative to it)."""

    def __init__(self, message: str, *, path: str, file: str | None = None, fix: str | None = None):
        self.path, self.file = path, file
        super().__init__(message, fix=fix)


class PlanMismatchError(ShardingError):
    """The processes of a torch backend planned the same step differently (each plans on its own;
    their programs would then not meet): raised on every rank before any program runs."""


class CollectiveError(RuntimeError):
    """A collective failed: a rank timed out, failed, or shapes disagreed."""

    def __init__(self, message: str, *, rank: int | None = None, missing: tuple[int, ...] = (),
                 node: str | None = None):
        self.rank = rank
        self.missing = tuple(missing)
        self.node = node  # the program node the failure is about, when known
        super().__init__(message)


class RankFailedError(CollectiveError):
    """Another rank raised; this rank stopped instead of waiting forever. ``rank`` is the rank
    that failed and ``node`` the program node it was at (when known)."""


class UnsupportedOpsError(UnsupportedOpError):
    """Several aten ops in the traced graph have no sharding rule: all of them in one error.
    ``ops`` lists ``(op, node, source)`` per op (its first node); ``op``/``node``/``source`` are the first's."""

    def __init__(self, ops: list):
        self.ops = list(ops)
        self.op, self.node, self.source = self.ops[0]
        rows = "".join(f"\n  {op} at node '{node}'" + (f"\n    source: {source}" if source else "")
                       for op, node, source in self.ops)
        names = ", ".join(f"'{op}'" for op, _, _ in self.ops)
        ShardingError.__init__(
            self, f"no sharding rule for {len(self.ops)} aten ops:{rows}",
            fix=("register a rule for each with @shardwise.rule(<op>) (check it with shardwise.verify_rule), or "
                 f"allow the replicate fallback for them with parallelize(..., replicate_fallback={{{names}}}), which "
                 "gathers their inputs and is reported in the plan"))
