"""The tool cache (worldmodel/toolcache.py), the grounding source of separate rehearse prompts:
retrieval (an exact call first, then the same tool's nearest arguments, k of them, ties by first
seen, none for a tool with no traffic), the coverage report of eval.json, the training path (a
chat task's own reference examples first), and that in evaluation no rehearse prompt ever holds
a test task's gold results, for the plain and the chat format."""
import json
from types import SimpleNamespace

import torch
from transformers import LlamaConfig

from chat import format as chat
from worldmodel import chat_separate
from formats import features
from formats import format_plain
from formats import format_plain_separate
from formats.setting import ChatSetting, ChoiceSetting, PlainSetting, Setting, UncertainSetting
from machinery import config
from scripts import evaluate_cli
from machinery.checkpoint import build_tokenizer
from worldmodel import honesty, separate, toolcache
import evaluate
import world
from envace import ACT, OBS, REHEARSE, encode, tag_ids
from rollout import sample_episodes
from helpers import chat_tokenizer, scripted_rows

# ----------------------------------------------------------------------------- retrieval

TRAFFIC = [("price milk", "2"), ("mul 3 , 4", "12"), ("price jam", "8"), ("mul 2 , 4", "8"), ("mul 3 , 5", "15"),
           ("mul 3 , 4", "12"), ("pay 3", "6"), ("pay 3", "3")]
CACHE = toolcache.build(TRAFFIC, toolcache.plain_call)


def test_an_exact_call_comes_first_then_the_nearest_arguments():
    # mul 3 , 4: itself (distance 0), then mul 2 , 4 and mul 3 , 5 (1 each: the first seen first)
    assert toolcache.examples(CACHE, "mul 3 , 4", 2) == [("mul 3 , 4", "12"), ("mul 2 , 4", "8")]
    assert toolcache.examples(CACHE, "mul 3 , 4", 3) == [("mul 3 , 4", "12"), ("mul 2 , 4", "8"), ("mul 3 , 5", "15")]
    # mul 2 , 5: mul 2 , 4 and mul 3 , 5 differ in one argument, mul 3 , 4 (seen first) in two
    assert toolcache.examples(CACHE, "mul 2 , 5", 3) == [("mul 2 , 4", "8"), ("mul 3 , 5", "15"), ("mul 3 , 4", "12")]
    # mul 7 , 7: all at distance 2, in the order first seen
    assert toolcache.examples(CACHE, "mul 7 , 7", 2) == [("mul 3 , 4", "12"), ("mul 2 , 4", "8")]
    assert toolcache.examples(CACHE, "price jam", 1) == [("price jam", "8")]
    assert toolcache.examples(CACHE, "price egg", 1) == [("price milk", "2")]


def test_k_limits_and_a_tool_with_no_traffic_gets_none():
    assert toolcache.examples(CACHE, "price egg", 5) == [("price milk", "2"), ("price jam", "8")]   # only two
    assert toolcache.examples(CACHE, "mul 3 , 4", 0) == []
    assert toolcache.examples(toolcache.build(TRAFFIC[:2], toolcache.plain_call), "pay 3", 3) == []
    assert toolcache.examples(None, "pay 3", 3) == []


def test_each_distinct_pair_once_a_stateful_call_with_each_response():
    assert toolcache.examples(CACHE, "pay 3", 3) == [("pay 3", "6"), ("pay 3", "3")]
    assert toolcache.examples(CACHE, "mul 3 , 4", 2) == [("mul 3 , 4", "12"), ("mul 2 , 4", "8")]   # logged twice
    assert [toolcache.times_seen(CACHE, c) for c in ("mul 3 , 4", "pay 3", "price milk", "mul 9 , 9")] == [2, 2, 1, 0]
    assert toolcache.counts_of(CACHE, ["mul 3 , 4", "price egg"]) == {"mul 3 , 4": 2, "price egg": 0}


