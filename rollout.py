"""Interleaved act / rehearse sampling with a KV cache: the rollout of world rehearsal.

The paper's episode alternates two roles of one policy: the actor writes a tool call, then the
same policy writes the environment's response to it (rehearsal), and the next action conditions
on that response. This file samples a batch of such episodes in lock step: every row appends
exactly one token per step (sampled, or forced from its queue), so all rows share one KV cache
and one forward per step, whatever role each row is in. Two things keep that cheap: a task's G
rows share one prefill of its prompt (the cache rows are copied), and once a quarter of the rows
in the cache have finished they are dropped from it, so short episodes stop costing compute.

Per-row state machine (the sampler forces every hand-off; no role ever writes another's tag):

    act  --samples </act>-->  parse the act text
            answer            -> done (cause "answer")
            malformed call    -> done ("bad_call"); reward 0, as in the official code
            call              -> force <env>, then by env_mode:
                rehearse: the policy samples the response (role REHEARSE) until </env>
                real:     the toy world executes the call; its response + </env> are forced
                          as OBS tokens (no loss)
                frozen:   a frozen copy of the warm-start model samples the response (OBS)
                none:     no world at all: an empty response, </env> forced (the no_env arm)
    env  --</env>-->  validate the response (rehearse.parse_response), force <act>, back to act

Chat format (chat.py): the same machine, with the hand-offs derived from the model's chat
template (each forced as a sequence of ids, e.g. `<|im_end|>` is the actor's stop and
`\n<|im_start|>user\n<tool_response>\n` is forced after it), JSON tool calls read strictly against
the task's tool schemas (a bad one ends the row with cause bad_call_json, unknown_tool or
bad_arguments), and one world per row, since every task brings its own tools.

With rehearsal_context separate, `sample_separate` drives this sampler in rounds: actor rows stop
at each finished call, every pending rehearsal is then sampled as its own row from its own prompt
(rehearse.rehearse_prompt; chat format: chat.rehearse_prompt_ids, in the model's own template),
and the response is copied into the actor row as context (OBS).

Truncation is explicit: a tag sampled in the wrong role ("bad_act", "bad_rehearsal"), a segment
longer than max_act_tokens / max_env_tokens ("act_limit", "env_limit"), more than max_turns calls
("turn_limit"), or more than max_tokens in all ("token_limit") ends the row with reward 0.
With `rehearse_check` (a guard, off by default) a simulated response of the wrong form for its
call (rehearse.check_rehearsal: a number where a number goes, the schema's error for a call the
schema rejects) also ends the row, with cause "rehearse_check".

Logprobs are recorded for every token the policy sampled, in fp32 from the full distribution at
the sampling temperature, i.e. exactly what a teacher-forced forward at that temperature gives
(top-p truncates what is *sampled*, not the recorded logprob; the small off-policy gap that
creates is ignored, as in most PPO-for-LLM code).
"""
import functools
from collections import deque

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import chat
import rehearse
import world as toy_world
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, encode, tag_ids


