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

Chat-format tasks (chat/format.py) are scored by `chat_reward` (chat/chat_reward.py): the final answer
(normalised string or number match), the tool calls against gold calls compared AST-style as BFCL
does (type-aware values, in order or in any order), and optionally the paper's checklist judge: a
local causal LM asked each yes/no question, scored by p(yes) / (p(yes) + p(no)) of its next token.

With rehearsal_context separate an episode is several rows (`training_rows`): its actor row and
one rehearse row per call, each with the episode's reward. `advantage_groups: task_role` (the
official grouping) gives the actor rows of a task one baseline and its rehearse rows another;
`task` gives them one shared mean. Task 0, G = 2: episode a (reward 1, two calls), b (0, one call):

    row       a.act  b.act  a.r1  a.r2  b.r1
    task_role  1/2   -1/2   1/3   1/3  -2/3     act mean 1/2, rehearse mean 2/3
    task       2/5   -3/5   2/5   2/5  -3/5     one mean over the 5 rows: 3/5

A mean is over rows, so an episode with more calls weighs more in its rehearse group. With
inline rehearsal every row holds both roles and one reward, so the two groupings are the same.

Dynamic sampling (max_sample_rounds > 1, formats/dynamic_sampling.py) keeps a task's G episodes
when their rewards vary (`varied_groups` over task ids). Every episode has an actor row, so a task
varies exactly when its actor group (task_role) or its one group (task) does. Under task_role its
rehearse group may still be all-equal, since only the episodes that made calls have rehearse rows:
G = 3, a rewarded 1 (two calls), b 1 (one call), c 0 (no call): the actor rows (1, 1, 0) vary, the
rehearse rows a.r1, a.r2, b.r1 (1, 1, 1) do not: their advantages are 0 and they add nothing to
the gradient (they count in the token normaliser, as every trained token of the batch does).
"""
from collections import Counter

import torch


def task_reward(episode, task):
    """Paper, the task-success reward: 1.0 when the episode ended with an answer equal to the
    task's answer, else 0.0.
    Malformed calls, malformed rehearsals and truncations end without an answer: 0."""
    return float(episode["cause"] == "answer" and episode["answer"] == task["answer"])


def group_advantages(rewards, group_ids, scale_std=False, eps=1e-6):
    """Paper, the group baseline A = R - mean(group) (no division by the std unless scale_std):
    rewards [N] float, group_ids [N] int -> (advantages [N], number of all-equal groups)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    group_ids = torch.as_tensor(group_ids)
    adv = torch.zeros_like(rewards)
    for g in group_ids.unique():
        members = group_ids == g
        r = rewards[members]
        adv[members] = r - r.mean()
        if scale_std:
            adv[members] /= r.std(unbiased=False) + eps
    return adv, len(group_ids.unique()) - len(varied_groups(rewards, group_ids))


def varied_groups(rewards, group_ids):
    """The ids of the groups whose rewards are not all equal (compared as float32, as the
    advantages are): the groups with a signal; every other group's advantages are all 0."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    group_ids = torch.as_tensor(group_ids)
    varied = set()
    for g in group_ids.unique():
        r = rewards[group_ids == g]
        if not bool((r == r[0]).all()):
            varied.add(int(g))
    return varied


def training_rows(episodes, rewards, task_ids, advantage_groups="task_role"):
    """Paper, the same reward on every row of both roles: (rows, row rewards, row group ids) for
    one update: each episode's own row, then its
    rehearse rows (episode["rehearsals"], separate context only), every row with its episode's
    reward. Groups: (task, role) for `task_role`, the task for `task` (see the module docstring)."""
    rows, row_rewards, groups = [], [], []
    for episode, reward, task in zip(episodes, rewards, task_ids):
        for row, role in [(episode, 0)] + [(r, 1) for r in episode.get("rehearsals", [])]:
            rows.append(row)
            row_rewards.append(reward)
            # task_role: group 2t holds task t's actor rows, 2t + 1 its rehearse rows (own baselines)
            groups.append(2 * task + role if advantage_groups == "task_role" else task)
    return rows, row_rewards, groups


def cause_counts(episodes):
    """How episodes ended: {'answer': n, 'bad_call': n, 'turn_limit': n, ...}."""
    return dict(Counter(e["cause"] for e in episodes))


# ----------------------------------------------------------------------------- what an evaluation reports

def outcome_record(tasks, episodes, rewards):
    """What every evaluation reports about outcomes (eval.json): success, how episodes ended
    (format_errors: the share that ended without an answer for another reason than an act cut at
    max_act_tokens, which is text that ran long, not a malformed call: cut_at_act_limit), mean
    calls, success per family."""
    causes = cause_counts(episodes)
    by_family = {}
    for t, r in zip(tasks, rewards):
        by_family.setdefault(t.get("family", "file"), []).append(r)
    return {"success": sum(rewards) / len(tasks), "n_tasks": len(tasks),
            "format_errors": sum(n for c, n in causes.items() if c not in ("answer", "act_limit")) / len(tasks),
            "cut_at_act_limit": causes.get("act_limit", 0) / len(tasks),
            "causes": causes, "mean_calls": sum(len(e["calls"]) for e in episodes) / len(tasks),
            "success_by_family": {f: sum(r) / len(r) for f, r in sorted(by_family.items())}}
