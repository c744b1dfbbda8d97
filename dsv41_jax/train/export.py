"""Write the trained model as a release-format checkpoint through the one writer (`make_tiny.write_checkpoint`,
``quantize="fp4"``: dense fp8 with 32×32 ue8m0 scales, routed experts fp4, engram tables fp8 rows, the DSpark
stages ``mtp.*``), with its ``tokenizer.json`` and the training record ``training.json``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .. import formats, param_specs
from ..config import ModelConfig
from ..make_tiny import write_checkpoint

RECORD_FILE = "training.json"


def release_weights(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The trainer's float32 model-name weights → what `write_checkpoint` takes: each engram table as its fp8-rows
    codes and ue8m0 scale bytes (the other tensors are quantised by the writer)."""
    out = {}
    for name, w in flat.items():
        if param_specs.is_engram_table(name):
            codes, scale = formats.fp8_rows_quantize(w)
            out[name], out[name.removesuffix(".weight") + ".scale"] = codes, scale.view(np.uint8)
        else:
            out[name] = np.asarray(w, np.float32)
    return out


def export(out: Path, cfg: ModelConfig, flat: dict[str, np.ndarray], tokenizer_json: Path, record: dict) -> None:
    """Replace ``out`` with the checkpoint of ``flat`` (model names, float32), its tokenizer and ``record``."""
    if out.exists():
        shutil.rmtree(out)
    write_checkpoint(out, cfg, release_weights(flat), "fp4", shard_bytes=64 << 20)
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    write_record(out, record)
    for f in out.iterdir():  # package data: readable by every user of an installed wheel
        f.chmod(0o644)


def write_record(out: Path, record: dict) -> None:
    (out / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")


def read_record(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / RECORD_FILE).read_text())
