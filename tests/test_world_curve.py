"""scripts/world_curve.py: the world model's learning curve (rehearse rows only, a fresh warm
start a point, fidelity split by the tool cache), on a tiny random Qwen2 and the example chat files."""
import json
import os

import pytest

import train
from envace import ACT, OBS, PROMPT, REHEARSE
from scripts import world_curve
from helpers import POSITION_INIT, chat_tokenizer, tiny_qwen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = chat_tokenizer()


def test_rehearse_sequences_keep_the_world_rows_only():
    actor = {"ids": [1, 2, 3], "roles": [PROMPT, ACT, OBS]}
    world = {"ids": [1, 4, 5], "roles": [PROMPT, REHEARSE, REHEARSE]}
    inline = {"ids": [1, 2, 5], "roles": [PROMPT, ACT, REHEARSE]}       # an inline row trains both roles
    assert world_curve.rehearse_sequences([{"rows": [actor, world]}, {"rows": [world]}, inline]) == [world, world]


def test_curve_points_resume_and_table(tmp_path, monkeypatch, capsys):
    tiny_qwen(TOK, tmp_path / "qwen", init_range=POSITION_INIT)
    monkeypatch.chdir(ROOT)
    drawn = []
    warm_start = train.warm_start
    monkeypatch.setattr(train, "warm_start", lambda model, ddp, seqs, cfg, *a, **kw:
                        drawn.append((cfg["sft_steps"], cfg["grounding_examples"], kw["roles"]))
                        or warm_start(model, ddp, seqs, cfg, *a, **kw))
    out = tmp_path / "curve.jsonl"
    args = ["--config", "configs/chat_tiny.yaml", f"--model={tmp_path / 'qwen'}", "--rehearsal_context=separate",
            "--grounding_examples=1", "--rows", "4,8", "--out", str(out)]
    assert world_curve.main(args + ["--arms", "grounded"]) == 0
    points = [json.loads(line) for line in open(out)]
    assert [(p["arm"], p["rows"], p["sft_steps"], p["grounding_examples"]) for p in points] == [
        ("grounded", 4, 1, 1), ("grounded", 8, 2, 1)]
    assert drawn == [(1, 1, (REHEARSE,)), (2, 1, (REHEARSE,))]
    for p in points:      # every expert call of the test file counted once, covered or not by the cache
        seen, unseen = p["fidelity_by_cache"]["seen"], p["fidelity_by_cache"]["unseen"]
        calls = p["cache_coverage"]["seen"] + p["cache_coverage"]["unseen"]
        assert calls > 0 and sum(n for _, n in seen.values()) + sum(n for _, n in unseen.values()) == calls
        assert sum(n for _, n in p["counts"].values()) == calls
    # both arms asked: the grounded points are kept, not redone; the ungrounded ones added
    drawn.clear()
    assert world_curve.main(args) == 0
    assert drawn == [(1, 0, (REHEARSE,)), (2, 0, (REHEARSE,))]
    assert [(p["arm"], p["rows"]) for p in map(json.loads, open(out))] == [
        ("grounded", 4), ("grounded", 8), ("ungrounded", 4), ("ungrounded", 8)]
    capsys.readouterr()
    assert world_curve.main(["--out", str(out), "--table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 4 and lines[2].startswith("| grounded | 4 | ")


@pytest.mark.parametrize("bad, says", [
    (["--rows", "4,6"], "each a positive multiple of sft_batch_size (4)"),
    (["--rows", "four"], "comma-separated whole numbers"),
    (["--arms", "both"], "some of grounded, ungrounded"),
    (["--rehearsal_context=inline"], "rehearsal_context separate"),
    (["--rows", ""], "--rows '': comma-separated whole numbers"),
    (["--rows", "0"], "--rows 0: each a positive multiple"),
    (["--rows", "4,,8"], "--rows '4,,8': comma-separated whole numbers"),
    (["--config", "nope.yaml"], "config file not found: nope.yaml"),
])
def test_bad_options_one_line_before_any_model(tmp_path, monkeypatch, capsys, bad, says):
    monkeypatch.chdir(ROOT)
    args = ["--config", "configs/chat_tiny.yaml", "--rehearsal_context=separate", "--out", str(tmp_path / "c.jsonl")]
    assert world_curve.main(args + bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1


def test_out_that_is_not_a_curve_is_refused_and_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    other = tmp_path / "notes.jsonl"
    other.write_text('{"step": 1}\n')
    assert world_curve.main(["--config", "configs/chat_tiny.yaml", "--rehearsal_context=separate",
                             "--out", str(other)]) == 2
    assert f"{other}, line 1: not a point of this curve" in capsys.readouterr().err
    assert other.read_text() == '{"step": 1}\n'


def test_copy_split_buckets_the_stateful_calls_by_whether_the_cache_copy_is_right(tmp_path, monkeypatch):
    """The example files' six test tasks make six pay calls. By hand: the tool cache holds the
    logged pays (pay 4 -> 5, pay 5 -> 0) then the tasks' examples (pay 6 -> 3, pay 2 -> 7, pay 6 -> 1):
    exact_response gives pay 6 -> 3 (first seen), pay 4 -> 5, pay 5 -> 0, pay 2 -> 7. The expert's
    pays: pay 6 (3), pay 4 (5) then pay 5 (0), pay 2 (7) then pay 6 (1: the copy says 3), pay 6 (3)."""
    import yaml
    from machinery import config
    from worldmodel import toolcache
    monkeypatch.chdir(ROOT)
    path = tmp_path / "ckpt"
    tiny_qwen(TOK, path)
    cfg = config.load_config("configs/chat_tiny.yaml", [f"--model={path}", "--rehearsal_context=separate",
                                                         "--grounding_examples=1"])
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    split = world_curve.copy_split(str(path))
    assert {k: n for k, (_, n) in split.items()} == {"first call of its tool, exact example right": 4,
                                                      "later call of its tool, exact example right": 1,
                                                      "later call of its tool, exact example wrong": 1}
    assert all(0 <= m <= n for m, n in split.values())
    cache = toolcache.build([("pay 6", "3"), ("pay 6", "1"), ("price jam", "8")], toolcache.plain_call)
    assert [toolcache.exact_response(cache, c) for c in ("pay 6", "pay 2", "price jam")] == ["3", None, "8"]


# ------------------------------------------------------------------------- faults: one line, exit 2, before any work

def the_line(capsys):
    """The one `error:` line on stderr of a command that refused (no traceback)."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def files_in(folder):
    """{path: bytes} of every file under `folder`, to show that a refused command changed none."""
    return {os.path.join(d, name): open(os.path.join(d, name), "rb").read()
            for d, _, names in os.walk(folder) for name in names}


@pytest.fixture
def no_work(monkeypatch):
    """A point or a copy split started fails the test: a refused option must be refused before."""
    def started(*args, **kwargs):
        raise AssertionError("work started before the options were checked")
    monkeypatch.setattr(world_curve, "point", started)
    monkeypatch.setattr(world_curve, "copy_split", started)


def curve_args(out):
    return ["--config", "configs/chat_tiny.yaml", "--rehearsal_context=separate", "--rows", "4", "--arms",
            "grounded", f"--out={out}"]


def test_an_out_that_cannot_take_the_curve_is_refused_before_any_point(tmp_path, monkeypatch, capsys, no_work):
    """Before: a path under a file was refused only when the first point was written (minutes of
    warm start on a real model, lost); an empty --out, a name ending in / or /dev/null (not a file:
    the curve is written to a temporary file renamed over it) went on to compute the point. A
    folder was refused already."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "folder").mkdir()
    cases = [
        (str(tmp_path / "notes.txt" / "curve.jsonl"),
         f"error: --out {tmp_path / 'notes.txt' / 'curve.jsonl'}: {tmp_path / 'notes.txt'} is a file, not a folder"),
        (str(tmp_path / "notes.txt" / "more" / "curve.jsonl"),
         f"error: --out {tmp_path / 'notes.txt' / 'more' / 'curve.jsonl'}: {tmp_path / 'notes.txt'} is a file, "
         f"not a folder"),
        ("", "error: --out: give the curve's file (e.g. results/smollm2_world_curve/curve.jsonl)"),
        (os.devnull, f"error: --out {os.devnull}: not a regular file; give a file"),
        (str(tmp_path / "folder"), f"error: --out {tmp_path / 'folder'} is a folder: give a file"),
        (f"{tmp_path / 'new'}/", f"error: --out {tmp_path / 'new'}/: a folder's name (it ends in /): give a file"),
    ]
    before = files_in(tmp_path)
    for out, line in cases:
        assert world_curve.main(curve_args(out)) == 2, out
        assert the_line(capsys) == line
    assert files_in(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["folder", "notes.txt"]


def test_an_out_file_that_cannot_be_opened_for_writing_is_refused_before_any_point(tmp_path, monkeypatch, capsys,
                                                                                   no_work):
    """A curve file that cannot be opened to append (its user made it read-only): refused with the
    OS's reason before any point (before: the point computed, then lost, or the file replaced anyway
    by the rename). Root writes any file whatever its mode, so the refusal is the OS's answer to
    open(out, "a") as a read-only file would give it, on every machine and user alike."""
    import builtins
    monkeypatch.chdir(ROOT)
    out = tmp_path / "curve.jsonl"
    out.write_text("")

    def read_only(path, mode="r", *args, **kwargs):
        if os.fspath(path) == str(out) and mode != "r":
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, mode, *args, **kwargs)
    monkeypatch.setattr(world_curve, "open", read_only, raising=False)     # the module's own open only
    assert world_curve.main(curve_args(out)) == 2
    assert the_line(capsys) == f"error: --out {out}: cannot write it (Permission denied)"
    assert out.read_bytes() == b""


def test_a_missing_out_folder_is_made_with_the_first_point_not_before(tmp_path, monkeypatch, capsys):
    """The early check of --out creates nothing: a folder not there yet is made when the first
    point is written (write_file), as for results/NAME/curve.jsonl in the docs."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "new" / "deeper" / "curve.jsonl"

    def point(cfg, arm, rows):
        assert not os.path.exists(tmp_path / "new")
        return {"arm": arm, "rows": rows, "fidelity": {}, "fidelity_by_cache": {"seen": {}, "unseen": {}},
                "warm_start_seconds": 0.0}
    monkeypatch.setattr(world_curve, "point", point)
    assert world_curve.main(curve_args(out)) == 0
    assert [(p["arm"], p["rows"]) for p in map(json.loads, open(out))] == [("grounded", 4)]


def test_a_cut_curve_file_is_one_line_naming_file_and_line_for_the_table_and_the_curve(tmp_path, monkeypatch, capsys,
                                                                                       no_work):
    """The curve is rewritten whole (a temporary file renamed), so a stopped curve never leaves a
    cut line; a cut one (a copy cut short, an edit) is named with its line, and kept as it is:
    the curve refused it already, --table was a traceback."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "curve.jsonl"
    whole = json.dumps({"arm": "grounded", "rows": 4, "fidelity": {}, "fidelity_by_cache": {"seen": {}, "unseen": {}},
                        "warm_start_seconds": 1.0})
    text = whole + "\n" + whole[:20]
    out.write_text(text)
    line = (f"error: {out}, line 2: a line cut short (this command writes whole lines only: a copy cut short, "
            f"an edit?); mend or remove it, or give another --out")
    assert world_curve.main(["--out", str(out), "--table"]) == 2
    assert the_line(capsys) == line
    assert world_curve.main(curve_args(out)) == 2
    assert the_line(capsys) == line
    assert out.read_text() == text
    binary = tmp_path / "weights.bin"                    # not text at all (before: UnicodeDecodeError, a traceback)
    binary.write_bytes(b"\x80\x81\xff\n")
    for argv in (["--out", str(binary), "--table"], curve_args(binary)):
        assert world_curve.main(argv) == 2
        assert the_line(capsys) == (f"error: {binary}, line 1: not a point of this curve (another file?); "
                                    f"give another --out")
    assert binary.read_bytes() == b"\x80\x81\xff\n"


def save_chat_checkpoint(path, **keys):
    """A tiny Qwen2 saved as train.py saves a checkpoint of configs/chat_tiny.yaml with
    rehearsal_context separate (its config.yaml beside the weights), `keys` set in its config."""
    import yaml
    from machinery import config
    tiny_qwen(TOK, path)
    cfg = config.load_config("configs/chat_tiny.yaml", [f"--model={path}", "--rehearsal_context=separate",
                                                         "--grounding_examples=1"])
    (path / "config.yaml").write_text(yaml.safe_dump({**cfg, **keys}))


def test_copy_split_refuses_what_is_not_a_chat_checkpoint_naming_it(tmp_path, monkeypatch, capsys, no_work):
    """Before: a run folder (config.yaml but no model) or cut weights were a traceback after the
    config was read, a toy checkpoint (format plain) printed nothing and exited 0."""
    import yaml
    from helpers import tiny_cfg, tiny_llama, toy_tokenizer
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"                               # a train.py out_dir: config.yaml, eval.json, warmstart/
    save_chat_checkpoint(run / "warmstart")
    (run / "config.yaml").write_text((run / "warmstart" / "config.yaml").read_text())
    (run / "eval.json").write_text("{}\n")
    cut = tmp_path / "cut"
    save_chat_checkpoint(cut)
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    toy = tmp_path / "toy"                               # train.py --config small.yaml's kind of checkpoint
    tokenizer = toy_tokenizer()
    tiny_llama(tokenizer).save_pretrained(toy)
    tokenizer.save_pretrained(toy)
    (toy / "config.yaml").write_text(yaml.safe_dump(tiny_cfg(tmp_path)))
    before = files_in(tmp_path)
    cases = [
        (run, f"error: --copy_split {run}: not a model checkpoint (no config.json); a run folder? give its "
              f"checkpoint: {run / 'warmstart'}"),
        (toy, f"error: --copy_split {toy}: a checkpoint of format plain with rehearsal_context inline; the split asks "
              f"a chat model's separate rehearse rows (format chat, rehearsal_context separate)"),
        (tmp_path / "gone", f"error: --copy_split {tmp_path / 'gone'}: no such folder"),
    ]
    for path, line in cases:
        assert world_curve.main(["--copy_split", str(path)]) == 2, path
        assert the_line(capsys) == line
    assert world_curve.main(["--copy_split", str(cut)]) == 2
    assert the_line(capsys).startswith(f"error: --copy_split {cut}: cannot load the checkpoint: "
                                       f"{cut / 'model.safetensors'} is truncated or corrupt (")
    assert files_in(tmp_path) == before


def test_copy_split_of_a_checkpoint_whose_test_file_is_not_here_is_one_line(tmp_path, monkeypatch, capsys):
    """The checkpoint's config.yaml names its data files as the run saw them: run from elsewhere,
    a file not there is found as the split reads its tasks, before the model loads (before: a
    traceback), one line naming it."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "ckpt"
    save_chat_checkpoint(path, test_file=str(tmp_path / "gone.jsonl"))
    gone = tmp_path / "gone.jsonl"
    assert world_curve.main(["--copy_split", str(path)]) == 2
    assert the_line(capsys) == f"error: cannot read tasks file {gone}: [Errno 2] No such file or directory: '{gone}'"


def test_copy_split_says_so_when_no_stateful_call_is_asked(tmp_path, monkeypatch, capsys):
    """Test tasks without a stateful call give an empty split: a line says so (before: nothing
    printed, exit 0, as if the command had not run)."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "ckpt"
    save_chat_checkpoint(path)
    monkeypatch.setattr(world_curve, "copy_split", lambda p: {})
    assert world_curve.main(["--copy_split", str(path)]) == 0
    assert capsys.readouterr().out == (f"no stateful call among the expert calls of the test tasks of {path}: "
                                       f"nothing to split\n")


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_copy_split_is_one_line_and_130(tmp_path, monkeypatch, capsys, signum):
    """Ctrl-C or SIGTERM while the checkpoint is asked (minutes on a real model): one line, exit 130,
    every file as it was (before: Python's KeyboardInterrupt traceback, or killed without a word)."""
    import signal
    monkeypatch.chdir(ROOT)
    path = tmp_path / "ckpt"
    save_chat_checkpoint(path)
    files = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}

    def asked(p):                      # the signal arrives while the model is being asked
        os.kill(os.getpid(), getattr(signal, signum))
        raise AssertionError("the signal did not stop the copy split")
    monkeypatch.setattr(world_curve, "copy_split", asked)

    def unhandled(signum, frame):      # the command's own handler must replace this one during the split
        raise AssertionError(f"{signum}: the copy split installed no handler (a traceback, or a killed process)")
    # SIGINT: Python's own handler (KeyboardInterrupt), as in every Python process; SIGTERM's default
    # would kill the process without a word: the command turns it into KeyboardInterrupt itself
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, unhandled)}
    try:
        assert world_curve.main(["--copy_split", str(path)]) == 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == [
        "interrupted: nothing written (the copy split only reads)"]
    assert {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()} == files


def test_copy_split_and_table_refuse_options_they_would_ignore(tmp_path, monkeypatch, capsys, no_work):
    """--copy_split reads the checkpoint's own config.yaml and prints; --table prints --out. An
    override or --config given with them was ignored without a word (exit 0)."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "ckpt"
    save_chat_checkpoint(path)
    out = tmp_path / "curve.jsonl"
    out.write_text("")
    cases = [
        (["--copy_split", str(path), "--n_test=2"], "error: --copy_split reads the checkpoint's own config.yaml and "
                                                    "prints its split; it takes no --n_test=2"),
        (["--copy_split", str(path), "--out", str(out), "--config", "configs/chat_tiny.yaml"],
         "error: --copy_split reads the checkpoint's own config.yaml and prints its split; it takes no --config, "
         "--out"),
        (["--table", "--out", str(out), "--config", "configs/chat_tiny.yaml", "--seed=3"],
         "error: --table prints the curve in --out; it takes no --config, --seed=3"),
    ]
    for argv, line in cases:
        assert world_curve.main(argv) == 2, argv
        assert the_line(capsys) == line
    assert out.read_bytes() == b""
