"""Faults: a non-finite step's optimizer step is skipped without touching weights or optimizer
state (an earlier PPO epoch of the step stays applied) and three in a row stop the run (RL and
warm start);
non-finite weights are never saved and non-finite logits stop sampling with one line; malformed
data files stop the run before training with the line and what is wrong; bf16 autocast only on CUDA.
Then the executor, oracle and BFCL paths: user code that exits or raises (a constructor, a tools
or check module, a tool, a task's check), a reward outside [0, 1], the oracle into a run folder,
the oracle's and bfcl.py's options and output folders, signals during the oracle, evaluate.py and
bfcl.py, and files rewritten whole: each one line and an exit status, nothing saved lost."""
from formats import features
from formats import format_plain
import envace
from machinery import distributed
from machinery import config
from machinery import checkpoint
from machinery import faults
import contextlib
import json
import math
import os
import warnings

import pytest
import torch
import yaml

from scripts import evaluate_cli
import rollout
import train
from envace import REHEARSE, encode_episode
from helpers import tiny_cfg, tiny_llama, toy_tokenizer, wrap_train_logprobs

TOK = toy_tokenizer()
FP32 = contextlib.nullcontext()          # rl_step's autocast context on the CPU in fp32


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


def one_group(cfg):
    """One group of 4 rehearsed episodes (rewards 1, 0, 0, 1: every row has A != 0) as rl_step's batch."""
    eps = [encode_episode(TOK, "price apple", ["price apple"], [r], "3", env_role=REHEARSE) for r in "3456"]
    return train.make_batch(eps, [1.0, 0.0, 0.0, 1.0], {**cfg, "group_size": 4}, TOK.pad_token_id)


def test_nonfinite_step_leaves_weights_and_optimizer_untouched(monkeypatch):
    model = tiny_llama(TOK)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 24}      # one 14-token row per micro-batch
    batch = one_group(cfg)
    assert train.rl_step(model, model, opt, batch, cfg, FP32)["status"] == "updated"
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    adam = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    nan_loss_on(monkeypatch, {1})               # the second of the four micro-batches
    stats = train.rl_step(model, model, opt, batch, cfg, FP32)
    assert stats["status"] == "nonfinite" and stats["rows_updated"] == 4
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    after = opt.state[next(iter(model.parameters()))]
    assert all(torch.equal(adam[k], after[k]) for k in adam)
    assert all(p.grad is None for p in model.parameters())


def test_three_nonfinite_steps_in_a_row_stop_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    """Every RL step non-finite: the loop stops after the third with one line, exit 1; the metrics
    hold the three steps; the last checkpoint is step 0's (save_every 50), the warm start's weights,
    which no step changed."""
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    nan_loss_on(monkeypatch, None)
    assert train.main(["--config", config_file(tmp_path, rl_steps=10)]) == 1
    assert one_error_line(capsys).startswith("error: 3 non-finite RL steps in a row (up to step 3)")
    out = str(tmp_path / "run")
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [line["status"] for line in lines] == ["nonfinite"] * 3
    assert [line["nonfinite_steps"] for line in lines] == [1, 2, 3]
    state = torch.load(os.path.join(out, "ckpt", "trainer_state.pt"), weights_only=False)
    assert state["step"] == 0
    saved = checkpoint.load_policy(os.path.join(out, "ckpt"))[0].state_dict()
    warm = checkpoint.load_policy(os.path.join(out, "warmstart"))[0].state_dict()
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


def test_bf16_autocast_on_cuda_and_on_the_cpu_only_with_cpu_bf16():
    on = {**config.DEFAULTS, "bf16": True}
    assert not isinstance(distributed.autocast(on, "cpu"), torch.autocast)
    cpu = distributed.autocast({**on, "cpu_bf16": True}, "cpu")
    assert isinstance(cpu, torch.autocast) and cpu.device == "cpu" and cpu.fast_dtype == torch.bfloat16
    assert not isinstance(distributed.autocast({**on, "bf16": False}, "cuda"), torch.autocast)
    with warnings.catch_warnings():          # a CPU-only torch warns that it disables it
        warnings.simplefilter("ignore")
        ctx = distributed.autocast(on, "cuda:0")
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16


