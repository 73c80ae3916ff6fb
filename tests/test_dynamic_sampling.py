"""DAPO's dynamic sampling (max_sample_rounds, formats/dynamic_sampling.py): how many rounds a step
draws, which groups' episodes it returns for the update, the counts it logs, the paper's one-round
step left as it was (no wrapper at all), and --resume across steps of several rounds.

The rounds are checked twice: with a scripted format (no model: a task's episodes get the rewards
its script names, the task draws are scripted too) through the sampler setup chooses
(features.sampler_and_reward), and in train.run on the toy with a scripted reward (a task of
VARIED gets reward 1 on its first episode of each group, every other task 0)."""
import collections
import contextlib
import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

import rollout
import train
from envace import ACT, PROMPT, REHEARSE
from formats import dynamic_sampling
from formats import features
from formats import format_plain
from machinery import config
from helpers import tiny_cfg, without_seconds
from test_resume import metrics, saved_rngs_and_weights


# ----------------------------------------------------------------------------- a scripted format

G = 2
SCRIPTS = {"A": [1.0, 1.0], "B": [0.0, 1.0], "C": [0.0, 0.0], "D": [1.0, 0.0], "E": [0.0, 0.0],
           "F": [1.0, 0.0], "H": [0.0, 0.0]}          # B, D, F vary
TASKS = [{"name": name, "rewards": rewards} for name, rewards in SCRIPTS.items()]
FP32 = contextlib.nullcontext()


class ScriptedFormat:
    """A format module for features.sampler_and_reward without a model: task t's k-th episode of a
    group gets t's k-th scripted reward; its ids (a prompt token, two ACT tokens) differ by task and
    k, so that an update's rows do not cancel. `sampled`: the task names each rl_sample call got,
    one per group."""

    def __init__(self):
        self.sampled = []

    def inputs(self, setting, tasks, repeat):
        return [t["name"] for t in tasks for _ in range(repeat)], None, None

    def rl_sample(self, setting, model, tokenizer, prompts, worlds, tags, env_model, generator):
        self.sampled.append(prompts[::G])
        return [{"name": p, "k": i % G, "ids": [1, 5 + i % G, 10 + list(SCRIPTS).index(p)], "roles": [PROMPT, ACT, ACT]}
                for i, p in enumerate(prompts)]

    def reward(self, setting, episode, task):
        if episode.get("cause") == "idle":     # no answer: 0, as every format's reward gives it
            return 0.0
        return task["rewards"][episode["k"]]


class ScriptedDraws:
    """The task RNG: each sample(population, k) is the next scripted draw of k task names."""

    def __init__(self, *draws):
        self.draws = [list(d) for d in draws]

    def sample(self, population, k):
        names = self.draws.pop(0)
        assert len(names) == k
        return [next(t for t in population if t["name"] == name) for name in names]


def step_cfg(rounds, **kw):
    return {**config.DEFAULTS, "tasks_per_step": 2, "group_size": G, "max_sample_rounds": rounds, **kw}


def step(draws, rounds=3):
    """One RL step's sampling as train.py's loop runs it, with the scripted format and task draws:
    round 1's tasks drawn, each group_size times, then the sampler and reward setup chose. Returns
    (names sampled per round, the episodes returned, the loop's task list after the call, their
    rewards as the loop computes them, the draws left)."""
    fmt, rng = ScriptedFormat(), ScriptedDraws(*draws)
    sample, reward = features.sampler_and_reward(fmt, SimpleNamespace(tokenizer=None), step_cfg(rounds), TASKS, FP32,
                                                 rng)
    prompts = [t for t in rng.sample(TASKS, 2) for _ in range(G)]
    episodes = sample(None, prompts=prompts, generator=None)
    return fmt.sampled, episodes, prompts, [reward(e, t) for e, t in zip(episodes, prompts)], rng.draws


def names(episodes):
    return "".join(e["name"] for e in episodes)


def test_rounds_are_drawn_until_tasks_per_step_groups_vary():
    """tasks_per_step 2: round 1 (A all 1, B varies) keeps B; round 2 (C all 0, D varies) keeps D:
    2 groups, so round 3 is never drawn. Only the kept groups' episodes come back, and the loop's
    task list holds their tasks, so that each episode is rewarded against its own task."""
    sampled, episodes, prompts, rewards, left = step(["AB", "CD", "EF"])
    assert sampled == [["A", "B"], ["C", "D"]] and left == [["E", "F"]]
    assert names(episodes) == "BBDD" and [t["name"] for t in prompts] == ["B", "B", "D", "D"]
    assert rewards == [0.0, 1.0, 1.0, 0.0]
    assert all(e["sampling"] == {"sample_rounds": 2, "groups_sampled": 4, "episodes_sampled": 8, "groups_kept": 2}
               for e in episodes)


