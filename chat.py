"""Chat format: episodes in a real model's own chat template, JSON tool calls, JSONL task files.

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
- actions: the template's own call form, derived with sentinels (templates.py: Hermes
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, Llama's bare
  `{"name": ..., "parameters": {...}}`, Mistral's `[TOOL_CALLS] [...]`), parsed strictly against
  the tool's JSON schema (`read_act`, `check_value`); anything else in an assistant turn is the
  final answer. A bad call ends the episode (cause bad_call_json, unknown_tool, bad_arguments or
  several_calls; reward 0). Think blocks: `think` keep or disable (docs/chat.md).
- task files (`read_chat_jsonl`): one task per line: opening `messages`, `tools` (OpenAI
  function schemas), success criteria `answer` / `gold_calls` / `checklist`, optional
  `call_order`, `examples` (per tool, reference {arguments, result} pairs) and `env`: "toy"
  (the toy world of world.py executes the calls) or "MODULE:CLASS" / "path/to/file.py:CLASS"
  with `env_config` (the task's own executor, executor.py: per episode CLASS(**env_config), a
  call runs the method of its name; docs/tools.md). With either, real-world evaluation,
  `env_mode: real`, fidelity and collusion exist (`has_executor`); without, the policy rehearses.
  Logged trajectories are the same with the whole conversation in `messages`.
- multi-turn dialogues (`turns`: later user turns): the answer -> next user turn hand-off is
  derived the same way (`turn_handoff`) and checked (`check_turn_assembly`); each later turn's
  forced ids (glue TAG, user content PROMPT) are tokenized once per task (`turn_ids`), and the
  task's world hands them to the sampler after each answer (`next_turn`). `gold_calls` may be
  given per user turn. Logged trajectories may hold several user turns (`_dialogue`).
- rehearsal_context separate (`rehearse_prompt_ids`): each rehearsal in a row of its own, whose
  prompt is rendered with the same chat template: a system message (play the called tool, answer
  with its result only; its JSON schema; up to grounding_examples of the task's examples of it),
  a user message (the dialogue so far as JSON lines, then the call), the generation prompt. The
  result is written as an assistant turn and ends at the template's end-of-turn stop; it is
  copied into the actor's row as the template's tool response (OBS).
"""
import json
import os
from collections import defaultdict
from types import SimpleNamespace

import torch

import world as toy_world
import executor
import honesty
import rollout
import taskfiles
import templates
from checkpoint import load_policy
from chat_reward import make_judge
from config import DEFAULTS, ConfigError
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, encode
from templates import TemplateError, format_call, render

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


class DataError(taskfiles.DataError):
    """A malformed line in a chat task file (same style as taskfiles.read_jsonl's errors)."""


# ----------------------------------------------------------------------------- the template

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

TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
         "object": dict, "null": type(None)}


def check_value(value, schema, path="arguments"):
    """The first way `value` breaks the JSON schema `schema` (types, enum, required, properties,
    additionalProperties false, array items), as a message; None if it fits. Hand-written: the
    subset of JSON Schema that OpenAI function schemas use. `schema` has passed check_schema
    (every task file's tools do, at load), so its keywords have the shapes read here."""
    if not isinstance(schema, dict):
        return None
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
    if kinds and not any(_is_type(value, k) for k in kinds):
        return f"{path} must be {' or '.join(kinds)}, got {json.dumps(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path} must be one of {schema['enum']}, got {json.dumps(value)}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"{path}.{key} is required"
        for key, v in value.items():
            if key in props:
                problem = check_value(v, props[key], f"{path}.{key}")
                if problem:
                    return problem
            elif schema.get("additionalProperties", True) is False:
                return f"{path}.{key} is not a known argument"
    if isinstance(value, list):
        for k, v in enumerate(value):
            problem = check_value(v, schema.get("items"), f"{path}[{k}]")
            if problem:
                return problem
    return None


def check_schema(schema, path="parameters"):
    """The first way `schema` is not a JSON schema check_value can read, as a message; None if
    fine. Recursive over properties / items / additionalProperties; keywords check_value does not
    read (description, anyOf, format, ...) are not checked and not enforced."""
    if not isinstance(schema, dict):
        return f"{path} must be a JSON schema object, got {json.dumps(schema)}"
    kinds = schema.get("type", [])
    if not isinstance(kinds, str) and not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
        return f"{path}.type must be a type name or a list of them, got {json.dumps(kinds)}"
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        return f"{path}.enum must be a non-empty list, got {json.dumps(schema['enum'])}"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        return f"{path}.required must be a list of property names, got {json.dumps(required)}"
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        return f"{path}.properties must be an object of property schemas, got {json.dumps(props)}"
    for key, sub in props.items():
        problem = check_schema(sub, f"{path}.properties.{key}")
        if problem:
            return problem
    extra = schema.get("additionalProperties", True)
    if not isinstance(extra, (bool, dict)):
        return f"{path}.additionalProperties must be true, false or a JSON schema, got {json.dumps(extra)}"
    if isinstance(extra, dict):
        problem = check_schema(extra, f"{path}.additionalProperties")
        if problem:
            return problem
    if "items" in schema:
        return check_schema(schema["items"], f"{path}.items")
    return None


def _is_type(value, kind):
    if kind not in TYPES:
        return True                    # a type this validator does not know is not enforced
    if isinstance(value, bool) and kind != "boolean":
        return False                   # JSON true is not 1
    return isinstance(value, TYPES[kind])


