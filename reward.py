"""Task reward and group advantages (the paper's outcome reward, GRPO-style baseline).

Every episode gets ONE scalar, task success, and the same advantage goes on every ACT and every
REHEARSE token of that episode: a wrong rehearsal that leads to a wrong answer is punished
exactly like a wrong action. The official code groups rollouts by (task, role) with K = 4 and
uses A = R - mean(group), without dividing by the std; here a group is the G samples of one
task (inline rehearsal puts both roles in one row, so the two groupings coincide).

Worked example, two tasks x G = 3:

    group    0    0    0    1    1    1
    reward   1    0    0    1    1    1
    mean     1/3            1
    A        2/3 -1/3 -1/3  0    0    0      group 1 is all-equal: zero signal, counted
"""
from collections import Counter

import torch


def task_reward(episode, task):
    """1.0 when the episode ended with an answer equal to the task's answer, else 0.0.
    Malformed calls, malformed rehearsals and truncations end without an answer: 0."""
    return float(episode["cause"] == "answer" and episode["answer"] == task["answer"])


def group_advantages(rewards, group_ids, scale_std=False, eps=1e-6):
    """rewards [N] float, group_ids [N] int -> (advantages [N], number of all-equal groups)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    group_ids = torch.as_tensor(group_ids)
    adv = torch.zeros_like(rewards)
    all_equal = 0
    for g in group_ids.unique():
        members = group_ids == g
        r = rewards[members]
        adv[members] = r - r.mean()
        if scale_std:
            adv[members] /= r.std(unbiased=False) + eps
        all_equal += int(bool((r == r[0]).all()))
    return adv, all_equal


def cause_counts(episodes):
    """How episodes ended: {'answer': n, 'bad_call': n, 'turn_limit': n, ...}."""
    return dict(Counter(e["cause"] for e in episodes))
