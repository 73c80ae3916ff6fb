"""Chat templates: the act format derived from a model's own chat template, and its strict parser.

Part of the chat format (chat/format.py): the paper's actor writes JSON tool calls inside assistant
turns, but the text around a call is the template's, and families differ (Qwen2.5/Hermes
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, a Qwen2-style template that puts a
newline before it, Llama 3.1/3.2's bare `{"name": ..., "parameters": ...}`, Mistral's
`[TOOL_CALLS] [{...}, {...}]`). Nothing here is written per family: `derive` renders a
conversation whose contents are sentinels (a tool call named §N1§ with arguments
{"§K1§": "§V1§"}, a tool response §T1§, an answer §ANS§, reasoning §R1§) and cuts out

    first      what the generation prompt adds (the sampler forces it)
    call       what the actor writes around the name and the arguments: item_pre, mid,
               item_post, and for several calls in one turn open, sep, close
    answer     what it writes before an answer (answer_pre: Mistral's " ")
    after      the call's end: item text, then the actor's stop, then the tool turn's opening
    think      (Qwen3-style) the think wrapper the actor writes, whether earlier turns keep
               it, or (think: disable) the empty block the template's enable_thinking switch forces

chat.chat_format turns those texts into the sampler's ids and checks the whole token by token.
`read_calls` parses an actor's text back: the wrapper words in order (any whitespace between
them), a JSON object holding exactly the template's name and arguments keys (any key order),
several calls where the template renders them. Simplified: one stop token ends every actor
turn (call or answer); the template's JSON must be json.dumps' default form; a call object with
further keys (Mistral's 9-character ids) does not fit.
"""
import json
import re

SENTINEL = "\u00a7{}\u00a7"                    # rendered content markers, found by string search

# The Qwen/Hermes form: what format_call and read_act use when no template was derived.
HERMES = {"open": "", "close": "", "sep": "\n", "item_pre": '<tool_call>\n{"name": "', "mid": '", "arguments": ',
          "item_post": "}\n</tool_call>", "wrap_pre": "<tool_call>\n", "wrap_post": "\n</tool_call>",
          "name_key": "name", "args_key": "arguments", "markers": ["<tool_call>", "</tool_call>"],
          "several": True, "answer_pre": "", "think": ["<think>", "</think>"], "env_markers": ["<tool_response>"]}


class TemplateError(Exception):
    """The tokenizer's chat template cannot host the sampler's hand-offs: says where."""


def render(tokenizer, messages, tools, generation_prompt=False, template=None):
    """The template's text; `template`: extra template variables (enable_thinking)."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt, **(template or {}))
    except Exception as e:          # jinja errors, missing template: all say the same thing
        raise TemplateError(f"the chat template cannot render a tool conversation: {e}") from None


def format_call(call, fmt=None):
    """{"name", "arguments"} -> the action text the actor writes, in the template's form."""
    return format_calls([call], fmt)


def format_calls(calls, fmt=None):
    fmt = fmt or HERMES
    items = [fmt["item_pre"] + c["name"] + fmt["mid"] + json.dumps(c["arguments"], ensure_ascii=False)
             + fmt["item_post"] for c in calls]
    return fmt["open"] + fmt["sep"].join(items) + fmt["close"]


# ----------------------------------------------------------------------------- derivation

def _call_message(k, reasoning=None):
    calls = k if isinstance(k, list) else [k]
    m = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": _s(f"N{j}"), "arguments": {_s(f"K{j}"): _s(f"V{j}")}}} for j in calls]}
    if reasoning:
        m["reasoning_content"] = reasoning
    return m


def _s(key):
    return SENTINEL.format(key)


def _args(j):
    return json.dumps({_s(f"K{j}"): _s(f"V{j}")}, ensure_ascii=False)


def _cut(text, start, end, what):
    """The text between the strings `start` and `end` (from the start or to the end if "")."""
    i = text.find(start) if start else 0
    j = text.find(end, i + len(start)) if end else len(text)
    if i < 0 or j < 0:
        missing = start if i < 0 else end
        raise TemplateError(f"{what}: the template does not render the content {missing!r} "
                            f"(does it support role 'tool' messages, tool_calls and a tools list?)")
    return text[i + len(start):j]


def _first_special(tokenizer, text, what):
    """(text before the first special token, that token's text, the rest)."""
    hits = [(text.find(t), t) for t in specials(tokenizer) if t in text]
    if not hits:
        raise TemplateError(f"{what} ({text!r}) holds no special token to stop on")
    at, token = min(hits, key=lambda h: (h[0], -len(h[1])))
    return text[:at], token, text[at + len(token):]


def specials(tokenizer):
    return [str(t) for t in tokenizer.added_tokens_decoder.values() if str(t)]