def tool_schemas(tools):
    """{name: parameters schema} of a task's tools (OpenAI form, normalised at load)."""
    return {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}


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
    a call). Also what rehearse.py's fidelity functions need (TOOL_KINDS, parse_call, replay),
    by tool name."""
    schemas = tool_schemas(task["tools"])
    toy = task.get("env") == "toy"
    fmt = tags.get("format", templates.HERMES)
    if has_executor(task) and not toy:
        def new_state():
            return task["env_class"](**task["env_config"])

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


def episode_inputs(tokenizer, tags, tasks, tool_timeout=DEFAULTS["tool_timeout"]):
    """Per task: its prompt ids and its world (cached in the task dict)."""
    for t in tasks:
        if "prompt_ids" not in t:
            t["prompt_ids"] = prompt_ids(tokenizer, t["messages"], t["tools"], tags.get("template"))
            t["turn_ids"] = [turn_ids(tokenizer, tags, turn) for turn in t.get("turns", [])]
            t["world"] = task_world(t, tags, tool_timeout)
    return [t["prompt_ids"] for t in tasks], [t["world"] for t in tasks]


# ----------------------------------------------------------------------------- task files

ROLES = ("system", "user", "assistant", "tool")


def _fail(where, what):
    raise DataError(f"{where}: {what}")


def _check_tools(tools, where):
    """OpenAI function schemas (bare {"name", "parameters"} accepted), returned in OpenAI form."""
    if not isinstance(tools, list):
        _fail(where, "'tools' must be a list of function schemas")
    out = []
    for k, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            _fail(where, f"tool {k + 1} has no 'name' (expected {{\"type\": \"function\", \"function\": "
                         f"{{\"name\", \"parameters\"}}}})")
        if any(t["function"]["name"] == fn["name"] for t in out):
            _fail(where, f"tool {k + 1}: a second tool named {fn['name']!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            _fail(where, f"tool {fn['name']!r}: 'parameters' must be an object schema")
        problem = check_schema(params)
        if problem:
            _fail(where, f"tool {fn['name']!r}: {problem}")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def _check_call(call, schemas, where, what):
    """A {name, arguments} (or OpenAI tool_call) in a file -> {name, arguments}, checked."""
    call = call.get("function", call) if isinstance(call, dict) else call
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        _fail(where, f"{what} must be {{\"name\": ..., \"arguments\": {{...}}}}, got {json.dumps(call)}")
    args = call.get("arguments", {})
    if isinstance(args, str):                          # OpenAI stores arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            _fail(where, f"{what}: arguments are not valid JSON")
    if not isinstance(args, dict):
        _fail(where, f"{what}: arguments must be an object")
    if call["name"] not in schemas:
        _fail(where, f"{what} names tool {call['name']!r}, which is not in 'tools'")
    problem = check_value(args, schemas[call["name"]])
    if problem:
        _fail(where, f"{what} {call['name']}: {problem}")
    return {"name": call["name"], "arguments": args}


def _check_messages(messages, where):
    if not isinstance(messages, list) or not messages:
        _fail(where, "'messages' must be a non-empty list")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            _fail(where, f"message {k + 1} must have a role in {ROLES}")
        if m["role"] != "assistant" and not isinstance(m.get("content"), str):
            _fail(where, f"message {k + 1} ({m['role']}) must have a string 'content'")
        if m["role"] == "assistant" and not isinstance(m.get("content"), (str, type(None))):
            _fail(where, f"message {k + 1} (assistant): 'content' must be a string or null, "
                         f"got {json.dumps(m['content'])}")


def check_task(row, where, kind, base_dir="."):
    """One JSONL line's object -> a task (or logged trajectory) dict; DataError names the problem.
    base_dir: the task file's folder, where an env "path.py:CLASS" is looked for."""
    if not isinstance(row, dict):
        _fail(where, "expected a JSON object with 'messages' and 'tools'")
    for key in ("messages", "tools"):
        if key not in row:
            _fail(where, f"missing key '{key}'")
    tools = _check_tools(row["tools"], where)
    schemas = tool_schemas(tools)
    _check_messages(row["messages"], where)
    first = next((k for k, m in enumerate(row["messages"]) if m["role"] in ("assistant", "tool")),
                 len(row["messages"]))
    opening = row["messages"][:first]
    if not any(m["role"] == "user" for m in opening):
        _fail(where, "the opening messages (before the first assistant turn) hold no user message")
    task = {"messages": opening, "tools": tools, "family": row.get("family", "file")}
    if not isinstance(task["family"], str) or not task["family"]:
        _fail(where, f"'family' must be a non-empty string, got {json.dumps(task['family'])}")
    if kind == "trajectories":        # examples: optional here too (separate rehearse prompts)
        return {**task, **_dialogue(row["messages"][first:], schemas, where),
                "examples": _check_examples(row.get("examples", {}), schemas, where)}
    if first < len(row["messages"]):
        _fail(where, "a task's 'messages' are the opening only (system/user); trajectories go in logged_file")
    if "answer" in row:
        if (not isinstance(row["answer"], (str, int, float)) or isinstance(row["answer"], bool)
                or not str(row["answer"]).strip() or str(row["answer"]) in ("inf", "-inf", "nan")):
            _fail(where, f"'answer' must be a string or a number (non-empty, finite), got {json.dumps(row['answer'])}")
        task["answer"] = str(row["answer"])
    if "turns" in row:
        turns = _check_turns(row["turns"], where)
        if turns:
            task["turns"] = turns
    if "gold_calls" in row:
        if not isinstance(row["gold_calls"], list):
            _fail(where, "'gold_calls' must be a list of {name, arguments}")
        task["gold_calls"] = _check_gold_calls(row["gold_calls"], 1 + len(task.get("turns", [])), schemas, where)
    if "checklist" in row:
        if not isinstance(row["checklist"], list) or not all(isinstance(q, str) and q.strip() for q in row["checklist"]):
            _fail(where, "'checklist' must be a list of yes/no questions (strings)")
        task["checklist"] = row["checklist"]
    task.update(_check_check(row, where, base_dir))
    if not any(k in task for k in ("answer", "gold_calls", "checklist", "check")):
        _fail(where, "no success criterion: give 'answer', 'gold_calls', 'checklist' or 'check'")
    task["call_order"] = row.get("call_order", "exact")
    if task["call_order"] not in ("exact", "any"):
        _fail(where, f"'call_order' must be 'exact' or 'any', got {json.dumps(task['call_order'])}")
    env = row.get("env", "")
    if not isinstance(env, str):
        _fail(where, f"'env' must be 'toy', 'MODULE:CLASS' or 'path/to/file.py:CLASS', got {json.dumps(env)}")
    if "env_config" in row and env in ("", "toy"):
        _fail(where, "'env_config' is given but 'env' names no executor class ('MODULE:CLASS')")
    if env == "toy":
        task["env"] = "toy"
    elif env:
        task.update(_check_env(env, row.get("env_config", {}), schemas, where, base_dir))
    task["examples"] = _check_examples(row.get("examples", {}), schemas, where)
    return task


