"""Chat format: episodes in a real model's own chat template, JSON tool calls, the world of a chat task.

The paper trains Qwen3 chat models on real tool-use data (BFCL, tau2-Bench): the actor writes
JSON tool calls inside assistant turns and the environment answers in the template's tool
turns. This file lets the same inline rehearsal run on such a model (`format: chat`):

- the hand-offs between roles are DERIVED from the tokenizer's chat template, never written by
  hand: a conversation is rendered with sentinel contents and the text between sentinels is cut
  out (`chat_format`). Each hand-off is split at its first special token: the text before it and
  the token itself are written by the role that is ending (its stop), the rest is forced as TAG
  ids by the sampler. With a Qwen2.5-style template (tests/helpers.py):

      prompt -> act   forced  <|im_start|>assistant\\n
      act -> env      stop    <|im_end|>            forced  \\n<|im_start|>user\\n<tool_response>\\n
      env -> act      stop    \\n</tool_response>    forced  <|im_end|>\\n<|im_start|>assistant\\n
      end             stop    <|im_end|>            (forced \\n, not sampled: nothing follows)

  The rehearsing policy writes the response AND the `\\n</tool_response>` closing it, so a
  byte-level BPE that merges `}\\n` into one token is sampled exactly as the template tokenizes it.
  At start, a sample conversation assembled token by token the sampler's way must equal the
  template's own tokens (`check_assembly`); a template that does not fit stops the run with one
  line saying which hand-off and the first differing token.
- actions: the template's own call form, derived with sentinels (chat/templates.py: Hermes
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, Llama's bare
  `{"name": ..., "parameters": {...}}`, Mistral's `[TOOL_CALLS] [...]`), parsed strictly against
  the tool's JSON schema (`read_act`, chat_tasks.check_value); anything else in an assistant turn
  is the final answer. A bad call ends the episode (cause bad_call_json, unknown_tool,
  bad_arguments or several_calls; reward 0). Think blocks: `think` keep or disable (docs/chat.md).
- the world of a task (`task_world`): reads actions against the task's tools and rehearsed
  responses, and executes calls where the task's `env` names an executor: "toy" (the toy world of
  world.py; its tools as JSON schemas, TOY_TOOLS) or "MODULE:CLASS" (chat/executor.py, docs/tools.md).
  With either, real-world evaluation, `env_mode: real`, fidelity and collusion exist
  (`has_executor`); without, the policy rehearses. `python -m chat.format --export data/toy_chat`
  writes the toy world's splits as chat task files (`export_toy`).

The rest of the chat format is in files of their own: below this one, chat/tasks.py (a task
file line checked field by field); above it, chat/multiturn.py (later user turns), worldmodel/chat_separate.py
(rehearsal_context separate), worldmodel/chat_honesty.py (fidelity and collusion in chat rows) and
chat/setup.py (what a chat run sets up from them).
Simplified: one tool call per assistant turn (several end the episode); every hand-off must be
the same after each turn (a template whose glue depends on the turn is refused at start).
"""
import json
from types import SimpleNamespace

import world as toy_world
from chat import executor
from machinery import taskfiles
from chat import templates
from chat.tasks import check_value, tool_schemas
from machinery.config import DEFAULTS
from envace import ACT, OBS, PROMPT, TAG, encode
from chat.templates import TemplateError, format_call, render


# ----------------------------------------------------------------------------- the template

SAMPLE_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["word"], "additionalProperties": False}}}
SAMPLE_TURNS = [({"name": "lookup", "arguments": {"word": "apple", "limit": 2}}, '{"result": "a fruit"}'),
                ({"name": "lookup", "arguments": {"word": "pear"}}, "error: not found")]
SAMPLE_OPENING = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is an apple?"}]
SAMPLE_ANSWER = "An apple is a fruit."
SAMPLE_THINKS = ["I should look the word up.", "Now pear, for comparison.", "I know enough."]


