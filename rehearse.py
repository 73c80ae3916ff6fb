"""Rehearsal: what it takes for the policy to play the environment, and how faithful it is.

In the paper the policy, after writing a tool call, writes the response that call would induce;
that response becomes the context of its next action. Here the hand-off is inline: the sampler
forces the `<env>` tag after the actor's `</act>`, the policy writes the response in the same
sequence (role REHEARSE) and closes it with `</env>`. This file holds:

- `parse_response`: what counts as a well-formed rehearsed response (a number, or `error WORD`
  with a known error word). Anything else ends the episode with reward 0 ("bad_rehearsal"),
  like the official simulator's format check.
- rehearsal fidelity, the caveat the write-ups stress: the internal world model is only as good
  as the calls it has seen, so wherever the real world exists, compare each rehearsed response
  with the real one (exact match), per tool kind. Two ways:
    `replay_fidelity`:  for episodes sampled in `rehearse` mode, replay the same calls in a fresh
                        real world and compare. Diagnostic only: never feeds reward or loss.
    `would_rehearse`:   for episodes run in the real world, ask the model (greedy) what it would
                        have rehearsed at each call, and compare with what the world said.
"""
from collections import defaultdict

import rollout  # a module import: rollout imports this file too
import world as toy_world
from envace import TAG, tag_ids

ERROR_WORDS = ("item", "args", "funds", "call")


def parse_response(text, world=toy_world):
    """'1 2' -> '12', 'error funds' -> 'error funds', anything else -> None."""
    w = world.join_digits(text)
    if len(w) == 1 and w[0].isdigit():
        return w[0]
    if len(w) == 2 and w[0] == "error" and w[1] in ERROR_WORDS:
        return " ".join(w)
    return None


def _tally(pairs, world):
    """[(call, rehearsed, real)] -> {kind: [matches, total]}."""
    counts = defaultdict(lambda: [0, 0])
    for call, rehearsed, real in pairs:
        kind = world.TOOL_KINDS[world.parse_call(call)[0]]
        counts[kind][0] += rehearsed == real
        counts[kind][1] += 1
    return dict(counts)


def replay_fidelity(episodes, world=toy_world):
    """Per tool kind [matches, total] of rehearsed responses against a real replay of the same
    calls (each episode from a fresh world, so the stateful wallet sees the same earlier calls)."""
    pairs = []
    for e in episodes:
        real = world.replay(e["calls"][:len(e["responses"])])
        pairs += zip(e["calls"], e["responses"], real)
    return _tally(pairs, world)


def would_rehearse(model, tokenizer, episodes, world=toy_world, max_env_tokens=6):
    """For real-world episodes: per tool kind [matches, total] of what the model, greedy, would
    have rehearsed at each call (from the episode's own prefix up to the `<env>` tag) against the
    real response."""
    tags = tag_ids(tokenizer)
    prefixes, calls, real = [], [], []
    for e in episodes:
        env_starts = [t for t in range(len(e["ids"]))
                      if e["roles"][t] == TAG and e["ids"][t] == tags["env"][-1]]
        for t, call, response in zip(env_starts, e["calls"], e["responses"]):
            prefixes.append(e["ids"][:t + 1])
            calls.append(call)
            real.append(response)
    if not prefixes:
        return {}
    outs = rollout.complete(model, prefixes, tags["env_end"], max_env_tokens + 1, tags["pad"])
    rehearsed = [parse_response(tokenizer.decode([t for t in o if t != tags["env_end"]]), world)
                 for o in outs]
    return _tally(zip(calls, rehearsed, real), world)


def rates(counts):
    """{kind: [matches, total]} -> {kind: match rate}."""
    return {k: m / n for k, (m, n) in sorted(counts.items()) if n}
