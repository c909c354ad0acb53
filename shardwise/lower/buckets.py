"""Bucketing pass: a per-rank program's independent all_reduces (and reduce_scatters) become
flat, asynchronous buckets.

Lowering emits a redistribution where its first consumer needs it, so every gradient's
``all_reduce`` sits at the program's end, one call per tensor, each
waited for before the next starts. DDP instead packs gradients into ~25 MB buckets and
launches each bucket as soon as its last gradient is computed, so the communication runs
while the rest of backward computes. This pass does the same on the program graph:

- candidates: plain ``comm.all_reduce`` and ``comm.reduce_scatter`` calls (any value, not
  only gradients: FSDP-style gradients are reduce-scattered) whose input is not another
  candidate's result: of a chain (HSDP's gradients: reduce_scatter on the shard dim, then
  all_reduce on the replicate dim), the first step, launched as backward makes the gradient,
  so its unsharded buffer is freed then; the next pass takes the next step, whose input is
  then a piece of a waited bucket, and so on to the chain's end;
- in order of where their inputs are computed, candidates of one key (kind, mesh dim, reduce
  op, dtype) fill a bucket up to ``bucket_bytes`` (one larger tensor gets a bucket of its own);
  a candidate joins the open bucket only if no member's result is read before its input is
  computed, so a bucket never waits on itself;
- reduce_scatters are bucketed per FSDP unit too (the block whose backward computed the
  gradient, trace/provenance.fsdp_unit; the root's: embeddings, final norm, head), as FSDP2
  reduce-scatters each block's gradients when its backward finishes: a block's bucket launches
  after its last gradient and overlaps the next block's backward, instead of one bucket
  launched at the end of backward;
- a bucket of one tensor read right after it is computed stays the plain call (no gain);
- the bucket is launched (``bucket_all_reduce``: flatten into one buffer, an async
  all_reduce; ``bucket_reduce_scatter``: each member's padded chunks side by side in one
  [group size, total] buffer, an async reduce_scatter) right after its last member's input
  is computed, and waited for (``wait_bucket``) just before the first read of any member's
  result (the output node: at the end), a reduce_scatter bucket at the latest just before the next
  reduce_scatter bucket launches (its [group size, total] input, the unit's unsharded gradients,
  is freed then, as FSDP2 frees them once reduced; waited at the end, every unit's would be alive
  at once); each member's result is then a view of the reduced buffer (``bucket_piece``) or
  its chunk narrowed to this rank's size (``bucket_chunk``).

Bucket sizes are decided on the largest local size over all ranks, so every rank forms the
same buckets and launches them in the same order (collectives must match across a group).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx

from ..core.errors import ShardingError
from ..core.scope import current
from ..trace.normalize import RESHAPES, is_view_op
from . import comm
from .guards import shape_guard

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb


def check_bucket_bytes(value):
    """``bucket_bytes`` of parallelize: a positive number of bytes, or None (no bucketing)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ShardingError(f"bucket_bytes must be a positive number of bytes or None, got {value!r}",
                            fix="pass e.g. bucket_bytes=25 * 2**20 (DDP's default), or None to launch each "
                                "all_reduce on its own where it is first needed")
    return int(value)


# -- the calls a bucketed program makes ------------------------------------------------
def bucket_all_reduce(members: tuple, mesh_dim: int, op: str = "sum"):
    """Copy ``members`` into one flat buffer (owned by the bucket, so it is reduced in place;
    each member copied straight into its place, no flattened copy of a strided member first)
    and launch its all_reduce; returns a handle for ``wait_bucket``."""
    if torch.compiler.is_compiling():  # see _compiled_flat
        return current().start_all_reduce(_compiled_flat([t.reshape(-1) for t in members], 0), mesh_dim, op)
    if all(t.is_contiguous() for t in members):  # one cat call (3 calls a member by slices)
        flat = torch.cat([t.view(-1) for t in members])
    else:  # strided members copied straight into their places, in one foreach call
        flat = members[0].new_empty(sum(t.numel() for t in members))
        places, off = [], 0
        for t in members:
            places.append(flat.as_strided(t.shape, _contiguous_strides(tuple(t.shape)), off))
            off += t.numel()
        torch._foreach_copy_(places, list(members))
    return current().start_all_reduce(flat, mesh_dim, op)