def _common_suffix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n:]


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def derive(tokenizer, think="keep", tools=None):
    """The act format and the hand-off texts of this template (module docstring). think: keep
    (the actor's think text stays in the sequence) or disable (the template's enable_thinking false).
    Returns a dict of texts: the act format (format_call/read_calls read it) and first, act_env
    (after the actor's stop, the tool turn's opening), env_act (from a tool response to the next
    actor turn), end (after the final stop), stop, act_pre, think_block, think_history."""
    kw = {"enable_thinking": False} if think == "disable" else {}
    opening = [{"role": "system", "content": _s("S")}, {"role": "user", "content": _s("U")}]

    def tool(messages, generation_prompt=False):
        return render(tokenizer, messages, tools, generation_prompt, kw)

    prompt, first = tool(opening), tool(opening, True)
    if tools and prompt == render(tokenizer, opening, None, template=kw):
        raise TemplateError("the chat template ignores `tools` (a tool list changes nothing it renders): set the "
                            "config key chat_template to a tool-aware Jinja file (chat/chatml_tools.jinja for "
                            "ChatML models such as SmolLM2)")
    if not first.startswith(prompt):
        raise TemplateError("hand-off prompt->act: the generation prompt does not extend the rendered opening")
    first = first[len(prompt):]
    block = ""
    if think == "disable":
        on = render(tokenizer, opening, tools, True, {"enable_thinking": True})[len(prompt):]
        if on == first or not first.startswith(on):
            raise TemplateError("think: disable needs a template whose enable_thinking switch adds an empty think "
                                f"block to the generation prompt; this one writes {first!r} either way")
        block = first[len(on):]
    # the think wrapper, if the template renders reasoning (keep: the actor writes it)
    with_r = tool(opening + [{"role": "assistant", "content": _s("ANS"), "reasoning_content": _s("R")}])
    wrapper = None
    if think == "keep" and _s("R") in with_r:
        inside = _cut(with_r, prompt + first, _s("ANS"), "the think block")
        wrapper = [inside[:inside.find(_s("R"))], inside[inside.find(_s("R")) + len(_s("R")):]]
    # the answer: what the actor writes before it, its stop, what follows
    answer = tool(opening + [{"role": "assistant", "content": _s("ANS"),
                              **({"reasoning_content": _s("R")} if wrapper else {})}])
    if not answer.startswith(prompt + first):
        raise TemplateError(f"hand-off prompt->act: an answer turn does not start with the generation prompt {first!r}")
    turn = answer[len(prompt + first):]
    if wrapper:
        turn = turn[len(wrapper[0] + _s("R") + wrapper[1]):]
    answer_pre = _cut(turn, "", _s("ANS"), "the answer")
    act_pre, stop, end = _first_special(tokenizer, _cut(turn, _s("ANS"), "", "the answer"), "hand-off end")
    # one call, then its tool response: the call's text, the actor's stop, the tool turn's opening
    turns = []
    for k in (1, 2):
        history = opening + [m for j in range(1, k + 1) for m in (_call_message(j), {"role": "tool", "content": _s(f"T{j}")})]
        text = tool(history)[len(prompt):]
        turns.append([_cut(text, _s(f"T{k - 1}") if k > 1 else "", _s(f"N{k}"), "the call"),
                      _cut(text, _s(f"N{k}"), _args(k), "the call"),
                      _cut(text, _args(k), _s(f"T{k}"), "hand-off act->env")])
        turns[-1].append(_cut(tool(history, True), _s(f"T{k}"), "", "hand-off env->act"))
    (lead, mid, after, env_act), second = turns[0], turns[1]
    env_pre, env_stop, act = _first_special(tokenizer, env_act, "hand-off env->act")
    for name, one, two in (("act->env", after, second[2]), ("env->act", env_act, second[3]), ("the call", mid, second[1])):
        if one != two:
            raise TemplateError(f"hand-off {name} depends on the turn: {one!r} after turn 1, {two!r} after turn 2")
    if lead.startswith(first):
        opener = first
    elif block and lead.startswith(first[:len(first) - len(block)]):
        opener = first[:len(first) - len(block)]       # the forced empty think block is not re-rendered
    else:
        raise TemplateError(f"hand-off prompt->act: the generation prompt {first!r} is not how the template "
                            f"opens an assistant turn that calls a tool ({lead!r})")
    item_pre = lead[len(opener):]
    if act_pre + stop not in after:
        raise TemplateError(f"a tool call turn ({after!r}) does not end with the answer's stop {stop!r}: the "
                            f"sampler ends every actor turn on one token")
    item_post, act_env = after.split(act_pre + stop, 1)
    # a space ending the tool turn's opening after text (Mistral's '{"content": ') belongs to the
    # response's first word in a byte-level BPE ('Ġ{'): the response is written with it (env_lead)
    body = act_env.rstrip(" ")
    env_lead = act_env[len(body):] if body and not any(body.endswith(t) for t in specials(tokenizer)) else ""
    act_env = act_env[:len(act_env) - len(env_lead)]
    history = ("kept" if opener == first else "dropped") if block else None
    if wrapper:
        shown = tool(opening + [_call_message(1, _s("R1")), {"role": "tool", "content": _s("T1")}], True)
        history = "kept" if _s("R1") in shown else "dropped"
    fmt = {"item_pre": item_pre, "mid": mid, "item_post": item_post, "answer_pre": answer_pre,
           "think": wrapper or HERMES["think"], "reasons": wrapper is not None, "first": first, "act_env": act_env,
           "act": act, "env_lead": env_lead, "env_pre": env_pre, "env_stop": env_stop, "end": end, "stop": stop, "act_pre": act_pre,
           "think_block": block, "think_history": history,
           "env_markers": [t for t in specials(tokenizer) if t in act_env],
           "template": kw, **_several(tool, opening, prompt, opener, item_pre, item_post)}
    fmt.update(_json_parts(tokenizer, fmt))
    return fmt


