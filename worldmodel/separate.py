"""rehearsal_context: separate: every rehearsal in a row of its own (the official code's layout).

    python train.py --config configs/separate.yaml

Inline (the default, rollout.py) the policy writes the response in the actor's own sequence.
Here each rehearsal is a row with its own prompt, which the actor never sees: a rehearse tag,
the called tool's signature, optional grounding examples ((call, response) pairs of that tool
from the tool cache, worldmodel/toolcache.py: training traffic only), the dialogue so far and the call. The response is copied into the actor's row as context
(OBS, no loss there); its training is in the rehearse row (REHEARSE). The warm start trains the
same rows (`warm_start_sequences`), and evaluation asks the model in them (`would_rehearse`).
The chat format's rehearse prompt is chat_separate.rehearse_prompt_ids, in the model's own template.
"""
import functools
import json
from collections import deque

import torch

from chat import format as chat
from worldmodel import chat_separate
from worldmodel import honesty
import world as toy_world
from machinery.config import ConfigError
from envace import OBS, PROMPT, REHEARSE, TAG, encode, encode_episode, tag_ids, world_is_sampled
from rollout import LIMITS, _next_turn, merged_settings, new_row, sample_rows

# the separate rehearse prompt's words, and each tool's signature (the toy's one-line stand-in
# for a JSON schema). In the vocabulary only with rehearsal_context separate, so that the inline
# model (and its figures) stay exactly as they were.
SEPARATE_WORDS = ["rehearse", "example", "dialogue", "number"]
SIGNATURES = {"price": "price item", "mul": "mul number , number", "pay": "pay number"}


@torch.no_grad()
def sample_separate(policy, tokenizer, prompts, env_mode="rehearse", *, env_model=None, examples=None,
                    world=toy_world, settings=None, generator=None, rehearse_prompt=None, plans=None):
    """rehearsal_context separate (the official implementation's choice): every rehearsal is its
    own row with its own prompt (toy format: separate.rehearse_prompt, the tool's signature,
    `examples(call)` grounding examples if given (toolcache.examples), the dialogue so far and
    the call), which the actor never sees.
    Sampled in rounds with rollout.sample_rows: the actor rows run until they end or finish a call;
    then the pending rehearse rows are sampled together (role REHEARSE, stopping at </env>); each
    response is copied into its actor row as `<env>` (TAG) + response + `</env>` (OBS: context
    with no loss; its training is in the rehearse row) and the actor rows go on. Each round
    keeps the actor rows' KV cache (rollout._save_paused): a round feeds them only the ids
    appended since. `settings`, `plans`: as in sample_episodes (rollout.SAMPLING; scripts/speed.py
    forces calls on random weights with `plans`).
    frozen: `env_model` writes the rehearse rows; their tokens are then OBS (no loss).
    Returns the actor rows as sample_episodes does, each with "rehearsals": its rehearse rows in
    call order (ids, roles, logprobs, calls [the call], responses, cause, "episode": the index of
    its actor row, i.e. of its prompt, "turn": which call, "tool": the tool it plays, by which the
    update groups its micro-batches). A rehearsal that fails (bad_rehearsal,
    env_limit) ends its episode with that cause.
    Chat format (`tags` the chat hand-offs, prompts as ids, one world per row): the rehearse prompt
    is `rehearse_prompt(actor row, its world)` (chat_separate.separate_prompt), the rehearser writes the
    result as an assistant turn ending at the template's end-of-turn stop (chat_separate.rehearse_tags), and
    the result is copied into the actor row as the template's tool response (`_copy_response`)."""
    assert world_is_sampled(env_mode) and (env_model is not None) == (env_mode == "frozen")
    chat_rows = any(isinstance(p, list) for p in prompts)     # chat prompts come as ids, the toy's as text
    if chat_rows and rehearse_prompt is None:
        rehearse_prompt = functools.partial(chat_separate.separate_prompt, tokenizer, 0)
    s = merged_settings(settings)
    tags = s["tags"] or tag_ids(tokenizer)
    env_tags = chat_separate.rehearse_tags(tags) if chat_rows else tags
    limits = {k: s[k] for k in LIMITS + ("rehearse_check",)}
    worlds = world if isinstance(world, list) else [world] * len(prompts)
    episodes = [new_row(p if chat_rows else tags["bos"] + encode(tokenizer, p), w, plan=plan, tags=tags,
                        tokenizer=tokenizer)
                for p, w, plan in zip(prompts, worlds, plans or [None] * len(prompts))]
    for i, e in enumerate(episodes):
        e.update(episode=i, rehearsals=[], stop_at="call")
    active = episodes
    while active:
        for e in active:                          # sample_rows drops a row's world when it returns
            e["world"] = worlds[e["episode"]]
        sample_rows(policy, tokenizer, active, "rehearse", None, tags, limits, s["temperature"], s["top_p"],
                    generator)
        pending = [e for e in active if e["cause"] == "call"]
        if not pending:
            break
        rehearsals = [_chat_rehearse_row(e, worlds[e["episode"]], env_tags, rehearse_prompt) if chat_rows
                      else _rehearse_row(e, tags, tokenizer, examples, world) for e in pending]
        room = max(len(r["ids"]) for r in rehearsals) + s["max_env_tokens"] + 2   # env_limit comes first
        sample_rows(env_model or policy, tokenizer, rehearsals, "rehearse", None, env_tags,
                    {**limits, "max_tokens": room}, s["temperature"], s["top_p"], generator)
        active = [e for e, r in zip(pending, rehearsals)
                  if _copy_response(e, r, tags, tokenizer, s["max_tokens"], frozen=env_model is not None)]
    for e in episodes:
        for row in [e] + e["rehearsals"]:
            row.pop("stop_at", None)
            row.pop("saved_kv", None)             # a row whose rehearsal failed kept its cache
        del e["episode"]
    return episodes



