"""The runtime: one model's compiled programs on its devices, and the calls every driver makes on them. The batch
engine (`dsv41_jax.engine.Engine`), the server's slots (`serve.slots.SlotEngine`), speculation
(`speculative.Speculator`) and the benchmarks stand on this API alone; each registers its own programs in the
runtime's table.

The model is split once (``nnx.split``) into a graph definition and a state; the programs take the state as an
argument (``FlatState``) and merge it inside, so weights are inputs, not constants. Every program is compiled ahead
of time once per static arguments and input shapes, all of a request's at once and in parallel, and kept in the
``ProgramTable``; compile seconds are counted apart from running.

Modules: ``table`` (``Program``, ``Call``, ``ProgramTable``, ``FlatState``, ``merge``), ``programs`` (the device
programs ``STEP``, ``STEPS``, ``INIT``, ``ENCODE``, their outputs ``StepOut`` / ``Chunk``, ``keeps_going``,
``segment_images``), ``model`` (``ModelLike``), ``runtime`` (``Runtime``).

``Runtime(model, cfg, *, cache_dtype, init_cache=None, mesh=None, hasher=None, host_tables=None)``:

* facts: ``cfg``, ``vocab_size``, ``cache_dtype``, ``mesh``, ``replicated`` (the inputs' sharding, None on one
  device), ``hasher`` (engram layers, else None), ``host_tables``, ``has_vision``, ``has_dspark``, ``graphdef``,
  ``state``, ``table``;
* programs: ``register(*programs)``; ``compile(calls) -> seconds``; ``program(p, static, args)`` (the executable,
  compiled or loaded on first use); ``run(p, static, args)``; ``compile_s``, ``compile_count``,
  ``programs_loaded``;
* what to compile: ``init_call(batch, positions)``, ``step_call(batch, rows, positions, eos_count, *, record,
  greedy, slot_steps)``, ``steps_call(batch, k, positions, eos_count, *, greedy)``;
* placement: ``place(tree)`` (replicated), ``spec(shape, dtype)`` / ``abstract(tree)`` (abstract inputs);
* caches: ``init_cache(batch, positions)`` (by the ``init`` program), ``empty_cache(batch, positions)`` (inside a
  program);
* step inputs: ``stop_inputs(eos_ids, max_new, sampling | None)``, ``empty_history(batch)``, ``engram_rows(ids,
  lengths, history, images)``, ``engram_spec(batch, rows)``, ``encode_images(prompts, rows)`` and
  ``segment_images(images, start, size, rows)``, ``step_args(cache, last_logits, ids, lengths, running, step,
  stop, history, images) -> (args, history)``;
* running: ``prefill(cache, last_logits, ids, lengths, stop, history, images, *, record) -> (StepOut, history)``
  (one prefill segment), ``step_program(args, *, record, chunk)`` (the decode step or chunk to call per step, on
  the previous ``StepOut``'s cache, logits, tokens, lengths, flags and step), ``run_step(args, *, record)``;
* reading: ``fetch(tokens)`` (start the host copy), ``read(tokens) -> numpy``.

Cache capacities (``positions``) and end ids are the driver's and passed to each call: engines that share one
runtime (a copy of an `Engine`) may differ in them.
"""

from .model import ModelLike, VocabMaps
from .programs import ENCODE, INIT, STEP, STEPS, Chunk, StepOut, image_rows, keeps_going, segment_images, stop_ids
from .runtime import EngineInputError, Runtime
from .table import Call, FlatState, Program, ProgramTable, abstract, merge

__all__ = ["ENCODE", "INIT", "STEP", "STEPS", "Call", "Chunk", "EngineInputError", "FlatState", "ModelLike",
           "Program", "ProgramTable", "Runtime", "StepOut", "VocabMaps", "abstract", "image_rows", "keeps_going",
           "merge", "segment_images", "stop_ids"]
