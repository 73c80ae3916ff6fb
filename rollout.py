"""Interleaved act / rehearse sampling with a KV cache: the rollout of world rehearsal.

The paper's episode alternates two roles of one policy: the actor writes a tool call, then the
same policy writes the environment's response to it (rehearsal), and the next action conditions
on that response. This file samples a batch of such episodes in lock step: at every step each row appends
one sampled token and then every forced id queued behind it (a hand-off, a planned call, a real
observation: a run), so all rows share one KV cache and one forward per step, whatever role each
row is in (the shorter runs' slots are masked holes). Finished rows leave the cache once a
quarter of them are done. The batch decoder is kvcache.decoder's pick: the plainest one
(transformers' DynamicCache) for the demo's short prompts, one with speed tricks for a chat
model's long ones (docs/speed.md).

Per-row state machine (the sampler forces every hand-off; no role ever writes another's tag):

    act  --samples </act>-->  parse the act text
            answer            -> done (cause "answer"); in a multi-turn chat task, while the
                                 world has a next user turn (world.next_turn), that turn is
                                 forced (TAG glue, PROMPT content) and the row acts again
            malformed call    -> done ("bad_call"); reward 0, as in the official code
            call              -> force <env>, then by env_mode:
                rehearse: the policy samples the response (role REHEARSE) until </env>
                real:     the toy world executes the call; its response + </env> are forced
                          as OBS tokens (no loss)
                frozen:   a frozen copy of the warm-start model samples the response (OBS)
                none:     no world at all: an empty response, </env> forced (the no_env arm)
    env  --</env>-->  validate the response (world.parse_response), force <act>, back to act
                      (the world's turn, token by token: rehearse.world_token)

The chat format (chat/format.py: hand-offs from the model's chat template, JSON tool calls, one world
per row) and the separate layout (worldmodel/separate.py: each rehearsal a row of its own, in rounds) drive
this same machine; their files say how.

Truncation is explicit: a tag sampled in the wrong role ("bad_act", "bad_rehearsal"), a segment
longer than max_act_tokens / max_env_tokens ("act_limit", "env_limit"), more than max_turns calls
over the whole episode, all user turns together ("turn_limit"), or more than max_tokens in all
("token_limit") ends the row with reward 0.
With `rehearse_check` (a guard, off by default: a function, rehearse.check_rehearsal) a simulated
response of the wrong form for its call (a number where a number goes, the schema's error for a
call the schema rejects) also ends the row, with cause "rehearse_check".

Logprobs are recorded for every token the policy sampled, in fp32 from the full distribution at
the sampling temperature, i.e. exactly what a teacher-forced forward at that temperature gives
(top-p truncates what is *sampled*, not the recorded logprob; the small off-policy gap that
creates is ignored, as in most PPO-for-LLM code).
"""
import functools
from collections import deque

import torch
import torch.nn.functional as F

from machinery import kvcache
import rehearse
import world as toy_world
from envace import ACT, ENV_MODES, OBS, PROMPT, REHEARSE, TAG, NonFiniteError, decoded, encode, tag_ids


# the config keys that bound an episode (the sampler's settings of the same names)
LIMITS = ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")

# The sampler's fixed choices, its `settings` (sample_episodes, separate.sample_separate), with
# their defaults; a caller's `settings` dict is merged over these (`merged_settings`).
SAMPLING = {
    "temperature": 1.0,     # the sampling temperature (0: greedy); logprobs are recorded at it
    "top_p": 1.0,           # nucleus sampling: truncates what is sampled, not the recorded logprob
    "max_turns": 6,         # calls over the whole episode, all user turns together ("turn_limit")
    "max_act_tokens": 8,    # tokens of one act segment, a call or an answer ("act_limit")
    "max_env_tokens": 6,    # tokens of one rehearsed response ("env_limit")
    "max_tokens": 96,       # tokens of the whole row, prompt included ("token_limit")
    "tags": None,           # the hand-off ids (envace.tag_ids); None: the tokenizer's toy tags;
                            # a chat model's come from its template (chat/format.py)
    "rehearse_check": None,  # None, or check(call, response, world) (rehearse.check_rehearsal): end a
                             # row whose simulated response has the wrong form for its call
                             # (cause "rehearse_check")
}


def limits(cfg):
    """The sampler's limits from the config: {max_turns, max_act_tokens, max_env_tokens, max_tokens}."""
    return {k: cfg[k] for k in LIMITS}


