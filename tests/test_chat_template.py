"""Chat templates rendered as transformers' `apply_chat_template` renders them (a ChatML / Qwen-style template
on a tiny tokenizer), read from tokenizer_config.json or chat_template.jinja."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import build_bpe_tokenizer, require_extra

require_extra("jinja2")  # the `serve` extra
transformers = pytest.importorskip("transformers")

# The shape of Qwen2.5's template: a default system prompt, tojson, loop variables, raise_exception.
CHATML = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant. Tools: ' + {"name": "é"} | tojson + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- elif not (message['role'] == 'system' and loop.first) %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
{{- eos_token if false else '' }}"""

# Llama 3's template: the role header, the content trimmed, <|eot_id|> closing each turn.
LLAMA3 = """{% set loop_messages = messages %}{% for message in loop_messages %}\
{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + \
'<|eot_id|>' %}{% if loop.index0 == 0 %}\
{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}\
{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello world"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"},
     {"role": "assistant", "content": "jumps"}, {"role": "user", "content": "over the lazy dog?"}],
]


@pytest.fixture(scope="module", params=["tokenizer_config", "jinja_file"])
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    build_bpe_tokenizer(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>"]
    if request.param == "tokenizer_config":
        config["chat_template"] = CHATML
    else:
        (folder / "chat_template.jinja").write_text(CHATML)
    config_path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_matches_transformers(folder, conversation, generation_prompt):
    from xlagen import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(folder)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    expected = reference.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False)
    assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=False) == expected
    ids = reference.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.apply_chat_template(conversation, add_generation_prompt=generation_prompt) == list(ids)


def test_errors(folder, tmp_path):
    from xlagen import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(ValueError, match="unknown role robot"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="does not compile"):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template="{% for %}")
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(plain)
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])


def test_sandboxed(folder):
    from xlagen import AutoTokenizer

    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError, match="refused"):
        AutoTokenizer.from_pretrained(folder).apply_chat_template(CONVERSATIONS[0], chat_template=escape)


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@pytest.mark.parametrize("prefill", ["The answer is", "The answer is ", "t"])
def test_continue_final_message_matches_transformers(folder, template, prefill):
    from xlagen import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(folder)
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    conversation = [*CONVERSATIONS[1], {"role": "assistant", "content": prefill}]
    expected = reference.apply_chat_template(conversation, continue_final_message=True, tokenize=False,
                                             chat_template=template)
    text = ours.apply_chat_template(conversation, continue_final_message=True, tokenize=False, chat_template=template)
    assert text == expected
    assert text.endswith(prefill.strip() if template == LLAMA3 else prefill)  # Llama 3 trims the content
    closed = ours.apply_chat_template(conversation, tokenize=False, chat_template=template)
    assert closed.startswith(text) and closed != text  # the same text without the turn's end
    assert ours.apply_chat_template(conversation, continue_final_message=True, chat_template=template) == \
        ours.encode(text, add_special_tokens=False)


def test_continue_final_message_errors(folder):
    from xlagen import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(folder)
    answer = [*CONVERSATIONS[0], {"role": "assistant", "content": "Hi"}]
    with pytest.raises(ValueError, match="not compatible"):
        ours.apply_chat_template(answer, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match="must be an assistant one; got a 'user' message"):
        ours.apply_chat_template(CONVERSATIONS[0], continue_final_message=True)
    with pytest.raises(ValueError, match="got no message"):
        ours.apply_chat_template([], continue_final_message=True)
    hides = "{% for m in messages %}{{ m['role'] }}: ...\n{% endfor %}"
    with pytest.raises(ValueError, match="does not render the last message's text"):
        ours.apply_chat_template(answer, continue_final_message=True, chat_template=hides)
