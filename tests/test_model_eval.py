"""evaluate.py --model: a model as it is (no checkpoint of train.py: the untrained baseline) evaluated
under a config's chat template, tasks and limits, as a checkpoint of the same weights is; the one
line for what to evaluate given wrong; and the one line for tasks whose prompts do not fit the
model's context (max_position_embeddings) or max_tokens, from train.py and evaluate.py alike."""
import json
import os
import shutil
import sys

import pytest
import yaml

from chat import format as chat
from chat import tasks as chat_tasks
from machinery import config
from scripts import evaluate_cli
import evaluate
import train
from helpers import chat_tokenizer, run_command, tiny_llama, tiny_qwen, toy_tokenizer, without_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT_TINY = os.path.join(ROOT, "configs", "chat_tiny.yaml")
TASKS = os.path.join(ROOT, "data", "toy_chat_example.jsonl")
TOK = chat_tokenizer()
# a random model writes long calls: 12 act tokens keep its episodes short; max_env_tokens stays 16
OVERRIDES = [f"--tasks_file={TASKS}", f"--test_file={TASKS}", "--logged_file=", "--max_act_tokens=12",
             "--max_tokens=640", "--n_collusion=0"]


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ----------------------------------------------------------------------------- a model as it is

def test_a_model_as_it_is_is_evaluated_as_a_checkpoint_of_it(tmp_path, capsys):
    """`python evaluate.py --model FOLDER --config configs/chat_tiny.yaml` on a tiny random Qwen2
    saved with its tokenizer (no config.yaml: train.py never wrote it): exit 0, the summary line and
    out_dir/eval.json on 3 test tasks; the same weights saved as a checkpoint with the same config
    and evaluated by --ckpt give the same eval.json (the same kernels in the same order: greedy
    episodes, their rewards and fidelity are equal, not close). A second run keeps that eval.json
    and writes evaluate.json, as --ckpt does in a run folder."""
    qwen, out = tmp_path / "qwen", tmp_path / "out"
    tiny_qwen(TOK, qwen)
    command = [sys.executable, os.path.join(ROOT, "evaluate.py"), "--model", str(qwen), "--config", CHAT_TINY,
               f"--out_dir={out}", "--n_test=3", *OVERRIDES]
    proc = run_command(command, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "eval.json").read_text())
    assert proc.stdout.splitlines() == [evaluate.summary(result), f"written to {out / 'eval.json'}"]
    assert result["n_tasks"] == sum(result["causes"].values()) == result["executed_tasks"] == 3
    assert len(result["task_rewards"]) == 3 and "collusion" not in result and os.listdir(out) == ["eval.json"]

    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen, ckpt)
    cfg = config.load_config(CHAT_TINY, [f"--model={qwen}", f"--out_dir={tmp_path / 'run'}", *OVERRIDES])
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert evaluate_cli.main(["--ckpt", str(ckpt), "--n_test=3"]) == 0
    assert without_seconds(json.loads((ckpt / "eval.json").read_text())) == without_seconds(result)

    capsys.readouterr()
    assert evaluate_cli.main(["--model", str(qwen), "--config", CHAT_TINY, f"--out_dir={out}", "--n_test=2",
                              *OVERRIDES]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"written to {out / 'evaluate.json'}"
    assert json.loads((out / "eval.json").read_text()) == result
    assert json.loads((out / "evaluate.json").read_text())["n_tasks"] == 2


@pytest.mark.parametrize("argv, line", [
    (["--ckpt", "{run}", "--model", "{qwen}", "--config", CHAT_TINY],
     "--ckpt evaluates a run of train.py, --model a model as it is: give one of them"),
    ([], "give --ckpt <run folder>, or --model PATH --config CONFIG for a model as it is (runs are compared by "
         "python -m scripts.compare --compare)"),
    (["--model=", "--config", CHAT_TINY], "--model is empty: give a Hugging Face folder or gguf:PACKAGE/FILE.gguf "
                                          "(and --config)"),
    (["--model", "{qwen}"], "--model {qwen} needs --config CONFIG: its chat template, tasks and limits"),
    (["--ckpt", "{run}", "--config", CHAT_TINY], "--config goes with --model: --ckpt evaluates under its run's "
                                                 "config.yaml (change a key with --key=value)"),
    (["--model", "{qwen}", "--config", CHAT_TINY, "--coverage"],
     "--coverage and --validation read a run of train.py: give --ckpt, not --model"),
    (["--ckpt", "{qwen}"], "no checkpoint written by train.py in {qwen}: to evaluate the model in it as it is, "
                           "give --model {qwen} --config CONFIG"),
    (["--model", "{missing}", "--config", CHAT_TINY], "no model checkpoint in {missing} (config.json missing)"),
], ids=["ckpt_and_model", "neither", "model_empty", "model_without_config", "config_with_ckpt",
        "model_with_coverage", "ckpt_on_a_model", "model_missing"])
def test_what_to_evaluate_given_wrong_is_one_line(tmp_path, capsys, argv, line):
    """Each mistake in what to evaluate: exit 2, one line on stderr (no traceback), nothing written."""
    tiny_qwen(TOK, tmp_path / "qwen")
    names = {"run": tmp_path / "run", "qwen": tmp_path / "qwen", "missing": tmp_path / "nowhere"}
    argv = [a.format(**names) for a in argv]
    assert evaluate_cli.main(argv) == 2
    assert one_error_line(capsys) == "error: " + line.format(**names)
    assert sorted(os.listdir(tmp_path)) == ["qwen"]


# ----------------------------------------------------------------------------- prompts that do not fit

def plain_setup(tmp_path, words, max_tokens):
    """A tiny random Llama (the toy tokenizer, 256 positions) saved as a model folder, a test file of
    one plain task whose prompt is `words` words ("price apple ..."), and a config of both: (config
    path, model folder)."""
    model = tmp_path / "llama"
    tiny_llama(toy_tokenizer()).save_pretrained(model)
    toy_tokenizer().save_pretrained(model)
    test_file = tmp_path / "long.jsonl"
    test_file.write_text(json.dumps({"prompt": " ".join(["price", "apple"] * (words // 2)), "answer": "3"}) + "\n")
    cfg = {"model": str(model), "test_file": str(test_file), "out_dir": str(tmp_path / "run"), "n_logged": 40,
           "n_new_logged": 2, "n_rl_tasks": 40, "n_test": 4, "tasks_per_step": 4, "max_tokens": max_tokens}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), str(model)


@pytest.mark.parametrize("max_tokens", [96, 300])
def test_prompts_longer_than_the_models_context_are_one_line_with_both_numbers(tmp_path, capsys, max_tokens):
    """A plain task of 1,000 words: 1,001 tokens with its <bos>, past the model's 256 positions,
    whatever max_tokens is (96: under the prompt; 300: past the positions too). train.py and
    evaluate.py --model each stop with the same line: the prompt's length, the model's context, and
    the context these tasks need: 1,001 + max_act_tokens 8 + max_env_tokens 6 = 1,015 (the defaults)."""
    path, model = plain_setup(tmp_path, 1000, max_tokens)
    line = (f"error: the tasks: the longest prompt is 1,001 tokens but the model ({model}) has a context of 256 "
            "(max_position_embeddings): these tasks need a model with a context of at least 1,015 tokens (the "
            "prompt + max_act_tokens + max_env_tokens, room for one call and its response); use a model with a "
            "longer context, or tasks with shorter prompts")
    assert train.main(["--config", path]) == 2
    assert one_error_line(capsys) == line
    assert evaluate_cli.main(["--model", model, "--config", path]) == 2
    assert one_error_line(capsys) == line
    assert not os.path.exists(tmp_path / "run")


def test_a_prompt_that_fits_the_model_but_not_max_tokens_says_what_max_tokens_to_set(tmp_path, capsys):
    """A plain task of 100 words (101 tokens with its <bos>) under max_tokens 96, on a model of 256
    positions: the max_tokens line, now with the range to set: at least 101 + 8 + 6 = 115 (the
    prompt + max_act_tokens + max_env_tokens), at most 256; from train.py and evaluate.py --model."""
    path, model = plain_setup(tmp_path, 100, 96)
    line = ("error: max_tokens (96) leaves no room for an episode: a task's prompt is 101 tokens with its <bos> "
            "('price apple price apple price apple pric'); set max_tokens to at least 115 and at most 256 (the "
            "model's max_position_embeddings)")
    assert train.main(["--config", path]) == 2
    assert one_error_line(capsys) == line
    assert evaluate_cli.main(["--model", model, "--config", path]) == 2
    assert one_error_line(capsys) == line
    assert not os.path.exists(tmp_path / "run")


def chat_prompt_lengths():
    """Each task of data/toy_chat_example.jsonl: the length of its prompt, rendered by the template."""
    return [len(chat.prompt_ids(TOK, t["messages"], t["tools"])) for t in chat_tasks.read_chat_jsonl(TASKS, "tasks")]


def test_chat_prompts_longer_than_the_models_context_name_the_task_and_the_context(tmp_path, capsys):
    """The chat example's prompts (several hundred tokens each) on a tiny Qwen2 whose config says 128
    positions, with max_tokens 640 (past them too): evaluate.py's command line (`--model`) stops with
    exit 2 and one line on stderr (no load bar, no traceback) naming the longest task's file and line,
    its length, the 128 and the context needed (+ max_act_tokens 12 + max_env_tokens 16)."""
    qwen = tmp_path / "qwen"
    tiny_qwen(TOK, qwen)
    settings = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**settings, "max_position_embeddings": 128}))
    lengths = chat_prompt_lengths()
    n = max(lengths)
    assert n > 128
    assert evaluate_cli.main(["--model", str(qwen), "--config", CHAT_TINY, f"--out_dir={tmp_path / 'out'}",
                              *OVERRIDES]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.splitlines() == [
        f"error: {TASKS} line {lengths.index(n) + 1}: the longest prompt is {n:,} tokens but the model ({qwen}) has "
        f"a context of 128 (max_position_embeddings): these tasks need a model with a context of at least "
        f"{n + 28:,} tokens (the prompt + max_act_tokens + max_env_tokens, room for one call and its response); "
        "use a model with a longer context, or tasks with shorter prompts"]
    assert sorted(os.listdir(tmp_path)) == ["qwen"]


def test_a_chat_prompt_that_fits_the_model_but_not_max_tokens_says_what_max_tokens_to_set(tmp_path, capsys):
    """The same tasks with max_tokens 100 on the tiny Qwen2's 2,048 positions: the max_tokens line,
    now with the range to set: at least the prompt + 12 + 16, at most 2048."""
    qwen = tmp_path / "qwen"
    tiny_qwen(TOK, qwen)
    lengths = chat_prompt_lengths()
    n = max(lengths)
    opening = chat_tasks.read_chat_jsonl(TASKS, "tasks")[lengths.index(n)]["messages"][-1]["content"]
    assert evaluate_cli.main(["--model", str(qwen), "--config", CHAT_TINY, f"--out_dir={tmp_path / 'out'}",
                              *OVERRIDES, "--max_tokens=100"]) == 2
    assert one_error_line(capsys) == (
        f"error: max_tokens (100) leaves no room for an episode: a task's prompt (messages + tools + later user "
        f"turns) is {n} tokens ({opening[:40]!r}); set max_tokens to at least {n + 28} and at most 2048 (the "
        "model's max_position_embeddings)")