def chat_format(tokenizer, think="keep"):
    """The sampler's hand-offs, derived from the template (templates.derive: sentinel contents,
    one and two tool-call turns, an answer) and turned into ids: the prompt->act hand-off
    (first_act), act->env after the actor's stop (env), env->act after the tool turn's stop (act),
    end after the final stop; the stop ids act_end/env_end and the text before each (act_pre,
    env_pre); the hand-off tokens the policy may not write (stops) and pad. think: keep (the
    actor's think text stays) or disable (the template's enable_thinking false: its empty think block
    is forced, think_block). `format` holds the act format read_act parses. Checked whole with
    `check_assembly`."""
    fmt = templates.derive(tokenizer, think, [SAMPLE_TOOL])
    first_ids, act_ids = encode(tokenizer, fmt["first"]), encode(tokenizer, fmt["act"])
    block = encode(tokenizer, fmt["think_block"]) if fmt["think_block"] else []
    for name, forced in (("prompt->act", first_ids), ("env->act", act_ids)):
        if forced[len(forced) - len(block):] != block:
            raise TemplateError(f"hand-off {name}: the empty think block {fmt['think_block']!r} does not end "
                                f"its tokens {tokenizer.convert_ids_to_tokens(forced)}")
    env_ids, end_ids = encode(tokenizer, fmt["act_env"]), encode(tokenizer, fmt["end"])
    ids = {str(t): i for i, t in tokenizer.added_tokens_decoder.items()}
    act_end, env_end = ids[fmt["stop"]], ids[fmt["env_stop"]]
    special = set(tokenizer.added_tokens_decoder)
    handoffs = set(first_ids + act_ids + env_ids + end_ids + [act_end, env_end])
    tags = {"bos": [], "first_act": first_ids, "act": act_ids, "env": env_ids, "end": end_ids,
            "act_end": act_end, "env_end": env_end, "act_pre": fmt["act_pre"], "env_pre": fmt["env_pre"], "env_lead": fmt["env_lead"],
            "pad": tokenizer.pad_token_id, "stops": (handoffs & special) | {tokenizer.pad_token_id},
            "format": fmt, "think_block": block, "template": fmt["template"]}
    check_assembly(tokenizer, tags)
    return tags


def prompt_ids(tokenizer, messages, tools, template=None):
    return encode(tokenizer, render(tokenizer, messages, tools, template=template))


def assemble(tokenizer, tags, prompt, calls, responses, answer=None, env_role=OBS, act_role=ACT,
             with_end=False, thinks=None):
    """An episode's ids and roles built the sampler's way: prompt ids, forced hand-offs as TAG,
    each action (call text or answer, in the template's act format) + its stop as `act_role`,
    each response + its stop as `env_role`. `calls` are {"name", "arguments"} dicts. answer=None
    with as many calls as responses ends with the hand-back to the actor (env->act), as a
    generation prompt does. thinks: per actor turn the think text it writes first (think: keep)
    or None. Labels (`where`) name every segment; a think text or a forced empty think block is
    labelled "think k" / "think block k" (k: the actor turn), so that check_assembly can leave out
    those the template does not re-render."""
    fmt, block = tags.get("format", templates.HERMES), tags.get("think_block", [])
    ids, roles, where = [], [], []

    def add(tok_ids, role, label):
        ids.extend(tok_ids)
        roles.extend([role] * len(tok_ids))
        where.extend([label] * len(tok_ids))

    def hand_to_actor(forced, label, turn):
        add(forced[:len(forced) - len(block)], TAG, label)
        add(forced[len(forced) - len(block):], TAG, f"think block {turn}")

    def actor(text, turn, label):
        if thinks and thinks[turn - 1] is not None:
            add(encode(tokenizer, fmt["think"][0] + thinks[turn - 1] + fmt["think"][1]), act_role, f"think {turn}")
        add(encode(tokenizer, text + tags["act_pre"]) + [tags["act_end"]], act_role, label)

    add(prompt, PROMPT, "prompt")
    hand_to_actor(tags["first_act"], "hand-off prompt->act", 1)
    for k, (call, response) in enumerate(zip(calls, responses)):
        if k:
            hand_to_actor(tags["act"], "hand-off env->act", k + 1)
        actor(format_call(call, fmt), k + 1, f"action {k + 1} and its stop")
        add(tags["env"], TAG, "hand-off act->env")
        add(encode(tokenizer, tags.get("env_lead", "") + response + tags["env_pre"]) + [tags["env_end"]], env_role,
            f"response {k + 1} and its stop")
    if answer is not None:
        if calls:
            hand_to_actor(tags["act"], "hand-off env->act", len(calls) + 1)
        actor(fmt["answer_pre"] + answer, len(calls) + 1, "answer and its stop")
        if with_end:
            add(tags["end"], TAG, "hand-off end")
    elif calls:
        hand_to_actor(tags["act"], "hand-off env->act", len(calls) + 1)
    return {"ids": ids, "roles": roles, "where": where}


