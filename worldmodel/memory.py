"""Test-time private rehearsal by the paper's rule, a rehearsal memory: N imagined episodes, each
self-assessed, condensed into a REHEARSAL MEMORY that the one committed real execution reads in
its context; the actor decides: it reads what its imagination showed and acts.

The paper's path (rehearse.private_rehearsal_plans, `python evaluate.py --sweep`) uses another,
simpler rule, a VOTE: the imagined answers vote and the committed episode replays the winning
plan. This file is the paper's rule, used by `world: choice` only. Here:

    self_assess(episode)        one imagined episode -> "good" | "bad" | "unfinished", judged from
                                what the imagination itself shows (no real call, no task answer):
                                  bad         a rehearsed response signalled failure (`error ...`),
                                              whether or not the episode went on to answer
                                  unfinished  no failure signal, but no answer (bad call, truncated)
                                  good        an answer, and no response signalled failure
    memory_text(episodes)       the memory: `memory` then, per imagined episode, `tried`, its calls
                                each with `got RESPONSE`, `answer A` if it answered, its verdict:
        memory tried price pear got 4 answer 4 good tried price apple got error item bad
    memory_prompt(prompt, eps)  the committed episode's prompt: the task, then its memory (role
                                PROMPT in the committed episode: context read, never trained)

The words the memory adds to the toy vocabulary are MEMORY_WORDS (model: tiny would need them in
features.tiny_words).

Where it is used (docs/imagination.md): worlds/choice.py (`world: choice`), a task family where an
imagined outcome tells the actor what it did not know when it chose (buy the cheapest of three
items with one real call per task): the actor is trained to read the memory there (a warm start
on commit episodes with synthetic memories, then RL in which the current policy's imagined
episodes make the memory), and success is measured against N at equal real calls
(docs/imagination.md). The demo's world does not use it.
"""
from world import ERROR_WORDS

MEMORY_WORDS = ["memory", "tried", "got", "good", "bad", "unfinished"]


def self_assess(episode):
    """The verdict on one imagined episode (a dict of rollout.sample_episodes): see the module
    docstring. A failure signal is a response `error WORD` with WORD one of world.ERROR_WORDS."""
    failed = any(r.split()[:1] == ["error"] and r.split()[1:] in [[w] for w in ERROR_WORDS]
                 for r in episode["responses"])
    if failed:
        return "bad"
    return "good" if episode["finished"] else "unfinished"


def episode_memory(episode):
    """`tried CALL got RESPONSE ... [answer A] VERDICT` for one imagined episode. A call that got no
    response (the episode ended at it) is left out: the memory holds what was imagined, in order."""
    words = ["tried"]
    for call, response in zip(episode["calls"], episode["responses"]):
        words += [call, "got", response]
    if episode["finished"]:
        words += ["answer", episode["answer"]]
    return " ".join(words + [self_assess(episode)])


def memory_text(episodes):
    """The rehearsal memory of a task's imagined episodes, in the order they were imagined ('' if none)."""
    return " ".join(["memory"] + [episode_memory(e) for e in episodes]) if episodes else ""


def memory_prompt(prompt, episodes):
    """The committed episode's prompt: the task, then the memory of its imagined episodes."""
    memory = memory_text(episodes)
    return f"{prompt} {memory}" if memory else prompt
