"""Hand samples (uneven sizes) for the nn losses, activations and layers of rules/loss_elementwise.py,
loss_margin.py, layers.py, embedding_bag.py, norm_batch.py (the functional batch norm) and distance.py
(pdist): 2-d batches the OpInfo samples lack, and the overloads OpInfo reaches only above the dispatch
(PReLU's kernel, bilinear's _trilinear, the functional batch norm, the dense embedding_bag backward)."""
from __future__ import annotations

import torch

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2


def _r(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 7 * sum(shape)))


def _loss_samples() -> dict:
    x, t, go = _r(5, 7), _r(5, 7, seed=1), _r(5, 7, seed=2)
    p, q, w = torch.sigmoid(x) * 0.9 + 0.05, torch.sigmoid(t), _r(5, 7, seed=3).abs()
    one = torch.tensor(1.3)
    cls, n = torch.tensor([0, 6, 3, 2, 6]), _r(5, seed=4)
    labels = torch.tensor([[0, 3, -1, 1, 1, 1, 1], [6, -1, 0, 0, 0, 0, 0], [2, 2, 5, 1, 0, 4, 3],
                           [-1, 0, 0, 0, 0, 0, 0], [4, 1, -1, 2, 2, 2, 2]])
    _, is_target = aten.multilabel_margin_loss_forward.default(x, labels, MEAN)
    return {
        aten.huber_loss.default: [(x, t, MEAN, 0.7), (x, t, NONE, 1.0)],
        aten.huber_loss_backward.default: [(one, x, t, MEAN, 0.7), (go, x, t, NONE, 1.0)],
        aten.smooth_l1_loss.default: [(x, t, MEAN, 0.5), (x, t, SUM, 1.0)],
        aten.smooth_l1_loss_backward.default: [(one, x, t, MEAN, 0.5), (go, x, t, NONE, 1.0)],
        aten.soft_margin_loss.default: [(x, t.sign(), MEAN), (x, t.sign(), NONE)],
        aten.soft_margin_loss_backward.default: [(one, x, t.sign(), MEAN), (go, x, t.sign(), NONE)],
        aten.binary_cross_entropy.default: [(p, q, w, MEAN), (p, q, None, SUM), (p, q, w, NONE)],
        aten.binary_cross_entropy_backward.default: [(one, p, q, w, MEAN), (go, p, q, None, NONE)],
        aten.multi_margin_loss.default: [(x, cls, 1, 1.0, None, MEAN), (x, cls, 2, 0.5, w[0], NONE)],
        aten.multi_margin_loss_backward.default: [(one, x, cls, 1, 1.0, None, MEAN), (n, x, cls, 2, 0.5, w[0], NONE)],
        aten.multilabel_margin_loss_forward.default: [(x, labels, MEAN), (x, labels, NONE)],
        aten.multilabel_margin_loss_backward.default: [(one, x, labels, MEAN, is_target),
                                                       (n, x, labels, NONE, is_target)],
    }


def _layer_samples() -> dict:
    x, w = _r(5, 3, 7), _r(1, 3, 1, seed=1)
    x1, x2, W, go = _r(5, 3), _r(5, 4, seed=1), _r(6, 3, 4, seed=2), _r(5, 6, seed=3)
    return {
        aten.glu.default: [(_r(5, 6, 3), 1), (_r(3, 10), -1)],
        aten.glu_backward.default: [(_r(5, 3, 3), _r(5, 6, 3, seed=1), 1)],
        aten._prelu_kernel.default: [(x, w), (_r(5, 7), torch.tensor([0.25]))],
        aten._prelu_kernel_backward.default: [(_r(5, 3, 7, seed=2), x, w)],
        # nn.functional.bilinear's forward and its three backward contractions
        aten._trilinear.default: [(x1, W, x2, [1, 3], [0], [1, 2], [2, 3]), (go, W, x2, [2, 3], [0], [1, 2], [1, 3]),
                                  (x1, go, x2, [1, 3], [2, 3], [1, 2], [0]), (x1, W, go, [1, 3], [0], [2, 3], [1, 2])],
        aten._pdist_forward.default: [(_r(5, 7), 2.0), (_r(5, 7), 1.0), (_r(4, 5), float("inf"))],
        aten._pdist_backward.default: [(_r(10, seed=1), _r(5, 7), 2.0, aten._pdist_forward.default(_r(5, 7), 2.0))],
    }


def _batch_norm_samples() -> dict:
    x, w, b = _r(5, 3, 7), _r(3, seed=1), _r(3, seed=2)
    rm, rv = _r(3, seed=3), _r(3, seed=4).abs() + 0.5
    fwd = aten._batch_norm_with_update_functional.default
    out = fwd(x, w, b, rm, rv, 0.1, 1e-5)
    return {
        fwd: [(x, w, b, rm, rv, 0.1, 1e-5), (_r(5, 3), w, b, rm, rv, 0.3, 1e-3)],
        aten.batch_norm_backward.default: [(_r(5, 3, 7, seed=5), x, w, rm, rv, out[1], out[2], True, 1e-5,
                                            [True, True, True], out[3]),
                                           (_r(5, 3, 7, seed=5), x, w, rm, rv, None, None, False, 1e-5,
                                            [True, True, False], out[3])],
    }


def _embedding_bag_samples() -> dict:
    w, idx, off = _r(10, 7), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 7, 7]), torch.tensor([0, 3, 3, 6, 8])
    fwd = aten._embedding_bag.default
    mean = fwd(w, idx, off, False, 1, False, None, False, 2)
    most = fwd(w, idx, off, False, 2, False, None, False, -1)
    g = _r(5, 7, seed=1)
    return {
        fwd: [(w, idx, off, False, 0, False, _r(11, seed=2), False, -1), (w, idx, off, False, 1, False, None, True, 2),
              (w, idx, off, False, 2, False, None, False, -1)],
        aten._embedding_bag_backward.default: [(g, idx, off, *mean[1:], 10, False, 1, False, None, 2),
                                               (g, idx, off, *most[1:], 10, False, 2, False, None, -1)],
        aten._embedding_bag_dense_backward.default: [(g, idx, *mean[1:], 10, False, 1, None, 2),
                                                     (g, idx, *most[1:], 10, False, 2, None, -1)],
        aten._embedding_bag_per_sample_weights_backward.default: [(g, w, idx, off, fwd(w, idx, off, False, 0, False,
                                                                                       _r(11), False, -1)[1], 0)],
    }


def nn_samples() -> dict:
    return {**_loss_samples(), **_layer_samples(), **_batch_norm_samples(), **_embedding_bag_samples()}
