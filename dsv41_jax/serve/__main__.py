"""``python -m dsv41_jax.serve``: serve the model over the OpenAI API (chat and completions) with continuous
batching. Model flags are `generate`'s; bad flags are one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Sequence

import uvicorn

from .. import distributed, runspec
from ..assets import EMBEDDED_MODEL
from ..cli import Parser, UsageError, cli_main, positive_int, say
from ..compile_cache import enable as enable_compile_cache
from ..config import load_named
from ..structured import StructuredVocab
from .media import add_media_args, media_policy
from .metrics import Metrics, server_counters, server_gauges

API_KEY_ENV = "DSV41_API_KEY"
# Not measured yet: a 512-row segment of the 2-layer cut would be about a quarter of its 2,048-row 19.4 ms on the
# H200 (README "Status") if the time scales with the rows, near one 32-slot decode step (5.7 ms), so a stream's
# gap while a long prompt prefills would stay near twice its step (the issue asks ITL p99 <= 2x without).
DEFAULT_PREFILL_TOKENS = 512
DEFAULT_PREFIX_CACHE_GIB = 1.0

EXAMPLES = """\
examples:
  python -m dsv41_jax.serve                                   # the embedded tiny model on 127.0.0.1:8000
  python -m dsv41_jax.serve --checkpoint /models/DeepSeek-V4.1-Flash --world 8 --max-batch 32 --max-context 65536
  python -m dsv41_jax.serve --port 0                          # a free port (the start-up line says which)

  curl http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Hi"}], "thinking": true, "stream": true}'

Routes: POST /v1/chat/completions, POST /v1/completions (SSE with "stream": true), GET /v1/models, GET /health,
GET /metrics. Chat requests take "thinking" (true/false or {"type": "enabled"}; default off, on when
"reasoning_effort" is given), "reasoning_effort" (low, high, max or 1..100), "tools" and "tool_choice"; the reply
carries "reasoning_content" apart from "content", and "tool_calls". A request field the server does not implement
is a 400 naming it, an unknown "model" a 404. SIGTERM or Ctrl-C drains: new requests get 503 while those running
and queued finish (up to --drain-timeout; then they end with an error), then the server exits 0. Without
--checkpoint the embedded tiny model (configs/tiny.json, random weights) answers noise: its 512-id vocabulary
folds the tokenizer's ids (id mod 512).
"""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m dsv41_jax.serve", description="An OpenAI-compatible server for DeepSeek-V4.1 in JAX.",
                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    runspec.add_model_args(p, cut_layers=True, engram_tables=False)
    serve = p.add_argument_group("serving")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    serve.add_argument("--max-batch", type=positive_int, default=8, metavar="B",
                       help="decode slots: requests generating at once (default 8)")
    serve.add_argument("--max-context", type=positive_int, default=4096, metavar="N",
                       help="cache capacity per request, prompt + new tokens (default 4096)")
    serve.add_argument("--max-queue", type=int, default=64, metavar="Q",
                       help="requests that may wait for a slot; more get 503 at once (default 64)")
    serve.add_argument("--segment-rows", type=positive_int, metavar="N",
                       help="prefill segment rows (default: the planner's segments; at most --max-prefill-tokens)")
    serve.add_argument("--max-prefill-tokens", type=positive_int, default=DEFAULT_PREFILL_TOKENS, metavar="N",
                       help="prefill rows a scheduling step runs beside its decode step: long prompts are cut into "
                            "segments of at most N, so a running stream waits at most about one decode step plus "
                            f"N rows of prefill (default {DEFAULT_PREFILL_TOKENS}; more: faster long prefills, "
                            "longer stalls)")
    serve.add_argument("--prefix-cache-gib", type=float, default=DEFAULT_PREFIX_CACHE_GIB, metavar="G",
                       help="device memory for prefix caching: prompts that start with the blocks (segments) of an "
                            "earlier prompt start from its prefill state (least recently used dropped first; "
                            f"default {DEFAULT_PREFIX_CACHE_GIB:g}; 0: off)")
    serve.add_argument("--served-model-name", action="append", metavar="NAME[,NAME...]",
                       help="the model names requests may ask for and /v1/models lists (repeatable or a comma "
                            "list; the first is the default; default: the checkpoint folder's name (bard: the "
                            "embedded model), or dsv41-CONFIG-random / dsv41-K-layer-random); another name is a 404")
    serve.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                       help="on SIGTERM or Ctrl-C, seconds the running and queued requests have to finish before "
                            "they are ended with an error (default 60; a second Ctrl-C stops at once)")
    serve.add_argument("--api-key", metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every route but /health and /metrics (else "
                            "401); default: $DSV41_API_KEY if set and not empty, else none (no key needed)")
    add_media_args(serve)
    return p


def check_args(args) -> None:
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.drain_timeout < float("inf"):
        raise UsageError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    if not 0 <= args.prefix_cache_gib < float("inf"):
        raise UsageError(f"--prefix-cache-gib must be a number of GiB >= 0, got {args.prefix_cache_gib}")
    served_names(args)
    api_key(args)
    media_policy(args)


def api_key(args) -> str | None:
    """``--api-key``, else ``$DSV41_API_KEY``; None: no key needed."""
    key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)  # set empty: none
    if key is not None and (not key.strip() or key != key.strip()):
        source = "--api-key" if args.api_key is not None else API_KEY_ENV
        raise UsageError(f"{source}: the key must be non-empty, without leading or trailing spaces")
    return key


def served_names(args) -> tuple[str, ...]:
    """``--served-model-name`` (each a comma list), in order, without repeats; default: the model's own name."""
    given = [n.strip() for flag in args.served_model_name or () for n in flag.split(",")]
    if any(not n for n in given):
        raise UsageError(f"--served-model-name: an empty name in {','.join(given)!r}")
    if given:
        return tuple(dict.fromkeys(given))
    if args.checkpoint:
        return (args.checkpoint.rstrip("/").split("/")[-1],)
    if args.layers:
        return (f"dsv41-{args.layers}-layer-random",)
    if args.config:
        return (f"dsv41-{Path(args.config).stem}-random",)
    return (EMBEDDED_MODEL,)  # the embedded trained model


def listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
        # Listening already, so a client that connects as soon as "listening on" is printed waits in the
        # backlog instead of being refused while uvicorn starts its loop (it listens on the socket again).
        sock.listen(2048)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_spec(args) -> runspec.RunSpec:
    """The model setup this command line asks for (engram tables on the devices; no speculation)."""
    return runspec.spec_from_args(args, engram_tables="device", images=_has_vision(args))


def _has_vision(args) -> bool:
    """Whether the model has a vision tower (its config's vision_config): then the server loads its image path."""
    if args.layers:
        return False
    if args.config:
        return load_named(args.config).vision is not None
    if args.checkpoint:
        path = Path(args.checkpoint) / "config.json"
        return path.is_file() and load_named(str(path)).vision is not None
    return False


def build_slots(args, spec: runspec.RunSpec, before_compile=lambda: None):
    """(slots, engine, tokenizer): the model, its engine and its slot engine, compiled (``runspec.start`` done;
    ``before_compile()`` just before). Among several processes, process 0's slot engine sends its calls to the
    others' (`lockstep`)."""
    # The engine and the slots bring JAX: after the command line is checked.
    from ..compiler import compiling_note  # noqa: PLC0415 - brings JAX (see above)
    from ..engine import Engine, EngineInputError  # noqa: PLC0415 - brings JAX (see above)
    from .lockstep import Channel, LeaderSlots  # noqa: PLC0415 - brings JAX (see above)
    from .prefix import PrefixCache  # noqa: PLC0415 - brings JAX (see above)
    from .slots import SlotEngine  # noqa: PLC0415 - brings JAX (see above)

    distributed.agree(distributed.run_fingerprint(args))
    cache_dir = enable_compile_cache(distributed.cache_dir(args.compile_cache))
    say(f"compile cache: {cache_dir if cache_dir is not None else 'off'}")
    inputs = runspec.open_inputs(spec)
    cfg = inputs.cfg
    if args.skip_engram and not cfg.engram_layer_ids:
        raise UsageError("--skip-engram: this model has no engram layers to skip")
    if args.max_context > cfg.max_position_embeddings:
        raise UsageError(f"--max-context {args.max_context:,} is above the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings:,})")
    say(f"model: {inputs.description}")
    tokenizer, tokenizer_description = runspec.tokenizer(spec)
    say(f"tokenizer: {tokenizer_description}")
    plan = runspec.segment_plan(cfg, spec, args.segment_rows)
    model, mesh = runspec.build(inputs, spec)
    engine = Engine(model, cfg, max_context=args.max_context, cache_dtype=args.dtype, segment_plan=plan, mesh=mesh,
                    hasher=inputs.hasher)
    kind = SlotEngine
    if distributed.several() and distributed.is_leader():
        LeaderSlots.channel = Channel()
        kind = LeaderSlots
    prefix = PrefixCache(int(args.prefix_cache_gib * (1 << 30)))
    try:
        slots = kind(engine, args.max_batch, prefill_budget=args.max_prefill_tokens, prefix_cache=prefix)
    except EngineInputError as e:
        raise UsageError(f"--max-prefill-tokens: {e}") from None
    say(f"scheduling: prefill segments of {slots.chunk:,} rows, at most {slots.budget:,} prefill rows a step; "
        f"prefix cache: {prefix_note(slots, prefix.capacity)}")
    before_compile()
    say(compiling_note(f"the programs for {args.max_batch} slots and a context of {args.max_context:,} tokens"))
    seconds = slots.precompile()
    loaded = f" ({engine.programs_loaded} loaded from the cache)" if engine.programs_loaded else ""
    say(f"compiled {engine.compile_count} programs in {seconds:.1f} s{loaded}")
    return slots, engine, tokenizer


