"""The shipped trained model (``dsv41_jax/assets/bard``, written by ``python -m dsv41_jax.train``, docs/TRAINING.md)
through the user's path: ``generate --checkpoint`` in a subprocess, as a user runs it.

* The checkpoint is in the release format (fp8 dense with ue8m0 scales, fp4 experts, fp8-row engram tables, the
  DSpark stages ``mtp.*``, its own ``tokenizer.json`` with the chat markers as single tokens) and small enough to
  ship (≤ 32 MiB).
* Its loss on the recorded held-out prompt, read back through ``--logits-out``, is the one the trainer recorded.
* Greedy text from it is English-like: most of its words are among the training text's 5,000 most frequent
  (recorded in ``training.json``).
* Greedy decoding with DSpark speculation gives the tokens of greedy decoding without it, and the stages'
  drafts are accepted on held-out text (≥ 1.5 tokens a round).
* Worlds 2 and 4 (simulated CPU devices) give world 1's tokens (slow: a world beyond the one the path needs).
* The server serves it when given no model flags (it is the embedded default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv41_jax.assets import embedded_checkpoint
from dsv41_jax.checkpoint import open_checkpoint
from dsv41_jax.tokenizer import DeepSeekTokenizer
from dsv41_jax.train.data import SPECIAL_TOKENS, WORD

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = embedded_checkpoint()
MAX_BYTES = 32 << 20
NEW_TOKENS = 64
# Both sides f32 with the rounding points off (the trainer's forward): the same weights (the trainer's forward
# sees every weight as stored, so the exporter writes exactly the values it trained), and the same operations; only
# the two programs' summation order differs (measured: equal to the record's 5 decimals). 1e-3 nats is far above
# that noise and far below what a changed weight moves it (bf16 activations with the rounding points on, the
# default run, already move it by 1e-3).
LOSS_TOLERANCE = 1e-3

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "config.json").is_file(),
                                reason="the trained checkpoint is not in this tree (python -m dsv41_jax.train)")


def _record() -> dict:
    return json.loads((CHECKPOINT / "training.json").read_text())


def _generate(*flags: str, devices: int = 1) -> subprocess.Popen:
    """``generate --checkpoint <the shipped model> --json`` with ``flags``, on ``devices`` CPU devices (the
    session's other XLA flags kept)."""
    xla = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join([*xla, f"--xla_force_host_platform_device_count={devices}"]),
               JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "dsv41_jax.generate", "--checkpoint", str(CHECKPOINT), "--json", "--greedy", *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _results(*procs: subprocess.Popen) -> list[dict]:
    """The JSON summaries of processes started side by side (each compiles on one core)."""
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out) for out, _ in outs]


