"""Keras training for language models: the token losses, perplexity, and the `fit` glue.

Labels follow transformers, and -100 marks positions left out of the loss. Causal LMs: `labels[b, t]`
is the token at position t, the model shifts them inside (position t predicts t + 1).
Encoder-decoder LMs: `labels[b, t]` is the token decoder position t predicts (no shift); the decoder's
inputs are the labels shifted right.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

IGNORE_INDEX = -100


def token_loss(logits, labels):
    """Summed cross-entropy of the predictions at each position and the number of tokens it covers.

    Args:
        logits: float `[B, T, V]`.
        labels: int `[B, T]`, the token expected at each position; -100 where no loss is wanted.

    Returns:
        `(loss_sum, count)` float32 scalars.
    """
    logits = ops.cast(logits, "float32")
    labels = ops.cast(labels, "int32")
    valid = ops.not_equal(labels, IGNORE_INDEX)
    losses = keras.losses.sparse_categorical_crossentropy(ops.where(valid, labels, 0), logits, from_logits=True)
    weights = ops.cast(valid, "float32")
    return ops.sum(losses * weights), ops.sum(weights)


def shifted_token_loss(logits, labels):
    """`token_loss` of next-token predictions: position t is scored on `labels[:, t + 1]`."""
    return token_loss(logits[:, :-1], labels[:, 1:])


class Perplexity(keras.metrics.Metric):
    """exp(mean token loss) over everything seen since the last reset."""

    def __init__(self, name: str = "perplexity", **kwargs):
        super().__init__(name=name, **kwargs)
        self.loss_sum = self.add_variable(shape=(), initializer="zeros", name="loss_sum")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, loss_sum, count):
        self.loss_sum.assign_add(ops.cast(loss_sum, "float32"))
        self.count.assign_add(ops.cast(count, "float32"))

    def result(self):
        return ops.exp(self.loss_sum / ops.maximum(self.count, 1.0))


def unpack_inputs(input_ids, attention_mask):
    """Accepts `model(ids, attention_mask=...)` and Keras' `model({"input_ids": ..., ...})`."""
    if isinstance(input_ids, dict):
        return input_ids["input_ids"], input_ids.get("attention_mask", attention_mask)
    return input_ids, attention_mask


def given_labels(x, y):
    """The labels of a Keras batch: `y`, else `x["labels"]`, else None."""
    return y if y is not None else (x.get("labels") if isinstance(x, dict) else None)


class LMTraining:
    """Mixin for LM Keras models: `compile(optimizer, jit_compile=True)` then `fit`; a subclass says
    what the labels are (`loss_terms`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.perplexity_tracker = Perplexity()
        self._replica_gradients = None

    def compile(self, *args, **kwargs):
        """Keras' compile. With `jit_compile=True` under a multi-replica `tf.distribute` strategy,
        each replica's forward and backward pass is compiled with XLA and the optimizer update runs
        outside it: Keras' own whole-step XLA compile fails there (a replica's XLA program is handed
        the variables of another device)."""
        super().compile(*args, **kwargs)
        self._replica_gradients = None
        if self.jit_compile and self.distribute_strategy.num_replicas_in_sync > 1:
            self.jit_compile = False
            self._replica_gradients = tf.function(self._loss_and_gradients, jit_compile=True)

    def _loss_and_gradients(self, x, y):
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True), training=True)
        return loss, tape.gradient(loss, self.trainable_variables)

    def train_step(self, data):
        """Keras' train step, or the per-replica XLA step described in `compile`."""
        if self._replica_gradients is None:
            return super().train_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, gradients = self._replica_gradients(x, y)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self._loss_tracker.update_state(loss * self.distribute_strategy.num_replicas_in_sync,
                                        sample_weight=tf.shape(unpack_inputs(x, None)[0])[0])
        return self.compute_metrics(x, y, None, sample_weight=sample_weight)

    def loss_terms(self, x, y, y_pred):
        """`(loss_sum, count)` of a batch, see `token_loss`."""
        raise NotImplementedError

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """Mean token cross-entropy over labelled tokens (transformers' loss)."""
        loss_sum, count = self.loss_terms(x, y, y_pred)
        self.perplexity_tracker.update_state(loss_sum, count)
        loss = loss_sum / ops.maximum(count, 1.0)
        # Keras sums replica gradients, so each replica's loss carries 1 / replicas.
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        return loss / replicas if replicas > 1 else loss

    @property
    def metrics(self):
        return [*super().metrics, self.perplexity_tracker]


class CausalLMTraining(LMTraining):
    """Training of causal LMs.

    Data: `x` is a dict with `input_ids`, optional `attention_mask` and optional `labels`, or `y`
    holds the labels; without labels, the inputs are the labels with padding left out of the loss.
    """

    def labels_for(self, x, y):
        """The labels `[B, T]` for a batch, checked against the inputs' shape."""
        input_ids, attention_mask = unpack_inputs(x, None)
        labels = given_labels(x, y)
        if labels is None:
            labels = input_ids
            if attention_mask is not None:
                labels = ops.where(ops.cast(attention_mask, "bool"), labels, IGNORE_INDEX)
        if tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids "
                             f"{tuple(input_ids.shape)}: give one label per input token (-100 to skip)")
        return labels

    def loss_terms(self, x, y, y_pred):
        """Next-token loss: the model's prediction at t is scored on the label at t + 1."""
        return shifted_token_loss(y_pred.logits, self.labels_for(x, y))


class Seq2SeqLMTraining(LMTraining):
    """Training of encoder-decoder LMs.

    Data: `x` is a dict with `input_ids`, optional `attention_mask`, and `labels` (the model feeds
    them shifted right to its decoder) or `decoder_input_ids` with the labels in `y`.
    """

    def shift_right(self, labels):
        """Decoder inputs for `labels` `[B, T]`: the start token, then the labels but the last, -100 -> pad."""
        start, pad = self.config.decoder_start_token_id, self.config.pad_token_id
        if start is None or pad is None:
            raise ValueError("deriving decoder_input_ids from labels needs decoder_start_token_id and "
                             "pad_token_id in the config")
        labels = ops.cast(labels, "int32")
        shifted = ops.concatenate([ops.full((ops.shape(labels)[0], 1), start, "int32"), labels[:, :-1]], axis=1)
        return ops.where(ops.equal(shifted, -100), pad, shifted)

    def loss_terms(self, x, y, y_pred):
        """Each decoder position is scored on its label (transformers' T5 loss, no shift)."""
        labels = given_labels(x, y)
        if labels is None:
            raise ValueError("the loss needs labels: put them in x['labels'] or give them as y")
        if tuple(labels.shape) != tuple(y_pred.logits.shape[:2]):
            raise ValueError(f"labels shape {tuple(labels.shape)} does not match the decoder's "
                             f"{tuple(y_pred.logits.shape[:2])}: give one label per decoder position (-100 to skip)")
        return token_loss(y_pred.logits, labels)
