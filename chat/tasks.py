"""Chat task files: one JSONL line checked field by field, before anything trains (`format: chat`).

One task per line (`read_chat_jsonl`, `check_task`): opening `messages`, `tools` (OpenAI
function schemas), success criteria `answer` / `gold_calls` / `checklist` / `check`, optional
`call_order`, `turns` (later user turns, chat/multiturn.py; `gold_calls` may then be given per user
turn), `examples` (per tool, reference {arguments, result} pairs) and `env`: "toy" (the toy world
of world.py executes the calls) or "MODULE:CLASS" / "path/to/file.py:CLASS" with `env_config`
(the task's own executor, chat/executor.py: per episode CLASS(**env_config), a call runs the method
of its name; docs/tools.md). Logged trajectories (logged_file) are the same with the whole
conversation in `messages`, read into calls, responses and answers per user turn (`_dialogue`).
The first bad line raises DataError naming the line and the field.
A tool call's arguments are checked against the tool's JSON schema (`check_value`) here, in
every gold call and example, and in every call the actor writes (chat.read_act); each tool's
schema itself is checked at load (`check_schema`: its shapes, each type a JSON Schema type, every
required name one of the properties, every enum value of the declared type).

Simplified: the JSON Schema check is a hand-written subset (type, enum, required, properties,
additionalProperties, items: what OpenAI function schemas use); other keywords (anyOf, format,
...) are neither checked nor enforced. One tool call per assistant turn in a logged trajectory.
"""
import json
import os

from chat import executor
from machinery import taskfiles
from machinery.config import ConfigError


class DataError(taskfiles.DataError):
    """A malformed line in a chat task file (same style as taskfiles.read_jsonl's errors)."""


# ----------------------------------------------------------------------------- tool schemas

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
    if "enum" in schema and not any(_same_json(value, e) for e in schema["enum"]):
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
    """The first way `schema` is not a JSON schema check_value can read, or cannot mean what it
    says, as a message; None if fine. Recursive over properties / items / additionalProperties.
    Shapes (properties an object, required a list of names, ...) and meaning: each type one of
    the JSON Schema types (TYPES), every required name one of the properties (else no call may
    leave it out, whatever its type), every enum value one its own schema accepts (else no call
    can give it). Keywords check_value does not read (description, anyOf, $defs, format, ...) are
    not checked and not enforced."""
    if not isinstance(schema, dict):
        return f"{path} must be a JSON schema object, got {json.dumps(schema)}"
    kinds = schema.get("type", [])
    if not isinstance(kinds, str) and not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
        return f"{path}.type must be a type name or a list of them, got {json.dumps(kinds)}"
    if kinds == [] and "type" in schema:
        return f"{path}.type is an empty list: name at least one type"
    unknown = [k for k in ([kinds] if isinstance(kinds, str) else kinds) if k not in TYPES]
    if unknown:
        return f"{path}.type {json.dumps(unknown[0])} is not a JSON Schema type (one of {', '.join(TYPES)})"
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        return f"{path}.enum must be a non-empty list, got {json.dumps(schema['enum'])}"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        return f"{path}.required must be a list of property names, got {json.dumps(required)}"
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        return f"{path}.properties must be an object of property schemas, got {json.dumps(props)}"
    missing = [k for k in required if k not in props]
    if missing:
        return f"{path}.required names {json.dumps(missing[0])}, which is not one of its properties {list(props)}"
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
        problem = check_schema(schema["items"], f"{path}.items")
        if problem:
            return problem
    rest = {key: value for key, value in schema.items() if key != "enum"}    # its shapes checked above
    for k, value in enumerate(schema.get("enum", [])):
        problem = check_value(_integral(value), rest, f"{path}.enum[{k}]")
        if problem:
            return f"{problem}: no call can give this enum value"
    return None


def _integral(value):
    """`value` with every integral float made an int: an enum's 3.0 is met by a call's 3, an integer."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def _same_json(a, b):
    """JSON equality (an enum's test): numbers by value (1 == 1.0), but true is not 1 and false
    not 0, which Python's == (and `in`) would take as equal; lists in order, objects by key."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same_json, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same_json(a[k], b[k]) for k in a)
    return a == b


def _is_type(value, kind):
    if isinstance(value, bool) and kind != "boolean":
        return False                   # JSON true is not 1
    return isinstance(value, TYPES[kind])


def tool_schemas(tools):
    """{name: parameters schema} of a task's tools (OpenAI form, normalised at load)."""
    return {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}


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
    task["where"] = where                 # "FILE line N": what a failing check or executor names
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
        missing = [n for n in schemas if n.startswith("_") or not callable(getattr(instance, n, None))]
    except executor.USER_ERRORS as e:     # the user's constructor (or a property): its error, in one line
        _fail(where, f"env {spec!r}: {spec.rpartition(':')[2]}(**env_config) raised {executor.error_text(e)}")
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


# ----------------------------------------------------------------------------- multi-turn fields

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
