"""Executors for chat tasks (chat/executor.py, chat/tasks.py `env`): a tiny bank of the tests' own, loaded from
a file next to the task file; its calls, state, errors, refusals and time limit; bad specs and
env_config; then real-mode sampling, fidelity, collusion and train.py / evaluate.py with it."""
from reporting import metrics
from scripts import evaluate_cli
import itertools
import json
import os
import types

import pytest
import torch

from machinery import config
from chat import executor

BANK = '''
import time


class Bank:
    """A bank account: deposit, withdraw (an error past the balance), the owner, a slow call."""

    def __init__(self, balance=10, owner="ann"):
        self.balance, self.owner = balance, owner

    def deposit(self, amount):
        self.balance += amount
        return {"balance": self.balance}

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError(f"insufficient funds: {self.balance} left")
        self.balance -= amount
        return {"balance": self.balance}

    def owner_name(self):
        return self.owner

    def slow(self, seconds):
        time.sleep(seconds)
        return "done"

    def _secret(self):
        return "leaked"


class Broken:
    def __init__(self, balance):
        raise RuntimeError("no database")
'''


@pytest.fixture
def bank_dir(tmp_path):
    (tmp_path / "bank.py").write_text(BANK)
    return tmp_path


TOOLS = ("deposit", "withdraw", "owner_name", "slow")


def call(name, **arguments):
    return {"name": name, "arguments": arguments}


def test_load_object_by_path_and_by_module(bank_dir):
    Bank = executor.load_object("bank.py:Bank", str(bank_dir))
    assert executor.load_object(str(bank_dir / "bank.py") + ":Bank", "/elsewhere") is Bank   # absolute, loaded once
    assert Bank(balance=3).balance == 3
    assert executor.load_object("json:dumps", ".") is json.dumps


@pytest.mark.parametrize("spec, problem", [
    ("bank.py", "expected 'MODULE:CLASS' or 'path/to/file.py:CLASS'"),
    ("bank.py:", "expected 'MODULE:CLASS'"),
    ("nowhere.py:Bank", "file not found: "),
    ("bank.py:Vault", "bank.py has no class or function 'Vault'"),
    ("no_such_module_xyz:Bank", "cannot import module 'no_such_module_xyz'"),
    ("bad.py:Bank", "loading "),
])
def test_a_bad_spec_is_one_config_error_line(bank_dir, spec, problem):
    (bank_dir / "bad.py").write_text("raise ImportError('needs a key')\n")
    with pytest.raises(config.ConfigError) as e:
        executor.load_object(spec, str(bank_dir))
    assert problem in str(e.value) and "\n" not in str(e.value) and spec in str(e.value)
    if spec == "bad.py:Bank":
        assert "ImportError: needs a key" in str(e.value)


def test_calls_keep_state_and_errors_are_responses(bank_dir):
    bank = executor.load_object("bank.py:Bank", str(bank_dir))(balance=5, owner="bo")
    run = lambda c: executor.call_tool(bank, c, TOOLS, 5.0)
    assert run(call("deposit", amount=3)) == '{"balance": 8}'              # not a str: json.dumps
    assert run(call("withdraw", amount=20)) == '{"error": "ValueError: insufficient funds: 8 left"}'
    assert run(call("withdraw", amount=6)) == '{"balance": 2}'             # the error changed nothing
    assert run(call("owner_name")) == "bo"                                 # a str: as is
    assert run(call("deposit", amount=1, note="x")).startswith('{"error": "TypeError: ')
    assert run(call("_secret")) == '{"error": "UnknownTool: no tool named \'_secret\'"}'
    assert run(call("balance")) == '{"error": "UnknownTool: no tool named \'balance\'"}'   # not in tools
    assert executor.call_tool(bank, call("_secret"), ("_secret",), 5.0).startswith('{"error": "UnknownTool')
    assert bank.balance == 2


