"""Reference runs of transformers' PyTorch generate and token comparisons."""

from __future__ import annotations

import numpy as np
import torch


def hf_generate(model, ids, mask=None, **options):
    """transformers' generate on numpy inputs; returns numpy tokens (or the output dict)."""
    mask = np.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        out = model.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask), **options)
    return out if options.get("return_dict_in_generate") else out.numpy()


def torch_logits(model, ids, mask) -> np.ndarray:
    """A transformers causal LM's logits on numpy inputs."""
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()


def max_logit_diff(reference, model, ids, mask) -> float:
    """Max |ours - transformers| of a causal LM's logits over the real (unmasked) positions of a batch."""
    ours = model(ids, attention_mask=mask).logits.numpy()
    return float(np.abs(ours - torch_logits(reference, ids, mask))[mask.astype(bool)].max())


def assert_same_tokens(ours, theirs, pad_id: int):
    """Equal on transformers' (possibly shorter) output, and only padding after it."""
    ours = np.asarray(ours)
    length = theirs.shape[1]
    assert ours.shape[0] == theirs.shape[0]
    np.testing.assert_array_equal(ours[:, :length], theirs)
    assert (ours[:, length:] == pad_id).all(), ours[:, length:]


def eos_that_occurs(model, ids, step: int = 3, mask=None, prompt_length: int | None = None) -> int:
    """An id the model generates greedily at `step` for row 0, so using it as EOS ends rows early.

    `prompt_length` is where the new tokens start in the output (default: the input's length; an
    encoder-decoder model's output starts with its 1-token decoder prompt instead)."""
    out = np.asarray(model.generate(ids, attention_mask=mask, max_new_tokens=step + 1, eos_token_id=None))
    return int(out[0, (ids.shape[1] if prompt_length is None else prompt_length) + step])


def left_pad(rows, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads 1-D id rows to one width; returns int32 (ids, attention_mask)."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask
