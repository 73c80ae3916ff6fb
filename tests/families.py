"""Template families for the chat-format tests: a Jinja chat template written here for each
family's documented tool format (none is a copy of a published file) and a tiny byte-level BPE
whose added tokens fit it. Families: hermes (Qwen2.5 / Hermes, tests/helpers.py's template),
qwen2_newline (a Qwen2-style template writing "\\n" before the call, after the generation
prompt's own "\\n"), llama3 (Llama 3.1/3.2 JSON tool calling: a bare {"name", "parameters"}
object, <|eot_id|>, results in an ipython turn), mistral ([TOOL_CALLS] [{...}, ...] </s>,
[TOOL_RESULTS] {"content": ...}[/TOOL_RESULTS], no call ids), qwen3 (Hermes calls, <think>
blocks kept after the last user message, an empty one on the last turn, enable_thinking),
chatml_text (Hermes calls on a vocabulary where <tool_call> is ordinary text, as SmolLM2's)."""
from helpers import CHAT_CORPUS, CHAT_SPECIALS, CHAT_TEMPLATE, chat_tokenizer

_TOOLS_IN_SYSTEM = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}")
_HERMES_CALL = ("{%- set c = tc.function if tc.function is defined else tc %}"
                "{{- '<tool_call>\\n{\"name\": \"' + c.name + '\", \"arguments\": ' + c.arguments | tojson + '}\\n</tool_call>' }}")
_TOOL_TURN = ("{%- elif message.role == 'tool' %}"
              "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
              "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
              "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}")

# Qwen2-style: the assistant header always ends with "\n", and every call starts with another "\n"
QWEN2_NEWLINE = (
    _TOOLS_IN_SYSTEM + "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls or [] %}{{- '\\n' }}" + _HERMES_CALL + "{%- endfor %}{{- '<|im_end|>\\n' }}"
    + _TOOL_TURN + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

LLAMA3 = (
    "{{- bos_token }}{%- set system = messages[0].content if messages[0].role == 'system' else '' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
    "{%- set ns = namespace(first=true) %}{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{%- if tools and ns.first %}{{- 'Given the following functions, please respond with a JSON for a function "
    "call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format {\"name\": "
    "function name, \"parameters\": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson + '\\n\\n' }}{%- endfor %}{%- endif %}{%- set ns.first = false %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- if message.tool_calls | length != 1 %}{{- raise_exception('only one tool call at once') }}{%- endif %}"
    "{%- set c = message.tool_calls[0].function if message.tool_calls[0].function is defined else message.tool_calls[0] %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + c.name + '\", \"parameters\": '"
    " + c.arguments | tojson + '}<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

MISTRAL = (
    "{{- bos_token }}{%- set system = messages[0].content if messages[0].role == 'system' else '' %}"
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last %}{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST] ' + ((system + '\\n\\n') if system and loop.index0 == ns.last else '') + message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tc in message.tool_calls %}{%- set c = tc.function if tc.function is defined else tc %}"
    "{{- '{\"name\": \"' + c.name + '\", \"arguments\": ' + c.arguments | tojson + '}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- ']' + eos_token }}"
    "{%- elif message.role == 'assistant' %}{{- ' ' + message.content + eos_token }}"
    "{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS] {\"content\": ' + message.content + '}[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}")

QWEN3 = (
    _TOOLS_IN_SYSTEM +
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is defined and message.reasoning_content else '' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last and (reasoning or loop.last) %}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for tc in message.tool_calls or [] %}{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    + _HERMES_CALL + "{%- endfor %}{{- '<|im_end|>\\n' }}"
    + _TOOL_TURN + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")

FAMILIES = {
    "hermes": {"template": CHAT_TEMPLATE},
    "qwen2_newline": {"template": QWEN2_NEWLINE},
    "llama3": {"template": LLAMA3, "specials": ["<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|eot_id|>",
                                                "<|start_header_id|>", "<|end_header_id|>"],
               "eos": "<|eot_id|>", "bos": "<|begin_of_text|>"},
    "mistral": {"template": MISTRAL, "specials": ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                                                  "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                                  "[/TOOL_RESULTS]"], "eos": "</s>", "bos": "<s>"},
    "qwen3": {"template": QWEN3, "specials": CHAT_SPECIALS + ["<think>", "</think>"]},
    # the Hermes template on a vocabulary whose tool wrappers are ordinary text (SmolLM2's: no
    # <tool_call> or <tool_response> token, only the ChatML ones)
    "chatml_text": {"template": CHAT_TEMPLATE, "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]},
}


def family_tokenizer(name, newline_pairs=False):
    """The family's template on a small byte-level BPE (Qwen2's pre-tokenizer) with its added
    tokens; the first special is the pad. newline_pairs: the corpus teaches it "\\n\\n" as one
    token (as Qwen's real vocabulary has), which the qwen2_newline template then cannot fit."""
    family = FAMILIES[name]
    return chat_tokenizer(family["template"], family.get("specials", CHAT_SPECIALS), family.get("eos", "<|im_end|>"),
                          family.get("bos"), CHAT_CORPUS + (["a\n\nb\n\n"] * 5 if newline_pairs else []))