def _several(tool, opening, prompt, opener, item_pre, item_post):
    """open, sep, close of several calls in one turn (open/close empty and several False where
    the template renders only one): from a turn calling §N1§ and §N2§."""
    one = {"open": "", "sep": "", "close": "", "several": False}
    try:
        text = tool(opening + [_call_message([1, 2]), {"role": "tool", "content": _s("T1")},
                               {"role": "tool", "content": _s("T2")}])[len(prompt) + len(opener):]
    except TemplateError:
        return one
    between = _cut(text, _args(1), _s("N2"), "two calls") if _s("N2") in text else None
    if between is None or not text.startswith(item_pre):
        return one
    pre, post = _common_suffix(item_pre, between), _common_prefix(item_post, between)
    if len(pre) + len(post) > len(between) or not text[text.find(_args(2)) + len(_args(2)):].startswith(item_post):
        return one
    return {"open": item_pre[:len(item_pre) - len(pre)], "close": item_post[len(post):],
            "sep": between[len(post):len(between) - len(pre)], "several": True,
            "item_pre": pre, "item_post": post}


def _json_parts(tokenizer, fmt):
    """Where the call's JSON object starts and ends inside an item: the wrapper text around it and
    the keys of the name and the arguments."""
    item = fmt["item_pre"] + _s("N1") + fmt["mid"] + _args(1) + fmt["item_post"]
    for b in [i for i, ch in enumerate(fmt["item_pre"]) if ch == "{"][::-1]:
        try:
            obj, end = json.JSONDecoder().raw_decode(item, b)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or len(obj) != 2:
            continue
        name = [k for k, v in obj.items() if v == _s("N1")]
        args = [k for k, v in obj.items() if v == json.loads(_args(1))]
        if name and args:
            wrap = fmt["open"] + fmt["item_pre"][:b] + item[end:] + fmt["close"]
            return {"wrap_pre": fmt["item_pre"][:b], "wrap_post": item[end:], "name_key": name[0],
                    "args_key": args[0], "markers": [t for t in specials(tokenizer) if t in wrap]}
    raise TemplateError(f"the template's tool call ({item!r}) is not a JSON object holding just the name and "
                        f"the arguments")


# ----------------------------------------------------------------------------- parsing

def _words(text):
    """A regex for `text`'s words in order, any whitespace around and between them."""
    return r"\s*" + "".join(re.escape(w) + r"\s*" for w in text.split())


def is_call(text, fmt=None):
    """Does this actor text try to call a tool? It holds the call wrapper's first word (Hermes'
    <tool_call>, Mistral's [TOOL_CALLS]) or another marker token of the wrapper, whether or not the
    vocabulary has that word as a special token (SmolLM2's has no <tool_call>: there the same
    wrapper is ordinary text); for a template with no wrapper (Llama's bare object), it starts with
    '{'. A call that breaks off or has text around it is still a call (read_calls says what is wrong)."""
    fmt = fmt or HERMES
    opening = (fmt["open"] + fmt["wrap_pre"]).split()
    if any(m in text for m in fmt["markers"] + opening[:1]):
        return True
    return not opening and text.lstrip().startswith("{")


def read_calls(text, fmt=None):
    """Actor text in the template's call form -> (the parsed JSON objects, None), or (None, what
    is wrong) where it is not exactly that form: wrappers, JSON objects, separators, nothing else."""
    fmt = fmt or HERMES
    form = f"the template's call form {format_call({'name': '...', 'arguments': {}}, fmt)!r} and nothing else"
    m = re.match(_words(fmt["open"]), text)
    if m is None:
        return None, f"expected {form}"
    pos, calls = m.end(), []
    while True:
        m = re.compile(_words(fmt["wrap_pre"])).match(text, pos)
        if m is None or not text.startswith("{", m.end()):
            return None, f"expected {form}"
        try:
            call, pos = json.JSONDecoder().raw_decode(text, m.end())
        except json.JSONDecodeError as e:
            return None, f"not valid JSON: {e.msg}"
        calls.append(call)
        m = re.compile(_words(fmt["wrap_post"])).match(text, pos)
        if m is None:
            return None, f"expected {form}"
        if re.compile(_words(fmt["close"]) + r"\Z").match(text, m.end()):
            return calls, None
        sep = re.compile(_words(fmt["sep"]) + _words(fmt["wrap_pre"]) + r"\{").match(text, m.end())
        if not fmt["several"] or sep is None:
            return None, f"expected {form}"
        pos = re.compile(_words(fmt["sep"])).match(text, m.end()).end()
