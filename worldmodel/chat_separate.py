"""Separate rehearse rows in the chat format (`rehearsal_context: separate`, sampled by worldmodel/separate.py).

Each rehearsal is a row of its own, whose prompt is rendered with the model's own chat template
(`rehearse_prompt_ids`): a system message (play the called tool, answer with its result only;
its JSON schema; up to grounding_examples (call, result) examples of it, `grounding`: in training
the task's own examples first, then the tool cache's; in evaluation the cache's only), a user
message (the dialogue so far as JSON lines, then the call), the generation prompt. The result is written as
an assistant turn and ends at the template's end-of-turn stop (`rehearse_tags`); worldmodel/separate.py
copies it into the actor's row as the template's tool response (OBS). The warm start trains the
same rows (`separate_warm_start_sequences`); evaluation asks in them (`would_rehearse_separate`).

Simplified: tasks with one user turn only (format_chat_separate.setup refuses multi-turn tasks); the
rehearser sees the dialogue as JSON lines, not as the actor's rendered conversation.
"""
import json

from worldmodel import honesty, toolcache
from chat.format import _call, _json, assemble, prompt_ids
from envace import PROMPT, REHEARSE, encode
from chat.templates import render


REHEARSE_SYSTEM = ("You play the tool {name!r}, not the assistant. The assistant has called it: answer with "
                   "the tool's result only, exactly as the tool would return it.\nThe tool:\n{schema}")


def rehearse_prompt_ids(tokenizer, task, dialogue, call, examples=(), template=None):
    """The prompt of a separate rehearse row (rehearsal_context separate), as ids: the only place
    it is built. A system message: the policy plays the called tool and answers with its result
    only; the tool's JSON schema; `examples` ([(call, result)] of that tool) as JSON lines. A user
    message: the dialogue so far as JSON lines (the task's opening messages, then each earlier
    call with its result: `dialogue` [(call, result)]) and the call. Rendered by the tokenizer's
    own chat template with its generation prompt: the policy writes the result as an assistant
    turn ending with the template's end-of-turn stop (tags act_end). The actor never sees it.
    Calls are {"name", "arguments"} dicts."""
    tool = next(t for t in task["tools"] if t["function"]["name"] == call["name"])
    system = REHEARSE_SYSTEM.format(name=call["name"], schema=_json(tool))
    if examples:
        system += "\nExamples:\n" + "\n".join(_json({"arguments": c["arguments"], "result": r}) for c, r in examples)
    lines = [_json({"role": m["role"], "content": m["content"]}) for m in task["messages"]]
    lines += [_json({"call": _call(c), "result": r}) for c, r in dialogue]
    user = "The dialogue so far:\n" + "\n".join(lines) + "\nThe call:\n" + _json(_call(call))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return encode(tokenizer, render(tokenizer, messages, None, generation_prompt=True, template=template))


def rehearse_tags(tags):
    """The hand-offs of a separate rehearse row: its result is an assistant turn, so it ends with
    the actor's stop (and the text before it), not with the tool turn's."""
    return {**tags, "env_end": tags["act_end"], "env_pre": tags["act_pre"]}


def task_examples(task, name, k):
    """The first k of the task's examples of tool `name` (grounding_examples k; 0: none)."""
    return [(c, r) for c, r in task.get("examples", []) if c["name"] == name][:k]


def grounding(task, call, k, cache=None, own_examples=False):
    """Up to k (call, result) grounding examples of the called tool for its rehearse prompt: with
    own_examples (training: RL sampling and the warm start, on training tasks) the task's own
    reference examples first, then the tool cache's nearest (toolcache.examples: training traffic
    only). Evaluation leaves own_examples False: a test task's examples never reach a prompt."""
    return toolcache.examples(cache, call, k, task_examples(task, call["name"], k) if own_examples else ())


def separate_prompt(tokenizer, k, episode, world, cache=None, own_examples=False):
    """separate.sample_separate's prompt for the rehearsal of an actor row's last call (the row's
    world, chat.task_world, carries its task), with up to k `grounding` examples."""
    calls = [json.loads(c) for c in episode["calls"]]
    return rehearse_prompt_ids(tokenizer, world.task, list(zip(calls, episode["responses"])), calls[-1],
                               grounding(world.task, calls[-1], k, cache, own_examples), world.tags.get("template"))


def rehearse_rows(tokenizer, tags, task, calls, responses, k=0, cache=None, own_examples=False):
    """The separate rehearse rows of a logged or real episode of `task` (calls: dicts): per call
    with a response, its rehearse prompt (k `grounding` examples), then the result and the
    end-of-turn stop as REHEARSE, the rows the sampler builds in RL. The warm start trains them
    (own_examples); evaluation asks in them (the cache only)."""
    rows = []
    for n, (call, response) in enumerate(zip(calls, responses)):
        prompt = rehearse_prompt_ids(tokenizer, task, list(zip(calls[:n], responses[:n])), call,
                                     grounding(task, call, k, cache, own_examples), tags.get("template"))
        target = encode(tokenizer, response + tags["act_pre"]) + [tags["act_end"]]
        rows.append({"ids": prompt + target, "roles": [PROMPT] * len(prompt) + [REHEARSE] * len(target),
                     "call": _json(_call(call)), "turn": n, "tool": call["name"]})
    return rows


def separate_warm_start_sequences(tokenizer, tags, logged, tasks, k=0, cache=None):
    """warm_start_sequences for rehearsal_context separate, one group of rows per logged
    trajectory or task: a trajectory's actor row (calls and answer ACT, responses OBS: context)
    and its rehearse rows (`rehearse_rows`); a task's reference examples as rehearse rows (an
    empty dialogue, the example's call, its result REHEARSE). Training rows: each row's own
    examples first, then the tool cache's (`grounding`)."""
    seqs = []
    for t in logged:
        actor = assemble(tokenizer, tags, prompt_ids(tokenizer, t["messages"], t["tools"], tags.get("template")), t["call_dicts"],
                         t["responses"], t["answer"])
        seqs.append({"rows": [{"ids": actor["ids"], "roles": actor["roles"]}]
                     + rehearse_rows(tokenizer, tags, t, t["call_dicts"], t["responses"], k, cache, True)})
    for t in tasks:
        rows = [r for call, result in t.get("examples", [])
                for r in rehearse_rows(tokenizer, tags, t, [call], [result], k, cache, True)]
        if rows:
            seqs.append({"rows": rows})
    return seqs


def would_rehearse_separate(model, tokenizer, tasks, episodes, tags, k=0, cache=None):
    """The same, asked in separate rehearse rows (`rehearse_rows`, k grounding examples from the
    tool `cache` only: never the tasks' own, these are evaluation's)."""
    rows = [r for t, e in zip(tasks, episodes) for r in rehearse_rows(
        tokenizer, tags, t, [json.loads(c) for c in e["calls"]], e["responses"], k, cache)]
    return honesty.would_rehearse_rows(model, rows, tokenizer.pad_token_id)
