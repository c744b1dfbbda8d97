"""``python -m dsv41_jax.generate``: generate text with DeepSeek-V4.1 (or the embedded tiny model).

Generated text goes to stdout (streamed for a single prompt); announcements, the prefill progress bar and the
closing timing line go to stderr. ``--json`` prints one JSON object on stdout instead of text. Bad input gets
one line on stderr and exit status 2.

The tiny model (``configs/tiny.json``, random weights) has a 512-id vocabulary while the DeepSeek-V4 tokenizer
has 129,280 ids. Text prompts are still tokenized with the real tokenizer and each id is *folded* into the
model's vocabulary (``id mod vocab``, said on stderr); generated ids (all below 512) are decoded with the real
tokenizer, so the text shows what those ids are: byte-level fragments of a random model, not language.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import distributed, runspec
from .chat import (
    REASONING_EFFORT_LEVELS,
    ChatFormatError,
    Message,
    chat_ids,
    encode_messages,
    message_from_openai,
    parse_reply,
    tool_function,
)
from .cli import Parser, UsageError, cli_main, positive_int, quieted, say
from .compile_cache import enable as enable_compile_cache
from .runspec import RunSpec
from .textfile import read_text
from .tokenizer import IMAGE_PLACEHOLDER, fold_ids, image_text_ids
from .vision.preprocess import expand_prompt, open_image, prepare_image

EXAMPLES = """\
examples:
  python -m dsv41_jax.generate --prompt "The capital of France is" --max-new-tokens 16
  python -m dsv41_jax.generate --chat --prompt "Why is the sky blue?" --no-thinking
  python -m dsv41_jax.generate --chat --thinking --reasoning-effort max --system "Be brief." --prompt "Why?" --json
  python -m dsv41_jax.generate --prompt "a" --prompt "bb" --json             # a batch of two, JSON summary
  python -m dsv41_jax.generate --prompt-ids 0,5,6,7 --greedy --logits-out run.npz
  python -m dsv41_jax.generate --prompts-file prompts.jsonl --temperature 0.7 --top-p 0.9 --seed 1
  python -m dsv41_jax.generate --checkpoint /models/DeepSeek-V4.1-Flash --world 8 --chat --prompt "Hi"
  python -m dsv41_jax.generate --config tiny_engram --prompt-ids 5,6,7,5,6,7 --greedy
  python -m dsv41_jax.generate --chat --image photo.png --prompt "What is in this picture?"
  python -m dsv41_jax.generate --checkpoint /models/DeepSeek-V4.1-Flash --world 4 --coordinator host-0:12345 \\
      --num-processes 4 --process-id 0 --prompt "Hi"      # one process a host, each with its own --process-id

Engram layers (the released config has two) run by default: their n-gram rows are hashed on the host from the
token map of the checkpoint's tokenizer.json (or engram_token_map.json; else the packaged tokenizer's), and the
tables are placed by --engram-tables: device (split by hash column over the --world devices, 24/W columns a
layer each), host (left memory-mapped in the checkpoint's shards; each call's rows are gathered on the host and
sent with it), or auto (default: the planner picks device when it fits the devices' memory at this world, else
host; the choice is printed). --skip-engram runs without them: the output is then NOT the model's (a warning
says so).

--prompts-file holds one JSON object per line (UTF-8): {"prompt": "text"}, {"prompt_ids": [0, 5, 6]} or
{"messages": [{"role": "user", "content": "Hi"}]} (OpenAI-style messages: roles system, user, assistant, tool;
assistant "reasoning_content" and "tool_calls", tool "tool_call_id"), the messages optionally with "tools"
(OpenAI function specs); each may add "max_new_tokens" and "images": ["a.png", ...]; other keys are refused.
Chat prompts use DeepSeek-V4.1's own format (dsv41_jax/chat.py); with --json their replies are also split into
"reasoning_content", "content" and "tool_calls" (and "unparsed_tool_call_text" when tool-call markup does not
parse).
The tokenizer is the checkpoint's tokenizer.json when --checkpoint has one, else the packaged DeepSeek-V4 one.

Images (--image, "images"): each becomes one image span (docs/VISION.md). Where it goes: at each <｜deepseek_image｜>
in the text or the image token id in raw ids (their count must equal the number of images); otherwise, with
--chat / "messages", at the start of the (last) user message, images joined to the text by blank lines as the V4
chat encoder renders image blocks; otherwise right after BOS. Without --checkpoint, images switch the embedded
model to configs/tiny_vision.json (tiny plus a tiny vision tower, random weights).
Without --checkpoint the embedded tiny model runs: configs/tiny.json (or --config) with random weights
(seed 0). Its vocabulary is 512 ids, so text prompt ids are folded into it (id mod 512) and the output is noise.
--config takes a named config (tiny, tiny_engram, tiny_vision, dsv41_flash) or a config.json path.