def _ids(values) -> str:
    return ",".join(str(int(i)) for i in values)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs of the shipped model: the recorded prompt's logits (f32, rounding points off), and greedy text
    from the four recorded held-out prompts (64 tokens each, spread over the held-out documents), one batch,
    without and with DSpark speculation (f32: the verify step's K + 1 rows and a decode
    step's one row sum in different orders, and in bf16 a near-tie of the argmax could tell them apart)."""
    record = _record()
    logits = tmp_path_factory.mktemp("trained") / "logits.npz"
    prompts = [flag for p in record["draft_prompt_ids"] for flag in ("--prompt-ids", _ids(p))]
    text = (*prompts, "--max-new-tokens", str(NEW_TOKENS), "--dtype", "float32")
    f32, plain = _results(_generate("--prompt-ids", _ids(record["prompt_ids"]), "--max-new-tokens", "8",
                                    "--dtype", "float32", "--no-quant-rounding", "--logits-out", str(logits)),
                          _generate(*text, "--speculate", "off"))
    (spec,) = _results(_generate(*text, "--speculate", "dspark"))
    return {"record": record, "logits": np.load(logits), "f32": f32, "plain": plain, "spec": spec}


def test_the_checkpoint_is_in_the_release_format_and_small_enough_to_ship():
    size = sum(f.stat().st_size for f in CHECKPOINT.iterdir())
    assert size <= MAX_BYTES, f"{size:,} bytes"
    ckpt = open_checkpoint(CHECKPOINT, dspark=True)
    codecs = {name: src.codec for name, src in ckpt.sources.items()}
    assert ckpt.stored_expert_format == "fp4"
    assert codecs["layers.0.attn.wq_a.weight"] == "fp8" and codecs["mtp.0.attn.wq_a.weight"] == "fp8"
    assert codecs["mtp.0.ffn.experts.0.w1.weight"] == "fp4"
    assert all(codecs[f"layers.{layer}.engram.embed.weight"] == "fp8r" for layer in ckpt.cfg.engram_layer_ids)
    assert ckpt.cfg.quantization["scale_fmt"] == "ue8m0"
    assert any(name.startswith(f"mtp.{ckpt.cfg.num_nextn_predict_layers - 1}.markov_head") for name in codecs)
    tok = DeepSeekTokenizer(CHECKPOINT)
    assert tok.vocab_size == ckpt.cfg.vocab_size and all(tok.is_single_token(t) for t in SPECIAL_TOKENS)


def test_held_out_loss_through_logits_out_equals_the_recorded_one(runs):
    ids = np.asarray(runs["record"]["prompt_ids"])
    prefill = runs["logits"]["prefill"].astype(np.float64)
    assert prefill.shape == (len(ids), json.loads((CHECKPOINT / "config.json").read_text())["vocab_size"])
    top = prefill.max(axis=-1, keepdims=True)
    logp = prefill - top - np.log(np.exp(prefill - top).sum(axis=-1, keepdims=True))
    loss = -np.mean(logp[np.arange(len(ids) - 1), ids[1:]])
    assert abs(loss - runs["record"]["prompt_loss_training"]) <= LOSS_TOLERANCE, (loss, runs["record"])
    assert runs["record"]["held_out_loss"] < 5.5  # learned: the training text's unigram entropy is ~6.5 nats


def test_greedy_text_is_english_like(runs):
    """At least 80 % of the words are among the training text's 5,000 most frequent (measured: 92 % for the
    shipped model, 38 % for random weights of the same config and tokenizer, whose text is glued fragments)."""
    texts = [r["text"] for r in runs["plain"]["results"]]
    words = [w for text in texts for w in WORD.findall(text.lower())]
    known = set(runs["record"]["words"])
    assert len(words) >= 20 * len(texts), texts
    assert sum(w in known for w in words) >= 0.8 * len(words), texts


def test_dspark_speculation_keeps_greedy_tokens_and_is_accepted_on_held_out_text(runs):
    """Tokens a round per sequence over the four prompts (measured: 1.95; the first prompt alone, the opening of
    a prose text, 1.47)."""
    plain, spec = runs["plain"]["results"], runs["spec"]["results"]
    assert [r["generated_ids"] for r in spec] == [r["generated_ids"] for r in plain]
    assert runs["spec"]["timings"]["tokens_per_round"] >= 1.5, runs["spec"]["timings"]


@pytest.mark.slow
def test_worlds_2_and_4_give_world_1s_tokens(runs):
    """f32 with the rounding points off, as the world-1 run of the fixture (its tokens after the recorded prompt)."""
    flags = ("--prompt-ids", _ids(runs["record"]["prompt_ids"]), "--max-new-tokens", "8", "--dtype", "float32",
             "--no-quant-rounding", "--speculate", "off")
    two, four = _results(_generate(*flags, "--world", "2", devices=4), _generate(*flags, "--world", "4", devices=4))
    one = runs["f32"]["results"][0]["generated_ids"]
    assert two["results"][0]["generated_ids"] == one
    assert four["results"][0]["generated_ids"] == one


@pytest.mark.slow  # the default server's user path is guarded by tests/test_serve_structured.py's server
def test_the_server_serves_it_by_default(runs):
    """``python -m dsv41_jax.serve`` with no model flags serves the shipped model: a chat and a completion through
    the official client answer, the completion in the training text's words."""
    openai = pytest.importorskip("openai")
    from test_serve import launch, stop  # noqa: PLC0415 - the server tests' helpers (they need the test extra)

    proc, url, lines = launch("--max-batch", "2", "--max-context", "256")
    try:
        assert any("assets/bard" in line for line in lines), "".join(lines)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Speak, friend."}],
                                              max_tokens=24, temperature=0)
        assert chat.choices[0].message.content.strip()
        prompt = runs["record"]["draft_prompt_ids"][1]
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        words = WORD.findall(completion.choices[0].text.lower())
        known = set(runs["record"]["words"])
        assert words and sum(w in known for w in words) >= 0.6 * len(words), completion.choices[0].text
    finally:
        stop(proc)
