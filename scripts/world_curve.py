"""The world model's learning curve: would-rehearse fidelity per tool kind against warm-start rows.

    python -m scripts.world_curve --config configs/smollm2-separate.yaml --rows 128,256,512 \
        --out results/smollm2_world_curve/curve.jsonl                      # grounded and ungrounded
    python -m scripts.world_curve --out results/smollm2_world_curve/curve.jsonl --table
    python -m scripts.world_curve --copy_split RUN/warmstart      # what limits stateful fidelity

For each arm (`grounded`: the config's grounding_examples; `ungrounded`: 0) and each budget of
R rows, the config's model is warm-started anew on R separate rehearse rows only (R / sft_batch_size
steps of sft_batch_size rows drawn from the rehearse rows of the config's warm start: the logged
episodes' calls and the RL tasks' reference examples, each row grounded as the warm start grounds
it; the cosine schedule over those steps), then asked, greedy and teacher-forced, to rehearse the
expert's calls of the test tasks (their real responses replayed: what `evaluate.py --coverage`
asks), grounded by the tool cache of training traffic only. Each point is one JSON line: fidelity
per tool kind, split by whether the cache holds the exact call (`fidelity_by_cache`), the
warm start's seconds and the process's peak resident memory. A point already in --out is kept and
not redone (a stopped curve goes on where it stopped).

--copy_split asks a checkpoint the same expert calls and splits its stateful ones (a result that
depends on the dialogue so far, e.g. a wallet's balance) by whether its call is the first of its
tool in the episode and whether copying the tool cache's example of exactly that call (the first
example the rehearse prompt shows: toolcache.exact_response) gives the true result: a model that
copies its examples is right exactly where the copy is.

Simplified: rehearse rows only (the actor's rows train the actor, not the world); one seed; a
budget is a run of its own, so a point is what a warm start of that size gives, not a snapshot of
a longer one.
"""
import json
import os
import resource
import sys
import time

from machinery.config import ArgumentParser, ConfigError, load_config

ARMS = ("grounded", "ungrounded")


def rehearse_sequences(sequences):
    """The warm start's rehearse rows, each a sequence of its own (the actor rows left out)."""
    from envace import ACT, REHEARSE
    return [row for s in sequences for row in s.get("rows", [s])
            if REHEARSE in row["roles"] and ACT not in row["roles"]]


