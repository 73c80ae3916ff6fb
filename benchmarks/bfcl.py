"""BFCL-v4 multi-turn as a benchmark, offline: tasks, the tools' executor, the official check.

The paper reports BFCL-v4 (EnvACE-8B 46.04 overall, its Table 1). The multi-turn categories run
with no network: the questions, the ground truth and the tools' own Python classes (a file
system, a messaging app, a trading bot, a car, ...) ship in the PyPI package `bfcl-eval`,
installed with `pip install --no-deps bfcl-eval==2026.3.23 mpmath` (its declared dependencies pin
numpy 1.26 and pull LLM SDKs; the multi-turn part needs none of them). A BFCL task is a
conversation of several user turns over stateful tools: after each turn the state of every tool
instance must equal the state the ground-truth calls leave, and every result of the ground
truth's calls must be among the model's results so far.

    python bfcl.py --out data/bfcl       # chat task files: multi_turn_base.jsonl (200 tasks), ...
    python evaluate.py --oracle --test_file=data/bfcl/multi_turn_base.jsonl --out_dir=out/oracle

What is here:
- `convert` writes each category as chat task files (chat/tasks.py `check_task`): `messages` = a system
  message + the first user turn, `turns` = the later user turns, `tools` = the function docs of
  the task's classes (minus `excluded_function`) as OpenAI JSON schemas (`json_schema`),
  `gold_calls` = the ground truth per turn as `{"name", "arguments"}` (`parse_call`: call strings
  read with `ast`, never `eval`; positional arguments named in the docs' parameter order; a
  parameter the ground truth gives another type than its doc also takes that type:
  `widen_to_ground_truth`), `env` = "benchmarks.bfcl:BFCLEnv", `env_config` = {"initial_config",
  "involved_classes"} (and "long_context": true for that category), `check` = "benchmarks.bfcl:check".
  multi_turn_base is also
  split for training configs: multi_turn_base_heldout.jsonl (tasks 0, 5, 10, ...: 40) and
  multi_turn_base_rl.jsonl (the other 160).
- `logged_line`: the RL split's gold conversations as logged traffic for the warm start
  (multi_turn_base_rl_logged.jsonl, a `logged_file`): each ground-truth call an assistant turn, its
  response what the task's executor returns for it (chat/executor.py's call_tool on a BFCLEnv, as in
  evaluation), each user turn closed by a fixed answer (BFCL has no gold answers; its check reads
  calls and states only). Only RL tasks: no held-out task's gold reaches a model.
- `BFCLEnv(**env_config)`: one instance per involved class, loaded from the initial config;
  each tool is an attribute of it (a method of the class that has it), so executor.call_tool
  runs it by name with keyword arguments.
- `check(task, episode)`: the official multi-turn checker's semantics (bfcl_eval
  eval_checker/multi_turn_eval/multi_turn_checker.py), written out: `mismatch` says why not.

Simplified or left out:
- multi_turn_miss_func is not written: it adds tool docs in the middle of a conversation (a turn
  with no user text: "I have updated some more functions you can choose from"), and a task's
  tools are fixed for the whole episode here (the strict call parser rejects any tool outside
  them). Writing all the tools from the start would be a different, easier task.
- The official harness shows the tools in its own system prompt formats and parses Python call
  strings; here the model's own chat template shows the OpenAI schemas and it writes JSON calls.
- The official harness ends a turn after 20 steps (force-terminated: the task fails); here the
  episode's own limits (max_turns calls over the whole episode, max_tokens) end it, and an
  episode that did not finish every turn fails.
- Results are compared as the official checker formats them (a str as is, a dict as JSON, else
  str()); the episode's own responses (executor.call_tool) are JSON for anything not a str.
"""
import ast
import contextlib
import copy
import importlib
import json
import os
import signal
import sys

from machinery.config import DEFAULTS, ArgumentParser, ConfigError
from chat import executor
from chat.executor import error_text

