"""Local shards as DCP chunks: global offsets and lengths, the form torch.distributed.checkpoint
stores every sharded tensor in (DTensor and FSDP2 included).

Every shardwise placement is expressible this way: a plain or unit shard is one rectangular
chunk per rank, nested shards are one smaller chunk, and a shard in ``groups`` is ``groups``
chunks per grouped dim (a rank holds its piece of every part). :class:`ShardChunks` carries the
chunks of the ranks this process holds and implements DCP's ``_Checkpointable`` hooks, so
``dcp.save`` / ``dcp.load`` accept it directly; DCP's own planner reshards on load by
intersecting the saved chunks with the chunks asked for.
"""
from __future__ import annotations

import itertools

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ...core.errors import ConfigTypeError, ShardingError
from ...core.layout import Layout, Shard
from ...core.mesh import Mesh


def rank_chunks(layout: Layout, mesh: Mesh, rank: int, local: torch.Tensor) -> list[tuple[tuple, torch.Tensor]]:
    """``[(global offsets, view of local)]``: the non-empty rectangular chunks ``rank`` holds.

    A dim split in ``g`` groups contributes ``g`` pieces (part ``k`` starts at ``k * size / g``);
    the chunks are the product of every dim's pieces, each a view into ``local`` (so loading
    into it writes through)."""
    pieces = []
    for d, (g, off, n) in enumerate(layout.extents(mesh, rank)):
        part = layout.shape[d] // g
        pieces.append([(k * part + off, k * n, n) for k in range(g)])  # (global, local, length)
    out = []
    for combo in itertools.product(*pieces):
        if any(n == 0 for _, _, n in combo):
            continue
        view = local
        for d, (_, lo, n) in enumerate(combo):
            view = view.narrow(d, lo, n)
        out.append((tuple(go for go, _, _ in combo), view))
    if not out and layout.numel == 0 and rank == 0:  # an empty tensor still has to be in the checkpoint
        out.append(((0,) * layout.ndim, local))
    return out


def writes(layout: Layout, mesh: Mesh, rank: int, held=()) -> bool:
    """Whether ``rank`` writes its chunks: the first rank along every mesh dim that does not shard
    the tensor (replicas are written once; every region has exactly one writer), ``held`` dims
    aside (only some ranks there hold the tensor at all: a pipeline stage's)."""
    coord = mesh.coord(rank)
    return all(coord[m] == 0 for m, p in enumerate(layout.placements) if not isinstance(p, Shard) and m not in held)


class ShardChunks(torch.Tensor):
    """A global tensor known only by the chunks held in this process (DCP ``_Checkpointable``).

    ``chunks``: ``[(global offsets, tensor)]``; the first ``n_write`` are written by a save (one
    writer per region), all of them are filled by a load (replicas included). Not a tensor to
    compute with: every torch op on it raises.
    """

    @staticmethod
    def __new__(cls, shape, dtype, chunks, n_write, device="cpu"):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        t._chunks = [(torch.Size(o), c) for o, c in chunks]
        t._n_write = n_write
        return t

    def __init__(self, *args, **kwargs):
        pass

    def __repr__(self) -> str:
        return f"ShardChunks({list(self.shape)}, {self.dtype}, {len(self._chunks)} chunk(s), {self._n_write} written)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise ConfigTypeError(f"ShardChunks only carries shards for torch.distributed.checkpoint; {func} is not "
                              "supported", fix="gather full tensors with pm.state_dict(); pass "
                              "pm.sharded_state_dict() to dcp.save / dcp.load only")

    # -- DCP's _Checkpointable protocol ------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, off, i), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                      properties=props, size=self.size()))
                for i, (off, t) in enumerate(self._chunks[: self._n_write])]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        i = index.index
        if i is not None and i < len(self._chunks) and self._chunks[i][0] == index.offset:
            return self._chunks[i][1]
        for off, t in self._chunks:
            if off == index.offset:
                return t
        raise ShardingError(f"{index.fqn}: no chunk at offset {tuple(index.offset or ())} in this process",
                            fix="save each process's own pm.sharded_state_dict() (or use pm.save), so the "
                                "checkpoint plan asks every process for the chunks it holds")


def shard_chunks(layout: Layout, mesh: Mesh, locals_: dict, held=()) -> ShardChunks:
    """ShardChunks of ``{rank: local tensor}`` laid out as ``layout``: writer chunks first
    (``held``: see ``writes``)."""
    write, rest = [], []
    for rank in sorted(locals_):
        (write if writes(layout, mesh, rank, held) else rest).extend(rank_chunks(layout, mesh, rank, locals_[rank]))
    device = next(iter(locals_.values())).device
    return ShardChunks(layout.shape, layout.dtype, write + rest, len(write), device=device)
