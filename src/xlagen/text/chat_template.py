"""Chat templates: a checkpoint's Jinja template (tokenizer_config.json "chat_template", or chat_template.jinja)
rendering a conversation into the model's prompt, as transformers' `apply_chat_template` does.

Reference: transformers 5.24, `utils/chat_template_utils.py` (`_cached_compile_jinja_template`,
`render_jinja_template`). Templates come from checkpoints, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment` with transformers' settings (trim_blocks, lstrip_blocks, loop controls) and
globals (`raise_exception`, `strftime_now`, a `tojson` filter that keeps non-ASCII characters).

`continue_final_message` leaves the last (assistant) message open, as transformers does: the message's text
is rendered with a tag after it, and the rendered text is cut where the tag is (before it, and before the
spaces a template trimmed from the message's end), so the turn's closing tokens are left out.

Known divergences: no tools, documents or assistant-token masks; `continue_final_message` continues the
"content" of an assistant message only (transformers also takes other fields and other roles).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any


# transformers' tag: unlikely in a message, and its trailing space tells whether a template trimmed the text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A template that cannot be compiled, or that refused a conversation (its `raise_exception`)."""


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2  # lazily: only chat needs it
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return environment.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ChatTemplateError(f"the chat template does not compile: {error}") from error


def render(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
           continue_final_message: bool = False, special_tokens: Mapping[str, str | None] | None = None,
           **variables: Any) -> str:
    """Renders a conversation with a chat template.

    Args:
        template: The Jinja source.
        messages: `{"role": ..., "content": ...}` dicts.
        add_generation_prompt: End with the start of an assistant turn.
        continue_final_message: End inside the last message, an assistant one, for the model to continue it
            (a prefilled start of its answer): without the tokens that close its turn.
        special_tokens: `bos_token`, `eos_token`, ... as the template sees them.
        **variables: Further template variables.

    Returns:
        The prompt text.

    Raises:
        ChatTemplateError: If the template does not compile or refuses the conversation.
        TypeError: If a message is not a mapping.
        ValueError: With `continue_final_message`: if `add_generation_prompt` is set too, if the last message is
            not an assistant one or has no text, or if the template does not render its text.
    """
    import jinja2

    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
    messages = [dict(m) for m in messages]
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible: "
                             "continue_final_message continues the last message, add_generation_prompt starts a new "
                             "assistant message")
        final_text = _tag_final_message(messages)
    compiled = _compile(template)
    try:
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **{k: v for k, v in (special_tokens or {}).items() if v is not None}, **variables)
    except jinja2.exceptions.TemplateError as error:
        raise ChatTemplateError(f"the chat template refused the conversation: {error}") from error
    return _cut_after_final_message(text, final_text) if continue_final_message else text


def _tag_final_message(messages: list[dict[str, Any]]) -> str:
    """Appends the tag to the last message's text (its last text block); returns that text."""
    if not messages or messages[-1].get("role") != "assistant":
        role = messages[-1].get("role") if messages else None
        raise ValueError(f"continue_final_message continues the last message, which must be an assistant one; "
                         f"got {'no message' if role is None else f'a {role!r} message'}")
    final = messages[-1] = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return content
    if isinstance(content, (list, tuple)):  # content blocks: continue the last text block
        blocks = [dict(block) if isinstance(block, Mapping) else block for block in content]
        for block in reversed(blocks):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                text, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                final["content"] = blocks
                return text
    raise ValueError("continue_final_message: the last message has no text to continue")


def _cut_after_final_message(text: str, final_text: str) -> str:
    """The rendered text up to the end of the last message's text (where its tag is)."""
    tag = _CONTINUE_TAG.strip()
    if tag not in text or final_text.strip() not in text:
        raise ValueError("continue_final_message: the chat template does not render the last message's text as "
                         "it is, so it cannot be continued")
    position = text.rindex(tag)
    if text.startswith(_CONTINUE_TAG, position):
        return text[:position]
    return text[:position].rstrip()  # the template trimmed the message's trailing spaces (and the tag's)