def check_assembly(tokenizer, tags):
    """At every point where the actor is handed the turn (after the prompt, after each of two
    tool responses, the second an error) and at the end of the answer, the sampler's
    token-by-token assembly of a sample conversation (structured tool_calls, tool messages, with
    think text where the template renders reasoning) must equal the template's own rendering of it
    (with its generation prompt at a hand-off), tokenized. Where the template drops the think
    blocks of earlier turns (think_history dropped), those are left out of the assembly before
    comparing: the one documented difference between the sampled sequence and a re-rendering.
    The first difference is reported with the segment it falls in."""
    fmt, template = tags.get("format", templates.HERMES), tags.get("template")
    thinks = SAMPLE_THINKS if fmt.get("reasons") else None
    calls, responses = [c for c, _ in SAMPLE_TURNS], [r for _, r in SAMPLE_TURNS]
    prompt = prompt_ids(tokenizer, SAMPLE_OPENING, [SAMPLE_TOOL], template)
    history, n = [], len(SAMPLE_TURNS)
    for k in range(n + 2):
        end = k == n + 1
        if 0 < k <= n:
            history += [{"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": calls[k - 1]}]},
                        {"role": "tool", "content": responses[k - 1]}]
        if end:
            history.append({"role": "assistant", "content": SAMPLE_ANSWER})
        if thinks:
            for j, m in enumerate([m for m in history if m["role"] == "assistant"]):
                m["reasoning_content"] = thinks[j]
        want = encode(tokenizer, render(tokenizer, SAMPLE_OPENING + history, [SAMPLE_TOOL], not end, template))
        got = assemble(tokenizer, tags, prompt, calls[:k], responses[:k], SAMPLE_ANSWER if end else None,
                       with_end=end, thinks=thinks)
        dropped = {f"think{b} {j}" for j in range(1, min(k, n) + 1) for b in ("", " block")} \
            if fmt.get("think_history") == "dropped" else set()
        kept = [t for t, w in enumerate(got["where"]) if w not in dropped]
        got = {key: [got[key][t] for t in kept] for key in ("ids", "where")}
        first_difference(tokenizer, got, want, "the sampler")


def first_difference(tokenizer, got, want, what):
    """Raise TemplateError at the first token where the sampler's assembly `got` (ids, where) and
    the template's own ids `want` differ, naming the segment it falls in."""
    for t, (a, b) in enumerate(zip(got["ids"] + [None], want + [None])):
        if a != b:
            seen = tokenizer.convert_ids_to_tokens(want[max(0, t - 3):t + 3])
            where = got["where"][min(t, len(got["where"]) - 1)]
            raise TemplateError(
                f"the chat template does not fit {what}: in {where}, token {t} is "
                f"{_tok(tokenizer, a)} in the sampler's assembly but {_tok(tokenizer, b)} in the template's "
                f"own rendering (template tokens there: {seen})")


def _tok(tokenizer, i):
    return "the end" if i is None else repr(tokenizer.convert_ids_to_tokens(i))


# ----------------------------------------------------------------------------- strict tool calls

