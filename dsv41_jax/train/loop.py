"""The training loop: batches, the two phases' jitted steps, the held-out evaluation and the export."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..config import ModelConfig
from ..engram import Hasher, compute_token_map, empty_history
from ..tokenizer import DeepSeekTokenizer
from . import objectives as obj
from .data import word_list
from .export import export
from .quantize import as_stored, model_kinds

EVAL_WINDOWS = 32  # held-out windows of --seq tokens in each evaluation (the same ones every time)
WORDS = 5000  # the training text's most frequent words, recorded for the test of the generated text
DRAFT_PROMPT_TOKENS = 64
PROMPT_TOKENS = 128  # the held-out prompt the shipped model's test reads back through generate --logits-out


# ------------------------------------------------------------------------------------------------ batches
class Batches:
    """Windows ``[BOS, t_i … t_{i+T−2}]`` of a token stream (documents joined by EOS) and their engram rows."""

    def __init__(self, stream: np.ndarray, seq: int, bos: int, hasher: Hasher | None):
        self.stream, self.seq, self.bos, self.hasher = stream, seq, bos, hasher

    def window(self, starts: np.ndarray) -> np.ndarray:
        idx = starts[:, None] + np.arange(self.seq - 1)[None, :]
        return np.concatenate([np.full((len(starts), 1), self.bos), self.stream[idx]], axis=1).astype(np.int32)

    def sample(self, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray | None]:
        return self.at(rng.integers(0, len(self.stream) - self.seq, size=batch))

    def at(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        ids = self.window(np.asarray(starts))
        return ids, self.engram_rows(ids)

    def engram_rows(self, ids: np.ndarray) -> np.ndarray | None:
        if self.hasher is None:
            return None
        rows, _ = self.hasher.rows(ids, empty_history(self.hasher.cfg, len(ids)))
        return rows.astype(np.int32)


def token_stream(tok: DeepSeekTokenizer, docs) -> np.ndarray:
    ids = []
    for _, text in docs:
        ids.extend(tok.encode(text))
        ids.append(tok.eos_id)
    return np.asarray(ids, np.int32)


# ------------------------------------------------------------------------------------------------ params
def _name(path) -> str:
    """A state leaf's path as its model name (the Variable's own ``.value`` step left out)."""
    keys = [k for k in path if not isinstance(k, jax.tree_util.GetAttrKey)]
    return ".".join(str(k.key if hasattr(k, "key") else k.idx) for k in keys)


def _is_bias(path, _value) -> bool:
    return path[-1] == "bias"


def _is_stage(path, _value) -> bool:
    return path[0] == "mtp"


def split_model(model):
    """(graphdef, target params, stage params, routing biases, the rest) as pure dicts."""
    graphdef, bias, stage, target, rest = nnx.split(model, nnx.All(nnx.Param, _is_bias),
                                                     nnx.All(nnx.Param, _is_stage), nnx.Param, ...)
    return graphdef, target, stage, bias, rest


def stored(tree, kinds):
    """Every weight of a state as stored (straight-through; `quantize.as_stored`)."""
    return jax.tree_util.tree_map_with_path(lambda p, w: as_stored(_name(p), w, kinds), tree)


def _decay_mask(tree):
    return jax.tree_util.tree_map_with_path(lambda p, w: w.ndim >= 2 and "engram.embed" not in _name(p), tree)


def _bias_update(bias, loads, rate: float, owners: str):
    """Each router's bias a step of ``rate`` towards balance: up where the expert is under the mean load
    (DeepSeek's auxiliary-loss-free balancing); only routers whose owner starts with ``owners``."""
    flat = {_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(bias)[0]}
    totals: dict[str, jnp.ndarray] = {}
    for owner, counts in loads:
        if owner.startswith(owners):
            totals[owner] = totals.get(owner, 0.0) + counts
    for owner, counts in totals.items():
        key = f"{owner}.bias"
        flat[key] = flat[key] + rate * jnp.sign(jnp.mean(counts) - counts)
    return jax.tree_util.tree_map_with_path(lambda p, _: flat[_name(p)], bias)


def _imbalance(loads) -> jnp.ndarray:
    """Mean over routers of max load / mean load."""
    return jnp.mean(jnp.stack([jnp.max(c) / jnp.maximum(jnp.mean(c), 1e-9) for _, c in loads]))


# ------------------------------------------------------------------------------------------------ steps
def make_steps(graphdef, rest, kinds, args, total_steps: int, stage_steps: int):
    def schedule(steps):
        return optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, max(1, steps // 10)), max(steps, 2),
                                                  args.lr * 0.1)

    def optimizer(steps, mask):
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.adamw(schedule(steps), b1=0.9, b2=0.95, weight_decay=0.1, mask=mask))

    target_opt = optimizer(total_steps, _decay_mask)
    stage_opt = optimizer(stage_steps, _decay_mask)

    def merged(target, stage, bias):
        return nnx.merge(graphdef, stored(target, kinds), stored(stage, kinds), bias, rest)

    @jax.jit
    def target_step(target, stage, bias, opt_state, ids, rows):
        def loss_fn(target):
            model = merged(target, stage, bias)
            with obj.recording_loads() as loads:
                logits, taps = obj.target_forward(model, ids, rows)
            lm = obj.lm_loss(logits, ids)
            ix = obj.indexer_loss(model, taps)
            return lm + args.indexer_weight * ix, (lm, ix, list(loads))

        grads, (lm, ix, loads) = jax.grad(loss_fn, has_aux=True)(target)
        updates, opt_state = target_opt.update(grads, opt_state, target)
        target = optax.apply_updates(target, updates)
        bias = _bias_update(bias, loads, args.bias_rate, "layers.")
        stats = {"lm": lm, "indexer_kl": ix, "imbalance": _imbalance([x for x in loads if x[0].startswith("layers.")])}
        return target, bias, opt_state, stats

    @jax.jit
    def stage_step(target, stage, bias, opt_state, ids, rows, anchors):
        def loss_fn(stage):
            model = merged(jax.lax.stop_gradient(target), stage, bias)
            with obj.recording_loads() as loads:
                logits, taps = obj.target_forward(model, ids, rows)
                xent, bce, agree = obj.dspark_loss(model, ids, logits, taps, anchors)
            return xent + 0.1 * bce, (xent, bce, agree, list(loads))

        grads, (xent, bce, agree, loads) = jax.grad(loss_fn, has_aux=True)(stage)
        updates, opt_state = stage_opt.update(grads, opt_state, stage)
        stage = optax.apply_updates(stage, updates)
        bias = _bias_update(bias, loads, args.bias_rate, "mtp.")
        return stage, bias, opt_state, {"draft_xent": xent, "confidence_bce": bce, "agree": agree}

    @jax.jit
    def evaluate(target, stage, bias, ids, rows):
        model = merged(target, stage, bias)
        logits, _ = obj.target_forward(model, ids, rows)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]

    return target_opt, stage_opt, target_step, stage_step, evaluate