def test_a_round_with_more_groups_than_needed_keeps_the_first():
    """Round 1 keeps B; round 2's D and F both vary, one is needed: D (drawn first)."""
    _, episodes, prompts, _, left = step(["AB", "DF", "EH"])
    assert names(episodes) == "BBDD" and names(prompts) == "BBDD" and left == [["E", "H"]]
    assert episodes[0]["sampling"] == {"sample_rounds": 2, "groups_sampled": 4, "episodes_sampled": 8,
                                       "groups_kept": 2}


def test_the_rounds_end_at_max_sample_rounds():
    """Three rounds, one group varies (F, round 3): kept alone; no fourth round. Its batch is one
    group of two rows with rewards 1, 0: A = +0.5, -0.5 on their two ACT targets."""
    _, episodes, prompts, rewards, left = step(["AC", "EH", "CF", "BD"])
    assert names(episodes) == "FF" and names(prompts) == "FF" and left == [["B", "D"]]
    assert episodes[0]["sampling"] == {"sample_rounds": 3, "groups_sampled": 6, "episodes_sampled": 12,
                                       "groups_kept": 1}
    batch = train.make_batch(episodes, rewards, step_cfg(3), pad_id=0)
    assert batch["advantages"].tolist() == [[0.5, 0.5], [-0.5, -0.5]]
    assert (batch["n_groups"], batch["all_equal_groups"], batch["n_tokens"]) == (1, 0, 4)


def test_a_step_with_no_group_varying_returns_every_episode_and_is_skipped():
    """Three rounds of all-equal groups: nothing kept; every sampled episode comes back with its
    task (6 groups, all equal) and rl_step skips the step, as a one-round step with no signal is
    skipped, before it runs the model or touches the optimizer (a model of one weight, no optimizer)."""
    _, episodes, prompts, rewards, _ = step(["AC", "EH", "CA"])
    assert names(episodes) == names(prompts) == "AACCEEHHCCAA"
    assert episodes[0]["sampling"]["groups_kept"] == 0 and episodes[0]["sampling"]["sample_rounds"] == 3
    batch = train.make_batch(episodes, rewards, step_cfg(3), pad_id=0)
    assert (batch["n_groups"], batch["all_equal_groups"]) == (6, 6) and not batch["advantages"].any()
    model = torch.nn.Linear(1, 1)
    before = model.weight.clone()
    assert train.rl_step(model, model, None, batch, step_cfg(3), FP32) == {"status": "skipped"}
    assert torch.equal(model.weight, before)


def test_one_round_is_the_papers_step():
    """max_sample_rounds 1: setup chooses the plain sampler (no dynamic sampling at all): one draw,
    every group in the update (A's all-equal one too: its rows count in the token mean and the
    KL), the loop's task list as drawn, no sampling counts on the episodes."""
    cfg = step_cfg(1)
    sample, _ = features.sampler_and_reward(ScriptedFormat(), None, cfg, TASKS, FP32, None)
    assert sample.func is features.layout_sampler
    assert features.sampler_and_reward(ScriptedFormat(), None, step_cfg(2), TASKS, FP32, None)[0].func \
        is dynamic_sampling.sample_until_varied
    sampled, episodes, prompts, rewards, left = step(["AB", "CD"], rounds=1)
    assert sampled == [["A", "B"]] and left == [["C", "D"]]
    assert names(episodes) == names(prompts) == "AABB" and not any("sampling" in e for e in episodes)
    batch = train.make_batch(episodes, rewards, cfg, pad_id=0)
    assert (batch["n_groups"], batch["all_equal_groups"], batch["n_tokens"]) == (2, 1, 8)


def rehearsed(name, n_rehearsals):
    """An episode of task `name` (an ACT target) with separate rehearse rows (a REHEARSE target each)."""
    return {"ids": [1, 2], "roles": [PROMPT, ACT], "name": name,
            "rehearsals": [{"ids": [1, 3], "roles": [PROMPT, REHEARSE], "name": f"{name}.r{i + 1}"}
                           for i in range(n_rehearsals)]}


