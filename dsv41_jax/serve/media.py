"""Images in chat messages: OpenAI's ``image_url`` parts read into decoded images for the vision tower.

A part is ``{"type": "image_url", "image_url": {"url": URL, "detail": "auto"}}`` (``detail`` may be absent or
null). URL is

* ``data:image/<type>;base64,<data>``: the encoded image inline (PNG, JPEG, WebP, GIF (its first frame), whatever
  Pillow reads; at most `MAX_IMAGE_BYTES` encoded, `preprocess.MAX_IMAGE_PIXELS` decoded);
* ``file:///path``: only when the server was started with ``--allowed-local-media-path DIR`` (`MediaPolicy`) and
  the path, symlinks resolved, lies under DIR; refused otherwise.

http(s) URLs are refused: the server fetches nothing over the network. Every refusal is a `BadRequest` naming
the part's ``image_url`` (``messages[0].content[1].image_url``, or the key under it that is wrong). Decoding is
`vision.preprocess.open_image`, the one ``generate --image`` uses, so both read the same pixels.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image

from ..cli import UsageError
from ..vision.preprocess import ImageError, open_image
from .errors import BadRequest, shown

MAX_IMAGE_BYTES = 20 << 20  # an encoded image (data: or file:), as OpenAI's per-image limit
DETAILS = (None, "auto")  # OpenAI's "detail": the tower reads every image at its one resolution plan
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),", re.IGNORECASE)
_WHITESPACE = re.compile(rb"\s+")
ALLOWED_FLAG = "--allowed-local-media-path"


@dataclass(frozen=True)
class MediaPolicy:
    """Where image URLs may come from. ``local_root``: the resolved directory ``file://`` URLs may name files
    under (None: no local files)."""

    local_root: Path | None = None


def add_media_args(group) -> None:
    """The server's ``--allowed-local-media-path`` flag, in ``group`` (an argparse group)."""
    group.add_argument(ALLOWED_FLAG, metavar="DIR",
                       help="chat image parts may name files under DIR as file:// URLs (symlinks resolved; "
                            "default: none, file:// URLs are refused); images otherwise come inline as data: URLs "
                            "(the server fetches no http(s) URL)")


def media_policy(args) -> MediaPolicy:
    """The policy of a parsed command line's ``--allowed-local-media-path`` (absent: no local files);
    UsageError unless it names a directory."""
    given = getattr(args, "allowed_local_media_path", None)
    if given is None:
        return MediaPolicy()
    root = Path(given).expanduser()
    if not root.is_dir():
        raise UsageError(f"{ALLOWED_FLAG} {given}: not a directory")
    return MediaPolicy(root.resolve())


@dataclass(frozen=True)
class ImagePart:
    """One image part of a message, checked for shape (`check_image_part`): its ``url`` and where it is
    (``field``: ``messages[i].content[j].image_url``)."""

    url: str
    field: str


def check_image_part(part: dict, where: str) -> ImagePart:
    """``part`` (the dict at ``where`` = ``messages[i].content[j]``) as an `ImagePart`: ``image_url`` an object
    with a string ``url`` and ``detail`` absent, null or "auto"; no other keys. BadRequest naming the key."""
    field = f"{where}.image_url"
    for key in part:
        if key not in ("type", "image_url"):
            raise BadRequest(f"{where}.{key} is not a key of an image part (type, image_url)", f"{where}.{key}")
    spec = part.get("image_url")
    if not isinstance(spec, dict):
        raise BadRequest(f'{field} must be an object {{"url": "data:image/png;base64,..."}}, got {shown(spec)}',
                         field)
    for key in spec:
        if key not in ("url", "detail"):
            raise BadRequest(f"{field}.{key} is not a key of image_url (url, detail)", f"{field}.{key}")
    if not isinstance(spec.get("url"), str) or not spec["url"]:
        raise BadRequest(f"{field}.url must be a non-empty string (a data: URL), got {shown(spec.get('url'))}",
                         f"{field}.url")
    if spec.get("detail") not in DETAILS:
        raise BadRequest(f'{field}.detail is not supported by this server (accepted only as "auto" or null: the '
                         f'vision tower reads each image at one resolution plan), got {shown(spec["detail"])}',
                         f"{field}.detail")
    return ImagePart(spec["url"], field)