# ----------------------------------------------------------------------------- non-finite values anywhere

def nan_logprobs_on(monkeypatch, calls):
    """Make the warm start's token_logprobs NaN on the given call numbers (0-based; one call per
    step with one micro-batch), all if None: in a run (setup's choice) and in the returned pass,
    for a direct call of train.warm_start."""
    count = [0]

    def nan_on_calls(real):
        def patched(*args, **kwargs):
            out = real(*args, **kwargs)
            count[0] += 1
            return out * float("nan") if calls is None or count[0] - 1 in calls else out
        return patched
    return wrap_train_logprobs(nan_on_calls, monkeypatch.setattr)


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
    logprobs = nan_logprobs_on(monkeypatch, nan_calls)
    cfg = {**config.DEFAULTS, "sft_steps": steps, "sft_batch_size": 4, "micro_batch_tokens": 10_000}
    try:
        skipped = train.warm_start(model, model, logged_sequences(), cfg, TOK.pad_token_id, logprobs=logprobs)
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
def test_a_nonfinite_epoch_skips_its_optimizer_step_and_keeps_the_earlier_epochs(monkeypatch, epochs, bad_epoch):
    """One micro-batch per epoch, epoch `bad_epoch` (0-based) non-finite: the step stops there with
    status "nonfinite"; the epochs before it stay applied, so the weights and AdamW's state are
    those of a twin model that ran the same step with ppo_epochs = bad_epoch (none: as the step
    found them), and AdamW took bad_epoch steps in it; no gradient is kept."""
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 10_000, "ppo_epochs": epochs}
    batch = one_group(cfg)
    runs = []
    for _ in range(2):                                     # the model and its twin, made and stepped alike
        model = tiny_llama(TOK)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert train.rl_step(model, model, opt, batch, cfg, FP32)["status"] == "updated"
        runs.append((model, opt))
    (model, opt), (twin, twin_opt) = runs
    if bad_epoch:
        assert train.rl_step(twin, twin, twin_opt, batch, {**cfg, "ppo_epochs": bad_epoch}, FP32)["status"] == "updated"
    found = {k: v.clone() for k, v in model.state_dict().items()}
    nan_loss_on(monkeypatch, {bad_epoch})
    assert train.rl_step(model, model, opt, batch, cfg, FP32)["status"] == "nonfinite"
    want = twin.state_dict()
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
    # the epochs before the bad one moved the weights; a bad first epoch left them as found
    assert all(torch.equal(found[k], v) for k, v in model.state_dict().items()) == (bad_epoch == 0)
    after, adam = opt.state_dict(), twin_opt.state_dict()
    assert after["param_groups"] == adam["param_groups"] and after["state"].keys() == adam["state"].keys()
    assert all(torch.equal(adam["state"][i][k], after["state"][i][k])
               for i in adam["state"] for k in adam["state"][i])
    assert all(int(s["step"]) == epochs + bad_epoch for s in after["state"].values())   # the first step's + these
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
    real = checkpoint.rl_state

    def poisoned(model, *args, **kwargs):                    # the weights break after checkpoint 0 is saved
        state = real(model, *args, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return state
    monkeypatch.setattr(checkpoint, "rl_state", poisoned)
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


# ----------------------------------------------------------------------------- executors, the oracle, BFCL

TOOLS = '''
import os, signal, sys, time


class Weather:
    """A forecast tool whose response shows every way a tool can answer: a kind per city."""
    def forecast(self, city):
        if city == "Tuple":
            return {(1, 2): "tuple keys"}
        if city == "Cycle":
            d = {}
            d["self"] = d
            return d
        if city == "Nothing":
            return None
        if city == "Prints":
            print("printed by the tool")
            return {"city": city}
        if city == "Exits":
            sys.exit(0)
        if city == "Interrupts":
            raise KeyboardInterrupt
        if city == "Signals":              # Ctrl-C or SIGTERM while a tool runs
            open(os.environ.get("TOOL_MARK", "/dev/null"), "w").close()
            os.kill(os.getpid(), getattr(signal, os.environ.get("TOOL_SIGNAL", "SIGTERM")))
            time.sleep(30)
        if city == "Hangs":
            open(os.environ["TOOL_MARK"], "w").close()
            time.sleep(60)
        return {"city": city}


class ExitsAtLoad:
    def __init__(self):
        sys.exit(0)

    def forecast(self, city):
        return city


class ConstructsOnce:
    """Constructs when the task file is read, then raises, exits or hangs (env_config `then`)."""
    built = 0

    def __init__(self, then):
        ConstructsOnce.built += 1
        if ConstructsOnce.built > 1:
            {"raise": lambda: 1 / 0, "exit": lambda: sys.exit(3), "hang": lambda: time.sleep(60)}[then]()

    def forecast(self, city):
        return city


def check_returns(task, episode):
    value = task["messages"][-1]["content"]
    return {"1.5": 1.5, "-0.5": -0.5, "nan": float("nan"), "None": None, "'1'": "1"}[value]


def check_raises(task, episode):
    raise ValueError("the check's own bug")


def check_exits(task, episode):
    sys.exit(0)
'''


@pytest.fixture
def sigterm_guard():
    """SIGTERM, left to its default, would end this test process: while a test runs, a SIGTERM that
    reaches no handler of the code under test raises here instead, so that the test fails."""
    import signal

    def unhandled(signum, frame):
        raise RuntimeError("SIGTERM reached no handler of the code under test")
    previous = signal.signal(signal.SIGTERM, unhandled)
    yield
    signal.signal(signal.SIGTERM, previous)


def weather_line(**kw):
    """data/weather_example.jsonl's first task with the tools above."""
    with open(os.path.join(os.path.dirname(__file__), "..", "data", "weather_example.jsonl")) as f:
        line = json.loads(f.readline())
    return {**{k: v for k, v in line.items() if k != "env_config"}, "env": "tools.py:Weather", **kw}


def task_file(tmp_path, *lines, name="tasks.jsonl"):
    (tmp_path / "tools.py").write_text(TOOLS)
    path = tmp_path / name
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def city_calls(*cities):
    return [{"name": "forecast", "arguments": {"city": c}} for c in cities]


def oracle(path, out, *extra):
    return evaluate_cli.main(["--oracle", f"--test_file={path}", f"--out_dir={out}", *extra])


def test_a_tools_response_is_an_error_for_what_json_cannot_encode_or_no_result(tmp_path, monkeypatch, capsys):
    """call_tool on each kind of answer: the response is the tool's value (None: null; prints go to
    the terminal, not the response), or an error response for a value JSON cannot encode (tuple
    keys, a cycle) and for a call that ends with no result (sys.exit, a KeyboardInterrupt the tool
    raised itself): never an exception out of call_tool, never a traceback on stderr."""
    import threading
    from chat import executor
    unhandled = []                      # what would print "Exception in thread ..." and a traceback
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    task_file(tmp_path, weather_line())
    weather = executor.load_object("tools.py:Weather", str(tmp_path))()
    answers = {c: executor.call_tool(weather, city_calls(c)[0], ("forecast",), 5.0)
               for c in ("Rome", "Nothing", "Prints", "Tuple", "Cycle", "Exits", "Interrupts")}
    assert answers == {
        "Rome": '{"city": "Rome"}', "Nothing": "null", "Prints": '{"city": "Prints"}',
        "Tuple": '{"error": "TypeError: forecast returned a value JSON cannot encode (keys must be str, int, '
                 'float, bool or None, not tuple)"}',
        "Cycle": '{"error": "ValueError: forecast returned a value JSON cannot encode (Circular reference detected)"}',
        "Exits": '{"error": "RuntimeError: forecast ended without a result"}',
        "Interrupts": '{"error": "RuntimeError: forecast ended without a result"}'}
    captured = capsys.readouterr()
    assert captured.out == "printed by the tool\n" and captured.err == "" and unhandled == []


def test_the_oracle_goes_on_past_a_tool_json_cannot_encode(tmp_path, capsys):
    """A tool returning a dict with tuple keys used to kill the evaluation with a traceback and no
    result: now it is that call's error response, the oracle writes its file and names the task."""
    path = task_file(tmp_path, weather_line(gold_calls=city_calls("Tuple", "Rome")), weather_line())
    assert oracle(path, tmp_path / "o") == 0
    result = json.loads((tmp_path / "o" / "oracle.json").read_text())
    assert (result["success"], result["executed_tasks"]) == (1.0, 2)   # the answer and calls match: the
    printed = capsys.readouterr()                                      # default reward reads no response
    assert printed.err == "" and printed.out.startswith("oracle success 1.000 on 2 replayed of 2 tasks")


@pytest.mark.parametrize("where", ["constructor", "module", "check module"])
def test_user_code_exiting_at_load_is_one_line_not_a_silent_exit_0(tmp_path, capsys, where):
    """sys.exit(0) in an executor's constructor (or a tools module, or a check's module) as the task
    file is read: train.py used to exit 0 printing and writing nothing. Now one line naming the
    file, the line and the spec, exit 2, for train.py and the oracle alike; nothing written."""
    if where == "constructor":
        path = task_file(tmp_path, weather_line(env="tools.py:ExitsAtLoad"))
        expected = f"{path} line 1: env 'tools.py:ExitsAtLoad': ExitsAtLoad(**env_config) raised SystemExit: 0"
    else:
        path = task_file(tmp_path, weather_line(**({"env": "exits.py:Weather"} if where == "module"
                                                   else {"check": "exits.py:check"})))
        (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
        spec = "env 'exits.py:Weather'" if where == "module" else "'check' 'exits.py:check'"
        expected = f"{path} line 1: {spec}: loading {tmp_path / 'exits.py'} raised SystemExit: 0"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"format: chat\nmodel: {tmp_path / 'no-model'}\ntasks_file: {path}\nout_dir: {tmp_path / 'run'}\n")
    assert train.main(["--config", str(cfg)]) == 2
    assert one_error_line(capsys) == f"error: {expected}"
    assert oracle(path, tmp_path / "o") == 2
    assert one_error_line(capsys) == f"error: {expected}"
    assert not (tmp_path / "run").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("then, why", [
    ("raise", "ZeroDivisionError: division by zero"),
    ("exit", "RuntimeError: ConstructsOnce(**env_config) ended without a result"),
    ("hang", "TimeoutError: ConstructsOnce(**env_config) took longer than 0.2 s")])
def test_an_executor_failing_for_a_new_episode_is_one_line_naming_the_task(tmp_path, capsys, then, why):
    """The executor constructed when the file was read but raises, exits or hangs for an episode:
    one line naming the task and why, exit 1 (user code failing mid-run), nothing written."""
    path = task_file(tmp_path, weather_line(env="tools.py:ConstructsOnce", env_config={"then": then}))
    assert oracle(path, tmp_path / "o", "--tool_timeout=0.2") == 1
    line = capsys.readouterr().err.strip()
    assert line == (f"error in the oracle's replay: ExecutorError: {path} line 1: env 'tools.py:ConstructsOnce': "
                    f"the executor of a new episode could not be built: {why} (--debug shows the traceback)")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["1.5", "-0.5", "nan", "None", "'1'"])