def read_act(text, schemas, fmt=None):
    """An actor's turn text -> ("answer", text) | ("call", canonical JSON) | (cause, message), in
    the template's act format `fmt` (templates.derive; default the Qwen/Hermes form). Causes:
    bad_call_json (not exactly the template's call form, holding JSON objects with just its name
    and arguments keys, an arguments object), unknown_tool, bad_arguments (the schema says no),
    several_calls (well-formed calls, more than one: the sampler runs one call per turn),
    empty_answer, unclosed_think. A leading think block (Qwen3's thinking mode) is not the action."""
    fmt = fmt or templates.HERMES
    think_open, think_close = (w.strip() for w in fmt["think"])
    if text.lstrip().startswith(think_open):
        if think_close not in text:
            return "unclosed_think", f"a {think_open} block without {think_close}"
        text = text.split(think_close, 1)[1]
    if not templates.is_call(text, fmt):
        answer = text.strip()
        if fmt["answer_pre"].strip() and answer.startswith(fmt["answer_pre"].strip()):
            answer = answer[len(fmt["answer_pre"].strip()):].strip()
        return ("answer", answer) if answer else ("empty_answer", "an empty assistant turn")
    parsed, problem = templates.read_calls(text, fmt)
    if parsed is None:
        return "bad_call_json", problem
    calls = []
    for call in parsed:
        name, args = fmt["name_key"], fmt["args_key"]
        if (not isinstance(call, dict) or set(call) != {name, args} or not isinstance(call[name], str)
                or not isinstance(call[args], dict)):
            return "bad_call_json", f'expected {{"{name}": "...", "{args}": {{...}}}}'
        if call[name] not in schemas:
            return "unknown_tool", f"no tool named {call[name]!r}"
        problem = check_value(call[args], schemas[call[name]])
        if problem:
            return "bad_arguments", problem
        calls.append({"name": call[name], "arguments": call[args]})
    if len(calls) > 1:
        return "several_calls", f"{len(calls)} calls in one turn: this sampler runs one call per turn"
    return "call", json.dumps(calls[0], ensure_ascii=False)


def _json(value):
    """JSON text as the chat files write it (non-ASCII kept); with _call, a call's canonical text."""
    return json.dumps(value, ensure_ascii=False)


def _call(call):
    """A call dict with only its name and arguments."""
    return {"name": call["name"], "arguments": call["arguments"]}


# ----------------------------------------------------------------------------- the worlds

TOY_TOOLS = [
    {"type": "function", "function": {
        "name": "price", "description": "The catalogue price of an item.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string", "enum": toy_world.ITEMS}},
                       "required": ["item"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "mul", "description": "The product a * b of two one-digit numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "pay", "description": "Pay an amount from the wallet (9 coins at the start); returns the balance.",
        "parameters": {"type": "object", "properties": {"amount": {"type": "integer"}},
                       "required": ["amount"], "additionalProperties": False}}}]
TOY_SYSTEM = "You are a shop assistant. Use the tools, then answer with the number only."


def toy_call_text(call):
    """A JSON call of the toy tools -> the toy world's call text ('mul 3 , 4')."""
    args = call["arguments"]
    if call["name"] == "mul":
        return f"mul {args['a']} , {args['b']}"
    return f"{call['name']} {args.get('item', args.get('amount'))}"


def toy_json_call(text):
    """'mul 3 , 4' -> {"name": "mul", "arguments": {"a": 3, "b": 4}}."""
    tool, args = toy_world.parse_call(text)
    keys = {"price": ["item"], "mul": ["a", "b"], "pay": ["amount"]}[tool]
    return {"name": tool, "arguments": dict(zip(keys, args))}


def _toy_step(state, call):
    return toy_world.step(state, toy_call_text(json.loads(call)))


def _no_executor(state, call):
    raise ValueError("this task has no executor ('env': 'toy' or 'MODULE:CLASS', docs/tools.md)")


def has_executor(task):
    """Whether a real executor runs the task's calls: the toy world (env "toy") or its own class."""
    return bool(task.get("env"))


