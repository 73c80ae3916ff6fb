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
    `would_rehearse`:   for episodes run in the real world, whether the model (greedy) would
                        have rehearsed at each call exactly what the world said.
"""
from collections import defaultdict

import torch

import world as toy_world
from envace import OBS, collate, micro_batches, tag_ids

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


@torch.no_grad()
def would_rehearse(model, tokenizer, episodes, world=toy_world, token_budget=4096):
    """For real-world episodes: per tool kind [matches, total] of whether the model, decoding
    greedily from the episode's own prefix up to `<env>`, would have written exactly the real
    response and its `</env>`. Greedy decoding reproduces a response iff at each of its tokens
    the argmax given the real tokens before it IS that token, so one teacher-forced forward over
    the real episodes answers every call at once (no generation)."""
    if not any(e["calls"] for e in episodes):
        return {}
    device = next(model.parameters()).device
    ids, roles = collate(episodes, tokenizer.pad_token_id)
    lengths = [len(e["ids"]) for e in episodes]
    hits = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    for index in micro_batches(lengths, token_budget):
        n = max(lengths[i] for i in index)
        batch = ids[index, :n].to(device)
        hits[index, :n - 1] = (model(input_ids=batch).logits[:, :-1].argmax(-1) == batch[:, 1:]).cpu()
    pairs = []
    for i, e in enumerate(episodes):
        obs = [t for t in range(1, len(e["ids"])) if e["roles"][t] == OBS]
        segments = [[]]            # each real response: a run of OBS tokens ending in </env>
        for t in obs:
            segments[-1].append(t)
            if e["ids"][t] == tag_ids(tokenizer)["env_end"]:
                segments.append([])
        for call, response, seg in zip(e["calls"], e["responses"], segments):
            pairs.append((call, "same" if all(hits[i, t - 1] for t in seg) else "other", "same"))
    return _tally(pairs, world)


def rates(counts):
    """{kind: [matches, total]} -> {kind: match rate}."""
    return {k: m / n for k, (m, n) in sorted(counts.items()) if n}
