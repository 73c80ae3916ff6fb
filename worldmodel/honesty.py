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
from machinery import kvcache
from worldmodel import toolcache
from envace import OBS, REHEARSE, collate, encode_episode, micro_batches, tag_ids, world_is_sampled
from machinery.distributed import can_share_prefix
from machinery.sharedprefix import final_hidden, lean_head, shared_prefix_length
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


def response_segments(row, stop, role=OBS):
    """The positions of each response of a row: runs of `role` ids, each ending at `stop` (the
    last one maybe unfinished or empty). A call's response is the segment of the same index."""
    segments = [[]]
    for t in range(1, len(row["ids"])):
        if row["roles"][t] == role:
            segments[-1].append(t)
            if row["ids"][t] == stop:
                segments.append([])
    return segments


@torch.no_grad()
def greedy_hits(model, rows, role, pad_id, token_budget=4096, stop=None):
    """One teacher-forced forward over `rows` (micro-batched): hits[i, t] is whether the argmax
    after row i's first t+1 tokens IS its token t+1, for the targets of `role` (OBS: the real
    responses; REHEARSE: a rehearse row's); every other target is False.
    With `stop` (the id closing a response), also what greedy decoding writes where it does not
    reproduce a response (a `response_segments` segment with a missed target): the ids from the
    response's start until `stop`, at most 2 x the response's length + 8 (None if no `stop` by then).
    Each row runs up to its last `role` id. A transformers model (lean_head) runs the ids every
    row starts with (a chat row's system prompt and tool schemas) once for all the rows, and once
    per group the ids a group of rows goes on with alike (`_prefix_groups`: separate rehearse rows
    of one tool), and its LM head on the `role` targets only: the full-vocabulary logits of the
    other positions, most of a chat row, are never made. It decodes a missed response on the
    forward's own keys and values, from its first missed id on (the ids before it are the greedy
    ones): no prefix runs again. Other models (tests' fakes) give their logits whole, and decode a
    missed response from a prefill of the ids before it (`greedy_responses`).
    Returns (hits [B, T-1], roles [B, T], written {(row, the response's first position): its ids,
    or None}: {} without `stop`)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))     # no weights: the CPU
    ids, roles = collate(rows, pad_id)
    wanted = roles[:, 1:] == role
    # each row up to its last `role` id: nothing after it is asked (a row with none is not run)
    lengths = {i: max(t for t in range(1, len(r["roles"])) if r["roles"][t] == role) + 1
               for i, r in enumerate(rows) if role in r["roles"][1:]}
    hits = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    written = {}
    head = lean_head(model)
    share = head is not None and can_share_prefix(model)
    for group, prefix, shared in _prefix_groups(model, ids, lengths, share, device):
        for part in micro_batches([lengths[i] for i in group], token_budget):
            index = [group[k] for k in part]
            n = max(lengths[i] for i in index)
            batch, want = ids[index, :n].to(device), wanted[index, :n - 1].to(device)
            if head is None:
                hits[index, :n - 1] = ((model(input_ids=batch).logits[:, :-1].argmax(-1) == batch[:, 1:]) & want).cpu()
                hidden = cache = None
            else:
                hidden, cache = _forced_pass(model, batch, prefix, shared)
                found = torch.zeros_like(want)
                # shift by one: position t's hidden state predicts id t+1, the target `want` marks
                found[want] = head(hidden[:, :-1][want]).argmax(-1) == batch[:, 1:][want]
                hits[index, :n - 1] = found.cpu()
            if stop is not None:
                written.update(_decode_misses(model, pad_id, rows, index, hits, role, stop, hidden, cache))
    return hits, roles, written


def _decode_misses(model, pad_id, rows, index, hits, role, stop, hidden, cache):
    """{(row, the response's first position): what greedy decoding writes} for the responses of
    the micro-batch `index` with a missed id (greedy_hits): on its pass's `hidden` states and
    `cache`, from the first missed id on; without them (no transformers model), from a prefill of
    the ids before the response."""
    misses = [(j, i, seg) for j, i in enumerate(index) for seg in response_segments(rows[i], stop, role)
              if seg and not all(hits[i, t - 1] for t in seg)]
    if not misses:
        return {}
    limits = [2 * len(seg) + 8 for _, _, seg in misses]
    if cache is None:
        out = greedy_responses(model, [rows[i]["ids"][:seg[0]] for _, i, seg in misses], stop, pad_id, limits)
    else:
        first = [next(t for t in seg if not hits[i, t - 1]) for _, i, seg in misses]
        logits = lean_head(model)(hidden[[j for j, _, _ in misses], [t - 1 for t in first]])
        decoder = _decoder_at(model, pad_id, cache, logits, [j for j, _, _ in misses], first)
        out = greedy_writes(decoder, [rows[i]["ids"][seg[0]:t] for (_, i, seg), t in zip(misses, first)], stop, limits)
    return {(i, seg[0]): w for (_, i, seg), w in zip(misses, out)}


def _prefix_groups(model, ids, lengths, share, device):
    """[(rows, prefix, its pass)]: the rows `lengths` names (row -> its ids to run), in groups
    whose ids[:prefix] are alike and ran once (`_forced_pass`: hidden states and one row's cache;
    prefix 0 and None where `share` is false or nothing is shared). The ids all rows start with
    run first; rows that go on alike for at least kvcache.MIN_SHARED more ids (separate rehearse
    rows of one tool: its instructions and schema) form a group whose common ids run once on top
    of those; the rest are one group."""
    rows = sorted(lengths, key=lambda i: ids[i, :lengths[i]].tolist())      # alike starts next to each other
    prefix = shared_prefix_length(ids[rows], [lengths[i] for i in rows]) if share and rows else 0
    shared = _forced_pass(model, ids[rows[:1], :prefix].to(device), 0, None) if prefix else None
    if not prefix:
        return [(rows, 0, None)]
    runs = [[rows[0]]]
    for a, b in zip(rows, rows[1:]):
        common = shared_prefix_length(ids[[a, b]], [lengths[a], lengths[b]])
        if common >= prefix + kvcache.MIN_SHARED:
            runs[-1].append(b)
        else:
            runs.append([b])
    groups, rest = [], [i for run in runs if len(run) == 1 for i in run]
    for run in (r for r in runs if len(r) > 1):
        longer = shared_prefix_length(ids[run], [lengths[i] for i in run])
        groups.append((run, longer, _forced_pass(model, ids[run[:1], :longer].to(device), prefix, shared)))
    return groups + ([(rest, prefix, shared)] if rest else [])


def _forced_pass(model, ids, prefix, shared):
    """(hidden states after the final norm [b, n, H], a kvcache.Decoder cache of every row's keys
    and values) of right-padded `ids` [b, n] through a transformers model, where ids[:, :prefix],
    alike in every row, already ran: `shared` is their (hidden [1, prefix, H], cache of one row)."""
    b, n = ids.shape
    cache, pieces = kvcache.new_cache(model.config), []
    if prefix:
        hidden, one = shared
        for layer, kept in zip(cache.layers, one.layers):
            layer.update(kept.keys.expand(b, -1, -1, -1), kept.values.expand(b, -1, -1, -1))
        pieces.append(hidden.expand(b, -1, -1))
    positions = torch.arange(prefix, n, device=ids.device)[None].expand(b, -1)
    pieces.append(final_hidden(model, ids[:, prefix:], cache=cache, use_cache=True, position_ids=positions))
    return torch.cat(pieces, 1), cache


def _decoder_at(model, pad_id, cache, logits, rows, lengths):
    """A kvcache.Decoder over copies of `cache`'s rows (`rows`, a row may come twice), each cut to
    its first lengths[k] ids (the later columns masked), with `logits` [k, V] after them."""
    device = logits.device
    cache.batch_select_indices(torch.tensor(rows, device=device))
    ends = torch.tensor(lengths, device=device)
    mask = (torch.arange(cache.get_seq_length(), device=device)[None] < ends[:, None]).long()
    return kvcache.Decoder.resume(model, pad_id, cache, mask, ends, logits.float())


def greedy_writes(decoder, written, stop, limits):
    """Greedy decoding on `decoder` (a kvcache.Decoder at each row's logits): row k's argmax ids are
    appended to written[k] until `stop` (left out). Returns each row's ids, or None for a row that
    reached limits[k] ids without `stop`."""
    written = [list(w) for w in written]
    ended = [len(w) >= limit for w, limit in zip(written, limits)]
    stopped = [False] * len(written)
    while not all(ended):
        tokens = decoder.logits.argmax(-1).tolist()
        for k, t in enumerate(tokens):
            if not ended[k]:
                stopped[k] = ended[k] = t == stop
                if not stopped[k]:
                    written[k].append(t)
                    ended[k] = len(written[k]) >= limits[k]
        if not all(ended):
            decoder.step([[t] for t in tokens])
    return [w if ok else None for w, ok in zip(written, stopped)]


@torch.no_grad()
def greedy_responses(model, prefixes, stop, pad_id, max_new, rows=32):
    """Per prefix, the ids greedy decoding writes before `stop` (None if it does not stop within
    max_new ids: one number, or one per prefix), `rows` prefixes at a time in one KV-cached batch
    (kvcache.Decoder, as the sampler decodes), so that the keys and values held stay bounded."""
    limits = max_new if isinstance(max_new, list) else [max_new] * len(prefixes)
    return [ids for k in range(0, len(prefixes), rows)
            for ids in greedy_writes(kvcache.Decoder(model, prefixes[k:k + rows], pad_id),
                                     [[] for _ in prefixes[k:k + rows]], stop, limits[k:k + rows])]


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
    hits, _, _ = greedy_hits(model, episodes, OBS, tokenizer.pad_token_id, token_budget)
    return [(call, all(hits[i, t - 1] for t in seg)) for i, e in enumerate(episodes)
            for call, seg in zip(e["calls"], response_segments(e, env_end))]


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
    """The test calls' coverage by the tool cache (worldmodel/toolcache.py: training traffic only)
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
    hits, roles, _ = greedy_hits(model, rows, REHEARSE, pad_id, token_budget)
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
    settings = rollout.sampling(cfg, temperature=cfg["eval_temperature"])
    episodes, batch_size = [], cfg["eval_batch_size"]
    for i in range(0, len(tasks), batch_size):
        episodes += sample(model, tokenizer, [t["prompt"] for t in tasks[i:i + batch_size]], "rehearse",
                           world=world, settings=settings, generator=generator, **sample_args)
    fidelity = replay_fidelity(episodes, world)
    return {"imagined_success": sum(task_reward(e, t) for e, t in zip(episodes, tasks)) / len(tasks),
            "imagined_fidelity": rates(fidelity), "imagined_fidelity_counts": fidelity,
            "collusion": collusion_rate(collusion_counts(episodes, tasks, world))}


def fidelity_gate(before, cfg, log):
    """Rehearsed rewards are only as good as the rehearsals: rehearse/frozen RL goes on only if
    every tool kind's would-rehearse fidelity reaches min_fidelity (tasks with no real world to
    compare with skip the gate). No tool called fails a gate that requires fidelity; elsewhere the
    line says that nothing was measured."""
    low = {k: v for k, v in before["fidelity"].items() if v < cfg["min_fidelity"]}
    if not before["executed_tasks"]:
        log("fidelity gate skipped: these tasks have no real environment to compare rehearsals with")
    elif world_is_sampled(cfg["env_mode"]) and cfg["min_fidelity"] > 0 and (low or not before["fidelity"]):
        log(f"fidelity gate FAILED: {low or 'no calls made'} below min_fidelity "
            f"{cfg['min_fidelity']}: rehearsed rewards would be noise for these tools. Raise "
            f"snippet_repeats/sft_steps/coverage, or set --min_fidelity=0 to run anyway.")
        return False
    elif not before["fidelity"]:
        log(f"fidelity not measured: no tool was called in the evaluation, so the fidelity gate checked nothing "
            f"(min_fidelity {cfg['min_fidelity']}, {cfg['env_mode']} mode)")
    else:
        log(f"fidelity gate passed: every tool kind >= {cfg['min_fidelity']} ({cfg['env_mode']} mode)")
    return True