def test_a_check_returning_a_reward_outside_0_1_is_refused_naming_task_and_value(tmp_path, capsys, value):
    """A task's check returning 1.5 used to give "oracle success 1.500" (nan: "nan", None and a
    string a traceback): now one line naming the task's file and line and the value, exit 2."""
    ok = weather_line(check="tools.py:check_returns")
    bad = {**ok, "messages": ok["messages"][:-1] + [{"role": "user", "content": value}]}
    path = task_file(tmp_path, weather_line(), bad)
    assert oracle(path, tmp_path / "o") == 2
    assert one_error_line(capsys) == (f"error: {path} line 2: check '{tmp_path / 'tools.py'}:check_returns' "
                                      f"returned {value}: a check returns a reward in [0, 1]")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("check, why", [("check_raises", "ValueError: the check's own bug"),
                                        ("check_exits", "SystemExit: 0")])
def test_a_check_that_raises_or_exits_is_one_line_naming_the_task(tmp_path, capsys, check, why):
    path = task_file(tmp_path, weather_line(check=f"tools.py:{check}"))
    assert oracle(path, tmp_path / "o") == 2
    assert one_error_line(capsys) == f"error: {path} line 1: check '{tmp_path / 'tools.py'}:{check}' raised {why}"


def test_checked_score_takes_a_real_number_in_0_1():
    import numpy as np
    from chat.chat_reward import checked_score
    task = {"check": "m:f", "where": "f.jsonl line 4"}
    assert [checked_score(lambda t, e: v, task, {}) for v in (0, 1, 0.25, True, np.float32(0.5))] == [0, 1, 0.25, 1, 0.5]
    for v in (1.0000001, -1e-9, float("inf"), "0.5", [1]):
        with pytest.raises(config.ConfigError, match=r"^f\.jsonl line 4: check 'm:f' returned .*in \[0, 1\]$"):
            checked_score(lambda t, e: v, task, {})