INSTALL = "pip install --no-deps bfcl-eval==2026.3.23 mpmath"
CATEGORIES = ("multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context")
LEFT_OUT = {"multi_turn_miss_func": "its tools change in the middle of a conversation (bfcl.py docstring)"}
# the official "classic" prompt's persona, task and multi-turn behaviour, without its call format
SYSTEM = ("You are an expert in composing functions. You are given a question and a set of possible functions. "
          "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
          "If none of the functions can be used, point it out. If the given question lacks the parameters "
          "required by the function, also point it out.\n\nAt each turn, you should try your best to complete "
          "the tasks requested by the user within the current turn. Continue to output functions to call until "
          "you have fulfilled the user's request to the best of your ability. Once you have no more functions "
          "to call, the system will consider the current turn complete and proceed to the next turn or task.")
TYPE_NAMES = {"dict": "object", "float": "number", "tuple": "array"}
HELDOUT_EVERY = 5                  # multi_turn_base_heldout.jsonl: tasks 0, 5, 10, ... (40 of 200)
# the logged conversations' answer closing a user turn: after the ground truth's calls, or a turn with none
DONE_ANSWER = "Done."
NO_CALL_ANSWER = "None of the functions can do that, or a parameter is missing."


def backend():
    """bfcl_eval's backend config (CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES, the doc files), or
    ConfigError saying how to install the package."""
    try:
        from bfcl_eval.constants import executable_backend_config
    except ImportError:
        raise ConfigError(f"BFCL tasks need the bfcl-eval package, not installed: {INSTALL}") from None
    return executable_backend_config


def data_dir():
    """The folder of the package's data files (questions, possible_answer/, multi_turn_func_doc/)."""
    backend()
    import bfcl_eval
    return os.path.join(os.path.dirname(bfcl_eval.__file__), "data")


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- the executor

class BFCLEnv:
    """The tools of one BFCL task: `BFCLEnv(initial_config, involved_classes)` makes one instance
    of each class (loaded with a deep copy of its part of initial_config unless stateless, as the
    official harness does) and `env.cd(folder="temp")` calls the instance whose class has `cd`
    (the last such class, as the official name mapping). Names starting with `_` are never looked
    up on the instances."""

    def __init__(self, initial_config, involved_classes, long_context=False):
        config = backend()
        instances = {}
        for name in involved_classes:
            if name not in config.CLASS_FILE_PATH_MAPPING:
                raise ValueError(f"unknown BFCL class {name!r}")
            instance = getattr(importlib.import_module(config.CLASS_FILE_PATH_MAPPING[name]), name)()
            if name not in config.STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(initial_config.get(name, {})), long_context=long_context)
            instances[name] = instance
        self.instances = instances

    def __getattr__(self, name):
        # only called when normal lookup fails; `instances` itself and private names never dispatch
        if name.startswith("_") or name == "instances":
            raise AttributeError(name)
        for instance in reversed(list(self.instances.values())):
            if callable(getattr(type(instance), name, None)):
                return getattr(instance, name)
        raise AttributeError(f"no BFCL tool {name!r} in {', '.join(self.instances)}")


def execution_result(env, call):
    """Run one call {name, arguments} on a BFCLEnv; its result as the official checker writes it:
    a str as is, a dict as JSON (str() if it cannot be), anything else str(); an exception is
    'Error during execution: <message>'."""
    try:
        result = getattr(env, call["name"])(**call["arguments"])
    except Exception as e:             # the tool's own error is a result, as in the official harness
        return f"Error during execution: {e}"
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


# ----------------------------------------------------------------------------- the check

def episode_turns(task, episode):
    """(the model's calls per turn, the ground truth's calls per turn, turns the episode finished)."""
    gold = task["gold_calls"]
    if gold and all(isinstance(c, dict) for c in gold):       # a flat list: one turn
        gold = [gold]
    calls = [json.loads(c) for c in episode["calls"]]
    call_turns = episode.get("call_turns") or [0] * len(calls)
    model = [[c for c, t in zip(calls, call_turns) if t == k] for k in range(len(gold))]
    answered = episode.get("answers")
    if answered is None:
        answered = [episode["answer"]] if episode.get("cause") == "answer" else []
    return model, gold, len(answered)


