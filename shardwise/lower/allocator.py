"""What PyTorch's CUDA caching allocator reserves for a sequence of allocations: its block rules replayed.

    r = replay([("x", 3 << 20), ("y", 1 << 20), ("x", None), ...], expandable=True)
    r.reserved, r.allocated      # peak bytes held from the device, peak bytes of blocks in use

A training run's memory as ``torch.cuda.max_memory_reserved`` reports it (torchtitan logs it as
"max_reserved") is more than its live tensors: the allocator rounds each request to 512 bytes,
serves it from the smallest cached free block that fits (splitting it), never moves a block, and
asks the device for more only when no cached block fits. Freed blocks of one step are refilled
by the next step's allocations in a different order, so large requests (a loss over a 128k-word
vocabulary) can find no contiguous free block and grow the reserve above the live peak. The
rules, from c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x):

- sizes are rounded up to a multiple of 512 bytes (``kMinBlockSize``); requests up to 1 MiB
  (``kSmallSize``) use the small pool, larger ones the large pool, each with its own blocks;
- best fit: the smallest free block of the pool at least the rounded size, the lowest address
  among equals; the rest of the block is split off as a free block when it is at least 512
  bytes (small pool, or expandable segments) or more than 1 MiB (large pool);
- a freed block merges with free neighbours of the same segment;
- with no fitting block, classic segments (PyTorch's default) ``cudaMalloc`` a new segment of
  2 MiB (small requests), 20 MiB (requests under 10 MiB) or the request rounded up to 2 MiB;
  expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, as torchtitan
  runs) keep one growing segment per pool and map pages (2 MiB small, 20 MiB large) at its end,
  merged with a free block that ends it;
- nothing is given back (``empty_cache`` aside): the reserve is the peak of the segments held.

Not modelled: streams (every block is the one compute stream's; FSDP2's gather and reduce
streams keep their own pools), the release-and-retry the allocator does at the device's limit
(a reserve above the device's memory means retries there, not an out-of-memory error, while the
live bytes fit), ``max_split_size_mb`` and ``roundup_power2_divisions``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512          # kMinBlockSize: every size rounded up to a multiple of it
SMALL_SIZE = 1 << 20     # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20   # kSmallBuffer: a small pool segment (and an expandable small page)
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a segment for requests under kMinLargeAlloc (and a large page)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20    # kRoundLarge: larger segments rounded up to it
ALLOCATORS = ("expandable", "segments")  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and torch's default
# how the reports name each (the calculator's text, the plan report's text and HTML)
ALLOCATOR_NAMES = {"expandable": "expandable segments", "segments": "classic segments"}


@dataclass(frozen=True)
class Reserve:
    """Peaks of one replay: ``reserved`` bytes held from the device, ``allocated`` bytes of the
    blocks in use (rounded sizes), ``requested`` bytes the program asked for (unrounded),
    ``segments`` device allocations made (expandable: page mappings)."""

    reserved: int
    allocated: int
    requested: int
    segments: int


def round_size(nbytes: int) -> int:
    """The block size a request of ``nbytes`` takes (round_size in the allocator)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    """The ``cudaMalloc`` a classic segment makes for a rounded request (get_allocation_size)."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


class _Pool:
    """One pool's blocks: free ones in a (size, address) order for best fit; every block by its start
    and end address for merging; each block's segment so that merges stay inside one."""

    def __init__(self, small: bool, expandable: bool):
        self.small, self.expandable = small, expandable
        self.free: list = []        # sorted (size, address)
        self.size: dict = {}        # address -> size, every block
        self.used: set = set()      # addresses of blocks in use
        self.by_end: dict = {}      # end address -> start address
        self.segment: dict = {}     # address -> segment id
        self.reserved = 0
        self.segments = 0
        self.end = 0                # the next address of a new segment, or the expandable segment's mapped end

    def _add(self, addr: int, size: int, seg: int, used: bool) -> None:
        self.size[addr], self.segment[addr], self.by_end[addr + size] = size, seg, addr
        if used:
            self.used.add(addr)
        else:
            bisect.insort(self.free, (size, addr))

    def _drop(self, addr: int) -> int:
        size = self.size.pop(addr)
        del self.by_end[addr + size], self.segment[addr]
        if addr in self.used:
            self.used.discard(addr)
        else:
            del self.free[bisect.bisect_left(self.free, (size, addr))]
        return size

    def _split_ok(self, remaining: int) -> bool:
        return remaining >= MIN_BLOCK if (self.small or self.expandable) else remaining > SMALL_SIZE

    def alloc(self, size: int) -> int:
        i = bisect.bisect_left(self.free, (size, -1))
        if i == len(self.free):
            addr, seg = self._grow(size)
        else:
            _, addr = self.free[i]
            seg = self.segment[addr]
        block = self._drop(addr)
        if self._split_ok(block - size):
            self._add(addr, size, seg, True)
            self._add(addr + size, block - size, seg, False)
        else:
            self._add(addr, block, seg, True)
        return addr

    def _grow(self, size: int) -> tuple:
        """(address, segment) of a new free block of at least ``size`` bytes: a new segment, or
        the expandable segment's free end extended by whole pages."""
        if not self.expandable:
            seg_bytes = segment_size(size)
            addr, self.end = self.end, self.end + seg_bytes + LARGE_BUFFER  # a gap: segments never merge
            self.reserved += seg_bytes
            self.segments += 1
            self._add(addr, seg_bytes, self.segments, False)
            return addr, self.segments
        page = SMALL_BUFFER if self.small else LARGE_BUFFER
        tail = self.by_end.get(self.end)
        tail = tail if tail is not None and tail not in self.used else None
        have = self.size[tail] if tail is not None else 0
        more = -(-(size - have) // page) * page
        start = tail if tail is not None else self.end
        if tail is not None:
            self._drop(tail)
        self.end += more
        self.reserved += more
        self.segments += 1
        self._add(start, self.end - start, 0, False)
        return start, 0

    def release(self, addr: int) -> None:
        """Free the block at ``addr``, merged with free neighbours of its segment."""
        seg = self.segment[addr]
        start = addr
        end = addr + self._drop(addr)
        prev = self.by_end.get(addr)
        if prev is not None and prev not in self.used and self.segment[prev] == seg:
            start = prev
            self._drop(prev)
        if end in self.size and end not in self.used and self.segment[end] == seg:
            end += self._drop(end)
        self._add(start, end - start, seg, False)


def replay(events, expandable: bool = False) -> Reserve:
    """Replay ``events``, each ``(key, nbytes)`` (allocate) or ``(key, None)`` (free ``key``), through
    the allocator's rules (module docstring) and give the peaks."""
    pools = {True: _Pool(True, expandable), False: _Pool(False, expandable)}
    where: dict = {}  # key -> (pool, address, rounded bytes, requested bytes)
    allocated = requested = 0
    peak_alloc = peak_req = peak_res = 0
    for key, nbytes in events:
        if nbytes is None:
            pool, addr, size, asked = where.pop(key)
            pool.release(addr)
            allocated -= size
            requested -= asked
            continue
        if key in where:
            raise ValueError(f"allocation {key!r} made twice without a free")
        size = round_size(nbytes)
        pool = pools[size <= SMALL_SIZE]
        addr = pool.alloc(size)
        size = pool.size[addr]  # an unsplit remainder stays part of the block
        where[key] = (pool, addr, size, nbytes)
        allocated += size
        requested += nbytes
        peak_alloc, peak_req = max(peak_alloc, allocated), max(peak_req, requested)
        peak_res = max(peak_res, pools[True].reserved + pools[False].reserved)
    return Reserve(peak_res, peak_alloc, peak_req, pools[True].segments + pools[False].segments)


def reserves(events) -> dict:
    """{allocator: Reserve} of ``events`` replayed with each of ALLOCATORS."""
    return {mode: replay(events, expandable=mode == "expandable") for mode in ALLOCATORS}


def training_events(resident, params, intervals, temps, positions: int, steps: int = 3,
                    state: float = 2.0) -> list:
    """The allocation events of ``steps`` training steps of one program (lower/memory.py's
    MemoryEstimate: ``resident`` bytes per argument storage, ``params`` of them the parameters',
    ``intervals`` (allocated, last read, bytes, ...) over ``positions`` program positions, ``temps``
    (position, bytes) dropped by the node that made them): the arguments allocated once; each
    step's storages in program order, a value made and freed after its last read; after each
    step the optimizer's update: at the first, its state per parameter, ``state`` times its bytes
    (CostModel.optimizer_state: AdamW's two moments, zeros_like each), kept; with two or more,
    AdamW's one foreach temporary per parameter (the square root of the second moment) each
    step; then what outlived the step (the gradients) freed, as ``zero_grad(set_to_none=True)``."""
    starts: dict = {}
    ends: dict = {}
    for j, (a, d, b, *_) in enumerate(intervals):
        starts.setdefault(a, []).append((j, b))
        ends.setdefault(d, []).append(j)
    spikes = dict(temps)
    events = [(("arg", i), b) for i, b in enumerate(resident)]
    params = list(params)
    for s in range(steps):
        for p in range(positions):
            events += [((s, j), b) for j, b in starts.get(p, ())]
            if p in spikes:
                events += [((s, "tmp", p), spikes[p]), ((s, "tmp", p), None)]
            events += [((s, j), None) for j in ends.get(p, ())]
        if s == 0:
            whole, part = int(state), state - int(state)
            for i, b in enumerate(params):
                events += [(("state", i, m), b) for m in range(whole)]
                events += [(("state", i, "part"), round(part * b))] if part * b >= 1 else []
        if state >= 2:
            events += [((s, "adam", i), b) for i, b in enumerate(params)]
            events += [((s, "adam", i), None) for i in range(len(params))]
        events += [((s, j), None) for j in ends.get(positions, ())]
    return events