def test_the_oracle_into_a_train_py_run_keeps_every_file(tmp_path, capsys):
    """`evaluate.py --oracle --out_dir=RUN` onto a finished run used to overwrite its eval.json and
    its `before` record: it writes RUN/oracle.json, every file of the run byte for byte as before
    (the run's files written here as train.py writes them: eval.json with `before`, config.yaml,
    warmstart/eval.json, ckpt/)."""
    run = tmp_path / "run"
    files = {"eval.json": json.dumps({"success": 0.9, "before": {"success": 0.5}}), "config.yaml": "seed: 1\n",
             "warmstart/eval.json": json.dumps({"success": 0.5}), "ckpt/model.safetensors": "weights",
             "metrics.jsonl": '{"step": 1}\n'}
    for name, text in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    assert oracle(task_file(tmp_path, weather_line()), run) == 0
    assert {str(p.relative_to(run)): p.read_text() for p in run.rglob("*") if p.is_file()} == \
        {**files, "oracle.json": (run / "oracle.json").read_text()}
    assert json.loads((run / "oracle.json").read_text())["success"] == 1.0
    assert capsys.readouterr().out.strip().endswith(f"written to {run / 'oracle.json'}")
    assert oracle(task_file(tmp_path, weather_line()), run / "eval.json") == 2             # a file, not a folder
    assert one_error_line(capsys) == (f"error: cannot write {run / 'eval.json' / 'oracle.json'}: "
                                      f"{run / 'eval.json'} is a file, not a folder")
    assert (run / "eval.json").read_text() == files["eval.json"]


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required: --test_file, --out_dir (--help lists the options)"),
    (["--test_file=T", "--out_dir=O", "--tool_timeout=0"], "config key 'tool_timeout' must be > 0, got 0.0"),
    (["--test_file=T", "--out_dir=O", "--tool_timeout=-1"], "config key 'tool_timeout' must be > 0, got -1.0"),
    (["--test_file=T", "--out_dir=O", "--tool_timeout=nan"], "config key 'tool_timeout' must be a finite number, got nan"),
    (["--test_file=T", "--out_dir=O", "--tool_timeout=inf"], "config key 'tool_timeout' must be a finite number, got inf"),
    (["--test_file=T", "--out_dir=O", "--tool_timeout=abc"],
     "argument --tool_timeout: invalid float value: 'abc' (--help lists the options)"),
    (["--test_file=T", "--out_dir="], "--out_dir is empty: give the folder for oracle.json"),
    (["--test_file=T", "--out_dir=O", "--ckpt=out/small", "--n_test=3"],
     "--oracle replays gold calls with no model: it takes no --ckpt, --n_test")])