def state_differences(model_instance, gold_instance):
    """The public attributes (not starting with `_`) of the ground truth's instance whose value in
    the model's instance differs, as the official `_compare_instances`."""
    return [k for k in vars(gold_instance) if not k.startswith("_")
            and getattr(model_instance, k) != getattr(gold_instance, k)]


def missing_results(gold_results, model_results):
    """The ground truth's results not among the model's, each model result matching at most one
    (the official `_is_subsequence_unordered`: order free, duplicates counted)."""
    left, missing = list(model_results), []
    for r in gold_results:
        if r in left:
            left.remove(r)
        else:
            missing.append(r)
    return missing


def mismatch(task, episode):
    """Why the episode fails the official multi-turn check, or None if it passes. Turn by turn,
    the model's calls of that turn and the ground truth's are replayed on their own BFCLEnv (state
    carried over from the earlier turns). A turn whose ground truth is empty is not checked (the
    model should have said it cannot; its calls still change its state). Otherwise the model must
    have made a call in that turn, every instance's public attributes must equal the ground
    truth's, and every ground-truth result of the turn must be among the model's results of all
    turns so far. An episode that did not finish every turn fails (the official force-terminated)."""
    model_turns, gold_turns, finished = episode_turns(task, episode)
    if finished < len(gold_turns):
        return f"the episode finished {finished} of {len(gold_turns)} turns"
    model_env, gold_env = BFCLEnv(**task["env_config"]), BFCLEnv(**task["env_config"])
    model_results = []
    for k, (model_calls, gold_calls) in enumerate(zip(model_turns, gold_turns)):
        model_results += [execution_result(model_env, c) for c in model_calls]
        gold_results = [execution_result(gold_env, c) for c in gold_calls]
        if not gold_calls:
            continue
        if not model_calls:
            return f"turn {k}: no call made; the ground truth makes {len(gold_calls)}"
        for name, gold_instance in gold_env.instances.items():
            differs = state_differences(model_env.instances[name], gold_instance)
            if differs:
                return f"turn {k}: {name}.{differs[0]} differs from the ground truth's"
        missing = missing_results(gold_results, model_results)
        if missing:
            return f"turn {k}: the ground truth's result {missing[0][:80]!r} is not among the model's"
    return None


def check(task, episode):
    """The task's success (a chat task's `check`, chat_reward's hard criterion): 1.0 when the
    episode passes the official multi-turn check (`mismatch`), else 0.0."""
    return 0.0 if mismatch(task, episode) else 1.0


# ----------------------------------------------------------------------------- the converter

def json_schema(doc):
    """A BFCL function doc's parameter schema -> JSON Schema: dict -> object, float -> number,
    tuple -> array, any -> no type constraint, through properties and items."""
    out = {}
    for key, value in doc.items():
        if key == "type":
            if value != "any":
                out["type"] = TYPE_NAMES.get(value, value)
        elif key == "properties":
            out["properties"] = {name: json_schema(sub) for name, sub in value.items()}
        elif key == "items":
            out["items"] = json_schema(value)
        else:
            out[key] = value
    return out


def tool_schema(doc):
    """A BFCL function doc -> an OpenAI function schema (its `response` doc is not shown)."""
    return {"type": "function", "function": {"name": doc["name"], "description": doc["description"],
                                             "parameters": json_schema(doc["parameters"])}}


def parse_call(text, docs):
    """A ground-truth call string -> {"name", "arguments"}, read with `ast` (literals only, never
    run): "sort('final_report.pdf')" -> {"name": "sort", "arguments": {"file_name":
    "final_report.pdf"}}, positional arguments named in the order of the docs' parameters.
    Tuples become lists (JSON has none)."""
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text}")
    name = node.func.id
    if name not in docs:
        raise ValueError(f"{text}: no function doc for {name!r}")
    order = list(docs[name]["parameters"].get("properties", {}))
    if len(node.args) > len(order):
        raise ValueError(f"{text}: more positional arguments than {name} has parameters")
    arguments = {order[k]: ast.literal_eval(a) for k, a in enumerate(node.args)}
    arguments.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    return {"name": name, "arguments": json.loads(json.dumps(arguments))}


JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
              (dict, "object"), (type(None), "null"))


