"""``python -m dsv41_jax.serve``: an OpenAI-compatible HTTP server over the engine with continuous batching.

`slots` is the device side (a cache of decode slots requests enter and leave), `app` the HTTP side (FastAPI),
`__main__` the command line."""
