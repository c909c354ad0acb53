"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save on one mesh and placements,
load on another, parameters and optimizer state bit for bit; DTensor / FSDP2 jobs read and write
the same format. With them the training state (step, random generators, a user dict), so a run
resumes as it was.

    pm.save("ckpt/step100", optimizer=opt, extra={"data": ...})   # every rank's shards, each region once
    info = pm2.load("ckpt/step100", optimizer=opt2)    # pm2 on any mesh / placements; extra + "step"
    ck = Checkpointer("ckpt", every=100); start = ck.resume(pm, opt); ck.step(step)   # a training loop's
    dcp.save(pm.sharded_state_dict(opt), checkpoint_id=...)   # or drive DCP yourself

Modules: chunks (shards as DCP chunks), state (the sharded state dict), restore (targets from a
checkpoint's metadata), io (save/load, atomic replace), manifest (sizes and checksums, checked on
load), training and rng (step, generators, extra), staging (CPU copies for background saves),
checkpointer (the training loop's Checkpointer), sync (agreeing processes), full (one device's
optimizer state), dtensor (DTensor views and interop).
"""
from .checkpointer import Checkpointer
from .chunks import ShardChunks, rank_chunks
from .dtensor import device_mesh, dtensor_placements, dtensor_state, to_dtensors
from .full import optimizer_state_dict
from .io import load, save
from .restore import apply_groups
from .state import sharded_state_dict
from .training import CheckpointWarning

__all__ = ["Checkpointer", "CheckpointWarning", "ShardChunks", "rank_chunks", "device_mesh", "dtensor_placements", "dtensor_state", "to_dtensors",
           "optimizer_state_dict", "load", "save", "sharded_state_dict", "apply_groups"]