def widen_to_ground_truth(tools, gold_calls):
    """Where a ground-truth argument is not of the JSON type its doc gives, that parameter of this
    task's tool also takes the ground truth's type, so that the strict call parser lets a model
    make the ground truth's call (the official harness checks no types). In the package: one call
    in each category, close_ticket(ticket_id='ticket_001') with ticket_id documented as integer."""
    props = {t["function"]["name"]: t["function"]["parameters"].get("properties", {}) for t in tools}
    for call in (c for turn in gold_calls for c in turn):
        for key, value in call["arguments"].items():
            schema = props[call["name"]].get(key, {})
            if "type" not in schema:
                continue
            kinds = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
            kind = next(name for cls, name in JSON_TYPES if isinstance(value, cls))
            if kind not in kinds and not (kind == "integer" and "number" in kinds):
                schema["type"] = kinds + [kind]


def class_docs(name):
    """The function docs of one BFCL class, in file order."""
    return read_lines(os.path.join(data_dir(), "multi_turn_func_doc", backend().MULTI_TURN_FUNC_DOC_FILE_MAPPING[name]))


def task_line(entry, ground_truth, category):
    """One BFCL entry and its ground truth -> a chat task line (see the module docstring)."""
    docs = [d for c in entry["involved_classes"] for d in class_docs(c)
            if d["name"] not in entry.get("excluded_function", [])]
    by_name = {d["name"]: d for d in docs}
    first, *later = entry["question"]
    tools = [tool_schema(d) for d in docs]
    gold_calls = [[parse_call(c, by_name) for c in turn] for turn in ground_truth]
    widen_to_ground_truth(tools, gold_calls)
    env_config = {"initial_config": entry["initial_config"], "involved_classes": entry["involved_classes"]}
    if "long_context" in category:
        env_config["long_context"] = True
    return {"id": entry["id"], "family": category,
            "messages": [{"role": "system", "content": SYSTEM}] + first,
            "turns": later,
            "tools": tools, "gold_calls": gold_calls,
            "env": "benchmarks.bfcl:BFCLEnv", "env_config": env_config, "check": "benchmarks.bfcl:check"}


def logged_line(task, timeout_s=DEFAULTS["tool_timeout"]):
    """A converted task's gold conversation as a logged trajectory (chat/tasks.py's logged_file
    lines): its opening, then per user turn that turn's user messages, each ground-truth call as an
    assistant turn with its tool message (the response the task's executor returns, replayed in order
    on one BFCLEnv: chat/executor.py's call_tool, as the evaluation's world), and an answer closing
    the turn (DONE_ANSWER, or NO_CALL_ANSWER for a turn the ground truth makes no call in)."""
    instance, names = BFCLEnv(**task["env_config"]), {t["function"]["name"] for t in task["tools"]}
    messages = list(task["messages"])
    for user, calls in zip([[]] + task["turns"], task["gold_calls"]):
        messages += user
        for call in calls:
            messages += [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                         {"role": "tool", "content": executor.call_tool(instance, call, names, timeout_s)}]
        messages.append({"role": "assistant", "content": DONE_ANSWER if calls else NO_CALL_ANSWER})
    return {"id": task["id"], "family": task["family"], "messages": messages, "tools": task["tools"]}


def jsonl_text(lines):
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


def write_whole(path, text):
    """`text` into `path` through PATH.tmp renamed over it: never half-written (a signal, a full
    disk), the temporary file removed if the write does not finish."""
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except BaseException:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise


