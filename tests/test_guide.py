"""The seed guide's example, with only the import line changed, against transformers' reference."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import torch
import transformers


def test_guide_example_matches_transformers(gpt2_checkpoint):
    path_or_id, reference = gpt2_checkpoint

    from xlagen import AutoTokenizer, TFAutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(path_or_id, padding_side="left", pad_token="</s>")
    model = TFAutoModelForCausalLM.from_pretrained(path_or_id)
    xla_generate = tf.function(model.generate, jit_compile=True)
    tokenized_input = tokenizer(["TensorFlow is"], pad_to_multiple_of=8, padding=True, return_tensors="tf")
    generated_tokens = xla_generate(**tokenized_input, num_beams=2)
    text = tokenizer.decode(generated_tokens[0], skip_special_tokens=True)

    # "</s>" is not in the vocabulary: it is added after the last id, outside the model's embedding.
    assert tokenizer.pad_token_id >= model.config.vocab_size
    assert tokenized_input["input_ids"].shape == (1, 8)
    assert generated_tokens.shape == (1, 20)  # max_length=20 counts the padded prompt
    assert text.startswith("TensorFlow is")

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path_or_id, padding_side="left", pad_token="</s>")
    hf_input = hf_tokenizer(["TensorFlow is"], pad_to_multiple_of=8, padding=True, return_tensors="np")
    np.testing.assert_array_equal(hf_input["input_ids"], tokenized_input["input_ids"].numpy())
    # The reference model cannot embed the pad id either; padded positions are masked, so any id works.
    ids = np.where(hf_input["attention_mask"] == 1, hf_input["input_ids"], 0)
    with torch.no_grad():
        theirs = reference.generate(torch.tensor(ids), attention_mask=torch.tensor(hf_input["attention_mask"]),
                                    num_beams=2, max_length=20, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id).numpy()
    ours = generated_tokens.numpy()
    np.testing.assert_array_equal(ours[:, 8:theirs.shape[1]], theirs[:, 8:])
    assert (ours[:, theirs.shape[1]:] == tokenizer.pad_token_id).all()
    assert text == hf_tokenizer.decode(np.concatenate([hf_input["input_ids"][0], theirs[0, 8:]]),
                                       skip_special_tokens=True)
