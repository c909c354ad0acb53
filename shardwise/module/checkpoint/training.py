"""The training state beside the weights: the step, each rank's random generators (rng.py), the
optimizer's count of skipped steps and the user's ``extra`` dict (data position, scheduler).

Stored in the DCP checkpoint as one pickled entry per rank, ``train.rank<r>``, written by the
process holding rank ``r`` (the threads backend's one process writes every rank's, all alike).
A load reads the entries of the ranks this process holds: step and ``extra`` from the first of
them, and the generators when every held rank has one and, in one process, they agree.
"""
from __future__ import annotations

import pickle
import warnings

from ...core.errors import CheckpointError, ConfigError
from . import rng

TRAIN = "train"


class CheckpointWarning(UserWarning):
    """Something a load could not restore, or a checkpoint passed over; the message says which."""


def saved_step(step, extra):
    """The step to record: ``step``, else ``extra["step"]``, else None; both and unequal raises."""
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError(f"extra must be a dict, got {type(extra).__name__}",
                          fix="pass extra={'data': loader.state_dict(), ...}")
    inner = (extra or {}).get("step")
    if step is not None and inner is not None and inner != step:
        raise ConfigError(f"step={step!r} but extra['step']={inner!r}", fix="give the step once")
    return step if step is not None else inner


def train_state(pm, optimizer, step, extra) -> dict:
    """{"train": {"rank<r>": bytes}} for the ranks held here (generators as they are now)."""
    body = {"step": step, "extra": dict(extra or {}), "rng": rng.capture(), "world": pm.mesh.size}
    if optimizer is not None:
        body["skipped_steps"] = getattr(optimizer, "skipped_steps", 0)
    try:
        blob = pickle.dumps(body)
    except Exception as e:  # noqa: BLE001 - the user's extra, most likely
        raise ConfigError(f"the checkpoint's extra dict cannot be pickled: {e}",
                          fix="put plain values and tensors in extra (state_dict() of loaders and schedulers)") from e
    return {TRAIN: {f"rank{r}": blob for r in sorted(pm.shards)}}


def saved_ranks(md) -> set[int]:
    """Ranks with a train entry in a checkpoint's metadata (empty for one saved without it)."""
    head = f"{TRAIN}.rank"
    return {int(k[len(head):]) for k in md.state_dict_metadata if k.startswith(head) and k[len(head):].isdigit()}


def train_targets(pm, md) -> dict:
    """What to read: the entries of the ranks held here and the first saved one (step and extra
    for a process whose ranks have none); every rank's when some held rank has none (saved on
    fewer ranks: their generators may all be one). {} for a checkpoint without training state."""
    saved = saved_ranks(md)
    if not saved:
        return {}
    held = set(pm.shards)
    want = saved if not held <= saved else (held & saved) | {min(saved)}
    return {TRAIN: {f"rank{r}": None for r in sorted(want)}}


def apply(pm, optimizer, loaded: dict, rng_mode, where: str) -> dict:
    """Restore what ``loaded`` (the filled train_targets) holds; returns extra + "step"."""
    if not loaded:
        return {"step": None}
    states = {int(k[4:]): pickle.loads(v) for k, v in loaded[TRAIN].items()}
    held = sorted(pm.shards)
    main = states[min(set(held) & set(states), default=min(states))]
    if rng_mode is not False:
        _restore_rng({r: s["rng"] for r, s in states.items()}, held, rng_mode, where)
    if optimizer is not None and "skipped_steps" in main:
        optimizer.skipped_steps = main["skipped_steps"]
    return {**main["extra"], "step": main["step"]}


def _restore_rng(saved: dict, held: list, strict, where: str) -> None:
    """One process has one set of generators: restore it from the held ranks' saved states if
    they agree (a rank not saved takes the state every saved rank agrees on)."""
    first = saved[min(saved)]
    uniform = all(rng.same(s, first) for s in saved.values())
    missing = [r for r in held if r not in saved]
    if missing and not uniform:
        why = (f"checkpoint {where} holds the random generators of ranks {sorted(saved)}, which differ, and none "
               f"for rank(s) {missing} held here (it was saved on another number of ranks)")
    elif not all(rng.same(saved.get(r, first), saved.get(held[0], first)) for r in held):
        why = (f"checkpoint {where} holds different random generators for ranks {held}, which this one process "
               "holds (one generator serves them all)")
    else:
        rng.restore(saved.get(held[0], first))
        return
    fix = "load with rng=False to keep this process's generators, or resume on the mesh and backend that saved it"
    if strict:
        raise CheckpointError(why, fix=fix)
    warnings.warn(f"{why}: the generators were not restored", CheckpointWarning, stacklevel=5)
