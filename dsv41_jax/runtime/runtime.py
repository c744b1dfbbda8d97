"""`Runtime`: one model's state, program table and placement, and the calls every driver makes on them (the
package docstring lists the API)."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..config import ModelConfig
from ..engram import Hasher, empty_history
from ..model.cache import init_cache as default_init_cache
from ..model.engram import EngramInput
from ..sampling import SamplingParams, sampling_arrays
from ..vision.batch import build_batch, image_row_index
from .model import ModelLike
from .programs import ENCODE, INIT, STEP, STEPS, StepOut, stop_ids
from .table import Call, FlatState, Program, ProgramTable, abstract


class EngineInputError(ValueError):
    """A request the engine cannot run (empty prompt, too long, ids outside the vocabulary, ...)."""


class Runtime:
    """One model on its devices: its state (``FlatState``, every model program's first argument), its program
    table, the placement of every input but the weights (replicated over the mesh, or the default device), and
    what the step programs take besides (stop constants, engram rows, image rows).

    ``model``: a `ModelLike`; ``cfg``: its (real) config. ``init_cache(cfg, batch, positions, dtype)``: the empty
    cache (default `model.cache.init_cache`), in ``cache_dtype``. ``mesh``: the sharded model's mesh, or None.
    ``hasher``: the engram hasher when the model runs engram layers (default ``engram.Hasher(cfg)``);
    ``host_tables``: `engram.HostTables` for a model built with ``ModelOptions(engram_tables="host")``.
    Cache capacities (``positions``) and end ids are the caller's: they are arguments, not state.
    """

    def __init__(self, model: ModelLike, cfg: ModelConfig, *, cache_dtype: str = "bfloat16",
                 init_cache: Callable | None = None, mesh=None, hasher=None, host_tables=None):
        self.cfg = cfg
        self.vocab_size = int(model.vocab_size)
        self.cache_dtype = cache_dtype
        self.init_fn = default_init_cache if init_cache is None else init_cache
        self.mesh = mesh
        self.replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.hasher = None
        if model.engram_layers:
            self.hasher = hasher or Hasher(cfg)
        self.host_tables = host_tables  # engram tables on the host: each call's rows gathered and sent with it
        self.has_vision = bool(model.has_vision)
        self.has_dspark = bool(model.has_dspark)
        graphdef, state = nnx.split(model)
        self.graphdef = graphdef
        self.state = FlatState.of(state)
        self.table = ProgramTable(graphdef)
        self.table.register(INIT, STEP, STEPS, ENCODE)
        self._cache_specs: dict = {}  # (batch, positions) -> the abstract cache
        self._sampling_specs: dict = {}  # batch -> abstract SamplingArrays

    # ------------------------------------------------------------------------------------------ programs
    def register(self, *programs: Program) -> None:
        """Add a driver's own programs to the table (`ProgramTable.register`: one name, one program)."""
        self.table.register(*programs)

    def compile(self, calls: Sequence[Call]) -> float:
        """Compile (or load from the executable store) every call not compiled yet, in parallel; returns the
        seconds it took."""
        before = self.table.compile_s
        self.table.ensure(calls)
        return self.table.compile_s - before

    def program(self, program: Program, static: dict, args: tuple):
        """The executable of ``program`` for these arguments (inputs replicated), compiled first if their shapes
        are new: look it up once, call it many times."""
        return self.table.get(program, static, args, self.replicated)

    def run(self, program: Program, static: dict, args: tuple):
        """Call ``program`` on these arguments, compiling it first if their shapes are new."""
        return self.program(program, static, args)(*args)

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling or loading programs so far."""
        return self.table.compile_s

    @property
    def compile_count(self) -> int:
        """Programs compiled so far (one per program, static arguments and input shapes)."""
        return len(self.table.compiled)

    @property
    def programs_loaded(self) -> int:
        """Of ``compile_count``, the programs loaded whole from the persistent cache (no trace, no compile)."""
        return self.table.loaded

    # ------------------------------------------------------------------------------------------ placement
    def place(self, tree):
        """``tree``'s arrays on the devices, replicated over the mesh (every input but the weights is)."""
        return jax.device_put(tree, self.replicated)

    def spec(self, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
        """An abstract replicated input of ``shape`` and ``dtype`` (for a ``Call``)."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    def abstract(self, tree):
        """``tree`` as abstract replicated inputs (for a ``Call``)."""
        return abstract(tree, self.replicated)

    @staticmethod
    def fetch(tokens: jax.Array) -> jax.Array:
        """Start copying ``tokens`` to the host (the copy starts when they are ready); returns them."""
        tokens.copy_to_host_async()
        return tokens

    @staticmethod
    def read(tokens: jax.Array) -> np.ndarray:
        """``tokens`` on the host (waits for the program that makes them)."""
        return np.asarray(tokens)

    # ------------------------------------------------------------------------------------------ caches
    def empty_cache(self, batch: int, positions: int):
        """The empty cache of ``batch`` sequences of ``positions`` positions each (traceable: inside a program)."""
        return self.init_fn(self.cfg, batch, positions, self.cache_dtype)

    def init_call(self, batch: int, positions: int) -> Call:
        """The ``init[batch]`` program to compile."""
        return Call(INIT, self._init_static(batch, positions), ())

    def init_cache(self, batch: int, positions: int):
        """An empty cache made by the ``init`` program: every leaf its own buffer (donation needs that)."""
        return self.table.run(INIT, self._init_static(batch, positions), ())

    def _init_static(self, batch: int, positions: int) -> dict:
        return {"init": self.init_fn, "cfg": self.cfg, "batch": batch, "max_context": positions,
                "dtype": self.cache_dtype, "sharding": self.replicated}

    def _cache_spec(self, batch: int, positions: int):
        key = (batch, positions)
        if key not in self._cache_specs:
            self._cache_specs[key] = self.abstract(jax.eval_shape(lambda: self.empty_cache(batch, positions)))
        return self._cache_specs[key]

    # ------------------------------------------------------------------------------------------ step calls
    def step_call(self, batch: int, rows: int, positions: int, eos_count: int, *, record: bool = False,
                  greedy: bool = False, slot_steps: bool = False) -> Call:
        """The ``step[batch, rows]`` program to compile, as it will be called: a cache of ``positions``,
        ``eos_count`` end ids, text rows (a batch with images compiles its steps on first use, their shapes known
        after encoding). ``record``: the head over every row of sequence 0; ``greedy``: no sampling arrays (the
        argmax-only step); ``slot_steps``: the step index is [batch], one count per sequence (`serve.slots`)."""
        args = self._step_spec(batch, rows, positions, eos_count, greedy, slot_steps)
        return Call(STEP, {"keep_first_row": record}, (*args, self.engram_spec(batch, rows)))

    def steps_call(self, batch: int, k: int, positions: int, eos_count: int, *, greedy: bool = False) -> Call:
        """The ``steps`` program (``k`` decode steps in one call) to compile, for a model without engram layers."""
        return Call(STEPS, {"keep_first_row": False, "k": k},
                    (*self._step_spec(batch, 1, positions, eos_count, greedy, False), None))

    def _step_spec(self, batch, rows, positions, eos_count, greedy, slot_steps) -> tuple:
        """The step's abstract arguments up to ``images`` (text: None)."""
        i32 = jnp.int32
        vec = self.spec((batch,), i32)
        if greedy:
            sampling = None
        elif batch in self._sampling_specs:
            sampling = self._sampling_specs[batch]
        else:
            sampling = self._sampling_specs[batch] = self.abstract(sampling_arrays([SamplingParams()] * batch))
        return (self.state, self._cache_spec(batch, positions), self.spec((batch, rows), i32), vec,
                self.spec((batch, self.vocab_size), jnp.float32), self.spec((batch,), jnp.bool_),
                self.spec((batch,) if slot_steps else (), i32), self.spec((eos_count,), i32), vec, sampling, None)

    # ------------------------------------------------------------------------------------------ inputs
    def stop_inputs(self, eos_ids: Sequence[int], max_new: Sequence[int],
                    sampling: Sequence[SamplingParams] | None = None) -> tuple:
        """(end ids [E], max new tokens [B], SamplingArrays | None) placed on the devices: the step's per-request
        constants. ``sampling``: each sequence's settings, or None when every one is greedy (the step is then the
        argmax-only program: the sampling path sorts the vocabulary every step, `sampling.sample`)."""
        arrays = None if sampling is None else sampling_arrays(list(sampling))
        return self.place((stop_ids(eos_ids), np.array(max_new, np.int32), arrays))

    def empty_history(self, batch: int):
        """The engram hash history of ``batch`` fresh sequences (numpy [B, 3]), or None without engram layers."""
        if self.hasher is None:
            return None
        return empty_history(self.cfg, batch)

    def engram_rows(self, ids: np.ndarray, lengths: np.ndarray, history, images=None):
        """(the call's `EngramInput` | None, the history after it): the rows of host ``ids`` [B, T] hashed on the
        host after ``history`` (`engram.Hasher`). ``images``: the call's slice of the image positions
        (`segment_images`) or None; image-span positions are DEAD in the hash history and gated to 0
        (VISION.md §V.E.4). With host tables the rows are gathered here, while the device step dispatched before
        this call still runs (`engram.HostTables`)."""
        if self.hasher is None:
            return None, history
        is_image = None if images is None else np.asarray(images[2]) >= 0
        rows, history = self.hasher.rows(ids, history, is_image=is_image, lengths=lengths)
        text = np.ones(ids.shape, bool) if is_image is None else ~is_image
        gathered = None if self.host_tables is None else self.host_tables.gather(rows)
        return EngramInput(rows=rows.astype(np.int32), text=text, gathered=gathered), history

    def engram_spec(self, batch: int, rows: int):
        """The abstract `EngramInput` of a ``[batch, rows]`` call, or None without engram layers."""
        if self.hasher is None:
            return None
        lay = self.hasher.layout
        shape = (batch, rows, len(lay.layer_ids), lay.columns)
        gathered = None if self.host_tables is None else self.spec((*shape, self.host_tables.row_bytes), jnp.uint8)
        return EngramInput(rows=self.spec(shape, jnp.int32), text=self.spec((batch, rows), jnp.bool_),
                           gathered=gathered)

    def encode_images(self, prompts: Sequence, rows: int):
        """Encode every image of a batch in one tower call (VISION.md §V.G). ``prompts`` [B]: each sequence's
        `vision.preprocess.ImagePrompt` or None; ``rows``: the longest prompt. -> None (no images) or (table
        [R, D] on the devices, row [B, rows] i32, roles [B, rows] i32 on the host): what `segment_images` slices
        for each step call."""
        if all(p is None or not p.images for p in prompts):
            return None
        vc = self.cfg.vision
        if vc is None or not self.has_vision:
            raise EngineInputError("this model has no vision tower: image prompts need a checkpoint with a "
                                   "vision_config, loaded with its image path")
        row = np.full((len(prompts), rows), -1, np.int32)
        roles = np.full((len(prompts), rows), -1, np.int32)
        batch = build_batch([im for p in prompts if p is not None for im in p.images], vc)
        m = batch.gather.shape[1]
        first = 0
        for b, p in enumerate(prompts):
            if p is None:
                continue
            n = len(p.images)
            row[b, : len(p.ids)] = image_row_index(p.roles, [(first + k) * m for k in range(n)], p.starts)
            roles[b, : len(p.ids)] = p.roles
            first += n
        encoded = self.run(ENCODE, {}, (self.state, batch))
        return encoded.reshape(-1, encoded.shape[-1]), row, roles

    def step_args(self, cache, last_logits, ids, lengths, running, step, stop: tuple, history=None,
                  images=None) -> tuple[tuple, object]:
        """(the arguments of one step call, the engram history after it). ``ids``/``lengths``/``running``/
        ``step``: host arrays (prefill, engram decode) or the previous step's device outputs (chained decode);
        ``stop``: `stop_inputs`; ``images``: `segment_images` of the call, or None. Engram rows are hashed here
        from host ids (`engram_rows`)."""
        engram, history = self.engram_rows(ids, lengths, history, images)
        return (self.state, cache, ids, lengths, last_logits, running, step, *stop, images, engram), history

    # ------------------------------------------------------------------------------------------ running
    def step_program(self, args: tuple, *, record: bool = False, chunk: int = 1):
        """The compiled step for these arguments (`step_args`), or with ``chunk`` > 1 the decode chunk of that many
        steps (returns a ``Chunk``), compiled first if new: a decode loop looks it up once and calls it per step."""
        if chunk == 1:
            return self.program(STEP, {"keep_first_row": record}, args)
        return self.program(STEPS, {"keep_first_row": record, "k": chunk}, args)

    def run_step(self, args: tuple, *, record: bool = False) -> StepOut:
        """One step call on these arguments (`step_args`)."""
        return self.step_program(args, record=record)(*args)

    def prefill(self, cache, last_logits, ids: np.ndarray, lengths: np.ndarray, stop: tuple, history=None,
                images=None, *, record: bool = False) -> tuple[StepOut, object]:
        """One prefill segment as one step call -> (its ``StepOut``, the engram history after it).

        ``ids`` [B, T] (rows ``t >= lengths[b]`` are padding), every sequence running, step index 0; the next
        segment goes on from ``out.cache`` and ``out.last_logits``, and the last one's ``out.tokens`` are the first
        new tokens. ``record``: ``out.first`` holds sequence 0's logits of every row."""
        args, history = self.step_args(cache, last_logits, ids, lengths, np.ones(ids.shape[0], bool), np.int32(0),
                                       stop, history, images)
        return self.run_step(args, record=record), history