def read_image(part: ImagePart, policy: MediaPolicy) -> Image.Image:
    """The part's image decoded to RGB (`open_image`); BadRequest naming ``part.field`` for a URL that is
    refused or unreadable, data that is not base64, bytes that are not an image, or an absurd size."""
    data = image_bytes(part, policy)
    try:
        return open_image(data)
    except ImageError as e:
        said = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e).replace("image the image", "the image"))
        raise BadRequest(f"{part.field}: {said}", part.field) from None


def image_bytes(part: ImagePart, policy: MediaPolicy) -> bytes:
    """The encoded image a URL holds or names (see the module docstring)."""
    url, field = part.url, part.field
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url_bytes(url, field)
    if scheme == "file":
        return _file_bytes(url, field, policy)
    if scheme in ("http", "https"):
        raise BadRequest(f"{field}: {scheme} URLs are refused: this server fetches nothing over the network; send "
                         f"the image inline as a data: URL (data:image/png;base64,...)", field)
    raise BadRequest(f"{field}: the url must be a data: URL (data:image/png;base64,...)"
                     f"{' or a file:// URL' if policy.local_root else ''}, got {shown(url)}", field)


def _data_url_bytes(url: str, field: str) -> bytes:
    head = _DATA_URL.match(url)
    if head is None:
        raise BadRequest(f"{field}: a data: URL is data:image/<type>;base64,<data>, got {shown(url)}", field)
    media_type = head["type"].strip().lower()
    params = [p.strip().lower() for p in head["params"].split(";") if p.strip()]
    if not media_type.startswith("image/"):
        raise BadRequest(f"{field}: the data: URL's media type must be image/... (image/png, image/jpeg, "
                         f"image/webp, image/gif), got {shown(media_type or 'none')}", field)
    if "base64" not in params:
        raise BadRequest(f"{field}: the data: URL must be base64 (data:{media_type};base64,...)", field)
    text = url[head.end():]
    if len(text) > 2 * MAX_IMAGE_BYTES:  # surely too large (base64 is 4/3 of the bytes, line breaks aside)
        raise BadRequest(f"{field}: the image is larger than {MAX_IMAGE_BYTES >> 20} MiB encoded", field)
    try:
        data = base64.b64decode(_WHITESPACE.sub(b"", text.encode("ascii")), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as e:
        raise BadRequest(f"{field}: the data: URL's data is not base64 ({e})", field) from None
    if not data:
        raise BadRequest(f"{field}: the data: URL holds no data", field)
    if len(data) > MAX_IMAGE_BYTES:
        raise BadRequest(f"{field}: the image is larger than {MAX_IMAGE_BYTES >> 20} MiB encoded", field)
    return data


def _file_bytes(url: str, field: str, policy: MediaPolicy) -> bytes:
    root = policy.local_root
    if root is None:
        raise BadRequest(f"{field}: file:// URLs are refused: this server reads no local files unless started "
                         f"with {ALLOWED_FLAG} DIR (then only files under DIR); send the image inline as a data: "
                         f"URL", field)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise BadRequest(f"{field}: a file URL is file:///absolute/path (no host, query or fragment), got "
                         f"{shown(url)}", field)
    path = Path(unquote(parts.path))
    if not path.is_absolute():
        raise BadRequest(f"{field}: a file URL names an absolute path, got {shown(url)}", field)
    resolved = path.resolve()  # symlinks followed: a link under the root to a file outside it is outside
    if not resolved.is_relative_to(root):
        raise BadRequest(f"{field}: {path} is not under the directory this server reads images from "
                         f"({ALLOWED_FLAG})", field)
    if not resolved.is_file():
        raise BadRequest(f"{field}: {path} is not a file", field)
    if resolved.stat().st_size > MAX_IMAGE_BYTES:
        raise BadRequest(f"{field}: {path} is larger than {MAX_IMAGE_BYTES >> 20} MiB", field)
    try:
        return resolved.read_bytes()
    except OSError as e:
        raise BadRequest(f"{field}: cannot read {path}: {e.strerror or e}", field) from None