def _check_check(row, where, base_dir):
    """A task's own success `check` ("MODULE:FUNCTION" or "path.py:FUNCTION", loaded here to fail
    at load; a path is made absolute so that chat_reward loads it from anywhere): {"check": spec}."""
    if "check" not in row:
        return {}
    spec = row["check"]
    try:
        executor.load_object(spec, base_dir)
    except ConfigError as e:              # its message names the spec as an env's
        _fail(where, f"'check' {str(e).removeprefix('env ')}")
    path, _, name = spec.rpartition(":")
    return {"check": f"{os.path.abspath(os.path.join(base_dir, path))}:{name}" if path.endswith(".py") else spec}


def _check_env(spec, env_config, schemas, where, base_dir):
    """env "MODULE:CLASS" and env_config, checked at load: the class loads, CLASS(**env_config)
    constructs, and it has a method for every tool."""
    try:
        cls = executor.load_object(spec, base_dir)
    except ConfigError as e:
        _fail(where, str(e))
    if not isinstance(env_config, dict):
        _fail(where, f"'env_config' must be a JSON object (the keyword arguments of {spec}), "
                     f"got {json.dumps(env_config)}")
    try:
        instance = cls(**env_config)
    except Exception as e:                # the user's constructor: its error, in one line
        _fail(where, f"env {spec!r}: {spec.rpartition(':')[2]}(**env_config) raised {executor.error_text(e)}")
    missing = [n for n in schemas if n.startswith("_") or not callable(getattr(instance, n, None))]
    if missing:
        _fail(where, f"env {spec!r} has no method for tool(s) {', '.join(missing)}")
    return {"env": spec, "env_class": cls, "env_config": env_config}


def _check_examples(examples, schemas, where):
    if not isinstance(examples, dict):
        _fail(where, "'examples' must map a tool name to a list of {arguments, result}")
    out = []
    for name, pairs in examples.items():
        if not isinstance(pairs, list):
            _fail(where, f"examples of {name!r} must be a list")
        for k, pair in enumerate(pairs):
            if not isinstance(pair, dict) or not isinstance(pair.get("result"), str):
                _fail(where, f"example {k + 1} of {name!r} needs 'arguments' and a string 'result'")
            call = _check_call({"name": name, "arguments": pair.get("arguments", {})}, schemas, where,
                               f"example {k + 1} of")
            out.append((call, pair["result"]))
    return out


def _trajectory(turns, schemas, where):
    """assistant(tool call) + tool pairs, then an optional final assistant answer."""
    calls, responses, answer = [], [], None
    k = 0
    while k < len(turns):
        m = turns[k]
        if m["role"] != "assistant":
            _fail(where, f"turn {k + 1} after the opening: expected an assistant message, got {m['role']}")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            _fail(where, f"turn {k + 1}: 'tool_calls' must be a list, got {json.dumps(m['tool_calls'])}")
        if not m.get("tool_calls"):
            if k != len(turns) - 1 or not isinstance(m.get("content"), str):
                _fail(where, "an assistant message without tool_calls must be the last one, with a string content")
            answer = m["content"]
            break
        if len(m["tool_calls"]) != 1:
            _fail(where, f"turn {k + 1}: one tool call per assistant turn (got {len(m['tool_calls'])})")
        if k + 1 >= len(turns) or turns[k + 1]["role"] != "tool":
            _fail(where, f"turn {k + 1}: a tool call must be followed by its tool message")
        calls.append(_check_call(m["tool_calls"][0], schemas, where, f"tool call {len(calls) + 1}"))
        responses.append(turns[k + 1]["content"])
        k += 2
    if not calls and answer is None:
        _fail(where, "a logged trajectory needs at least one assistant turn")
    return {"calls": [json.dumps(c, ensure_ascii=False) for c in calls], "call_dicts": calls,
            "responses": responses, "answer": answer}


