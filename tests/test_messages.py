"""The lines a run prints where a setting or an outcome is not the usual one: a warm start with
nothing to train on, acts cut at max_act_tokens beside malformed calls, a fidelity gate with no
tool called, the memory estimate of a CPU run and of evaluation, the ignored BFCL task files, and
the separate layout's refusal of multi-turn tasks. Expectations are computed by hand."""
import json
import os
import subprocess
from types import SimpleNamespace

import pytest

from chat import tasks as chat_tasks
from formats import features, format_plain
from machinery import config, distributed
import train
from evaluate import evaluate, summary
from helpers import POSITION_INIT, ScriptedModel, chat_tokenizer, tiny_qwen, toy_tokenizer
from worldmodel.honesty import fidelity_gate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30


# ----------------------------------------------------------------------------- warm start with no data

def test_a_warm_start_with_no_logged_file_and_no_task_examples_says_it_was_skipped(tmp_path, capsys):
    """configs/chat_tiny.yaml on two toy chat tasks without `examples` and no logged_file: sft_steps 2
    has nothing to train on. The run goes on from the model as loaded and says so in one line;
    no line claims a warm start."""
    tasks = [json.loads(line) for line in open(os.path.join(ROOT, "data", "toy_chat_example.jsonl"))][:2]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({k: v for k, v in t.items() if k != "examples"}) + "\n"
                                                  for t in tasks))
    tiny_qwen(chat_tokenizer(), tmp_path / "qwen", init_range=POSITION_INIT)
    args = ["--config", os.path.join(ROOT, "configs", "chat_tiny.yaml"), f"--model={tmp_path / 'qwen'}",
            f"--out_dir={tmp_path / 'run'}", f"--tasks_file={tmp_path / 'tasks.jsonl'}",
            f"--test_file={tmp_path / 'tasks.jsonl'}", "--logged_file=", "--sft_steps=2", "--rl_steps=0",
            "--max_act_tokens=4", "--max_env_tokens=4", "--max_tokens=640", "--n_collusion=0"]
    assert train.main(args) == 0
    printed = capsys.readouterr().out.splitlines()
    [line] = [x for x in printed if "warm start" in x]
    assert line.startswith("warm start skipped, nothing to train on: no logged_file and no task has examples "
                           "(give logged_file=FILE, or sft_steps: 0); the model as loaded (")
    assert "): success " in line


# ----------------------------------------------------------------------------- acts cut at max_act_tokens

def test_an_act_cut_at_max_act_tokens_is_no_format_error():
    """Five toy tasks: a right answer, a wrong answer, a malformed call, text past max_act_tokens (8),
    a tag written by the actor. format_errors: the malformed endings (bad_call, bad_act), 2 / 5;
    cut_at_act_limit: 1 / 5."""
    tok = toy_tokenizer()
    cases = [("price apple", "3", "<act> price apple </act> <env> x x <act> answer 3 </act>"),
             ("price milk", "2", "<act> answer 5 </act>"),
             ("price egg", "1", "<act> mul egg </act>"),
             ("price tea", "4", "<act>" + " price" * 10),
             ("price fish", "9", "<act> price fish <env>")]
    tasks = [{"prompt": p, "answer": a, "family": "price"} for p, a, _ in cases]
    cfg = {**config.DEFAULTS, "n_collusion": 0}
    result = evaluate(ScriptedModel(tok, {p: s for p, _, s in cases}), tok, tasks, cfg, format_plain,
                      format_plain.setup(cfg, tok, {"logged": []}))
    assert result["causes"] == {"answer": 2, "bad_call": 1, "act_limit": 1, "bad_act": 1}
    assert result["format_errors"] == pytest.approx(2 / 5)
    assert result["cut_at_act_limit"] == pytest.approx(1 / 5)
    assert summary(result).startswith("success 0.200 on 5 tasks | format errors 0.400 | cut at max_act_tokens 0.200 | "
                                      "mean calls 0.20 | would-rehearse fidelity: ")


def test_the_summary_line_says_when_no_tool_was_called_and_no_act_was_cut():
    """An evaluation where no episode called a tool (every act ran past max_act_tokens): the fidelity
    figure says it was not measured rather than print nothing after its colon; with no act cut the
    line has no cut figure (the demo's lines read as they did)."""
    m = {"success": 0.0, "n_tasks": 4, "executed_tasks": 4, "format_errors": 0.0, "cut_at_act_limit": 1.0,
         "mean_calls": 0.0, "fidelity": {}}
    assert summary(m) == ("success 0.000 on 4 tasks | format errors 0.000 | cut at max_act_tokens 1.000 | mean calls "
                          "0.00 | would-rehearse fidelity: not measured (no tool called in the real world)")
    m = {**m, "cut_at_act_limit": 0.0, "mean_calls": 2.0, "fidelity": {"lookup": 1.0}}
    assert summary(m) == ("success 0.000 on 4 tasks | format errors 0.000 | mean calls 2.00 | would-rehearse "
                          "fidelity: lookup 1.000")


# ----------------------------------------------------------------------------- fidelity with no call

