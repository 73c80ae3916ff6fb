"""Honesty of the rehearsals: fidelity, coverage and collusion, measured against the real world.

The caveat the write-ups stress: the internal world model is only as good as the calls it has
seen, and task reward alone invites the world role to fix the actor's mistakes. Wherever the real
world exists, each rehearsed response is compared with the real one (exact match), per tool kind.
Everything here is diagnostic only: it never feeds a reward or a loss (the guards that do are
config switches: kl_rehearse_coef, rehearse_check, grounding_examples; docs/honesty.md).

    replay_fidelity         episodes sampled in `rehearse` mode: replay the same calls in a fresh
                            real world and compare.
    would_rehearse_calls    episodes run in the real world: would the model (greedy) have
                            rehearsed at each call exactly what the world said (the fidelity gate);
    coverage_fidelity       the same on the expert's calls, bucketed by how often the warm start
                            saw each call.
    fidelity_by_cache       the test calls seen / unseen by the tool cache (the grounding
                            source), and fidelity per tool kind split by it.
    fidelity_gate           train.py's gate after the warm start: rehearse/frozen RL only if every
                            tool kind's would-rehearse fidelity reaches min_fidelity.
    collusion_counts        wrong calls answered as if they were right (reward hacking by the world).
    imagined_world          the policy acts and rehearses on test tasks; success, fidelity and
                            collusion in that imagined world.
"""
from collections import defaultdict

import torch

import rollout
import world as toy_world
from rehearsal import toolcache
from envace import (OBS, REHEARSE, can_share_prefix, collate, encode_episode, final_hidden, lean_head, micro_batches,
                    shared_prefix_forward, shared_prefix_length, tag_ids)
from reward import task_reward


def collusion_counts(episodes, tasks, world=toy_world):
    """Collusion between the roles, for rehearsed (or frozen-simulated) episodes, one task each.

    For an episode e of task t, with t["calls"] the scripted expert's calls:
      real[i] = world.replay(e["calls"][:len(e["responses"])])[i]   the real response to call i
                (a fresh wallet, so a pay sees the same earlier calls)
      path    = {(tool of c, world's response to c) for c in t["calls"]}   the values, per tool,
                that the task's solution passes through (its last one is the answer)
      call i is WRONG     iff real[i] is an error or (tool_i, real[i]) is not in path. A toy task
                          is answered only by copying the last response, each response feeding
                          the next call (price -> mul -> pay), so a real response off the path
                          means the same actions in the real world carry a wrong value forward
                          (pricing the distractor, a wrong factor, a wrong payment);
      a wrong call COLLUDES iff e["responses"][i] != real[i], (tool_i, e["responses"][i]) is in
                          path, and task_reward(e, t) == 1: the rehearsal answered the wrong call
                          with the value the task needed, and the episode succeeded on it.
    Only calls with a response count (a truncated rehearsal has none). Tasks without expert
    calls (read from a task file) are skipped. Returns {"calls", "wrong", "colluding"}: sums
    that add up over micro-batches, steps and ranks; rate = colluding / wrong (`collusion_rate`).

    Example, `not pear cost 3 milk` (milk 2, pear 4; path: price 2, mul 6):
      price pear -> rehearsed 2 (real 4); mul 3 , 2 -> 6; answer 6:  2 calls, 1 wrong, 1 colludes
      price pear -> rehearsed 4 (true); mul 3 , 4 -> 12; answer 12:  2 calls, 2 wrong, 0 collude
      price milk -> 2; mul 3 , 2 -> 6; answer 6:                     2 calls, 0 wrong
      together: 6 calls, 3 wrong, 1 colluding, rate 1/3."""
    counts = {"calls": 0, "wrong": 0, "colluding": 0}
    for e, t in zip(episodes, tasks):
        if not t.get("calls"):
            continue
        path = {(world.parse_call(c)[0], r) for c, r in zip(t["calls"], world.replay(t["calls"]))}
        success = task_reward(e, t) == 1
        real = world.replay(e["calls"][:len(e["responses"])])
        for call, imagined, truth in zip(e["calls"], e["responses"], real):
            tool = world.parse_call(call)[0]
            wrong = truth.startswith("error") or (tool, truth) not in path
            counts["calls"] += 1
            counts["wrong"] += wrong
            counts["colluding"] += wrong and success and imagined != truth and (tool, imagined) in path
    return counts


def collusion_rate(counts):
    """{"calls", "wrong", "colluding"} -> the same with "rate": colluding / wrong (None if no wrong call)."""
    return {**counts, "rate": counts["colluding"] / counts["wrong"] if counts["wrong"] else None}


def by_kind(calls, world=toy_world):
    """[(call, matched)] -> {tool kind: [matches, total]}."""
    counts = defaultdict(lambda: [0, 0])
    for call, matched in calls:
        kind = world.TOOL_KINDS[world.parse_call(call)[0]]
        counts[kind][0] += matched
        counts[kind][1] += 1
    return dict(counts)


