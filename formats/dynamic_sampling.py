"""DAPO's dynamic sampling (max_sample_rounds > 1): a sampler wrapper chosen once at setup
(formats/features.sampler_and_reward). The paper's step, and the demo, never enter it.

A group whose rewards are all equal has A = 0 on every token: no signal. `sample_until_varied`
samples the step's tasks as the plain sampler does (round 1), then draws more rounds of
tasks_per_step tasks from the run's task RNG (every rank the same draw, then its slice, as
train.py draws round 1) until tasks_per_step groups with reward variance are found over all ranks
(the first ones drawn, rank 0's first: `first_needed`) or max_sample_rounds rounds are. It returns
the episodes of the kept groups only, and puts their tasks in place of the loop's `prompts` list,
so that the loop's reward line pairs each episode with its own task. When no rank found a group
with variance, every round's episodes are returned (the step is then skipped, as a one-round step
is); a rank that kept none while others did returns one idle row (two prompt tokens, nothing
trained) so that its update passes stay in step with theirs. Each returned episode carries the
step's counts under "sampling" (rounds drawn, groups and episodes sampled, groups kept), which the
step's metrics line reports.
"""
from envace import PROMPT
from machinery.distributed import all_sum, world
from reward import varied_groups


def sample_until_varied(model, prompts, generator, sample, reward, rl_tasks, task_rng, cfg):
    """The step's episodes of up to tasks_per_step groups with reward variance (see the module's
    docstring). `prompts`: the loop's round-1 tasks, group_size consecutive entries each, replaced
    in place by the kept episodes' tasks."""
    G, want = cfg["group_size"], cfg["tasks_per_step"]
    rank, world_size = world()
    per_rank = want // world_size
    group, every_episode, every_task, kept, kept_tasks, n_kept = list(prompts), [], [], [], [], 0
    for rounds in range(1, cfg["max_sample_rounds"] + 1):
        if rounds > 1:
            tasks = task_rng.sample(rl_tasks, want)[rank * per_rank:(rank + 1) * per_rank]
            group = [t for t in tasks for _ in range(G)]
        episodes = sample(model, prompts=group, generator=generator)
        rewards = [reward(e, t) for e, t in zip(episodes, group)]
        every_episode, every_task = every_episode + episodes, every_task + group
        varied = sorted(varied_groups(rewards, [i // G for i in range(len(episodes))]))
        mine, n_round = first_needed(varied, want - n_kept, rank, world_size)
        for g in mine:
            kept, kept_tasks = kept + episodes[g * G:(g + 1) * G], kept_tasks + group[g * G:(g + 1) * G]
        n_kept += n_round
        if n_kept == want:
            break
    if n_kept == 0:                 # no signal anywhere: every episode, and the step is skipped
        kept, kept_tasks = every_episode, every_task
    elif not kept:                  # none here, some on another rank: an idle row keeps the ranks in step
        kept = [{"ids": [0, 0], "roles": [PROMPT, PROMPT], "logprobs": [0.0, 0.0], "calls": [], "responses": [],
                 "cause": "idle", "answer": None, "answers": [], "finished": False}]
        kept_tasks = [every_task[0]]
    counts = {"sample_rounds": rounds, "groups_sampled": rounds * want, "episodes_sampled": rounds * want * G,
              "groups_kept": n_kept}
    prompts[:] = kept_tasks
    return [{**e, "sampling": counts} for e in kept]


def first_needed(varied, need, rank=0, world_size=1):
    """Of this rank's groups with reward variance in a round (`varied`, in task order), those among
    the round's first `need` over all ranks, rank 0's first (the order of the global task draw,
    which each rank slices): (this rank's kept groups, how many the round kept over all ranks)."""
    counts = all_sum([len(varied) if r == rank else 0 for r in range(world_size)])   # [len(varied)] alone
    before = int(sum(counts[:rank]))
    return varied[:max(0, min(len(varied), need - before))], min(int(sum(counts)), need)