def test_chat_calls_match_by_name_and_arguments_whatever_their_order():
    def mul(**arguments):
        return {"name": "mul", "arguments": arguments}
    cache = toolcache.build([(mul(a=3, b=4), "12"), (mul(b=4, a=2), "8"), (mul(a=3, b="4"), "x"), (mul(a=2), "2")],
                            toolcache.chat_call)
    assert toolcache.examples(cache, mul(b=4, a=3), 1) == [(mul(a=3, b=4), "12")]
    assert toolcache.times_seen(cache, json.dumps(mul(b=4, a=3))) == 1          # a call's JSON text too
    # a missing argument differs (mul(a=3) is 1 from a=3, b=4 and 2 from a=2, b=4); 4 is not "4"
    assert toolcache.examples(cache, mul(a=3), 2) == [(mul(a=3, b=4), "12"), (mul(a=3, b="4"), "x")]
    assert toolcache.examples(cache, mul(a=2, b=4), 3) == [(mul(b=4, a=2), "8"), (mul(a=3, b=4), "12"), (mul(a=2), "2")]
    # `first` (a training task's own examples) first, then the cache less what `first` holds
    own = [(mul(a=2, b=4), "8"), (mul(a=9, b=9), "81")]
    assert toolcache.examples(cache, mul(a=2, b=4), 3, own) == own + [(mul(a=3, b=4), "12")]
    assert toolcache.examples(cache, mul(a=2, b=4), 1, own) == own[:1]
    assert toolcache.examples(cache, {"name": "pay", "arguments": {"amount": 3}}, 2) == []


def test_fidelity_by_cache_splits_the_test_calls_seen_and_unseen():
    pairs = [("price milk", True), ("price egg", False), ("mul 3 , 4", False), ("mul 3 , 4", True)]
    got = honesty.fidelity_by_cache(pairs, CACHE, honesty.by_kind)
    assert got == {"cache_coverage": {"seen": 3, "unseen": 1, "rate": 0.75},
                   "fidelity_by_cache": {"seen": {"lookup": [1, 1], "compute": [1, 2]},
                                         "unseen": {"lookup": [0, 1]}}}
    assert honesty.fidelity_by_cache([], CACHE, honesty.by_kind)["cache_coverage"] == {"seen": 0, "unseen": 0,
                                                                                       "rate": None}
    assert honesty.fidelity_by_cache(pairs, None, honesty.by_kind) == {}


# ----------------------------------------------------------------------------- what each path reads

class Caller(torch.nn.Module):
    """A fake LM: a row whose ids open with `mark` (a rehearse row) writes `rehearse`, any other
    (an actor row) `actor`, token by token after its prefill (forced ids are the sampler's
    business); a teacher-forced pass gets zeros."""

    def __init__(self, vocab, mark, actor, rehearse):
        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.mark, self.scripts = vocab, list(mark), [list(actor), list(rehearse)]

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        B, T = input_ids.shape
        if cache is None:
            return SimpleNamespace(logits=torch.zeros(B, T, self.vocab))
        real = attention_mask[:, -T:].bool()
        who, k = scripted_rows(input_ids, attention_mask, cache, lambda b: int(
            input_ids[b][real[b]].tolist()[:len(self.mark)] == self.mark))
        logits = torch.full((B, T, self.vocab), -1e4)
        for b, i in enumerate(who):
            logits[b, -1, self.scripts[i][min(k[b], len(self.scripts[i]) - 1)]] = 0.0
        return SimpleNamespace(logits=logits)


def record_prompts(monkeypatch, module, name, text):
    """Every prompt `module.name` builds, as text."""
    built, build = [], getattr(module, name)

    def spy(*args, **kw):
        ids = build(*args, **kw)
        built.append(text(ids))
        return ids
    monkeypatch.setattr(module, name, spy)
    return built


def evaluation_prompts(monkeypatch, module, name, text, model, tokenizer, tests, cfg, fmt, setting, tmp_path):
    """The rehearse prompts of an evaluation (would-rehearse rows, test-time rehearsal, the imagined
    world) and of --coverage (the warm start's and the policy's), and the evaluation's result."""
    built = record_prompts(monkeypatch, module, name, text)
    result = evaluate.evaluate(model, tokenizer, tests, cfg, fmt, setting)
    n = len(built)
    evaluate_cli.measure(SimpleNamespace(coverage=True, ckpt=str(tmp_path)), cfg, model, tokenizer, tests, fmt,
                         setting, None, model)
    return built[:n], built[n:], result


SENTINEL = "sentinel"


