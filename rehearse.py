"""Rehearsal: the policy playing the environment, its form guard, and private rehearsal at test time.

In the paper the policy, after writing a tool call, writes the response that call would induce;
that response becomes the context of its next action. Here the hand-off is inline: the sampler
(rollout.py) forces the `<env>` tag after the actor's `</act>`, then hands every token of the
world's turn to `world_token`, where the policy writes the response in the same sequence (role
REHEARSE) and closes it with `</env>`. This file holds:

- `world_token`: the world's turn of a row, token by token: in rehearse mode the rehearsal itself
  (the response the policy writes, read back by world.parse_response when `</env>` closes it);
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
import world as toy_world
from envace import decoded, world_is_sampled


def world_token(row, tok, tags, tokenizer, env_mode, max_env_tokens, rehearse_check=None):
    """Paper, rehearsal: one token of the world's turn of a sampler row (rollout.py's state machine,
    phase "env", after the forced `<env>`). Returns True when `</env>` closed a response the row goes
    on from (the sampler then hands the turn back to the actor), else False.
      rehearse: the policy writes the response (REHEARSE tokens; frozen: the warm-start copy, OBS).
                A tag, or more than max_env_tokens tokens, ends the row ("bad_rehearsal",
                "env_limit"); at `</env>` the text is read by the world (world.parse_response: None
                is "bad_rehearsal") and, with `rehearse_check`, checked against its call
                ("rehearse_check"), then recorded in row["responses"].
      real, none: the response was written whole at the call (rollout._end_act) and is forced
                token by token (OBS): nothing to decide until `</env>`.
    A separate rehearse row (stop_at "response") ends with its response (cause "response")."""
    if tok == tags["env_end"]:
        if world_is_sampled(env_mode):        # real (and empty) responses were recorded at the call
            response = row["world"].parse_response(decoded(tokenizer, tuple(row["segment"])))
            if response is None:
                return _ended(row, "bad_rehearsal")
            row["responses"].append(response)
            if rehearse_check is not None and not rehearse_check(row["calls"][-1], response, row["world"]):
                return _ended(row, "rehearse_check")
        if row.get("stop_at") == "response":      # a separate rehearse row ends with its response
            return _ended(row, "response")
        row["segment"] = []
        return True
    if env_mode in ("real", "none"):
        return False                            # a forced observation token: nothing to decide
    if tok in tags["stops"]:
        return _ended(row, "bad_rehearsal")     # the world wrote a tag
    if len(row["segment"]) >= max_env_tokens:
        return _ended(row, "env_limit")
    row["segment"].append(tok)
    return False


def _ended(row, cause):
    """The row is done, for `cause`; its world's turn does not hand back to the actor."""
    row["phase"], row["cause"] = "done", cause
    return False


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
                            generator=None, world=toy_world, *, sample, settings=None):
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
    rollout.sample_episodes (inline), or separate.sample_separate; the committed one is the same
    (an argument: rollout.py imports this file for `world_token`).
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