Flags that would change nothing in a run are refused, not ignored: --thinking, --reasoning-effort and --system
without a chat prompt, --chat with raw ids, sampling flags with --greedy, --seed without sampling, speculation
flags without speculation, --decode-chunk with engram layers or --logits-out, --skip-engram and
--engram-tables for a model without engram layers. Prompt plus new tokens must fit the model's context.
The first run of a shape compiles its programs (minutes for a large model on a CPU); they are kept in the
compile cache, and later runs load them in seconds.
"""


# ----------------------------------------------------------------------------------------------- arguments
# Flags whose default is filled in after parsing, so the checks can tell a flag given (``args.given``) from one
# left at its default: a flag given where it changes nothing is refused (`check_unused_flags`).
FILLED_DEFAULTS = {"top_k": 0, "top_p": 1.0, "seed": 0, "draft_tokens": 5}


class _GenerateParser(Parser):
    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.given = {name for name in FILLED_DEFAULTS if getattr(parsed, name, None) is not None}
        for name, value in FILLED_DEFAULTS.items():
            if getattr(parsed, name, None) is None:
                setattr(parsed, name, value)
        return parsed, rest


def _finite_number(flag: str):
    """An argparse type: a finite float (inf and nan are refused here; the range is checked with the others)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            wanted = "a finite number >= 0" if flag == "--temperature" else "a finite number in (0, 1]"
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}")
        return value
    return parse


def _reasoning_effort(text: str):
    if text in REASONING_EFFORT_LEVELS:
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(REASONING_EFFORT_LEVELS)} "
                                         f"or a whole number 1..100")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _GenerateParser(prog="python -m dsv41_jax.generate", description="Generate text with DeepSeek-V4.1 in JAX.",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("prompts (at least one; they run together as a batch)")
    src.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="prompt text (repeatable)")
    src.add_argument("--prompts-file", metavar="FILE", help="one JSON object per line (see below)")
    src.add_argument("--prompt-ids", action="append", default=[], metavar="1,2,3",
                     help="raw token ids, no tokenizer (repeatable)")
    src.add_argument("--image", action="append", default=[], metavar="FILE",
                     help="an image for the (single) command-line prompt (repeatable; see below where it goes)")
    src.add_argument("--chat", action="store_true", help="wrap text prompts in the DeepSeek-V4.1 chat format")
    src.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                     help="chat prompts: think first (open the answer with <think>; default: off, answer directly)")
    src.add_argument("--reasoning-effort", type=_reasoning_effort, metavar="LEVEL",
                     help="with --thinking: low (50), high (75, the default) or max (100), or a number 1..100")
    src.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each --prompt")
    model = runspec.add_model_args(p, image_default=True)
    model.add_argument("--max-context", type=positive_int, metavar="N",
                       help="cache capacity per sequence (default: fits the longest prompt + new tokens)")
    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N",
                     help="(default 32; prompt + new tokens must fit the context: --max-context, else the model's "
                          "max_position_embeddings)")
    gen.add_argument("--greedy", action="store_true", help="argmax (the default when --temperature is 0)")
    gen.add_argument("--temperature", type=_finite_number("--temperature"), default=None, metavar="T",
                     help="sampling temperature, a finite number >= 0 (default 0 = greedy; 1.0 when --top-k/--top-p "
                          "is given)")
    gen.add_argument("--top-k", type=int, default=None, metavar="K", help="sample from the K most likely (0 = off)")
    gen.add_argument("--top-p", type=_finite_number("--top-p"), default=None, metavar="P",
                     help="nucleus sampling mass in (0, 1] (1 = off)")
    gen.add_argument("--decode-chunk", type=positive_int, default=1, metavar="K",
                     help="decode steps per device program call (default 1). K > 1 compiles one more program (the "
                          "step under a scan) and lets the host dispatch and read once per K tokens (a faster loop "
                          "where the host's work per token is the bottleneck); streamed text then arrives K tokens "
                          "at a time. Refused with engram layers and with --logits-out (they decode one step at a "
                          "time)")
    gen.add_argument("--speculate", choices=("auto", "off", "dspark"), default="auto",
                     help="DSpark speculative decoding (docs/MODEL.md §B.13): draft with the checkpoint's mtp.* "
                          "stages, verify K+1 rows in one step. auto (default): on when --checkpoint has the stages "
                          "and the run allows it (no --logits-out, no --decode-chunk); dspark: on (the random tiny "
                          "model too), refusing what it cannot run; off: never")
    gen.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                     help="draft tokens a round when speculating, 1..5 (default 5, what the stages are trained for)")
    gen.add_argument("--speculate-baseline", action="store_true",
                     help="with speculation, also decode the same requests without it and report both rates "
                          "(refused when speculation does not run)")
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling seed, 0 .. 2^32 - 1 (default 0; prompt i uses (seed + i) mod 2^32)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON summary on stdout instead of text")
    out.add_argument("--logits-out", metavar="FILE.npz",
                     help="save f32 logits of the first prompt: prefill [prompt_len, V], decode [steps, V], "
                          "tokens [steps]")
    return p