def task_world(task, tags, tool_timeout=DEFAULTS["tool_timeout"]):
    """The sampler's world for one chat task: reads actions against the task's tools, reads a
    rehearsed response, and executes calls: env "toy" in the toy world, env "MODULE:CLASS" on a
    fresh CLASS(**env_config) per episode (`new_state`; executor.call_tool, tool_timeout seconds
    a call). Also what worldmodel/honesty.py's fidelity functions need (TOOL_KINDS, parse_call, replay),
    by tool name."""
    schemas = tool_schemas(task["tools"])
    toy = task.get("env") == "toy"
    fmt = tags.get("format", templates.HERMES)
    if has_executor(task) and not toy:
        def new_state():
            return executor.new_instance(task, tool_timeout)

        def step(state, call):
            return executor.call_tool(state, json.loads(call), schemas, tool_timeout)
    else:
        new_state, step = toy_world.new_state, _toy_step if toy else _no_executor

    def parse_response(text):
        pre, lead = tags["env_pre"], tags.get("env_lead", "")
        if (not text.endswith(pre) or not text.startswith(lead)
                or any(s in text for s in fmt["markers"] + fmt["env_markers"])):
            return None
        return text[len(lead):len(text) - len(pre)]

    def replay(calls):
        state = new_state()
        return [step(state, c) for c in calls]

    def read(text):
        pre = tags["act_pre"]
        return read_act(text[:len(text) - len(pre)] if pre and text.endswith(pre) else text, schemas, fmt)

    def next_turn(answered):
        """The forced (id, role) pairs of the user turn after the `answered`-th answer (episode_inputs
        caches them in the task), or None after the last: the episode ends."""
        later = task.get("turn_ids", [])
        return later[answered - 1] if answered <= len(later) else None

    return SimpleNamespace(task=task, tags=tags, new_state=new_state, read_act=read, parse_response=parse_response,
                           next_turn=next_turn, step=step, replay=replay,
                           TOOL_KINDS=toy_world.TOOL_KINDS if toy else {name: name for name in schemas},
                           parse_call=lambda call: (json.loads(call)["name"], None))


# ----------------------------------------------------------------------------- the toy's tasks as chat task files

def toy_task_line(task, with_trajectory=False):
    """A toy world task (world.random_task) as a chat JSONL object: the toy tools as JSON schemas,
    the expert's calls as gold_calls, its (call, result) pairs as examples, env toy."""
    calls = [toy_json_call(c) for c in task["calls"]]
    results = toy_world.replay(task["calls"])
    messages = [{"role": "system", "content": TOY_SYSTEM}, {"role": "user", "content": task["prompt"]}]
    if with_trajectory:
        for call, result in zip(calls, results):
            messages += [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                         {"role": "tool", "content": result}]
        messages.append({"role": "assistant", "content": task["answer"]})
        return {"messages": messages, "tools": TOY_TOOLS}
    examples = {}
    for call, result in zip(calls, results):
        examples.setdefault(call["name"], []).append({"arguments": call["arguments"], "result": result})
    return {"messages": messages, "tools": TOY_TOOLS, "answer": task["answer"], "gold_calls": calls,
            "examples": examples, "env": "toy", "family": task["family"]}


def export_toy(out_dir, seed=0, n_logged=3000, n_new_logged=20, n_rl=4000, n_test=500):
    """The toy world's splits in the chat JSONL format: rl.jsonl, test.jsonl, logged.jsonl."""
    import os
    os.makedirs(out_dir, exist_ok=True)
    splits = toy_world.make_splits(seed, n_logged, n_new_logged, n_rl, n_test)
    for name, tasks, full in (("rl", splits["rl"], False), ("test", splits["test"], False),
                              ("logged", splits["logged"], True)):
        with open(os.path.join(out_dir, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(toy_task_line(t, full)) + "\n" for t in tasks)
    return out_dir


if __name__ == "__main__":
    taskfiles.export_main(export_toy, "chat JSONL (tools as JSON schemas)")