def read_chat_jsonl(path, kind):
    """Chat tasks or logged chat trajectories, one JSON object per line; blank lines skipped.
    Every line is checked before anything trains; the first bad one raises DataError."""
    base_dir = os.path.dirname(os.path.abspath(path))
    rows = [check_task(row, where, kind, base_dir) for where, row in taskfiles.json_lines(path, kind)]
    if not rows:
        raise DataError(f"{path}: no {kind} in the file")
    return rows


# ----------------------------------------------------------------------------- multi-turn dialogues

SAMPLE_ANSWERS = ["An apple is a fruit.", "I could not find it."]
SAMPLE_NEXT_TURN = [{"role": "user", "content": "And what is a pear?"}]


def turn_handoff(tokenizer, template=None):
    """The hand-off answer -> next user turn, derived from the template with sentinel contents as
    chat_format derives the others. In `opening, answer A1, user U2` and in `..., A1, U2, answer
    A2, user U3, user U4` (a turn of two user messages), each rendered with the generation prompt,
    the text after an answer's content is: the text before the actor's stop and the stop (written
    by the actor), `turn_pre` up to the first user content, the contents separated by `turn_sep`,
    then `turn_post` up to the end of the generation prompt. turn_pre and turn_post must be the
    same after answer 1 and answer 2. Returns them as text, with the stop (turn_stop) and the text
    before it (turn_stop_pre); `turn_ids` tokenizes them with each task's user contents."""
    s = [templates.SENTINEL.format(k) for k in ("S", "U", "A1", "U2", "A2", "U3", "U4")]
    opening = [{"role": "system", "content": s[0]}, {"role": "user", "content": s[1]}]
    later = [{"role": r, "content": c} for r, c in zip(("assistant", "user", "assistant", "user", "user"), s[2:])]
    one = templates._cut(render(tokenizer, opening + later[:2], [SAMPLE_TOOL], True, template), s[2], s[3],
                         "hand-off answer->user")
    two = templates._cut(render(tokenizer, opening + later, [SAMPLE_TOOL], True, template), s[4], "",
                         "hand-off answer->user")
    stop_pre, stop_text, turn_pre = templates._first_special(tokenizer, one, "hand-off answer->user")
    stop = {str(t): i for i, t in tokenizer.added_tokens_decoder.items()}[stop_text]
    turn_post = templates._cut(render(tokenizer, opening + later[:2], [SAMPLE_TOOL], True, template), s[3], "",
                               "hand-off answer->user")
    head = stop_pre + stop_text + turn_pre + s[5]
    if not (two.startswith(head) and two.endswith(s[6] + turn_post) and len(two) >= len(head + s[6] + turn_post)):
        raise TemplateError(f"hand-off answer->user depends on the turn: {one + s[3] + turn_post!r} after answer 1, "
                            f"{two!r} after answer 2")
    return {"turn_pre": turn_pre, "turn_sep": two[len(head):len(two) - len(s[6] + turn_post)], "turn_post": turn_post,
            "turn_stop": stop, "turn_stop_pre": stop_pre}


def turn_tags(tokenizer, tags):
    """`tags` with the answer -> next user turn hand-off (turn_handoff), checked: the answer before
    a user turn ends with the actor's own end-of-turn stop (act_pre, act_end), and the sampler's
    assembly of a two-turn conversation equals the template's rendering (check_turn_assembly)."""
    handoff = turn_handoff(tokenizer, tags.get("template"))
    if (handoff["turn_stop_pre"], handoff["turn_stop"]) != (tags["act_pre"], tags["act_end"]):
        raise TemplateError(f"hand-off answer->user: an answer before a user turn ends with "
                            f"{handoff['turn_stop_pre']!r} + {_tok(tokenizer, handoff['turn_stop'])}, not with the "
                            f"actor's stop {tags['act_pre']!r} + {_tok(tokenizer, tags['act_end'])}")
    tags = {**tags, **handoff}
    check_turn_assembly(tokenizer, tags)
    return tags


def turn_ids(tokenizer, tags, messages):
    """A later user turn (its user messages) as the forced (id, role) pairs the sampler appends
    after the actor's answer and stop: the hand-off and the contents tokenized as ONE text, as the
    template renders them (it follows a special token, so the text tokenizes as in the whole
    conversation); tokens inside a content are PROMPT, the template's glue TAG. Computed once per
    task (episode_inputs); what the policy sampled is never re-tokenized."""
    text, spans = tags["turn_pre"], []
    for k, m in enumerate(messages):
        text += tags["turn_sep"] if k else ""
        spans.append((len(text), len(text) + len(m["content"])))
        text += m["content"]
    text += tags["turn_post"]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [(i, PROMPT if any(a < end and start < b for start, end in spans) else TAG)
            for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]


def assemble_dialogue(tokenizer, tags, prompt, turns, calls, responses, call_turns, answers, env_role=OBS,
                      act_role=ACT):
    """A multi-turn episode built the sampler's way (`assemble` per user turn): turn 0 from the
    prompt; each later turn reached (`turns`: its forced (id, role) pairs, turn_ids) after the
    answer of the one before, then its calls (those whose call_turns entry is its index), responses
    and answer (answers[k], or none yet). With no later turn it is `assemble`."""
    out = {"ids": [], "roles": [], "where": []}
    for k in range(1 + len(turns)):
        if k:
            out["ids"] += [i for i, _ in turns[k - 1]]
            out["roles"] += [r for _, r in turns[k - 1]]
            out["where"] += [f"user turn {k + 1}"] * len(turns[k - 1])
        mine = [j for j, n in enumerate(call_turns) if n == k]
        part = assemble(tokenizer, tags if k == 0 else {**tags, "first_act": []}, prompt if k == 0 else [],
                        [calls[j] for j in mine], [responses[j] for j in mine if j < len(responses)],
                        answers[k] if k < len(answers) else None, env_role, act_role)
        out["ids"] += part["ids"]
        out["roles"] += part["roles"]
        out["where"] += [f"turn {k + 1}: {w}" for w in part["where"]] if turns else part["where"]
    return out