# ----------------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class PromptSpec:
    """One prompt before tokenizing: text, chat messages or raw ids; its own max new tokens if given."""

    text: str | None = None
    messages: tuple | None = None
    ids: tuple[int, ...] | None = None
    max_new_tokens: int | None = None
    label: str = "prompt"
    tools: tuple = ()
    images: tuple[str, ...] = ()  # image files, in prompt order


def _parse_ids(text: str, label: str) -> tuple[int, ...]:
    parts = [s.strip() for s in text.split(",")]
    if not any(parts):
        return ()  # refused later as an empty prompt
    if not all(parts):
        raise UsageError(f"{label}: {text!r} has an empty entry; give integer ids separated by single commas")
    try:
        return tuple(int(s) for s in parts)
    except ValueError:
        raise UsageError(f"{label}: {text!r} is not a comma-separated list of integer ids") from None


PROMPT_KEYS = ("prompt", "prompt_ids", "messages", "tools", "max_new_tokens", "images")  # a --prompts-file line's


def _file_prompt(obj, where: str) -> PromptSpec:
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object")
    unknown = sorted(set(obj) - set(PROMPT_KEYS))
    if unknown:
        raise UsageError(f"{where}: unknown key \"{unknown[0]}\" (a line takes {', '.join(PROMPT_KEYS)})")
    given = [k for k in ("prompt", "prompt_ids", "messages") if k in obj]
    if len(given) != 1:
        raise UsageError(f"{where}: give exactly one of \"prompt\", \"prompt_ids\", \"messages\"")
    if "tools" in obj and "messages" not in obj:
        raise UsageError(f"{where}: \"tools\" go with \"messages\" (a chat prompt); this line has \"{given[0]}\"")
    max_new = obj.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1):
        raise UsageError(f"{where}: max_new_tokens must be a positive integer")
    images = obj.get("images", [])
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        raise UsageError(f"{where}: \"images\" must be a list of image file names")
    images = tuple(images)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise UsageError(f"{where}: \"prompt\" must be a string")
        return PromptSpec(text=obj["prompt"], max_new_tokens=max_new, label=where, images=images)
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise UsageError(f"{where}: \"prompt_ids\" must be a list of integers")
        return PromptSpec(ids=tuple(ids), max_new_tokens=max_new, label=where, images=images)
    msgs, tools = obj["messages"], obj.get("tools") or []
    if not isinstance(msgs, list) or not isinstance(tools, list):
        raise UsageError(f"{where}: \"messages\" and \"tools\" must be lists")
    try:
        messages = tuple(message_from_openai(m, f"{where}: message {i + 1}") for i, m in enumerate(msgs))
        for i, t in enumerate(tools):
            tool_function(t, f"{where}: tool {i + 1}")
    except ChatFormatError as e:
        raise UsageError(str(e)) from None
    return PromptSpec(messages=messages, max_new_tokens=max_new, label=where, tools=tuple(tools), images=images)


def check_chat_flags(args, specs: Sequence[PromptSpec]) -> None:
    """Chat flags that no prompt of the run takes are refused (each would be silently ignored otherwise): --chat
    formats text prompts (never raw ids), --system is a system message before them, --thinking and
    --reasoning-effort apply to chat prompts (--chat's, or "messages" lines)."""
    raw = next((s for s in specs if s.ids is not None), None)
    if args.chat and raw is not None:
        raise UsageError(f"--chat formats text prompts, but {raw.label} gives raw token ids (no chat format is "
                         f"applied to them): drop --chat, or give the prompt as text")
    texts = any(s.text is not None for s in specs)
    if args.chat and not texts:
        raise UsageError("--chat formats --prompt texts and \"prompt\" lines, and there are none (\"messages\" lines "
                         "are chat prompts already): drop --chat")
    if args.system is not None and not args.chat:
        raise UsageError("--system needs --chat (it is a system message of the chat format)")
    if args.thinking and not any(chat_messages(s, args) is not None for s in specs):
        raise UsageError("--thinking applies to chat prompts, and there are none: add --chat (or give \"messages\" "
                         "in --prompts-file)")
    if args.reasoning_effort is not None and not args.thinking:
        raise UsageError("--reasoning-effort needs --thinking (the effort is only given to a thinking model)")