def test_plain_evaluation_never_renders_a_test_tasks_gold_results(monkeypatch, tmp_path):
    """Training traffic: one logged episode (price apple -> 3, pay 3 -> 6). Two test tasks whose
    results, examples and answer are the sentinel. The policy prices apple and pays 3 in every
    episode; it rehearses 3 each time. Rehearse prompts: the would-rehearse rows (2 tasks x 2
    calls), private rehearsal (budget 1: 2 x 2), fidelity by coverage on the expert's calls (2 x 2),
    the imagined world (2 x 2), then --coverage (2 x 2, before and after): none holds the sentinel."""
    tok = build_tokenizer(world.WORDS + separate.SEPARATE_WORDS + [SENTINEL])
    tags = tag_ids(tok)
    cfg = {**config.DEFAULTS, "rehearsal_context": "separate", "grounding_examples": 2, "snippet_repeats": 0,
           "rehearsal_budget": 1, "n_collusion": 2, "max_tokens": 96}
    gold = {"prompt": "buy apple", "calls": ["price apple", "pay 3"], "answer": "6", "family": "buy1"}
    tests = [{**gold, "answer": SENTINEL, "responses": [SENTINEL] * 2, "examples": [("price apple", SENTINEL)]}
             for _ in range(2)]
    fmt, setting = features.setup(cfg, tok, {"logged": [gold], "rl": [gold], "test": tests})
    actor = "<act> price apple </act> <env> 3 </env> <act> pay 3 </act> <env> 6 </env> <act> answer 6 </act>"
    model = Caller(len(tok), tags["bos"] + encode(tok, "rehearse"), tok.convert_tokens_to_ids(actor.split()),
                   tok.convert_tokens_to_ids(["3", "</env>"]))
    evaluated, covered, result = evaluation_prompts(
        monkeypatch, separate, "rehearse_prompt", lambda ids: " ".join(tok.convert_ids_to_tokens(ids)),
        model, tok, tests, cfg, fmt, setting, tmp_path)
    assert result["executed_tasks"] == 2 and result["imagined_per_task"] == 1 and result["collusion"]["calls"] == 4
    assert (len(evaluated), len(covered)) == (16, 8)
    assert [p for p in evaluated + covered if SENTINEL in p.split()] == []
    # the prompts are grounded: the cache's exact pair comes first
    assert evaluated[0].startswith("<bos> rehearse price item example <act> price apple </act> <env> 3 </env>")
    # both test calls are in the training traffic
    assert result["cache_coverage"] == {"seen": 4, "unseen": 0, "rate": 1.0}