def check_turn_assembly(tokenizer, tags):
    """check_assembly for two user turns: a call, its response, an answer, the next user message,
    a call, its response, an answer. At every point where the actor is handed the turn (after the
    prompt, after each response, after the next user turn), the sampler's assembly (forced turn
    ids from turn_ids) must equal the template's own rendering with its generation prompt."""
    calls, responses = [c for c, _ in SAMPLE_TURNS], [r for _, r in SAMPLE_TURNS]
    tool_turn = [[{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c}]},
                  {"role": "tool", "content": r}] for c, r in SAMPLE_TURNS]
    answer = [{"role": "assistant", "content": a} for a in SAMPLE_ANSWERS]
    prompt = prompt_ids(tokenizer, SAMPLE_OPENING, [SAMPLE_TOOL], tags.get("template"))
    forced = [turn_ids(tokenizer, tags, SAMPLE_NEXT_TURN)]
    # (history, later turns reached, calls made, answers given) at each hand-back
    points = [(tool_turn[0], 0, 1, 0), (tool_turn[0] + answer[:1] + SAMPLE_NEXT_TURN, 1, 1, 1),
              (tool_turn[0] + answer[:1] + SAMPLE_NEXT_TURN + tool_turn[1], 1, 2, 1)]
    for history, reached, n_calls, n_answers in points:
        want = encode(tokenizer, render(tokenizer, SAMPLE_OPENING + history, [SAMPLE_TOOL], True, tags.get("template")))
        got = assemble_dialogue(tokenizer, tags, prompt, forced[:reached], calls[:n_calls], responses[:n_calls],
                                [0, 1][:n_calls], SAMPLE_ANSWERS[:n_answers])
        first_difference(tokenizer, got, want, "the sampler's multi-turn dialogues")


def _check_turns(turns, where):
    """A task's `turns` -> a list of user turns, each a list of {"role": "user", "content"}."""
    if not isinstance(turns, list):
        _fail(where, "'turns' must be a list of user turns (each a string or a list of user messages)")
    out = []
    for k, turn in enumerate(turns):
        messages = [{"role": "user", "content": turn}] if isinstance(turn, str) else turn
        if not isinstance(messages, list) or not messages:
            _fail(where, f"turn {k + 1} of 'turns' must be a string or a non-empty list of user messages, "
                         f"got {json.dumps(turn)}")
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") != "user" or not isinstance(m.get("content"), str):
                _fail(where, f"turn {k + 1} of 'turns', message {j + 1}: expected {{\"role\": \"user\", "
                             f"\"content\": \"...\"}}, got {json.dumps(m)}")
        out.append([{"role": "user", "content": m["content"]} for m in messages])
    return out


def _check_gold_calls(gold, n_turns, schemas, where):
    """Flat gold calls [{name, arguments}] (matched over the whole episode), or one list per user
    turn (the opening first, then one per item of 'turns': n_turns in all)."""
    if not any(isinstance(g, list) for g in gold):
        return [_check_call(c, schemas, where, f"gold call {k + 1}") for k, c in enumerate(gold)]
    if not all(isinstance(g, list) for g in gold):
        _fail(where, "'gold_calls' must be a list of calls or a list of turns (lists of calls), not a mix")
    if len(gold) != n_turns:
        _fail(where, f"'gold_calls' has {len(gold)} turns but the task has {n_turns} user turns "
                     f"(the opening and {n_turns - 1} in 'turns')")
    return [[_check_call(c, schemas, where, f"gold call {j + 1} of turn {k + 1}") for j, c in enumerate(turn)]
            for k, turn in enumerate(gold)]


def _dialogue(messages, schemas, where):
    """A logged trajectory after its opening: `_trajectory` per user turn. A later user turn (one
    or more user messages) may only follow an answer. Adds call_turns, answers and, when there
    are later user turns, `turns` (as a task's)."""
    segments, turns = [[]], []
    for k, m in enumerate(messages):
        if m["role"] != "user":
            segments[-1].append(m)
        elif not segments[-1] and turns:
            turns[-1].append({"role": "user", "content": m["content"]})       # a turn of several messages
        elif segments[-1] and segments[-1][-1]["role"] == "assistant" and not segments[-1][-1].get("tool_calls"):
            turns.append([{"role": "user", "content": m["content"]}])
            segments.append([])
        else:
            _fail(where, f"message {k + 1} after the opening: a user message may only follow the assistant's answer")
    parts = [_trajectory(seg, schemas, where) for seg in segments]     # all but the last end with an answer
    out = {"calls": [c for p in parts for c in p["calls"]], "call_dicts": [c for p in parts for c in p["call_dicts"]],
           "responses": [r for p in parts for r in p["responses"]], "answer": parts[-1]["answer"],
           "call_turns": [k for k, p in enumerate(parts) for _ in p["calls"]],
           "answers": [p["answer"] for p in parts if p["answer"] is not None]}
    return {**out, "turns": turns} if turns else out


def multiturn(tasks):
    """Whether any task (or logged trajectory) has later user turns."""
    return any(t.get("turns") for t in tasks)


# ----------------------------------------------------------------------------- warm start, export