def test_rows_under_per_role_groups():
    """Task 0: a (reward 1, two calls), b (1, one call), c (0, no call); task 1: d (1, one call),
    e (0, one call), f (1, no call); group_size 3. task_role: task 0's actor rows a, b, c (1, 1, 0:
    A = 1/3, 1/3, -2/3) and its rehearse rows a.r1, a.r2, b.r1 (all 1: group all-equal, the rows
    stay in the batch with A = 0); task 1's actor rows (1, 0, 1: 1/3, -2/3, 1/3) and rehearse rows
    d.r1, e.r1 (1, 0: +1/2, -1/2). task: one group per task (task 0: 5 of 6 rows rewarded, mean
    5/6; task 1: 3 of 5, mean 3/5), neither all-equal: all 11 rows."""
    episodes = [rehearsed("a", 2), rehearsed("b", 1), rehearsed("c", 0),
                rehearsed("d", 1), rehearsed("e", 1), rehearsed("f", 0)]
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    batch = train.make_batch(episodes, rewards, step_cfg(1, group_size=3), pad_id=0)
    # training_rows' order: each episode's own row, then its rehearse rows
    # a, a.r1, a.r2, b, b.r1, c, d, d.r1, e, e.r1, f
    want = [1 / 3, 0, 0, 1 / 3, 0, -2 / 3, 1 / 3, 1 / 2, -2 / 3, -1 / 2, 1 / 3]
    assert batch["advantages"][:, 0].tolist() == pytest.approx(want)
    assert (batch["n_groups"], batch["all_equal_groups"], batch["n_tokens"]) == (4, 1, 11)
    batch = train.make_batch(episodes, rewards, step_cfg(1, group_size=3, advantage_groups="task"), pad_id=0)
    want = [1 / 6] * 5 + [-5 / 6] + [2 / 5, 2 / 5, -3 / 5, -3 / 5, 2 / 5]
    assert batch["advantages"][:, 0].tolist() == pytest.approx(want)
    assert (batch["n_groups"], batch["all_equal_groups"]) == (2, 0)


def test_a_rank_that_kept_nothing_gets_an_idle_row(monkeypatch):
    """Rank 1 of 2 (1 task a round each), its groups all equal, while rank 0 finds one varied group a
    round: after 2 rounds the step has its 2 groups, none of them here. This rank returns one idle
    row (no trained target: 0 tokens) with round 1's first task, so that its update runs as many
    passes as rank 0's and adds nothing; the counts are the step's over both ranks."""
    monkeypatch.setattr(dynamic_sampling, "world", lambda: (1, 2))
    monkeypatch.setattr(dynamic_sampling, "all_sum", lambda values: [a + b for a, b in zip(values, [1, 0])])
    fmt, rng = ScriptedFormat(), ScriptedDraws(["H", "A"], ["E", "C"], ["B", "D"])   # (this rank: A, C)
    sample, reward = features.sampler_and_reward(fmt, SimpleNamespace(tokenizer=None), step_cfg(3), TASKS, FP32, rng)
    prompts = [t for t in rng.sample(TASKS, 2)[1:] for _ in range(G)]              # the loop's draw, rank 1's slice
    episodes = sample(None, prompts=prompts, generator=None)
    assert fmt.sampled == [["A"], ["C"]] and rng.draws == [["B", "D"]]
    assert [(e["ids"], e["roles"], e["cause"]) for e in episodes] == [([0, 0], [PROMPT, PROMPT], "idle")]
    assert names(prompts) == "A"
    assert episodes[0]["sampling"] == {"sample_rounds": 2, "groups_sampled": 4, "episodes_sampled": 8,
                                       "groups_kept": 2}
    batch = train.make_batch(episodes, [reward(e, t) for e, t in zip(episodes, prompts)], step_cfg(3), 7)
    assert batch["n_tokens"] == 0 and not batch["advantages"].any() and batch["lengths"] == [2]
    assert (batch["n_groups"], batch["all_equal_groups"]) == (1, 1)


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
    monkeypatch.setattr(dynamic_sampling, "all_sum", lambda values: [a + b for a, b in zip(values, others)])
    assert dynamic_sampling.first_needed(varied, need, rank, 2) == want


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
    """[(the tasks sampled, per sampler call: one per group)], [(the tasks of the update's episodes,
    per make_batch)]: each episode tagged with its task's prompt. RL's sampler on the toy is
    rollout.sample_episodes, bound at setup (its `prompts`: task dicts, each group_size times)."""
    sampled, updated, real_sample, real_batch = [], [], rollout.sample_episodes, train.make_batch

    def sample_episodes(*args, prompts, **kwargs):
        episodes = real_sample(*args, prompts=prompts, **kwargs)
        sampled.append([t["prompt"] for t in prompts[::4]])
        for e, t in zip(episodes, prompts, strict=True):
            e["prompt"] = t["prompt"]
        return episodes

    def make_batch(episodes, *args, **kwargs):
        updated.append([e["prompt"] for e in episodes])
        return real_batch(episodes, *args, **kwargs)
    monkeypatch.setattr(rollout, "sample_episodes", sample_episodes)
    monkeypatch.setattr(train, "make_batch", make_batch)
    return sampled, updated