def wait_bucket(handle) -> torch.Tensor:
    """The reduced flat buffer of a launched bucket (waits for it, with the backend's timeouts)."""
    return handle.wait()


def bucket_reduce_scatter(members: tuple, mesh_dim: int, op: str, splits: tuple):
    """Reduce-scatter several tensors in one call: member i (split along ``splits[i] = (dim,
    sizes)`` into the group's chunks, each padded to the largest) becomes an [n, chunk numel]
    block; the blocks side by side make one [n, total] buffer whose row k goes to member k.
    Returns a handle for ``wait_bucket`` (its result: this rank's [total] row, reduced). Each
    piece is copied straight into its padded place in the one buffer (no padded copies first)."""
    if torch.compiler.is_compiling():  # see _compiled_flat
        rows = [torch.stack([_padded(piece, d, max(sizes)) for piece in x.split(list(sizes), d)]).flatten(1)
                for x, (d, sizes) in zip(members, splits)]
        return current().start_reduce_scatter(_compiled_flat(rows, 1), mesh_dim, op)
    blocks = [tuple(x.shape[:d]) + (max(sizes),) + tuple(x.shape[d + 1:]) for x, (d, sizes) in zip(members, splits)]
    total = sum(math.prod(b) for b in blocks)
    buf = members[0].new_zeros((len(splits[0][1]), total))
    places, pieces, off = [], [], 0
    for x, (d, sizes), block in zip(members, splits, blocks):
        strides = _contiguous_strides(block)  # the piece's place: the head of its padded block
        for i, piece in enumerate(x.split(list(sizes), d)):
            places.append(buf.as_strided(piece.shape, strides, i * total + off))
            pieces.append(piece)
        off += math.prod(block)
    torch._foreach_copy_(places, pieces)  # one call for every piece of every member
    return current().start_reduce_scatter(buf, mesh_dim, op)


def _compiled_flat(pieces: list, dim: int) -> torch.Tensor:
    """A bucket's buffer under torch.compile: one ``cat``. Eager's copies into narrowed slices of
    one buffer trace as a chain of ``slice_scatter``s, which inductor fuses into one loop over the
    whole buffer testing every member's range per element (slow for a bucket of many members); a
    cat lowers on CPU to each member written straight into its slice."""
    return torch.cat(pieces, dim)