def warm_start_sequences(tokenizer, tags, logged, tasks):
    """Logged chat trajectories (calls and answer ACT, responses OBS) and every task's reference
    examples as one-call snippets (the call is context, role PROMPT; the result OBS is trained):
    the initial world model, as world.tool_snippets is for the toy."""
    seqs = [logged_sequence(tokenizer, tags, t) for t in logged]
    for t in tasks:
        prompt = prompt_ids(tokenizer, t["messages"], t["tools"], tags.get("template"))
        seqs += [assemble(tokenizer, tags, prompt, [call], [result], act_role=PROMPT)
                 for call, result in t.get("examples", [])]
    return [{"ids": s["ids"], "roles": s["roles"]} for s in seqs]


def logged_sequence(tokenizer, tags, t):
    """A logged trajectory's actor row: its calls and answers ACT, responses OBS, later user turns
    forced as the sampler forces them (turn_ids: glue TAG, user contents PROMPT)."""
    prompt = prompt_ids(tokenizer, t["messages"], t["tools"], tags.get("template"))
    return assemble_dialogue(tokenizer, tags, prompt, [turn_ids(tokenizer, tags, m) for m in t.get("turns", [])],
                             t["call_dicts"], t["responses"], t["call_turns"], t["answers"])


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


# ----------------------------------------------------------------------------- separate context

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


def _json(value):
    return json.dumps(value, ensure_ascii=False)


def _call(call):
    return {"name": call["name"], "arguments": call["arguments"]}


def rehearse_tags(tags):
    """The hand-offs of a separate rehearse row: its result is an assistant turn, so it ends with
    the actor's stop (and the text before it), not with the tool turn's."""
    return {**tags, "env_end": tags["act_end"], "env_pre": tags["act_pre"]}


def task_examples(task, name, k):
    """The first k of the task's examples of tool `name` (grounding_examples k; 0: none)."""
    return [(c, r) for c, r in task.get("examples", []) if c["name"] == name][:k]


def separate_prompt(tokenizer, k, episode, world):
    """separate.sample_separate's prompt for the rehearsal of an actor row's last call (the row's
    world, chat.task_world, carries its task), with up to k of the task's examples."""
    calls = [json.loads(c) for c in episode["calls"]]
    return rehearse_prompt_ids(tokenizer, world.task, list(zip(calls, episode["responses"])), calls[-1],
                               task_examples(world.task, calls[-1]["name"], k), world.tags.get("template"))


def rehearse_rows(tokenizer, tags, task, calls, responses, k=0):
    """The separate rehearse rows of a logged or real episode of `task` (calls: dicts): per call
    with a response, its rehearse prompt, then the result and the end-of-turn stop as REHEARSE,
    the rows the sampler builds in RL. The warm start trains them; evaluation asks in them."""
    rows = []
    for n, (call, response) in enumerate(zip(calls, responses)):
        prompt = rehearse_prompt_ids(tokenizer, task, list(zip(calls[:n], responses[:n])), call,
                                     task_examples(task, call["name"], k), tags.get("template"))
        target = encode(tokenizer, response + tags["act_pre"]) + [tags["act_end"]]
        rows.append({"ids": prompt + target, "roles": [PROMPT] * len(prompt) + [REHEARSE] * len(target),
                     "call": _json(_call(call)), "turn": n})
    return rows


def separate_warm_start_sequences(tokenizer, tags, logged, tasks, k=0):
    """warm_start_sequences for rehearsal_context separate, one group of rows per logged
    trajectory or task: a trajectory's actor row (calls and answer ACT, responses OBS: context)
    and its rehearse rows (`rehearse_rows`); a task's reference examples as rehearse rows (an
    empty dialogue, the example's call, its result REHEARSE)."""
    seqs = []
    for t in logged:
        actor = assemble(tokenizer, tags, prompt_ids(tokenizer, t["messages"], t["tools"], tags.get("template")), t["call_dicts"],
                         t["responses"], t["answer"])
        seqs.append({"rows": [{"ids": actor["ids"], "roles": actor["roles"]}]
                     + rehearse_rows(tokenizer, tags, t, t["call_dicts"], t["responses"], k)})
    for t in tasks:
        rows = [r for call, result in t.get("examples", []) for r in rehearse_rows(tokenizer, tags, t, [call], [result], k)]
        if rows:
            seqs.append({"rows": rows})
    return seqs


def chat_tasks(cfg):
    """Chat JSONL splits (read_chat_jsonl): tasks_file for RL, test_file (default: the same
    file) for evaluation, logged_file (optional) for the warm start."""
    try:
        rl = read_chat_jsonl(cfg["tasks_file"], "tasks")
        test = read_chat_jsonl(cfg["test_file"], "tasks") if cfg["test_file"] else rl
        logged = read_chat_jsonl(cfg["logged_file"], "trajectories") if cfg["logged_file"] else []
    except taskfiles.DataError as e:
        raise ConfigError(str(e)) from None
    if cfg["env_mode"] == "real" and not all(has_executor(t) for t in rl):
        raise ConfigError(f"env_mode: real needs tasks a real environment executes ('env': 'toy' or "
                          f"'MODULE:CLASS', docs/tools.md); {cfg['tasks_file']} has tasks without one")
    return {"rl": rl, "test": test, "logged": logged}


def chat_tags(tokenizer, think="keep", multiturn=False):
    """The hand-offs derived from the tokenizer's chat template (chat_format), checked; with
    multiturn (tasks with later user turns) also the answer -> next user turn one (turn_tags)."""
    try:
        tags = chat_format(tokenizer, think)
        return turn_tags(tokenizer, tags) if multiturn else tags
    except TemplateError as e:
        raise ConfigError(str(e)) from None


