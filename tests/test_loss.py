"""clipped_pg_loss (train.py): every clip branch, its gradient, normalisation, the k3 KL, stats.

Ratios are built as new_logprobs = old_logprobs + log(ratio), in float64."""
import math

import pytest
import torch

from envace import clipped_pg_loss

F64 = torch.float64
OLD = -1.7          # any old logprob; only the ratio matters


def tokens(advantages, ratios, ref_shift=None):
    """[1, T] tensors: old, new (a leaf that requires grad), advantages, ref (new + shift)."""
    adv = torch.tensor([advantages], dtype=F64)
    old = torch.full_like(adv, OLD)
    new = (old + torch.log(torch.tensor([ratios], dtype=F64))).requires_grad_(True)
    ref = None if ref_shift is None else new.detach() + torch.tensor([ref_shift], dtype=F64)
    return new, old, adv, ref


def one_token(a, ratio, **kw):
    new, old, adv, _ = tokens([a], [ratio])
    loss, stats = clipped_pg_loss(new, old, adv, torch.tensor([[True]]), 1, **kw)
    (grad,) = torch.autograd.grad(loss, new)
    return loss.item(), grad.item(), stats


# ----------------------------------------------------------------------------- branches

@pytest.mark.parametrize("a, ratio, loss, grad", [
    (+1, 1.5, -1.2, 0.0),     # A > 0 above 1 + eps: clipped, no gradient
    (+1, 0.5, -0.5, -0.5),    # A > 0 below 1 - eps: unclipped (pessimistic), d(-A r)/dlogp = -A r
    (+1, 1.0, -1.0, -1.0),    # on-policy
    (+2, 1.1, -2.2, -2.2),    # inside the trust region
    (+1, 5.0, -1.2, 0.0),     # no dual clip for A > 0
    (-1, 0.5, 0.8, 0.0),      # A < 0 below 1 - eps: clipped at 1 - eps
    (-1, 1.5, 1.5, 1.5),      # A < 0 above 1 + eps: unclipped, gradient -A r = 1.5
    (-1, 2.5, 2.5, 2.5),      # still under the dual-clip cap c |A| = 3
    (-1, 5.0, 3.0, 0.0),      # dual clip: capped at c |A| = 3
    (-2, 5.0, 6.0, 0.0),      # the cap scales with |A|
    (0, 5.0, 0.0, 0.0),       # zero advantage: nothing
])
def test_branch_loss_and_gradient(a, ratio, loss, grad):
    got_loss, got_grad, _ = one_token(a, ratio, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    assert got_loss == pytest.approx(loss, abs=1e-9)
    assert got_grad == pytest.approx(grad, abs=1e-9)


def test_defaults_are_eps_02_and_dual_clip_3():
    assert one_token(+1, 1.5)[0] == pytest.approx(-1.2, abs=1e-9)
    assert one_token(-1, 0.5)[0] == pytest.approx(0.8, abs=1e-9)
    assert one_token(-1, 5.0)[0] == pytest.approx(3.0, abs=1e-9)


@pytest.mark.parametrize("a, ratio, loss, grad", [
    (+1, 1.5, -1.3, 0.0),     # upper bound 1 + eps_high = 1.3
    (+1, 1.25, -1.25, -1.25), # under 1.3: not clipped (it would be at 1.1 if the eps were swapped)
    (-1, 0.5, 0.9, 0.0),      # lower bound 1 - eps_low = 0.9
    (-1, 0.8, 0.9, 0.0),      # under 0.9: clipped (it would not be at 0.7 if swapped)
    (-1, 0.95, 0.95, 0.95),   # inside [0.9, 1.3]
])
def test_asymmetric_eps(a, ratio, loss, grad):
    got_loss, got_grad, _ = one_token(a, ratio, eps_low=0.1, eps_high=0.3, dual_clip=3.0)
    assert got_loss == pytest.approx(loss, abs=1e-9)
    assert got_grad == pytest.approx(grad, abs=1e-9)


def test_dual_clip_value():
    assert one_token(-1, 5.0, dual_clip=2.0)[0] == pytest.approx(2.0, abs=1e-9)
    assert one_token(-1, 5.0, dual_clip=10.0)[0] == pytest.approx(5.0, abs=1e-9)


# ----------------------------------------------------------------------------- normalisation

def batch():
    """Row 0: (+1, 1.5) -> -1.2, (-1, 0.5) -> 0.8, masked; row 1: (-1, 5) -> 3.0, masked, masked.
    The masked-out tokens carry huge advantages and ratios."""
    new, old, adv, _ = tokens([+1, -1, 1e6], [1.5, 0.5, math.exp(30)])
    new2, old2, adv2, _ = tokens([-1, -1e6, 1e6], [5.0, math.exp(-30), math.exp(30)])
    new = torch.cat([new.detach(), new2.detach()]).requires_grad_(True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    return new, torch.cat([old, old2]), torch.cat([adv, adv2]), mask


def test_loss_sums_masked_tokens_over_n_tokens():
    new, old, adv, mask = batch()
    loss, _ = clipped_pg_loss(new, old, adv, mask, 3)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0) / 3, abs=1e-9)      # 2.6 / 3
    loss2, _ = clipped_pg_loss(new, old, adv, mask, 6)
    assert loss2.item() == pytest.approx((-1.2 + 0.8 + 3.0) / 6, abs=1e-9)     # halved


def test_masked_tokens_get_no_gradient():
    new, old, adv, mask = batch()
    loss, _ = clipped_pg_loss(new, old, adv, mask, 3)
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.isfinite(grad).all()
    # the three trained tokens are all clipped (1 + eps, 1 - eps, dual clip): zero gradient;
    # the masked-out ones, with huge advantages and ratios, get exactly zero too
    assert grad.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_gradient_is_divided_by_n_tokens():
    new, old, adv, _ = tokens([+1, -1, +1], [0.5, 1.5, 2.0])
    mask = torch.tensor([[True, True, False]])
    loss, _ = clipped_pg_loss(new, old, adv, mask, 4)
    (grad,) = torch.autograd.grad(loss, new)
    # per token: -0.5 and +1.5 (unclipped), masked 0; divided by 4
    assert grad[0].tolist() == pytest.approx([-0.125, 0.375, 0.0], abs=1e-9)
    assert loss.item() == pytest.approx((-0.5 + 1.5) / 4, abs=1e-9)


def test_micro_batches_add_up_to_the_whole_batch():
    new, old, adv, mask = batch()
    whole, whole_stats = clipped_pg_loss(new, old, adv, mask, 3)
    parts = [clipped_pg_loss(new[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], 3)
             for i in range(2)]
    assert parts[0][0].item() == pytest.approx((-1.2 + 0.8) / 3, abs=1e-9)
    assert parts[1][0].item() == pytest.approx(3.0 / 3, abs=1e-9)
    assert parts[0][0].item() + parts[1][0].item() == pytest.approx(whole.item(), abs=1e-9)
    for k in whole_stats:
        assert parts[0][1][k] + parts[1][1][k] == pytest.approx(whole_stats[k], abs=1e-9)


# ----------------------------------------------------------------------------- stats

def test_stats():
    new, old, adv, mask = batch()
    _, stats = clipped_pg_loss(new, old, adv, mask, 3)
    assert set(stats) == {"clip_frac", "dual_clip_frac", "approx_kl", "kl_ref"}
    assert stats["clip_frac"] == pytest.approx(2 / 3)         # (+1, 1.5) and (-1, 0.5)
    assert stats["dual_clip_frac"] == pytest.approx(1 / 3)    # (-1, 5)
    assert stats["kl_ref"] == 0.0                             # no reference
    # k1: mean of -log ratio over trained tokens = -(log 1.5 + log 0.5 + log 5) / 3 = -log(3.75)/3
    assert stats["approx_kl"] == pytest.approx(-math.log(3.75) / 3, abs=1e-9)
    _, halved = clipped_pg_loss(new, old, adv, mask, 6)
    assert halved["clip_frac"] == pytest.approx(1 / 3)
    assert halved["dual_clip_frac"] == pytest.approx(1 / 6)


def test_unclipped_tokens_are_not_counted():
    new, old, adv, _ = tokens([+1, -1, +1, -1], [0.5, 1.5, 1.1, 2.5])
    _, stats = clipped_pg_loss(new, old, adv, torch.ones(1, 4, dtype=torch.bool), 4)
    assert stats["clip_frac"] == 0.0
    assert stats["dual_clip_frac"] == 0.0


# ----------------------------------------------------------------------------- k3 KL to the reference

K3_LOG2 = 2 - math.log(2) - 1            # d = ref - new = log 2:  e^d - d - 1
K3_MINUS_LOG2 = 0.5 + math.log(2) - 1    # d = -log 2


def test_k3_kl_is_added_per_token_times_kl_coef():
    new, old, adv, ref = tokens([0.0], [1.0], ref_shift=[math.log(2)])
    loss, stats = clipped_pg_loss(new, old, adv, torch.tensor([[True]]), 1, ref, kl_coef=0.5)
    assert loss.item() == pytest.approx(0.5 * K3_LOG2, abs=1e-9)
    assert stats["kl_ref"] == pytest.approx(K3_LOG2, abs=1e-9)    # the stat has no kl_coef
    # d/dnew (e^d - d - 1) with d = ref - new: 1 - e^d = 1 - 2 = -1, times kl_coef 0.5
    (grad,) = torch.autograd.grad(loss, new)
    assert grad.item() == pytest.approx(-0.5, abs=1e-9)


def test_k3_kl_with_policy_gradient_and_mask():
    # token 0: (+1, 1.5) -> -1.2, ref above by log 2; token 1: (-1, 1.5) -> 1.5, ref below by
    # log 2; token 2 masked out with a huge KL
    new, old, adv, ref = tokens([+1, -1, +1], [1.5, 1.5, 1.0],
                                ref_shift=[math.log(2), -math.log(2), 20.0])
    mask = torch.tensor([[True, True, False]])
    loss, stats = clipped_pg_loss(new, old, adv, mask, 2, ref, kl_coef=0.1)
    expected = (-1.2 + 0.1 * K3_LOG2 + 1.5 + 0.1 * K3_MINUS_LOG2) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    assert stats["kl_ref"] == pytest.approx((K3_LOG2 + K3_MINUS_LOG2) / 2, abs=1e-9)


def test_kl_coef_zero_reports_but_does_not_add():
    new, old, adv, ref = tokens([+1], [1.5], ref_shift=[math.log(2)])
    loss, stats = clipped_pg_loss(new, old, adv, torch.tensor([[True]]), 1, ref, kl_coef=0.0)
    assert loss.item() == pytest.approx(-1.2, abs=1e-9)
    assert stats["kl_ref"] == pytest.approx(K3_LOG2, abs=1e-9)


def test_k3_kl_is_zero_at_the_reference():
    new, old, adv, ref = tokens([0.0, 0.0], [1.0, 1.3], ref_shift=[0.0, 0.0])
    loss, stats = clipped_pg_loss(new, old, adv, torch.ones(1, 2, dtype=torch.bool), 2, ref,
                                  kl_coef=1.0)
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-12)
