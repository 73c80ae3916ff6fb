"""Faults: non-finite steps are skipped without touching weights or optimizer and three in a row
stop the run with the last good state; malformed data files stop the run before training with
the line and what is wrong; bf16 autocast only on CUDA."""
import features
import envace
import distributed
import config
import checkpoint
import json
import os
import warnings

import pytest
import torch

import train
from envace import REHEARSE, encode_episode
from helpers import tiny_cfg, tiny_llama, toy_tokenizer

TOK = toy_tokenizer()


def nan_loss_on(monkeypatch, calls):
    """Make clipped_pg_loss return NaN on the given call numbers (0-based), all if None."""
    real, count = envace.clipped_pg_loss, [0]

    def patched(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        count[0] += 1
        if calls is None or count[0] - 1 in calls:
            loss = loss * float("nan")
        return loss, stats
    monkeypatch.setattr(train, "clipped_pg_loss", patched)


def one_group():
    eps = [encode_episode(TOK, "price apple", ["price apple"], [r], "3", env_role=REHEARSE) for r in "3456"]
    return eps, [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0]


def test_nonfinite_step_leaves_weights_and_optimizer_untouched(monkeypatch):
    model = tiny_llama(TOK)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 24}      # 2 rows of 12 tokens per micro-batch
    eps, rewards, groups = one_group()
    assert train.rl_step(model, model, opt, eps, rewards, groups, cfg, TOK.pad_token_id)[1] == "updated"
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    adam = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    nan_loss_on(monkeypatch, {1})               # the second of the two micro-batches
    sums, status = train.rl_step(model, model, opt, eps, rewards, groups, cfg, TOK.pad_token_id)
    assert status == "nonfinite"
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    after = opt.state[next(iter(model.parameters()))]
    assert all(torch.equal(adam[k], after[k]) for k in adam)
    assert all(p.grad is None for p in model.parameters())


def test_three_nonfinite_steps_in_a_row_stop_with_the_last_good_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(features, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    nan_loss_on(monkeypatch, None)
    cfg = tiny_cfg(tmp_path, rl_steps=10)
    assert train.run(cfg) == 1
    assert "3 non-finite steps in a row" in capsys.readouterr().out
    lines = [json.loads(line) for line in open(os.path.join(cfg["out_dir"], "metrics.jsonl"))]
    assert [line["status"] for line in lines] == ["nonfinite"] * 3
    assert lines[-1]["nonfinite_steps"] == 3
    state = torch.load(os.path.join(cfg["out_dir"], "ckpt", "trainer_state.pt"), weights_only=False)
    assert state["step"] == 3
    saved = checkpoint.load_policy(os.path.join(cfg["out_dir"], "ckpt"))[0].state_dict()
    warm = checkpoint.load_policy(os.path.join(cfg["out_dir"], "warmstart"))[0].state_dict()
    assert all(torch.equal(saved[k], warm[k]) for k in saved)


def test_one_nonfinite_step_is_counted_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(features, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    nan_loss_on(monkeypatch, {0})               # the first micro-batch of step 1
    cfg = tiny_cfg(tmp_path, rl_steps=3)
    assert train.run(cfg) == 0
    lines = [json.loads(line) for line in open(os.path.join(cfg["out_dir"], "metrics.jsonl"))]
    assert [line["status"] for line in lines] == ["nonfinite", "updated", "updated"]
    assert lines[-1]["nonfinite_steps"] == 1


TASK = '{"prompt": "price apple", "answer": "3"}'
TRAJ = '{"prompt": "price apple", "calls": ["price apple"], "responses": ["3"], "answer": "3"}'


@pytest.mark.parametrize("key, lines, message", [
    ("tasks_file", [TASK, '{"prompt": "price apple", "answer": 3}'], "line 2: 'answer' must be a str"),
    ("tasks_file", [TASK, "", '{"prompt": "x"'], "line 3: not valid JSON"),
    ("test_file", ['{"prompt": "price apple"}'], "line 1: missing key 'answer'"),
    ("test_file", ['["price apple", "3"]'], "line 1: expected a JSON object"),
    ("logged_file", [TRAJ, TRAJ.replace('["3"]', '["3", "4"]')], "line 2: 1 calls but 2 responses"),
    ("logged_file", [TRAJ.replace('"price apple"]', '"mul 3 4"]')],
     "line 1: call 1 'mul 3 4' is not a valid"),
    ("logged_file", [], "no trajectories in the file"),
])
def test_malformed_data_line_stops_before_training(tmp_path, key, lines, message):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = tiny_cfg(tmp_path, **{key: str(path)})
    with pytest.raises(config.ConfigError, match=message):
        train.run(cfg)
    assert not os.path.exists(cfg["out_dir"])            # nothing was built, trained or written


def test_data_files_replace_the_generated_splits(tmp_path):
    (tmp_path / "rl.jsonl").write_text(TASK + "\n")
    (tmp_path / "logged.jsonl").write_text(TRAJ + "\n" + TRAJ + "\n")
    cfg = tiny_cfg(tmp_path, tasks_file=str(tmp_path / "rl.jsonl"),
                   logged_file=str(tmp_path / "logged.jsonl"))
    splits = features.build_tasks(cfg)
    assert [t["prompt"] for t in splits["rl"]] == ["price apple"] and len(splits["logged"]) == 2
    assert len(splits["test"]) == cfg["n_test"]           # not named: still generated


def test_missing_data_file_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"tasks_file: {tmp_path / 'nope.jsonl'}\nout_dir: {tmp_path / 'run'}\n")
    assert train.main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read tasks file" in err[0] and "nope.jsonl" in err[0]


def test_bf16_autocast_only_on_cuda():
    on = {**config.DEFAULTS, "bf16": True}
    assert not isinstance(distributed.autocast(on, "cpu"), torch.autocast)
    assert not isinstance(distributed.autocast({**on, "bf16": False}, "cuda"), torch.autocast)
    with warnings.catch_warnings():          # a CPU-only torch warns that it disables it
        warnings.simplefilter("ignore")
        ctx = distributed.autocast(on, "cuda:0")
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
