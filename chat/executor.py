"""Executors: your own tools run for real, so a chat task file measures something real.

The paper evaluates on executable environments (BFCL, tau2-Bench); the toy world (world.py) is
this repo's. A chat task line names its own with `"env": "MODULE:CLASS"` or
`"env": "path/to/file.py:CLASS"` (a path relative to the task file's folder, or absolute) and
`"env_config": {...}`: per episode the executor is `instance = CLASS(**env_config)`, and a tool
call `{"name", "arguments"}` runs `getattr(instance, name)(**arguments)` (chat.task_world). With
it, `env_mode: real` trains against the tools, evaluation executes them, and fidelity and
collusion compare the policy's rehearsals with their true responses (docs/tools.md).

    load_object(spec, base_dir)                  the class (or function) a spec names; ConfigError
    call_tool(instance, call, tool_names, timeout_s)   the response string of one call
    new_instance(task, timeout_s)                the executor of one episode; ExecutorError

The response: a str return as is, anything else `json.dumps` (default=str for what JSON cannot
hold: `None` is "null"); an exception, a value JSON cannot encode (a dict with tuple keys) and a
call that ends with no result (sys.exit) are the response `{"error": "<Type>: <message>"}` and
the episode goes on, as a real API answers an error. What a tool prints goes to the terminal as
any Python code's prints; it is not the response. User code raising or calling sys.exit
outside a tool call (a tools module's import, the constructor at load) is a ConfigError, one
line naming it; the constructor of each episode runs as a tool call does (new_instance), and its
failure is an ExecutorError naming the task. Names starting with `_` or not among the task's
tools are never called. Simplified: the time limit runs the call in a worker thread and stops waiting after
timeout_s (the answer is then an error response); the thread is NOT killed (Python cannot kill
a thread): it runs on in the background and may still change the instance of that episode.
A MODULE is imported as Python imports it (the current directory, then sys.path); a file is
loaded once per path, as a module of its own.
"""
import importlib
import importlib.util
import json
import os
import re
import sys
import threading

from machinery.config import ConfigError

_FILES = {}                               # real path of a tools file -> its module, loaded once
# What user code may raise that must not end the process unseen: sys.exit in a tool's module, its
# constructor or a task's check is a SystemExit, which `except Exception` lets through.
USER_ERRORS = (Exception, SystemExit)


class ExecutorError(Exception):
    """An executor that could not be built for an episode during a run (its constructor raised,
    exited or hung, though it constructed at load): the run stops with this one line."""


def load_object(spec, base_dir="."):
    """"MODULE:NAME" or "path.py:NAME" -> that object. A bad spec: ConfigError, one line."""
    where, _, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not where or not name.isidentifier():
        raise ConfigError(f"env {json.dumps(spec)}: expected 'MODULE:CLASS' or 'path/to/file.py:CLASS'")
    if where.endswith(".py"):
        path = where if os.path.isabs(where) else os.path.join(base_dir, where)
        if not os.path.isfile(path):
            raise ConfigError(f"env {spec!r}: file not found: {path}")
        module = _load_file(spec, path)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise ConfigError(f"env {spec!r}: cannot import module {where!r} ({e})") from None
        except USER_ERRORS as e:          # the user's module raised (or exited) while importing
            raise ConfigError(f"env {spec!r}: importing {where} raised {error_text(e)}") from None
    obj = getattr(module, name, None)
    if not callable(obj):
        raise ConfigError(f"env {spec!r}: {where} has no class or function {name!r}")
    return obj


def _load_file(spec, path):
    real = os.path.realpath(path)
    if real not in _FILES:
        module_name = "envace_tools_" + re.sub(r"\W", "_", real)
        found = importlib.util.spec_from_file_location(module_name, real)
        module = importlib.util.module_from_spec(found)
        sys.modules[module_name] = module         # dataclasses and pickle look the module up here
        try:
            found.loader.exec_module(module)
        except USER_ERRORS as e:
            del sys.modules[module_name]
            raise ConfigError(f"env {spec!r}: loading {path} raised {error_text(e)}") from None
        _FILES[real] = module
    return _FILES[real]


def error_text(e):
    """"<Type>: <first line of the message>" (sys.exit(3): "SystemExit: 3")."""
    message = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def run_with_timeout(fn, timeout_s, name):
    """fn() in a daemon worker thread, waited for at most timeout_s: ("value", v) or ("error",
    "<Type>: <message>") for an exception, a time-out or an end with no result (SystemExit)."""
    result = {}

    def work():
        try:
            result["value"] = fn()
        except Exception as e:            # the tool's own error: the response, the episode goes on
            result["error"] = error_text(e)
        except BaseException:             # sys.exit, or a KeyboardInterrupt the tool raised itself
            pass                          # (signals reach the main thread only): no result

    worker = threading.Thread(target=work, name=f"tool {name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():                 # not killed: it runs on in the background (see above)
        return "error", f"TimeoutError: {name} took longer than {timeout_s:g} s"
    if "error" in result:
        return "error", result["error"]
    if "value" not in result:             # SystemExit and the like end a thread with no result
        return "error", f"RuntimeError: {name} ended without a result"
    return "value", result["value"]


def new_instance(task, timeout_s):
    """A fresh executor for one episode: CLASS(**env_config), run as a tool call is (timeout_s).
    It constructed when the task file was read; failing now is an ExecutorError naming the task."""
    spec = task["env"]
    kind, value = run_with_timeout(lambda: task["env_class"](**task["env_config"]), timeout_s,
                                   f"{spec.rpartition(':')[2]}(**env_config)")
    if kind == "error":
        where = f"{task['where']}: " if "where" in task else ""
        raise ExecutorError(f"{where}env {spec!r}: the executor of a new episode could not be built: {value}")
    return value


def error_response(text):
    """The response of a call that failed: {"error": "<Type>: <message>"} as JSON text."""
    return json.dumps({"error": text}, ensure_ascii=False)


def call_tool(instance, call, tool_names, timeout_s):
    """Run one tool call {"name", "arguments"} on `instance`; the response string (see the module
    docstring). Never raises for what the tool does: its exceptions and time-outs are responses."""
    name, arguments = call["name"], call.get("arguments", {})
    if not isinstance(name, str) or name.startswith("_") or name not in tool_names:
        return error_response(f"UnknownTool: no tool named {name!r}")
    method = getattr(instance, name, None)
    if not callable(method):
        return error_response(f"UnknownTool: the executor has no method {name!r}")
    kind, value = run_with_timeout(lambda: method(**arguments), timeout_s, name)
    if kind == "error":
        return error_response(value)
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except USER_ERRORS as e:              # tuple keys, a cycle, a __str__ that raises: the tool's bug
        why = error_text(e).partition(": ")[2] or "no reason given"
        return error_response(f"{type(e).__name__}: {name} returned a value JSON cannot encode ({why})")


def normalised(response):
    """A response as compared for fidelity: the canonical JSON dump if it parses as JSON, else the
    stripped string. '{"b": 1,  "a": 2}' and '{"a": 2, "b": 1}' are the same response."""
    try:
        return json.dumps(json.loads(response), sort_keys=True, ensure_ascii=False)
    except (ValueError, TypeError):
        return response.strip()


def same_response(a, b):
    """Whether two responses are the same once normalised (`normalised`)."""
    return normalised(a) == normalised(b)


def is_error(response):
    """An error response: a JSON object with an "error" key (call_tool's), or the toy's 'error ...'."""
    if response.startswith("error"):
        return True
    try:
        value = json.loads(response)
    except (ValueError, TypeError):
        return False
    return isinstance(value, dict) and "error" in value
