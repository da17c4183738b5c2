"""Chat templates: a checkpoint's Jinja template (tokenizer_config.json "chat_template", or chat_template.jinja)
rendering a conversation into the model's prompt, as transformers' `apply_chat_template` does.

Reference: transformers 5.24, `utils/chat_template_utils.py` (`_cached_compile_jinja_template`,
`render_jinja_template`). Templates come from checkpoints, so they are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment` with transformers' settings (trim_blocks, lstrip_blocks, loop controls) and
globals (`raise_exception`, `strftime_now`, a `tojson` filter that keeps non-ASCII characters).

Known divergences: no tools, documents, assistant-token masks or `continue_final_message`.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any


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
           special_tokens: Mapping[str, str | None] | None = None, **variables: Any) -> str:
    """Renders a conversation with a chat template.

    Args:
        template: The Jinja source.
        messages: `{"role": ..., "content": ...}` dicts.
        add_generation_prompt: End with the start of an assistant turn.
        special_tokens: `bos_token`, `eos_token`, ... as the template sees them.
        **variables: Further template variables.

    Returns:
        The prompt text.

    Raises:
        ChatTemplateError: If the template does not compile or refuses the conversation.
        TypeError: If a message is not a mapping.
    """
    import jinja2

    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
    compiled = _compile(template)
    try:
        return compiled.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               **{k: v for k, v in (special_tokens or {}).items() if v is not None}, **variables)
    except jinja2.exceptions.TemplateError as error:
        raise ChatTemplateError(f"the chat template refused the conversation: {error}") from error
