"""A small chat tokenizer for benches and tests, built in a second with no download: a byte-level
BPE with Qwen2's pre-tokenizer and special tokens, trained on a fixed corpus of the toy shop's and
JSON tool calls' words (deterministic), and a Qwen2.5 / Hermes-style chat template. scripts/speed.py's chat
workload and the chat format's tests run the chat format on it with a random tiny model.
"""

CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>"]
# Qwen2's pre-tokenizer pattern: words, single digits, punctuation runs with their newlines
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# A Qwen2.5 / Hermes-style template: tools as JSON in the system turn, tool calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, tool responses in a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT_WORDS = ("system user assistant tools name arguments type function description parameters "
              "properties required object string integer enum additionalProperties false true "
              "price item mul pay amount answer error funds args call shop the a of is what "
              "cost buy and not you are use apple").split()
CHAT_CORPUS = ["\n".join(CHAT_WORDS), " ".join(CHAT_WORDS), '{"name": "price", "arguments": {"item": "apple"}}',
               '{"type": "function", "function": {"name": "mul", "parameters": {}}}\n', "0123456789"]


def chat_tokenizer(template=CHAT_TEMPLATE, specials=CHAT_SPECIALS, eos="<|im_end|>", bos=None, corpus=CHAT_CORPUS,
                   vocab_size=1000):
    """A small byte-level BPE with Qwen's pre-tokenizer, special tokens (the first is the pad) and a
    chat template (Hermes-style by default), trained on a fixed corpus (deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=specials[0],
                                   additional_special_tokens=specials[1:], **({"bos_token": bos} if bos else {}))
    fast.chat_template = template
    return fast