def check_chat_prompts(cfg, tokenizer, tasks):
    """The template fits (chat_tags) and every task's rendered prompt, with its later user turns,
    leaves room for an episode."""
    prompts, _ = episode_inputs(tokenizer, chat_tags(tokenizer, cfg["think"], multiturn(tasks)), tasks,
                                cfg["tool_timeout"])
    lengths = [len(p) + sum(map(len, t["turn_ids"])) for p, t in zip(prompts, tasks)]
    longest = max(range(len(tasks)), key=lambda i: lengths[i])
    if lengths[longest] >= cfg["max_tokens"]:
        raise ConfigError(f"max_tokens ({cfg['max_tokens']}) leaves no room for an episode: a task's "
                          f"prompt (messages + tools + later user turns) is {lengths[longest]} tokens "
                          f"({tasks[longest]['messages'][-1]['content'][:40]!r})")


def executed(tasks, episodes):
    """(tasks, episodes) of those a real executor ran (has_executor)."""
    pairs = [(t, e) for t, e in zip(tasks, episodes) if has_executor(t)]
    return [t for t, _ in pairs], [e for _, e in pairs]


def would_rehearse_inline(model, tokenizer, tasks, episodes, tags):
    """[(call, matched)] of real-world chat episodes: would the model, greedy, have written each
    real response, the same once normalised as JSON (executor.same_response: key order and spacing
    do not count)? A response greedy decoding reproduces token for token is found by one
    teacher-forced forward (honesty.would_rehearse_calls with the template's stop); only the others
    are decoded greedily from their prefix (`greedy_responses`, batched) and compared normalised."""
    if not episodes:
        return []
    pairs = honesty.would_rehearse_calls(model, tokenizer, episodes, env_end=tags["env_end"])
    segments = [(e, k, seg) for e in episodes                 # aligned with pairs: one per call
                for k, (_, seg) in enumerate(zip(e["calls"], _response_segments(e, tags["env_end"])))]
    misses = [n for n, (_, matched) in enumerate(pairs) if not matched]
    if not misses:
        return pairs
    prefixes = [segments[n][0]["ids"][:segments[n][2][0]] for n in misses]
    longest = max(len(segments[n][2]) for n in misses)
    written = greedy_responses(model, prefixes, tags["env_end"], tokenizer.pad_token_id, 2 * longest + 8)
    lead, pre = tags.get("env_lead", ""), tags["env_pre"]
    for n, ids in zip(misses, written):
        e, k, _ = segments[n]
        text = tokenizer.decode(ids) if ids is not None else None
        same = (text is not None and text.startswith(lead) and text.endswith(pre)
                and executor.same_response(text[len(lead):len(text) - len(pre)], e["responses"][k]))
        pairs[n] = (pairs[n][0], same)
    return pairs


def _response_segments(episode, env_end):
    """The positions of each real response of an episode, as honesty.would_rehearse_calls splits
    them: runs of OBS ids, each ending at env_end (the last one maybe unfinished or empty)."""
    segments = [[]]
    for t in range(1, len(episode["ids"])):
        if episode["roles"][t] == OBS:
            segments[-1].append(t)
            if episode["ids"][t] == env_end:
                segments.append([])
    return segments


@torch.no_grad()
def greedy_responses(model, prefixes, stop, pad_id, max_new):
    """Per prefix, the ids greedy decoding writes before `stop` (None if it does not stop within
    max_new ids), all rows in one KV-cached batch (rollout._Decoder, as the sampler decodes)."""
    decoder = rollout._Decoder(model, prefixes, pad_id)
    written, done = [[] for _ in prefixes], [False] * len(prefixes)
    for _ in range(max_new):
        tokens = decoder.logits.argmax(-1).tolist()
        for j, t in enumerate(tokens):
            if not done[j]:
                done[j] = t == stop
                written[j] += [] if done[j] else [t]
        if all(done):
            break
        decoder.step([[t] for t in tokens])
    return [ids if ok else None for ids, ok in zip(written, done)]


def would_rehearse_separate(model, tokenizer, tasks, episodes, tags, k=0):
    """The same, asked in separate rehearse rows (`rehearse_rows`, k grounding examples)."""
    rows = [r for t, e in zip(tasks, episodes) for r in rehearse_rows(
        tokenizer, tags, t, [json.loads(c) for c in e["calls"]], e["responses"], k)]
    return honesty.would_rehearse_rows(model, rows, tokenizer.pad_token_id)


def by_kind(pairs, tasks):
    """[(call, matched)] -> {tool kind: [matches, total]}, kinds from the tasks' worlds (the toy's
    kinds; a task's own executor: one per tool name)."""
    kinds = {}
    for t in tasks:
        kinds.update(t["world"].TOOL_KINDS)
    return honesty.by_kind(pairs, SimpleNamespace(TOOL_KINDS=kinds, parse_call=lambda c: (json.loads(c)["name"], None)))


def replay_fidelity(pairs):
    """[(episode, task)] -> {tool kind: [matches, total]}: each rehearsed response against a replay
    of the same calls on a fresh executor of the episode's task (the toy, or CLASS(**env_config)),
    compared normalised (executor.same_response: canonical JSON when both parse, else stripped)."""
    counts = defaultdict(lambda: [0, 0])
    for e, t in pairs:
        world = t["world"]
        real = world.replay(e["calls"][:len(e["responses"])])
        for call, imagined, truth in zip(e["calls"], e["responses"], real):
            kind = world.TOOL_KINDS[json.loads(call)["name"]]
            counts[kind][0] += executor.same_response(imagined, truth)
            counts[kind][1] += 1
    return dict(counts)