def rl_split(cfg):
    return features.build_tasks(cfg)["rl"]


def dynamic_cfg(path, **kw):
    return tiny_cfg(path, **{"rl_steps": 3, "kl_coef": 0.05, "n_test": 4, "save_every": 0, "max_sample_rounds": 3, **kw})


def test_a_run_with_dynamic_sampling(tmp_path, monkeypatch, capsys):
    """tasks_per_step 4, 3 rounds at most, seed 1's draws (DRAWS) and VARIED:
    step 1: draws 1, 2 ([8 36 4 16]: 36 varies; [7 31 28 30]: all vary): 36, 7, 31, 28 kept, 30
            not (4 are enough); 2 rounds, 32 episodes; the update's 16 episodes, 4 rewarded
    step 2: draws 3-5 ([24 13 6 31]: 31; [1 24 27 38]: none; [0 28 17 14]: 28): 2 kept; 48
            episodes sampled; the update's 8, 2 rewarded
    step 3: draws 6-8: none varies: skipped after 3 rounds (all 48 episodes, 12 all-equal groups)
    The line's reward and all_equal_groups are the update's episodes'. With kl_coef > 0 every row
    of the update gets a gradient (KL): rows_updated = 4 x kept groups; the task RNG saved has made
    8 draws."""
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
        ("updated", 2, 8, 32, 4, 0, 4 / 16, 0), ("updated", 3, 12, 48, 2, 0, 2 / 8, 0),
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
    update with KL (rows_updated 16, the all-equal groups' rows too); no sampling counts in the
    line (the plain sampler: nothing counts rounds)."""
    cfg = dynamic_cfg(tmp_path, max_sample_rounds=1)
    rl = rl_split(cfg)
    scripted_reward(monkeypatch, rl)
    sampled, updated = tagged_passes(monkeypatch)
    assert train.run(cfg) == 0
    index = {t["prompt"]: i for i, t in enumerate(rl)}
    assert [[index[p] for p in names] for names in sampled] == DRAWS[:3]
    assert [[index[p] for p in rows[::4]] for rows in updated] == DRAWS[:3]
    fields = ("status", "all_equal_groups", "rows_updated", "reward")
    lines = metrics(cfg)
    assert [tuple(line[k] for k in fields) for line in lines] == [
        ("updated", 3, 16, 1 / 16), ("updated", 0, 16, 4 / 16), ("updated", 3, 16, 1 / 16)]
    assert not any(k in line for line in lines for k in ("sample_rounds", "groups_kept"))


def test_resume_across_steps_of_several_rounds_is_exact(tmp_path, monkeypatch):
    """The run of test_a_run_with_dynamic_sampling, never stopped; stopped after step 1 and
    resumed; and interrupted inside step 2's second round (a KeyboardInterrupt from the 4th sampler
    call, as Ctrl-C there raises it), which ends the run at once with step 1's checkpoint on the
    disk (save_every 1): --resume redoes step 2 from it, its first round's draws and samples too.
    Both write the metrics, weights, RNGs and task RNG of the run never stopped."""
    cfg = dynamic_cfg(tmp_path / "whole")
    scripted_reward(monkeypatch, rl_split(cfg))
    assert train.run(cfg) == 0
    whole = metrics(cfg)
    assert [line["sample_rounds"] for line in whole] == [2, 3, 3]

    part = dynamic_cfg(tmp_path / "part", rl_steps=1)
    assert train.run(part) == 0
    assert train.run({**part, "rl_steps": 3}, resume=True) == 0

    stopped = dynamic_cfg(tmp_path / "stopped", save_every=1)
    calls, real_sample = [], rollout.sample_episodes

    def interrupted_at_the_4th(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_sample(*args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(rollout, "sample_episodes", interrupted_at_the_4th)
        with pytest.raises(KeyboardInterrupt):
            train.run(stopped)
    assert len(calls) == 4
    assert saved_rngs_and_weights(stopped)[0]["step"] == 1 and len(metrics(stopped)) == 1
    assert train.run(stopped, resume=True) == 0

    (a, a_weights) = saved_rngs_and_weights(cfg)
    for other in (part, stopped):
        assert metrics(other) == whole
        b, b_weights = saved_rngs_and_weights(other)
        assert b["step"] == 3 and b["task_rng"] == a["task_rng"]
        assert without_seconds(b["progress"]) == without_seconds(a["progress"])
        assert all(torch.equal(a_weights[k], b_weights[k]) for k in a_weights)
        assert all(torch.equal(a["rngs"][0][k], b["rngs"][0][k]) for k in ("torch", "generator"))
        assert a["rngs"][0]["python"] == b["rngs"][0]["python"]