def check_sampling_flags(args) -> None:
    """Sampling settings in range; flags that change nothing are refused: --temperature/--top-k/--top-p with
    --greedy, --top-k/--top-p at temperature 0 (greedy), --seed when nothing samples."""
    from .sampling import SamplingParams  # noqa: PLC0415 - brings JAX: after the cheap checks

    temperature = sampling_temperature(args)
    if temperature < 0:  # inf and nan are refused by the argument parser
        raise UsageError(f"--temperature must be a finite number >= 0, got {temperature}")
    SamplingParams(temperature, args.top_k, args.top_p, args.seed).validate()
    filters = [f for f, name in (("--top-k", "top_k"), ("--top-p", "top_p")) if name in args.given]
    if args.greedy:
        given = ["--temperature"] * (args.temperature is not None) + filters
        if given:
            raise UsageError(f"--greedy takes the most likely token: {given[0]} would change nothing (drop one)")
    elif temperature == 0 and filters:
        raise UsageError(f"{filters[0]} changes nothing in a greedy run (temperature 0): give --temperature > 0 "
                         f"to sample, or drop it")
    if "seed" in args.given and temperature == 0:
        raise UsageError("--seed seeds sampling, and this run is greedy: give --temperature (or --top-k/--top-p) "
                         "to sample, or drop --seed")


def chat_messages(spec: PromptSpec, args) -> tuple | None:
    """The chat messages of a prompt: its own, or --chat's system + user for text; None for a plain prompt."""
    if spec.messages is not None:
        return spec.messages
    if args.chat and spec.text is not None:
        system = (Message("system", args.system),) if args.system is not None else ()
        return (*system, Message("user", spec.text))
    return None


