"""Task reward, group advantages (reward.py) and the per-token advantages / loss mask (envace.py)."""
import math

import pytest
import torch

import envace
from envace import ACT, OBS, PAD, PROMPT, REHEARSE, TAG, loss_mask, token_advantages
from reward import cause_counts, group_advantages, task_reward


# ----------------------------------------------------------------------------- task_reward

def test_right_answer_is_rewarded():
    r = task_reward({"cause": "answer", "answer": "12"}, {"answer": "12"})
    assert r == 1.0 and type(r) is float


def test_wrong_answer_is_not_rewarded():
    r = task_reward({"cause": "answer", "answer": "13"}, {"answer": "12"})
    assert r == 0.0 and type(r) is float
    assert task_reward({"cause": "answer", "answer": "012"}, {"answer": "12"}) == 0.0


@pytest.mark.parametrize("cause", ["bad_call", "bad_rehearsal", "turn_limit", "truncated"])
def test_only_an_answer_ending_is_rewarded(cause):
    assert task_reward({"cause": cause, "answer": "12"}, {"answer": "12"}) == 0.0
    assert task_reward({"cause": cause, "answer": None}, {"answer": "12"}) == 0.0


# ----------------------------------------------------------------------------- group_advantages

def test_group_advantages_worked_example():
    adv, all_equal = group_advantages([1, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1])
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0], abs=1e-6)
    assert all_equal == 1


def test_group_advantages_scale_std():
    # group 0: rewards 1, 0, 0 -> mean 1/3, population std sqrt(2/9) = sqrt(2)/3,
    # so (2/3, -1/3, -1/3) / (sqrt(2)/3) = (sqrt(2), -1/sqrt(2), -1/sqrt(2)); group 1: 0 / eps = 0
    adv, all_equal = group_advantages([1, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1], scale_std=True)
    s = math.sqrt(2)
    assert adv.tolist() == pytest.approx([s, -1 / s, -1 / s, 0, 0, 0], abs=1e-5)
    assert all_equal == 1


def test_group_advantages_interleaved_groups():
    adv, all_equal = group_advantages([1, 1, 0, 0], [1, 0, 1, 0])
    assert adv.tolist() == pytest.approx([0.5, 0.5, -0.5, -0.5], abs=1e-6)
    assert all_equal == 0


def test_group_advantages_all_groups_equal():
    adv, all_equal = group_advantages([0.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    assert adv.tolist() == [0, 0, 0, 0]
    assert all_equal == 2


def test_group_advantages_fractional_rewards():
    # one group of four: mean 0.5 -> A = R - 0.5
    adv, all_equal = group_advantages([1.0, 0.0, 0.25, 0.75], [3, 3, 3, 3])
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.25, 0.25], abs=1e-6)
    assert all_equal == 0


def test_group_advantages_accepts_tensors():
    adv, all_equal = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    assert adv.tolist() == pytest.approx([0.5, -0.5], abs=1e-6)
    assert all_equal == 0


# ----------------------------------------------------------------------------- cause_counts

def test_cause_counts():
    episodes = [{"cause": "answer"}, {"cause": "bad_call"}, {"cause": "answer"},
                {"cause": "turn_limit"}, {"cause": "answer"}]
    assert cause_counts(episodes) == {"answer": 3, "bad_call": 1, "turn_limit": 1}
    assert cause_counts([]) == {}


# ----------------------------------------------------------------------------- roles

def test_role_constants():
    assert (PROMPT, ACT, REHEARSE, OBS, TAG, PAD) == (0, 1, 2, 3, 4, 5)
    assert envace.ROLE_NAMES == ["prompt", "act", "rehearse", "obs", "tag", "pad"]


P, A, R, O, T, X = PROMPT, ACT, REHEARSE, OBS, TAG, PAD

# the envace.py docstring example: <bos> price apple <act> price apple </act> <env> 3 </env>
# <act> answer 3 </act>, in rehearse mode (row 0) and real mode (row 1)
DOC_ROLES = torch.tensor([[P, P, P, T, A, A, A, T, R, R, T, A, A, A],
                          [P, P, P, T, A, A, A, T, O, O, T, A, A, A]])


def test_loss_mask_docstring_example():
    mask = loss_mask(DOC_ROLES)
    assert mask.dtype == torch.bool and mask.shape == (2, 13)
    assert mask[0].int().tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]
    assert mask[1].int().tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    # the warm start also trains OBS targets
    warm = loss_mask(DOC_ROLES, trained=(ACT, REHEARSE, OBS))
    assert warm[1].int().tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]


def test_loss_mask_ignores_padding():
    roles = torch.tensor([[P, T, A, A, X, X]])
    assert loss_mask(roles).int().tolist() == [[0, 1, 1, 0, 0]]


def test_token_advantages_scale_by_role():
    roles = torch.tensor([[P, P, T, A, A, T, R, R, T, A, X, X],
                          [P, T, A, A, T, O, O, T, A, A, X, X]])
    adv = token_advantages(roles, torch.tensor([2.0, -3.0]), act_coef=0.5, rehearse_coef=0.25)
    assert adv.shape == (2, 11)
    # row 0 targets: P T A A T R R T A X X, A = 2: ACT -> 2 * 0.5 = 1, REHEARSE -> 2 * 0.25 = 0.5
    assert adv[0].tolist() == [0, 0, 1.0, 1.0, 0, 0.5, 0.5, 0, 1.0, 0, 0]
    # row 1 targets: T A A T O O T A A X X, A = -3: ACT -> -1.5, OBS gets nothing
    assert adv[1].tolist() == [0, -1.5, -1.5, 0, 0, 0, 0, -1.5, -1.5, 0, 0]


def test_token_advantages_default_coefficients_and_zero_coef():
    roles = torch.tensor([[P, T, A, T, R, R]])
    assert token_advantages(roles, torch.tensor([0.75])).tolist() == [[0, 0.75, 0, 0.75, 0.75]]
    no_rehearse = token_advantages(roles, torch.tensor([0.75]), act_coef=1.0, rehearse_coef=0.0)
    assert no_rehearse.tolist() == [[0, 0.75, 0, 0, 0]]
    # integer episode advantages are promoted to float
    assert token_advantages(roles, torch.tensor([2])).tolist() == [[0, 2.0, 0, 2.0, 2.0]]
