"""Forward calls without a model's KV cache (Hugging Face's ``use_cache``).

    kwargs = KVCache(model).drop(kwargs, per_rank=None)   # use_cache=False where a cache would come back

A traced graph returns tensors only, and a Hugging Face causal LM's forward returns its KV cache
(a ``DynamicCache``) beside the logits whenever ``use_cache`` is on, as it is by default in
their configs. Forward calls (``pm(...)``) therefore run the model with ``use_cache=False``: the
output is what the model returns less the cache (its cache field None), and the first call that
drops one says so in a warning. A cache is of no use to a sharded forward anyway: it is not
fed back in (no generation loop runs through ``pm``).
"""
from __future__ import annotations

import inspect
import warnings


class KVCacheWarning(UserWarning):
    """A forward call ran the model with use_cache=False: the output holds no cache."""


def _signature_default(model):
    """``model.forward``'s ``use_cache`` parameter's default, or ``KeyError`` where it has none."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        raise KeyError("use_cache") from None
    if "use_cache" not in params:
        raise KeyError("use_cache")
    default = params["use_cache"].default
    return None if default is inspect.Parameter.empty else default


class KVCache:
    """Whether ``model``'s forward takes ``use_cache``, and whether, not given, it defaults to on
    (Hugging Face reads None as the config's ``use_cache``)."""

    def __init__(self, model):
        self.warned = False
        try:
            default = _signature_default(model)
        except KeyError:
            self.takes, self.default_on = False, False
            return
        if default is None:
            default = getattr(getattr(model, "config", None), "use_cache", None)
        self.takes, self.default_on = True, bool(default)

    def drop(self, kwargs: dict, per_rank: int | None = None) -> dict:
        """``kwargs`` with ``use_cache=False`` where the model would return a cache (asked for, or
        on by default); ``per_rank``: each keyword input is a list of that many per-rank values
        (inputs="local" with every rank in this process)."""
        if not self.takes:
            return kwargs
        given = kwargs.get("use_cache")
        if "use_cache" in kwargs:
            asked = any(given) if per_rank is not None and isinstance(given, (list, tuple)) else bool(given)
        else:
            asked = self.default_on
        if not asked:
            return kwargs
        self._warn("use_cache=True was given" if "use_cache" in kwargs
                   else "the model returns its KV cache by default (use_cache=True in its config or forward)")
        return {**kwargs, "use_cache": False if per_rank is None else [False] * per_rank}

    def _warn(self, why: str) -> None:
        if self.warned:
            return
        self.warned = True
        warnings.warn(f"{why}, but a forward call through shardwise returns tensors only: the model runs with "
                      "use_cache=False and its output holds no KV cache (its cache / past_key_values field is None; "
                      "the logits are the same). Pass use_cache=False to say so and silence this warning",
                      KVCacheWarning, stacklevel=5)  # the caller of pm(...)
