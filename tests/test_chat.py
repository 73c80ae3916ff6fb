"""Chat format: hand-offs derived from the template and checked, strict tool-call parsing, the
chat JSONL task files, roles and shifted loss mask of sampled chat episodes, the rewards, the
toy world in chat form, and train.py / evaluate.py end to end on a tiny random Qwen2."""
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

from chat import format as chat
from chat import chat_reward
from chat import setup as chat_setup
from chat import tasks as chat_tasks
from machinery import checkpoint
from machinery import config
import evaluate
from scripts import evaluate_cli
from formats import features
import reward
import train
from machinery import taskfiles
import world
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, loss_mask
from helpers import CHAT_TEMPLATE, POSITION_INIT, assert_ratio_one, chat_tokenizer, scripted_rows, tiny_qwen
from rollout import sample_episodes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = chat_tokenizer()
PAY = {"type": "function", "function": {"name": "pay", "parameters": {
    "type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}}}
SCHEMAS = {"pay": PAY["function"]["parameters"],
           "find": {"type": "object", "additionalProperties": False, "required": ["city", "tags"],
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                   "tags": {"type": "array", "items": {"type": "string"}},
                                   "radius": {"type": "number"}, "open": {"type": "boolean"},
                                   "where": {"type": "object", "properties": {"lat": {"type": "number"}},
                                             "required": ["lat"]}}}}


def tokens(ids):
    return TOK.convert_ids_to_tokens(ids)


# ----------------------------------------------------------------------------- the template

def test_hand_offs_are_derived_from_the_template():
    tags = chat.chat_format(TOK)
    # ids 0..6 are the special tokens in the order helpers.CHAT_SPECIALS adds them
    assert tags["act_end"] == 2 and tokens(tags["act_end"]) == "<|im_end|>"
    assert tags["env_end"] == 6 and tokens(tags["env_end"]) == "</tool_response>"
    assert tokens(tags["first_act"]) == ["<|im_start|>", "assistant", "Ċ"]
    assert tokens(tags["env"]) == ["Ċ", "<|im_start|>", "user", "Ċ", "<tool_response>", "Ċ"]
    assert tokens(tags["act"]) == ["<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    assert tokens(tags["end"]) == ["Ċ"]
    assert (tags["act_pre"], tags["env_pre"]) == ("", "\n")     # the rehearsal writes "\n</tool_response>"
    assert tags["stops"] == {0, 1, 2, 5, 6}                       # <tool_call> (3, 4) is action text


@pytest.mark.parametrize("broken, where", [
    # no tool role: tool messages are not rendered at all
    (CHAT_TEMPLATE.replace("message.role == 'tool'", "message.role == 'nobody'"),
     "hand-off act->env: the template does not render the content '§T1§'"),
    # tool responses numbered by their place: a hand-off that depends on the turn
    (CHAT_TEMPLATE.replace("'\\n<tool_response>\\n' + message.content",
                           "'\\n<tool_response>' + (loop.index|string) + '\\n' + message.content"),
     "hand-off act->env depends on the turn"),
    # tool responses written as JSON strings (tojson): the template escapes what the rehearsal writes raw
    (CHAT_TEMPLATE.replace("'\\n<tool_response>\\n' + message.content", "'\\n<tool_response>\\n' + message.content|tojson"),
     "in response 1 and its stop, token 180 is '{\"' in the sampler's assembly but '{' in the template's own rendering"),
], ids=["no_tool_role", "numbered_turns", "response_as_json_string"])
def test_a_template_that_does_not_fit_fails_with_one_clear_message(broken, where):
    with pytest.raises(chat.TemplateError) as e:
        chat.chat_format(chat_tokenizer(broken))
    message = str(e.value)
    assert where in message and "\n" not in message
    # token 180: the sample prompt (135 tokens), <|im_start|> assistant Ċ, the call and <|im_end|> (32),
    # Ċ <|im_start|> user Ċ <tool_response> Ċ (6), then the opening quote '"' the template adds
    assert len(chat.prompt_ids(TOK, chat.SAMPLE_OPENING, [chat.SAMPLE_TOOL])) == 135


def test_the_call_form_follows_the_template():
    """A template writing <tool_call>{"name"... with no newline (which stopped the run before the act
    format was derived) fits: the actor is asked to write the call the template's way."""
    tags = chat.chat_format(chat_tokenizer(CHAT_TEMPLATE.replace("'\\n<tool_call>\\n{\"name\": \"'",
                                                                 "'\\n<tool_call>{\"name\": \"'")))
    call = {"name": "pay", "arguments": {"amount": 3}}
    assert chat.format_call(call, tags["format"]) == '<tool_call>{"name": "pay", "arguments": {"amount": 3}}\n</tool_call>'
    assert chat.read_act(chat.format_call(call, tags["format"]), SCHEMAS, tags["format"]) == ("call", json.dumps(call))


def test_a_bad_template_stops_train_with_one_line(tmp_path, capsys):
    tok = chat_tokenizer(CHAT_TEMPLATE.replace("message.role == 'tool'", "message.role == 'nobody'"))
    tiny_qwen(tok, tmp_path / "m")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"format: chat\nmodel: {tmp_path / 'm'}\ntasks_file: {ROOT}/data/toy_chat_example.jsonl\n"
                   f"out_dir: {tmp_path / 'run'}\ntasks_per_step: 2\n")
    assert train.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "role 'tool'" in err[0]


@pytest.mark.parametrize("text, fault", [
    ("{# caf\u00e9 #}".encode("latin-1"), "is not UTF-8 text (invalid continuation byte); a Jinja chat template is a "
                                          "UTF-8 text file, e.g. chat/chatml_tools.jinja"),
    (b"", "is empty; give a Jinja chat template, e.g. chat/chatml_tools.jinja"),
    (b"\n  \n", "is empty; give a Jinja chat template, e.g. chat/chatml_tools.jinja"),
], ids=["latin_1", "empty", "blank"])
def test_a_chat_template_file_not_utf8_or_empty_stops_train_with_one_line(tmp_path, capsys, text, fault):
    """The config key chat_template naming a file saved in Latin-1 (its e-acute 0xE9 opens a
    three-byte UTF-8 sequence that the space after it does not continue), an empty one, or one of
    whitespace only: one line naming the file, exit 2, the file as it was and no out_dir (before:
    "error in setup: UnicodeDecodeError", exit 1; the empty file unnamed, blamed on the template
    ignoring tools)."""
    tiny_qwen(TOK, tmp_path / "m")
    jinja = tmp_path / "t.jinja"
    jinja.write_bytes(text)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"format: chat\nmodel: {tmp_path / 'm'}\ntasks_file: {ROOT}/data/toy_chat_example.jsonl\n"
                   f"out_dir: {tmp_path / 'run'}\ntasks_per_step: 2\nchat_template: {jinja}\n")
    assert train.main(["--config", str(cfg)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: chat_template: {jinja} {fault}"]
    assert jinja.read_bytes() == text and not (tmp_path / "run").exists()


def test_evaluate_on_a_chat_checkpoint_missing_its_template_names_the_file(tmp_path, capsys):
    """A chat checkpoint (a tiny Qwen2 saved with its tokenizer and a format: chat config.yaml, as
    train.py saves one) whose chat_template.jinja is gone: evaluate.py says the checkpoint is
    damaged, naming the folder and the file, exit 2, every file as it was (before: one line saying
    the chat template cannot render a tool conversation, as if the config were at fault). With the
    file back, the same checkpoint loads."""
    ckpt = tmp_path / "ckpt"
    tiny_qwen(TOK, ckpt)
    (ckpt / "config.yaml").write_text(f"format: chat\nmodel: {ckpt}\ntasks_file: {ROOT}/data/toy_chat_example.jsonl\n"
                                      f"out_dir: {tmp_path}\ntasks_per_step: 2\nmax_tokens: 640\n")
    template = (ckpt / "chat_template.jinja").read_bytes()
    (ckpt / "chat_template.jinja").unlink()
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    assert evaluate_cli.main(["--ckpt", str(ckpt)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: cannot load the checkpoint in {ckpt}: {ckpt / 'chat_template.jinja'} is missing (the chat template "
        "a format: chat run saves with its checkpoints)"]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == files and sorted(os.listdir(tmp_path)) == ["ckpt"]
    (ckpt / "chat_template.jinja").write_bytes(template)
    assert evaluate_cli.load_run(str(ckpt), [])[2].chat_template == template.decode()


def test_the_chat_template_key_replaces_the_tokenizers_own_template(tmp_path):
    """The config key chat_template names a Jinja file that replaces the template the model's
    tokenizer brings (here helpers' Hermes one): the policy train.py builds (build_policy) renders
    prompts by the file, and a checkpoint of it keeps the file's template (--resume and evaluate.py
    load it from there). Mutation: the file applied only where the tokenizer has no template."""
    tiny_qwen(TOK, tmp_path / "qwen")
    jinja = tmp_path / "plain.jinja"
    jinja.write_text("{%- if tools %}<tools {{ tools | length }}>|{%- endif %}"
                     "{%- for m in messages %}<{{ m.role }}>{{ m.content }}|{%- endfor %}"
                     "{%- if add_generation_prompt %}<assistant>{%- endif %}")
    cfg = {**config.DEFAULTS, "format": "chat", "model": str(tmp_path / "qwen"), "chat_template": str(jinja)}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "pay 3"}]
    model, tokenizer, state, warm = checkpoint.build_policy(cfg, False, "cpu", 1, None)
    assert (state, warm) == (None, None)
    assert chat.render(tokenizer, messages, [PAY], True) == "<tools 1>|<system>Be brief.|<user>pay 3|<assistant>"
    own = checkpoint.build_policy({**cfg, "chat_template": ""}, False, "cpu", 1, None)[1]
    assert chat.render(own, messages, None, True) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\npay 3<|im_end|>\n<|im_start|>assistant\n"
    checkpoint.save_checkpoint(model, tokenizer, str(tmp_path / "ckpt"))
    saved = checkpoint.load_policy(str(tmp_path / "ckpt"))[1]
    assert chat.render(saved, messages, [PAY], True) == "<tools 1>|<system>Be brief.|<user>pay 3|<assistant>"


# ----------------------------------------------------------------------------- strict tool calls

def call(text):
    return chat.read_act(f"<tool_call>\n{text}\n</tool_call>", SCHEMAS)


def test_strict_tool_call_parsing():
    assert call('{"name": "pay", "arguments": {"amount": 3}}') == ("call", '{"name": "pay", "arguments": {"amount": 3}}')
    assert call('{"arguments": {"amount": 3},   "name": "pay"}')[0] == "call"          # any key order
    assert chat.read_act("  6 \n", SCHEMAS) == ("answer", "6")
    assert chat.read_act(" \n", SCHEMAS)[0] == "empty_answer"
    for text in ('{"name": "pay", "arguments": {"amount": 3}', '{"name": "pay"}', "[1, 2]",
                 '{"name": "pay", "arguments": {"amount": 3}, "id": 1}', '{"name": "pay", "arguments": "3"}'):
        assert call(text)[0] == "bad_call_json", text
    two = '<tool_call>\n{"name": "pay", "arguments": {"amount": 1}}\n</tool_call>' * 2
    # two well-formed calls are parsed (templates.read_calls), then refused: one call per turn
    assert chat.read_act(two, SCHEMAS) == ("several_calls", "2 calls in one turn: this sampler runs one call per turn")
    assert chat.read_act(two.replace("</tool_call><tool_call>", "</tool_call>\n<tool_call>"), SCHEMAS)[0] == "several_calls"
    assert chat.read_act(two.replace("</tool_call><tool_call>", "</tool_call> and <tool_call>"), SCHEMAS)[0] == "bad_call_json"
    assert chat.read_act('I pay. <tool_call>{"name": "pay", "arguments": {"amount": 1}}</tool_call>',
                         SCHEMAS)[0] == "bad_call_json"
    assert chat.read_act('<tool_call>{"name": "pay", "arguments": {"amount": 1}}', SCHEMAS)[0] == "bad_call_json"
    assert call('{"name": "steal", "arguments": {}}') == ("unknown_tool", "no tool named 'steal'")
    bad = {'{"amount": "3"}': 'arguments.amount must be integer, got "3"',
           '{"amount": 3.0}': "arguments.amount must be integer, got 3.0",
           '{"amount": true}': "arguments.amount must be integer, got true",
           "{}": "arguments.amount is required"}
    for args, problem in bad.items():
        assert call(f'{{"name": "pay", "arguments": {args}}}') == ("bad_arguments", problem)
    assert call('{"name": "pay", "arguments": {"amount": 3, "note": "x"}}')[0] == "call"   # extra allowed here
    thought = '<think>\nI pay.\n</think>\n\n<tool_call>\n{"name": "pay", "arguments": {"amount": 3}}\n</tool_call>'
    assert chat.read_act(thought, SCHEMAS) == ("call", '{"name": "pay", "arguments": {"amount": 3}}')
    assert chat.read_act("<think>\nhm\n</think>\n\n 6", SCHEMAS) == ("answer", "6")
    assert chat.read_act("<think>\nhm", SCHEMAS)[0] == "unclosed_think"


def test_schema_types_enum_required_and_additional_properties():
    ok = {"city": "Rome", "tags": ["a"], "radius": 2, "open": False, "where": {"lat": 1.5}}
    assert chat_tasks.check_value(ok, SCHEMAS["find"]) is None
    cases = {"city": ("Milan", "arguments.city must be one of ['Paris', 'Rome'], got \"Milan\""),
             "tags": (["a", 1], "arguments.tags[1] must be string, got 1"),
             "radius": ("2", 'arguments.radius must be number, got "2"'),
             "open": (0, "arguments.open must be boolean, got 0"),
             "where": ({}, "arguments.where.lat is required"),
             "nearby": (True, "arguments.nearby is not a known argument")}
    for key, (value, problem) in cases.items():
        assert chat_tasks.check_value({**ok, key: value}, SCHEMAS["find"]) == problem
    assert chat_tasks.check_value({"city": "Rome"}, SCHEMAS["find"]) == "arguments.tags is required"



def test_schema_enum_compares_json_values():
    """An enum holds JSON values: a number matches by value (100.0 is 100), never a different one
    (101), and true is not 1 nor false 0 (Python's `in` says they are); a quoted string is not
    the string (the schema check does not normalise)."""
    level = {"enum": [100, 0, "Paris", [1, 2]]}
    for ok in (100, 100.0, 0, "Paris", [1, 2], [1.0, 2]):
        assert chat_tasks.check_value(ok, level) is None, ok
    for bad in (101, 99.999, True, False, '"Paris"', "paris", [1, True], [2, 1]):
        assert chat_tasks.check_value(bad, level) == (f"arguments must be one of [100, 0, 'Paris', [1, 2]], "
                                                      f"got {json.dumps(bad)}"), bad
    assert chat_tasks.check_value(1, {"enum": [True]}) is not None

# ----------------------------------------------------------------------------- episodes

class Script(torch.nn.Module):
    """A fake causal LM: at the k-th position after the prompt it puts all probability on
    script[k], whatever it is fed (forced positions of the script are the sampler's business)."""

    def __init__(self, script):
        super().__init__()
        self.config = Qwen2Config(vocab_size=len(TOK), hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.script = script

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        B, T = input_ids.shape
        _, k = scripted_rows(input_ids, attention_mask, cache, lambda b: 0)
        logits = torch.full((B, T, len(TOK)), -1e4)
        for b in range(B):
            logits[b, -1, self.script[min(k[b], len(self.script) - 1)]] = 0.0
        return SimpleNamespace(logits=logits)


def pay_task(**kw):
    return {"messages": [{"role": "user", "content": "pay 3"}], "tools": [PAY], "answer": "6",
            "gold_calls": [{"name": "pay", "arguments": {"amount": 3}}], "env": "toy", **kw}


def sample(task, env_mode, actions, responses, answer, n=1):
    """Sample `n` episodes of `task` from a model scripted to write exactly this episode."""
    tags = chat.chat_format(TOK)
    prompts, worlds = chat_setup.episode_inputs(TOK, tags, [task] * n)
    script = chat.assemble(TOK, tags, prompts[0], actions, responses, answer)["ids"][len(prompts[0]):]
    return tags, prompts[0], sample_episodes(Script(script), TOK, prompts, env_mode, world=worlds,
                                             settings={"tags": tags, "max_act_tokens": 40, "max_env_tokens": 8,
                                                       "max_tokens": 200})


def test_roles_and_shifted_loss_mask_of_a_chat_episode():
    """pay 3 -> '6' -> answer 6. After the n prompt tokens (the template's rendering of the user turn
    and the tool; n = 74 with the fixture's BPE, the tokenizer's business), tokens and roles from the
    template: n..n+2 <|im_start|> assistant Ċ (T) | n+3..n+22 <tool_call> Ċ {" name ": Ġ" pay ",
      Ġ" arguments ": Ġ{" amount ": Ġ 3 }} Ċ </tool_call> <|im_end|> (A) | n+23..n+28 Ċ <|im_start|>
      user Ċ <tool_response> Ċ (T) | n+29..n+31 6 Ċ </tool_response> (R) | n+32..n+36 <|im_end|> Ċ
      <|im_start|> assistant Ċ (T) | n+37..n+38 6 <|im_end|> (A)."""
    tags, prompt, episodes = sample(pay_task(), "rehearse", [{"name": "pay", "arguments": {"amount": 3}}],
                                    ["6"], "6")
    e = episodes[0]
    want = TOK.encode(TOK.apply_chat_template([{"role": "user", "content": "pay 3"}], tools=[PAY], tokenize=False),
                      add_special_tokens=False)
    n = len(want)
    assert prompt == want == e["ids"][:n] and e["cause"] == "answer" and e["answer"] == "6"
    assert e["calls"] == ['{"name": "pay", "arguments": {"amount": 3}}'] and e["responses"] == ["6"]
    P, T, A, R = PROMPT, TAG, ACT, REHEARSE
    assert e["roles"] == [P] * n + [T] * 3 + [A] * 20 + [T] * 6 + [R] * 3 + [T] * 5 + [A] * 2
    assert tokens(e["ids"][n + 29:n + 32]) == ["6", "Ċ", "</tool_response>"]
    assert tokens(e["ids"][n + 21:n + 24]) == ["</tool_call>", "<|im_end|>", "Ċ"]
    # the sequence is the template's own rendering of the conversation (without the final "\n")
    messages = [{"role": "user", "content": "pay 3"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "pay", "arguments": {"amount": 3}}}]},
                {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]
    assert e["ids"] + tags["end"] == chat.prompt_ids(TOK, messages, [PAY])
    # target t is trained iff the token at t+1 is ACT or REHEARSE
    mask = loss_mask(torch.tensor([e["roles"]]))[0].tolist()
    assert "".join(str(int(m)) for m in mask[n - 1:]) == "000" + "1" * 20 + "0" * 6 + "111" + "0" * 5 + "11"
    assert not any(mask[:n - 1])
    sampled = [i for i, lp in enumerate(e["logprobs"]) if lp != 0.0]
    assert all(e["roles"][i] in (A, R) for i in sampled)        # forced and prompt tokens: logprob 0


def test_real_mode_executes_the_json_call_in_the_toy_world():
    # the script rehearses '5' but the toy world says 6: forced as OBS, no loss
    _, _, episodes = sample(pay_task(), "real", [{"name": "pay", "arguments": {"amount": 3}}], ["5"], "6")
    e = episodes[0]
    assert e["responses"] == ["6"] and e["cause"] == "answer"
    assert e["roles"][103:106] == [OBS] * 3 and tokens(e["ids"][103:106]) == ["6", "Ċ", "</tool_response>"]
    assert not loss_mask(torch.tensor([e["roles"]]))[0, 102:105].any()


def test_a_bad_call_ends_the_episode_with_its_cause_and_reward_0():
    for name, args, cause in (("steal", {}, "unknown_tool"), ("pay", {"amount": "3"}, "bad_arguments")):
        _, _, episodes = sample(pay_task(), "rehearse", [{"name": name, "arguments": args}], ["6"], "6", n=2)
        assert [e["cause"] for e in episodes] == [cause, cause]
        assert reward.cause_counts(episodes) == {cause: 2}
        assert chat_reward.chat_reward(episodes[0], pay_task()) == 0.0
        assert episodes[0]["roles"][-1] == ACT and tokens(episodes[0]["ids"][-1]) == "<|im_end|>"


# ----------------------------------------------------------------------------- rewards

def test_answer_match_normalises_strings_and_numbers():
    for a, b in (("6", "6.0"), (" The  Apple.", "the apple"), ("1,200", "1200"), ("-2", "-2.00")):
        assert chat_reward.answer_match(a, b), (a, b)
    for a, b in (("7", "6"), ("apple", "apples"), ("6 coins", "6")):
        assert not chat_reward.answer_match(a, b), (a, b)


def test_answer_match_tolerance_is_relative_and_tiny_and_quotes_are_dropped():
    """Numbers match within 1e-9 of the expected value's size (at least 1e-9): 101 is not 100, nor
    2,000,000,003 two billion; 2,000,000,000.5 is (a float's rounding there). Quotes and a final
    period around an answer go, on both sides, for strings and numbers; quotes inside stay."""
    for a, b in (('"Paris"', "paris"), ("'42'", "42"), ('"42."', "42.0"), ("Paris", "'Paris'"),
                 ("2000000000.5", "2000000000"), ("1e-10", "0"), ("100", "100.0000000001")):
        assert chat_reward.answer_match(a, b), (a, b)
    for a, b in (("101", "100"), ("100", "101"), ("2000000003", "2000000000"), ("1e-8", "0"), ("0.5", "0"),
                 ('"Pa"ris"', "paris"), ("'Rome'", "Paris")):
        assert not chat_reward.answer_match(a, b), (a, b)
    assert chat_reward.value_match(2000000000.5, 2000000000) and chat_reward.value_match(100.0, 100)
    assert not chat_reward.value_match(101, 100) and not chat_reward.value_match(2000000003, 2000000000)


def test_tool_call_match_is_ast_style():
    gold = [{"name": "find", "arguments": {"city": "Rome", "radius": 2, "open": True}},
            {"name": "pay", "arguments": {"amount": 3}}]
    same = [{"name": "find", "arguments": {"open": True, "radius": 2.0, "city": " rome"}},
            {"name": "pay", "arguments": {"amount": 3}}]
    assert chat_reward.calls_match(same, gold)
    assert not chat_reward.calls_match(same[::-1], gold)                       # order matters by default
    assert chat_reward.calls_match(same[::-1], gold, "any")
    assert not chat_reward.calls_match(same + same[:1], gold, "any")           # one call too many
    assert not chat_reward.calls_match([same[0], {"name": "pay", "arguments": {"amount": 4}}], gold)
    assert not chat_reward.calls_match([{"name": "find", "arguments": {"city": "Rome", "radius": 2, "open": 1}},
                                   same[1]], gold)                        # 1 is not true
    assert not chat_reward.calls_match([{"name": "find", "arguments": {"city": "Rome", "radius": 2}}, same[1]], gold)
    assert chat_reward.value_match([1, {"a": "X"}], [1.0, {"a": "x"}]) and not chat_reward.value_match([1, 2], [2, 1])


def test_chat_reward_combines_answer_calls_and_judge():
    e = {"cause": "answer", "answer": "6", "calls": ['{"name": "pay", "arguments": {"amount": 3}}'],
         "responses": ["6"]}
    assert chat_reward.chat_reward(e, pay_task()) == 1.0
    assert chat_reward.chat_reward({**e, "answer": "7"}, pay_task()) == 0.0
    assert chat_reward.chat_reward({**e, "calls": []}, pay_task()) == 0.0
    assert chat_reward.chat_reward({**e, "cause": "token_limit"}, pay_task()) == 0.0
    task = pay_task(checklist=["paid?", "polite?"])
    assert chat_reward.chat_reward(e, task, judge=lambda ep, t: [0.2, 0.6]) == pytest.approx(0.4)
    assert chat_reward.chat_reward({**e, "answer": "7"}, task, judge=lambda ep, t: [1.0, 1.0]) == 0.0


def yes_by_hand(judge, prompt):
    """p(yes) / (p(yes) + p(no)) of the judge's next token after `prompt`, from its logits by hand;
    the first tokens of yes/Yes and no/No in this tokenizer: 'y', 'Y', 'no' (merged, from 'not'), 'N'."""
    ids = torch.tensor([TOK.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        logits = judge(input_ids=ids).logits[0, -1].tolist()
    z = sum(math.exp(v) for v in logits)
    p = {t: math.exp(logits[TOK.convert_tokens_to_ids(t)]) / z for t in ("y", "Y", "no", "N")}
    return (p["y"] + p["Y"]) / (p["y"] + p["Y"] + p["no"] + p["N"])


def judge_prompt_by_hand(user, transcript, question):
    """The judge's question as the Hermes template renders one user turn, written out."""
    return (f"<|im_start|>user\nTask: {user}\n\nWhat the assistant did:\n{transcript}\n\nQuestion: {question}\n"
            f"Answer yes or no.<|im_end|>\n<|im_start|>assistant\n")


def test_judge_probability_of_yes_by_hand(tmp_path):
    judge = tiny_qwen(TOK, seed=3)
    prompt = "<|im_start|>user\nIs 6 right? Answer yes or no.<|im_end|>\n<|im_start|>assistant\n"
    assert [tokens(TOK.encode(w, add_special_tokens=False)[0]) for w in ("yes", "Yes", "no", "No")] == \
        ["y", "Y", "no", "N"]
    # (the same forward, softmax in float32 against math.exp in float64: 1e-5 of a probability)
    assert chat_reward.judge_yes_probability(judge, TOK, [prompt]) == [pytest.approx(yes_by_hand(judge, prompt), rel=1e-5)]
    # make_judge: one prompt per checklist question, the episode written as its transcript
    questions = ["a?", "b?", "c?"]
    scores = chat_reward.make_judge(judge, TOK)({"calls": ['{"name": "pay", "arguments": {"amount": 3}}'],
                                                 "responses": ["6"], "answer": "6"}, pay_task(checklist=questions))
    transcript = 'call: {"name": "pay", "arguments": {"amount": 3}}\nresult: 6\nanswer: 6'
    want = [yes_by_hand(judge, judge_prompt_by_hand("pay 3", transcript, q)) for q in questions]
    assert scores == pytest.approx(want, rel=1e-5) and len(set(want)) == 3


# ----------------------------------------------------------------------------- task files

def write(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return str(path)


GOOD = {"messages": [{"role": "user", "content": "pay 3"}], "tools": [PAY], "answer": 6}


@pytest.mark.parametrize("line, problem", [
    ("{not json", "line 2: not valid JSON"),
    ({"messages": GOOD["messages"], "answer": "6"}, "line 2: missing key 'tools'"),
    ({**GOOD, "answer": None}, "line 2: 'answer' must be a string or a number"),
    ({k: v for k, v in GOOD.items() if k != "answer"}, "line 2: no success criterion"),
    ({**GOOD, "gold_calls": [{"name": "pay", "arguments": {"amount": "3"}}]},
     "line 2: gold call 1 pay: arguments.amount must be integer"),
    ({**GOOD, "gold_calls": [{"name": "buy", "arguments": {}}]}, "line 2: gold call 1 names tool 'buy'"),
    ({**GOOD, "messages": [{"role": "system", "content": "hi"}]}, "line 2: the opening messages"),
    ({**GOOD, "call_order": "sorted"}, "line 2: 'call_order' must be 'exact' or 'any'"),
    ({**GOOD, "examples": {"pay": [{"arguments": {"amount": 1}, "result": 8}]}}, "line 2: example 1 of 'pay'"),
])
def test_task_file_errors_name_the_line(tmp_path, line, problem):
    path = write(tmp_path, [GOOD, line])
    with pytest.raises(taskfiles.DataError) as e:
        chat_tasks.read_chat_jsonl(path, "tasks")
    assert problem in str(e.value) and str(e.value).startswith(path)


def test_logged_trajectory_errors_and_reading(tmp_path):
    call = {"type": "function", "function": {"name": "pay", "arguments": '{"amount": 3}'}}   # OpenAI: a string
    good = {"messages": GOOD["messages"] + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                            {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}],
            "tools": [PAY]}
    two = {**good, "messages": GOOD["messages"] + [{"role": "assistant", "tool_calls": [call, call]}]}
    path = write(tmp_path, [good, two])
    with pytest.raises(taskfiles.DataError, match="line 2: turn 1: one tool call per assistant turn"):
        chat_tasks.read_chat_jsonl(path, "trajectories")
    (t,) = chat_tasks.read_chat_jsonl(write(tmp_path, [good]), "trajectories")
    assert t["calls"] == ['{"name": "pay", "arguments": {"amount": 3}}'] and t["responses"] == ["6"]
    assert t["answer"] == "6" and t["messages"] == GOOD["messages"]


def test_a_bad_task_file_stops_train_before_the_model_loads(tmp_path, capsys):
    path = write(tmp_path, [GOOD, {**GOOD, "tools": "pay"}])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"format: chat\nmodel: {tmp_path / 'nowhere'}\ntasks_file: {path}\n")
    assert train.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "line 2: 'tools' must be a list" in err[0]
    assert train.main(["--config", str(cfg), "--model=tiny"]) == 2
    assert "format: chat needs model" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the toy world in chat form

def test_toy_export_round_trips_and_the_toy_world_executes_json_calls(tmp_path):
    chat.export_toy(str(tmp_path), seed=0, n_logged=5, n_new_logged=0, n_rl=5, n_test=5)
    tasks = chat_tasks.read_chat_jsonl(str(tmp_path / "test.jsonl"), "tasks")
    logged = chat_tasks.read_chat_jsonl(str(tmp_path / "logged.jsonl"), "trajectories")
    shipped = chat_tasks.read_chat_jsonl(os.path.join(ROOT, "data", "toy_chat_example.jsonl"), "tasks")
    for t in tasks + shipped:
        w = chat.task_world(t, {"env_pre": "\n", "act_pre": ""})
        calls = [json.dumps(c) for c in t["gold_calls"]]
        assert w.replay(calls)[-1] == t["answer"] and t["env"] == "toy"
    for t in logged:
        assert world.replay([chat.toy_call_text(c) for c in t["call_dicts"]]) == t["responses"]
    w = chat.task_world(tasks[0], {"env_pre": "\n", "act_pre": ""})
    state = w.new_state()
    steps = [{"name": "price", "arguments": {"item": "apple"}}, {"name": "mul", "arguments": {"a": 3, "b": 4}},
             {"name": "pay", "arguments": {"amount": 4}}, {"name": "pay", "arguments": {"amount": 9}}]
    assert [w.step(state, json.dumps(c)) for c in steps] == ["3", "12", "5", "error funds"]
    assert chat.toy_json_call("mul 3 , 4") == {"name": "mul", "arguments": {"a": 3, "b": 4}}
    assert chat.read_act('<tool_call>{"name": "price", "arguments": {"item": "pen"}}</tool_call>',
                         chat_tasks.tool_schemas(chat.TOY_TOOLS))[0] == "bad_arguments"   # enum of items


def test_tasks_file_toy_makes_the_exported_splits_in_memory(tmp_path):
    """tasks_file: toy gives, split by split, the tasks `python -m chat.format --export` writes and
    read_chat_jsonl reads back, from the same data keys; it refuses test_file/logged_file beside it."""
    chat.export_toy(str(tmp_path), seed=3, n_logged=6, n_new_logged=2, n_rl=5, n_test=4)
    cfg = {**config.DEFAULTS, "format": "chat", "tasks_file": "toy", "data_seed": 3, "n_logged": 6,
           "n_new_logged": 2, "n_rl_tasks": 5, "n_test": 4}
    made = chat_setup.chat_tasks(cfg)
    for name, kind in (("rl", "tasks"), ("test", "tasks"), ("logged", "trajectories")):
        read = chat_tasks.read_chat_jsonl(str(tmp_path / f"{name}.jsonl"), kind)

        def content(tasks):                    # where a task came from: a file's line, or "toy rl task 3"
            return [{k: v for k, v in t.items() if k != "where"} for t in tasks]
        assert content(made[name]) == content(read), name
    assert [len(made[k]) for k in ("rl", "test", "logged")] == [5, 4, 6 + 2]
    with pytest.raises(config.ConfigError, match="tasks_file: toy makes every split .*remove test_file and logged_file"):
        config.check_format({**cfg, "model": "m", "test_file": "t.jsonl"})


# ----------------------------------------------------------------------------- train.py, resume, evaluate.py

def test_train_resume_and_evaluate_on_the_chat_path(tmp_path, monkeypatch):
    # a random model never answers right: reward episode-length parity so that steps update
    monkeypatch.setattr(chat_reward, "chat_reward", lambda e, t, judge=None: float(len(e["ids"]) % 2))
    tiny_qwen(TOK, tmp_path / "qwen", init_range=POSITION_INIT)
    overrides = [f"--model={tmp_path / 'qwen'}", f"--out_dir={tmp_path / 'run'}", "--max_act_tokens=12",
                 "--max_tokens=640", "--temperature=2.0", "--lr=0.01"]
    monkeypatch.chdir(ROOT)
    cfg = config.load_config(os.path.join(ROOT, "configs", "chat_tiny.yaml"), overrides)
    assert train.run(cfg) == 0
    assert train.run({**cfg, "rl_steps": 3}, resume=True) == 0
    out = cfg["out_dir"]
    lines = [json.loads(text) for text in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:           # every episode samples at least its first token as the actor
        assert sum(m["causes"].values()) == 4 and m["tokens_act"] >= 4
    assert_ratio_one(lines)   # the resumed step 3 too
    final = checkpoint.load_policy(os.path.join(out, "ckpt"))[0]
    warm = checkpoint.load_policy(os.path.join(out, "warmstart"))[0]
    # each updated AdamW step moves an element by at most ~1.004 lr plus weight decay; the first by lr
    updated = sum(m["status"] == "updated" for m in lines)
    diff = max((a - b).abs().max().item() for a, b in zip(final.parameters(), warm.parameters()))
    assert cfg["lr"] / 2 < diff <= updated * cfg["lr"] * 1.03
    os.remove(os.path.join(out, "eval.json"))
    assert evaluate_cli.main(["--ckpt", out, "--n_test=3"]) == 0
    result = json.load(open(os.path.join(out, "eval.json")))
    answered = result["causes"].get("answer", 0)                # only an answer can succeed
    assert result["n_tasks"] == sum(result["causes"].values()) == 3 and result["executed_tasks"] == 3
    assert round(result["success"] * 3, 9).is_integer() and result["success"] * 3 <= answered + 1e-9


def test_resume_from_a_chat_checkpoint_missing_its_template_names_the_file(tmp_path, monkeypatch, capsys):
    # --resume reads the checkpoint's own template (the run's, saved by save_pretrained); without its
    # chat_template.jinja the line names the damaged checkpoint and the file, exit 2, every file kept
    # (before: the template "cannot render a tool conversation", as if the config were at fault)
    monkeypatch.setattr(chat_reward, "chat_reward", lambda e, t, judge=None: float(len(e["ids"]) % 2))
    tiny_qwen(TOK, tmp_path / "qwen", init_range=POSITION_INIT)
    overrides = [f"--model={tmp_path / 'qwen'}", f"--out_dir={tmp_path / 'run'}", "--max_act_tokens=12",
                 "--max_tokens=640", "--rl_steps=1"]
    monkeypatch.chdir(ROOT)
    config_path = os.path.join(ROOT, "configs", "chat_tiny.yaml")
    assert train.run(config.load_config(config_path, overrides)) == 0
    ckpt = tmp_path / "run" / "ckpt"
    (ckpt / "chat_template.jinja").unlink()
    files = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    capsys.readouterr()
    assert train.main(["--config", config_path, *overrides, "--rl_steps=2", "--resume"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: cannot load the checkpoint in {ckpt}: {ckpt / 'chat_template.jinja'} is missing (the chat template "
        "a format: chat run saves with its checkpoints)"]
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == files


def test_max_tokens_shorter_than_a_prompt_is_one_line(tmp_path, capsys):
    tiny_qwen(TOK, tmp_path / "qwen")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"format: chat\nmodel: {tmp_path / 'qwen'}\ntasks_file: {ROOT}/data/toy_chat_example.jsonl\n"
                   f"out_dir: {tmp_path / 'run'}\nmax_tokens: 100\ntasks_per_step: 2\n")
    assert train.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_tokens (100) leaves no room" in err[0]


def test_evaluation_of_tasks_without_an_executor_scores_by_criteria_and_judge(tmp_path):
    """A task with no env: the policy rehearses the response; the episode is right on answer and
    gold call, so its success is the judge's mean p(yes) over the checklist (a tiny random Qwen2
    judge loaded from judge_model)."""
    tiny_qwen(TOK, tmp_path / "judge", seed=5)
    task = {k: v for k, v in pay_task(checklist=["Did it pay 3?", "Is 6 left?"]).items() if k != "env"}
    tags = chat.chat_format(TOK)
    prompts, _ = chat_setup.episode_inputs(TOK, tags, [dict(task)])
    script = chat.assemble(TOK, tags, prompts[0], [{"name": "pay", "arguments": {"amount": 3}}], ["6"], "6")
    cfg = {**config.DEFAULTS, "format": "chat", "judge_model": str(tmp_path / "judge"), "max_act_tokens": 40,
           "max_tokens": 200}
    fmt, setting = features.setup(cfg, TOK, {"logged": [], "rl": [task], "test": [task]})   # loads the judge
    result = evaluate.evaluate(Script(script["ids"][len(prompts[0]):]), TOK, [task], cfg, fmt, setting)
    judge = checkpoint.load_policy(str(tmp_path / "judge"))[0]
    transcript = 'call: {"name": "pay", "arguments": {"amount": 3}}\nresult: 6\nanswer: 6'
    want = [yes_by_hand(judge, judge_prompt_by_hand("pay 3", transcript, q)) for q in task["checklist"]]
    assert result["causes"] == {"answer": 1} and result["rehearsed_tasks"] == 1
    assert result["success"] == pytest.approx(sum(want) / 2, rel=1e-5)
    assert result["executed_tasks"] == 0 and result["fidelity"] == {}


def test_the_qwen3_config_runs_its_keys_together_on_a_tiny_model(tmp_path, monkeypatch):
    """configs/qwen3-1.7b.yaml (chat format, gradient checkpointing, KL 1e-4 to the reference,
    lr 1e-6, dual clip) with only the model and the sizes swapped for a tiny random Qwen2: a step
    runs, updates and logs the reference KL of the act tokens."""
    monkeypatch.setattr(chat_reward, "chat_reward", lambda e, t, judge=None: float(len(e["ids"]) % 2))
    tiny_qwen(TOK, tmp_path / "qwen")
    overrides = [f"--model={tmp_path / 'qwen'}", f"--out_dir={tmp_path / 'run'}", "--rl_steps=1",
                 "--tasks_per_step=2", "--group_size=4", "--max_act_tokens=12", "--max_env_tokens=12",
                 "--max_tokens=640", "--micro_batch_tokens=2048", "--eval_every=0", "--temperature=2.0"]
    monkeypatch.chdir(ROOT)
    cfg = config.load_config(os.path.join(ROOT, "configs", "qwen3-1.7b.yaml"), overrides)
    assert cfg["gradient_checkpointing"] and cfg["kl_coef"] == 1e-4 and cfg["format"] == "chat"
    assert train.run(cfg) == 0
    [line] = [json.loads(text) for text in open(os.path.join(cfg["out_dir"], "metrics.jsonl"))]
    # the one step's policy is its reference (no warm start, no update before it): KL 0 up to rounding
    assert line["status"] == "updated" and line["kl_ref_act"] < 1e-9 and line["kl_ref"] < 1e-9
    assert_ratio_one([line], kl_coef=cfg["kl_coef"])
