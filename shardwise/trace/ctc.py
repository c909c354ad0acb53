"""CTC loss at fixed shapes while tracing.

``aten._ctc_loss`` returns the per-sample losses ``[N]`` and ``log_alpha`` ``[N, T, 2 * L + 1]``,
the forward variables its backward reads, with ``L`` the longest target length of the batch: a
value of the data, so torch tags the op ``dynamic_output_shape`` and fake tensors refuse it. Only
the first ``2 * target_length + 1`` entries of a sample's row are ever read (the rest is left
unwritten), so the trace gives ``log_alpha`` the largest width the targets allow, ``2 * S + 1``
(``S``: the padded targets' length, or every target's count when they come concatenated), and the
rule's local call pads the op's result to it (rules/loss.ctc_loss_fixed): the backward reads the
same entries, whatever the widest target of a batch or of a rank's shard.

Hugging Face's CTC loss passes the targets concatenated (``labels.masked_select(mask)``: a length
that is the data's); while tracing it takes the padded form instead (``hf_ctc_as_padded``), which
gives the same losses.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from .patching import TracingPatch

aten = torch.ops.aten
CTC = (aten._ctc_loss.default, aten._ctc_loss.Tensor)


def ctc_width(targets_shape) -> int:
    """log_alpha's last dim at its largest: 2 * (most labels a sample can have) + 1."""
    longest = targets_shape[1] if len(targets_shape) == 2 else (targets_shape[0] if targets_shape else 0)
    return 2 * longest + 1


def ctc_fake(mode, args) -> tuple | None:
    """The fake (losses, log_alpha) of a ``_ctc_loss`` call on ``mode``'s fake tensors; None where the
    inputs are not the batched form (the fake mode then refuses it as usual)."""
    log_probs, targets = args[0], args[1]
    if log_probs.dim() != 3:
        return None
    steps, batch = log_probs.shape[0], log_probs.shape[1]
    with mode:
        losses = log_probs.new_empty((batch,))
        alpha = log_probs.new_empty((batch, steps, ctc_width(tuple(targets.shape))))
    return losses, alpha


def ctc_padded_targets(labels: torch.Tensor, keep: torch.Tensor, fill: int) -> torch.Tensor:
    """``labels [N, S]`` with each row's kept labels first, in their order, and ``fill`` after them: the
    padded form of ``labels.masked_select(keep)`` (a stable sort of the dropped flags, fixed shapes)."""
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices
    return torch.where(keep, labels, fill).gather(-1, order)


def hf_ctc_loss(logits, labels, logit_lengths, blank_token_id, reduction="mean", zero_infinity=False,
                ignore_index=-100, **kwargs):
    """Hugging Face's ForCTCLoss with padded targets ``[N, S]`` instead of concatenated ones (whose
    length is the data's): the same losses, since each sample reads only its first target_length
    labels."""
    labels = labels.to(logits.device)
    keep = (labels != ignore_index) & (labels != blank_token_id)
    targets = ctc_padded_targets(labels, keep, blank_token_id)
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    return torch.nn.functional.ctc_loss(log_probs, targets, logit_lengths, keep.sum(-1), blank=blank_token_id,
                                        reduction=reduction, zero_infinity=zero_infinity)


_PATCH = TracingPatch()  # hf_ctc_as_padded: Hugging Face's "ForCTC" loss swapped while any thread traces


@contextlib.contextmanager
def hf_ctc_as_padded():
    """While tracing on this thread, Hugging Face's "ForCTC" loss (Wav2Vec2ForCTC and kin, through
    ``model.loss_function``) is ``hf_ctc_loss``; other threads get the library's own."""
    utils = sys.modules.get("transformers.loss.loss_utils")
    mapping = getattr(utils, "LOSS_MAPPING", None)
    if not isinstance(mapping, dict) or "ForCTC" not in mapping:
        yield
        return

    def install():
        original = mapping["ForCTC"]

        def for_ctc(*args, **kwargs):
            return (hf_ctc_loss if _PATCH.active else original)(*args, **kwargs)

        mapping["ForCTC"] = for_ctc

        def undo():
            mapping["ForCTC"] = original
        return undo

    with _PATCH.opened(install):
        yield
