"""A tool schema that cannot mean what it says is refused when the task file is read, as the JSON
Schema rules say (chat_tasks.check_schema): a `required` name that is not one of the `properties`,
a `type` that is not a JSON Schema type, an `enum` value its own schema refuses. Each used to load
and train with every call a format error (a required name no call can give; an enum no call can
match); now one line naming the file, the line, the tool and the property, exit 2, before any
model is built. Read here through features.build_tasks, what train.py's setup reads task files
with, and end to end through train.main."""
import json
import os
import re

import pytest

import train
from benchmarks import bfcl
from chat import format as chat
from chat import tasks as chat_tasks
from formats import features
from machinery import checkpoint
from machinery.config import DEFAULTS, ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = {"type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}


def task(params):
    return {"messages": [{"role": "user", "content": "pay 3"}], "answer": "6",
            "tools": [{"type": "function", "function": {"name": "pay", "parameters": params}}]}


def write(tmp_path, rows, name="tasks.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def chat_cfg(tmp_path, **kw):
    return {**DEFAULTS, "format": "chat", "model": str(tmp_path / "qwen"), "out_dir": str(tmp_path / "run"), **kw}


def amount(**schema):
    return {**SCHEMA, "properties": {"amount": schema}}


REFUSED = [
    # required: a name no property declares (a typo): every call lacked it or was refused
    ({**SCHEMA, "required": ["amout"]}, "parameters.required names \"amout\", which is not one of its properties "
                                        r"\['amount'\]"),
    ({"type": "object", "required": ["amount"]}, r"parameters.required names \"amount\", which is not one of its "
                                                 r"properties \[\]"),
    (amount(type="object", properties={"lat": {"type": "number"}}, required=["lat", "lon"]),
     "parameters.properties.amount.required names \"lon\""),
    # type: not one of the seven JSON Schema types (before: not enforced at all)
    (amount(type="int"), 'parameters.properties.amount.type "int" is not a JSON Schema type '
                         r"\(one of string, integer, number, boolean, array, object, null\)"),
    (amount(type=["string", "float"]), 'parameters.properties.amount.type "float" is not a JSON Schema type'),
    (amount(type="array", items={"type": "dict"}), 'parameters.properties.amount.items.type "dict" is not'),
    (amount(type=[]), "parameters.properties.amount.type is an empty list: name at least one type"),
    # enum: a value its own schema refuses can never be given
    (amount(type="integer", enum=["a"]), r'parameters.properties.amount.enum\[0\] must be integer, got "a": '
                                         "no call can give this enum value"),
    (amount(type="integer", enum=[1, True]), r"parameters.properties.amount.enum\[1\] must be integer, got true"),
    (amount(type=["string", "null"], enum=[None, 3]),
     r"parameters.properties.amount.enum\[1\] must be string or null, got 3"),
    (amount(type="array", items={"type": "string", "enum": ["a", 1]}),
     r"parameters.properties.amount.items.enum\[1\] must be string, got 1"),
    (amount(type="array", items={"type": "integer"}, enum=[[1, "x"]]),
     r"parameters.properties.amount.enum\[0\]\[1\] must be integer, got \"x\""),
]


@pytest.mark.parametrize("params, message", REFUSED)
def test_a_schema_that_cannot_mean_what_it_says_is_one_error_naming_file_line_tool_and_property(
        tmp_path, params, message):
    path = write(tmp_path, [task(SCHEMA), task(params)])
    with pytest.raises(ConfigError, match=f"^{re.escape(path)} line 2: tool 'pay': {message}"):
        features.build_tasks(chat_cfg(tmp_path, tasks_file=path))


def test_a_logged_files_schemas_are_checked_alike(tmp_path):
    good = write(tmp_path, [task(SCHEMA)])
    logged = {**task(amount(type="integer", enum=["3"])),
              "messages": [{"role": "user", "content": "pay 3"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"type": "function", "function": {"name": "pay", "arguments": '{"amount": 3}'}}]},
                           {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]}
    path = write(tmp_path, [logged], "logged.jsonl")
    with pytest.raises(ConfigError, match=f"^{re.escape(path)} line 1: tool 'pay': "
                                          r'parameters.properties.amount.enum\[0\] must be integer, got "3"'):
        features.build_tasks(chat_cfg(tmp_path, tasks_file=good, logged_file=path))


def test_valid_schemas_still_load(tmp_path):
    """Every type, type lists, enums that fit them (numbers by value, null in a nullable type),
    required names among nested properties, keywords check_value does not read."""
    params = {"type": "object", "additionalProperties": False, "required": ["amount", "where"], "properties": {
        "amount": {"type": "integer", "enum": [1, 3.0, 100]},     # 3.0 is met by 3
        "ratio": {"type": "number", "enum": [1, 2.5]},
        "unit": {"type": ["string", "null"], "enum": ["eur", None]},
        "flag": {"type": "boolean", "enum": [False]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "enum": [["a"], ["a", "b"]]},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"],
                  "additionalProperties": {"type": "string"}},
        "any": {"description": "no type: anything", "anyOf": [{"$ref": "#/$defs/X"}]},
        "nothing": {"type": "null"}}, "$defs": {"X": {"type": "string"}}}
    path = write(tmp_path, [{**task(params), "gold_calls": [{"name": "pay", "arguments": {
        "amount": 3, "where": {"lat": 1.5}}}]}])
    rows = features.build_tasks(chat_cfg(tmp_path, tasks_file=path))["rl"]
    assert rows[0]["tools"][0]["function"]["parameters"] == params


