"""Inputs as the ranks hand them over: ``inputs="global"`` or ``inputs="local"``.

global: every rank passes the full tensors and slices its own piece. On the torch backend,
    the first step of each plan checks (one small all-gather of shapes and checksums) that
    every rank was handed the same tensors, and raises naming the rank that differs; ranks
    fed different batches would otherwise train on a mix, silently.
local: each rank passes its own piece, laid out as its input placements say (the DDP
    habit; uneven pieces as torch.chunk makes them). The global shape is the sum of the
    pieces along the sharding mesh dims; each piece must be exactly the rank's chunk of it,
    and ranks that hold the same chunk (replicas) must hold the same values. On the torch
    backend this takes a small exchange every step: a rank cannot tell on its own that
    another rank's piece changed (8 rows -> 7 rows on 2 ranks leaves rank 0's piece at 4).
    A step on shapes not seen before gathers every rank's shapes and checksums (two
    all-gathers: the lengths, then the facts); later steps of that plan, one all-gather of
    each rank's say that its pieces are the plan's and of the checksums of pieces held alike
    (module/steady.LocalSteadyStep).
    On the threads backend a local input is a list of per-rank values, in rank order.

Everything here works on the flat tensor leaves of ``(inputs, targets)``, in the order the
trace flattens them, with one placement tuple per leaf.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from ..core.errors import ShardingError
from ..core.layout import Layout, Shard

MODES = ("global", "local")
_PRIME = 65521  # position weights of the checksum: 1..PRIME


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ShardingError(f"inputs={mode!r} is not one of {MODES}",
                            fix='inputs="global": every rank passes the full tensors; inputs="local": each rank '
                                "passes its own piece, as its input placements lay it out")
    return mode


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Order-independent, exact fingerprint of a tensor's bytes: the wrapping int64 sums of its
    words, plain and position-weighted (integer sums are associative, so reduction order and
    thread count cannot change them, unlike a float sum)."""
    flat = t.detach()
    if not flat.is_contiguous() or flat.storage_offset():  # word views need an aligned, dense buffer
        flat = flat.clone(memory_format=torch.contiguous_format)
    flat = flat.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return 0, 0
    words = flat.view(torch.uint8)
    for dt, size in ((torch.int64, 8), (torch.int32, 4)):
        if nbytes % size == 0:
            words = words.view(dt)
            break
    words = words.to(torch.int64)
    w = torch.arange(words.numel(), dtype=torch.int64, device=words.device) % _PRIME + 1
    return int(words.sum()), int((words * w).sum())


@dataclass
class LeafInfo:
    """What one rank reports about one tensor leaf: its shape and checksum."""

    shape: tuple
    sums: tuple

    def encode(self) -> list[int]:
        return [len(self.shape), *self.shape, *self.sums]


def leaf_infos(leaves: list, with_sums=True) -> list[LeafInfo]:
    """``with_sums``: one bool for all leaves or one per leaf (a leaf no two ranks hold alike
    needs no checksum)."""
    sums = [with_sums] * len(leaves) if isinstance(with_sums, bool) else list(with_sums)
    return [LeafInfo(tuple(t.shape), checksum(t) if s else (0, 0)) for t, s in zip(leaves, sums)]


def has_replicas(placements, mesh) -> bool:
    """Whether some ranks hold the same chunk: a mesh dim of size > 1 that does not shard it."""
    return any(not isinstance(p, Shard) and n > 1 for p, n in zip(placements, mesh.shape))


def encode(infos: list[LeafInfo]) -> torch.Tensor:
    return torch.tensor([len(infos)] + [v for i in infos for v in i.encode()], dtype=torch.int64)


def decode(vec) -> list[LeafInfo]:
    vals = [int(v) for v in vec]
    out, i = [], 1
    for _ in range(vals[0]):
        nd = vals[i]
        out.append(LeafInfo(tuple(vals[i + 1:i + 1 + nd]), tuple(vals[i + 1 + nd:i + 3 + nd])))
        i += 3 + nd
    return out


def gather_infos(comm, infos: list[LeafInfo], device) -> dict[int, list[LeafInfo]]:
    """{rank: its leaf infos} over the whole mesh (collective: every rank calls it). The lengths go
    first, so ranks handed a different number of tensors or dims are told so, not a size error."""
    vec = encode(infos)
    sizes = comm.world_gather(torch.tensor([vec.numel()], dtype=torch.int64, device=device)).reshape(-1)
    padded = torch.zeros(int(sizes.max()), dtype=torch.int64)
    padded[:vec.numel()] = vec
    got = comm.world_gather(padded.to(device)).cpu()
    return {r: decode(got[r]) for r in range(comm.mesh.size)}


