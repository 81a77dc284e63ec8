"""Users' own training code from keras.io, at tiny sizes, on stand-in data of the same shapes.

Each is the keras-io example's code as written there (only sizes shrunk, the data replaced
by random arrays of the example's shapes, TensorFlow calls spelled with `keras.ops` so the
JAX pass runs them too):

* `train_step`: the guide "Customizing what happens in `fit()`": a `keras.Model` whose
  `train_step` computes `self.compute_loss(...)`, takes `tape.gradient` and calls
  `self.optimizer.apply` (it never scales the loss), compiled with SGD (TensorFlow only:
  the guide's `tf.GradientTape`).
* `gan`: the same guide's GAN (and the DCGAN example): `compile(d_optimizer, g_optimizer,
  loss_fn)` calling `super().compile()` with no arguments, two Adams applied in
  `train_step` (TensorFlow only).
* `vae`: the variational autoencoder: an encoder with a `Sampling` layer, a decoder, and a
  `train_step` adding the example's own reconstruction and KL losses (TensorFlow only).
* `translation`: the English-to-Spanish Transformer: `PositionalEmbedding` with a position
  `arange` and a padding mask, a `TransformerEncoder`, a `TransformerDecoder` with a causal
  mask, compiled with `"rmsprop"`; sequences of unknown length (`Input((None,))`) (the
  example's Keras 3 version, in `keras.ops`).
* `timeseries`: the timeseries classification Transformer (Conv1D feed-forward,
  MultiHeadAttention, `GlobalAveragePooling1D`), Adam.

`run(name, policy, optimizers=None)` builds the float32 model, converts it to `policy`
(`"float32"`: no conversion), compiles and fits as the example does, and returns the
per-epoch losses (a dict of lists). The JAX guide's stateless loop is in `jax_loop`.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops

import keras_mp as kmp

__all__ = ["NAMES", "TF_ONLY", "run", "jax_loop"]

NAMES = ("train_step", "gan", "vae", "translation", "timeseries")
TF_ONLY = ("train_step", "gan", "vae")  # their train_step uses tf.GradientTape


def _tf():
    import tensorflow as tf

    return tf


# -- "Customizing what happens in fit()": the first example ---------------------------------


class CustomModel(keras.Model):
    def train_step(self, data):
        tf = _tf()
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)  # Forward pass
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _train_step(rng, policy, optimizers):
    inputs = keras.Input(shape=(32,))
    hidden = layers.Dense(32, activation="relu")(inputs)
    outputs = layers.Dense(1)(hidden)
    model = CustomModel(inputs, outputs)
    model = _convert(model, policy)
    model.compile(optimizer=optimizers or keras.optimizers.SGD(0.05), loss="mse",
                  metrics=["mae"])
    x = rng.random((256, 32)).astype("float32")
    y = rng.random((256, 1)).astype("float32")
    history = model.fit(x, y, epochs=4, batch_size=32, verbose=0)
    return model, history.history


# -- the GAN of the same guide (and the DCGAN example) --------------------------------------

_LATENT = 16


def _discriminator():
    return keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.GlobalMaxPooling2D(),
        layers.Dense(1),
    ], name="discriminator")


def _generator():
    return keras.Sequential([
        keras.Input(shape=(_LATENT,)),
        layers.Dense(7 * 7 * 16),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Reshape((7, 7, 16)),
        layers.Conv2DTranspose(16, (4, 4), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2DTranspose(16, (4, 4), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.Conv2D(1, (7, 7), padding="same", activation="sigmoid"),
    ], name="generator")


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        tf = _tf()
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(),
                "g_loss": self.g_loss_tracker.result()}


def _gan(rng, policy, optimizers):
    gan = GAN(discriminator=_discriminator(), generator=_generator(), latent_dim=_LATENT)
    gan = _convert(gan, policy)
    d_opt, g_opt = optimizers or (keras.optimizers.Adam(learning_rate=0.0003),
                                  keras.optimizers.Adam(learning_rate=0.0003))
    gan.compile(d_optimizer=d_opt, g_optimizer=g_opt,
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    digits = rng.random((128, 28, 28, 1)).astype("float32")
    history = gan.fit(digits, epochs=3, batch_size=32, verbose=0)
    return gan, history.history


# -- the variational autoencoder ------------------------------------------------------------


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def _vae_parts(latent_dim=2):
    encoder_inputs = keras.Input(shape=(28, 28, 1))
    x = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(7 * 7 * 16, activation="relu")(latent_inputs)
    x = layers.Reshape((7, 7, 16))(x)
    x = layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    return encoder, decoder


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                self.kl_loss_tracker]

    def train_step(self, data):
        tf = _tf()
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}

    def call(self, x):
        z_mean, z_log_var, z = self.encoder(x)
        return self.decoder(z)


def _vae(rng, policy, optimizers):
    digits = (rng.random((128, 28, 28, 1)) < 0.2).astype("float32")
    # The container has no input specs: the conversion's run check takes a batch (as its
    # plan's note says), and pins `Sampling` (float32 noise times float16 in raw ops).
    vae = _convert(VAE(*_vae_parts()), policy, calibrate=digits[:32])
    vae.compile(optimizer=optimizers or keras.optimizers.Adam())
    history = vae.fit(digits, epochs=3, batch_size=32, verbose=0)
    return vae, history.history


# -- English-to-Spanish translation with a Transformer --------------------------------------

_VOCAB, _SEQ = 40, 10


class TransformerEncoder(layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim = embed_dim
        self.dense_dim = dense_dim
        self.num_heads = num_heads
        self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        if mask is not None:
            padding_mask = ops.cast(mask[:, None, :], dtype="int32")
        else:
            padding_mask = None
        attention_output = self.attention(
            query=inputs, value=inputs, key=inputs, attention_mask=padding_mask)
        proj_input = self.layernorm_1(inputs + attention_output)
        proj_output = self.dense_proj(proj_input)
        return self.layernorm_2(proj_input + proj_output)

    def get_config(self):
        config = super().get_config()
        config.update({"embed_dim": self.embed_dim, "dense_dim": self.dense_dim,
                       "num_heads": self.num_heads})
        return config


class PositionalEmbedding(layers.Layer):
    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.position_embeddings = layers.Embedding(
            input_dim=sequence_length, output_dim=embed_dim)
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.embed_dim = embed_dim

    def call(self, inputs):
        length = ops.shape(inputs)[-1]
        positions = ops.arange(0, length, 1)
        embedded_tokens = self.token_embeddings(inputs)
        embedded_positions = self.position_embeddings(positions)
        return embedded_tokens + embedded_positions

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)

    def get_config(self):
        config = super().get_config()
        config.update({"sequence_length": self.sequence_length,
                       "vocab_size": self.vocab_size, "embed_dim": self.embed_dim})
        return config


class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim = embed_dim
        self.latent_dim = latent_dim
        self.num_heads = num_heads
        self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.dense_proj = keras.Sequential(
            [layers.Dense(latent_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        inputs, encoder_outputs = inputs
        causal_mask = self.get_causal_attention_mask(inputs)
        if mask is None:
            inputs_padding_mask, encoder_outputs_padding_mask = None, None
        else:
            inputs_padding_mask, encoder_outputs_padding_mask = mask
        attention_output_1 = self.attention_1(
            query=inputs, value=inputs, key=inputs, attention_mask=causal_mask,
            query_mask=inputs_padding_mask)
        out_1 = self.layernorm_1(inputs + attention_output_1)
        attention_output_2 = self.attention_2(
            query=out_1, value=encoder_outputs, key=encoder_outputs,
            query_mask=inputs_padding_mask, key_mask=encoder_outputs_padding_mask)
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        proj_output = self.dense_proj(out_2)
        return self.layernorm_3(out_2 + proj_output)

    def get_causal_attention_mask(self, inputs):
        input_shape = ops.shape(inputs)
        batch_size, sequence_length = input_shape[0], input_shape[1]
        i = ops.arange(sequence_length)[:, None]
        j = ops.arange(sequence_length)
        mask = ops.cast(i >= j, dtype="int32")
        mask = ops.reshape(mask, (1, input_shape[1], input_shape[1]))
        # The example tiles by a concatenated tensor, which Keras 3.15's symbolic tile
        # cannot iterate; the same tile spelt as a tuple:
        return ops.tile(mask, (batch_size, 1, 1))

    def get_config(self):
        config = super().get_config()
        config.update({"embed_dim": self.embed_dim, "latent_dim": self.latent_dim,
                       "num_heads": self.num_heads})
        return config


def _translation_model(embed_dim=16, latent_dim=32, num_heads=2):
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(_SEQ, _VOCAB, embed_dim)(encoder_inputs)
    encoder_outputs = TransformerEncoder(embed_dim, latent_dim, num_heads)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    x = PositionalEmbedding(_SEQ, _VOCAB, embed_dim)(decoder_inputs)
    x = TransformerDecoder(embed_dim, latent_dim, num_heads)([x, encoder_outputs])
    x = layers.Dropout(0.5)(x)
    decoder_outputs = layers.Dense(_VOCAB, activation="softmax")(x)
    return keras.Model([encoder_inputs, decoder_inputs], decoder_outputs, name="transformer")


def _pairs(rng, n=96):
    """Token sequences padded with 0 after a random length, as the vectorizers emit."""
    def padded():
        tokens = rng.integers(2, _VOCAB, size=(n, _SEQ + 1))
        lengths = rng.integers(4, _SEQ + 2, size=(n, 1))
        return np.where(np.arange(_SEQ + 1) < lengths, tokens, 0).astype("int64")

    eng, spa = padded()[:, :-1], padded()
    return {"encoder_inputs": eng, "decoder_inputs": spa[:, :-1]}, spa[:, 1:]


def _translation(rng, policy, optimizers):
    transformer = _convert(_translation_model(), policy)
    transformer.compile(optimizers or "rmsprop", loss="sparse_categorical_crossentropy",
                        metrics=["accuracy"])
    x, y = _pairs(rng)
    if keras.backend.backend() == "tensorflow":  # as the example: batches of unknown length
        data = _tf().data.Dataset.from_tensor_slices((x, y)).batch(32)
        history = transformer.fit(data, epochs=3, verbose=0)
    else:
        history = transformer.fit(x, y, epochs=3, batch_size=32, verbose=0, shuffle=False)
    return transformer, history.history


# -- timeseries classification with a Transformer -------------------------------------------


def transformer_encoder(inputs, head_size, num_heads, ff_dim, dropout=0):
    x = layers.MultiHeadAttention(key_dim=head_size, num_heads=num_heads, dropout=dropout)(
        inputs, inputs)
    x = layers.Dropout(dropout)(x)
    x = layers.LayerNormalization(epsilon=1e-6)(x)
    res = x + inputs
    x = layers.Conv1D(filters=ff_dim, kernel_size=1, activation="relu")(res)
    x = layers.Dropout(dropout)(x)
    x = layers.Conv1D(filters=inputs.shape[-1], kernel_size=1)(x)
    x = layers.LayerNormalization(epsilon=1e-6)(x)
    return x + res


def _timeseries_model(input_shape, head_size, num_heads, ff_dim, num_transformer_blocks,
                      mlp_units, n_classes=2, dropout=0, mlp_dropout=0):
    inputs = keras.Input(shape=input_shape)
    x = inputs
    for _ in range(num_transformer_blocks):
        x = transformer_encoder(x, head_size, num_heads, ff_dim, dropout)
    x = layers.GlobalAveragePooling1D(data_format="channels_last")(x)
    for dim in mlp_units:
        x = layers.Dense(dim, activation="relu")(x)
        x = layers.Dropout(mlp_dropout)(x)
    outputs = layers.Dense(n_classes, activation="softmax")(x)
    return keras.Model(inputs, outputs)


def _timeseries(rng, policy, optimizers):
    model = _timeseries_model((32, 1), head_size=16, num_heads=2, ff_dim=4,
                              num_transformer_blocks=2, mlp_units=[16])
    model = _convert(model, policy)
    model.compile(loss="sparse_categorical_crossentropy",
                  optimizer=optimizers or keras.optimizers.Adam(learning_rate=1e-3),
                  metrics=["sparse_categorical_accuracy"])
    y = rng.integers(0, 2, size=(128,))
    t = np.linspace(0, 4 * np.pi, 32)
    x = np.sin(t[None, :] * (1 + y[:, None])) + 0.3 * rng.normal(size=(128, 32))
    history = model.fit(x[..., None].astype("float32"), y, epochs=3, batch_size=32, verbose=0)
    return model, history.history


# -- running them ---------------------------------------------------------------------------

_RUNNERS = {"train_step": _train_step, "gan": _gan, "vae": _vae,
            "translation": _translation, "timeseries": _timeseries}


def _convert(model, policy, **kwargs):
    return model if policy == "float32" else kmp.convert(model, policy, **kwargs)


def run(name: str, policy: str, optimizers=None, seed: int = 0):
    """Builds example `name` in float32, converts it to `policy`, compiles and fits it.

    Args:
        name: one of `NAMES`.
        policy: `"float32"` (no conversion) or a policy name for `kmp.convert`.
        optimizers: what the example passes to `compile` instead of its own (the GAN: a
            pair); `None`: the example's.
        seed: the random seed of the weights and the data.

    Returns:
        `(model, history)`: the trained model and its `History.history` dict.
    """
    keras.utils.set_random_seed(seed)
    return _RUNNERS[name](np.random.default_rng(seed), policy, optimizers)


# -- "Writing a training loop from scratch in JAX" ------------------------------------------


def jax_loop(policy: str, optimizer=None, seed: int = 0, steps: int = 24) -> list:
    """The JAX guide's loop: `stateless_call`, `jax.value_and_grad`, `stateless_apply`.

    Returns:
        The loss of each step (floats).
    """
    import jax

    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    inputs = keras.Input(shape=(64,), name="digits")
    x1 = keras.layers.Dense(32, activation="relu")(inputs)
    x2 = keras.layers.Dense(32, activation="relu")(x1)
    outputs = keras.layers.Dense(10, name="predictions")(x2)
    model = _convert(keras.Model(inputs=inputs, outputs=outputs), policy)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = optimizer or keras.optimizers.Adam(learning_rate=1e-3)
    optimizer.build(model.trainable_variables)

    def compute_loss_and_updates(trainable_variables, non_trainable_variables, x, y):
        y_pred, non_trainable_variables = model.stateless_call(
            trainable_variables, non_trainable_variables, x)
        loss = loss_fn(y, y_pred)
        return loss, non_trainable_variables

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, data):
        trainable_variables, non_trainable_variables, optimizer_variables = state
        x, y = data
        (loss, non_trainable_variables), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y)
        trainable_variables, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        return loss, (trainable_variables, non_trainable_variables, optimizer_variables)

    centers = rng.normal(size=(10, 64))
    labels = rng.integers(0, 10, size=(steps * 32,))
    images = (centers[labels] + rng.normal(size=(steps * 32, 64))).astype("float32")
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])
    losses = []
    for step in range(steps):
        batch = slice(step * 32, (step + 1) * 32)
        loss, state = train_step(state, (images[batch], labels[batch]))
        losses.append(float(loss))
    return losses
