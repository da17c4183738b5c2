"""Training under XLA: Keras fit / evaluate / predict, a custom jit train step, distribution, saving."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch
import transformers

from conftest import random_ids
from xlagen import AutoTokenizer, TFAutoModelForCausalLM


def _batch(rows=4, length=12, seed=60):
    ids = random_ids((rows, length), 64, seed=seed)
    mask = np.ones_like(ids)
    mask[0, 8:] = 0  # right padding, as used for training
    labels = np.where(mask == 1, ids, -100).astype(np.int32)
    labels[1, 4] = -100
    return ids, mask, labels


def test_loss_equals_transformers(gpt2_checkpoint, gpt2_model):
    _, reference = gpt2_checkpoint
    ids, mask, labels = _batch()
    with torch.no_grad():
        theirs = reference(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                           labels=torch.tensor(labels, dtype=torch.long)).loss.item()
    x = {"input_ids": ids, "attention_mask": mask}
    ours = float(gpt2_model.compute_loss(x=x, y=labels, y_pred=gpt2_model(x)))
    assert abs(ours - theirs) <= 1e-4
    # Without labels, the inputs are the labels with padding ignored.
    with torch.no_grad():
        default = reference(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                            labels=torch.tensor(np.where(mask == 1, ids, -100), dtype=torch.long)).loss.item()
    assert abs(float(gpt2_model.compute_loss(x=x, y_pred=gpt2_model(x))) - default) <= 1e-4


def test_fit_under_jit_compile_decreases_loss(gpt2_checkpoint):
    model = TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0])
    ids, mask, labels = _batch(rows=8)
    data = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=True)
    before = model.evaluate(data, batch_size=4, verbose=0, return_dict=True)
    history = model.fit(data, batch_size=4, epochs=4, verbose=0)
    after = model.evaluate(data, batch_size=4, verbose=0, return_dict=True)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert after["loss"] < before["loss"]
    assert after["perplexity"] == pytest.approx(np.exp(after["loss"]), rel=0.05)
    predicted = model.predict({"input_ids": ids}, batch_size=4, verbose=0)
    assert predicted.logits.shape == (8, 12, model.config.vocab_size)


def test_custom_xla_train_step_with_gradient_tape(gpt2_checkpoint):
    model = TFAutoModelForCausalLM.from_pretrained(gpt2_checkpoint[0])
    optimizer = keras.optimizers.SGD(0.05)
    ids, mask, labels = _batch()
    x = {"input_ids": tf.constant(ids), "attention_mask": tf.constant(mask)}

    @tf.function(jit_compile=True)
    def train_step(x, labels):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=x, y=labels, y_pred=model(x, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    losses = [float(train_step(x, tf.constant(labels))) for _ in range(5)]
    assert losses[-1] < losses[0]


def test_bad_training_input(gpt2_model):
    ids, mask, labels = _batch()
    x = {"input_ids": ids, "attention_mask": mask}
    with pytest.raises(ValueError, match="labels shape"):
        gpt2_model.compute_loss(x=x, y=labels[:, :5], y_pred=gpt2_model(x))
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        gpt2_model(random_ids((1, 65), 64))


def test_save_pretrained_round_trip(tmp_path, gpt2_checkpoint, gpt2_model):
    folder, _ = gpt2_checkpoint
    gpt2_model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path)
    ids = random_ids((2, 9), 64, seed=61)
    ours = gpt2_model(ids).logits.numpy()
    reloaded = TFAutoModelForCausalLM.from_pretrained(tmp_path)
    np.testing.assert_array_equal(reloaded(ids).logits.numpy(), ours)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(theirs - ours).max() <= 1e-5
    text = "TensorFlow is"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"]
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 0


def test_save_refuses_to_overwrite_and_writes_nothing(tmp_path, gpt2_model):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        gpt2_model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    gpt2_model.save_pretrained(tmp_path, overwrite=True)
    assert (tmp_path / "model.safetensors").is_file()


def test_mirrored_strategy_fit_matches_single_device(gpt2_checkpoint, tmp_path):
    # Without dropout, so that both runs see the same computation.
    shutil.copytree(gpt2_checkpoint[0], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                                      "attn_pdrop": 0.0}))
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np, tensorflow as tf, keras
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        from xlagen import TFAutoModelForCausalLM
        ids = np.random.RandomState(0).randint(2, 64, (8, 12)).astype(np.int32)
        data = {{"input_ids": ids}}

        def run(strategy):
            with strategy.scope():
                model = TFAutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
                model.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=True)
            history = model.fit(data, batch_size=8, epochs=3, verbose=0, shuffle=False)
            return history.history["loss"]

        devices = [d.name for d in tf.config.list_logical_devices("CPU")]
        mirrored = tf.distribute.MirroredStrategy(devices)
        print(json.dumps({{"replicas": mirrored.num_replicas_in_sync, "mirrored": run(mirrored),
                          "single": run(tf.distribute.OneDeviceStrategy(devices[0]))}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    losses = json.loads(result.stdout.strip().splitlines()[-1])
    assert losses["replicas"] == 2
    np.testing.assert_allclose(losses["mirrored"], losses["single"], rtol=2e-3)
    assert losses["single"][-1] < losses["single"][0]
