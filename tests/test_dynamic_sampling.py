"""DAPO's dynamic sampling (max_sample_rounds, train.sample_step): how many rounds a step draws,
which groups its update keeps, the metrics it logs, the paper's one-round step left as it was,
and --resume / a dropped step across a step of several rounds.

The rounds are checked twice: with a scripted format (no model: a task's episodes get the rewards
its script names, the task draws are scripted too), and in train.run on the toy with a scripted
reward (a task of VARIED gets reward 1 on its first episode of each group, every other task 0)."""
import collections
import contextlib
import json
import os
import random
import signal

import pytest
import torch

import train
from envace import ACT, PROMPT
from formats import features
from formats import format_plain
from machinery import config
from reward import group_advantages
from helpers import tiny_cfg, without_seconds
from test_resume import count_rl_passes, metrics, saved_rngs_and_weights


# ----------------------------------------------------------------------------- a scripted format

G = 2
SCRIPTS = {"A": [1.0, 1.0], "B": [0.0, 1.0], "C": [0.0, 0.0], "D": [1.0, 0.0], "E": [0.0, 0.0],
           "F": [1.0, 0.0], "H": [0.0, 0.0]}          # B, D, F vary
TASKS = [{"name": name, "rewards": rewards} for name, rewards in SCRIPTS.items()]


class ScriptedFormat:
    """A format module for sample_step without a model: task t's k-th episode of a group gets t's
    k-th scripted reward; its ids (a prompt token, two ACT tokens) differ by task and k, so that
    an update's rows do not cancel. `sampled`: the task names each rl_sample call got, one per group."""

    def __init__(self):
        self.sampled = []

    def inputs(self, setting, tasks, repeat):
        return [t["name"] for t in tasks for _ in range(repeat)], None, None

    def rl_sample(self, setting, model, tokenizer, prompts, worlds, tags, env_model, generator):
        self.sampled.append(prompts[::G])
        return [{"name": p, "k": i % G, "ids": [1, 5 + i % G, 10 + list(SCRIPTS).index(p)], "roles": [PROMPT, ACT, ACT]}
                for i, p in enumerate(prompts)]

    def reward(self, setting, episode, task):
        return task["rewards"][episode["k"]]


class ScriptedDraws:
    """The task RNG: each sample(population, k) is the next scripted draw of k task names."""

    def __init__(self, *draws):
        self.draws = [list(d) for d in draws]

    def sample(self, population, k):
        names = self.draws.pop(0)
        assert len(names) == k
        return [next(t for t in population if t["name"] == name) for name in names]


def step(draws, rounds=3, tasks_per_step=2):
    """sample_step with the scripted format: (sampled names per round, sampled, kept, counts, draws left)."""
    fmt, rng = ScriptedFormat(), ScriptedDraws(*draws)
    cfg = {**config.DEFAULTS, "tasks_per_step": tasks_per_step, "group_size": G, "max_sample_rounds": rounds}
    sampled, kept, counts = train.sample_step(fmt, None, None, None, TASKS, rng, cfg, None, None,
                                              contextlib.nullcontext())
    return fmt.sampled, sampled, kept, counts, rng.draws


def test_rounds_are_drawn_until_tasks_per_step_groups_vary():
    """tasks_per_step 2: round 1 (A all 1, B varies) keeps B; round 2 (C all 0, D varies) keeps D:
    2 groups, so round 3 is never drawn. Task ids run on over rounds: B is 1, D is 3."""
    names, (episodes, rewards, episode_tasks, task_ids), kept, counts, left = step(["AB", "CD", "EF"])
    assert names == [["A", "B"], ["C", "D"]] and left == [["E", "F"]]
    assert task_ids == [0, 0, 1, 1, 2, 2, 3, 3] and kept == [1, 3]
    assert rewards == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert [t["name"] for t in episode_tasks] == ["A", "A", "B", "B", "C", "C", "D", "D"]
    assert counts == {"sample_rounds": 2, "groups_sampled": 4, "episodes_sampled": 8, "groups_kept": 2}


def test_a_round_with_more_groups_than_needed_keeps_the_first():
    """Round 1 keeps B; round 2's D and F both vary, one is needed: D (drawn first)."""
    _, _, kept, counts, left = step(["AB", "DF", "EH"])
    assert kept == [1, 2] and left == [["E", "H"]]
    assert counts == {"sample_rounds": 2, "groups_sampled": 4, "episodes_sampled": 8, "groups_kept": 2}


def test_the_rounds_end_at_max_sample_rounds():
    """Three rounds, one group varies (F, task id 5): kept alone; no fourth round."""
    _, sampled, kept, counts, left = step(["AC", "EH", "CF", "BD"])
    assert kept == [5] and left == [["B", "D"]]
    assert counts == {"sample_rounds": 3, "groups_sampled": 6, "episodes_sampled": 12, "groups_kept": 1}
    rows, rewards, groups = train.update_rows(sampled, kept, counts["groups_kept"], step_cfg(3), pad_id=0)
    assert [r["name"] for r in rows] == ["F", "F"] and rewards == [1.0, 0.0] and groups == [10, 10]  # task_role: 2t