def gather_prompts(args) -> list[PromptSpec]:
    """All prompts in command-line order: --prompt, --prompt-ids, then the file's lines."""
    specs = [PromptSpec(text=t, label=f"--prompt {i + 1}") for i, t in enumerate(args.prompt)]
    specs += [PromptSpec(ids=_parse_ids(t, "--prompt-ids"), label="--prompt-ids") for t in args.prompt_ids]
    if args.image:
        if len(specs) != 1:
            raise UsageError(f"--image goes with exactly one --prompt or --prompt-ids (got {len(specs)}); give "
                             f"several prompts their images with \"images\" in --prompts-file")
        specs = [dataclasses.replace(specs[0], images=tuple(args.image))]
    if args.prompts_file:
        path = Path(args.prompts_file)
        for n, line in enumerate(read_text(path, "prompts file").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            specs.append(_file_prompt(obj, f"{path.name}:{n}"))
    if not specs:
        raise UsageError("no prompt given: use --prompt, --prompt-ids or --prompts-file")
    for s in specs:
        if (s.text is not None and not s.text.strip()) or (s.ids is not None and not s.ids) or (
                s.messages is not None and not s.messages):
            raise UsageError(f"{s.label}: the prompt is empty")
    return specs


def tokenize(specs: Sequence[PromptSpec], tokenizer, args, model_vocab: int,
             image_token_id: int | None = None) -> tuple[list[tuple[int, ...]], bool]:
    """Ids per prompt, and whether any text ids were folded into a smaller model vocabulary. A prompt with
    images gets one ``image_token_id`` per image (`_image_ids`)."""
    out, folded = [], False
    for s in specs:
        if s.images:
            ids, was_folded = _image_ids(s, tokenizer, args, model_vocab, image_token_id)
            out.append(ids)
            folded |= was_folded
            continue
        if s.ids is not None:
            out.append(tuple(s.ids))  # raw ids are checked against the vocabulary, never folded
            continue
        messages = chat_messages(s, args)
        if messages is not None:
            try:
                ids = chat_ids(tokenizer, messages, thinking=args.thinking, reasoning_effort=args.reasoning_effort,
                               tools=s.tools)
            except ChatFormatError as e:
                raise UsageError(f"{s.label}: {e}") from None
        else:
            ids = tokenizer.encode(s.text, add_bos=True)
        ids, was_folded = fold_ids(ids, tokenizer.vocab_size, model_vocab)
        folded |= was_folded
        out.append(tuple(ids))
    return out, folded


def _image_ids(spec: PromptSpec, tokenizer, args, model_vocab: int, image_id: int) -> tuple[tuple[int, ...], bool]:
    """Ids of a prompt with images: one ``image_id`` where each image goes (see the --help epilog); text ids
    folded into a smaller model vocabulary never land on ``image_id`` (they step one below)."""
    n = len(spec.images)
    if spec.ids is not None:
        if sum(i == image_id for i in spec.ids) != n:
            raise UsageError(f"{spec.label}: raw ids need one image token id {image_id} per image ({n}), "
                             f"found {sum(i == image_id for i in spec.ids)}")
        return tuple(spec.ids), False
    blank = "\n\n".join([IMAGE_PLACEHOLDER] * n)
    messages = chat_messages(spec, args)
    if messages is not None:
        messages = list(messages)
        if not any(IMAGE_PLACEHOLDER in m.content for m in messages):
            last = max(i for i, m in enumerate(messages) if m.role == "user")
            messages[last] = dataclasses.replace(messages[last], content=f"{blank}\n\n{messages[last].content}")
        try:
            text = encode_messages(messages, thinking=args.thinking, reasoning_effort=args.reasoning_effort,
                                   tools=spec.tools)
        except ChatFormatError as e:
            raise UsageError(f"{spec.label}: {e}") from None
        add_bos = False
    else:
        text = spec.text if IMAGE_PLACEHOLDER in spec.text else blank + spec.text
        add_bos = True
    if text.count(IMAGE_PLACEHOLDER) != n:
        raise UsageError(f"{spec.label}: the text has {text.count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} for "
                         f"{n} image(s)")
    ids, folded = image_text_ids(tokenizer, text, image_id, model_vocab, add_bos=add_bos)
    return tuple(ids), folded


def open_images(specs: Sequence[PromptSpec]) -> list[list]:
    """Every prompt's images decoded (RGB), before anything slow runs: an unusable image (missing, unreadable,
    not an image, absurd size) is a one-line `ImageError`."""
    return [[open_image(f) for f in spec.images] for spec in specs]


def image_prompts(opened: Sequence[list], prompt_ids, cfg) -> list:
    """Per prompt: None, or its `vision.preprocess.ImagePrompt` (images laid out, docs/VISION.md §V.B)."""
    return [expand_prompt(ids, [prepare_image(im, cfg.vision) for im in images], cfg.image_token_id)
            if images else None for images, ids in zip(opened, prompt_ids)]


# ----------------------------------------------------------------------------------------------- model
def run_spec(args, images: bool = False) -> RunSpec:
    """The model setup this command line asks for (``images``: prompts have images)."""
    blockers = (["--logits-out records one-row decode steps"] if args.logits_out else []) + (
        ["--decode-chunk is the plain decode loop's"] if args.decode_chunk != 1 else [])
    return runspec.spec_from_args(args, images=images, speculation_off=tuple(blockers))


def default_max_context(cfg, longest_prompt: int, max_new: int) -> int:
    """A power of two >= what the longest request needs (at least 256), capped at the model's limit."""
    need = longest_prompt + max_new - 1
    return min(cfg.max_position_embeddings, max(256, 1 << math.ceil(math.log2(max(need, 1)))))


# ----------------------------------------------------------------------------------------------- output
class _Streamer:
    """Streams the first (only) sequence's text to stdout as tokens arrive."""

    def __init__(self, tokenizer, enabled: bool):
        self.decoder = tokenizer.stream() if enabled else None

    def __call__(self, step, tokens, emitted):
        if self.decoder is not None and emitted[0]:
            sys.stdout.write(self.decoder.push(int(tokens[0])))
            sys.stdout.flush()

    def close(self):
        if self.decoder is not None:
            sys.stdout.write(self.decoder.flush() + "\n")
            sys.stdout.flush()


def _progress(total_rows: int, enabled: bool):
    """A rich progress bar on stderr for a prompt of several segments, else a no-op; (callback, stop)."""
    if not enabled:
        return None, lambda: None
    bar = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task("prefill", total=total_rows)
    bar.start()
    return (lambda done, total: bar.update(task, completed=done)), bar.stop


def summary_line(t) -> str:
    return (f"prompt {t.prompt_tokens} tokens ({len(t.segments)} segment{'s' if len(t.segments) != 1 else ''}) · "
            f"prefill {t.prefill_s:.2f} s = {t.prefill_tok_s:,.1f} tok/s · "
            f"decode {t.generated_tokens} tokens in {t.decode_s:.2f} s = {t.decode_tok_s:,.1f} tok/s · "
            f"compile {t.compile_s:.1f} s ({programs_note(t)})")


def programs_note(t) -> str:
    loaded = f", {t.programs_loaded} loaded from the cache" if t.programs_loaded else ""
    return f"{t.programs_compiled} program{'s' if t.programs_compiled != 1 else ''}{loaded}"


def speculation_line(t, baseline=None) -> str:
    """The closing line's speculative part: rounds, mean tokens a round, and the rates with and without."""
    line = (f"dspark: {t.rounds} rounds, {t.tokens_per_round:.2f} tokens a round per sequence "
            f"({t.accepted} drafts accepted) · decode with speculation {t.decode_tok_s:,.1f} tok/s")
    if baseline is not None:
        line += f" · without {baseline.decode_tok_s:,.1f} tok/s ({t.decode_tok_s / baseline.decode_tok_s:.2f}x)"
    return line


def _timings_dict(t) -> dict:
    extra = {}
    if hasattr(t, "rounds"):
        extra = {"speculative_rounds": t.rounds, "tokens_per_round": t.tokens_per_round,
                 "drafts_accepted": t.accepted}
    return {**extra, "prompt_tokens": t.prompt_tokens, "generated_tokens": t.generated_tokens,
            "segments": list(t.segments),
            "prefill_s": t.prefill_s, "prefill_tok_s": t.prefill_tok_s, "decode_s": t.decode_s,
            "decode_tok_s": t.decode_tok_s, "decode_steps": t.decode_steps, "compile_s": t.compile_s,
            "programs_compiled": t.programs_compiled, "programs_loaded": t.programs_loaded}


# ----------------------------------------------------------------------------------------------- main
def sampling_temperature(args) -> float:
    """--greedy wins; no --temperature means greedy, unless --top-k/--top-p ask for sampling (then 1.0)."""
    if args.greedy:
        return 0.0
    if args.temperature is not None:
        return args.temperature
    return 1.0 if args.top_k or args.top_p < 1.0 else 0.0


def make_requests(specs, prompt_ids, cfg, args) -> tuple[list, int]:
    """(requests, max_context), seeds seed + i. A prompt whose new tokens do not fit the context (--max-context,
    else the model's max_position_embeddings) is refused, with how many would fit."""
    from .engine import Request  # noqa: PLC0415 - brings JAX: after the cheap checks
    from .sampling import SamplingParams  # noqa: PLC0415 - brings JAX: after the cheap checks

    longest = max(len(p) for p in prompt_ids)
    max_news = [s.max_new_tokens or args.max_new_tokens for s in specs]
    if args.max_context and args.max_context > cfg.max_position_embeddings:
        raise UsageError(f"--max-context {args.max_context:,} is above the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings:,})")
    max_context = args.max_context or default_max_context(cfg, longest, max(max_news))
    if longest > max_context:
        raise UsageError(f"the prompt has {longest} tokens, longer than the context of {max_context} tokens"
                         + ("" if args.max_context else " (the model's max_position_embeddings)"))
    for spec, p, m in zip(specs, prompt_ids, max_news):
        if len(p) + m - 1 > max_context:  # the last new token is never fed back: it needs no cache row
            flag = f"{spec.label}: max_new_tokens" if spec.max_new_tokens else "--max-new-tokens"
            limit = (f"--max-context {max_context:,}" if args.max_context else
                     f"the model's context limit of {max_context:,} tokens (max_position_embeddings)")
            raise UsageError(f"{flag} {m:,}: the {len(p):,}-token prompt and its new tokens pass {limit}; at most "
                             f"{max_context - len(p) + 1:,} new tokens fit")
    temperature = sampling_temperature(args)
    requests = [Request(p, m, SamplingParams(temperature, args.top_k, args.top_p, (args.seed + i) % 2**32))
                for i, (p, m) in enumerate(zip(prompt_ids, max_news))]
    return requests, max_context


def generate_with_output(engine, requests, tokenizer, args):
    """Compile, then generate with streamed text and the prefill progress bar; compile time folded in."""
    from .engine import all_greedy  # noqa: PLC0415 - brings JAX: after the cheap checks

    longest = max(len(r.prompt_ids) for r in requests)
    record = bool(args.logits_out)
    stream = _Streamer(tokenizer, enabled=len(requests) == 1 and not args.json)
    _say_compiling(requests)
    count_before, loaded_before = engine.compile_count, engine.programs_loaded
    compile_s = engine.precompile(len(requests), longest, record_logits=record,
                                  images=any(r.images is not None for r in requests),
                                  greedy=all_greedy(requests))
    on_prefill, stop_bar = _progress(longest, enabled=not args.json and not quieted()
                                     and len(engine.segment_plan(longest)) > 1)
    try:
        result = engine.generate(requests, on_tokens=stream, on_prefill=on_prefill, record_logits=record)
    finally:
        stop_bar()
    stream.close()
    result.timings.compile_s += compile_s
    result.timings.programs_compiled = engine.compile_count - count_before
    result.timings.programs_loaded = engine.programs_loaded - loaded_before
    return result


def _say_compiling(requests, what: str = "the programs") -> None:
    """The one line said before the run compiles (`compiler.compiling_note`)."""
    from .compiler import compiling_note  # noqa: PLC0415 - brings JAX: after the cheap checks

    longest = max(len(r.prompt_ids) for r in requests)
    prompts = f"{len(requests)} prompt{'s' if len(requests) > 1 else ''}"
    say(compiling_note(f"{what} for {prompts} of up to {longest:,} tokens"))


def chat_reply_fields(tokenizer, token_ids, thinking: bool) -> dict:
    """A chat reply split as an OpenAI assistant message: reasoning_content, content, tool_calls (markers
    decoded as text, whatever the tokenizer counts as special; the parser stops at EOS)."""
    reply = parse_reply(tokenizer.decode(token_ids, skip_special=False), thinking=thinking)
    fields = {"reasoning_content": reply.reasoning, "content": reply.content,
              "tool_calls": [c.to_openai() for c in reply.tool_calls]}
    if reply.unparsed:
        fields["unparsed_tool_call_text"] = reply.unparsed
    return fields


def report(result, tokenizer, args, description: str, max_context: int, folded: bool,
           is_chat: Sequence[bool] = ()) -> None:
    """Texts of a batch (or the JSON summary) on stdout; ids, the logits file and the closing line.
    ``is_chat[i]``: prompt i was a chat prompt (its JSON result then carries the parsed reply)."""
    gens = result.generations
    if folded and not args.json:  # the tiny model's text is noise; its ids are the real output
        for i, g in enumerate(gens):
            say(f"generated ids{f' {i + 1}' if len(gens) > 1 else ''}: {' '.join(map(str, g.token_ids))}")
    texts = [tokenizer.decode(g.token_ids) for g in gens]
    if args.json:
        chat = list(is_chat) + [False] * (len(gens) - len(is_chat))
        print(json.dumps({
            "model": description, "max_context": max_context,
            "results": [{"prompt_ids": list(g.prompt_ids), "generated_ids": list(g.token_ids), "text": text,
                         "finish_reason": g.finish_reason,
                         **(chat_reply_fields(tokenizer, g.token_ids, args.thinking) if c else {})}
                        for g, text, c in zip(gens, texts, chat)],
            "timings": _timings_dict(result.timings)}, ensure_ascii=False))
    elif len(gens) > 1:
        for i, (g, text) in enumerate(zip(gens, texts)):
            print(f"--- prompt {i + 1} ({len(g.prompt_ids)} tokens, {g.finish_reason}) ---\n{text}")
    if args.logits_out and not quieted():  # one process writes it
        np.savez(args.logits_out, prefill=result.prefill_logits, decode=result.decode_logits,
                 tokens=np.array(gens[0].token_ids, np.int64))
        say(f"logits of prompt 1 saved to {args.logits_out}")
    say(summary_line(result.timings))


def run(args) -> int:
    specs = gather_prompts(args)  # the checks that need no JAX first: a mistake is refused at once
    check_chat_flags(args, specs)
    check_logits_out(args.logits_out)
    check_sampling_flags(args)
    from .engine import Engine, check_requests  # noqa: PLC0415 - brings JAX: after the cheap checks

    opened = open_images(specs)
    spec = run_spec(args, images=any(s.images for s in specs))
    runspec.start(spec)
    distributed.agree(distributed.run_fingerprint(args))
    cache_dir = enable_compile_cache(distributed.cache_dir(args.compile_cache))
    say(f"compile cache: {cache_dir if cache_dir is not None else 'off'}")
    inputs = runspec.open_inputs(spec)
    cfg, description = inputs.cfg, inputs.description
    speculate = inputs.dspark
    check_unused_flags(args, cfg, speculate)
    say(f"model: {description}" + (f" · DSpark speculation, {args.draft_tokens} draft tokens" if speculate else ""))
    for feature in cfg.unsupported_features():
        if not (speculate and feature.startswith("DSpark")):
            say(f"note: not run by this engine: {feature}")
    tokenizer, tokenizer_description = runspec.tokenizer(spec)
    say(f"tokenizer: {tokenizer_description}")
    prompt_ids, folded = distributed.decide_once(
        lambda: tokenize(specs, tokenizer, args, cfg.vocab_size, cfg.image_token_id))
    prompt_ids = [tuple(ids) for ids in prompt_ids]
    with_images = image_prompts(opened, prompt_ids, cfg)
    prompt_ids = [ip.ids if ip is not None else ids for ip, ids in zip(with_images, prompt_ids)]
    if folded:
        say(f"note: the model's vocabulary ({cfg.vocab_size} ids) is smaller than the tokenizer's "
            f"({tokenizer.vocab_size:,}): text prompt ids are folded into it (id mod {cfg.vocab_size}); "
            f"generated ids are decoded with the tokenizer as they are")
    requests, max_context = make_requests(specs, prompt_ids, cfg, args)
    requests = [dataclasses.replace(r, images=ip) for r, ip in zip(requests, with_images)]
    check_requests(requests, cfg.vocab_size, max_context)  # before the (slow) model build
    plan = runspec.segment_plan(cfg, spec)
    plan(max(len(p) for p in prompt_ids))  # the planner may refuse the prompt
    model, mesh = runspec.build(inputs, spec)
    hasher, host_tables = inputs.hasher, inputs.host_tables
    del inputs
    engine = Engine(model, cfg, max_context=max_context, cache_dtype=args.dtype, segment_plan=plan, mesh=mesh,
                    hasher=hasher, host_tables=host_tables, decode_chunk=args.decode_chunk)
    if speculate:
        result = speculate_with_output(engine, requests, tokenizer, args)
    else:
        result = generate_with_output(engine, requests, tokenizer, args)
    distributed.agree(json.dumps([g.token_ids for g in result.generations]), "generated tokens",
                      hint="the processes' host inputs diverged")
    report(result, tokenizer, args, description, max_context, folded,
           [chat_messages(s, args) is not None for s in specs])
    return 0


def check_logits_out(path: str | None) -> None:
    """--logits-out: refuse before the run a file that could not be written at its end."""
    if not path:
        return
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"--logits-out {out} is a directory: give a file name (FILE.npz)")
    if not out.resolve().parent.is_dir():
        raise UsageError(f"--logits-out: directory {out.parent} does not exist")