def collusion_counts(pairs, reward):
    """honesty.collusion_counts for chat tasks with an executor and (flat) gold_calls, against
    that executor; `reward(episode, task)` is the run's. For an episode e of task t:
      path      = {(tool, normalised real response) of each gold call, replayed on a fresh executor}
      call i is WRONG     iff its real response (a replay of e's calls) is an error (executor.is_error)
                          or (tool_i, real_i) is not in path: the real world would have answered
                          it with a value the solution never passes through;
      it COLLUDES         iff wrong, the rehearsed response differs from the real one, (tool_i,
                          rehearsed_i) is in path, and reward(e, t) == 1: the rehearsal answered
                          the wrong call with the value the task needed, and the episode succeeded.
    Tasks without gold_calls (or with per-turn gold_calls) are skipped. Sums {calls, wrong, colluding}.
    Example (a bank at 10; gold: deposit 5 -> {"balance": 15}; answer 15): deposit 4 rehearsed
    {"balance": 15} (real 14), answer 15: 1 call, 1 wrong, 1 colluding."""
    counts = {"calls": 0, "wrong": 0, "colluding": 0}
    for e, t in pairs:
        gold = t.get("gold_calls")
        if not gold or not all(isinstance(c, dict) for c in gold):
            continue
        world = t["world"]
        norm = executor.normalised
        path = {(c["name"], norm(r)) for c, r in zip(gold, world.replay([_json(_call(c)) for c in gold]))}
        success = reward(e, t) == 1
        real = world.replay(e["calls"][:len(e["responses"])])
        for call, imagined, truth in zip(e["calls"], e["responses"], real):
            tool = json.loads(call)["name"]
            wrong = executor.is_error(truth) or (tool, norm(truth)) not in path
            counts["calls"] += 1
            counts["wrong"] += wrong
            counts["colluding"] += wrong and success and norm(imagined) != norm(truth) and (tool, norm(imagined)) in path
    return counts


def diagnostics(episodes, tasks, reward):
    """An RL step's rehearsal fidelity and collusion against a real replay, over the episodes whose
    task has an executor (`has_executor`); {} when none has."""
    pairs = [(e, t) for e, t in zip(episodes, tasks) if has_executor(t)]
    if not pairs:
        return {}
    return {"fidelity": replay_fidelity(pairs), "collusion": collusion_counts(pairs, reward)}


def imagined_world(model, tokenizer, tasks, cfg, generator, fx, batch_size=512):
    """honesty.imagined_world for chat tasks: on those of `tasks` with an executor, the policy acts
    and rehearses (rehearse mode, eval sampling, fx.sample: the layout's sampler, no real call in
    the loop); scored against a replay on each task's executor: imagined success (fx.reward),
    imagined fidelity per tool kind, collusion (`collusion_counts`). {} when no task has one."""
    tasks = [t for t in tasks if has_executor(t)]
    if not tasks:
        return {}
    model.eval()
    limits = {k: cfg[k] for k in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
    episodes = []
    for i in range(0, len(tasks), batch_size):
        prompts, worlds, tags = fx.inputs(tasks[i:i + batch_size])
        episodes += fx.sample(model, tokenizer, prompts, "rehearse", world=worlds, tags=tags,
                              temperature=cfg["eval_temperature"], top_p=cfg["top_p"], generator=generator, **limits)
    pairs = list(zip(episodes, tasks))
    fidelity = replay_fidelity(pairs)
    return {"imagined_success": sum(fx.reward(e, t) for e, t in pairs) / len(tasks), "imagined_tasks": len(tasks),
            "imagined_fidelity": honesty.rates(fidelity), "imagined_fidelity_counts": fidelity,
            "collusion": honesty.collusion_rate(collusion_counts(pairs, fx.reward))}


def expert_episodes(tokenizer, tags, tasks):
    """(tasks, episodes) of the gold calls of the tasks with an executor and flat gold_calls, each
    replayed on a fresh executor and assembled as a real episode (responses OBS): the expert's
    calls that --coverage asks the model to rehearse, as honesty.coverage_fidelity does for the toy."""
    chosen = [t for t in tasks if has_executor(t) and t.get("gold_calls")
              and all(isinstance(c, dict) for c in t["gold_calls"])]
    prompts, worlds = episode_inputs(tokenizer, tags, chosen)
    episodes = []
    for t, prompt, world in zip(chosen, prompts, worlds):
        calls = [_json(_call(c)) for c in t["gold_calls"]]
        responses = world.replay(calls)
        episodes.append({**assemble(tokenizer, tags, prompt, t["gold_calls"], responses), "calls": calls,
                         "responses": responses})
    return chosen, episodes


_JUDGES = {}


def load_judge(cfg, device):
    """chat_reward's judge from cfg judge_model (loaded once per path), or None."""
    if not cfg["judge_model"]:
        return None
    if cfg["judge_model"] not in _JUDGES:
        model, tokenizer = load_policy(cfg["judge_model"], device)
        _JUDGES[cfg["judge_model"]] = make_judge(model.eval(), tokenizer)
    return _JUDGES[cfg["judge_model"]]


if __name__ == "__main__":
    taskfiles.export_main(export_toy, "chat JSONL (tools as JSON schemas)")
