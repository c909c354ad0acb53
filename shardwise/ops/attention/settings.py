"""AttentionSettings: every non-tensor setting of one attention call, the op's args as data
(op.py turns them into the custom op's primitive args and back)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from ...core.errors import AttentionError, ConfigTypeError


def default_scale(head_dim: int) -> float:
    """F.sdpa's default: 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


@dataclass(frozen=True)
class AttentionSettings:
    """Every non-tensor setting of one attention call (local block of a global problem).

    is_causal: F.sdpa's top-left causal mask, applied at GLOBAL positions (see kernels.py).
    scale: None = 1/sqrt(head_dim), resolved by ``resolve_scale`` (never ``scale or ...``).
    enable_gqa: allow fewer key/value heads than query heads (repeat_interleave grouping).
    q_offset / k_offset: global position of the first local query / key.
    q_len_global / k_len_global: global sequence lengths; required when is_causal and an
        offset is nonzero (a sharded causal call must say which global problem it is a
        block of), validated against offset + local length whenever given.

    Score modifications (mods.py applies them; positions are GLOBAL, top-left aligned as
    causal is: query i at q_offset + i, key j at k_offset + j):
    softcap: logit soft-capping, scores = softcap * tanh(scores / softcap) after scaling,
        before any bias or mask (Gemma 2); None = off.
    window_left / window_right: sliding window, query i sees key j only when
        i - window_left <= j <= i + window_right; None = unbounded on that side.
    alibi_key_only: with alibi slopes given, bias = slope_h * j (Bloom's form) instead of
        slope_h * (j - i); the outputs are equal (a per-row shift), lse differs.
    """

    is_causal: bool = False
    scale: Optional[float] = None
    enable_gqa: bool = False
    q_offset: int = 0
    k_offset: int = 0
    q_len_global: Optional[int] = None
    k_len_global: Optional[int] = None
    softcap: Optional[float] = None
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    alibi_key_only: bool = False

    def __post_init__(self):
        for name in ("is_causal", "enable_gqa", "alibi_key_only"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigTypeError(f"AttentionSettings.{name} must be a bool, got {getattr(self, name)!r}",
                                      fix=f"pass {name}=True or {name}=False")
        for name in ("q_offset", "k_offset", "q_len_global", "k_len_global", "window_left", "window_right"):
            x = getattr(self, name)
            if x is None and not name.endswith("offset"):
                continue
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                raise AttentionError(f"AttentionSettings.{name} must be a non-negative int, got {x!r}", fix="e.g. 0")
        if self.scale is not None:
            if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale):
                raise AttentionError(f"AttentionSettings.scale must be a finite number, got {self.scale!r}",
                                     fix="pass a float, or None for 1/sqrt(head_dim)")
            object.__setattr__(self, "scale", float(self.scale))
        if self.softcap is not None:
            c = self.softcap
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
                raise AttentionError(f"AttentionSettings.softcap must be a finite number > 0, got {c!r}",
                                     fix="pass e.g. softcap=50.0, or None for no soft-capping")
            object.__setattr__(self, "softcap", float(c))

    @property
    def windowed(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def reach(self) -> tuple[Optional[int], Optional[int]]:
        """(left, right): how far before / after its own position a query may see keys, causal and
        window together; None = unbounded."""
        right = self.window_right
        if self.is_causal:
            right = 0 if right is None else min(right, 0)
        return self.window_left, right

    def resolve_scale(self, head_dim: int) -> float:
        """The scale actually used: the given one, or 1/sqrt(head_dim)."""
        return default_scale(head_dim) if self.scale is None else self.scale

    def check_blocks(self, q_len: int, k_len: int) -> None:
        """Fail loudly where the offsets and global lengths do not describe a valid block."""
        if (self.is_causal or self.windowed) and (self.q_offset or self.k_offset) and (
                self.q_len_global is None or self.k_len_global is None):
            raise AttentionError(
                f"attention: causal or windowed with offsets (q_offset={self.q_offset}, k_offset={self.k_offset}) "
                f"needs q_len_global and k_len_global (got {self.q_len_global}, {self.k_len_global})",
                fix="pass the global sequence lengths of the sharded problem")
        for what, off, n, total in (("query", self.q_offset, q_len, self.q_len_global),
                                    ("key", self.k_offset, k_len, self.k_len_global)):
            if total is not None and off + n > total:
                raise AttentionError(f"attention: local {what} block [{off}, {off + n}) lies outside the global "
                                     f"sequence of length {total}", fix=f"make {what} offset + length <= {total}")

    def block(self, q_offset: int, k_offset: int, q_len_global: int, k_len_global: int) -> "AttentionSettings":
        """These settings for one block of a global problem (offsets and lengths replaced)."""
        return dataclasses.replace(self, q_offset=q_offset, k_offset=k_offset,
                                   q_len_global=q_len_global, k_len_global=k_len_global)

    def to_op_args(self) -> tuple:
        """The op's non-tensor args, in schema order."""
        return tuple(getattr(self, n) for n in SETTING_NAMES)

    @staticmethod
    def from_op_args(is_causal, scale, enable_gqa, q_offset, k_offset, q_len_global, k_len_global, softcap=None,
                     window_left=None, window_right=None, alibi_key_only=False) -> "AttentionSettings":
        return AttentionSettings(bool(is_causal), scale, bool(enable_gqa), int(q_offset), int(k_offset),
                                 q_len_global, k_len_global, softcap, window_left, window_right, bool(alibi_key_only))


SETTING_NAMES = tuple(f.name for f in dataclasses.fields(AttentionSettings))