def _padded(piece: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``piece`` zero-padded at the end of ``dim`` to ``size``."""
    short = size - piece.shape[dim]
    if not short:
        return piece
    return torch.cat([piece, piece.new_zeros(piece.shape[:dim] + (short,) + piece.shape[dim + 1:])], dim)


def bucket_chunk(flat: torch.Tensor, offset: int, shape: tuple, dim: int, length: int) -> torch.Tensor:
    """One member's reduce-scattered chunk: its padded block of the row, narrowed to this
    rank's ``length`` along ``dim`` (contiguous, as comm.reduce_scatter's)."""
    return bucket_piece(flat, offset, shape).narrow(dim, 0, length).contiguous()


def bucket_piece(flat: torch.Tensor, offset: int, shape: tuple) -> torch.Tensor:
    """One member's result: a contiguous view of the reduced buffer (one ``as_strided`` call in
    eager, where narrow + view is two: a data-parallel step takes one piece per gradient)."""
    if torch.compiler.is_compiling() or not flat.is_contiguous():
        return flat.narrow(0, offset, math.prod(shape)).view(shape)
    return flat.as_strided(shape, _contiguous_strides(shape), flat.storage_offset() + offset)


def bucket_scalar(flat: torch.Tensor, offset: int) -> torch.Tensor:
    """A scalar member's result (the loss) copied out of the reduced buffer, which it would
    otherwise keep alive as long as the caller keeps the loss."""
    return flat[offset].clone()


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


# -- the pass ----------------------------------------------------------------------------
class _Bucket:
    def __init__(self, key):
        self.key, self.members, self.bytes = key, [], 0
        self.launch_pos, self.first_use = -1, float("inf")


_KINDS = (comm.all_reduce, comm.reduce_scatter)


def _key(n: fx.Node) -> tuple:
    """Calls that may share a bucket: kind, mesh dim, reduce op, dtype, and for reduce_scatters
    the FSDP unit of the value (trace/provenance.fsdp_unit). A scalar (the loss) shares the
    gradients' bucket: one round trip less a step (DDP's loss is each rank's own and costs none),
    its result a copy (``bucket_scalar``), never a view the caller's loss would keep the buffer
    alive by."""
    if n.target is comm.all_reduce:
        return (n.target.__name__, n.args[1], n.args[2], n.meta["sw_step"].src.dtype)
    return (n.target.__name__, n.args[1], n.args[4], n.meta["sw_step"].src.dtype, n.meta.get("sw_src_unit"))


def _candidates(graph: fx.Graph, pos: dict) -> list:
    ars = [n for n in graph.nodes if n.op == "call_function" and n.target in _KINDS
           and "sw_step" in n.meta and isinstance(n.args[0], fx.Node) and len(n.args) == (3 if n.target
                                                                                  is comm.all_reduce else 5)]
    ids = set(ars)
    out = []
    for n in ars:
        if n.args[0] in ids or not n.users:  # a chain's later step: the next pass's (its input a piece then)
            continue
        out.append(n)
    return sorted(out, key=lambda n: (pos[n.args[0]], pos[n]))


def plan_buckets(graph: fx.Graph, mesh, cap: int) -> list:
    """Group the graph's independent all_reduce calls into buckets (see the module docstring)."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    floor = max((i for n, i in pos.items() if n.op == "placeholder"), default=-1)  # launch after the arguments
    open_: dict = {}
    done = []
    for n in _candidates(graph, pos):
        step = n.meta["sw_step"]
        key = _key(n)
        size = step.src.max_local_numel(mesh) * step.src.itemsize  # the busiest rank's, ranks unvisited
        at, first = max(pos[n.args[0]], floor), min(pos[u] for u in n.users)
        b = open_.get(key)
        if b is not None and (b.bytes + size > cap or b.first_use <= at):
            done.append(open_.pop(key))
            b = None
        if b is None:
            b = open_[key] = _Bucket(key)
        b.members.append(n)
        b.bytes += size
        b.launch_pos, b.first_use = max(b.launch_pos, at), min(b.first_use, first)
    nodes = list(graph.nodes)
    return [b for b in done + list(open_.values()) if len(b.members) > 1 or _overlaps(b, nodes)]


def _overlaps(b: _Bucket, nodes: list) -> bool:
    """Whether some computation could run while the bucket is in flight: a one-member bucket
    without any stays the plain all_reduce where it was (a tensor-parallel partial sum read at
    once gains nothing from a flat copy and a handle)."""
    return any(n.op == "call_function" and n not in b.members for n in nodes[b.launch_pos + 1:b.first_use])


def owned_all_reduce(x: torch.Tensor, mesh_dim: int, op: str = "sum") -> torch.Tensor:
    """comm.all_reduce of a value nothing else reads or aliases: the backend may reduce it in
    place (torch: no copy of the buffer; threads: a new result as always)."""
    return current().start_all_reduce(x if x.is_contiguous() else x.contiguous(), mesh_dim, op).wait()




def _owned(x) -> bool:
    """Whether the program owns ``x``'s buffer outright: a fresh result of an aten op (no aliased
    return; through a debug shape guard, or a reshape of such a result) read by nothing but one
    call. aten._unsafe_view aliases its input although its schema does not say so (matmul's
    reshape of its mm): it is owned only when that input is."""

    if not isinstance(x, fx.Node) or len(x.users) != 1:
        return False
    if x.op == "call_function" and x.target is shape_guard:
        x = x.args[0]
        if not isinstance(x, fx.Node) or len(x.users) != 1:
            return False
    op = x.target
    if x.op == "call_function" and op in RESHAPES and is_view_op(op):  # a view of the same contiguous buffer
        return _owned(x.args[0])
    return (x.op == "call_function" and isinstance(op, torch._ops.OpOverload) and not op.is_view
            and all(r.alias_info is None for r in op._schema.returns))


def reduce_owned_in_place(graph: fx.Graph) -> fx.Graph:
    """Plain all_reduces of values the program owns become ``owned_all_reduce`` (in place)."""
    for n in graph.nodes:
        if (n.op == "call_function" and n.target is comm.all_reduce and len(n.args) == 3 and not n.kwargs
                and _owned(n.args[0])):
            n.target = owned_all_reduce
    return graph


