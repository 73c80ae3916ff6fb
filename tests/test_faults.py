"""Faults: non-finite steps are skipped without touching weights or optimizer and three in a row
stop the run with the last good state (RL and warm start; several PPO epochs are undone whole);
non-finite weights are never saved and non-finite logits stop sampling with one line; malformed
data files stop the run before training with the line and what is wrong; bf16 autocast only on CUDA."""
from formats import features
from formats import plain as format_plain
import envace
from machinery import distributed
from machinery import config
from machinery import checkpoint
from machinery import faults
import copy
import json
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import yaml

from machinery import evaluate_cli
import rollout
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
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 24}      # one 14-token row per micro-batch
    eps, rewards, groups = one_group()
    assert train.rl_step(model, model, opt, eps, rewards, groups, cfg, TOK.pad_token_id)[1] == "updated"
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    adam = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    nan_loss_on(monkeypatch, {1})               # the second of the four micro-batches
    sums, status = train.rl_step(model, model, opt, eps, rewards, groups, cfg, TOK.pad_token_id)
    assert status == "nonfinite"
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    after = opt.state[next(iter(model.parameters()))]
    assert all(torch.equal(adam[k], after[k]) for k in adam)
    assert all(p.grad is None for p in model.parameters())


def test_three_nonfinite_steps_in_a_row_stop_with_the_last_good_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
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
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
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


# ----------------------------------------------------------------------------- non-finite values anywhere

def nan_logprobs_on(monkeypatch, calls):
    """Make the warm start's token_logprobs NaN on the given call numbers (0-based; one call per
    step with one micro-batch), all if None."""
    real, count = envace.token_logprobs, [0]

    def patched(*args, **kwargs):
        out = real(*args, **kwargs)
        count[0] += 1
        return out * float("nan") if calls is None or count[0] - 1 in calls else out
    monkeypatch.setattr(train, "token_logprobs", patched)


def logged_sequences():
    return [encode_episode(TOK, f"price {item}", [f"price {item}"], ["3"], "3")
            for item in ("apple", "pear", "milk", "egg")]


def warm(monkeypatch, steps, nan_calls):
    """warm_start of a tiny Llama with NaN logprobs on `nan_calls`: (the model, its initial
    weights, the skipped steps warm_start returns, the AdamW steps it took)."""
    model = tiny_llama(TOK)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps_taken, real_step = [], torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step",
                        lambda self, *a, **k: steps_taken.append(1) or real_step(self, *a, **k))
    nan_logprobs_on(monkeypatch, nan_calls)
    cfg = {**config.DEFAULTS, "sft_steps": steps, "sft_batch_size": 4, "micro_batch_tokens": 10_000}
    try:
        skipped = train.warm_start(model, model, logged_sequences(), cfg, TOK.pad_token_id)
        return model, before, skipped, len(steps_taken)
    finally:
        monkeypatch.undo()


def test_nonfinite_warm_start_step_is_skipped_and_the_warm_start_goes_on(monkeypatch):
    model, before, skipped, steps = warm(monkeypatch, 1, {0})      # the only step: nothing applied
    assert (skipped, steps) == (1, 0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    model, before, skipped, steps = warm(monkeypatch, 5, {0, 2, 4})   # never two in a row: it goes on
    assert (skipped, steps) == (3, 2)
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_three_nonfinite_warm_start_steps_in_a_row_raise(monkeypatch):
    with pytest.raises(envace.NonFiniteError,
                       match=r"^3 non-finite warm-start steps in a row \(up to step 4 of 5\)"):
        warm(monkeypatch, 5, {1, 2, 3})


def config_file(tmp_path, **kw):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_cfg(tmp_path, **kw), sort_keys=False))
    return str(path)


def one_error_line(capsys):
    """The one `error:` line of a run that stopped on stderr (the progress bars share stderr)."""
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip() and "%|" not in line]
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in captured.err, captured.err
    return err[0]


def test_nonfinite_warm_start_stops_the_run_with_one_line_and_saves_nothing(tmp_path, monkeypatch, capsys):
    path = config_file(tmp_path)
    earlier = tmp_path / "run" / "warmstart"                 # an earlier run's warm start: kept as it was
    earlier.mkdir(parents=True)
    (earlier / "model.safetensors").write_text("earlier")
    nan_logprobs_on(monkeypatch, None)
    assert train.main(["--config", path, "--overwrite"]) == 1      # (without it the folder is refused)
    assert "3 non-finite warm-start steps in a row (up to step 3 of 5): nothing saved" in one_error_line(capsys)
    assert os.listdir(earlier) == ["model.safetensors"] and (earlier / "model.safetensors").read_text() == "earlier"
    assert sorted(os.listdir(tmp_path / "run")) == ["config.yaml", "warmstart"]


def test_nonfinite_warm_started_weights_are_never_saved(tmp_path, monkeypatch, capsys):
    real = train.warm_start

    def poisoned(model, *args, **kwargs):                    # finite steps, then broken weights
        skipped = real(model, *args, **kwargs)
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("inf")
        return skipped
    monkeypatch.setattr(train, "warm_start", poisoned)
    assert train.main(["--config", config_file(tmp_path, sft_steps=1)]) == 1
    line = one_error_line(capsys)
    assert "the warm-started weights are not finite (NaN or inf): not saved as" in line
    assert sorted(os.listdir(tmp_path / "run")) == ["config.yaml"]