def test_the_fidelity_gate_with_no_tool_called_says_nothing_was_measured():
    lines = []
    before = {"fidelity": {}, "executed_tasks": 4}
    assert fidelity_gate(before, {**config.DEFAULTS, "min_fidelity": 0.0, "env_mode": "rehearse"}, lines.append)
    assert lines == ["fidelity not measured: no tool was called in the evaluation, so the fidelity gate "
                     "checked nothing (min_fidelity 0.0, rehearse mode)"]
    lines.clear()                   # a gate that needs fidelity still stops the run
    assert not fidelity_gate(before, {**config.DEFAULTS, "min_fidelity": 0.5, "env_mode": "rehearse"}, lines.append)
    assert lines[0].startswith("fidelity gate FAILED")


# ----------------------------------------------------------------------------- memory estimate

def toy_shapes():
    return SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=4, vocab_size=10, tie_word_embeddings=True)


CFG = {**config.DEFAULTS, "micro_batch_tokens": 100, "bf16": True, "cpu_bf16": False, "fsdp": False,
       "gradient_checkpointing": False, "kl_coef": 0.0, "env_mode": "rehearse", "tasks_per_step": 4,
       "group_size": 2, "max_tokens": 50, "eval_batch_size": 3}


def test_the_memory_estimate_of_a_cpu_run_counts_fp32_and_names_no_gpu():
    """On the CPU with cpu_bf16 off the run is fp32 (distributed.autocast): 4 bytes an activation and a
    KV entry, though bf16 is on. 8 rows x 50 tokens x 2 layers x (k, v) x 1 kv head x 4 dims x 4 bytes
    = 25,600 bytes of KV cache; activations 100 tokens x 2 layers x 8 hidden x 34 x 4 / 2 = 108,800."""
    e = distributed.memory_estimate(1000, CFG, toy_shapes(), device="cpu")
    assert e["kv_cache"] * GIB == pytest.approx(8 * 50 * 2 * 2 * 1 * 4 * 4)
    assert e["activations_full"] * GIB == pytest.approx(108_800)
    assert e["sample"] * GIB == pytest.approx(4000 + 4000 + 8000 + 25_600)
    line = distributed.memory_line(e, CFG, 1, device="cpu")
    assert line.startswith("memory estimate per process, on the CPU (unsharded, GiB, rough): ") and "GPU" not in line
    half = distributed.memory_estimate(1000, {**CFG, "cpu_bf16": True}, toy_shapes(), device="cpu")
    assert half["kv_cache"] * GIB == pytest.approx(8 * 50 * 2 * 2 * 1 * 4 * 2)     # bf16 autocast on the CPU
    cuda = distributed.memory_estimate(1000, {**CFG, "bf16": False}, toy_shapes(), device="cuda")
    assert cuda["kv_cache"] == e["kv_cache"]                                        # fp32 on a GPU too
    assert distributed.memory_line(cuda, CFG, 1).startswith("memory estimate per GPU (unsharded, ")


def test_the_memory_estimate_of_evaluation_counts_eval_batch_size_rows():
    """Evaluation samples eval_batch_size (3) tasks at once, one row of up to max_tokens each: KV
    3 x 50 x 2 x 2 x 1 x 4 x 2 bytes (bf16 on a GPU) = 4,800, beside the resident 16 bytes a parameter."""
    e = distributed.memory_estimate(1000, CFG, toy_shapes())
    ev = distributed.eval_memory_estimate(e, CFG, toy_shapes())
    assert ev["kv_cache"] * GIB == pytest.approx(4800)
    assert ev["evaluate"] * GIB == pytest.approx(16_000 + 4800)
    assert "; evaluation (3 tasks at once): KV cache 0.0 = 0.0" in distributed.memory_line(e, CFG, 1, evaluation=ev)


