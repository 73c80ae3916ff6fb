"""Task files: the toy world's splits as JSONL, and JSONL tasks or logged trajectories read back.

    python -m machinery.taskfiles --export data/toy          # rl.jsonl, test.jsonl, logged.jsonl
    python -m chat.format --export data/toy_chat          # the same tasks in the chat format

A config's tasks_file / test_file / logged_file replace the generated splits (formats/features.py). Every
line is checked before anything trains; a bad one is a DataError naming its file, line and field.

What a line may hold (plain format):
- "prompt": a non-empty string; "answer": a non-empty string of ASCII digits (the only answers the
  toy actor can write, `answer 1 2` -> "12"); trajectories also "calls" (strings world.parse_call
  reads) and "responses" (one string per call).
- "family" (optional): a string, the group evaluate.py reports success by.
- any other key is allowed and ignored (exports and other tools carry ids and metadata).
- words outside the toy world's vocabulary (world.WORDS) are allowed, with one warning per file:
  `model: tiny`'s word-level tokenizer reads them as <unk>, while a real model's tokenizer may
  know them, and the file cannot tell which model will read it.
"""
import json
import os
import warnings

import world


TASK_KEYS = {"prompt": str, "answer": str}



TRAJECTORY_KEYS = {"prompt": str, "calls": list, "responses": list, "answer": str}



class DataError(Exception):
    """A malformed line in a task or trajectory file: says which file, which line, and what."""



def json_lines(path, kind):
    """(where, parsed object) for each non-blank line of a JSONL file, `where` being "PATH line N";
    an unreadable file or a line that is not JSON raises DataError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {kind} file {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield f"{path} line {n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno})") from None



def read_jsonl(path, kind):
    """Tasks ({"prompt", "answer"}) or logged trajectories ({"prompt", "calls", "responses",
    "answer"}), one JSON object per line; blank lines are skipped. Every line is checked before
    anything trains (see the module docstring), and the first bad one raises DataError naming its
    line and field."""
    keys = TASK_KEYS if kind == "tasks" else TRAJECTORY_KEYS
    rows, unknown = [], None
    for where, row in json_lines(path, kind):
        _check_row(row, where, keys, kind)
        if unknown is None:
            words = row["prompt"].split() + [w for text in row.get("calls", []) + row.get("responses", [])
                                              for w in text.split()]
            new = sorted(set(w for w in words if w not in VOCABULARY and not w.isdigit()))
            if new:
                unknown = (where, new)
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no {kind} in the file")
    if unknown:
        warnings.warn(f"{unknown[0]}: words outside the toy world's vocabulary {unknown[1][:5]} "
                      f"(model: tiny reads them as <unk>); first such line of the file", stacklevel=2)
    return rows


VOCABULARY = set(world.WORDS)


def _check_row(row, where, keys, kind):
    """One line's object against the plain format; DataError names the field."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with keys {list(keys)}")
    for key, typ in keys.items():
        if key not in row:
            raise DataError(f"{where}: missing key '{key}'")
        if not isinstance(row[key], typ):
            raise DataError(f"{where}: '{key}' must be a {typ.__name__}, got {json.dumps(row[key])}")
    if not row["prompt"].strip():
        raise DataError(f"{where}: 'prompt' is empty")
    if not (row["answer"].isascii() and row["answer"].isdigit()):
        raise DataError(f"{where}: 'answer' must be a string of digits (what the toy actor can answer), "
                        f"got {json.dumps(row['answer'])}")
    if "family" in row and not (isinstance(row["family"], str) and row["family"]):
        raise DataError(f"{where}: 'family' must be a non-empty string, got {json.dumps(row['family'])}")
    if kind == "trajectories":
        if len(row["calls"]) != len(row["responses"]):
            raise DataError(f"{where}: {len(row['calls'])} calls but {len(row['responses'])} responses")
        for i, call in enumerate(row["calls"]):
            if not isinstance(call, str) or world.parse_call(call) is None:
                raise DataError(f"{where}: call {i + 1} {call!r} is not a valid tool call")
        for i, response in enumerate(row["responses"]):
            if not isinstance(response, str):
                raise DataError(f"{where}: response {i + 1} must be a string, got {json.dumps(response)}")



def export(out_dir, seed=0, n_logged=3000, n_new_logged=20, n_rl=4000, n_test=500):
    """Write the generated splits as JSONL (the format `read_jsonl` reads)."""
    os.makedirs(out_dir, exist_ok=True)
    splits = world.make_splits(seed, n_logged, n_new_logged, n_rl, n_test)
    for name, tasks in (("rl", splits["rl"]), ("test", splits["test"])):
        with open(os.path.join(out_dir, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps({"prompt": t["prompt"], "answer": t["answer"],
                                     "family": t["family"]}) + "\n" for t in tasks)
    with open(os.path.join(out_dir, "logged.jsonl"), "w") as f:
        f.writelines(json.dumps({"prompt": t["prompt"], "calls": t["calls"], "answer": t["answer"],
                                 "responses": world.replay(t["calls"])}) + "\n" for t in splits["logged"])
    return out_dir


def export_main(export_fn, what="JSONL files"):
    """The command line of an export: python -m machinery.taskfiles --export DIR [--seed S] [--n N]."""
    import argparse
    parser = argparse.ArgumentParser(description=f"Export the toy world's tasks as {what}.")
    parser.add_argument("--export", required=True, metavar="DIR")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=None, help="at most N lines per file")
    args = parser.parse_args()
    sizes = {} if args.n is None else {"n_logged": args.n, "n_new_logged": 0, "n_rl": args.n, "n_test": args.n}
    print("wrote rl.jsonl, test.jsonl, logged.jsonl to", export_fn(args.export, args.seed, **sizes))


if __name__ == "__main__":
    export_main(export)