def sampling(cfg, **extra):
    """The sampler's settings from the config: temperature, top_p and the limits (`limits`), then
    `extra` over them (tags, rehearse_check, or another temperature, e.g. eval_temperature)."""
    return {"temperature": cfg["temperature"], "top_p": cfg["top_p"], **limits(cfg), **extra}


def merged_settings(settings):
    """SAMPLING with `settings` (a dict, or None) over it; a key SAMPLING lacks is a TypeError
    naming it, as a bad keyword argument would be."""
    unknown = sorted(set(settings or {}) - set(SAMPLING))
    if unknown:
        raise TypeError(f"unknown sampler setting(s) {unknown}: the settings are {list(SAMPLING)}")
    return {**SAMPLING, **(settings or {})}


def sample_token(logits, temperature, top_p, generator=None):
    """[B, V] logits -> (tokens [B], logprobs [B]) at `temperature`; temperature 0 is greedy.
    NonFiniteError when a row is no distribution (a NaN or +inf logit, or every logit -inf):
    broken weights, which torch.multinomial would report obscurely or argmax hide."""
    logits = logits.float()
    logp = F.log_softmax(logits / temperature if temperature else logits, dim=-1)
    # one check per step and one device sync (the sampler syncs once more for the tokens); a NaN
    # or +inf logit makes its whole row NaN here, a lone -inf logit (a masked token) does not
    if torch.isnan(logp).any():
        raise NonFiniteError("the policy's logits are not finite (NaN or inf) while sampling: the weights are "
                             "broken (a diverged update or a broken checkpoint); use an earlier checkpoint "
                             "or lower the learning rate")
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p          # keep the smallest set reaching top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def new_row(prompt_ids, world, phase="act", plan=None, tags=None, tokenizer=None, **extra):
    """A row of the sampler: its prompt (role PROMPT), the world that reads its text, the phase it
    starts in, and its state machine's fields. A row starting in "act" gets its first <act> hand-off
    forced (`tags`, `tokenizer`: _next_turn); a separate rehearse row starts in "env" with none."""
    row = {"world": world, "ids": list(prompt_ids), "roles": [PROMPT] * len(prompt_ids),
           "logprobs": [0.0] * len(prompt_ids), "prompt_len": len(prompt_ids), "phase": phase,
           "forced": deque(), "segment": [], "plan": deque(plan or []), "calls": [], "call_turns": [],
           "responses": [], "answer": None, "answers": [], "cause": None, "state": None, **extra}
    if phase == "act":
        _next_turn(row, tags, tokenizer, first=True)
    return row


def _next_turn(row, tags, tokenizer, first=False):
    """Force the <act> hand-off (a chat template's first one, after the prompt, may differ); a row
    that follows a plan (test-time private rehearsal) also has the plan's next call forced."""
    row["phase"] = "act"
    row["forced"].extend((t, TAG) for t in tags["first_act" if first else "act"])
    if row["plan"]:
        call, _ = row["plan"][0]
        row["forced"].extend((t, ACT) for t in encode(tokenizer, call) + [tags["act_end"]])


@torch.no_grad()
def sample_episodes(policy, tokenizer, prompts, env_mode="rehearse", *, env_model=None, world=toy_world,
                    settings=None, generator=None, plans=None):
    """Paper, world rehearsal: sample one episode per prompt (repeat a prompt G times for a group),
    the policy acting and, in rehearse mode, writing the environment's responses too. Returns dicts
    with ids, roles, logprobs (0 where the policy did not sample), calls and responses as text,
    call_turns (per call, its user turn: 0 but in multi-turn chat), answers (per finished user
    turn), answer (the last), cause ('answer' or why it was truncated) and finished.
    settings: the sampler's fixed choices, a dict merged over SAMPLING (None: SAMPLING itself;
    `sampling(cfg, ...)` builds one from the config): temperature, top_p, the limits max_turns,
    max_act_tokens, max_env_tokens, max_tokens, tags and rehearse_check. A key SAMPLING lacks is a
    TypeError naming it.
    plans: optional, per row a list of (call, expected response) the row commits to (rehearse.py): each
    call is forced while every response so far was the expected one; from the first surprise, it re-plans.
    settings["rehearse_check"]: None, or check(call, response, world) (rehearse.check_rehearsal): end a
    row whose simulated response has the wrong form for its call (cause "rehearse_check"). Chat format
    (chat/format.py): prompts are id lists, `world` one world per row, settings["tags"] from the template."""
    s = merged_settings(settings)
    tags = s["tags"] or tag_ids(tokenizer)
    worlds = world if isinstance(world, list) else [world] * len(prompts)
    prompts = [p["prompt"] if isinstance(p, dict) else p for p in prompts]      # a task: its prompt
    rows = [new_row(p if isinstance(p, list) else tags["bos"] + encode(tokenizer, p), w, plan=plan, tags=tags,
                    tokenizer=tokenizer) for p, plan, w in zip(prompts, plans or [None] * len(prompts), worlds)]
    limits = {k: s[k] for k in LIMITS + ("rehearse_check",)}
    return sample_rows(policy, tokenizer, rows, env_mode, env_model, tags, limits, s["temperature"], s["top_p"],
                       generator)