def replay_fidelity(episodes, world=toy_world):
    """The paper's caveat, measured: per tool kind [matches, total] of rehearsed responses
    against a real replay of the same
    calls (each episode from a fresh world, so the stateful wallet sees the same earlier calls)."""
    calls = []
    for e in episodes:
        real = world.replay(e["calls"][:len(e["responses"])])
        calls += [(c, imagined == truth) for c, imagined, truth in zip(e["calls"], e["responses"], real)]
    return by_kind(calls, world)


@torch.no_grad()
def greedy_hits(model, rows, role, pad_id, token_budget=4096):
    """One teacher-forced forward over `rows` (micro-batched): hits[i, t] is whether the argmax
    after row i's first t+1 tokens IS its token t+1, for the targets of `role` (OBS: the real
    responses; REHEARSE: a rehearse row's); every other target is False.
    A transformers model (envace.lean_head) runs the ids every row of a micro-batch shares (a chat
    row's system prompt and tool schemas) once (envace.shared_prefix_forward) and its LM head on
    the `role` targets only: the full-vocabulary logits of the other positions, most of a chat
    row, are never made. Other models (tests' fakes) give their logits whole.
    Returns (hits [B, T-1], roles [B, T])."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))     # no weights: the CPU
    ids, roles = collate(rows, pad_id)
    wanted = roles[:, 1:] == role
    lengths = [len(r["ids"]) for r in rows]
    hits = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    head = lean_head(model)
    for index in micro_batches(lengths, token_budget):
        n = max(lengths[i] for i in index)
        batch, want = ids[index, :n].to(device), wanted[index, :n - 1].to(device)
        if head is None:
            hits[index, :n - 1] = ((model(input_ids=batch).logits[:, :-1].argmax(-1) == batch[:, 1:]) & want).cpu()
            continue
        prefix = shared_prefix_length(batch, [lengths[i] for i in index]) if can_share_prefix(model) else 0
        if prefix:
            pieces = shared_prefix_forward(model, batch, prefix)
        else:
            pieces = [(0, final_hidden(model, batch, use_cache=False))]
        hidden = torch.cat([h.expand(len(index), -1, -1) for _, h in pieces], 1)    # [b, n, H]
        found = torch.zeros_like(want)
        # shift by one: position t's hidden state predicts id t+1, the target `want` marks
        found[want] = head(hidden[:, :-1][want]).argmax(-1) == batch[:, 1:][want]
        hits[index, :n - 1] = found.cpu()
    return hits, roles


@torch.no_grad()
def would_rehearse_calls(model, tokenizer, episodes, token_budget=4096, env_end=None):
    """For real-world episodes: per tool kind [matches, total] of whether the model, decoding
    greedily from the episode's own prefix up to `<env>`, would have written exactly the real
    response and its `</env>`. Greedy decoding reproduces a response iff at each of its tokens
    the argmax given the real tokens before it IS that token, so one teacher-forced forward over
    the real episodes answers every call at once (no generation). Returns [(call, matched)].
    env_end: the id closing a response (chat format: the template's; default the toy's </env>)."""
    env_end = tag_ids(tokenizer)["env_end"] if env_end is None else env_end
    if not any(e["calls"] for e in episodes):
        return []
    hits, _ = greedy_hits(model, episodes, OBS, tokenizer.pad_token_id, token_budget)
    pairs = []
    for i, e in enumerate(episodes):
        obs = [t for t in range(1, len(e["ids"])) if e["roles"][t] == OBS]
        segments = [[]]            # each real response: a run of OBS tokens ending in </env>
        for t in obs:
            segments[-1].append(t)
            if e["ids"][t] == env_end:
                segments.append([])
        pairs += [(call, all(hits[i, t - 1] for t in seg)) for call, seg in zip(e["calls"], segments)]
    return pairs


def fidelity_by_coverage(pairs, warm_start_counts, edges=(1, 50)):
    """[(call, matched)] -> {bucket: [matches, total]}, bucketed by how often the exact call was
    in the warm-start data: the paper's caveat that the world model is only as good as the
    action/response pairs it has seen, measured."""
    names = ["seen 0 times", f"seen {edges[0]}-{edges[1] - 1} times", f"seen {edges[1]}+ times"]
    counts = {name: [0, 0] for name in names}
    for call, matched in pairs:
        n = warm_start_counts.get(call, 0)
        name = names[(n >= edges[0]) + (n >= edges[1])]
        counts[name][0] += matched
        counts[name][1] += 1
    return counts


def fidelity_by_cache(pairs, cache, by_kind):
    """The test calls' coverage by the tool cache (rehearsal/toolcache.py: training traffic only)
    and would-rehearse fidelity split by it: [(call, matched)] -> {"cache_coverage": {"seen",
    "unseen": calls, "rate": seen / calls or None}, "fidelity_by_cache": {"seen": by_kind(its
    pairs), "unseen": ...}}, a call seen iff exactly it is in the cache. No cache: {}."""
    if cache is None:
        return {}
    split = {"seen": [], "unseen": []}
    for call, matched in pairs:
        split["seen" if toolcache.times_seen(cache, call) else "unseen"].append((call, matched))
    seen, unseen = len(split["seen"]), len(split["unseen"])
    return {"cache_coverage": {"seen": seen, "unseen": unseen, "rate": seen / (seen + unseen) if pairs else None},
            "fidelity_by_cache": {name: by_kind(part) for name, part in split.items()}}


def rates(counts):
    """{kind: [matches, total]} -> {kind: match rate}."""
    return {k: m / n for k, (m, n) in sorted(counts.items()) if n}


@torch.no_grad()
def would_rehearse_rows(model, rows, pad_id, token_budget=4096):
    """[(row["call"], matched)]: would the model write each rehearse row's REHEARSE tokens greedily
    (one teacher-forced forward)? The rows of rehearsal_rows, or chat_separate.rehearse_rows."""
    if not rows:
        return []
    hits, roles = greedy_hits(model, rows, REHEARSE, pad_id, token_budget)
    target = roles[:, 1:] == REHEARSE
    return [(r["call"], bool(hits[i][target[i]].all())) for i, r in enumerate(rows)]


def coverage_fidelity(model, tokenizer, tasks, warm_start_counts, would_rehearse=would_rehearse_calls,
                      world=toy_world):
    """The coverage caveat: would-rehearse fidelity on the EXPERT's calls of `tasks` (their real
    responses replayed, `expert_episodes`), bucketed by how often each exact call was in the
    warm-start data. The expert's calls, not the policy's: a policy that never calls an unseen
    item would hide it."""
    return fidelity_by_coverage(would_rehearse(model, tokenizer, expert_episodes(tokenizer, tasks, world)),
                                warm_start_counts)


def expert_episodes(tokenizer, tasks, world=toy_world):
    """The expert's episodes of the tasks that have calls: their calls, the real responses replayed
    on `world`, their answer, as rows with calls and responses (what coverage asks the model)."""
    expert = []
    for t in tasks:
        if t.get("calls"):
            responses = world.replay(t["calls"])
            expert.append({**encode_episode(tokenizer, t["prompt"], t["calls"], responses, t["answer"]),
                           "calls": t["calls"], "responses": responses})
    return expert


def imagined_world(model, tokenizer, tasks, cfg, generator=None, world=toy_world,
                   sample=rollout.sample_episodes, **sample_args):
    """The world model's honesty on `tasks`: the policy acts and rehearses (rehearse mode, the
    eval sampling, no real call in the loop; `sample` is the layout's sampler, `sample_args` its
    own arguments, e.g. separate.sample_separate's grounding examples), and the episodes
    are scored against a real replay. Returns imagined_success (the task reward in that imagined
    world), imagined_fidelity (per tool kind) and collusion ({calls, wrong, colluding, rate},
    collusion_counts). Tasks are sampled eval_batch_size at a time, as in evaluation."""
    model.eval()
    limits = {k: cfg[k] for k in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
    episodes, batch_size = [], cfg["eval_batch_size"]
    for i in range(0, len(tasks), batch_size):
        episodes += sample(model, tokenizer, [t["prompt"] for t in tasks[i:i + batch_size]], "rehearse",
                           world=world, temperature=cfg["eval_temperature"], top_p=cfg["top_p"],
                           generator=generator, **limits, **sample_args)
    fidelity = replay_fidelity(episodes, world)
    return {"imagined_success": sum(task_reward(e, t) for e, t in zip(episodes, tasks)) / len(tasks),
            "imagined_fidelity": rates(fidelity), "imagined_fidelity_counts": fidelity,
            "collusion": collusion_rate(collusion_counts(episodes, tasks, world))}


def fidelity_gate(before, cfg, log):
    """Rehearsed rewards are only as good as the rehearsals: rehearse/frozen RL goes on only if
    every tool kind's would-rehearse fidelity reaches min_fidelity (tasks with no real world to
    compare with skip the gate)."""
    low = {k: v for k, v in before["fidelity"].items() if v < cfg["min_fidelity"]}
    if not before["executed_tasks"]:
        log("fidelity gate skipped: these tasks have no real environment to compare rehearsals with")
    elif cfg["env_mode"] in ("rehearse", "frozen") and cfg["min_fidelity"] > 0 and (low or not before["fidelity"]):
        log(f"fidelity gate FAILED: {low or 'no calls made'} below min_fidelity "
            f"{cfg['min_fidelity']}: rehearsed rewards would be noise for these tools. Raise "
            f"snippet_repeats/sft_steps/coverage, or set --min_fidelity=0 to run anyway.")
        return False
    else:
        log(f"fidelity gate passed: every tool kind >= {cfg['min_fidelity']} ({cfg['env_mode']} mode)")
    return True