def _rehearse_row(episode, tags, tokenizer, examples, world):
    """A rehearse row for the actor row's last call (the actor row ends with that call's </act>)."""
    call = episode["calls"][-1]
    ids = rehearse_prompt(tokenizer, episode["ids"][len(tags["bos"]):], call,
                                   examples(call) if examples else (), world)
    return new_row(ids, world, "env", calls=[call], stop_at="response", episode=episode["episode"],
                   turn=len(episode["calls"]) - 1, tool=world.parse_call(call)[0])



def _chat_rehearse_row(episode, world, env_tags, rehearse_prompt):
    """A chat rehearse row for the actor row's last call: its own prompt (`rehearse_prompt`), and a
    world reading its result as an assistant turn (chat_separate.rehearse_tags)."""
    ids = rehearse_prompt(episode, world)
    call = episode["calls"][-1]
    return new_row(ids, chat.task_world(world.task, env_tags), "env", calls=[call], stop_at="response",
                   episode=episode["episode"], turn=len(episode["calls"]) - 1, tool=json.loads(call)["name"])



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
    # the ids a real tool's response would have (the toy's: the sampled ones; a chat template's
    # tool turn: not the rehearse row's assistant turn)
    response = encode(tokenizer, tags["env_lead"] + rehearsal["responses"][0] + tags["env_pre"]) + [tags["env_end"]]
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


def rehearse_prompt(tokenizer, dialogue, call, examples=(), world=toy_world):
    """The prompt of a separate rehearse row, as ids (the only place it is rendered for the toy's
    plain tags; a chat-template model gets its own: chat_separate.rehearse_prompt_ids). A rehearse
    tag with the called tool's signature, the grounding `examples` ([(call, response)] of that
    tool, from the tool cache), the dialogue so far and the call (`dialogue`: the actor's own
    ids after <bos>, up to the call's </act>), then the <env> hand-off; the policy writes the
    response and </env> after it. The actor never sees it.

        <bos> rehearse price item example <act> price jam </act> <env> 8 </env>
              dialogue buy milk <act> price milk </act> <env>
    """
    tags = tag_ids(tokenizer)
    ids = tags["bos"] + encode(tokenizer, f"rehearse {SIGNATURES[world.parse_call(call)[0]]}")
    for example_call, response in examples:
        ids += (encode(tokenizer, "example") + tags["act"] + encode(tokenizer, example_call) + [tags["act_end"]]
                + tags["env"] + encode(tokenizer, response) + [tags["env_end"]])
    return ids + encode(tokenizer, "dialogue") + list(dialogue) + tags["env"]