def step_cfg(rounds, **kw):
    return {**config.DEFAULTS, "tasks_per_step": 2, "group_size": G, "max_sample_rounds": rounds, **kw}


def test_a_step_with_no_group_varying_takes_every_row_and_is_skipped():
    """Three rounds of all-equal groups: nothing kept; the update gets every sampled row (6
    groups, all equal) and rl_step skips it, as a one-round step with no signal is skipped."""
    _, sampled, kept, counts, _ = step(["AC", "EH", "CA"])
    assert kept == [] and counts["groups_kept"] == 0 and counts["sample_rounds"] == 3
    rows, rewards, groups = train.update_rows(sampled, kept, 0, step_cfg(3), pad_id=0)
    assert len(rows) == 12 and groups == [2 * (i // 2) for i in range(12)]        # task_role: actor rows 2t
    sums, status = train.rl_step(None, None, None, rows, rewards, groups, step_cfg(3), 0)
    assert status == "skipped" and sums["all_equal_groups"] == 6


def test_one_round_is_the_papers_step():
    """max_sample_rounds 1: one draw, every group in the update (A and C, all equal, too: their rows
    count in the token mean and the KL), groups_kept counts those that vary."""
    _, sampled, kept, counts, left = step(["AB", "CD"], rounds=1)
    assert left == [["C", "D"]] and kept == [0, 1]
    assert counts == {"sample_rounds": 1, "groups_sampled": 2, "episodes_sampled": 4, "groups_kept": 1}
    _, _, groups = train.update_rows(sampled, kept, 1, step_cfg(1), pad_id=0)
    assert groups == [0, 0, 2, 2]
    _, _, kept, counts, _ = step(["AC", "BD"], rounds=1)
    assert kept == [0, 1] and counts["groups_kept"] == 0


def rehearsed(name, reward, n_rehearsals):
    """An episode of task `name` with separate rehearse rows (rehearsal_context separate)."""
    row = {"ids": [1, 2], "roles": [PROMPT, ACT]}
    return {**row, "name": name, "rehearsals": [{**row, "name": f"{name}.r{i + 1}"} for i in range(n_rehearsals)]}


def test_kept_rows_under_per_role_groups():
    """Task 0: a (reward 1, two calls), b (1, one call), c (0, no call); task 1: d (1, one call),
    e (0, one call), f (1, no call). Both tasks vary. task_role: task 0's rehearse rows a.r1,
    a.r2, b.r1 are all 1 (group 1 all-equal: left out); task 1's d.r1, e.r1 (1, 0) vary (group 3).
    task: one group per task, each varies: all 11 rows."""
    episodes = [rehearsed("a", 1, 2), rehearsed("b", 1, 1), rehearsed("c", 0, 0),
                rehearsed("d", 1, 1), rehearsed("e", 0, 1), rehearsed("f", 1, 0)]
    sampled = (episodes, [1.0, 1.0, 0.0, 1.0, 0.0, 1.0], [None] * 6, [0, 0, 0, 1, 1, 1])
    rows, rewards, groups = train.update_rows(sampled, [0, 1], 2, step_cfg(2), pad_id=0)
    assert [r["name"] for r in rows] == ["a", "b", "c", "d", "d.r1", "e", "e.r1", "f"]
    assert groups == [0, 0, 0, 2, 3, 2, 3, 2] and rewards == [1, 1, 0, 1, 1, 0, 0, 1]
    assert train.all_equal_row_groups(sampled, step_cfg(2)) == 1
    rows, _, groups = train.update_rows(sampled, [0, 1], 2, step_cfg(2, advantage_groups="task"), pad_id=0)
    assert len(rows) == 11 and groups == [0] * 6 + [1] * 5
    assert train.all_equal_row_groups(sampled, step_cfg(2, advantage_groups="task")) == 0
    # one definition of a group with signal: group_advantages counts the same all-equal groups
    all_rows = train.update_rows(sampled, [0, 1], 2, step_cfg(1), pad_id=0)
    assert group_advantages(all_rows[1], all_rows[2])[1] == 1


def test_a_rank_that_kept_nothing_gets_an_idle_row():
    """Another rank kept groups, this one none: one row with no trained target (0 tokens), so that
    its update runs as many passes as the others' and adds nothing."""
    _, sampled, kept, _, _ = step(["AC", "EH", "CA"])
    rows, rewards, groups = train.update_rows(sampled, kept, 2, step_cfg(3), pad_id=7)
    assert rows == [{"ids": [7, 7], "roles": [PROMPT, PROMPT]}] and rewards == [0.0] and groups == [-1]
    batch = train.make_batch(rows, rewards, groups, step_cfg(3), 7)
    assert batch["n_tokens"] == 0 and not batch["advantages"].any()


@pytest.mark.parametrize("rank, others, need, varied, want", [
    (1, [1, 0], 2, [0, 2], ([0], 2)),       # rank 0 has 1 of the 2 needed: rank 1 gives its first
    (1, [1, 0], 4, [0, 2], ([0, 2], 3)),    # 4 needed: all 3 of the round
    (0, [0, 5], 1, [3, 4], ([3], 1)),       # rank 0 comes first
    (1, [3, 0], 2, [1], ([], 2)),           # rank 0 alone has enough
])
def test_ranks_keep_the_first_groups_in_the_global_order(monkeypatch, rank, others, need, varied, want):
    """first_needed on rank `rank` of 2: the other rank's count (`others`, the all_sum of the
    one-hot counts, this rank's own slot added) decides which of this rank's groups are among the
    round's first `need`, and how many the round keeps over both ranks."""
    monkeypatch.setattr(train, "all_sum", lambda values: [a + b for a, b in zip(values, others)])
    assert train.first_needed(varied, need, rank, 2) == want


# ----------------------------------------------------------------------------- train.run on the toy

# seed 1, 40 RL tasks, 4 a draw: the task RNG's first draws (indices into the RL split)
DRAWS = [[8, 36, 4, 16], [7, 31, 28, 30], [24, 13, 6, 31], [1, 24, 27, 38], [0, 28, 17, 14],
         [37, 6, 20, 1], [1, 34, 0, 24], [13, 27, 1, 33]]
VARIED = [36, 7, 31, 28, 30]


def scripted_reward(monkeypatch, rl):
    """A task of VARIED: reward 1 on the first episode of each of its groups (a group's 4 episodes
    are rewarded in a row), else 0; every other task 0."""
    varied, calls = {rl[i]["prompt"] for i in VARIED}, collections.Counter()

    def reward(episode, task):
        if task["prompt"] not in varied:
            return 0.0
        calls[task["prompt"]] += 1
        return float(calls[task["prompt"]] % 4 == 1)
    monkeypatch.setattr(format_plain, "task_reward", reward)


def tagged_passes(monkeypatch):
    """[(names of the tasks sampled, per rl_sample call)], [(names of the tasks of the update's rows,
    per rl_step)]: each episode tagged with its prompt's index in the RL split."""
    sampled, updated, real_sample, real_step = [], [], format_plain.rl_sample, train.rl_step

    def rl_sample(setting, model, tokenizer, prompts, *a, **k):
        episodes = real_sample(setting, model, tokenizer, prompts, *a, **k)
        sampled.append(prompts[::4])
        for e, p in zip(episodes, prompts, strict=True):
            e["prompt"] = p
        return episodes

    def rl_step(model, ddp_model, opt, episodes, *a, **k):
        updated.append([e["prompt"] for e in episodes])
        return real_step(model, ddp_model, opt, episodes, *a, **k)
    monkeypatch.setattr(format_plain, "rl_sample", rl_sample)
    monkeypatch.setattr(train, "rl_step", rl_step)
    return sampled, updated


def rl_split(cfg):
    return features.build_tasks(cfg)["rl"]


def dynamic_cfg(path, **kw):
    return tiny_cfg(path, **{"rl_steps": 3, "kl_coef": 0.05, "n_test": 4, "save_every": 0, "max_sample_rounds": 3, **kw})


def test_a_run_with_dynamic_sampling(tmp_path, monkeypatch, capsys):
    """tasks_per_step 4, 3 rounds at most, seed 1's draws (DRAWS) and VARIED:
    step 1: draws 1, 2 ([8 36 4 16]: 36 varies; [7 31 28 30]: all vary): 36, 7, 31, 28 kept, 30
            not (4 are enough); 2 rounds, 32 episodes, 5 rewarded; 8 groups, 3 all-equal
    step 2: draws 3-5 ([24 13 6 31]: 31; [1 24 27 38]: none; [0 28 17 14]: 28): 2 kept; 48
            episodes, 2 rewarded; 12 groups, 10 all-equal
    step 3: draws 6-8: none varies: skipped after 3 rounds (48 episodes, 12 all-equal groups)
    With kl_coef > 0 every row of the update gets a gradient (KL): rows_updated = 4 x kept groups;
    the task RNG saved has made 8 draws."""
    cfg = dynamic_cfg(tmp_path)
    rl = rl_split(cfg)
    scripted_reward(monkeypatch, rl)
    sampled, updated = tagged_passes(monkeypatch)
    assert train.run(cfg) == 0
    index = {t["prompt"]: i for i, t in enumerate(rl)}
    assert [[index[p] for p in names] for names in sampled] == DRAWS
    assert [[index[p] for p in rows[::4]] for rows in updated] == [[36, 7, 31, 28], [31, 28],
                                                                  [i for d in DRAWS[5:] for i in d]]
    lines = metrics(cfg)
    fields = ("status", "sample_rounds", "groups_sampled", "episodes_sampled", "groups_kept", "all_equal_groups",
              "reward", "skipped_steps")
    assert [tuple(line[k] for k in fields) for line in lines] == [
        ("updated", 2, 8, 32, 4, 3, 5 / 32, 0), ("updated", 3, 12, 48, 2, 10, 2 / 48, 0),
        ("skipped", 3, 12, 48, 0, 12, 0.0, 1)]
    assert [line.get("rows_updated") for line in lines] == [16, 8, None]
    draws = random.Random(cfg["seed"])
    for _ in range(8):
        draws.sample(rl, 4)
    state = torch.load(os.path.join(cfg["out_dir"], "ckpt", "trainer_state.pt"), weights_only=False)
    assert state["task_rng"] == draws.getstate()
    result = json.load(open(os.path.join(cfg["out_dir"], "eval.json")))
    assert result["rl_updates"] == {"steps": 3, "updated": 2, "skipped": 1, "nonfinite": 0, "updated_share": 2 / 3}
    assert "(rehearse mode, 3 steps: 2 updated (67%), 1 skipped, 0 non-finite, " in capsys.readouterr().out


def test_one_round_is_the_step_it_always_was(tmp_path, monkeypatch):
    """max_sample_rounds 1, the same reward: one draw a step (DRAWS 1-3), every group in the
    update with KL (rows_updated 16, the all-equal groups' rows too); groups_kept counts the
    groups that vary (36; all four; 31)."""
    cfg = dynamic_cfg(tmp_path, max_sample_rounds=1)
    rl = rl_split(cfg)
    scripted_reward(monkeypatch, rl)
    sampled, updated = tagged_passes(monkeypatch)
    assert train.run(cfg) == 0
    index = {t["prompt"]: i for i, t in enumerate(rl)}
    assert [[index[p] for p in names] for names in sampled] == DRAWS[:3]
    assert [[index[p] for p in rows[::4]] for rows in updated] == DRAWS[:3]
    fields = ("status", "sample_rounds", "groups_sampled", "episodes_sampled", "groups_kept", "all_equal_groups",
              "rows_updated", "reward")
    assert [tuple(line[k] for k in fields) for line in metrics(cfg)] == [
        ("updated", 1, 4, 16, 1, 3, 16, 1 / 16), ("updated", 1, 4, 16, 4, 0, 16, 4 / 16),
        ("updated", 1, 4, 16, 1, 3, 16, 1 / 16)]


def test_resume_and_a_dropped_step_across_several_rounds_are_exact(tmp_path, monkeypatch):
    """The run of test_a_run_with_dynamic_sampling, never stopped; stopped after step 1 and resumed;
    and signalled during step 2's second round (the 4th rl_sample call: its first sampled token),
    which drops step 2 (its first round's draws and samples rewound), saves step 1, and resumes.
    Both write the metrics, weights, RNGs and task RNG of the run never stopped."""
    cfg = dynamic_cfg(tmp_path / "whole")
    scripted_reward(monkeypatch, rl_split(cfg))
    assert train.run(cfg) == 0
    whole = metrics(cfg)
    assert [line["sample_rounds"] for line in whole] == [2, 3, 3]

    part = dynamic_cfg(tmp_path / "part", rl_steps=1)
    assert train.run(part) == 0
    assert train.run({**part, "rl_steps": 3}, resume=True) == 0

    dropped = dynamic_cfg(tmp_path / "dropped")
    with monkeypatch.context() as m:
        ran = count_rl_passes(m, signal_at=(4, "token", 1), signum=signal.SIGTERM)
        assert train.run(dropped) == 0
    assert [p["tokens"] for p in ran][3] == 1 and len(ran) == 4        # step 2's round 2 stopped at once
    assert saved_rngs_and_weights(dropped)[0]["step"] == 1 and len(metrics(dropped)) == 1
    assert train.run(dropped, resume=True) == 0

    (a, a_weights) = saved_rngs_and_weights(cfg)
    for other in (part, dropped):
        assert metrics(other) == whole
        b, b_weights = saved_rngs_and_weights(other)
        assert b["step"] == 3 and b["task_rng"] == a["task_rng"]
        assert without_seconds(b["progress"]) == without_seconds(a["progress"])
        assert all(torch.equal(a_weights[k], b_weights[k]) for k in a_weights)
        assert all(torch.equal(a["rngs"][0][k], b["rngs"][0][k]) for k in ("torch", "generator"))
        assert a["rngs"][0]["python"] == b["rngs"][0]["python"]