def point(cfg, arm, rows):
    """One curve point (a dict): a fresh model warm-started on `rows` rehearse rows, its fidelity."""
    import torch
    import train
    from chat import setup as chat_setup
    from envace import REHEARSE
    from formats import features
    from machinery.checkpoint import load_policy
    from worldmodel import honesty
    cfg = {**cfg, "grounding_examples": cfg["grounding_examples"] if arm == "grounded" else 0,
           "sft_steps": rows // cfg["sft_batch_size"]}
    torch.manual_seed(cfg["seed"])
    splits = features.build_tasks(cfg)
    model, tokenizer = load_policy(cfg["model"], "cpu", cfg["model_init"])
    if cfg["chat_template"]:
        with open(cfg["chat_template"], encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    fmt, setting = features.setup(cfg, tokenizer, splits, "cpu")
    sequences = rehearse_sequences(fmt.warm_start_sequences(setting))
    t0 = time.time()
    train.warm_start(model, model, sequences, cfg, tokenizer.pad_token_id, roles=(REHEARSE,),
                     logprobs=train.chosen_logprobs(cfg))      # as train.py's setup chooses it (lean_logprobs)
    seconds = time.time() - t0
    tasks, episodes = chat_setup.expert_episodes(tokenizer, setting.tags, splits["test"])
    pairs = fmt.would_rehearse(setting, model, tokenizer, tasks, episodes)
    by_kind = lambda part: fmt.by_kind(setting, part, tasks)         # noqa: E731
    return {"arm": arm, "rows": rows, "grounding_examples": cfg["grounding_examples"],
            "sft_steps": cfg["sft_steps"], "rehearse_rows_available": len(sequences),
            "fidelity": honesty.rates(by_kind(pairs)), "counts": by_kind(pairs),
            **honesty.fidelity_by_cache(pairs, setting.cache, by_kind),
            "warm_start_seconds": round(seconds, 1),
            "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def copy_split(path):
    """{"<first|later> call of its tool, exact example <right|wrong|none>": [matches, calls]} over
    the stateful expert calls of a checkpoint's test tasks (`path`: a folder train.py saved)."""
    from chat import setup as chat_setup
    from formats import features
    from machinery.checkpoint import load_policy
    from worldmodel import chat_separate, honesty, toolcache
    cfg = load_config(os.path.join(path, "config.yaml"))
    splits = features.build_tasks(cfg)           # (its data files, checked before the model loads)
    model, tokenizer = load_policy(path, "cpu")
    model.eval()
    fmt, setting = features.setup(cfg, tokenizer, splits, "cpu")
    rows, buckets = [], []
    for task, episode in zip(*chat_setup.expert_episodes(tokenizer, setting.tags, splits["test"])):
        calls = [json.loads(c) for c in episode["calls"]]
        earlier = set()
        for row, call, response in zip(chat_separate.rehearse_rows(tokenizer, setting.tags, task, calls,
                                                                   episode["responses"], setting.k, setting.cache),
                                       calls, episode["responses"]):
            if task["world"].TOOL_KINDS.get(call["name"]) == "stateful":
                copy = toolcache.exact_response(setting.cache, call)
                rows.append(row)
                buckets.append(f"{'later' if call['name'] in earlier else 'first'} call of its tool, exact example "
                               f"{'none' if copy is None else 'right' if copy == response else 'wrong'}")
            earlier.add(call["name"])
    split = {}
    for bucket, (_, matched) in zip(buckets, honesty.would_rehearse_rows(model, rows, tokenizer.pad_token_id)):
        split.setdefault(bucket, [0, 0])
        split[bucket][0] += matched
        split[bucket][1] += 1
    return dict(sorted(split.items()))


def table(lines):
    """The curve as a markdown table: matches / calls per tool kind, covered by the cache and not."""
    kinds = sorted({k for p in lines for part in p["fidelity_by_cache"].values() for k in part})
    head = " | ".join(f"{k} covered | {k} not" for k in kinds)
    out = [f"| arm | rows | {head} | warm start s |", "|---" * (3 + 2 * len(kinds)) + "|"]
    for p in lines:
        cells = []
        for k in kinds:
            for part in ("seen", "unseen"):
                m, n = p["fidelity_by_cache"][part].get(k, [0, 0])
                cells.append(f"{m}/{n}" + (f" ({m / n:.2f})" if n else ""))
        out.append(f"| {p['arm']} | {p['rows']} | " + " | ".join(cells) + f" | {p['warm_start_seconds']:.0f} |")
    return "\n".join(out) + "\n"


def read_points(path):
    """The points already in `path` ([] if it does not exist); a line that is not a point: ConfigError."""
    if not os.path.exists(path):
        return []
    points = []
    with open(path, "rb") as f:          # bytes: a file that is not UTF-8 text is a line that is not a point
        for n, line in enumerate(f, 1):
            try:
                p = json.loads(line)
            except ValueError:
                p = None
            cut = p is None and n > 1 and not line.endswith(b"\n")      # the last line, after whole points
            if cut:           # write_file rewrites the curve whole: a stopped curve never leaves a cut line
                raise ConfigError(f"{path}, line {n}: a line cut short (this command writes whole lines only: a "
                                  f"copy cut short, an edit?); mend or remove it, or give another --out")
            if not isinstance(p, dict) or not {"arm", "rows", "fidelity_by_cache"} <= set(p):
                raise ConfigError(f"{path}, line {n}: not a point of this curve (another file?); give another --out")
            points.append(p)
    return points


def check_checkpoint(path):
    """The checkpoint --copy_split names, checked before it loads: a whole model folder (is_checkpoint and
    damaged_file, what load_policy checks) saved with a config.yaml of format chat and rehearsal_context
    separate, whose rehearse rows the split asks; else one line naming the path and what is wrong."""
    from machinery.checkpoint import damaged_file, is_checkpoint
    if not os.path.isdir(path):
        raise ConfigError(f"--copy_split {path}: no such folder")
    if not is_checkpoint(path):          # a train.py run folder holds its checkpoints in warmstart/ and ckpt/
        inside = [os.path.join(path, name) for name in ("warmstart", "ckpt")
                  if is_checkpoint(os.path.join(path, name))]
        hint = f"; a run folder? give its checkpoint: {' or '.join(inside)}" if inside else ""
        raise ConfigError(f"--copy_split {path}: not a model checkpoint (no config.json){hint}")
    problem = damaged_file(path)
    if problem:
        raise ConfigError(f"--copy_split {path}: cannot load the checkpoint: {problem}")
    if not os.path.isfile(os.path.join(path, "config.yaml")):
        raise ConfigError(f"--copy_split {path}: not a checkpoint train.py saved (no config.yaml)")
    try:
        cfg = load_config(os.path.join(path, "config.yaml"))
    except ConfigError as e:
        raise ConfigError(f"--copy_split {path}: {e}") from None
    if cfg["format"] != "chat" or cfg["rehearsal_context"] != "separate":
        raise ConfigError(f"--copy_split {path}: a checkpoint of format {cfg['format']} with rehearsal_context "
                          f"{cfg['rehearsal_context']}; the split asks a chat model's separate rehearse rows "
                          f"(format chat, rehearsal_context separate)")


def check_out(out):
    """--out must take the curve before the first point is computed (minutes of warm start on a real
    model, lost if the write is refused then). Nothing is created or changed here: a file there is
    opened to append and closed, nothing written; a folder not there yet is made with the first point
    (write_file), so the nearest folder that is there must be writable."""
    from machinery.savefiles import file_in_the_way
    if os.path.isdir(out):
        raise ConfigError(f"--out {out} is a folder: give a file")
    if not os.path.basename(out):
        raise ConfigError(f"--out {out}: a folder's name (it ends in {os.sep}): give a file")
    blocker = file_in_the_way(os.path.dirname(out) or ".")
    if blocker:
        raise ConfigError(f"--out {out}: {blocker} is a file, not a folder")
    if os.path.exists(out) and not os.path.isfile(out):    # /dev/null, a pipe: the curve is renamed over --out
        raise ConfigError(f"--out {out}: not a regular file; give a file")
    folder = os.path.dirname(os.path.abspath(out))
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    if not os.access(folder, os.W_OK | os.X_OK):            # the temporary file is written there
        raise ConfigError(f"--out {out}: cannot write in {folder} (no permission)")
    if os.path.exists(out):
        try:
            open(out, "a").close()
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot write it ({e.strerror})") from None


def ignored(args, overrides, names):
    """The options among `names` given, and the overrides: what --copy_split or --table would ignore."""
    return [f"--{name}" for name in names if getattr(args, name)] + overrides


def check_options(args, overrides):
    """One line for each bad option, before any model loads."""
    if args.copy_split is not None:
        extra = ignored(args, overrides, ("config", "out", "table"))
        if extra:
            raise ConfigError(f"--copy_split reads the checkpoint's own config.yaml and prints its split; "
                              f"it takes no {', '.join(extra)}")
        check_checkpoint(args.copy_split)
        return None, [], []
    if not args.out:
        raise ConfigError("--out: give the curve's file (e.g. results/smollm2_world_curve/curve.jsonl)")
    if args.table:
        extra = ignored(args, overrides, ("config",))
        if extra:
            raise ConfigError(f"--table prints the curve in --out; it takes no {', '.join(extra)}")
        if not os.path.isfile(args.out):
            raise ConfigError(f"--out {args.out}: no such file")
        return None, [], []
    if args.config is None:
        raise ConfigError("--config: give the run's config (e.g. configs/smollm2-separate.yaml)")
    cfg = load_config(args.config, overrides)
    if cfg["format"] != "chat" or cfg["rehearsal_context"] != "separate":
        raise ConfigError(f"{args.config}: this curve is for format chat with rehearsal_context separate")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise ConfigError(f"--rows {args.rows!r}: comma-separated whole numbers, e.g. 128,256,512") from None
    if any(r <= 0 or r % cfg["sft_batch_size"] for r in rows):
        raise ConfigError(f"--rows {args.rows}: each a positive multiple of sft_batch_size ({cfg['sft_batch_size']})")
    arms = args.arms.split(",")
    if not set(arms) <= set(ARMS) or not arms:
        raise ConfigError(f"--arms {args.arms!r}: some of {', '.join(ARMS)}")
    check_out(args.out)
    read_points(args.out)
    return cfg, rows, arms


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a chat config with rehearsal_context separate")
    parser.add_argument("--rows", default="128,256,512", help="warm-start budgets in rehearse rows")
    parser.add_argument("--arms", default="grounded,ungrounded", help="grounded, ungrounded or both")
    parser.add_argument("--out", help="the curve's JSON lines (points already there are kept)")
    parser.add_argument("--table", action="store_true", help="print --out as a markdown table")
    parser.add_argument("--copy_split", metavar="CKPT", help="a checkpoint's stateful fidelity by whether copying "
                                                            "the cache's exact example is right")
    try:
        args, overrides = parser.parse_known_args(argv)
        cfg, rows, arms = check_options(args, overrides)
        if args.table:
            print(table(read_points(args.out)), end="")
            return 0
        if args.copy_split is not None:     # (a data file the checkpoint's config.yaml names, not here: one line too)
            from machinery.faults import sigterm_as_interrupt
            try:
                sigterm_as_interrupt()                # SIGTERM too: KeyboardInterrupt at once
                split = copy_split(args.copy_split)
            except KeyboardInterrupt:
                print("interrupted: nothing written (the copy split only reads)", file=sys.stderr)
                return 130
            for bucket, (m, n) in split.items():
                print(f"{bucket}: {m}/{n}")
            if not split:
                print(f"no stateful call among the expert calls of the test tasks of {args.copy_split}: "
                      f"nothing to split")
            return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from machinery.faults import sigterm_as_interrupt
    from machinery.savefiles import write_file
    try:
        sigterm_as_interrupt()                # SIGTERM too: KeyboardInterrupt at once
        for arm in arms:
            for r in rows:
                points = read_points(args.out)
                if any(p["arm"] == arm and p["rows"] == r for p in points):
                    continue
                p = point(cfg, arm, r)
                print(f"{arm} {r} rows: fidelity {p['fidelity']} | covered {p['fidelity_by_cache']['seen']} | "
                      f"not covered {p['fidelity_by_cache']['unseen']} | {p['warm_start_seconds']:.0f}s", flush=True)
                write_file(args.out, "".join(json.dumps(q) + "\n" for q in points + [p]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the points finished are in {args.out}; the same command goes on from there",
              file=sys.stderr)
        return 130
    print(table(read_points(args.out)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