def test_the_oracles_options_are_checked_in_one_line(capsys, args, message):
    """Before: argparse's usage block, and a tool_timeout of nan / inf a traceback (0 and -1: every
    call timed out at once)."""
    assert evaluate_cli.main(["--oracle", *args]) == 2
    assert one_error_line(capsys) == f"error: {message}"


def test_an_empty_text_override_is_the_empty_text():
    """docs/tools.md's `--logged_file=` failed ("must be str, got None"): a text key takes its
    override as written, so `--logged_file=` is "" and `--out_dir=2024` the folder 2024."""
    cfg = config.load_config(os.path.join(os.path.dirname(__file__), "..", "small.yaml"),
                             ["--logged_file=", "--out_dir=2024", "--judge_model=", "--seed=3"])
    assert (cfg["logged_file"], cfg["out_dir"], cfg["judge_model"], cfg["seed"]) == ("", "2024", "", 3)
    with pytest.raises(config.ConfigError, match="config key 'seed' must be int, got ''"):
        config.load_config(os.path.join(os.path.dirname(__file__), "..", "small.yaml"), ["--seed="])


def test_a_signal_while_a_tool_runs_stops_the_oracle_with_one_line_and_keeps_its_last_result(tmp_path):
    """SIGTERM to `python evaluate.py --oracle` while a tool hangs (a process of its own, forked,
    evaluate_cli.main as evaluate.py calls it: the exit status is the process's): exit 130, one
    line, the oracle.json of an earlier run byte for byte as it was, no temporary file. Before:
    killed by SIGTERM (Ctrl-C: a traceback)."""
    import signal
    import time
    from helpers import fork_process, read_log, wait_process
    path = task_file(tmp_path, weather_line(gold_calls=city_calls("Hangs")))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "oracle.json").write_text('{"an earlier": "result"}')
    mark = tmp_path / "mark"
    pid = fork_process(evaluate_cli.main, (["--oracle", f"--test_file={path}", f"--out_dir={tmp_path / 'o'}",
                                            "--tool_timeout=60"],), tmp_path, "oracle", {"TOOL_MARK": str(mark)})
    deadline = time.time() + 120                 # a loaded machine, not a timing
    while not mark.exists() and not os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) \
            and time.time() < deadline:
        time.sleep(0.1)
    assert mark.exists(), read_log(tmp_path, "oracle")
    os.kill(pid, signal.SIGTERM)
    rc = wait_process(pid, 60)
    out, err = read_log(tmp_path, "oracle")
    assert rc == 130 and out == ""
    assert [x for x in err.splitlines() if x.strip()] == ["interrupted during the oracle's replay: nothing written"]
    assert os.listdir(tmp_path / "o") == ["oracle.json"]
    assert (tmp_path / "o" / "oracle.json").read_text() == '{"an earlier": "result"}'


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_oracle_is_130_in_process_too(tmp_path, monkeypatch, capsys, signum, sigterm_guard):
    """The same with the signal sent by the tool itself to its process (SIGINT and SIGTERM), so
    that it arrives while the oracle waits for the tool: 130, one line, nothing written."""
    monkeypatch.setenv("TOOL_SIGNAL", signum)
    path = task_file(tmp_path, weather_line(gold_calls=city_calls("Signals")))
    assert oracle(path, tmp_path / "o") == 130
    assert capsys.readouterr().err.strip() == "interrupted during the oracle's replay: nothing written"
    assert not (tmp_path / "o").exists()