def test_bfcl_qwen3_evaluates_in_no_more_memory_than_its_rl_sampling():
    """configs/bfcl-qwen3-1.7b.yaml on one GPU: Qwen3-1.7B (1.72e9 parameters; 28 layers, 8 KV heads
    of 128) keeps 16 + 4 (the KL reference) bytes a parameter, 32.0 GiB; a row of 12,288 tokens is
    12,288 x 28 x 2 x 8 x 128 x 2 bytes = 1.3125 GiB of KV cache. RL samples 8 x 4 = 32 rows (42 GiB);
    evaluation eval_batch_size rows, 20: 26.25 GiB (all 40 test tasks at once: 52.5, 84.5 in all)."""
    qwen3 = SimpleNamespace(num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    cfg = config.load_config(os.path.join(ROOT, "configs", "bfcl-qwen3-1.7b.yaml"))
    assert cfg["eval_batch_size"] == 20 and cfg["max_tokens"] == 12288
    assert 12288 * 28 * 2 * 8 * 128 * 2 == 1.3125 * GIB
    e = distributed.memory_estimate(1.72e9, cfg, qwen3)
    ev = distributed.eval_memory_estimate(e, cfg, qwen3)
    assert e["kv_cache"] == pytest.approx(32 * 1.3125) and ev["kv_cache"] == pytest.approx(20 * 1.3125)
    assert ev["evaluate"] == pytest.approx(20 * 1.72e9 / GIB + 26.25)              # 58.3 GiB
    assert ev["evaluate"] < e["sample"]


# ----------------------------------------------------------------------------- BFCL files, separate layout

def test_the_bfcl_task_files_are_ignored_by_git():
    done = subprocess.run(["git", "check-ignore", "-q", "data/bfcl/multi_turn_base.jsonl"], cwd=ROOT)
    assert done.returncode == 0


def test_the_separate_layout_refusing_multi_turn_tasks_says_what_to_use():
    tok = chat_tokenizer()
    price = {"type": "function", "function": {"name": "price", "parameters": {
        "type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}
    task = chat_tasks.check_task({"messages": [{"role": "user", "content": "price apple"}], "tools": [price],
                                  "turns": ["price milk"], "answer": "2", "env": "toy"}, "line 1", "tasks")
    cfg = {**config.DEFAULTS, "format": "chat", "max_tokens": 400, "rehearsal_context": "separate",
           "tasks_file": "data/bfcl/multi_turn_base.jsonl"}
    with pytest.raises(config.ConfigError) as refused:
        features.setup(cfg, tok, {"rl": [task], "test": [task], "logged": []})
    assert str(refused.value) == (
        "rehearsal_context: separate does not support multi-turn tasks, and tasks_file "
        "data/bfcl/multi_turn_base.jsonl has them ('turns', or logged trajectories with several user turns): "
        "set rehearsal_context: inline (for SmolLM2: configs/smollm2.yaml, not configs/smollm2-separate.yaml)")


# ----------------------------------------------------------------------------- limits against the ground truth

def test_tasks_no_episode_can_win_within_the_limits_are_counted_in_one_warning_line(capsys):
    """The first three tasks of data/toy_chat_example.jsonl make 1, 2 and 4 gold calls (price cake;
    price ham, pay 6; price pear, pay 4, price lime, pay 5), each answered by the toy world with one
    digit. Each call as the actor writes it (the Hermes form, no text before the stop) is tokenized
    here from its literal text; a rehearsed response is its digit and the newline before
    </tool_response>: 2 tokens. max_turns 2 leaves the 4-call task out; max_act_tokens 20 every task
    with a call of more than 20 tokens; max_env_tokens 1 every task, but only where the world is
    rehearsed."""
    from chat import setup as chat_setup
    tok = chat_tokenizer()
    tasks = chat_tasks.read_chat_jsonl(os.path.join(ROOT, "data", "toy_chat_example.jsonl"), "tasks")[:3]
    tags = chat_setup.chat_tags(tok)

    def act(name, key, value):
        text = '<tool_call>\n{"name": "%s", "arguments": {"%s": %s}}\n</tool_call>' % (name, key, json.dumps(value))
        return len(tok.encode(text, add_special_tokens=False))

    acts = [[act("price", "item", "cake")], [act("price", "item", "ham"), act("pay", "amount", 6)],
            [act("price", "item", "pear"), act("pay", "amount", 4), act("price", "item", "lime"), act("pay", "amount", 5)]]
    assert [a[:1] for a in acts] == [[22], [act("price", "item", "ham")], [20]]     # BPE: "cake" is 3 tokens here
    cfg = {**config.DEFAULTS, "max_turns": 2, "max_act_tokens": 20, "max_env_tokens": 1, "max_tokens": 4096}
    over, blocked = chat_setup.warn_gold_limits(cfg, tok, tags, tasks, "toy (RL)", rehearsed=True)
    act_over = sum(max(a) > 20 for a in acts)
    assert over == {"max_turns": [1, 4], "max_act_tokens": [act_over, max(map(max, acts))], "max_env_tokens": [3, 2],
                    "max_tokens": [0, over["max_tokens"][1]]} and blocked == 3
    [line] = capsys.readouterr().err.splitlines()
    assert line == (f"warning: toy (RL): 3 of 3 tasks cannot be won within the limits: 1 more calls than max_turns 2 "
                    f"(up to 4); {act_over} a call longer than max_act_tokens 20 (up to {max(map(max, acts))}); 3 a "
                    f"response longer than max_env_tokens 1 (up to 2); raise the limits to at least these")
    over, blocked = chat_setup.gold_limits({**cfg, "max_turns": 4, "max_act_tokens": 22}, tok, tags, tasks,
                                           rehearsed=False)        # evaluation: real responses, no env limit
    assert over["max_env_tokens"] == [0, 0] and blocked == 0
    # the gold episode is what the sampler builds: one token less of max_tokens than it needs is over
    longest = over["max_tokens"][1]
    assert chat_setup.gold_limits({**cfg, "max_turns": 4, "max_act_tokens": 22, "max_tokens": longest - 1}, tok, tags,
                                  tasks, rehearsed=False)[0]["max_tokens"][0] == 1
    chat_setup.warn_gold_limits({**cfg, "max_turns": 4, "max_act_tokens": 22}, tok, tags, tasks, "toy (test)", False)
    assert capsys.readouterr().err == ""                       # nothing over: no line