def prefix_note(slots, asked: int) -> str:
    """The prefix cache of this slot engine (``asked``: the bytes --prefix-cache-gib gives) for the start-up line:
    its size in snapshots of the engine's one-row state."""
    one = slots.snapshot_bytes / (1 << 20)
    if not asked:
        return "off"
    if slots.prefix_cache is None:
        return f"off: one snapshot ({one:,.1f} MiB, a one-row cache of the context) is larger than --prefix-cache-gib"
    return (f"{asked / (1 << 30):g} GiB, {asked // slots.snapshot_bytes:,} snapshots of {one:,.1f} MiB, blocks of "
            f"{slots.chunk:,} tokens")


def build_server(args, spec: runspec.RunSpec):
    """(app, state): the model, its engine and slots compiled (`build_slots`), the HTTP app over them."""
    # The server's pieces and JAX itself: after the command line is checked.
    import jax  # noqa: PLC0415 - JAX starts after the CLI asked for its simulated devices

    from .app import ServerState, create_app  # noqa: PLC0415 - brings JAX (see above)
    from .worker import Worker  # noqa: PLC0415 - brings JAX (see above)

    compile_events = [0]

    def on_compile(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compile_events[0] += 1

    slots, engine, tokenizer = build_slots(
        args, spec, before_compile=lambda: jax.monitoring.register_event_duration_secs_listener(on_compile))
    names = served_names(args)
    metrics = Metrics({}, model_name=names[0])
    worker = Worker(slots, args.max_queue, on_token=metrics.add_generated_token)
    metrics.gauges.update(server_gauges(worker, lambda: compile_events[0]))
    metrics.counters.update(server_counters(worker))
    structured, structured_off = structured_vocab(tokenizer, engine.vocab_size)
    state = ServerState(worker, tokenizer, metrics, names, engine.vocab_size, args.max_context,
                        api_key=api_key(args), structured=structured, structured_off=structured_off,
                        media=media_policy(args))
    return create_app(state), state


def structured_vocab(tokenizer, model_vocab: int):
    """(the grammars' token tables, or None and why): structured output needs the tokenizer's ids to be the
    model's (a smaller model vocabulary folds them: the tiny random models) and one process (a grammar's masks
    are host inputs the followers would need too)."""
    if tokenizer.vocab_size > model_vocab:
        return None, (f"the model's {model_vocab:,}-id vocabulary folds the tokenizer's {tokenizer.vocab_size:,} "
                      f"ids (a random tiny model)")
    if distributed.several():
        return None, "it is not served over several processes"
    return StructuredVocab(tokenizer, model_vocab), ""


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain: the first SIGTERM / SIGINT stops the worker taking requests (the app
    answers 503, /health "draining") and waits up to ``drain_timeout`` seconds for those in flight; what is left
    then ends with a shutdown event (an error event and [DONE], or a 503); then uvicorn shuts down. A second
    signal stops at once. The signal is not raised again after the drain: the exit status is 0."""

    FLUSH_S = 10  # uvicorn's wait for the last responses to be written once nothing is in flight

    def __init__(self, config, worker, drain_timeout: float):
        super().__init__(config)
        self.worker, self.drain_timeout = worker, drain_timeout

    def handle_exit(self, sig, frame) -> None:
        if self.worker.draining:
            say("dsv41_jax.serve: stopping now")
            self.should_exit = self.force_exit = True
            return
        name = signal.Signals(sig).name
        say(f"dsv41_jax.serve: {name}: draining ({self.worker.in_flight} requests in flight; new requests get "
            f"503; up to {self.drain_timeout:g} s)")
        self.worker.drain()
        threading.Thread(target=self._drain, name="dsv41-drain", daemon=True).start()

    def _drain(self) -> None:
        if not self.worker.wait_idle(self.drain_timeout):
            left = self.worker.in_flight
            self.worker.abort(f"the server shut down before this request finished (its drain timeout, "
                              f"{self.drain_timeout:g} s, ran out)")
            self.worker.wait_idle(self.FLUSH_S)
            say(f"dsv41_jax.serve: drain timeout: ended {left} requests")
        self.should_exit = True


def run(args) -> int:
    check_args(args)
    spec = run_spec(args)
    processes = spec.processes
    # The port is taken before the slow start-up (a port in use is refused at once), by the process that serves.
    sock = listen(args.host, args.port) if not processes.several or (
        processes.coordinator != distributed.AUTO and processes.index == 0) else None
    runspec.start(spec)
    if not distributed.is_leader():
        return follow(args, spec)
    sock = sock or listen(args.host, args.port)
    app, state = build_server(args, spec)
    state.worker.start()
    try:
        return _serve(app, state, sock, args)
    finally:
        if distributed.several():
            from .lockstep import LeaderSlots, stop_followers  # noqa: PLC0415 - brings JAX

            stop_followers(LeaderSlots.channel)


def follow(args, spec: runspec.RunSpec) -> int:
    """A process other than process 0: the same model and slot engine, stepped as process 0 says (`lockstep`)."""
    from .lockstep import follow as follow_leader  # noqa: PLC0415 - brings JAX

    slots, _, _ = build_slots(args, spec)
    follow_leader(slots)
    return 0


def _serve(app, state, sock, args) -> int:
    host, port = sock.getsockname()[:2]
    say(f"dsv41_jax.serve: listening on http://{host}:{port} (model {state.model_name}, "
        f"{args.max_batch} slots, context {args.max_context:,}, queue {args.max_queue})")
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=DrainingServer.FLUSH_S)
    DrainingServer(config, state.worker, args.drain_timeout).run(sockets=[sock])
    say("dsv41_jax.serve: stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(build_parser(), run, argv, interrupted=None, local_devices=runspec.local_devices)


if __name__ == "__main__":
    sys.exit(main())