def test_write_file_interrupted_keeps_the_earlier_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """write_file (eval.json, evaluate.json, oracle.json, config.yaml) writes a temporary file and
    renames it: Ctrl-C in the middle of the write leaves the earlier version whole."""
    import builtins
    path = tmp_path / "evaluate.json"
    path.write_text('{"earlier": 1}')
    real_open = builtins.open

    class Interrupted:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:5])
            raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "open", lambda file, mode="r", *a, **k:
                        Interrupted(real_open(file, mode, *a, **k)) if "w" in mode else real_open(file, mode, *a, **k))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.write_file(str(path), '{"new": 2}')
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["evaluate.json"] and path.read_text() == '{"earlier": 1}'
    checkpoint.write_file(str(path), '{"new": 2}')
    assert os.listdir(tmp_path) == ["evaluate.json"] and path.read_text() == '{"new": 2}'


def test_user_code_exiting_in_a_run_is_one_line_exit_1(capsys):
    """A SystemExit escaping train.py's run (user code calling sys.exit during the run) is one
    line, exit 1: before, the process exited with its code and printed nothing."""
    def run(cfg):
        raise SystemExit(0)
    assert faults.exit_status(lambda: {"out_dir": "unused"}, run) == 1
    assert capsys.readouterr().err.strip() == "error: SystemExit: 0 (--debug shows the traceback)"


# BFCL's converter: needs bfcl-eval (CI installs it; without it, a skip that says so, or under CI a failure)

def needs_bfcl():
    from helpers import needs
    needs("bfcl_eval")


@pytest.fixture
def base_only(monkeypatch):
    """bfcl.main converting multi_turn_base alone (its two splits too): what these tests check does
    not depend on how many categories are written, and one is a third of the time."""
    import functools
    from benchmarks import bfcl
    needs_bfcl()
    monkeypatch.setattr(bfcl, "convert", functools.partial(bfcl.convert, categories=("multi_turn_base",)))
    return bfcl


