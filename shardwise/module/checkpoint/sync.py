"""How the processes of one save or load agree: this process's place among them and the few
object collectives a checkpoint needs (which directory, which files each checks, done).

Threads backend: one process holds every rank, nothing to agree on. Torch backend: one
process per rank, over ``group`` (default: the default process group; the Checkpointer's own
gloo group when it saves from its writer thread, so those collectives never interleave with
the training step's).
"""
from __future__ import annotations


class Sync:
    def __init__(self, pm, group=None):
        self.distributed = pm.backend.name == "torch"
        self.group = group
        if self.distributed:
            import torch.distributed as dist

            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.world = 0, 1

    @property
    def leader(self) -> bool:
        """The process that creates, finishes and renames directories (rank 0)."""
        return self.rank == 0

    def broadcast(self, value):
        """Rank 0's ``value`` on every process."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                   group=self.group)
        return box[0]

    def all_gather(self, value) -> list:
        """Every process's ``value``, in rank order."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.group)