def global_shape(shapes: dict[int, tuple], mesh, placements) -> tuple:
    """The global shape whose chunks the ranks' pieces are: per dim, the sum of the pieces along
    the mesh dims that shard it (other mesh coordinates 0)."""
    ndim = len(shapes[0])
    out = []
    for d in range(ndim):
        sharders = {m for m, p in enumerate(placements) if getattr(p, "dim", None) == d}
        line = [r for r in range(mesh.size) if all(mesh.coord(r)[m] == 0 for m in range(mesh.ndim) if m not in sharders)]
        out.append(sum(shapes[r][d] for r in line))
    return tuple(out)


def chunk_holders(layout: Layout, mesh) -> list[int]:
    """Per rank, the first rank that holds the same chunk of ``layout`` (itself where none before
    it does): ranks apart only on mesh dims that do not shard it are replicas."""
    first: dict = {}
    return [first.setdefault(tuple(layout.extents(mesh, r)), r) for r in range(mesh.size)]


def resolve_local(infos: dict[int, list[LeafInfo]], mesh, placements: list, names: list[str],
                  dtypes: list) -> list[tuple]:
    """Global shapes of local pieces; raises naming the rank whose piece is not its chunk, or
    whose values differ from a rank holding the same chunk."""
    ranks = sorted(infos)
    counts = {r: len(infos[r]) for r in ranks}
    if len(set(counts.values())) != 1:
        raise ShardingError(f"ranks were handed different numbers of input tensors: {counts}",
                            fix="call the step with the same arguments (each rank its own piece) on every rank")
    shapes = []
    for i, (pl, name) in enumerate(zip(placements, names)):
        ndims = {r: len(infos[r][i].shape) for r in ranks}
        if len(set(ndims.values())) != 1:
            raise ShardingError(f"{name}: the ranks' pieces have different numbers of dims {ndims}",
                                fix="hand every rank a piece of the same tensor")
        glob = global_shape({r: infos[r][i].shape for r in ranks}, mesh, pl)
        layout = Layout(glob, dtypes[i], pl)
        for r in ranks:
            want = layout.local_shape(mesh, r)
            if infos[r][i].shape != want:
                raise ShardingError(
                    f"{name}: rank {r}'s piece has shape {infos[r][i].shape}, but under placements "
                    f"{list(pl)} the pieces make a tensor of shape {glob} whose chunk for rank {r} has shape {want}",
                    fix="hand each rank its torch.chunk piece (the first ranks get the larger pieces), and name "
                        "the placement of every local input and target (input_placements / target_placements; "
                        "an unnamed one is Replicate: every rank must pass the whole tensor)")
        holders: dict = {}
        for r, first in zip(ranks, chunk_holders(layout, mesh), strict=True):
            holders.setdefault(first, []).append(r)
        for same in holders.values():
            for r in same[1:]:
                if infos[r][i].sums != infos[same[0]][i].sums:
                    raise ShardingError(
                        f"{name}: ranks {same[0]} and {r} hold the same chunk under placements {list(pl)} but were "
                        f"handed different values (rank {r} differs)",
                        fix="replicated mesh dims need the same values on every rank of the group; if each rank "
                            "should have its own rows, shard that input on that mesh dim too")
        shapes.append(glob)
    return shapes


def check_same(infos: dict[int, list[LeafInfo]], names: list[str]) -> None:
    """inputs="global": every rank was handed the same tensors; raises naming the first rank that differs."""
    ref = infos[0]
    for r in sorted(infos)[1:]:
        got = infos[r]
        if len(got) != len(ref):
            raise ShardingError(f"rank {r} was handed {len(got)} input tensors, rank 0 {len(ref)}",
                                fix="call the step with the same arguments on every rank")
        for i, name in enumerate(names):
            if got[i].shape != ref[i].shape:
                raise ShardingError(
                    f'inputs="global": rank {r} was handed {name} of shape {got[i].shape}, rank 0 of shape '
                    f"{ref[i].shape}; every rank must pass the same full tensors",
                    fix='pass the full batch on every rank, or parallelize(..., inputs="local") to hand each rank '
                        "its own piece")
            if got[i].sums != ref[i].sums:
                raise ShardingError(
                    f'inputs="global": rank {r} was handed different values of {name} than rank 0 (same shape '
                    f"{ref[i].shape}, different checksum); every rank must pass the same full tensors",
                    fix='seed the data loader the same on every rank, or parallelize(..., inputs="local") to hand '
                        "each rank its own piece")


def leaves_of(tree) -> list[torch.Tensor]:
    """The tensor leaves of ``tree``; a tuple of tuples of plain tensors (a step's inputs and
    targets) without pytree's walk."""
    if type(tree) is tuple and all(type(t) is tuple and all(type(x) is torch.Tensor for x in t) for t in tree):
        return [x for t in tree for x in t]
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