def test_a_call_past_the_time_limit_is_an_error_response(bank_dir):
    bank = executor.load_object("bank.py:Bank", str(bank_dir))()
    assert executor.call_tool(bank, call("slow", seconds=0.3), TOOLS, 0.05) == \
        '{"error": "TimeoutError: slow took longer than 0.05 s"}'
    assert executor.call_tool(bank, call("slow", seconds=0.0), TOOLS, 5.0) == "done"




def run_script(tmp_path, body):
    """Run `body` (Python, executor importable) as a script of its own: (exit status, stdout,
    stderr). The 60 s limit only guards the suite against a hang (a failure, not a timing)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "script.py").write_text(f"import sys\nsys.path.insert(0, {root!r})\nfrom chat import executor\n" + body)
    done = subprocess.run([sys.executable, str(tmp_path / "script.py")], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def test_a_tool_that_hangs_does_not_keep_the_process_alive(tmp_path):
    """The time limit answers an error and leaves the call running in its thread; that thread
    must not keep the process alive once the run is over (a daemon thread): a script calling a
    tool that never returns prints the time-out response and exits 0 at once."""
    assert run_script(tmp_path, """
import threading


class Stuck:
    def wait(self):
        threading.Event().wait()          # never returns


print(executor.call_tool(Stuck(), {"name": "wait", "arguments": {}}, ("wait",), 0.2))
""") == (0, '{"error": "TimeoutError: wait took longer than 0.2 s"}\n', "")


def test_a_tool_that_exits_gives_an_error_response(tmp_path):
    """sys.exit() inside a tool (SystemExit is no Exception) ends its thread with neither a value
    nor an error: the call answers an error response at once, prints nothing else, and the
    process and the instance go on (a second call, then the script's own last line)."""
    assert run_script(tmp_path, """
class Quitter:
    calls = 0

    def quit(self, code):
        self.calls += 1
        sys.exit(code)


tool = Quitter()
for code in (0, 3):
    print(executor.call_tool(tool, {"name": "quit", "arguments": {"code": code}}, ("quit",), 30.0))
print("still running after", tool.calls, "calls")
""") == (0, '{"error": "RuntimeError: quit ended without a result"}\n' * 2 + "still running after 2 calls\n", "")

def test_normalised_responses():
    assert executor.same_response('{"b": 1,  "a": [2, 3]}', '{"a": [2, 3], "b": 1}')
    assert executor.same_response(" 6\n", "6") and executor.same_response("sunny ", "sunny")
    assert not executor.same_response('{"a": 1}', '{"a": 2}')
    assert not executor.same_response("Sunny", "sunny")
    assert executor.is_error('{"error": "ValueError: x"}') and executor.is_error("error funds")
    assert not executor.is_error('{"balance": 1}') and not executor.is_error("[1]")


# ----------------------------------------------------------------------------- chat task lines with env

from chat import format as chat  # noqa: E402  (the chat part of the file)
from worldmodel import chat_honesty  # noqa: E402
from chat import chat_reward  # noqa: E402
from chat import setup as chat_setup  # noqa: E402
from chat import tasks as chat_tasks  # noqa: E402
import evaluate        # noqa: E402
from formats import features  # noqa: E402
from machinery import taskfiles  # noqa: E402
import train           # noqa: E402
from envace import OBS, REHEARSE, TAG  # noqa: E402
from helpers import POSITION_INIT, assert_ratio_one, scripted_rows, tiny_qwen  # noqa: E402
from worldmodel import honesty  # noqa: E402
from rollout import sample_episodes  # noqa: E402
from test_chat import TOK, Script  # noqa: E402

AMOUNT = {"type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}
BANK_TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} coins", "parameters": AMOUNT}}
              for n in ("deposit", "withdraw")]


def bank_line(**kw):
    return {"messages": [{"role": "user", "content": "deposit 5 and withdraw 8"}], "tools": BANK_TOOLS,
            "answer": "2", "gold_calls": [call("deposit", amount=5), call("withdraw", amount=8)],
            "call_order": "any", "env": "bank.py:Bank", "env_config": {"balance": 5}, **kw}


