"""Every field of every data line is checked at load: inputs that used to crash with a traceback
(found by a fuzz loop over hand-made bad lines, both formats) are one DataError line naming the
file, the line and the field, and train.py stops on them with exit 2 before anything is built."""
import json
import math
import os
import warnings

import pytest

from chat import format as chat
from chat import tasks as chat_tasks
from machinery import taskfiles
import train
from helpers import chat_tokenizer, tiny_qwen

TASK = {"prompt": "price apple", "answer": "3"}
TRAJ = {"prompt": "price apple", "calls": ["price apple"], "responses": ["3"], "answer": "3"}


def write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ----------------------------------------------------------------------------- plain format

@pytest.mark.parametrize("kind, row, message", [
    # crashed in encode_episode (tokenizer ValueError / IndexError) at the warm start
    ("trajectories", {**TRAJ, "responses": [1]}, "line 2: response 1 must be a string, got 1"),
    ("trajectories", {**TRAJ, "responses": [[]]}, r"line 2: response 1 must be a string, got \[\]"),
    # crashed in reward.outcome_record (unhashable / unsortable family) at the evaluation, after training
    ("tasks", {**TASK, "family": None}, "line 2: 'family' must be a non-empty string, got null"),
    ("tasks", {**TASK, "family": ["a"]}, "line 2: 'family' must be a non-empty string"),
    # never crashed, but could never be rewarded: refused
    ("tasks", {**TASK, "answer": "three"}, "line 2: 'answer' must be a string of digits"),
    ("tasks", {**TASK, "answer": ""}, "line 2: 'answer' must be a string of digits"),
    ("trajectories", {**TRAJ, "answer": "-3"}, "line 2: 'answer' must be a string of digits"),
    ("tasks", {**TASK, "prompt": "  "}, "line 2: 'prompt' is empty"),
    ("tasks", {**TASK, "prompt": None}, "line 2: 'prompt' must be a str, got null"),
])
def test_plain_line_errors_name_file_line_and_field(tmp_path, kind, row, message):
    path = write(tmp_path, [TASK if kind == "tasks" else TRAJ, row])
    with pytest.raises(taskfiles.DataError, match=f"^{path} {message}"):
        taskfiles.read_jsonl(path, kind)


def test_plain_extra_keys_are_allowed_and_unknown_words_warn_once(tmp_path):
    path = write(tmp_path, [{**TASK, "id": 7, "family": "price"}, {**TASK, "prompt": "price banana"},
                            {**TASK, "prompt": "price kumquat"}])
    with pytest.warns(UserWarning, match=r"line 2: words outside the toy world's vocabulary \['banana'\].*<unk>") as w:
        rows = taskfiles.read_jsonl(path, "tasks")
    assert len([x for x in w if x.category is UserWarning]) == 1 and len(rows) == 3 and rows[0]["id"] == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # toy words and digits: no warning
        taskfiles.read_jsonl(write(tmp_path, [TASK, {**TASK, "prompt": "cost 12 apple"}]), "tasks")


# ----------------------------------------------------------------------------- chat format

