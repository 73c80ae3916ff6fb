"""Executors for chat tasks (executor.py, chat.py `env`): a tiny bank of the tests' own, loaded from
a file next to the task file; its calls, state, errors, refusals and time limit; bad specs and
env_config; then real-mode sampling, fidelity, collusion and train.py / evaluate.py with it."""
import json
import os

import pytest

import config
import executor

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


def test_normalised_responses():
    assert executor.same_response('{"b": 1,  "a": [2, 3]}', '{"a": [2, 3], "b": 1}')
    assert executor.same_response(" 6\n", "6") and executor.same_response("sunny ", "sunny")
    assert not executor.same_response('{"a": 1}', '{"a": 2}')
    assert not executor.same_response("Sunny", "sunny")
    assert executor.is_error('{"error": "ValueError: x"}') and executor.is_error("error funds")
    assert not executor.is_error('{"balance": 1}') and not executor.is_error("[1]")