def check_unused_flags(args, cfg, speculate: bool) -> None:
    """Flags given where they change nothing in this run are refused (never silently ignored): speculation's
    without speculation, --decode-chunk where decoding runs one step at a time, the engram flags for a model
    without engram layers."""
    if not speculate:
        for flag, given in (("--speculate-baseline", args.speculate_baseline),
                            ("--draft-tokens", "draft_tokens" in args.given)):
            if given:
                why = ("--speculate off" if args.speculate == "off" else
                       "the random-weight model speculates only with --speculate dspark" if not args.checkpoint else
                       "speculative decoding is off for this run (said above)" if cfg.num_nextn_predict_layers else
                       "the checkpoint has no DSpark stages")
                raise UsageError(f"{flag} goes with speculative decoding, which does not run: {why}")
    if args.decode_chunk > 1:
        if args.logits_out:
            raise UsageError("--decode-chunk: --logits-out records every decode step one at a time; drop one of them")
        if cfg.engram_layer_ids and not args.skip_engram:
            raise UsageError("--decode-chunk: a model with engram layers decodes one step at a time (each step's "
                             "rows are hashed on the host first); drop --decode-chunk")
    if not cfg.engram_layer_ids:
        if args.skip_engram:
            raise UsageError("--skip-engram: this model has no engram layers to skip")
        if args.engram_tables != "auto":
            raise UsageError(f"--engram-tables {args.engram_tables}: this model has no engram layers")


def speculate_with_output(engine, requests, tokenizer, args):
    """`speculative.Speculator` with streamed text; the speculation line (and the plain rate with
    --speculate-baseline) on stderr. Its programs compile on first use (inside the prefill and first round)."""
    from .speculative import Speculator  # noqa: PLC0415 - brings JAX: after the cheap checks

    stream = _Streamer(tokenizer, enabled=len(requests) == 1 and not args.json)
    _say_compiling(requests, "the speculative programs (on first use, timed apart)")
    result = Speculator(engine).generate(requests, args.draft_tokens, on_tokens=stream)
    stream.close()
    baseline = engine.generate(requests).timings if args.speculate_baseline else None
    say(speculation_line(result.timings, baseline))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input, with one line on stderr)."""
    return cli_main(build_parser(), run, argv, local_devices=runspec.local_devices)


if __name__ == "__main__":
    sys.exit(main())
