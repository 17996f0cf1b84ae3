"""Chat data for the SFT tests: a byte-level BPE tokenizer folder saved by `transformers` with a real chat template
(ChatML, as Qwen's), and conversations."""

import json
from pathlib import Path

# ChatML with a default system message, as Qwen 2.5's template renders it.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{%- elif message.role in "
    "['user', 'assistant', 'system'] %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}{%- else %}{{- raise_exception('unknown role ' + message.role) }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# As Qwen 3's: the last assistant turn after the last user message gets an (empty) think block, earlier ones none.
THINKING = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 "
    "%}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.index0 > ns.last and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# ChatML with what published templates render beyond plain turns: tool schemas, documents, content given as text
# parts, reasoning, assistant tool calls and tool results; TAGGED marks the trained spans with {% generation %}.
RICH = (
    "{%- macro text(c) %}{%- if c is string %}{{- c }}{%- elif c %}{%- for p in c %}{{- p.text }}{%- endfor %}"
    "{%- endif %}{%- endmacro %}"
    "{%- if tools %}{{- '<|im_start|>system\n<tools>' + tools | tojson + '</tools><|im_end|>\n' }}{%- endif %}"
    "{%- if documents %}{{- '<|im_start|>system\n' }}{%- for d in documents %}{{- d.title + ': ' + d.text + '\n' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.role == 'assistant' %}@OPEN@"
    "{%- if m.reasoning_content %}{{- '<think>' + m.reasoning_content + '</think>' }}{%- endif %}{{- text(m.content) }}"
    "{%- for call in m.tool_calls or [] %}{{- '<tool_call>' + call.function | tojson + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>' }}@CLOSE@{{- '\n' }}"
    "{%- else %}{{- text(m.content) + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
TAGGED = RICH.replace("@OPEN@", "{%- generation %}").replace("@CLOSE@", "{%- endgeneration %}")
RICH = RICH.replace("@OPEN@", "").replace("@CLOSE@", "")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]
TOOL_CALLING = [
    {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                        "function": {"name": "add", "arguments": {"a": 2}}}]},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "reasoning": "The tool said 4.", "content": "4, of course."}]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4, of course."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": "Green, or maybe red."}],
    [{"role": "user", "content": "Say hello in French."}, {"role": "assistant", "content": "Bonjour !"}],
]


def chat_tokenizer(folder: Path, template: str = CHATML) -> Path:
    """A byte-level BPE (trained here on a few sentences) with ChatML's special tokens, saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    corpus = [m["content"] for c in CONVERSATIONS for m in c] * 4 + ["system user assistant helpful"] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
