"""Training the embedded model (``python -m dsv41_jax.train``, docs/TRAINING.md): `data` (the texts, the
held-out split, the tokenizer), `quantize` (the weights as stored, straight-through), `objectives` (the trainable
model and its losses), `loop` (the two phases), `export` (the release-format checkpoint), `plot` (the loss
curve). Needs the ``train`` extra (optax; matplotlib for the plot)."""
