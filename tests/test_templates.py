"""Template families (tests/families.py: Hermes/Qwen2.5, Qwen2-style leading newline, Llama 3.1/3.2,
Mistral, Qwen3 with think kept or switched off): the act format and hand-offs derived from each
template (templates.derive, chat.chat_format) and checked, strict parsing in each call form, the
roles of one sampled episode token by token, and train.py (warm start, two RL steps, evaluation)
end to end on a tiny random model with each family's tokenizer."""
import itertools
import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

from chat import format as chat
from chat import chat_reward
from chat import setup as chat_setup
from machinery import config
import train
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, loss_mask
from families import family_tokenizer
from helpers import (POSITION_INIT, assert_ratio_one, needs, scripted_rows, tiny_qwen, CHAT_SPECIALS, CHAT_TEMPLATE, chat_tokenizer)
from rollout import sample_episodes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"hermes": ("hermes", "keep"), "qwen2_newline": ("qwen2_newline", "keep"), "llama3": ("llama3", "keep"),
         "mistral": ("mistral", "keep"), "qwen3_keep": ("qwen3", "keep"), "qwen3_disable": ("qwen3", "disable"),
         "chatml_text": ("chatml_text", "keep")}
TOKS = {}
PAY = {"type": "function", "function": {"name": "pay", "parameters": {
    "type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}}}
SCHEMAS = {"pay": PAY["function"]["parameters"]}
PAY3 = {"name": "pay", "arguments": {"amount": 3}}


def setup(case):
    name, think = CASES[case]
    if name not in TOKS:
        TOKS[name] = family_tokenizer(name)
    return TOKS[name], chat.chat_format(TOKS[name], think)


def published_qwen3():
    """Qwen3's published chat template, as bfcl-eval (PyPI) ships it in its Qwen handler's
    docstring, on the qwen3 fixture's tokenizer (helpers.needs: skipped without bfcl-eval, a
    failure under CI)."""
    import textwrap
    bfcl_eval = needs("bfcl_eval")
    src = open(os.path.join(os.path.dirname(bfcl_eval.__file__), "model_handler", "local_inference", "qwen.py")).read()
    tok = family_tokenizer("qwen3")
    tok.chat_template = textwrap.dedent(src.split('"chat_template":', 1)[1].split('"""', 1)[0]).strip()
    return tok


# the JSON of {"amount": 3} and the call's name, as every family's BPE splits them
CALL = ['{"', 'name', '":', 'Ġ"', 'pay', '",', 'Ġ"', 'arguments', '":', 'Ġ{"', 'amount', '":', 'Ġ', '3', '}}']
IM_TOOL = ['Ċ', '<|im_start|>', 'user', 'Ċ', '<tool_response>', 'Ċ']
IM_BACK = ['<|im_end|>', 'Ċ', '<|im_start|>', 'assistant', 'Ċ']
BLOCK = ['<think>', 'Ċ', 'Ċ', '</think>', 'Ċ', 'Ċ']
P, T, A, R = PROMPT, TAG, ACT, REHEARSE
# pay 3 -> "6" -> answer 6: the (role, tokens) runs after the prompt, from each family's
# documented format (qwen3_keep writes the think texts "pay 3" and "done")
EPISODES = {
    "hermes": [(T, ['<|im_start|>', 'assistant', 'Ċ']), (A, ['<tool_call>', 'Ċ'] + CALL + ['Ċ', '</tool_call>', '<|im_end|>']),
               (T, IM_TOOL), (R, ['6', 'Ċ', '</tool_response>']), (T, IM_BACK), (A, ['6', '<|im_end|>'])],
    "qwen2_newline": [(T, ['<|im_start|>', 'assistant', 'Ċ']),
                      (A, ['Ċ', '<tool_call>', 'Ċ'] + CALL + ['Ċ', '</tool_call>', '<|im_end|>']),
                      (T, IM_TOOL), (R, ['6', 'Ċ', '</tool_response>']), (T, IM_BACK), (A, ['6', '<|im_end|>'])],
    "llama3": [(T, ['<|start_header_id|>', 'assistant', '<|end_header_id|>', 'Ċ', 'Ċ']),
               (A, [c if c != 'arguments' else 'parameters' for c in CALL] + ['<|eot_id|>']),
               (T, ['<|start_header_id|>', 'i', 'p', 'y', 't', 'h', 'on', '<|end_header_id|>', 'Ċ', 'Ċ']),
               (R, ['6', '<|eot_id|>']),
               (T, ['<|start_header_id|>', 'assistant', '<|end_header_id|>', 'Ċ', 'Ċ']), (A, ['6', '<|eot_id|>'])],
    "mistral": [(A, ['[TOOL_CALLS]', 'Ġ', '['] + CALL + [']', '</s>']),
                (T, ['[TOOL_RESULTS]', 'Ġ{"', 'co', 'nt', 'e', 'nt', '":']), (R, ['Ġ', '6', '}', '[/TOOL_RESULTS]']),
                (A, ['Ġ', '6', '</s>'])],
    "qwen3_keep": [(T, ['<|im_start|>', 'assistant', 'Ċ']),
                   (A, ['<think>', 'Ċ', 'pay', 'Ġ', '3', 'Ċ', '</think>', 'Ċ', 'Ċ', '<tool_call>', 'Ċ'] + CALL
                    + ['Ċ', '</tool_call>', '<|im_end|>']),
                   (T, IM_TOOL), (R, ['6', 'Ċ', '</tool_response>']), (T, IM_BACK),
                   (A, ['<think>', 'Ċ', 'd', 'on', 'e', 'Ċ', '</think>', 'Ċ', 'Ċ', '6', '<|im_end|>'])],
    "qwen3_disable": [(T, ['<|im_start|>', 'assistant', 'Ċ'] + BLOCK),
                      (A, ['<tool_call>', 'Ċ'] + CALL + ['Ċ', '</tool_call>', '<|im_end|>']),
                      (T, IM_TOOL), (R, ['6', 'Ċ', '</tool_response>']), (T, IM_BACK + BLOCK), (A, ['6', '<|im_end|>'])],
}
# chatml_text: the same wrappers as hermes, spelled in ordinary tokens
CALL_OPEN, CALL_CLOSE = ['<', 't', 'oo', 'l', '_', 'call', '>'], ['<', '/', 't', 'oo', 'l', '_', 'call', '>']
RESPONSE_OPEN = ['<', 't', 'oo', 'l', '_', 'r', 'es', 'p', 'on', 'se', '>']
EPISODES["chatml_text"] = [
    (T, ['<|im_start|>', 'assistant', 'Ċ']), (A, CALL_OPEN + ['Ċ'] + CALL + ['Ċ'] + CALL_CLOSE + ['<|im_end|>']),
    (T, ['Ċ', '<|im_start|>', 'user', 'Ċ'] + RESPONSE_OPEN + ['Ċ']),
    (R, ['6', 'Ċ', '<', '/'] + RESPONSE_OPEN[1:] + ['<|im_end|>']),    # the first special token after the
    (T, IM_BACK[1:]), (A, ['6', '<|im_end|>'])]                          # response is its stop: <|im_end|>
THINKS = {"qwen3_keep": ["pay 3", "done"]}


class Script(torch.nn.Module):
    """A fake causal LM writing `script` from the first position after the prompt (the sampler
    forces the hand-offs itself)."""

    def __init__(self, vocab, script):
        super().__init__()
        self.config = Qwen2Config(vocab_size=vocab, hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.script, self.vocab = script, vocab

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        B, L = input_ids.shape
        _, k = scripted_rows(input_ids, attention_mask, cache, lambda b: 0)   # ids fed after the prompt
        logits = torch.full((B, L, self.vocab), -1e4)
        for b in range(B):
            logits[b, -1, self.script[min(k[b], len(self.script) - 1)]] = 0.0
        return SimpleNamespace(logits=logits)


def pay_task():
    return {"messages": [{"role": "user", "content": "pay 3"}], "tools": [PAY], "answer": "6",
            "gold_calls": [PAY3], "env": "toy"}


@pytest.mark.parametrize("case", CASES)
def test_roles_of_one_episode_token_by_token(case):
    roles_of_one_episode(case, *setup(case))


@pytest.mark.parametrize("case", ["qwen3_keep", "qwen3_disable"])
def test_the_published_qwen3_template_fits_both_think_modes(case):
    """The same episode, token by token, under Qwen3's own published template (not a fixture)."""
    tok = published_qwen3()
    tags = chat.chat_format(tok, CASES[case][1])
    assert tags["format"]["think_history"] == ("kept" if case == "qwen3_keep" else "dropped")
    roles_of_one_episode(case, tok, tags)       # its tools preamble is longer than the fixture's


def roles_of_one_episode(case, tok, tags):
    prompts, worlds = chat_setup.episode_inputs(tok, tags, [pay_task()])
    script = chat.assemble(tok, tags, prompts[0], [PAY3], ["6"], "6", thinks=THINKS.get(case))["ids"][len(prompts[0]):]
    (e,) = sample_episodes(Script(len(tok), script), tok, prompts, "rehearse", world=worlds,
                           settings={"tags": tags, "max_act_tokens": 50, "max_env_tokens": 16,
                                     "max_tokens": 400})   # chatml_text: 13
    runs = EPISODES[case]
    # the prompt: the tokenizer's own template rendering of the user turn and the tool (no
    # generation prompt: the hand-off to the actor is the first forced run); its length is the
    # tokenizer's business, the runs after it the format's
    prompt = tok.encode(tok.apply_chat_template(pay_task()["messages"], tools=[PAY], tokenize=False,
                                                **tags["template"]), add_special_tokens=False)
    n = len(prompt)
    assert prompts[0] == prompt and e["ids"][:n] == prompt
    assert (e["cause"], e["calls"], e["responses"], e["answer"]) == ("answer", [json.dumps(PAY3)], ["6"], "6")
    assert tok.convert_ids_to_tokens(e["ids"][n:]) == [t for _, ts in runs for t in ts]
    assert e["roles"] == [P] * n + [r for r, ts in runs for _ in ts]
    mask = loss_mask(torch.tensor([e["roles"]]))[0].tolist()        # target t trained iff token t+1 is A or R
    assert mask == [float(r in (A, R)) for r in e["roles"][1:]]
    assert all(e["roles"][i] in (A, R) for i, lp in enumerate(e["logprobs"]) if lp != 0.0)
    # the sequence is the template's own rendering of the conversation (its end hand-off added),
    # except that think: disable's forced empty think block of the call turn is not re-rendered
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": PAY3}]}
    answer = {"role": "assistant", "content": "6"}
    if case in THINKS:
        call["reasoning_content"], answer["reasoning_content"] = THINKS[case]
    rendered = chat.prompt_ids(tok, pay_task()["messages"] + [call, {"role": "tool", "content": "6"}, answer], [PAY],
                               tags["template"])
    ids = e["ids"] + tags["end"]
    if case == "qwen3_disable":
        assert tok.convert_ids_to_tokens(ids[n + 3:n + 9]) == BLOCK
        ids = ids[:n + 3] + ids[n + 9:]
    assert ids == rendered


@pytest.mark.parametrize("case", CASES)
def test_strict_parsing_in_each_call_form(case):
    tok, tags = setup(case)
    fmt = tags["format"]
    text = chat.format_call(PAY3, fmt)
    assert chat.read_act(text, SCHEMAS, fmt) == ("call", json.dumps(PAY3))
    spaced = text.replace('{"name"', '  {"name"').replace("}", "} ", 1)
    assert chat.read_act(spaced, SCHEMAS, fmt)[0] == "call"                       # whitespace is free
    for bad in (text.replace("3}", "3"), text + " and more", text.replace('"pay"', '"pay", "id": 1'),
                text.replace(fmt["args_key"], "args")):
        assert chat.read_act(bad, SCHEMAS, fmt)[0] == "bad_call_json", bad
    # text before the call: a bad call where the call has a marker token, an answer for Llama's bare JSON
    assert chat.read_act("Now: " + text, SCHEMAS, fmt)[0] == ("answer" if case == "llama3" else "bad_call_json")
    assert chat.read_act(text.replace('"pay"', '"steal"'), SCHEMAS, fmt)[0] == "unknown_tool"
    assert chat.read_act(text.replace("3", '"3"'), SCHEMAS, fmt)[0] == "bad_arguments"
    assert chat.read_act(fmt["answer_pre"] + "6", SCHEMAS, fmt) == ("answer", "6")
    two = chat.templates.format_calls([PAY3, PAY3], fmt)
    # several calls in one turn: parsed where the template renders them, then refused (one per turn)
    assert chat.read_act(two, SCHEMAS, fmt)[0] == ("bad_call_json" if case == "llama3" else "several_calls")
    assert fmt["args_key"] == ("parameters" if case == "llama3" else "arguments")


# answers holding brackets or starting with '{' (no word of the call wrapper in them)
BRACKETED_ANSWERS = ["It costs [4].", "[4]", "[4, 5] coins", "4 ] [", "see [TOOL] and [CALLS]", '{"total": 4}', "{4}",
                     '{"name": "pay", "arguments": {"amount": 3}} is what I would call']


@pytest.mark.parametrize("case", CASES)
def test_answers_with_brackets_or_braces_are_answers_and_calls_with_them_are_calls(case):
    """An answer is what holds no word of the template's call wrapper: Mistral's '[TOOL_CALLS] ['
    is a call by its first word only (its '[' alone is any answer's bracket), Hermes' by
    '<tool_call>' (a JSON-looking answer is an answer there). Only a template with no wrapper
    (Llama's bare object) reads a leading '{' as a call, which is then malformed here. A call
    whose strings hold brackets and braces is still read whole. Mutations: the wrapper's last
    word in place of its first (Mistral's '['), the leading-'{' rule for every template."""
    tok, tags = setup(case)
    fmt = tags["format"]
    for text in BRACKETED_ANSWERS:
        got = chat.read_act(fmt["answer_pre"] + text, SCHEMAS, fmt)
        bare_object = case == "llama3" and text.startswith("{")
        assert got == (("bad_call_json", got[1]) if bare_object else ("answer", text)), text
    noted = {"name": "pay", "arguments": {"amount": 3, "note": "] [TOOL] {4} [4"}}
    assert chat.read_act(chat.format_call(noted, fmt), SCHEMAS, fmt) == ("call", json.dumps(noted))
    assert chat.read_act(chat.format_call(noted, fmt) + " [4]", SCHEMAS, fmt)[0] == "bad_call_json"
    obj = json.dumps({fmt["name_key"]: "pay", fmt["args_key"]: {"amount": 3}})
    if case != "llama3":          # the wrapper holding a list in place of the call's object
        cause, problem = chat.read_act(chat.format_call(PAY3, fmt).replace(obj, "[4]"), SCHEMAS, fmt)
        assert (cause, problem.split(" '")[0]) == ("bad_call_json", "expected the template's call form")
    if case == "mistral":         # the call as the template renders it: the marker token, then the list
        assert chat.format_call(PAY3, fmt) == '[TOOL_CALLS] [{"name": "pay", "arguments": {"amount": 3}}]'
        assert chat.read_act('[TOOL_CALLS][ {"name": "pay", "arguments": {"amount": 3}} ]', SCHEMAS, fmt) == \
            ("call", json.dumps(PAY3))


def test_derived_call_forms():
    forms = {case: chat.templates.format_calls([PAY3, {"name": "pay", "arguments": {}}], setup(case)[1]["format"])
             for case in ("hermes", "qwen2_newline", "mistral")}
    assert forms == {
        "hermes": '<tool_call>\n{"name": "pay", "arguments": {"amount": 3}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "pay", "arguments": {}}\n</tool_call>',
        "qwen2_newline": '\n<tool_call>\n{"name": "pay", "arguments": {"amount": 3}}\n</tool_call>'
                         '\n<tool_call>\n{"name": "pay", "arguments": {}}\n</tool_call>',
        "mistral": '[TOOL_CALLS] [{"name": "pay", "arguments": {"amount": 3}}, {"name": "pay", "arguments": {}}]'}
    fmt = setup("llama3")[1]["format"]
    assert chat.format_call(PAY3, fmt) == '{"name": "pay", "parameters": {"amount": 3}}' and not fmt["several"]
    assert chat.read_act("{not a call", SCHEMAS, fmt)[0] == "bad_call_json"          # Llama: '{' starts a call
    assert (setup("qwen3_keep")[1]["format"]["think_history"], setup("qwen3_disable")[1]["format"]["think_history"]) == \
        ("kept", "dropped")


def test_templates_that_still_do_not_fit_stop_with_one_line():
    # Qwen's real vocabulary merges "\n\n": the generation prompt's "\n" then cannot be a prefix
    with pytest.raises(chat.TemplateError) as e:
        chat.chat_format(family_tokenizer("qwen2_newline", newline_pairs=True))
    assert "in hand-off prompt->act, token 136 is 'Ċ' in the sampler's assembly but 'ĊĊ'" in str(e.value)
    with pytest.raises(chat.TemplateError, match="think: disable needs a template whose enable_thinking switch"):
        chat.chat_format(setup("hermes")[0], "disable")
    for message in (str(e.value),):
        assert "\n" not in message


@pytest.mark.parametrize("case", CASES)
def test_warm_start_two_rl_steps_and_evaluation(case, tmp_path, monkeypatch):
    """configs/chat_tiny.yaml on a tiny random Qwen2 with the family's tokenizer: the warm start on
    the logged trajectories, two RL steps, the real-world evaluation of the toy tasks."""
    # rewards 0, 1, 0, 1, ... in the order episodes are scored: a group's 2 samples (group_size 2)
    # always differ, so both steps update whatever a random model writes
    calls = itertools.count()
    monkeypatch.setattr(chat_reward, "chat_reward", lambda e, t, judge=None: float(next(calls) % 2))
    tok, _ = setup(case)
    tiny_qwen(tok, tmp_path / "m", width=32, init_range=POSITION_INIT)
    monkeypatch.chdir(ROOT)
    tasks, logged = tmp_path / "tasks.jsonl", tmp_path / "logged.jsonl"   # 2 of the 6 examples: short
    for path, name in ((tasks, "toy_chat_example.jsonl"), (logged, "toy_chat_logged_example.jsonl")):
        path.write_text("".join(open(os.path.join(ROOT, "data", name)).readlines()[:2]))
    cfg = config.load_config(os.path.join(ROOT, "configs", "chat_tiny.yaml"), [
        f"--model={tmp_path / 'm'}", f"--out_dir={tmp_path / 'run'}", "--max_act_tokens=12", "--temperature=2.0",
        f"--tasks_file={tasks}", f"--test_file={tasks}", f"--logged_file={logged}", "--max_tokens=700",
        f"--think={CASES[case][1]}", "--lr=0.01"])
    assert train.run(cfg) == 0
    lines = [json.loads(t) for t in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2] and all(sum(m["causes"].values()) == 4 for m in lines)
    assert len(assert_ratio_one(lines)) == 2    # each family's hand-offs fed as forced runs
    result = json.load(open(tmp_path / "run" / "eval.json"))
    after = result.get("after", result)
    assert after["n_tasks"] == sum(after["causes"].values()) == 2 and after["executed_tasks"] == 2
    assert os.path.isdir(tmp_path / "run" / "warmstart") and os.path.isdir(tmp_path / "run" / "ckpt")


@pytest.mark.parametrize("case", ["mistral", "hermes", "llama3"])
def test_real_mode_forces_the_response_as_the_template_renders_it(case):
    """Real mode: the world's response is forced (OBS), with whatever the template puts before a
    tool result that belongs to the response's tokens (Mistral's space after '{"content":', which a
    byte-level BPE writes as one token with the response's first character: env_lead). The sampled
    sequence must still be the template's own rendering, token for token, and the forced tokens
    are exactly the response's (role OBS, logprob 0)."""
    tok, tags = setup(case)
    prompts, worlds = chat_setup.episode_inputs(tok, tags, [pay_task()])
    script = chat.assemble(tok, tags, prompts[0], [PAY3], ["6"], "6")["ids"][len(prompts[0]):]
    (e,) = sample_episodes(Script(len(tok), script), tok, prompts, "real", world=worlds,
                           settings={"tags": tags, "max_act_tokens": 50, "max_env_tokens": 16,
                                     "max_tokens": 400})   # chatml_text: 13
    assert (e["cause"], e["responses"], e["answer"]) == ("answer", ["6"], "6")
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": PAY3}]}
    rendered = chat.prompt_ids(tok, pay_task()["messages"] + [call, {"role": "tool", "content": "6"},
                                                               {"role": "assistant", "content": "6"}], [PAY])
    assert e["ids"] + tags["end"] == rendered
    n = len(prompts[0])
    forced = [t for t, r in zip(tok.convert_ids_to_tokens(e["ids"][n:]), e["roles"][n:]) if r == OBS]
    assert forced == {"mistral": ["Ġ", "6", "}", "[/TOOL_RESULTS]"], "hermes": ["6", "Ċ", "</tool_response>"],
                      "llama3": ["6", "<|eot_id|>"]}[case]
    assert all(lp == 0.0 for lp, r in zip(e["logprobs"], e["roles"]) if r == OBS)


def test_derive_keeps_a_trailing_space_of_the_tool_turn_with_the_response_not_a_newline():
    """The tool turn's opening ends with text and a space in Mistral's template ('{"content": '):
    the space is the response's (env_lead), not the opening's. A newline ending the opening (a
    ChatML-style '<|im_start|>tool\\n') stays in the opening: a byte-level BPE writes it as a
    token of its own, so the response must not start with it."""
    fmt = setup("mistral")[1]["format"]
    assert (fmt["act_env"], fmt["env_lead"], fmt["env_pre"]) == ('[TOOL_RESULTS] {"content":', " ", "}")
    tool_turn = CHAT_TEMPLATE.split("{%- elif message.role == 'tool' %}")[1].split("{%- endif %}{%- endfor %}")[0]
    chatml_tool = CHAT_TEMPLATE.replace(tool_turn, "{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' }}")
    tags = chat.chat_format(chat_tokenizer(chatml_tool))
    fmt = tags["format"]
    assert (fmt["act_env"], fmt["env_lead"], fmt["env_pre"], fmt["env_stop"]) == \
        ("\n<|im_start|>tool\n", "", "", "<|im_end|>")


def test_derive_stops_on_the_longer_of_two_special_tokens_starting_at_one_place():
    """A vocabulary with '<|im_end|>' and '<|im_end|>\\n' (one token for the end and its newline):
    the tokenizer writes the longer where both match, so the derived stop, the hand-offs after it
    and the sampler's ids are the longer token's, and the whole assembly still fits."""
    tok = chat_tokenizer(CHAT_TEMPLATE, CHAT_SPECIALS + ["<|im_end|>\n"])
    tags = chat.chat_format(tok)
    fmt = tags["format"]
    assert (fmt["stop"], fmt["end"], fmt["act"]) == ("<|im_end|>\n", "", "<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens([tags["act_end"]]) == ["<|im_end|>\n"]