def write_tasks(folder, lines, name="tasks.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def read_one(folder, **kw):
    (task,) = chat_tasks.read_chat_jsonl(write_tasks(folder, [bank_line(**kw)]), "tasks")
    return task


def test_a_task_line_with_env_constructs_its_executor(bank_dir):
    task = read_one(bank_dir)
    assert task["env"] == "bank.py:Bank" and task["env_config"] == {"balance": 5} and chat.has_executor(task)
    assert chat.has_executor({**task, "env": "toy"}) and not chat.has_executor({"messages": []})
    w = chat.task_world(task, {"env_pre": "\n", "act_pre": ""})
    state = w.new_state()
    assert state.balance == 5 and w.TOOL_KINDS == {"deposit": "deposit", "withdraw": "withdraw"}
    # state across the calls of an episode; an exception is the response and the next call goes on
    steps = [call("withdraw", amount=8), call("deposit", amount=5), call("withdraw", amount=8)]
    assert [w.step(state, json.dumps(c)) for c in steps] == [
        '{"error": "ValueError: insufficient funds: 5 left"}', '{"balance": 10}', '{"balance": 2}']
    assert w.new_state().balance == 5                                  # a fresh instance per episode
    assert w.replay([json.dumps(c) for c in steps[1:]]) == ['{"balance": 10}', '{"balance": 2}']
    assert w.step(state, json.dumps(call("owner_name"))).startswith('{"error": "UnknownTool')   # not a tool


@pytest.mark.parametrize("change, problem", [
    ({"env": "bank.py:Vault"}, "line 1: env 'bank.py:Vault': bank.py has no class or function 'Vault'"),
    ({"env": "nowhere.py:Bank"}, "line 1: env 'nowhere.py:Bank': file not found: "),
    ({"env": "bank"}, "line 1: env \"bank\": expected 'MODULE:CLASS'"),
    ({"env": 3}, "line 1: 'env' must be 'toy', 'MODULE:CLASS' or 'path/to/file.py:CLASS', got 3"),
    ({"env_config": [5]}, "line 1: 'env_config' must be a JSON object (the keyword arguments of bank.py:Bank), got [5]"),
    ({"env_config": {"rate": 2}}, "line 1: env 'bank.py:Bank': Bank(**env_config) raised TypeError: "),
    ({"env": "bank.py:Broken"}, "line 1: env 'bank.py:Broken': Broken(**env_config) raised RuntimeError: no database"),
    ({"env": "toy"}, "line 1: 'env_config' is given but 'env' names no executor class"),
    ({"tools": BANK_TOOLS + [{"name": "close", "parameters": {"type": "object"}}]},
     "line 1: env 'bank.py:Bank' has no method for tool(s) close"),
])
def test_a_bad_env_or_env_config_is_one_line_naming_file_line_and_spec(bank_dir, change, problem):
    with pytest.raises(taskfiles.DataError) as e:
        read_one(bank_dir, **change)
    assert problem in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith(str(bank_dir))


def test_a_bad_env_stops_train_with_one_line_exit_2(bank_dir, capsys):
    path = write_tasks(bank_dir, [bank_line(), bank_line(env="bank.py:Vault")])
    cfg = bank_dir / "c.yaml"
    cfg.write_text(f"format: chat\nmodel: {bank_dir / 'nowhere'}\ntasks_file: {path}\n")
    assert train.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tasks.jsonl line 2: env 'bank.py:Vault': bank.py has no class" in err[0]


def test_env_mode_real_needs_an_executor_for_every_rl_task(bank_dir):
    plain = {k: v for k, v in bank_line().items() if k not in ("env", "env_config")}
    path = write_tasks(bank_dir, [bank_line(), plain])
    cfg = {**config.DEFAULTS, "format": "chat", "tasks_file": path, "env_mode": "real"}
    with pytest.raises(config.ConfigError, match="line|has tasks without one"):
        chat_setup.chat_tasks(cfg)
    assert len(chat_setup.chat_tasks({**cfg, "tasks_file": write_tasks(bank_dir, [bank_line()] * 2)})["rl"]) == 2


def scripted(task, actions, responses, answer, n=1):
    """(tags, prompt, a Script model writing exactly this episode) for `task`."""
    tags = chat.chat_format(TOK)
    prompts, _ = chat_setup.episode_inputs(TOK, tags, [task])
    script = chat.assemble(TOK, tags, prompts[0], actions, responses, answer)["ids"][len(prompts[0]):]
    return tags, prompts[0], Script(script)


def test_real_mode_forces_the_executors_responses_as_obs(bank_dir):
    """withdraw 8 (insufficient funds: an error response), deposit 5, withdraw 8: the bank's own
    responses are forced as OBS (no loss; the script would have written {"balance": 3} last, of
    the same length, so that it stays aligned), the episode goes on after the error, and the
    second episode starts from a fresh bank (the same responses)."""
    task = read_one(bank_dir)
    actions = [call("withdraw", amount=8), call("deposit", amount=5), call("withdraw", amount=8)]
    real = ['{"error": "ValueError: insufficient funds: 5 left"}', '{"balance": 10}', '{"balance": 2}']
    tags, prompt, model = scripted(task, actions, real[:2] + ['{"balance": 3}'], "2")
    _, worlds = chat_setup.episode_inputs(TOK, tags, [task, task])
    episodes = sample_episodes(model, TOK, [prompt, prompt], "real", world=worlds,
                               settings={"tags": tags, "max_act_tokens": 40, "max_env_tokens": 40, "max_tokens": 400})
    for e in episodes:                                     # the same in both: a fresh bank each
        assert e["responses"] == real and e["cause"] == "answer" and e["answer"] == "2"
        assert e["calls"] == [json.dumps(c) for c in actions]
        # each response: its ids (response + "\n" + </tool_response>) as OBS, after the act->env TAG hand-off
        at = len(prompt)
        for k, response in enumerate(real):
            want = chat.encode(TOK, response + "\n") + [tags["env_end"]]
            at = next(t for t in range(at, len(e["ids"])) if e["roles"][t] == OBS)
            assert e["ids"][at:at + len(want)] == want and e["roles"][at:at + len(want)] == [OBS] * len(want)
            assert e["roles"][at - len(tags["env"]):at] == [TAG] * len(tags["env"])
            assert all(lp == 0.0 for lp in e["logprobs"][at:at + len(want)])
            at += len(want)
        assert REHEARSE not in e["roles"]
    assert chat_reward.chat_reward(episodes[0], task) == 0.0     # three calls against two gold calls


def test_replay_fidelity_and_collusion_against_the_executor_by_hand(bank_dir):
    """The bank at 5; gold (any order): deposit 5 -> {"balance": 10}, withdraw 8 -> {"balance": 2}; answer 2.
      A: withdraw 8 rehearsed {"balance": 2} (real: insufficient funds), deposit 5 rehearsed
         {"balance": 7} (real 10), answer 2: success; call 1 wrong AND colluding (its rehearsal is
         the path's value); call 2 real 10 is on the path (not wrong).
      B: deposit 5 -> {"balance":10} (written without the space: the same JSON), withdraw 8 -> 2, answer 2: nothing wrong.
      C: withdraw 8 -> the true error, deposit 5 -> 10, answer 10: call 1 wrong, no success.
    Fidelity per tool: withdraw A no, B yes, C yes: 2/3; deposit A no, B yes, C yes: 2/3.
    Collusion: 6 calls, 2 wrong, 1 colluding (rate 1/2). B after A: a fresh bank per replay."""
    task = read_one(bank_dir)
    chat_setup.episode_inputs(TOK, chat.chat_format(TOK), [task])
    W, D = json.dumps(call("withdraw", amount=8)), json.dumps(call("deposit", amount=5))
    funds = '{"error": "ValueError: insufficient funds: 5 left"}'
    episodes = [{"calls": [W, D], "responses": ['{"balance": 2}', '{"balance": 7}'], "answer": "2", "cause": "answer"},
                {"calls": [D, W], "responses": ['{"balance":10}', ' {"balance": 2}\n'], "answer": "2", "cause": "answer"},
                {"calls": [W, D], "responses": [funds, '{"balance": 10}'], "answer": "10", "cause": "answer"}]
    pairs = [(e, task) for e in episodes]
    assert [chat_reward.chat_reward(e, task) for e in episodes] == [1.0, 1.0, 0.0]
    assert chat_honesty.replay_fidelity(pairs) == {"withdraw": [2, 3], "deposit": [2, 3]}
    assert chat_honesty.collusion_counts(pairs) == {"calls": 6, "wrong": 2, "colluding": 1}
    sums = chat_honesty.diagnostics(episodes + [{"calls": [W], "responses": ["x"]}], [task] * 3 + [
        {**task, "env": ""}])                                   # a task without executor: left out
    assert sums == {"fidelity": {"withdraw": [2, 3], "deposit": [2, 3]},
                    "collusion": {"calls": 6, "wrong": 2, "colluding": 1}}


class Oracle(Script):
    """Script when sampling (a cache); in a teacher-forced pass (no cache) it predicts the next
    token of the one sequence it memorised, `known` (its prompt + script)."""

    def __init__(self, script, known):
        super().__init__(script)
        self.known = known

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        if cache is not None:
            return super().forward(input_ids, attention_mask, position_ids, cache, use_cache)
        B, T = input_ids.shape
        logits = torch.full((B, T, len(TOK)), -1e4)
        for t in range(T):
            logits[:, t, self.known[t + 1] if t + 1 < len(self.known) else 0] = 0.0
        return types.SimpleNamespace(logits=logits)


def test_evaluation_executes_and_measures_would_rehearse_fidelity_per_tool(bank_dir):
    """A policy that writes withdraw 8, deposit 5, withdraw 8, answer 2 and would have rehearsed
    the first two responses right and the third wrong ({"balance": 3}, real 2): evaluation runs
    the bank (success 1, executed 1), would-rehearse fidelity withdraw 1/2, deposit 1/1."""
    actions = [call("withdraw", amount=8), call("deposit", amount=5), call("withdraw", amount=8)]
    task = read_one(bank_dir, gold_calls=actions)
    funds = '{"error": "ValueError: insufficient funds: 5 left"}'
    tags, prompt, _ = scripted(task, actions, [funds, '{"balance": 10}', '{"balance": 3}'], "2")
    known = chat.assemble(TOK, tags, prompt, actions, [funds, '{"balance": 10}', '{"balance": 3}'], "2")["ids"]
    cfg = {**config.DEFAULTS, "format": "chat", "max_act_tokens": 40, "max_env_tokens": 40, "max_tokens": 400,
           "n_collusion": 0}
    fmt, setting = features.setup(cfg, TOK, {"logged": [], "rl": [task], "test": [task]})
    result = evaluate.evaluate(Oracle(known[len(prompt):], known), TOK, [task], cfg, fmt, setting)
    assert result["executed_tasks"] == 1 and result["rehearsed_tasks"] == 0 and result["success"] == 1.0
    assert result["fidelity_counts"] == {"withdraw": [1, 2], "deposit": [1, 1]}
    assert result["fidelity"] == {"deposit": 1.0, "withdraw": 0.5}
    assert evaluate.summary(result).startswith("success 1.000 on 1 tasks")
    # --coverage without pairs: the gold calls (the same three) replayed on a fresh bank, asked of
    # the model; no warm-start data saw them; the oracle would write the first two responses only
    assert fmt.coverage(setting, Oracle([0], known), TOK, [task]) == {"seen 0 times": [2, 3], "seen 1-49 times": [0, 0],
                                                            "seen 50+ times": [0, 0]}


class Writer(Script):
    """A fake LM that, teacher-forced (no cache), predicts the episode `known` except at OBS
    positions (token 0 there: no response is reproduced token for token); decoding from a prefix
    (a cache), it writes writes[len(prefix)], whatever it is fed."""

    def __init__(self, known, roles, writes):
        super().__init__([0])
        self.known, self.roles, self.writes = known, roles, writes

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        B, T = input_ids.shape
        logits = torch.full((B, T, len(TOK)), -1e4)
        if cache is None:
            for t in range(T - 1):
                logits[:, t, 0 if self.roles[t + 1] == OBS else self.known[t + 1]] = 0.0
            return types.SimpleNamespace(logits=logits)
        who, k = scripted_rows(input_ids, attention_mask, cache, lambda b: int(attention_mask[b].sum()))
        for b in range(B):
            script = self.writes[who[b]]
            logits[b, -1, script[min(k[b], len(script) - 1)]] = 0.0
        return types.SimpleNamespace(logits=logits)


def test_would_rehearse_fidelity_compares_responses_as_normalised_json(bank_dir):
    """deposit 5 -> {"balance": 10}, withdraw 8 -> {"balance": 2}. Greedy from each response's
    prefix, the model writes {"balance":10} (no space: the same JSON) and {"balance": 3} (not).
    Token for token neither is reproduced; normalised, the first is: fidelity [True, False]."""
    task = read_one(bank_dir)
    tags = chat.chat_format(TOK)
    prompts, _ = chat_setup.episode_inputs(TOK, tags, [task])
    actions, real = [call("deposit", amount=5), call("withdraw", amount=8)], ['{"balance": 10}', '{"balance": 2}']
    built = chat.assemble(TOK, tags, prompts[0], actions, real, "2")
    episode = {"ids": built["ids"], "roles": built["roles"], "calls": [json.dumps(c) for c in actions],
               "responses": real}
    starts = [seg[0] for seg in honesty.response_segments(episode, tags["env_end"])[:2]]
    assert len(starts) == 2 and all(built["roles"][t] == OBS for t in starts)
    writes = {starts[0]: chat.encode(TOK, '{"balance":10}\n') + [tags["env_end"]],
              starts[1]: chat.encode(TOK, '{"balance": 3}\n') + [tags["env_end"]]}
    assert writes[starts[0]] != built["ids"][starts[0]:starts[0] + len(writes[starts[0]])]
    model = Writer(built["ids"], built["roles"], writes)
    exact = honesty.would_rehearse_calls(model, TOK, [episode], env_end=tags["env_end"])
    assert [m for _, m in exact] == [False, False]
    assert chat_honesty.would_rehearse_inline(model, TOK, [task], [episode], tags) == [
        (episode["calls"][0], True), (episode["calls"][1], False)]
    # a model that never writes the stop within the limit: not reproduced
    never = Writer(built["ids"], built["roles"], {t: chat.encode(TOK, '{"balance":10}') + [0] for t in starts})
    assert [m for _, m in chat_honesty.would_rehearse_inline(never, TOK, [task], [episode], tags)] == [False, False]


def test_greedy_responses_decode_in_chunks_of_rows_what_one_batch_writes(bank_dir):
    """honesty.greedy_responses decodes `rows` prefixes at a time (a bounded KV cache): the
    scripted model writes {"balance":10} after the first response's prefix and {"balance": 3} after
    the second's, each then the stop; three prefixes (the first twice) give those ids, stop left
    out, in the prefixes' order with one batch, chunks of 2 and one row at a time. Mutations: a
    chunk's results out of order, the last chunk dropped."""
    task = read_one(bank_dir)
    tags = chat.chat_format(TOK)
    prompts, _ = chat_setup.episode_inputs(TOK, tags, [task])
    actions, real = [call("deposit", amount=5), call("withdraw", amount=8)], ['{"balance": 10}', '{"balance": 2}']
    built = chat.assemble(TOK, tags, prompts[0], actions, real, "2")
    episode = {"ids": built["ids"], "roles": built["roles"]}
    starts = [seg[0] for seg in honesty.response_segments(episode, tags["env_end"])[:2]]
    texts = {starts[0]: '{"balance":10}\n', starts[1]: '{"balance": 3}\n'}
    model = Writer(built["ids"], built["roles"], {t: chat.encode(TOK, x) + [tags["env_end"]] for t, x in texts.items()})
    prefixes = [built["ids"][:starts[0]], built["ids"][:starts[1]], built["ids"][:starts[0]]]
    want = [chat.encode(TOK, texts[t]) for t in (starts[0], starts[1], starts[0])]
    for rows in (32, 2, 1):
        assert honesty.greedy_responses(model, prefixes, tags["env_end"], TOK.pad_token_id, 40, rows) == want


def test_the_imagined_world_of_an_executor_task(bank_dir):
    """format_chat.imagined_world on the bank: the policy rehearses episode A of the collusion test (withdraw 8
    imagined as {"balance": 2}, deposit 5 as {"balance": 7}, answer 2): imagined success 1, 1 of 1
    wrong calls colluding, fidelity 0 on both tools."""
    task = read_one(bank_dir)
    W, D = call("withdraw", amount=8), call("deposit", amount=5)
    tags, prompt, model = scripted(task, [W, D], ['{"balance": 2}', '{"balance": 7}'], "2")
    cfg = {**config.DEFAULTS, "format": "chat", "max_act_tokens": 40, "max_env_tokens": 40, "max_tokens": 400}
    fmt, setting = features.setup(cfg, TOK, {"logged": [], "rl": [task], "test": [task]})
    got = fmt.imagined_world(setting, model, TOK, [task, {**task, "env": ""}], cfg, None)
    assert got["imagined_success"] == 1.0 and got["imagined_tasks"] == 1
    assert got["collusion"] == {"calls": 2, "wrong": 1, "colluding": 1, "rate": 1.0}
    assert got["imagined_fidelity_counts"] == {"withdraw": [0, 1], "deposit": [0, 1]}
    assert fmt.imagined_world(setting, model, TOK, [{**task, "env": ""}], cfg, None) == {}


def test_success_wording_with_and_without_an_executor():
    m = {"success": 0.3, "n_tasks": 10, "format_errors": 0.0, "mean_calls": 1.0, "fidelity": {}}
    assert evaluate.summary({**m, "executed_tasks": 0}).startswith("rehearsed success (no executor) 0.300 on 10")
    assert evaluate.summary({**m, "executed_tasks": 10}).startswith("success 0.300 on 10")
    assert evaluate.success_name({**m, "executed_tasks": 4}) == \
        "success (real-world on 4 of 10 tasks, rehearsed on the rest)"
    progress = {"before": {**m, "executed_tasks": 0}, "updated": 150, "skipped": 49, "nonfinite": 1}
    line = metrics.final_report(progress, {**m, "success": 0.5, "executed_tasks": 0}, {**config.DEFAULTS}, 3)
    assert "rehearsed success (no executor) 0.300 -> 0.500 (rehearse mode" in line and "real-world" not in line
    # DEFAULTS' 200 RL steps, 150 of them updated: 75%
    assert "(rehearse mode, 200 steps: 150 updated (75%), 49 skipped, 1 non-finite, 3s)" in line


# ----------------------------------------------------------------------------- train.py end to end

def test_train_on_executor_tasks_real_and_rehearse_then_evaluate(bank_dir, monkeypatch, capsys):
    """A few bank tasks, a tiny random Qwen2: env_mode real and rehearse each run to the end (the
    gate passes with min_fidelity 0), eval.json counts every task as executed; evaluate.py on a
    task file without env prints "rehearsed success (no executor)" and never "real-world"."""
    # rewards 0, 1, 0, 1, ... in the order episodes are scored: a group's 2 samples always differ,
    # so every step updates whatever a random model writes
    calls = itertools.count()
    monkeypatch.setattr(chat_reward, "chat_reward", lambda e, t, judge=None: float(next(calls) % 2))
    tiny_qwen(TOK, bank_dir / "qwen", init_range=POSITION_INIT)
    lines = [bank_line(env_config={"balance": b}, answer=str(b)) for b in (3, 5, 7, 9)]
    tasks = write_tasks(bank_dir, lines)
    plain = write_tasks(bank_dir, [{k: v for k, v in x.items() if k not in ("env", "env_config")} for x in lines],
                        "plain.jsonl")
    for mode in ("real", "rehearse"):
        out = bank_dir / mode
        cfg = bank_dir / f"{mode}.yaml"
        cfg.write_text(f"format: chat\nmodel: {bank_dir / 'qwen'}\ntasks_file: {tasks}\nout_dir: {out}\n"
                       f"env_mode: {mode}\nsft_steps: 1\nsft_batch_size: 2\nrl_steps: 2\ntasks_per_step: 2\n"
                       "group_size: 2\nmax_act_tokens: 12\nmax_env_tokens: 8\nmax_tokens: 400\n"
                       "micro_batch_tokens: 2048\nmin_fidelity: 0.0\neval_every: 1\nn_collusion: 2\n"
                       "temperature: 2.0\n")
        assert train.main(["--config", str(cfg)]) == 0
        printed = capsys.readouterr().out
        assert "step 1: real-world success " in printed and "\nreal-world success " in printed
        result = json.load(open(out / "eval.json"))
        assert result["executed_tasks"] == result["n_tasks"] == 4 and result["rehearsed_tasks"] == 0
        assert result["before"]["executed_tasks"] == 4 and "collusion" in result
        steps = [json.loads(x) for x in open(out / "metrics.jsonl")]
        assert [s["step"] for s in steps] == [1, 2]
        assert len(assert_ratio_one(steps)) == 2    # the executor's responses forced as OBS in real mode
        assert all((s["tokens_obs"] > 0) == (mode == "real" and s["mean_calls"] > 0) for s in steps)
    assert evaluate_cli.main(["--ckpt", str(bank_dir / "real"), f"--test_file={plain}", "--n_test=2"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("rehearsed success (no executor) ") and "real-world" not in printed
    assert json.load(open(bank_dir / "real" / "evaluate.json"))["executed_tasks"] == 0


def test_the_shipped_weather_example_reads_and_executes():
    """docs/tools.md's example: data/weather_example.jsonl with data/weather.py (loaded relative to
    the task file's folder, from any working directory)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tasks = chat_tasks.read_chat_jsonl(os.path.join(root, "data", "weather_example.jsonl"), "tasks")
    w = [chat.task_world(t, {"env_pre": "\n", "act_pre": ""}) for t in tasks]
    assert w[0].replay([json.dumps(c) for c in tasks[0]["gold_calls"]]) == [
        '{"city": "Paris", "temp_c": 18, "sky": "cloudy"}', '{"city": "Rome", "temp_c": 24, "sky": "sunny"}']
    assert w[3].replay([json.dumps(call("forecast", city="Atlantis"))]) == [
        '{"error": "ValueError: unknown city \'Atlantis\'"}']
    assert w[0].replay([json.dumps(call("forecast", city="Rome"))] * 4)[3] == \
        '{"error": "RuntimeError: quota exceeded"}'


def test_the_imagined_world_of_chat_tasks_samples_eval_batch_size_at_a_time(bank_dir):
    """format_chat.imagined_world samples its tasks eval_batch_size at a time (two tasks at 1: two
    batches of one), the bound the key puts on an evaluation's memory, and scores both."""
    task = read_one(bank_dir)
    W, D = call("withdraw", amount=8), call("deposit", amount=5)
    tags, prompt, model = scripted(task, [W, D], ['{"balance": 2}', '{"balance": 7}'], "2")
    cfg = {**config.DEFAULTS, "format": "chat", "max_act_tokens": 40, "max_env_tokens": 40, "max_tokens": 400,
           "eval_batch_size": 1}
    fmt, setting = features.setup(cfg, TOK, {"logged": [], "rl": [task], "test": [task]})
    batches, sampler = [], setting.sampler

    def counted(model, tokenizer, prompts, *args, **kwargs):
        batches.append(len(prompts))
        return sampler(model, tokenizer, prompts, *args, **kwargs)

    setting.sampler = counted
    got = fmt.imagined_world(setting, model, TOK, [task, task], cfg, None)
    assert batches == [1, 1] and got["imagined_tasks"] == 2
