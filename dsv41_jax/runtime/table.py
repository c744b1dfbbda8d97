"""The program table: each program compiled ahead of time, once per static arguments and input shapes.

A ``Program`` names a function with its donated and static arguments. A *model* program is
``fn(graphdef, state, ...)``: the table binds the model's graph definition, the caller passes the state first (a
``FlatState``), and the state is left out of the key (it is the same for the table's lifetime), so weights are
inputs, not constants baked into programs. The table compiles through `compiler` (``jit(...).lower(...).compile()``,
or the executable store), every missing shape of a batch at once and in parallel, and times compiling apart from
running.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import compiler


@jax.tree_util.register_pytree_node_class
class FlatState:
    """The model's state (``nnx.split``) as a flat tuple of arrays and the state's tree definition: what the
    programs take. A call flattens its arguments every time, and an ``nnx.State`` flattens in Python one Variable
    at a time; a flat tuple flattens in one step (the decode loop pays it per token)."""

    def __init__(self, leaves: tuple, treedef):
        self.leaves, self.treedef = leaves, treedef

    @classmethod
    def of(cls, state) -> "FlatState":
        leaves, treedef = jax.tree.flatten(state)
        return cls(tuple(leaves), treedef)

    def state(self):
        """The ``nnx.State`` again (inside a program: of tracers)."""
        return jax.tree.unflatten(self.treedef, self.leaves)

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(tuple(leaves), treedef)


def merge(graphdef, state: FlatState) -> nnx.Module:
    """The model of a program's ``graphdef`` and ``FlatState`` argument."""
    return nnx.merge(graphdef, state.state())


def abstract(tree, sharding=None):
    """``tree`` as ``jax.ShapeDtypeStruct`` leaves (placed with ``sharding``): what a program compiles for."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding), tree)


@dataclass(frozen=True)
class Program:
    """A program of a table: ``fn`` jitted with the arguments named in ``static`` static and the positions in
    ``donate`` donated. ``model``: ``fn(graphdef, state, ...)`` runs the model (module docstring). ``name`` is the
    program's key in its table: one name, one program."""

    name: str
    fn: Callable
    donate: tuple[int, ...] = ()
    static: tuple[str, ...] = ()
    model: bool = True


class Call(NamedTuple):
    """One entry to compile: the program, its static arguments, its arguments (abstract or real)."""

    program: Program
    static: dict
    args: tuple


class ProgramTable:
    """The compiled programs of one model, keyed by (program name, static arguments, input shapes); times every
    compile. ``compiled``: key → executable (key[0] is the program's name); ``programs``: name → Program, every
    program the table has seen (`register`)."""

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self.compiled: dict = {}
        self.programs: dict[str, Program] = {}
        self.compile_s = 0.0
        self.loaded = 0  # programs whose executable came from the persistent cache
        self._graph_digest = compiler.graph_digest(graphdef)  # names the model programs in `compiler`'s store

    def register(self, *programs: Program) -> None:
        """Add programs to the table (again: nothing). ValueError for a name another program holds: keys start with
        the name, so two programs of one name would share executables."""
        for program in programs:
            held = self.programs.setdefault(program.name, program)
            if held != program:
                raise ValueError(f"the program table already holds a program named {program.name!r} ({held.fn})")

    @staticmethod
    def key(call: Call) -> tuple:
        args = call.args[1:] if call.program.model else call.args
        leaves, treedef = jax.tree.flatten(abstract(args))
        return (call.program.name, tuple(sorted(call.static.items())), treedef,
                tuple((x.shape, str(x.dtype)) for x in leaves))

    def _compile(self, call: Call):
        program = call.program
        fn = functools.partial(program.fn, self.graphdef) if program.model else program.fn
        jitted = jax.jit(fn, static_argnames=program.static, donate_argnums=program.donate)
        return compiler.compile(jitted, call.args, call.static, identity=self._identity(program))  # (exe, loaded)

    def _identity(self, program: Program) -> str:
        """What names ``program`` across processes beyond its arguments (`compiler.compile`'s store key)."""
        return (f"{program.fn.__module__}.{program.fn.__qualname__} donate={program.donate} "
                f"graph={self._graph_digest if program.model else None}")

    def ensure(self, calls: Sequence[Call]) -> None:
        """Compile every call not compiled yet, in parallel threads."""
        todo = {}
        for call in calls:
            self.register(call.program)
            key = self.key(call)
            if key not in self.compiled:
                todo.setdefault(key, call)
        if not todo:
            return
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(todo)) as pool:
            futures = {key: pool.submit(self._compile, call) for key, call in todo.items()}
            for key, fut in futures.items():
                self.compiled[key], loaded = fut.result()
                self.loaded += loaded
        self.compile_s += time.perf_counter() - start

    def get(self, program: Program, static: dict, args: tuple, sharding=None):
        """The executable for these arguments (placed with ``sharding``), compiled first if their shapes are new."""
        self.register(program)
        head, rest = (args[:1], args[1:]) if program.model else ((), args)
        call = Call(program, static, (*head, *abstract(rest, sharding)))
        key = self.key(call)
        if key not in self.compiled:
            self.ensure([call])
        return self.compiled[key]

    def run(self, program: Program, static: dict, args: tuple, sharding=None):
        """Call the program on these arguments, compiling it first if their shapes are new."""
        return self.get(program, static, args, sharding)(*args)
