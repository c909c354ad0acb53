"""Sharded checkpoints through torch.distributed.checkpoint (DCP): save on one mesh and placements,
load on another, parameters and optimizer state bit for bit; DTensor / FSDP2 jobs read and write
the same format.

    pm.save("ckpt/step100", optimizer=opt)      # every rank's shards, each region written once
    pm2.load("ckpt/step100", optimizer=opt2)    # pm2 on any mesh / placements
    dcp.save(pm.sharded_state_dict(opt), checkpoint_id=...)   # or drive DCP yourself

Modules: chunks (shards as DCP chunks), state (the sharded state dict), restore (targets from a
checkpoint's metadata), io (save/load, atomic replace), full (one device's optimizer state),
dtensor (DTensor views and interop).
"""
from .chunks import ShardChunks, rank_chunks
from .dtensor import device_mesh, dtensor_placements, dtensor_state, to_dtensors
from .full import optimizer_state_dict
from .io import load, save
from .restore import apply_groups
from .state import sharded_state_dict

__all__ = ["ShardChunks", "rank_chunks", "device_mesh", "dtensor_placements", "dtensor_state", "to_dtensors",
           "optimizer_state_dict", "load", "save", "sharded_state_dict", "apply_groups"]