SCHEMA = {"type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}
CALL = {"type": "function", "function": {"name": "pay", "arguments": '{"amount": 3}'}}


def chat_task(params=SCHEMA, **kw):
    return {"messages": [{"role": "user", "content": "pay 3"}], "answer": "6",
            "tools": [{"type": "function", "function": {"name": "pay", "parameters": params}}], **kw}


def chat_traj(tool_calls=(CALL,), content=None):
    return {**chat_task(), "messages": [{"role": "user", "content": "pay 3"},
                                        {"role": "assistant", "content": content, "tool_calls": list(tool_calls)
                                         if isinstance(tool_calls, tuple) else tool_calls},
                                        {"role": "tool", "content": "6"}]}


def amount(**schema):
    return {**SCHEMA, "properties": {"amount": schema}}


@pytest.mark.parametrize("kind, row, message", [
    # malformed tool schemas: crashed in check_value (TypeError) on the first call checked against them
    ("tasks", chat_task({**SCHEMA, "properties": None}), "tool 'pay': parameters.properties must be an object"),
    ("tasks", chat_task({**SCHEMA, "properties": ["amount"]}), "tool 'pay': parameters.properties must be an object"),
    ("tasks", chat_task({**SCHEMA, "required": "amount"}),
     'tool \'pay\': parameters.required must be a list of property names, got "amount"'),
    ("tasks", chat_task(amount(type=3)), "tool 'pay': parameters.properties.amount.type must be a type name"),
    ("tasks", chat_task(amount(type="integer", enum=5)), "tool 'pay': parameters.properties.amount.enum must be a non-empty list"),
    ("tasks", chat_task(amount(type="array", items=5)), "tool 'pay': parameters.properties.amount.items must be a JSON schema"),
    ("tasks", chat_task({**SCHEMA, "additionalProperties": "no"}), "tool 'pay': parameters.additionalProperties must be true"),
    ("trajectories", {**chat_traj(), "tools": chat_task({**SCHEMA, "required": 1})["tools"]},
     "tool 'pay': parameters.required must be a list"),
    # tool_calls not a list: TypeError (len of an int) / KeyError (a dict's [0])
    ("trajectories", chat_traj(-1), "turn 1: 'tool_calls' must be a list, got -1"),
    ("trajectories", chat_traj({"a": 1}), "turn 1: 'tool_calls' must be a list"),
    # family not a string: crashed in reward.outcome_record at the evaluation
    ("tasks", chat_task(family=[1]), r"'family' must be a non-empty string, got \[1\]"),
    ("tasks", chat_task(family=None), "'family' must be a non-empty string, got null"),
    # refused, not crashes: content a list, answers nothing can equal, two tools of one name
    ("trajectories", chat_traj(content=["x"]), r"message 2 \(assistant\): 'content' must be a string or null"),
    ("tasks", chat_task(answer=math.nan), r"'answer' must be a string or a number \(non-empty, finite\), got NaN"),
    ("tasks", chat_task(answer=" "), "'answer' must be a string or a number"),
    ("tasks", {**chat_task(), "tools": chat_task()["tools"] * 2}, "tool 2: a second tool named 'pay'"),
    ("tasks", chat_task(checklist=["ok?", ""]), "'checklist' must be a list of yes/no questions"),
    # already one line before: kept so
    ("tasks", chat_task(examples={"pay": {"arguments": {"amount": 1}, "result": "8"}}), "examples of 'pay' must be a list"),
    ("tasks", chat_task(gold_calls=[{"name": "pay", "arguments": '{"amount":'}]), "gold call 1: arguments are not valid JSON"),
    ("trajectories", chat_traj([None]), "tool call 1 must be"),
])
def test_chat_line_errors_name_file_line_and_field(tmp_path, kind, row, message):
    good = chat_task() if kind == "tasks" else chat_traj()
    path = write(tmp_path, [good, row])
    with pytest.raises(taskfiles.DataError, match=f"^{path} line 2: {message}"):
        chat_tasks.read_chat_jsonl(path, kind)


def test_schema_checker_accepts_what_check_value_reads():
    ok = {"type": "object", "additionalProperties": {"type": "string"}, "required": [],
          "properties": {"a": {"type": ["string", "null"], "enum": ["x", None]},
                         "b": {"type": "array", "items": {"type": "object", "properties": {}}},
                         "c": {"anyOf": [{"type": "string"}], "description": "not read, not checked"}}}
    assert chat_tasks.check_schema(ok) is None
    assert chat_tasks.check_schema({"properties": {"a": {"items": {"type": [1]}}}}) == \
        "parameters.properties.a.items.type must be a type name or a list of them, got [1]"


def test_an_actor_call_whose_name_is_not_a_string_is_a_bad_call():
    # the actor writes this, not a file: it crashed read_act (unhashable list in a dict lookup)
    cause, _ = chat.read_act('<tool_call>\n{"name": ["pay"], "arguments": {}}\n</tool_call>', {"pay": SCHEMA})
    assert cause == "bad_call_json"


# ----------------------------------------------------------------------------- train.py end to end

def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_a_plain_file_that_crashed_stops_train_with_one_line(tmp_path, capsys):
    path = write(tmp_path, [TRAJ, {**TRAJ, "responses": [3]}])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"logged_file: {path}\nout_dir: {tmp_path / 'run'}\n")
    assert train.main(["--config", str(cfg)]) == 2
    assert f"{path} line 2: response 1 must be a string, got 3" in one_error_line(capsys)
    assert not os.path.exists(tmp_path / "run")