def test_bfcl_out_onto_a_file_or_other_files_is_one_line_and_writes_nothing(tmp_path, capsys, base_only):
    """`python bfcl.py --out PATH` onto a file used to be a traceback. A file of one of its names
    with other content (edited by hand) is refused before anything is written; the same content
    is left as it is; an empty or missing --out is one line."""
    bfcl = base_only
    (tmp_path / "a_file").write_text("mine")
    assert bfcl.main(["--out", str(tmp_path / "a_file")]) == 2
    assert one_error_line(capsys) == f"error: --out {tmp_path / 'a_file'} is a file, not a folder"
    assert bfcl.main(["--out", ""]) == 2
    assert one_error_line(capsys) == "error: --out is empty: give a folder for the chat task files"
    assert bfcl.main([]) == 2
    assert one_error_line(capsys) == "error: the following arguments are required: --out (--help lists the options)"
    out = tmp_path / "bfcl"
    assert bfcl.main(["--out", str(out)]) == 0
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(written) == ["multi_turn_base.jsonl", "multi_turn_base_heldout.jsonl", "multi_turn_base_rl.jsonl",
                               "multi_turn_base_rl_logged.jsonl"]
    assert bfcl.main(["--out", str(out)]) == 0                          # the same content: left as it is
    assert {p.name: p.read_bytes() for p in out.iterdir()} == written
    capsys.readouterr()
    (out / "multi_turn_base_rl.jsonl").write_text("my own 3 tasks\n")
    (out / "multi_turn_base.jsonl").unlink()
    assert bfcl.main(["--out", str(out)]) == 2
    assert one_error_line(capsys) == (f"error: {out / 'multi_turn_base_rl.jsonl'} is already there and is not what "
                                      "bfcl.py writes (edited, or from another bfcl-eval version): move it away or "
                                      "give another --out; nothing written")
    assert sorted(p.name for p in out.iterdir()) == ["multi_turn_base_heldout.jsonl", "multi_turn_base_rl.jsonl",
                                                     "multi_turn_base_rl_logged.jsonl"]
    assert (out / "multi_turn_base_rl.jsonl").read_text() == "my own 3 tasks\n"


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_while_bfcl_writes_leaves_whole_files_only(tmp_path, monkeypatch, capsys, base_only, signum, sigterm_guard):
    """Ctrl-C / SIGTERM while the second file is written (its temporary file complete, not yet
    renamed; the signal is sent to this process): exit 130, one line naming the file written
    whole; the second file absent, no temporary file. Before: SIGTERM killed it and Ctrl-C was a
    traceback, with the file being written left half-written."""
    import signal
    bfcl = base_only
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            os.kill(os.getpid(), getattr(signal, signum))
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "bfcl"
    assert bfcl.main(["--out", str(out)]) == 130
    first = out / "multi_turn_base.jsonl"
    assert capsys.readouterr().err.strip() == (f"interrupted: 1 files written whole ({first}), none half-written; "
                                               "run the same command again to finish")
    assert os.listdir(out) == ["multi_turn_base.jsonl"]
    assert len(first.read_text().splitlines()) == 200 and all(json.loads(x) for x in first.read_text().splitlines())


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_during_evaluate_py_is_130_and_writes_nothing(tmp_path, monkeypatch, capsys, signum, sigterm_guard):
    """Ctrl-C or SIGTERM while evaluate.py evaluates (a tool waiting, a model sampling): one line,
    exit 130, no result file. Before: SIGTERM killed the process with no line."""
    import signal
    cfg = {**config.DEFAULTS, "n_collusion": 0}
    monkeypatch.setattr(evaluate_cli, "load_run", lambda *a: (cfg, None, None, [], None, None, None))

    def evaluate(*a, **k):
        os.kill(os.getpid(), getattr(signal, signum))
        return {}
    monkeypatch.setattr(evaluate_cli, "evaluate", evaluate)
    assert evaluate_cli.main(["--ckpt", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == "interrupted during evaluation: no result written"
    assert os.listdir(tmp_path) == []
