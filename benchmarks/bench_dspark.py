"""DSpark speculative decoding costs: the 1-row decode step, the 6-row verify step, the
draft round and what acceptance lengths would buy, on a cut of the model with random weights drawn on the devices
(`dsv41_jax.profiling.build`) and a random cache filled to the position.

    python benchmarks/bench_dspark.py                              # H200: flash 2-layer cut, worlds 1,2
    python benchmarks/bench_dspark.py --worlds 1 --json-out r.json
    python benchmarks/bench_dspark.py --config tiny --steps 2      # CPU smoke run (tests/test_bench_dspark.py)

Per world it prints (device-bound: each program chained ``--steps`` times, one wait at the end, after a warm-up):

* ``step1 ms``: the engine's one-row decode step (`Engine.step_seconds`: forward + sampling + stop flags);
* ``step6 ms``: the same program over 6 rows a sequence (what a verify step of 5 drafts costs the target), and
  ``ratio`` = step6 / step1 (target ≤ 1.3);
* ``round ms``: one whole speculative round, the program ``generate --speculate`` runs (`speculative.ROUND`:
  the verify forward with taps and every row's logits, acceptance, rollback and the next draft);
* ``draft ms``: the draft round alone (`speculative.first_drafts`: three stages, head, Markov head), ``stage ms``
  one stage's forward, and ``head ms`` the final norm + head over B rows (for the extrapolation);
* ``draft %``: the draft round as a share of a full-depth target step extrapolated from the per-layer figure:
  ``full1 = head1 + N · (step1 − head1) / L`` (N = the config's layers, L = the cut's), target ≤ 25 %; and
  ``rest %``: the round less its verify step (draft + acceptance + rollback inside the round's program, an upper
  bound of the draft as `generate` runs it) as the same share;
* ``× at a``: the speed-up of acceptance length a (tokens a round) at full depth, ``a · full1 / (full6 +
  draft)`` with ``full6 = head1 + N · (step6 − head1) / L`` (+ the 5 extra head rows), for a = 1.5, 2.5, 3.5.

Random weights accept nothing: the end-to-end speed-up needs the released weights; these are the costs this
engine controls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import runspec
from dsv41_jax.config import ConfigError, load_named
from dsv41_jax.engine import Engine, Request
from dsv41_jax.profiling import build
from dsv41_jax.profiling.cut import cut_layers
from dsv41_jax.runtime import Program, merge
from dsv41_jax.speculative import ROUND, SpecState, empty_rings, first_drafts

ACCEPTANCE = (1.5, 2.5, 3.5)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="dsv41_flash", help="tiny, dsv41_flash, or a config.json")
    p.add_argument("--layers", type=int, default=2, help="cut the target to K layers (keeps its layer roles)")
    p.add_argument("--worlds", default="1,2", help="comma-separated worlds (default 1,2)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--position", type=int, default=4096, help="cache position (default 4096)")
    p.add_argument("--draft-tokens", type=int, default=5, help="K drafts a round (verify rows K + 1)")
    p.add_argument("--steps", type=int, default=50, help="chained calls per timing (default 50)")
    p.add_argument("--impl", choices=("auto", "xla", "pallas"), default="auto")
    p.add_argument("--json-out", metavar="FILE", help="write the rows as JSON")
    args = p.parse_args(argv)
    try:
        args.worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        p.error(f"--worlds {args.worlds!r}: comma-separated integers")
    if min(args.worlds) < 1 or args.batch < 1 or args.steps < 1 or args.layers < 1 or args.position < 0:
        p.error("--worlds, --batch, --steps and --layers must be positive, --position >= 0")
    if not 1 <= args.draft_tokens <= 5:
        p.error("--draft-tokens must be in 1..5")
    return args


def with_stages(full, layers: int):
    """The ``layers``-layer cut of ``full`` with its DSpark stages back (tapping the cut's last layers)."""
    cut = cut_layers(full, layers)
    n = full.num_nextn_predict_layers or 3
    taps = len(full.dspark_target_layer_ids) or 3
    last = cut.num_hidden_layers - 1
    return cut.replace(num_nextn_predict_layers=n, compress_ratios=tuple(cut.compress_ratios) + (0,) * n,
                       dspark_target_layer_ids=tuple(max(0, last - taps + 1 + i) for i in range(taps)))


def _draft_only(graphdef, state, rings, bonus, offset, sampling, produced, *, k: int):
    """The stages' draft round alone -> its tokens [B, k]."""
    model, ctx, vocab = merge(graphdef, state).unwrap()
    with ctx:
        return first_drafts(model, rings, bonus, offset, sampling, produced, k, vocab).tokens


def _one_stage(graphdef, state, x, rings, offset):
    """Stage 1's forward over a block: x [B, block, hc, D] -> the same shape."""
    model, ctx, _ = merge(graphdef, state).unwrap()
    with ctx:
        pos = offset[:, None] + jnp.arange(x.shape[1])[None, :]
        pre = jnp.full(x.shape[:3], 1.0 / x.shape[2], jnp.float32)
        return model.mtp[1](x, pre, pos, rings[1], offset)[0]


def _head_only(graphdef, state, h):
    """The final norm + head over h [B, rows, D], folded back into h so calls chain."""
    model, ctx, vocab = merge(graphdef, state).unwrap()
    with ctx:
        logits = model.head(model.norm(h))
        return h + 1e-3 * (vocab[1](logits) if vocab else logits)[..., :1].astype(h.dtype)


# The benchmark's own programs in the engine's runtime table (beside the step and the speculative round).
DRAFT = Program("bench_dspark_draft", _draft_only, static=("k",))
STAGE = Program("bench_dspark_stage", _one_stage)
HEAD = Program("bench_dspark_head", _head_only)


def _chained(fn, first_args, next_args, steps: int) -> float:
    """Seconds per call of ``fn``: one warm-up, then ``steps`` calls each on ``next_args(previous output)``."""
    out = fn(*first_args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn(*next_args(out))
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def measure(cfg, full_layers: int, world: int, args) -> dict:
    spec = runspec.RunSpec(world=world, impl=args.impl)
    model, mesh = runspec.device_model(cfg, spec, runspec.model_options(spec, dspark=True))
    b, k, steps = args.batch, args.draft_tokens, args.steps
    capacity = args.position + (k + 1) * (3 * steps + 8)
    engine = Engine(model, cfg, max_context=capacity, eos_ids=(), mesh=mesh)
    last = np.random.default_rng(0).integers(0, cfg.vocab_size, b).astype(np.int32)

    def cache():
        return build.build_cache(cfg, mesh, batch=b, position=args.position, rows=capacity - args.position,
                                 dtype="bfloat16")

    rt = engine.runtime
    rt.register(DRAFT, STAGE, HEAD)
    step1 = engine.step_seconds(cache(), last, steps).seconds
    stop = engine.stop_inputs([Request((0,), 10**8)] * b, greedy=True)  # as step_seconds
    ids6 = np.tile(last[:, None], (1, k + 1))
    lengths6 = np.full(b, k + 1, np.int32)
    sargs, _ = rt.step_args(cache(), np.zeros((b, cfg.vocab_size), np.float32), ids6, lengths6, np.ones(b, bool),
                            np.int32(0), stop)
    run6 = rt.step_program(sargs)
    ids6_d, len6_d = rt.place((ids6, lengths6))
    step6 = _chained(run6, sargs, lambda o: (rt.state, o.cache, ids6_d, len6_d, o.last_logits, o.keep_going,
                                             o.next_step, *stop, None, None), steps)

    state = rt.state
    sampling = None  # greedy drafts: the argmax-only picker, as `Speculator.generate` runs a greedy batch
    rings = rt.place(empty_rings(cfg, b, jnp.bfloat16))
    bonus = rt.place(last)
    offset = rt.place(np.full(b, args.position, np.int32))
    produced = rt.place(np.zeros(b, np.int32))

    dargs = (state, rings, bonus, offset, sampling, produced)
    draft_s = _chained(rt.program(DRAFT, {"k": k}, dargs), dargs,
                       lambda o: (state, rings, o[:, 0], offset, sampling, produced), steps)

    x = rt.place(jnp.ones((b, cfg.dspark_block_size, cfg.hc_mult, cfg.hidden_size), jnp.bfloat16))
    sargs = (state, x, rings, offset)
    stage_s = _chained(rt.program(STAGE, {}, sargs), sargs, lambda o: (state, o, rings, offset), steps)

    heads = {}
    for rows in (1, k + 1):
        hargs = (state, rt.place(jnp.ones((b, rows, cfg.hidden_size), jnp.bfloat16)))
        heads[rows] = _chained(rt.program(HEAD, {}, hargs), hargs, lambda o: (state, o), steps)

    spec = SpecState(cache(), rings, bonus, jnp.tile(bonus[:, None], (1, k)),
                     jnp.zeros((b, k, cfg.vocab_size), jnp.float32), jnp.ones((b,), bool), produced)
    spec = rt.place(spec)
    eos, max_new, _ = stop
    rargs = (state, spec, eos, max_new, sampling, None, None)
    round_s = _chained(rt.program(ROUND, {"k": k}, rargs), rargs,
                       lambda o: (state, o.state, eos, max_new, sampling, None, None), steps)

    n, layers = full_layers, cfg.num_hidden_layers
    full1 = heads[1] + n * (step1 - heads[1]) / layers
    full6 = heads[k + 1] + n * (step6 - heads[1]) / layers
    row = {"world": world, "batch": b, "position": args.position, "draft_tokens": k, "layers": layers,
           "full_layers": n, "step1_ms": step1 * 1e3, "step6_ms": step6 * 1e3, "ratio": step6 / step1,
           "round_ms": round_s * 1e3, "draft_ms": draft_s * 1e3, "stage_ms": stage_s * 1e3,
           "head1_ms": heads[1] * 1e3, "head6_ms": heads[k + 1] * 1e3, "full1_ms": full1 * 1e3,
           "full6_ms": full6 * 1e3, "draft_pct_of_full_step": 100 * draft_s / full1,
           # the round less its verify step: what the round's draft, acceptance and rollback cost together (an
           # upper bound of the draft as generate runs it, inside the round's one program)
           "round_less_verify_ms": (round_s - step6) * 1e3,
           "round_less_verify_pct_of_full_step": 100 * (round_s - step6) / full1,
           "speedup_full": {str(a): a * full1 / (full6 + draft_s) for a in ACCEPTANCE},
           "speedup_cut": {str(a): a * step1 / round_s for a in ACCEPTANCE}}
    return row


def fmt(r: dict) -> str:
    sp = " ".join(f"{v:5.2f}x" for v in r["speedup_full"].values())
    return (f"{r['world']:>5} {r['step1_ms']:8.3f} {r['step6_ms']:8.3f} {r['ratio']:6.2f} {r['round_ms']:8.3f} "
            f"{r['draft_ms']:8.3f} {r['stage_ms']:8.3f} {r['head1_ms']:7.3f} {r['full1_ms']:8.2f} "
            f"{r['draft_pct_of_full_step']:6.1f}% {r['round_less_verify_pct_of_full_step']:6.1f}% {sp}")


HEADER = (f"{'world':>5} {'step1 ms':>8} {'step6 ms':>8} {'ratio':>6} {'round ms':>8} {'draft ms':>8} {'stage ms':>8} "
          f"{'head ms':>7} {'full1 ms':>8} {'draft %':>7} {'rest %':>7} "
          + " ".join(f"{'x@' + str(a):>6}" for a in ACCEPTANCE))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        full = load_named(args.config)
    except ConfigError as e:
        print(f"bench_dspark: error: {e}", file=sys.stderr)
        return 2
    if not full.num_nextn_predict_layers:
        print(f"bench_dspark: error: config {args.config} has no DSpark stages", file=sys.stderr)
        return 2
    cfg = with_stages(full, args.layers)
    worlds = [w for w in args.worlds if w <= jax.device_count()]
    if not worlds:
        print(f"bench_dspark: error: worlds {args.worlds} need more than the {jax.device_count()} devices here",
              file=sys.stderr)
        return 2
    print(f"{args.config}: {cfg.num_hidden_layers}-layer cut + {cfg.num_nextn_predict_layers} DSpark stages, "
          f"random weights, batch {args.batch}, position {args.position}, {args.draft_tokens} drafts a round; "
          f"full depth = {full.num_hidden_layers} layers; speed-ups at acceptance {', '.join(map(str, ACCEPTANCE))} "
          f"tokens a round (random weights accept nothing: the real speed-up needs the released weights)")
    print(HEADER)
    rows = []
    for world in worlds:
        rows.append(measure(cfg, full.num_hidden_layers, world, args))
        print(fmt(rows[-1]), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"config": args.config, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
