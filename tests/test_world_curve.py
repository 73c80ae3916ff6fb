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