# ------------------------------------------------------------------------------------------------ run
def run(args, cfg: ModelConfig, tok_path: Path, train_docs, held_docs) -> dict:
    tok = DeepSeekTokenizer(tok_path)
    hasher = Hasher(cfg, compute_token_map(tok_path)) if cfg.engram_layer_ids else None
    if hasher is not None:
        hasher.overlap = False
    train = Batches(token_stream(tok, train_docs), args.seq, tok.bos_id, hasher)
    held = Batches(token_stream(tok, held_docs), args.seq, tok.bos_id, hasher)
    eval_starts = np.linspace(0, len(held.stream) - args.seq, EVAL_WINDOWS).astype(np.int64)
    eval_ids, eval_rows = held.at(eval_starts)
    say(f"{len(train.stream):,} training tokens, {len(held.stream):,} held-out tokens")

    model = obj.trainable_model(cfg, args.seed)
    graphdef, target, stage, bias, rest = split_model(model)
    del model
    kinds = model_kinds(cfg)
    target_opt, stage_opt, target_step, stage_step, evaluate = make_steps(graphdef, rest, kinds, args, args.steps,
                                                                          args.dspark_steps)
    opt_state = target_opt.init(target)
    rng = np.random.default_rng(args.seed)
    log_path = args.work / "train_log.jsonl"
    log = log_path.open("w")
    curve: list[dict] = []

    def held_out() -> float:
        return float(jnp.mean(evaluate(target, stage, bias, jnp.asarray(eval_ids), _dev(eval_rows))))

    def emit(entry: dict) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()

    t0 = time.time()
    for step in range(1, args.steps + 1):
        ids, rows = train.sample(rng, args.batch)
        target, bias, opt_state, stats = target_step(target, stage, bias, opt_state, jnp.asarray(ids), _dev(rows))
        if step % 10 == 0 or step == 1:
            entry = {"phase": "target", "step": step, "s": round(time.time() - t0, 1),
                     **{k: round(float(v), 4) for k, v in stats.items()}}
            if step % args.eval_every == 0 or step == args.steps:
                entry["held_out"] = round(held_out(), 4)
                curve.append({"step": step, "train": entry["lm"], "held_out": entry["held_out"]})
            emit(entry)
            say(json.dumps(entry))
    target_s = time.time() - t0

    opt_state = stage_opt.init(stage)
    t1 = time.time()
    for step in range(1, args.dspark_steps + 1):
        ids, rows = train.sample(rng, args.batch)
        anchors = obj.sample_anchors(rng, args.batch, args.anchors, args.seq, cfg.dspark_block_size)
        stage, bias, opt_state, stats = stage_step(target, stage, bias, opt_state, jnp.asarray(ids), _dev(rows),
                                                   jnp.asarray(anchors))
        if step % 10 == 0 or step == 1:
            entry = {"phase": "dspark", "step": step, "s": round(time.time() - t1, 1),
                     "draft_xent": round(float(stats["draft_xent"]), 4),
                     "confidence_bce": round(float(stats["confidence_bce"]), 4),
                     "agree": [round(float(a), 3) for a in stats["agree"]]}
            emit(entry)
            say(json.dumps(entry))
    log.close()

    final = held_out()
    prompt = [int(x) for x in held.window(np.array([0]))[0, :PROMPT_TOKENS]]
    prompt_loss = float(jnp.mean(evaluate(target, stage, bias, jnp.asarray([prompt]),
                                          _dev(held.engram_rows(np.asarray([prompt], np.int32))))))
    flat = {**_flat(target), **_flat(stage), **_flat(bias)}
    record = {
        "config": args.config, "seed": args.seed, "steps": args.steps, "dspark_steps": args.dspark_steps,
        "batch": args.batch, "seq": args.seq, "lr": args.lr, "indexer_weight": args.indexer_weight,
        "bias_rate": args.bias_rate, "anchors": args.anchors, "held_out_chars": args.held_out_chars,
        "train_documents": [n for n, _ in train_docs], "held_out_documents": [n for n, _ in held_docs],
        "train_tokens": int(len(train.stream)), "held_out_tokens": int(len(held.stream)),
        "held_out_loss": round(final, 5), "held_out_windows": EVAL_WINDOWS,
        "prompt_ids": prompt, "prompt_loss_training": round(prompt_loss, 5),
        "draft_prompt_ids": draft_prompts(eval_ids),
        "target_s": round(target_s, 1), "dspark_s": round(time.time() - t1, 1),
        "devices": str(jax.devices()), "curve": curve,
        "words": word_list([t for _, t in train_docs], WORDS),
    }
    export(args.out, cfg, flat, tok_path, record)
    return record


def draft_prompts(eval_ids: np.ndarray) -> list[list[int]]:
    """The held-out prompts the speculation test drafts from: the first DRAFT_PROMPT_TOKENS tokens of every
    eighth evaluation window (four places spread over the held-out documents)."""
    return [[int(x) for x in w[:DRAFT_PROMPT_TOKENS]] for w in eval_ids[::8]]


def _flat(tree) -> dict[str, np.ndarray]:
    return {_name(p): np.asarray(v, np.float32) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _dev(x):
    return None if x is None else jnp.asarray(x)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
