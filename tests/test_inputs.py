"""Nothing a user types crashes the run, and nothing finished is ever lost: a key given twice,
settings that could never train, sizes that do not fit, and a second run into a finished run's
folder are each refused with one line (exit code 2) before anything trains or is written;
evaluate.py keeps train.py's eval.json."""
import hashlib
import json
import os

import pytest
import yaml

from scripts import evaluate_cli
from formats import features
import train
from machinery.config import ConfigError, load_config
from helpers import tiny_cfg


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def write_config(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def tree(folder):
    """{relative path: sha256} of every file under `folder`."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def small_yaml(tmp_path, **kw):
    """A config file of tiny_cfg's keys (what train.main reads)."""
    cfg = tiny_cfg(tmp_path, **kw)
    return write_config(tmp_path, yaml.safe_dump(cfg, sort_keys=False)), cfg


# ----------------------------------------------------------------------------- the config file

@pytest.mark.parametrize("in_base", [False, True])
def test_a_key_given_twice_is_one_line_naming_key_and_file(tmp_path, capsys, in_base):
    twice = "seed: 2\nlr: 0.001\nrl_steps: 3\nlr: 0.01\n"
    if in_base:
        bad = write_config(tmp_path, twice, "b.yaml")
        path = write_config(tmp_path, "base: b.yaml\nseed: 3\n")
    else:
        bad = path = write_config(tmp_path, twice)
    assert train.main(["--config", path]) == 2
    line = one_error_line(capsys)
    assert "'lr'" in line and "twice" in line and bad in line and "lines 2 and 4" in line
    assert ("the base of" in line) == in_base
    assert not os.path.exists(tmp_path / "run")


def test_keys_given_once_and_yaml_merge_keys_still_load(tmp_path):
    from machinery.config import UniqueKeyLoader
    assert load_config(write_config(tmp_path, "seed: 2\nlr: 0.01\n"))["lr"] == 0.01
    # a merge key may override what it merges: that is not a key given twice
    assert yaml.load("a: &x {k: 1, j: 2}\nb:\n  <<: *x\n  k: 3\n", Loader=UniqueKeyLoader) == \
        {"a": {"k": 1, "j": 2}, "b": {"k": 3, "j": 2}}
    with pytest.raises(ConfigError, match="'a' is given twice in .*n.yaml: at lines 1 and 1"):
        load_config(write_config(tmp_path, "seed: {a: 1, a: 2}\n", "n.yaml"))     # nested mappings too


def test_group_size_one_cannot_train(tmp_path, capsys):
    path = write_config(tmp_path, f"out_dir: {tmp_path / 'run'}\n")
    assert train.main(["--config", path, "--group_size=1"]) == 2
    line = one_error_line(capsys)
    assert "group_size 1" in line and "could update" in line and "rl_steps: 0" in line
    assert not os.path.exists(tmp_path / "run")
    assert load_config(path, ["--group_size=1", "--rl_steps=0"])["group_size"] == 1   # a warm start only


# ----------------------------------------------------------------------------- sizes, in train.run

def test_fewer_rl_tasks_than_a_step_samples(tmp_path, capsys):
    tasks = tmp_path / "rl.jsonl"
    tasks.write_text('{"prompt": "price apple", "answer": "3"}\n{"prompt": "price pear", "answer": "2"}\n')
    path, cfg = small_yaml(tmp_path, tasks_file=str(tasks))
    assert train.main(["--config", path]) == 2
    line = one_error_line(capsys)
    assert "tasks_per_step (4) is more than the 2 RL tasks" in line and str(tasks) in line
    assert not os.path.exists(cfg["out_dir"])          # nothing built, trained or written


def test_an_empty_test_split(tmp_path, capsys, monkeypatch):
    build = features.build_tasks
    monkeypatch.setattr(features, "build_tasks", lambda cfg: {**build(cfg), "test": []})
    path, cfg = small_yaml(tmp_path)
    assert train.main(["--config", path]) == 2
    assert "the test split is empty" in one_error_line(capsys)
    assert not os.path.exists(cfg["out_dir"])


@pytest.mark.parametrize("max_tokens, message", [
    (6, "max_tokens (6) leaves no room for an episode: a task's prompt is "),
    (300, "max_tokens (300) is more than the model's max_position_embeddings (256)"),
])
def test_max_tokens_that_does_not_fit(tmp_path, capsys, max_tokens, message):
    path, cfg = small_yaml(tmp_path)
    assert train.main(["--config", path, f"--max_tokens={max_tokens}"]) == 2
    assert message in one_error_line(capsys)
    assert not os.path.exists(cfg["out_dir"])


def test_the_longest_prompt_with_its_bos_is_what_must_fit(tmp_path):
    from machinery.checkpoint import build_tokenizer
    from machinery.config import check_lengths
    tok = build_tokenizer(features.tiny_words({"rehearsal_context": "inline"}))
    model_config = type("C", (), {"max_position_embeddings": 256})
    tasks = [{"prompt": "price apple"}, {"prompt": "what is the price of apple"}]
    n = 1 + len(tok.encode(tasks[1]["prompt"], add_special_tokens=False))
    check_lengths({**tiny_cfg(tmp_path), "max_tokens": n + 1}, tok, model_config, tasks)
    with pytest.raises(ConfigError, match=f"is {n} tokens with its <bos> \\('what is"):
        check_lengths({**tiny_cfg(tmp_path), "max_tokens": n}, tok, model_config, tasks)


# ----------------------------------------------------------------------------- a finished run's folder

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (warm start, 1 RL step, eval.json with `before`): (config path, out_dir)."""
    tmp = tmp_path_factory.mktemp("finished")
    cfg = tiny_cfg(tmp, rl_steps=1, sft_steps=2, n_test=4, n_collusion=2)
    assert train.run(cfg) == 0
    return os.path.join(cfg["out_dir"], "config.yaml"), cfg["out_dir"]


def test_a_second_run_into_a_finished_folder_is_refused(finished, capsys):
    path, out = finished
    files = tree(out)
    assert {"ckpt/config.json", "ckpt/trainer_state.pt", "warmstart/config.json", "eval.json"} <= set(files)
    assert train.main(["--config", path]) == 2
    line = one_error_line(capsys)
    assert f"{out} already holds a checkpoint ({out}/ckpt)" in line
    assert "--resume" in line and "--out_dir" in line and "--overwrite" in line
    assert tree(out) == files                           # every file byte for byte
    assert train.main(["--config", path, "--resume", "--overwrite"]) == 2
    assert "give one" in one_error_line(capsys)
    assert tree(out) == files


def test_a_warm_start_alone_is_refused_too_without_resume_advice(tmp_path, capsys):
    path, cfg = small_yaml(tmp_path)
    os.makedirs(os.path.join(cfg["out_dir"], "warmstart"))           # e.g. a run the gate stopped
    open(os.path.join(cfg["out_dir"], "warmstart", "config.json"), "w").write("{}")
    assert train.main(["--config", path]) == 2
    line = one_error_line(capsys)
    assert "warmstart" in line and "--overwrite" in line and "--resume" not in line
    assert os.listdir(cfg["out_dir"]) == ["warmstart"]


def test_evaluate_keeps_train_py_eval_json(finished, capsys):
    _, out = finished
    files = tree(out)
    assert evaluate_cli.main(["--ckpt", out, "--n_test=0"]) == 2
    assert "--n_test must be at least 1" in one_error_line(capsys)
    assert evaluate_cli.main(["--ckpt", out, "--n_test=2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"written to {out}/evaluate.json"
    assert {k: v for k, v in tree(out).items() if k != "evaluate.json"} == files     # eval.json untouched
    kept, new = (json.load(open(os.path.join(out, name))) for name in ("eval.json", "evaluate.json"))
    assert "before" in kept and kept["n_tasks"] == 4 and new["n_tasks"] == 2 and "before" not in new
    assert evaluate_cli.main(["--ckpt", out, "--max_tokens=300"]) == 2         # an override that does not fit
    assert "max_position_embeddings (256)" in one_error_line(capsys)


def test_overwrite_starts_the_finished_run_over(finished):
    # the last test on `finished`: it replaces that run (a 1-step warm start, no RL step)
    path, out = finished
    files = tree(out)
    assert train.main(["--config", path, "--overwrite", "--rl_steps=0", "--sft_steps=1"]) == 0
    now = tree(out)
    assert now["warmstart/model.safetensors"] != files["warmstart/model.safetensors"]
    assert open(os.path.join(out, "metrics.jsonl")).read() == ""           # started over: no step yet
    assert yaml.safe_load(open(path))["sft_steps"] == 1