def test_a_chat_file_that_crashed_stops_train_with_one_line(tmp_path, capsys):
    tiny_qwen(chat_tokenizer(), tmp_path / "qwen")
    path = write(tmp_path, [chat_task(), chat_task({**SCHEMA, "properties": ["amount"]})])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"format: chat\nmodel: {tmp_path / 'qwen'}\ntasks_file: {path}\nout_dir: {tmp_path / 'run'}\n")
    assert train.main(["--config", str(cfg)]) == 2
    assert f"{path} line 2: tool 'pay': parameters.properties must be an object" in one_error_line(capsys)
    assert not os.path.exists(tmp_path / "run")


# ----------------------------------------------------------------------------- the fuzz loop, kept

BAD = [None, 0, -1, 10 ** 30, 1.5, True, "", "zz", [], ["x"], {}, {"a": 1}, '{"a":']


def mutations(obj):
    """obj with one value at any nesting level replaced by each BAD value, or one key dropped."""
    if isinstance(obj, dict):
        for k in obj:
            yield {key: v for key, v in obj.items() if key != k}
            for sub in [*BAD, *mutations(obj[k])]:
                yield {**obj, k: sub}
    elif isinstance(obj, list):
        for i in range(len(obj)):
            for sub in [*BAD, *mutations(obj[i])]:
                yield obj[:i] + [sub] + obj[i + 1:]


def survives(tmp_path, read, row, kind, use):
    """A mutated line is refused with a DataError, or read into rows the run can use."""
    path = write(tmp_path, [row])
    try:
        rows = read(path, kind)
    except taskfiles.DataError:
        return
    use(rows)


def test_no_mutation_of_a_good_line_crashes_past_the_checks(tmp_path):
    import reward
    import world
    from envace import encode_episode
    from helpers import toy_tokenizer
    tok = toy_tokenizer()

    def evaluated(rows):
        reward.outcome_record(rows + [{"family": "file"}], [{"cause": "answer", "calls": []}] * (len(rows) + 1),
                              [1.0] * (len(rows) + 1))

    def plain(rows):
        evaluated(rows)
        for t in rows:
            encode_episode(tok, t["prompt"], t.get("calls", []), t.get("responses") or world.replay(t.get("calls", [])),
                           t["answer"])

    def chatted(rows):
        evaluated(rows)
        for t in rows:
            schemas = chat_tasks.tool_schemas(t["tools"])
            for name, schema in schemas.items():
                for args in [{}, {"amount": 3}, {"amount": [1, {}]}, {"tags": ["x", 1]}, {"w": {"lat": "x"}}]:
                    chat_tasks.check_value(args, schema)
                    chat.read_act("<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>", schemas)

    schema = {"type": "object", "additionalProperties": False, "required": ["amount"],
              "properties": {"amount": {"type": "integer", "enum": [1, 3]}, "tags": {"type": "array", "items": {"type": "string"}},
                             "w": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}
    task = {**chat_task(schema), "gold_calls": [{"name": "pay", "arguments": {"amount": 3}}], "family": "f",
            "examples": {"pay": [{"arguments": {"amount": 1}, "result": "8"}]}, "checklist": ["q?"]}
    traj = {**chat_traj(), "tools": task["tools"]}
    traj["messages"] = traj["messages"] + [{"role": "assistant", "content": "6"}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                        # unknown words: a warning, not an error
        for kind, good, read, use in [("tasks", {**TASK, "family": "price"}, taskfiles.read_jsonl, plain),
                                      ("trajectories", TRAJ, taskfiles.read_jsonl, plain),
                                      ("tasks", task, chat_tasks.read_chat_jsonl, chatted),
                                      ("trajectories", traj, chat_tasks.read_chat_jsonl, chatted)]:
            for row in [good, *mutations(good), *BAD]:
                survives(tmp_path, read, row, kind, use)