@torch.no_grad()
def sample_rows(policy, tokenizer, rows, env_mode, env_model, tags, limits, temperature, top_p, generator):
    """The lock-step loop: every row (`new_row`: sample_episodes' episodes, or the separate
    layout's actor and rehearse rows, continued in rounds) gets a token a step, then its forced
    ids, in one forward of a shared KV cache, until every row is done. Returns the rows."""
    assert env_mode in ENV_MODES, env_mode
    assert (env_model is not None) == (env_mode == "frozen"), "env_model is for frozen mode"
    for row in rows:
        if row.get("state") is None:                  # the real world's state, used in real mode only
            row["state"] = row["world"].new_state()
    max_new = limits["max_tokens"] - min(len(r["ids"]) for r in rows) + 1
    decoders = _start_decoders(policy, env_model, rows, tags["pad"])
    live = list(range(len(rows)))      # the rows still in the caches, in cache order
    for _ in range(max_new):
        logits = decoders[0].logits
        if env_model is not None:      # rows in the env phase sample from the simulator
            in_env = torch.tensor([rows[i]["phase"] == "env" for i in live], device=logits.device)
            logits = torch.where(in_env[:, None], decoders[1].logits, logits)
        sampled, logps = sample_token(logits, temperature, top_p, generator)
        sampled, logps = sampled.tolist(), logps.tolist()   # one sync per step
        runs = [_append_run(rows[i], sampled[j], logps[j], env_mode, tags, tokenizer, limits)
                for j, i in enumerate(live)]
        running = [j for j, i in enumerate(live) if rows[i]["phase"] != "done"]
        dropped = [j for j in range(len(live)) if j not in set(running)] if (
            not running or len(running) <= 0.75 * len(live)) else []
        for j in dropped:              # a quarter finished (or all): they leave the caches
            if rows[live[j]]["cause"] == "call":      # (separate layout: an actor row paused at its call)
                _save_paused(rows[live[j]], decoders[0], j, len(runs[j]))
        if not running:
            break
        if dropped:
            index = torch.tensor(running, device=logits.device)
            # dropped, not fed holes to the end: test_shared_prompt_prefill_and_dropped_rows_match_a_full_forward
            for dec in decoders:
                dec.keep(index)
            live, runs = [live[j] for j in running], [runs[j] for j in running]
        # a forward per run, not per id: test_forced_runs_in_one_forward_match_a_full_forward
        for dec in decoders:
            dec.step(runs)
    for row in rows:
        row["cause"] = row["cause"] or "token_limit"
        row["finished"] = row["cause"] == "answer"
        for k in ("phase", "forced", "segment", "state", "plan", "world"):
            del row[k]
    return rows


def _start_decoders(policy, env_model, rows, pad_id):
    """The policy's decoder over the rows' ids (restored from the KV each row saved, when every row
    did: separate rounds), and in frozen mode the simulator's, fed the same tokens."""
    saved = [r.pop("saved_kv", None) for r in rows]  # separate rounds: actor rows keep their cache
    saved = saved if all(saved) and env_model is None else None
    decoders = [kvcache.decoder(policy, [r["ids"] for r in rows], pad_id, saved and [s["cache"] for s in saved])]
    if saved:                          # feed what was appended to the rows since their cache was saved
        decoders[0].step([r["ids"][s["fed"]:] for r, s in zip(rows, saved)])
    if env_model is not None:          # frozen mode: a second cache, fed the same tokens
        decoders.append(kvcache.decoder(env_model, [r["ids"] for r in rows], pad_id))
    return decoders


def _save_paused(row, decoder, j, unfed):
    """A separate-layout actor row paused at its call (cause "call") keeps its cache (row j of
    `decoder`) for the next round, and how many of its ids are in it (its last `unfed` are not)."""
    cache = decoder.save(j)
    if cache is not None:
        row["saved_kv"] = {"cache": cache, "fed": len(row["ids"]) - unfed}