def convert(out_dir, categories=CATEGORIES, written=None):
    """Write each category as OUT_DIR/<category>.jsonl, and multi_turn_base split in two for a
    training config: multi_turn_base_heldout.jsonl (every HELDOUT_EVERY-th task, from the first)
    and multi_turn_base_rl.jsonl (the others), with the RL tasks' gold conversations as logged
    traffic in multi_turn_base_rl_logged.jsonl (`logged_line`). {file stem: number of lines}. Every file is
    converted before any is written; a file already there with other content (edited by hand, or
    from another package version) is a ConfigError and nothing is written; one with the same
    content is left as it is. Each file is written whole (`write_whole`); `written` (a list)
    collects the paths written, for the line of an interrupted run."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"--out {out_dir} is a file, not a folder")
    files = {}
    for category in categories:
        entries = read_lines(os.path.join(data_dir(), f"BFCL_v4_{category}.json"))
        answers = {r["id"]: r["ground_truth"] for r in
                   read_lines(os.path.join(data_dir(), "possible_answer", f"BFCL_v4_{category}.json"))}
        files[category] = [task_line(e, answers[e["id"]], category) for e in entries]
        if category == "multi_turn_base":
            files["multi_turn_base_rl"] = [t for k, t in enumerate(files[category]) if k % HELDOUT_EVERY]
            files["multi_turn_base_heldout"] = files[category][::HELDOUT_EVERY]
            files["multi_turn_base_rl_logged"] = [logged_line(t) for t in files["multi_turn_base_rl"]]
    texts = {os.path.join(out_dir, f"{stem}.jsonl"): jsonl_text(lines) for stem, lines in files.items()}
    missing = refuse_edited_files(texts, "bfcl.py", "bfcl-eval")
    try:
        os.makedirs(out_dir, exist_ok=True)
        for path in missing:
            write_whole(path, texts[path])
            if written is not None:
                written.append(path)
    except OSError as e:
        raise ConfigError(f"cannot write {e.filename or out_dir}: {e.strerror or e}") from None
    return {stem: len(lines) for stem, lines in files.items()}


def refuse_edited_files(texts, writer, source):
    """{path: text} a converter is about to write -> the paths not there yet. A path that is a
    folder, or a file with other content (edited by hand, or from another version of the package
    `source`), is a ConfigError naming it, raised before anything is written; a file with the same
    text is left as it is. `writer`: the command, as the line names it."""
    for path, text in texts.items():
        if os.path.isdir(path) or os.path.exists(path) and not same_text(path, text):
            raise ConfigError(f"{path} is already there and is not what {writer} writes (edited, or from another "
                              f"{source} version): move it away or give another --out; nothing written")
    return [path for path in texts if not os.path.exists(path)]


def same_text(path, text):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == text
    except (OSError, UnicodeDecodeError):
        return False


@contextlib.contextmanager
def signals_interrupt():
    """Inside: Ctrl-C and SIGTERM both raise KeyboardInterrupt, whatever handler the caller left;
    the caller's handlers are back afterwards."""
    previous = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def convert_command(argv, convert, what):
    """A converter's command line, `--out DIR`: (the folder, convert's counts), or (None, the exit
    status) after its one line: 2 a user mistake (no package, --out a file or holding other files
    of these names, a refused write); 1 anything else; 130 Ctrl-C or SIGTERM (the files written so
    far whole, none half-written). bfcl.py and benchmarks/tau2bench.py read their options here."""
    parser = ArgumentParser(description=sys.modules[convert.__module__].__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for the chat task files")
    try:
        args = parser.parse_args(argv)            # (--help prints and exits 0 here)
        if not args.out:
            raise ConfigError("--out is empty: give a folder for the chat task files")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 2
    written = []
    try:
        with signals_interrupt():
            return args.out, convert(args.out, written=written)
    except KeyboardInterrupt:
        done = f"{len(written)} files written whole ({', '.join(written)})" if written else "nothing written"
        print(f"\ninterrupted: {done}, none half-written; run the same command again to finish", file=sys.stderr)
        return None, 130
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 2
    except (Exception, SystemExit) as e:
        print(f"error while converting {what}: {error_text(e)}", file=sys.stderr)
        return None, 1


def main(argv=None):
    """python bfcl.py --out DIR -> exit status (convert_command's; 0 written), each one line."""
    out, counts = convert_command(argv, convert, "BFCL")
    if out is None:
        return counts
    for stem, n in counts.items():
        what = "logged conversations" if stem.endswith("_logged") else "tasks"
        print(f"{stem}: {n} {what} -> {os.path.join(out, stem + '.jsonl')}")
    for category, why in LEFT_OUT.items():
        print(f"{category}: not written ({why})")
    return 0

if __name__ == "__main__":
    sys.exit(main())
