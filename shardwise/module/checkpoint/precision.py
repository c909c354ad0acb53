"""What a checkpoint says about precision: the mixed-precision policy of the run that saved it and
the dtype of its masters (the parameters it wrote), under "precision" in the checkpoint's manifest
(manifest.py).

A mixed-precision run saves its fp32 masters and their optimizer state (never the bf16 compute
copies: each rank's program makes those afresh). Loading into a run with another policy, or none,
loads those masters as they are; where the target's parameters have another dtype (a model cast
to bf16) DCP casts them. Either way ``load`` says what it did (a PrecisionWarning), never silently.
"""
from __future__ import annotations

import warnings

KEY = "precision"  # the manifest's entry


class PrecisionWarning(UserWarning):
    """A checkpoint loaded into a run of another precision: what was loaded into what."""


def _name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def describe(pm) -> dict:
    """{"mixed_precision": {field: dtype name} or None, "masters": {dtype name: parameters}}."""
    mp = pm.options.mixed_precision
    policy = None if mp is None else {f: _name(getattr(mp, f)) for f in ("param_dtype", "reduce_dtype", "output_dtype")}
    masters: dict = {}
    # the shards are cut from the model's parameters in their dtype (the masters); read the model's,
    # since a rank may hold some parameters only (a pipeline stage), and every process must agree
    for _, p in pm.model.named_parameters():
        masters[_name(p.dtype)] = masters.get(_name(p.dtype), 0) + 1
    return {"mixed_precision": policy, "masters": masters}


def info(pm) -> dict:
    """The manifest's entry for a checkpoint of ``pm``."""
    return {KEY: describe(pm)}


def report(pm, manifest: dict | None, directory) -> str | None:
    """What loading the checkpoint at ``directory`` (its ``manifest``, None when it has none) into
    ``pm`` does about precision, when the two differ (warned too)."""
    saved = (manifest or {}).get(KEY)
    if saved is None:  # no manifest, or one written without a precision entry (dcp.save, older shardwise)
        return None
    now = describe(pm)
    if saved == now:
        return None
    def policy(p):
        return "no mixed precision" if p is None else "MixedPrecision(" + ", ".join(
            f"{k}={v}" for k, v in p.items() if v) + ")"

    def masters(m):
        return "/".join(sorted(m))

    msg = (f"checkpoint {directory!r} was saved by a run with {policy(saved['mixed_precision'])} and "
           f"{masters(saved['masters'])} masters; loaded into this run ({policy(now['mixed_precision'])}, "
           f"{masters(now['masters'])} masters): its masters and optimizer state were loaded as saved")
    if saved["masters"] != now["masters"]:
        msg += f", cast from {masters(saved['masters'])} to {masters(now['masters'])}"
    if now["mixed_precision"] is not None:
        msg += f"; this run computes with copies in {now['mixed_precision']['param_dtype']} made from them"
    warnings.warn(msg, PrecisionWarning, stacklevel=3)
    return msg


__all__ = ["PrecisionWarning", "describe", "info", "report"]