def sample_token(logits, temperature, top_p, generator=None):
    """[B, V] logits -> (tokens [B], logprobs [B]) at `temperature`; temperature 0 is greedy."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, F.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    logp = F.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p          # keep the smallest set reaching top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class _Decoder:
    """A batch of left-padded prefixes and their KV cache, advanced one token per row per step.
    Identical prefixes (a task's G samples) are prefilled once and their cache rows copied, and
    `keep` drops finished rows from the cache, so that they cost nothing afterwards."""

    def __init__(self, model, prefixes, pad_id, max_new):
        self.model = model
        device = next(model.parameters()).device
        unique = {p: i for i, p in enumerate(dict.fromkeys(map(tuple, prefixes)))}
        P = max(len(p) for p in unique)
        ids = torch.full((len(unique), P), pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((len(unique), P + max_new), dtype=torch.long, device=device)
        for p, i in unique.items():
            ids[i, P - len(p):] = torch.tensor(p, device=device)
            mask[i, P - len(p):] = 1                   # left pads masked; every new token real
        self.cache = DynamicCache(config=model.config)
        self.mask, self.length = mask, P
        logits = self._forward(ids, (mask[:, :P].cumsum(1) - 1).clamp(min=0))
        prefix_of_row = torch.tensor([unique[tuple(p)] for p in prefixes], device=device)
        self.keep(prefix_of_row, logits)              # each row: a copy of its prefix's cache
        self.pos = torch.tensor([len(p) for p in prefixes], device=device)

    @torch.no_grad()
    def _forward(self, ids, position_ids):
        out = self.model(input_ids=ids, attention_mask=self.mask[:, :self.length],
                         position_ids=position_ids, cache=self.cache, use_cache=True)
        return out.logits[:, -1].float()

    def keep(self, index, logits=None):
        """Keep (or copy) the batch rows at `index` (a LongTensor): cache, mask, logits."""
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.logits = (self.logits if logits is None else logits)[index]
        if logits is None:
            self.pos = self.pos[index]

    def step(self, tokens):
        """Append one token per row; returns the logits for the next position [B, V]."""
        self.length += 1
        self.logits = self._forward(tokens[:, None], self.pos[:, None])
        self.pos = self.pos + 1
        return self.logits


def _new_row(prompt_ids, tags, plan, tokenizer, world):
    row = {"world": world, "ids": list(prompt_ids), "roles": [PROMPT] * len(prompt_ids),
           "logprobs": [0.0] * len(prompt_ids), "prompt_len": len(prompt_ids),
           "phase": "act", "forced": deque(), "segment": [], "plan": deque(plan or []),
           "calls": [], "responses": [], "answer": None, "cause": None, "state": None}
    _next_turn(row, tags, tokenizer, first=True)
    return row


def _next_turn(row, tags, tokenizer, first=False):
    """Force the <act> hand-off (a chat template's first one, after the prompt, may differ); a row
    that follows a plan (test-time private rehearsal) also has the plan's next call forced."""
    row["phase"] = "act"
    row["forced"].extend((t, TAG) for t in tags["first_act" if first and "first_act" in tags else "act"])
    if row["plan"]:
        call, _ = row["plan"][0]
        row["forced"].extend((t, ACT) for t in encode(tokenizer, call) + [tags["act_end"]])


@torch.no_grad()
def sample_episodes(policy, tokenizer, prompts, env_mode="rehearse", *, env_model=None,
                    world=toy_world, temperature=1.0, top_p=1.0, max_turns=6, max_act_tokens=8,
                    max_env_tokens=6, max_tokens=96, generator=None, plans=None, tags=None,
                    rehearse_check=False, rows=None):
    """Sample one episode per prompt (repeat a prompt G times for a group). Returns a list of
    dicts with ids, roles, logprobs (0 where not sampled by the policy), calls and responses as
    text, answer, cause ('answer' or why it was truncated) and finished.
    plans: optional, per row a list of (call, expected response) that the row commits to: each
    call is forced as the row's action while every response so far was the expected one; from
    the first surprise on, the policy acts on its own (re-plans). Used by rehearse.py.
    rehearse_check: end a row whose simulated response has the wrong form for its call (rehearse
    and frozen modes; the response is kept in `responses`, the cause is "rehearse_check").
    Chat format (chat.py): prompts are token id lists, `world` is a list (one world per row, it
    reads that task's tool calls) and `tags` the hand-offs derived from the chat template.
    rows: rows already started (instead of prompts), continued in place: sample_separate's rounds."""
    assert env_mode in ("rehearse", "real", "frozen", "none"), env_mode
    assert (env_model is not None) == (env_mode == "frozen"), "env_model is for frozen mode"
    tags = tags or tag_ids(tokenizer)
    stop_tags = tags.get("stops") or set(tags["act"] + tags["env"] + tags["bos"] + [
        tags["pad"], tags["act_end"], tags["env_end"]])
    if rows is None:
        worlds = world if isinstance(world, list) else [world] * len(prompts)
        rows = [_new_row(p if isinstance(p, list) else tags["bos"] + encode(tokenizer, p), tags, plan,
                         tokenizer, w) for p, plan, w in zip(prompts, plans or [None] * len(prompts), worlds)]
    for row in rows:
        row.setdefault("world", world)                # rows continued in rounds may come without
        if row.get("state") is None:                  # the real world's state, used in real mode only
            row["state"] = row["world"].new_state()
    max_new = max_tokens - min(len(r["ids"]) for r in rows) + 1
    decoders = [_Decoder(policy, [r["ids"] for r in rows], tags["pad"], max_new)]
    if env_model is not None:          # frozen mode: a second cache, fed the same tokens
        decoders.append(_Decoder(env_model, [r["ids"] for r in rows], tags["pad"], max_new))
    live = list(range(len(rows)))      # the rows still in the caches, in cache order
    for _ in range(max_new):
        logits = decoders[0].logits
        if env_model is not None:      # rows in the env phase sample from the simulator
            in_env = torch.tensor([rows[i]["phase"] == "env" for i in live], device=logits.device)
            logits = torch.where(in_env[:, None], decoders[1].logits, logits)
        sampled, logps = sample_token(logits, temperature, top_p, generator)
        sampled, logps = sampled.tolist(), logps.tolist()   # one sync per step
        next_tokens = []
        for j, i in enumerate(live):
            row = rows[i]
            if row["phase"] == "done":
                next_tokens.append(tags["pad"])
                continue
            if row["forced"]:
                tok, role = row["forced"].popleft()
                logp = 0.0
            else:
                tok, logp = sampled[j], logps[j]
                role = ACT if row["phase"] == "act" else (REHEARSE if env_mode == "rehearse" else OBS)
                if role == OBS:
                    logp = 0.0                                # the simulator's logprob, not the policy's
            row["ids"].append(tok)
            row["roles"].append(role)
            row["logprobs"].append(logp)
            next_tokens.append(tok)
            if role != TAG:
                _advance(row, tok, role, tags, stop_tags, tokenizer, row["world"], env_mode,
                         max_turns, max_act_tokens, max_env_tokens, rehearse_check)
            if row["phase"] != "done" and len(row["ids"]) >= max_tokens:
                row["phase"], row["cause"] = "done", "token_limit"
        running = [j for j, i in enumerate(live) if rows[i]["phase"] != "done"]
        if not running:
            break
        tokens = torch.tensor(next_tokens, device=logits.device)
        if len(running) <= 0.75 * len(live):       # a quarter finished: drop them from the caches
            index = torch.tensor(running, device=logits.device)
            for dec in decoders:
                dec.keep(index)
            live, tokens = [live[j] for j in running], tokens[index]
        for dec in decoders:
            dec.step(tokens)
    for row in rows:
        if row["cause"] is None:
            row["cause"] = "token_limit"
        row["finished"] = row["cause"] == "answer"
        for k in ("phase", "forced", "segment", "state", "plan", "world"):
            del row[k]
    return rows


def _advance(row, tok, role, tags, stop_tags, tokenizer, world, env_mode,
             max_turns, max_act_tokens, max_env_tokens, rehearse_check=False):
    """The per-row state machine: one appended token, sampled or forced OBS."""
    if row["phase"] == "act":
        if tok == tags["act_end"]:
            _end_act(row, tokenizer.decode(row["segment"]), tags, tokenizer, world, env_mode, max_turns)
        elif tok in stop_tags:
            row["phase"], row["cause"] = "done", "bad_act"          # the actor wrote a tag
        elif len(row["segment"]) >= max_act_tokens:
            row["phase"], row["cause"] = "done", "act_limit"
        else:
            row["segment"].append(tok)
        return
    # env phase
    if tok == tags["env_end"]:
        if env_mode in ("rehearse", "frozen"):  # real (and empty) responses were recorded at the call
            text = tokenizer.decode(row["segment"])
            response = world.parse_response(text) if hasattr(world, "parse_response") else \
                rehearse.parse_response(text)
            if response is None:
                row["phase"], row["cause"] = "done", "bad_rehearsal"
                return
            row["responses"].append(response)
            if rehearse_check and not rehearse.check_rehearsal(row["calls"][-1], response, world):
                row["phase"], row["cause"] = "done", "rehearse_check"
                return
        if row.get("stop_at") == "response":      # a separate rehearse row ends with its response
            row["phase"], row["cause"] = "done", "response"
            return
        row["segment"] = []
        _next_turn(row, tags, tokenizer)
    elif env_mode in ("real", "none"):
        pass                                    # a forced observation token: nothing to decide
    elif tok in stop_tags:
        row["phase"], row["cause"] = "done", "bad_rehearsal"
    elif len(row["segment"]) >= max_env_tokens:
        row["phase"], row["cause"] = "done", "env_limit"
    else:
        row["segment"].append(tok)


def _end_act(row, text, tags, tokenizer, world, env_mode, max_turns):
    row["segment"] = []
    kind, value = world.read_act(text)
    if kind == "answer":
        row["phase"], row["cause"], row["answer"] = "done", "answer", value
        return
    if kind != "call":                         # a malformed call: its cause is counted
        row["phase"], row["cause"] = "done", kind
        return
    if len(row["calls"]) >= max_turns:
        row["phase"], row["cause"] = "done", "turn_limit"
        return
    call = value
    row["calls"].append(call)
    row["phase"] = "env"
    row["forced"].extend((t, TAG) for t in tags["env"])
    if env_mode in ("real", "none"):
        # the only place the real world is called; with no world the response is empty
        response = world.step(row["state"], call) if env_mode == "real" else ""
        row["responses"].append(response)
        row["forced"].extend((t, OBS) for t in encode(tokenizer, response + tags.get("env_pre", ""))
                             + [tags["env_end"]])
    if row["plan"]:                            # a committed plan: go on only while unsurprised
        _, expected = row["plan"].popleft()
        if env_mode != "real" or response != expected:
            row["plan"].clear()
    if row.get("stop_at") == "call":              # separate context: the call is rehearsed in its own row
        row["phase"], row["cause"] = "done", "call"


# ----------------------------------------------------------------------------- separate context

@torch.no_grad()
def sample_separate(policy, tokenizer, prompts, env_mode="rehearse", *, env_model=None, examples=None,
                    world=toy_world, temperature=1.0, top_p=1.0, max_turns=6, max_act_tokens=8,
                    max_env_tokens=6, max_tokens=96, generator=None, tags=None, rehearse_check=False,
                    rehearse_prompt=None):
    """rehearsal_context separate (the official implementation's choice): every rehearsal is its
    own row with its own prompt (rehearse.rehearse_prompt: the tool's signature, `examples(call)`
    logged examples if given, the dialogue so far and the call), which the actor never sees.
    Sampled in rounds with sample_episodes: the actor rows run until they end or finish a call;
    then the pending rehearse rows are sampled together (role REHEARSE, stopping at </env>); each
    response is copied into its actor row as `<env>` (TAG) + response + `</env>` (OBS: context
    with no loss; its training is in the rehearse row) and the actor rows go on. Each round
    prefills the rows anew (no cache is kept across rounds).
    frozen: `env_model` writes the rehearse rows; their tokens are then OBS (no loss).
    Returns the actor rows as sample_episodes does, each with "rehearsals": its rehearse rows in
    call order (ids, roles, logprobs, calls [the call], responses, cause, "episode": the index of
    its actor row, i.e. of its prompt, "turn": which call). A rehearsal that fails (bad_rehearsal,
    env_limit) ends its episode with that cause.
    Chat format (`tags` the chat hand-offs, prompts as ids, one world per row): the rehearse prompt
    is `rehearse_prompt(actor row, its world)` (chat.separate_prompt), the rehearser writes the
    result as an assistant turn ending at the template's end-of-turn stop (chat.rehearse_tags), and
    the result is copied into the actor row as the template's tool response (`_copy_response`)."""
    assert env_mode in ("rehearse", "frozen") and (env_model is not None) == (env_mode == "frozen")
    chat_rows = tags is not None
    if chat_rows and rehearse_prompt is None:
        rehearse_prompt = functools.partial(chat.separate_prompt, tokenizer, 0)
    tags = tags or tag_ids(tokenizer)
    env_tags = chat.rehearse_tags(tags) if chat_rows else tags
    limits = {"temperature": temperature, "top_p": top_p, "max_turns": max_turns,
              "max_act_tokens": max_act_tokens, "max_env_tokens": max_env_tokens, "generator": generator,
              "rehearse_check": rehearse_check}
    worlds = world if isinstance(world, list) else [world] * len(prompts)
    episodes = [_new_row(p if chat_rows else tags["bos"] + encode(tokenizer, p), tags, None, tokenizer, w)
                for p, w in zip(prompts, worlds)]
    for i, e in enumerate(episodes):
        e.update(episode=i, rehearsals=[], stop_at="call")
    active = episodes
    while active:
        for e in active:                          # sample_episodes drops a row's world when it returns
            e["world"] = worlds[e["episode"]]
        sample_episodes(policy, tokenizer, None, rows=active, max_tokens=max_tokens, tags=tags, **limits)
        pending = [e for e in active if e["cause"] == "call"]
        if not pending:
            break
        rehearsals = [_chat_rehearse_row(e, worlds[e["episode"]], env_tags, rehearse_prompt) if chat_rows
                      else _rehearse_row(e, tags, tokenizer, examples, world) for e in pending]
        room = max(len(r["ids"]) for r in rehearsals) + max_env_tokens + 2   # env_limit comes first
        sample_episodes(env_model or policy, tokenizer, None, rows=rehearsals, max_tokens=room, tags=env_tags,
                        **limits)
        active = [e for e, r in zip(pending, rehearsals)
                  if _copy_response(e, r, tags, tokenizer, max_tokens, frozen=env_model is not None)]
    for e in episodes:
        for row in [e] + e["rehearsals"]:
            row.pop("stop_at", None)
        del e["episode"]
    return episodes


def _rehearse_row(episode, tags, tokenizer, examples, world):
    """A rehearse row for the actor row's last call (the actor row ends with that call's </act>)."""
    call = episode["calls"][-1]
    ids = rehearse.rehearse_prompt(tokenizer, episode["ids"][len(tags["bos"]):], call,
                                   examples(call) if examples else (), world)
    return {"world": world, "ids": ids, "roles": [PROMPT] * len(ids), "logprobs": [0.0] * len(ids), "prompt_len": len(ids),
            "phase": "env", "forced": deque(), "segment": [], "plan": deque(), "calls": [call],
            "responses": [], "answer": None, "cause": None, "state": None, "stop_at": "response",
            "episode": episode["episode"], "turn": len(episode["calls"]) - 1}


def _chat_rehearse_row(episode, world, env_tags, rehearse_prompt):
    """A chat rehearse row for the actor row's last call: its own prompt (`rehearse_prompt`), and a
    world reading its result as an assistant turn (chat.rehearse_tags)."""
    ids = rehearse_prompt(episode, world)
    return {"world": chat.task_world(world.task, env_tags), "ids": ids, "roles": [PROMPT] * len(ids),
            "logprobs": [0.0] * len(ids), "prompt_len": len(ids), "phase": "env", "forced": deque(),
            "segment": [], "plan": deque(), "calls": [episode["calls"][-1]], "responses": [], "answer": None,
            "cause": None, "state": None, "stop_at": "response", "episode": episode["episode"],
            "turn": len(episode["calls"]) - 1}


def _copy_response(episode, rehearsal, tags, tokenizer, max_tokens, frozen):
    """Append a rehearse row's response to its actor row as context (OBS, no loss) and set the actor
    row up to act again. Returns whether it goes on; else its cause says why it ended. Chat format:
    the rehearse row's result is re-tokenised as the template's tool response renders it (result,
    the text before the tool turn's stop, the stop): the ids a real tool's response would have."""
    episode["rehearsals"].append(rehearsal)
    if frozen:                                   # written by the frozen simulator, not the policy
        rehearsal["roles"] = [OBS if r == REHEARSE else r for r in rehearsal["roles"]]
        rehearsal["logprobs"] = [0.0] * len(rehearsal["ids"])
    if rehearsal["cause"] != "response":         # bad_rehearsal or env_limit: the episode ends
        episode["cause"] = rehearsal["cause"]
        return False
    response = rehearsal["ids"][rehearsal["prompt_len"]:]
    if "first_act" in tags:                      # chat tags: a tool turn, not an assistant turn
        response = encode(tokenizer, rehearsal["responses"][0] + tags["env_pre"]) + [tags["env_end"]]
    add = tags["env"] + response
    room = max_tokens - len(episode["ids"])
    episode["ids"] += add[:room]
    episode["roles"] += ([TAG] * len(tags["env"]) + [OBS] * (len(add) - len(tags["env"])))[:room]
    episode["logprobs"] += [0.0] * len(add[:room])
    if len(add) <= room:                         # the whole response fits, as in the inline sampler
        episode["responses"].append(rehearsal["responses"][0])
    if len(episode["ids"]) >= max_tokens:
        episode["cause"] = "token_limit"
        return False
    episode.update(phase="act", forced=deque(), segment=[], plan=deque(), cause=None)
    _next_turn(episode, tags, tokenizer)
    return True