def rehearsal_rows(tokenizer, episode, examples=None, world=toy_world):
    """The separate rehearse rows of a logged or real episode ({ids, roles, calls, responses}):
    per call with a response, `rehearse_prompt` over the episode's own ids up to that call's
    </act>, then the response and </env> as REHEARSE. The warm start trains on these rows and
    would_rehearse_separate asks the model in them: the rows the sampler builds in RL."""
    if not episode["calls"]:
        return []
    tags = tag_ids(tokenizer)
    first_turn = episode["roles"].index(TAG)       # a call's </act> comes after the task prompt
    ends = [t for t in range(first_turn, len(episode["ids"])) if episode["ids"][t] == tags["act_end"]]
    rows = []
    for k, (call, response) in enumerate(zip(episode["calls"], episode["responses"])):
        prompt = rehearse_prompt(tokenizer, episode["ids"][len(tags["bos"]):ends[k] + 1], call,
                                 examples(call) if examples else (), world)
        target = encode(tokenizer, response) + [tags["env_end"]]
        rows.append({"ids": prompt + target, "roles": [PROMPT] * len(prompt) + [REHEARSE] * len(target),
                     "call": call, "turn": k, "tool": world.parse_call(call)[0]})
    return rows



@torch.no_grad()
def would_rehearse_separate(model, tokenizer, episodes, examples=None, world=toy_world, token_budget=4096):
    """would_rehearse_calls for a model trained with rehearsal_context separate: asked in the
    context it rehearses in (a separate row per call, with the same grounding examples), would it
    write exactly the real response and its </env> greedily? One teacher-forced forward over
    those rows. Returns [(call, matched)]."""
    rows = [r for e in episodes for r in rehearsal_rows(tokenizer, e, examples, world)]
    return honesty.would_rehearse_rows(model, rows, tokenizer.pad_token_id, token_budget)


def check_vocabulary(cfg, tokenizer):
    """The separate rehearse prompt's words must be in the vocabulary (a toy model warm-started
    inline has none of them): else one clear line."""
    if tokenizer.unk_token_id in tokenizer.encode(" ".join(SEPARATE_WORDS), add_special_tokens=False):
        raise ConfigError(f"rehearsal_context separate: the tokenizer of {cfg['model']} lacks the "
                          f"rehearse prompt's words {SEPARATE_WORDS}; start from model: tiny "
                          f"(or a model warm-started with rehearsal_context separate)")


def warm_start_sequences(tokenizer, logged, snippets, examples=None, world=toy_world):
    """The rows RL trains, from the logged data ([(task, responses)]) and the tool snippets, one
    group of rows ({"rows": [...]}) per logged episode or snippet, so that a warm-start step trains
    the same calls and responses as inline. An expert episode: its actor row (responses OBS:
    context here) and a rehearse row per call (`rehearsal_rows`: dialogue so far + call ->
    response, REHEARSE, with the grounding `examples`). A tool snippet: a rehearse row per call."""
    seqs = []
    for t, responses in logged:
        episode = {**encode_episode(tokenizer, t["prompt"], t["calls"], responses, t["answer"]),
                   "calls": t["calls"], "responses": responses}
        seqs.append({"rows": [episode] + rehearsal_rows(tokenizer, episode, examples, world)})
    for s in snippets:
        responses = world.replay(s["calls"])
        episode = {**encode_episode(tokenizer, s["prompt"], s["calls"], responses, act_role=PROMPT),
                   "calls": s["calls"], "responses": responses}
        seqs.append({"rows": rehearsal_rows(tokenizer, episode, examples, world)})
    return seqs