def bucket_program(graph: fx.Graph, mesh, rank: int, cap: int) -> fx.Graph:
    """``graph`` with its independent all_reduces bucketed, launched early and waited for late,
    and the remaining all_reduces of owned values reduced in place: rewritten in place (a copy
    of the graph would cost as much as building it), and returned. A chain's later steps are
    bucketed by the passes after the first (HSDP: the replicate dim's all_reduce of a gradient
    chunk, launched as its reduce_scatter bucket is waited for, not one call each at the end)."""
    made = 0
    while n := _bucket_pass(graph, mesh, rank, cap, made):  # each pass takes one more step of the chains
        made += n
    return reduce_owned_in_place(graph)


def _bucket_pass(graph: fx.Graph, mesh, rank: int, cap: int, first: int) -> int:
    """Bucket ``graph``'s candidates in place (buckets numbered from ``first``); how many were made."""
    buckets = sorted(plan_buckets(graph, mesh, cap), key=lambda b: b.launch_pos)  # numbered in launch order
    if not buckets:
        return 0
    nodes = list(graph.nodes)
    launch_after: dict = {}
    wait_before: dict = {}
    for i, b in enumerate(buckets):
        launch_after.setdefault(nodes[b.launch_pos], []).append((i, b))
        wait_before.setdefault(nodes[b.first_use], []).append((i, b))
    handles: dict = {}
    scattering = None  # (index, bucket) of the last reduce_scatter bucket launched
    at = None  # the node the next call is placed after: calls keep the order they are made in

    def emit(fn, args):
        nonlocal at
        with graph.inserting_after(at):
            at = graph.call_function(fn, args)
        return at

    def wait(i, b):
        flat = emit(wait_bucket, (handles.pop(i),))
        flat.name = f"bucket{first + i}_reduced"
        off = 0
        for m in b.members:
            call, size = _piece(m, flat, off, mesh, rank)
            piece = emit(*call)
            m.replace_all_uses_with(piece)  # every read comes after the bucket's first_use
            graph.erase_node(m)
            piece.name = m.name  # the erased member's name (a new name would be suffixed: still taken)
            off += size

    for n in nodes:
        if n not in wait_before and n not in launch_after:  # (members among them: erased on the way)
            continue
        at = n.prev  # (a member erased below only once the first call has moved past it)
        for i, b in wait_before.get(n, ()):
            if i in handles:  # (a reduce_scatter bucket may have been waited for already, below)
                wait(i, b)
        at = n
        for i, b in launch_after.get(n, ()):
            kind, mesh_dim, op = b.key[:3]
            ins = tuple(m.args[0] for m in b.members)
            if kind == "all_reduce":
                h = emit(bucket_all_reduce, (ins, mesh_dim, op))
            else:
                # the previous reduce_scatter bucket is waited for before this one's buffer is made, as
                # FSDP2 frees a unit's unsharded gradients once their reduce_scatter is done: its
                # [group size, total] input would otherwise live to the end of backward, every
                # unit's at once (the whole model's gradients, unsharded); it had the backward of
                # this unit to run in
                if scattering is not None and scattering[0] in handles:
                    wait(*scattering)
                scattering = (i, b)
                h = emit(bucket_reduce_scatter, (ins, mesh_dim, op, tuple((m.args[2], m.args[3]) for m in b.members)))
            h.name = f"bucket{first + i}"
            handles[i] = h
    return len(buckets)


def _piece(m: fx.Node, flat, off: int, mesh, rank: int):
    """(the call that takes member ``m``'s result out of a reduced bucket, its numel there)."""
    shape = tuple(m.meta["sw_step"].src.local_shape(mesh, rank))
    if m.target is comm.all_reduce:
        return ((bucket_scalar, (flat, off)) if shape == () else (bucket_piece, (flat, off, shape))), math.prod(shape)
    _, mesh_dim, dim, sizes, _ = m.args
    block = shape[:dim] + (max(sizes),) + shape[dim + 1:]
    mine = sizes[mesh.coord(rank)[mesh_dim]]
    return (bucket_chunk, (flat, off, block, dim, mine)), math.prod(block)