PAY = {"type": "function", "function": {"name": "pay", "parameters": {
    "type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}}}
PAY3, PAY1, PAY2, PAY4 = ({"name": "pay", "arguments": {"amount": n}} for n in (3, 1, 2, 4))
MESSAGES = [{"role": "user", "content": "pay 3"}]


def chat_splits():
    """Training: an RL task with its reference examples (pay 1 -> 8, pay 4 -> 5) and a logged trajectory
    (pay 3 -> 6, pay 2 -> 4). Test: two tasks with the toy executor and one with none, each
    with the sentinel as its examples' results and its answer."""
    rl = {"messages": MESSAGES, "tools": [PAY], "answer": "6", "gold_calls": [PAY3], "env": "toy",
          "examples": [(PAY1, "8"), (PAY4, "5")], "family": "pay"}
    logged = {"messages": MESSAGES, "tools": [PAY], "call_dicts": [PAY3, PAY2],
              "calls": [json.dumps(PAY3), json.dumps(PAY2)], "responses": ["6", "4"], "answer": "4"}
    test = {**rl, "answer": SENTINEL, "examples": [(PAY3, SENTINEL), (PAY2, SENTINEL)]}
    no_executor = {k: v for k, v in test.items() if k != "env"}
    return {"logged": [logged], "rl": [rl], "test": [dict(test), dict(test), no_executor]}


def chat_caller(tok, tags):
    """The fake policy: calls pay 3, answers 6; in a rehearse row writes 6."""
    mark = chat_separate.rehearse_prompt_ids(tok, chat_splits()["rl"][0], [], PAY3)[:8]
    prompt = chat.prompt_ids(tok, MESSAGES, [PAY])
    assert prompt[:8] != mark
    actor = chat.assemble(tok, tags, prompt, [PAY3], ["6"], "6")["ids"][len(prompt):]
    return Caller(len(tok), mark, actor, encode(tok, "6") + [tags["act_end"]])


def test_chat_evaluation_never_renders_a_test_tasks_gold_results(monkeypatch, tmp_path):
    """Rehearse prompts: the would-rehearse rows (2 tasks with an executor x 1 call), the task with
    no executor rehearsed by the policy (1), the imagined world (2), then --coverage on the gold
    calls (2, before and after): none holds the sentinel (the test tasks' examples' results)."""
    tok = chat_tokenizer()
    tags = chat.chat_format(tok)
    cfg = {**config.DEFAULTS, "format": "chat", "rehearsal_context": "separate", "grounding_examples": 2,
           "max_act_tokens": 40, "max_env_tokens": 8, "max_tokens": 300, "n_collusion": 3}
    splits = chat_splits()
    fmt, setting = features.setup(cfg, tok, splits)
    evaluated, covered, result = evaluation_prompts(monkeypatch, chat_separate, "rehearse_prompt_ids", tok.decode,
                                                    chat_caller(tok, tags), tok, splits["test"], cfg, fmt, setting,
                                                    tmp_path)
    assert (result["executed_tasks"], result["rehearsed_tasks"], result["imagined_tasks"]) == (2, 1, 2)
    assert (len(evaluated), len(covered)) == (5, 4)
    assert [p for p in evaluated + covered if SENTINEL in p] == []
    # grounded by the training traffic: pay 3 -> 6 (exact), then pay 2 -> 4 (first seen at distance 1)
    assert all('Examples:\n{"arguments": {"amount": 3}, "result": "6"}\n{"arguments": {"amount": 2}, "result": "4"}'
               in p for p in evaluated + covered)
    assert result["cache_coverage"] == {"seen": 2, "unseen": 0, "rate": 1.0}


# ----------------------------------------------------------------------------- the training path

def examples_shown(text):
    return [json.loads(line) for line in text.split("Examples:\n")[1].split("<|im_end|>")[0].split("\n")]


def test_training_puts_a_tasks_own_examples_first_evaluation_the_cache_only():
    """k 3; the cache: pay 3 -> 6, pay 2 -> 4 (logged), pay 1 -> 8, pay 4 -> 5 (the RL task's).
    RL's prompt for the RL task's pay 3: its own pay 1 -> 8 and pay 4 -> 5, then the cache's
    nearest, pay 3 -> 6 (exact); evaluation's prompt for the same call: the cache only, pay 3 -> 6,
    then at distance 1 the first seen, pay 2 -> 4 and pay 1 -> 8. The warm-start row of the task's
    example pay 1: its own two, then pay 3 -> 6 (the cache alone: pay 1, pay 3, pay 2)."""
    tok = chat_tokenizer()
    tags = chat.chat_format(tok)
    cfg = {**config.DEFAULTS, "format": "chat", "rehearsal_context": "separate", "grounding_examples": 3}
    fmt, setting = features.setup(cfg, tok, chat_splits())
    task = chat_splits()["rl"][0]
    actor, world_ = {"calls": [json.dumps(PAY3)], "responses": []}, chat.task_world(task, tags)
    rl = examples_shown(tok.decode(setting.rl_sampler_args["rehearse_prompt"](actor, world_)))
    shown = examples_shown(tok.decode(setting.sampler_args["rehearse_prompt"](actor, world_)))
    assert [(e["arguments"]["amount"], e["result"]) for e in rl] == [(1, "8"), (4, "5"), (3, "6")]
    assert [(e["arguments"]["amount"], e["result"]) for e in shown] == [(3, "6"), (2, "4"), (1, "8")]
    *logged_rows, example_rows = fmt.warm_start_sequences(setting)
    row = example_rows["rows"][0]
    assert [(e["arguments"]["amount"], e["result"]) for e in examples_shown(tok.decode(row["ids"]))] == \
        [(1, "8"), (4, "5"), (3, "6")]


def test_rl_samples_with_the_training_arguments_evaluation_with_its_own():
    calls = []

    def sampler(model, tokenizer, prompts, mode, **kw):
        calls.append((mode, kw["source"]))
        return []
    setting = Setting(env_mode="rehearse", sampling={}, tokenizer=None, tags=None, sampler=sampler,
                      sampler_args={"source": "cache"}, rl_sampler=sampler, rl_sampler_args={"source": "own first"})
    format_plain_separate.rl_sample(setting, None, None, [], None, None, None, None)
    format_plain.sample(setting, None, None, [], "rehearse")
    assert calls == [("rehearse", "own first"), ("rehearse", "cache")]
    # the plain format has no task examples: its RL arguments are evaluation's
    cfg = {**config.DEFAULTS, "rehearsal_context": "separate", "grounding_examples": 1, "snippet_repeats": 0}
    tok = build_tokenizer(world.WORDS + separate.SEPARATE_WORDS)
    plain = format_plain_separate.setup(cfg, tok, {"logged": []})
    assert plain.sampler is plain.rl_sampler is separate.sample_separate
    assert plain.rl_sampler_args is plain.sampler_args
    assert plain.sampler_args["examples"].func is toolcache.examples
    # the real world (or none) answers RL's calls in the inline sampler, whatever the layout
    for mode in ("real", "none"):
        real = format_plain_separate.setup({**cfg, "env_mode": mode}, tok, {"logged": []})
        assert (real.sampler, real.rl_sampler, real.rl_sampler_args) == (separate.sample_separate, sample_episodes, {})


def test_no_grounding_no_examples():
    """grounding_examples 0 (the demo's): every prompt as before, with no example."""
    tok = chat_tokenizer()
    tags = chat.chat_format(tok)
    cfg = {**config.DEFAULTS, "format": "chat", "rehearsal_context": "separate", "grounding_examples": 0}
    fmt, setting = features.setup(cfg, tok, chat_splits())
    task = chat_splits()["rl"][0]
    actor, world_ = {"calls": [json.dumps(PAY3)], "responses": []}, chat.task_world(task, tags)
    bare = chat_separate.rehearse_prompt_ids(tok, task, [], PAY3)
    for args in (setting.sampler_args, setting.rl_sampler_args):
        assert args["rehearse_prompt"](actor, world_) == bare
    plain = format_plain_separate.setup({**config.DEFAULTS, "rehearsal_context": "separate", "snippet_repeats": 0},
                                        build_tokenizer(world.WORDS + separate.SEPARATE_WORDS),
                                        {"logged": [{"prompt": "buy apple", "calls": ["price apple"], "answer": "3"}]})
    assert plain.examples("price apple") == []


def test_every_format_sets_up_a_typed_setting_with_no_config_inside():
    """features.setup returns each format's own Setting dataclass; every config key a function
    needs was read at setup into a field (no field holds the config); the layout is chosen once,
    as a module: its sampler and warm-start roles, with nothing left to branch on."""
    from worlds import choice as world_choice
    toy = build_tokenizer(world.WORDS + separate.SEPARATE_WORDS + world_choice.NEW_WORDS)
    toy_splits = world.make_splits(0, 4, 0, 4, 2)
    cases = [({}, toy, toy_splits, "format_plain", PlainSetting, sample_episodes),
             ({"rehearsal_context": "separate", "grounding_examples": 1}, toy, toy_splits, "format_plain_separate",
              PlainSetting, separate.sample_separate),
             ({"world": "uncertain"}, toy, toy_splits, "format_uncertain", UncertainSetting, sample_episodes),
             ({"world": "choice", "n_test": 2, "n_logged": 4, "n_rl_tasks": 4}, toy, None, "format_choice",
              ChoiceSetting, world_choice.sample_with_memory),
             ({"format": "chat"}, chat_tokenizer(), chat_splits(), "format_chat", ChatSetting, sample_episodes),
             ({"format": "chat", "rehearsal_context": "separate"}, chat_tokenizer(), chat_splits(),
              "format_chat_separate", ChatSetting, separate.sample_separate)]
    for keys, tok, splits, module, kind, sampler in cases:
        cfg = {**config.DEFAULTS, "snippet_repeats": 1, **keys}
        fmt, setting = features.setup(cfg, tok, splits or features.build_tasks(cfg))
        assert fmt.__name__ == "formats." + module and type(setting) is kind and setting.sampler is sampler
        assert not any(value is cfg or (isinstance(value, dict) and value.keys() >= cfg.keys())
                       for value in vars(setting).values()) and "cfg" not in vars(setting)
        assert fmt.warm_start_roles(setting) == ((ACT, REHEARSE) if "separate" in module else (ACT, REHEARSE, OBS))