def _append_run(row, sampled, logp, env_mode, tags, tokenizer, limits):
    """This step's run of one row: its token (`append_token`), then every forced id queued behind it
    (a hand-off, a planned call, a real observation), which need no sampling and so go to the
    cache in the same forward. Returns the ids to feed ([] for a finished row)."""
    if row["phase"] == "done":
        return []
    run = [append_token(row, sampled, logp, env_mode, tags, tokenizer, limits)]
    while row["forced"] and row["phase"] != "done":
        run.append(append_token(row, None, 0.0, env_mode, tags, tokenizer, limits))
    return run


def append_token(row, sampled, logp, env_mode, tags, tokenizer, limits):
    """Append this step's token to one row: the next forced id if the row has one queued (a
    hand-off tag, a planned call, a real observation), else the sampled one, with its role and
    logprob (0 for what the policy did not sample). Returns the token fed to the cache."""
    if row["phase"] == "done":
        return tags["pad"]
    if row["forced"]:
        tok, role = row["forced"].popleft()
        logp = 0.0
    else:
        tok = sampled
        role = ACT if row["phase"] == "act" else (REHEARSE if env_mode == "rehearse" else OBS)
        if role == OBS:
            logp = 0.0                                # the simulator's logprob, not the policy's
    row["ids"].append(tok)
    row["roles"].append(role)
    row["logprobs"].append(logp)
    if role not in (TAG, PROMPT):                 # a forced user turn (PROMPT) is context, like a tag
        _advance(row, tok, role, tags, tokenizer, row["world"], env_mode, limits["max_turns"],
                 limits["max_act_tokens"], limits["max_env_tokens"], limits["rehearse_check"])
    if row["phase"] != "done" and len(row["ids"]) >= limits["max_tokens"]:
        row["phase"], row["cause"] = "done", "token_limit"
    return tok


def _advance(row, tok, role, tags, tokenizer, world, env_mode,
             max_turns, max_act_tokens, max_env_tokens, rehearse_check=None):
    """The per-row state machine: one appended token, sampled or forced OBS. The actor's turn is
    here; the world's turn (the rehearsal, when the policy plays the world) is rehearse.world_token."""
    if row["phase"] == "act":
        if tok == tags["act_end"]:
            _end_act(row, decoded(tokenizer, tuple(row["segment"])), tags, tokenizer, world, env_mode, max_turns)
        elif tok in tags["stops"]:
            row["phase"], row["cause"] = "done", "bad_act"          # the actor wrote a tag
        elif len(row["segment"]) >= max_act_tokens:
            row["phase"], row["cause"] = "done", "act_limit"
        else:
            row["segment"].append(tok)
        return
    if rehearse.world_token(row, tok, tags, tokenizer, env_mode, max_env_tokens, rehearse_check):   # rehearse.py
        _next_turn(row, tags, tokenizer)          # </env> closed the response: the actor's turn again


@functools.lru_cache(maxsize=1 << 16)
def _encoded(tokenizer, text):
    """encode of a real response as a tuple (the same responses recur across rows and steps)."""
    return tuple(encode(tokenizer, text))


def _end_act(row, text, tags, tokenizer, world, env_mode, max_turns):
    row["segment"] = []
    kind, value = world.read_act(text)
    if kind == "answer":
        row["answers"].append(value)
        next_turn = world.next_turn(len(row["answers"]))     # a multi-turn task's next user turn, or None
        if next_turn is None:
            row["phase"], row["cause"], row["answer"] = "done", "answer", value
        else:
            row["forced"].extend(next_turn)                  # forced (id, role) pairs; the actor goes on
        return
    if kind != "call":                         # a malformed call: its cause is counted
        row["phase"], row["cause"] = "done", kind
        return
    if len(row["calls"]) >= max_turns:
        row["phase"], row["cause"] = "done", "turn_limit"
        return
    call = value
    row["calls"].append(call)
    row["call_turns"].append(len(row["answers"]))
    row["phase"] = "env"
    row["forced"].extend((t, TAG) for t in tags["env"])
    if env_mode in ("real", "none"):
        # the only place the real world is called; with no world the response is empty
        response = world.step(row["state"], call) if env_mode == "real" else ""
        row["responses"].append(response)
        row["forced"].extend((t, OBS) for t in _encoded(tokenizer, tags["env_lead"] + response + tags["env_pre"])
                             + (tags["env_end"],))
    if row["plan"]:                            # a committed plan: go on only while unsurprised
        _, expected = row["plan"].popleft()
        if env_mode != "real" or response != expected:
            row["plan"].clear()
    if row.get("stop_at") == "call":              # separate context: the call is rehearsed in its own row
        row["phase"], row["cause"] = "done", "call"
