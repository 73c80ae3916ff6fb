"""Rehearsal: the policy playing the environment, its form guard, and private rehearsal at test time.

In the paper the policy, after writing a tool call, writes the response that call would induce;
that response becomes the context of its next action. Here the hand-off is inline: the sampler
forces the `<env>` tag after the actor's `</act>`, the policy writes the response in the same
sequence (role REHEARSE) and closes it with `</env>` (rollout.py). This file holds:

- the `rehearse_check` guard (`check_rehearsal`): a response must have the form its call implies,
  as the official simulator's format/whitelist/schema checks demand;
- test-time private rehearsal (`private_rehearsal_plans`): the paper's use of the internal
  world model at test time, imagine whole episodes before committing one real execution, decided
  here by a VOTE: the imagined answers vote and the committed episode replays the winning plan.
  The vote is this repository's simpler rule, not the paper's; the paper's rule (each imagined
  episode self-assessed into a rehearsal memory that the actor reads and then acts on) is
  worldmodel/memory.py, used by `world: choice`.
How faithful the rehearsals are (fidelity per tool kind, collusion, coverage) is measured in
worldmodel/honesty.py, against a real replay, diagnostic only. What a well-formed rehearsed response is lives
with its world (world.parse_response); the separate rehearse rows' prompt with its layout (worldmodel/separate.py).
"""
import rollout
import world as toy_world


def check_rehearsal(call, response, world=toy_world):
    """The `rehearse_check` guard: does the parsed rehearsed `response` have the form that `call`
    implies (world.response_form)? A number where the tool answers a number, and exactly the
    schema's error for a call its schema rejects: `price 3` -> `error item`, `mul 0 , 3` ->
    `error args`. `pay N` may also be `error funds` (that depends on the wallet, i.e. the value).
    The form only: whether the number is the true one is what the world model must learn."""
    forms = world.response_form(*world.parse_call(call))
    return response in forms or ("N" in forms and response.isdigit())


# ----------------------------------------------------------------------------- private rehearsal

def private_rehearsal_plans(policy, tokenizer, prompts, budget, mode="parallel", rehearser=None,
                            generator=None, world=toy_world, sample=rollout.sample_episodes, settings=None):
    """Paper, test-time private rehearsal: before acting for real on each task, imagine up to `budget`
    complete act/rehearse episodes in which the policy (or `rehearser`, e.g. the warm-start model)
    plays the world, and turn them into a plan for the one committed real execution.

    The rule, a vote (this repository's, not the paper's rehearsal memory: worldmodel/memory.py):
    the imagined answers vote. The plan is the calls of the first imagined episode
    that reached the most-imagined answer, each with the response imagined for it. The committed
    episode (rollout.sample_episodes with `plans`) makes those calls in the real world while the
    real responses are the imagined ones, and re-plans (the policy acts on its own, greedy) from
    the first response that differs. Imagination never calls the real world, so the committed
    episode makes as many real calls as an unrehearsed one would.

    parallel:   `budget` independent imagined episodes per task.
    sequential: one imagined episode per task at a time, each drawn in light of the earlier
                ones: a task stops imagining once two of its imagined episodes agree on the
                answer (or the budget is spent), so it spends imagination only where the
                earlier attempts disagreed. Same vote, at most `budget` imaginations.
    An imagined episode that ends without an answer (bad call, truncation) has no vote.
    sample: the sampler of the imagined episodes, the model's rehearsal layout (format_plain.sample):
    rollout.sample_episodes (inline), or separate.sample_separate; the committed one is the same.
    settings: the imagined episodes' sampler settings (rollout.SAMPLING: temperature, the limits, ...).
    Returns (plans, imaginations used per task)."""
    env_mode = "rehearse" if rehearser is None else "frozen"
    imagined = [[] for _ in prompts]
    per_task = budget if mode == "parallel" else 1
    for _ in range(budget if mode == "sequential" else 1):
        todo = [i for i in range(len(prompts)) if mode == "parallel" or not _agreed(imagined[i])]
        if not todo:
            break
        episodes = sample(
            policy, tokenizer, [prompts[i] for i in todo for _ in range(per_task)], env_mode,
            env_model=rehearser, world=world, settings=settings, generator=generator)
        for k, e in enumerate(episodes):
            imagined[todo[k // per_task]].append(e)
    return [_vote(episodes) for episodes in imagined], [len(episodes) for episodes in imagined]


def _agreed(episodes):
    answers = [e["answer"] for e in episodes if e["finished"]]
    return len(answers) > len(set(answers))


def _vote(episodes):
    """The plan of the first imagined episode with the most-imagined answer ([] if none answered)."""
    answers = [e["answer"] for e in episodes if e["finished"]]
    if not answers:
        return []
    best = max(answers, key=answers.count)          # ties: the answer imagined first
    chosen = next(e for e in episodes if e["finished"] and e["answer"] == best)
    return list(zip(chosen["calls"], chosen["responses"]))
