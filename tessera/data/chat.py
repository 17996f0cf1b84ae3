"""Chat templates: a conversation (a list of {role, content} messages) -> the text a model is trained on, and the
character spans of it that are trained (the assistant turns).

A tokenizer folder whose tokenizer_config.json holds a `chat_template` is rendered by `transformers`' own renderer
(the one `apply_chat_template` runs, with the special tokens by name and a record's tools and documents), so the
text, tokenized once without added special tokens, gives the same ids. A template with `{% generation %}` tags
marks the trained spans itself (transformers' assistant mask). Without them, an assistant turn's span is what
rendering the conversation up to it adds after the generation prompt of the conversation before it (its content
and the template's end of turn, not the header). A template whose rendering of the first turns is not the start
of the whole conversation's (one that drops earlier turns' reasoning, like Qwen 3's) gives one example per
assistant turn instead: that turn's conversation so far, only that turn trained, as the model sees it when it
answers.

Tokenizers without a template (the built-in byte tokenizer included) use the plain template (PLAIN): each
message is `ROLE: CONTENT` and a newline; an assistant turn's header `assistant: ` is not trained, its content and
the EOS token after it (instead of the newline) are.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tessera.config.manager import ConfigError

ROLES = ("system", "user", "assistant", "tool")
PLAIN = "plain"


class TemplateError(ValueError):
    """A conversation the template refuses or cannot render: a bad record, not a bad setting."""


@dataclass(frozen=True)
class Rendered:
    """One training example: `text`, the character spans [start, end) of it that are trained, and the places
    (character offsets) an EOS token id goes between its tokens (the plain template's end of an assistant turn),
    trained when inside a span or at its end."""
    text: str
    spans: tuple[tuple[int, int], ...]
    eos_at: tuple[int, ...] = ()


@dataclass(frozen=True)
class Context:
    """What a record gives its template beside the messages: tool schemas and documents (as transformers passes
    them)."""
    tools: list | None = None
    documents: list | None = None


_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class JinjaTemplate:
    """A tokenizer's own chat template (a jinja2 string) with the special tokens it names, rendered by transformers'
    own renderer (the one apply_chat_template runs: its sandbox, helpers, `{% generation %}` tags, reasoning
    aliases)."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        import jinja2  # deferred: only chat data needs them
        from transformers.utils.chat_template_utils import _compile_jinja_template

        try:
            _compile_jinja_template(source)  # cached: rendering compiles it no more
        except jinja2.TemplateError as e:
            raise ConfigError(f"model.hf_assets_path: the chat_template of tokenizer_config.json does not compile "
                              f"({e}); fix it, or set training.chat_template = 'plain'") from None
        self.source, self.special_tokens = source, special_tokens
        self.tagged = bool(_GENERATION.search(source))  # it marks the trained spans itself

    def render(self, messages: list[dict], add_generation_prompt: bool = False, context: Context = Context(),
               tagged: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The text, and (`tagged`) the character spans its `{% generation %}` tags enclose."""
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, spans = render_jinja_template([messages], tools=context.tools, documents=context.documents,
                                                 chat_template=self.source, return_assistant_tokens_mask=tagged,
                                                 add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            if type(e) is jinja2.TemplateError:  # the template's own raise_exception: its message
                raise TemplateError(str(e)) from None
            raise TemplateError(f"the chat template fails on it ({type(e).__name__}: {e})") from None
        return texts[0], [tuple(span) for span in spans[0]] if tagged else []

    def conversation(self, messages: list[dict], assistant_only: bool, context: Context = Context()) -> list[Rendered]:
        """The example(s) of a conversation (see the module's docstring)."""
        full, tagged = self.render(messages, context=context, tagged=self.tagged and assistant_only)
        if not assistant_only:
            return [Rendered(full, ((0, len(full)),))]
        if self.tagged:
            return [Rendered(full, tuple(tagged))]
        spans, whole = [], True
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, context=context)[0]
            upto = self.render(messages[:i + 1], context=context)[0]
            if not upto.startswith(before):
                raise TemplateError("the chat template's generation prompt is not the start of the assistant turn "
                                    "it renders, so the turn cannot be told from its header")
            whole = whole and full.startswith(upto)
            spans.append((i, len(before), len(upto)))
        if whole:
            return [Rendered(full, tuple((start, end) for _, start, end in spans))]
        return [Rendered(self.render(messages[:i + 1], context=context)[0], ((start, end),))
                for i, start, end in spans]


class PlainTemplate:
    """The documented template for tokenizers without one (see the module's docstring)."""

    def conversation(self, messages: list[dict], assistant_only: bool, context: Context = Context()) -> list[Rendered]:
        if context.tools or context.documents or any(m.get("tool_calls") for m in messages):
            raise TemplateError("the plain template has no place for tools, documents or tool calls; use a tokenizer "
                                "whose chat template renders them (model.hf_assets_path)")
        text, spans, eos_at = "", [], []
        for message in messages:
            content = text_of(message.get("content"))
            if message["role"] == "assistant":
                text += "assistant: "
                spans.append((len(text), len(text) + len(content)))
                text += content
                eos_at.append(len(text))  # the turn ends with the EOS id, not a newline
            else:
                text += f"{message['role']}: {content}\n"
        if not assistant_only:
            spans = [(0, len(text))]
        return [Rendered(text, tuple(spans), tuple(eos_at))]


def text_of(content) -> str:
    """A message's text: its content string, or its text parts (`[{"type": "text", "text": ...}]`) joined."""
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content or ""


def special_tokens(config: dict) -> dict[str, str]:
    """The special tokens tokenizer_config.json names (bos_token, eos_token, ...), as strings, as templates use."""
    found = {}
    for name, value in config.items():
        if name.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if name.endswith("_token") and isinstance(value, str):
            found[name] = value
    return found


def build_template(hf_assets_path: str, choice: str) -> JinjaTemplate | PlainTemplate:
    """training.chat_template: 'auto' (the tokenizer's own, the plain one when it has none) or 'plain'."""
    if choice == PLAIN or not hf_assets_path:
        return PlainTemplate()
    file = Path(hf_assets_path, "tokenizer_config.json")
    try:
        config = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"model.hf_assets_path: {file} is not valid JSON ({e})") from None
    source = config.get("chat_template")
    jinja_file = Path(hf_assets_path, "chat_template.jinja")  # where transformers >= 4.50 saves it
    if source is None and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    return PlainTemplate() if not source else JinjaTemplate(source, special_tokens(config))
