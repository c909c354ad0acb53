"""Tracing leaves no trace: the user's module and torch's random state as the trace found them.

The trace runs the model's forward on fake tensors. A forward that keeps what it computes on
itself (``if self.cache is None: self.cache = ...``; Hugging Face's long-rope ``long_inv_freq``)
would hold a FakeTensor afterwards: the user's own ``model(x)`` then returns fake tensors and the
next trace bakes the fake in as a constant. So every module's attributes, parameters, buffers and
submodules, and the contents of the lists, dicts and sets it holds, are put back as they were;
the forward's own computation of that state is in the graph, as one device would run it. A fake
tensor still reachable from the model after that (deeper in an object the forward changed) is
refused, naming where it is.

A random-state change inside the traced step (``torch.manual_seed``, ``torch.set_rng_state``,
``torch.random.fork_rng`` called by the model or the loss) would run once, at trace time, and be
missing from the program: the program draws from the state the default generator has when the
step starts (rules/random.py), so its numbers would differ from one device's. It is refused with
the user's line, and the default generator is left as it was found.
"""
from __future__ import annotations

import contextlib
import copy
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .errors import _SHARDWISE, _TORCH, TraceError
from .patching import TracingPatch

_CONTAINERS = (list, dict, set)
RANDOM_STATE_FIX = ("seed outside the traced step: call torch.manual_seed(...) (or set the generator's state) before "
                    "pm.step / pm(...), not inside forward or the loss. shardwise's random ops draw from the state "
                    "the default generator has when the step starts, as one device would")


def _held(value) -> bool:
    """A container whose items a forward may change in place (a module's hook dicts are OrderedDicts)."""
    return isinstance(value, _CONTAINERS)


def _restore_container(now, then) -> None:
    """Put ``then``'s items back into the container ``now`` (the same object, changed in place)."""
    if not _same_items(now, then):
        now.clear()
        now.update(then) if isinstance(now, (dict, set)) else now.extend(then)


def _same_items(now, then) -> bool:
    """By identity (a tensor's ``==`` is elementwise; membership tests identity first)."""
    if len(now) != len(then):
        return False
    if isinstance(now, dict):
        return all(k in then and now[k] is then[k] for k in now)
    if isinstance(now, set):
        return all(x in then for x in now)
    return all(a is b for a, b in zip(now, then))


class _ModuleState:
    """One module's ``__dict__`` (its attributes, and the dicts of its parameters, buffers and
    submodules) and the contents of the containers it holds, kept by reference."""

    __slots__ = ("module", "attrs", "held")

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.attrs = dict(module.__dict__)
        self.held = {k: copy.copy(v) for k, v in self.attrs.items() if _held(v)}

    def restore(self) -> None:
        now = self.module.__dict__
        for k in [k for k in now if k not in self.attrs]:
            del now[k]
        for k, v in self.attrs.items():
            if now.get(k, self) is not v:
                now[k] = v
            if k in self.held:
                _restore_container(v, self.held[k])


def _fake_paths(obj, path: str, seen: set, depth: int = 0):
    """Where a FakeTensor is reachable from ``obj`` (modules, their attributes, containers and plain
    objects' attributes, a few levels deep)."""
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, FakeTensor):
        yield path
    elif isinstance(obj, torch.Tensor):
        return
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield from _fake_paths(v, f"{path}[{k!r}]", seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(list(obj)):
            yield from _fake_paths(v, f"{path}[{i}]", seen, depth + 1)
    elif isinstance(obj, torch.nn.Module) or (hasattr(obj, "__dict__") and type(obj).__module__ != "builtins"
                                              and not isinstance(obj, type)):
        for k, v in list(vars(obj).items()):
            yield from _fake_paths(v, f"{path}.{k}", seen, depth + 1)


def fake_tensors_in(model: torch.nn.Module, name: str = "model") -> list[str]:
    """The paths at which a FakeTensor is reachable from ``model`` (none after a trace)."""
    return list(_fake_paths(model, name, set()))


@contextlib.contextmanager
def model_as_found(model: torch.nn.Module):
    """Trace ``model`` inside: afterwards (also on an error) its state is put back as it was, and
    torch's default generator too; a random-state change made by the traced code is refused."""
    states = [_ModuleState(m) for m in model.modules()]
    rng = torch.random.get_rng_state()
    failed = False
    try:
        with random_state_refused():
            yield
    except BaseException:
        failed = True
        raise
    finally:
        for s in states:
            s.restore()
        moved = not torch.equal(torch.random.get_rng_state(), rng)
        if moved:
            torch.random.set_rng_state(rng)
    if moved and not failed:
        raise TraceError("the traced step changed torch's default random generator (a seed or generator state set "
                         "inside forward or the loss); the program would not repeat it", fix=RANDOM_STATE_FIX)
    left = fake_tensors_in(model)
    if left:
        raise TraceError(f"the model's forward stored a traced (fake) tensor where shardwise cannot put the old value "
                         f"back: {', '.join(left[:4])}",
                         fix="keep tensors a forward caches on the module itself (an attribute, a buffer, a list or "
                             "dict attribute), or compute them in __init__")


_PATCH = TracingPatch()
_GUARDED = (("manual_seed", torch.random), ("manual_seed", torch), ("seed", torch.random), ("seed", torch),
            ("set_rng_state", torch.random), ("set_rng_state", torch), ("fork_rng", torch.random))


def _user_line(frame) -> str:
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


# Callers whose random-state calls go through: torch.utils.checkpoint replays the forward's state in
# its recomputation (which trace/recompute.py makes read the forward's draws) and fork_rng sets the
# state back at its end. Any other caller, torch's test helpers (OpInfo's seeded wrappers) included,
# is the step's own code.
_ALLOWED = tuple(_TORCH + f for f in ("utils/checkpoint.py", "random.py"))


def _refusing(name: str, original):
    """``original``, refused when the tracing thread's caller is the traced step's own code."""
    def guarded(*args, **kwargs):
        caller = sys._getframe(1)
        where = caller.f_code.co_filename
        if _PATCH.active and not (where.startswith(_ALLOWED) or where.startswith(_SHARDWISE)):
            line = _user_line(caller)
            raise TraceError(f"torch.{name} is called inside the traced step (source: {line}); the program would not "
                             f"repeat it, so its random numbers would differ from one device's", source=line,
                             fix=RANDOM_STATE_FIX)
        return original(*args, **kwargs)

    guarded.__wrapped__ = original
    return guarded


def _install():
    saved = [(mod, name, getattr(mod, name)) for name, mod in _GUARDED]
    for mod, name, fn in saved:
        setattr(mod, name, _refusing(name, fn))

    def undo():
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    return undo


def random_state_refused():
    """While open on this thread: the user's code calling a seed / random-state setter raises."""
    return _PATCH.opened(_install)
