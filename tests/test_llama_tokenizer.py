"""Byte-level BPE tokenizers of the Llama 3 and Qwen2 kind (a regex split before the byte-level mapping,
special tokens such as <|im_end|>, Llama 3's begin-of-text added by the post-processor) built with the
`tokenizers` library: xlagen's AutoTokenizer gives transformers' AutoTokenizer's ids, texts and chat
prompts."""

from __future__ import annotations

import json

import pytest

from conftest import CORPUS, require_extra
from test_chat_template import CHATML, CONVERSATIONS

require_extra("jinja2")  # the `serve` extra, for the chat template
transformers = pytest.importorskip("transformers")

# The split patterns of the two families' tokenizer.json (Qwen2 splits digits one by one, Llama 3 in threes).
SPLITS = {"qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
          "llama3": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""}
SPECIALS = {"qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]}
TEXTS = ["Hello world, hello tokens!", "  The   quick\n\nbrown fox's 12345 jumps.", "Ünïcödé ✓ 東京 🙂",
         "<|im_start|>user\nHi<|im_end|>", "<|begin_of_text|>x<|eot_id|>", "", "tabs\tand\r\nreturns  "]


def build_tokenizer(folder, family: str) -> None:
    """Trains a byte-level BPE with the family's split and special tokens; writes tokenizer.json and
    tokenizer_config.json as the family's checkpoints have them."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    if family == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLITS[family]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS[family], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    if family == "llama3":
        bos = "<|begin_of_text|>"
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|eot_id|>"}
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                  "bos_token": None, "unk_token": None, "chat_template": CHATML}
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 32768}))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family -> (xlagen tokenizer, transformers tokenizer) of one folder, each built once."""
    from xlagen import AutoTokenizer

    built = {}

    def get(family):
        if family not in built:
            folder = tmp_path_factory.mktemp(family)
            build_tokenizer(folder, family)
            built[family] = AutoTokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
        return built[family]

    return get


@pytest.mark.parametrize("family", list(SPLITS))
def test_ids_and_texts_equal_transformers(tokenizers, family):
    ours, theirs = tokenizers(family)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
    if theirs.pad_token is not None:  # Qwen's <|endoftext|>; Llama 3's folder names no pad token
        assert ours(TEXTS[:3], padding=True)["input_ids"] == theirs(TEXTS[:3], padding=True)["input_ids"]
    assert ours.eos_token_id == theirs.eos_token_id and ours.bos_token_id == theirs.bos_token_id


def test_qwen_chat_prompt_equals_transformers(tokenizers):
    ours, theirs = tokenizers("qwen2")
    for conversation in CONVERSATIONS:
        for generation_prompt in (False, True):
            options = dict(add_generation_prompt=generation_prompt)
            text = ours.apply_chat_template(conversation, tokenize=False, **options)
            assert text == theirs.apply_chat_template(conversation, tokenize=False, **options)
            assert ours.apply_chat_template(conversation, **options) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.apply_chat_template(CONVERSATIONS[0]))[-len("<|im_end|>\n"):] == "<|im_end|>\n"