@pytest.mark.parametrize("epochs, bad_epoch", [(1, 0), (2, 0), (2, 1), (3, 2)],
                         ids=["1 epoch", "epoch 1 of 2", "epoch 2 of 2", "epoch 3 of 3"])
def test_nonfinite_epoch_rolls_the_whole_step_back(monkeypatch, epochs, bad_epoch):
    """One micro-batch per epoch: a bad epoch after good ones, whose updates were applied, undoes
    the step whole. One epoch takes no snapshot: nothing was applied before its check."""
    model = tiny_llama(TOK)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 10_000, "ppo_epochs": epochs}
    eps, rewards, groups = one_group()
    assert train.rl_step(model, model, opt, eps, rewards, groups, cfg, TOK.pad_token_id)[1] == "updated"
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    adam = copy.deepcopy(opt.state_dict())
    nan_loss_on(monkeypatch, {bad_epoch})
    if epochs == 1:                                          # as before: no copy of weights or optimizer
        monkeypatch.setattr(faults, "copy", SimpleNamespace(deepcopy=lambda x: pytest.fail("a snapshot")))
    sums, status = train.rl_step(model, model, opt, eps, rewards, groups, cfg, TOK.pad_token_id)
    assert status == "nonfinite"
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    after = opt.state_dict()
    assert after["param_groups"] == adam["param_groups"] and after["state"].keys() == adam["state"].keys()
    assert all(torch.equal(adam["state"][i][k], after["state"][i][k])
               for i in adam["state"] for k in adam["state"][i])
    assert all(p.grad is None for p in model.parameters())


def test_sample_token_says_the_logits_are_not_finite():
    logits = torch.zeros(3, 5)
    logits[1, 2] = float("-inf")                            # a masked token is fine
    assert math.isfinite(rollout.sample_token(logits, 1.0, 0.9)[1].sum().item())
    for bad in (float("nan"), float("inf")):
        broken = logits.clone()
        broken[2, 0] = bad
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (0, 1.0)):
            with pytest.raises(envace.NonFiniteError, match=r"^the policy's logits are not finite \(NaN or inf\) "
                                                            r"while sampling: the weights are broken"):
                rollout.sample_token(broken, temperature, top_p)
    with pytest.raises(envace.NonFiniteError):             # a row with no token left
        rollout.sample_token(torch.full((1, 5), float("-inf")), 1.0, 1.0)


def test_sample_episodes_with_nan_weights_raise_the_error():
    model = tiny_llama(TOK)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(envace.NonFiniteError, match="logits are not finite"):
        rollout.sample_episodes(model, TOK, ["price apple"] * 2, "rehearse",
                                generator=torch.Generator().manual_seed(0))


def test_nonfinite_logits_in_rl_stop_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    real = train.rl_state

    def poisoned(model, *args, **kwargs):                    # the weights break after the warm start is saved
        state = real(model, *args, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return state
    monkeypatch.setattr(train, "rl_state", poisoned)
    assert train.main(["--config", config_file(tmp_path, sft_steps=2, n_test=4)]) == 1
    assert "the policy's logits are not finite (NaN or inf) while sampling" in one_error_line(capsys)
    run = tmp_path / "run"
    assert (run / "metrics.jsonl").read_text() == ""                    # no step finished
    state = torch.load(run / "ckpt" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 0                                          # checkpoint 0, as saved
    saved = checkpoint.load_policy(str(run / "ckpt"))[0].state_dict()
    warm = checkpoint.load_policy(str(run / "warmstart"))[0].state_dict()
    assert all(torch.isfinite(v).all() and torch.equal(v, warm[k]) for k, v in saved.items())


def test_evaluate_on_a_nan_checkpoint_is_one_line(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path)
    tokenizer = checkpoint.build_tokenizer(features.tiny_words(cfg))
    model = checkpoint.build_model(cfg, tokenizer)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    path = os.path.join(cfg["out_dir"], "ckpt")
    checkpoint.save_checkpoint(model, tokenizer, path, {"config.yaml": yaml.safe_dump(cfg, sort_keys=False)})
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"], "--n_test=2"]) == 1
    assert "the policy's logits are not finite (NaN or inf) while sampling" in one_error_line(capsys)
    assert not os.path.exists(os.path.join(path, "eval.json"))


def test_nonfinite_is_the_gradient_norm_or_the_loss():
    assert not faults.nonfinite(torch.tensor(3.0), 0.5)
    assert faults.nonfinite(torch.tensor(float("inf")), 0.5)
    assert faults.nonfinite(torch.tensor(1.0), float("nan"))
    assert faults.nonfinite(float("nan"), 1.0)


def test_error_line_names_the_phase_and_the_first_line_of_the_message():
    assert faults.error_line(ValueError("bad value\nsecond line"), "RL step 3") == \
        "error in RL step 3: ValueError: bad value (--debug shows the traceback)"
    assert faults.error_line(KeyError(), "setup", debug=False) == "error in setup: KeyError (--debug shows the traceback)"