def test_the_example_files_the_toy_tools_and_a_converted_bfcl_schema_pass():
    """data/'s example files and the toy world's chat tools load; bfcl.json_schema maps BFCL's own
    type names (dict, float, tuple, any) onto JSON Schema's, so a converted schema passes."""
    for name in ("toy_chat_example.jsonl", "weather_example.jsonl"):
        cfg = {**DEFAULTS, "format": "chat", "model": "m", "tasks_file": os.path.join(ROOT, "data", name)}
        assert features.build_tasks(cfg)["rl"]
    logged = os.path.join(ROOT, "data", "toy_chat_logged_example.jsonl")
    cfg = {**DEFAULTS, "format": "chat", "model": "m", "logged_file": logged,
           "tasks_file": os.path.join(ROOT, "data", "toy_chat_example.jsonl")}
    assert len(features.build_tasks(cfg)["logged"]) == 6
    for tool in chat.TOY_TOOLS:
        assert chat_tasks.check_schema(tool["function"]["parameters"]) is None
    doc = {"type": "dict", "required": ["price"], "properties": {
        "price": {"type": "float"}, "pairs": {"type": "tuple", "items": {"type": "dict", "properties": {
            "x": {"type": "any"}}}}, "n": {"type": "integer", "default": 3}}}
    assert chat_tasks.check_schema(bfcl.json_schema(doc)) is None
    assert chat_tasks.check_schema(doc) == 'parameters.type "dict" is not a JSON Schema type ' \
                                           "(one of string, integer, number, boolean, array, object, null)"


@pytest.mark.parametrize("params, message", [REFUSED[0], REFUSED[3], REFUSED[7]])
def test_train_stops_with_one_line_before_any_model_is_built(tmp_path, capsys, monkeypatch, params, message):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")
    monkeypatch.setattr(checkpoint, "build_policy", no_model)      # (train.setup builds through it)
    path = write(tmp_path, [task(SCHEMA), task(params)])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"format: chat\nmodel: {tmp_path / 'qwen'}\ntasks_file: {path}\ntasks_per_step: 2\n"
                   f"out_dir: {tmp_path / 'run'}\n")
    assert train.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.match(f"error: {re.escape(path)} line 2: tool 'pay': {message}", err[0]), err[0]
    assert not os.path.exists(tmp_path / "run")
