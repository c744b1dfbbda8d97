"""Load an official-format DeepSeek-V4.1 checkpoint directory into **model names** (docs/DESIGN.md).

A directory holds ``config.json`` and safetensors shards listed by ``model.safetensors.index.json`` (or one
``model.safetensors``); names and layouts are those of `docs/MODEL.md` §E. fp8 (e4m3 + 32×32 ue8m0 scales) and fp4
(packed e2m1 + per-32 ue8m0 scales) matrices are dequantised; per-expert tensors are stacked
(``layers.L.ffn.experts.w1.weight [E, F, D]``). Everything is checked against `param_specs` from the file
headers alone before any data is read: a missing, unexpected or mis-shaped tensor is refused by name.

With ``expert_format="fp4"`` the routed experts are returned packed as stored (``layers.L.ffn.experts.wN.codes``
uint8 ``[E, out, in/2]`` and ``.scales`` ue8m0 bytes uint8 ``[E, out, in/32]``, `param_specs.model_tensors`):
the checkpoint must then hold them as fp4. With ``dense_format="fp8"`` the dense matrices the release stores in
fp8 (`param_specs.is_fp8_dense`) are returned as stored too: ``….weight`` e4m3 codes and ``….scale`` ue8m0 bytes
uint8 (the checkpoint must hold them as fp8).

Three entry points:

* ``load_checkpoint(path)`` → ``(cfg, {model name: array})``, the whole text model in memory.
* ``iter_tensors(path)`` → yields ``(model name, array)`` one tensor at a time (for loading into shards).
* ``open_checkpoint(path)`` → a `Checkpoint` whose ``read(name, experts=...)`` reads one tensor, or a subset
  of the routed experts of a stacked tensor, without touching the rest.

Safetensors files are read through their header and a memory map (the library's numpy front end has no fp8
dtypes); float8 / bfloat16 views come from ``ml_dtypes``.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from dsv41_jax import formats, param_specs
from dsv41_jax.config import ConfigError, ModelConfig
from dsv41_jax.textfile import TextFileError, read_text

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
_DTYPES = {**_FLOAT_DTYPES, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
           "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64}
_SCALE_DTYPES = ("F8_E8M0", "U8", "F32", "BF16", "F16")
PROGRESS_BYTES = 256 << 20  # reads at least this large show a progress bar on stderr (here and sharding.load)


class CheckpointError(ValueError):
    """A checkpoint this engine cannot load; the message names the file or tensor and why."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as found in a shard: safetensors dtype, stored shape, byte range in ``file``."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Source:
    """How one official tensor is stored: its weight, its ``.scale`` (None if plain) and the codec."""

    weight: StoredTensor
    scale: StoredTensor | None
    codec: str  # "plain" | "fp8" | "fp4"


# --------------------------------------------------------------------------------------------- safetensors
def read_header(path: Path) -> dict[str, StoredTensor]:
    """Name → `StoredTensor` from a safetensors file's header (no tensor data read)."""
    try:
        file_bytes = path.stat().st_size
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > file_bytes - 8:  # garbage would otherwise ask for an absurd read
                raise CheckpointError(f"{path}: not a safetensors file (its header length {size:,} is more than "
                                      f"the file's {file_bytes:,} bytes)")
            header = json.loads(f.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    base = 8 + size
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        out[name] = _stored_tensor(path, name, meta, base, file_bytes)
    return out


def _stored_tensor(path: Path, name: str, meta, base: int, file_bytes: int) -> StoredTensor:
    """One header entry, checked: its byte range lies in the file and fits its dtype and shape."""
    try:
        begin, end = (int(x) for x in meta["data_offsets"])
        dtype, shape = str(meta["dtype"]), tuple(int(d) for d in meta["shape"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: header entry {name} is not a safetensors tensor entry") from None
    if base + end > file_bytes:
        raise CheckpointError(f"{path}: truncated: tensor {name} ends at byte {base + end:,} but the file has "
                              f"{file_bytes:,} bytes")
    if dtype in _DTYPES and end - begin != int(np.prod(shape)) * np.dtype(_DTYPES[dtype]).itemsize:
        raise CheckpointError(f"{path}: tensor {name} has {end - begin:,} bytes, not what {dtype} {list(shape)} "
                              f"needs")
    return StoredTensor(name, path, dtype, shape, base + begin, base + end)


class _Files:
    """Memory maps of the shards, opened on first use."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.memmap] = {}

    def array(self, t: StoredTensor) -> np.ndarray:
        if t.dtype not in _DTYPES:
            raise CheckpointError(f"tensor {t.name} in {t.file.name}: unsupported dtype {t.dtype}")
        if t.file not in self._maps:
            self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        raw = self._maps[t.file][t.start:t.end]
        return raw.view(_DTYPES[t.dtype]).reshape(t.shape)


# ---------------------------------------------------------------------------------------------- checkpoint
@dataclass
class Checkpoint:
    """A validated checkpoint directory. ``skipped`` lists what the text model leaves out (printable lines)."""

    path: Path
    cfg: ModelConfig
    sources: dict[str, Source]  # official name → how it is stored
    skipped: list[str] = field(default_factory=list)
    expert_format: str = "dequantized"  # or "fp4": routed experts read packed (param_specs.model_tensors)
    vision: bool = False  # the image path's tensors are read too (param_specs.vision_tensors)
    engram: bool = True  # the engram layers' tensors are part of the model (False: skipped, --skip-engram)
    dspark: bool = False  # the DSpark stages' mtp.* tensors are part of the model (param_specs.dspark_tensors)
    dense_format: str = "dequantized"  # or "fp8": fp8 dense matrices read as stored (codes + .scale bytes)
    _files: _Files = field(default_factory=_Files, repr=False)

    @property
    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """Model name → shape (`param_specs.model_tensors` in this checkpoint's ``expert_format``)."""
        return param_specs.model_tensors(self.cfg, self.expert_format, vision=self.vision, engram=self.engram,
                                         dspark=self.dspark, dense_format=self.dense_format)

    @property
    def stored_expert_format(self) -> str:
        """"fp4" when every routed expert is stored packed fp4 (the official release), else "dequantized"."""
        codecs = {s.codec for name, s in self.sources.items() if param_specs.expert_name(name) is not None}
        return "fp4" if codecs == {"fp4"} else "dequantized"

    @property
    def stored_dense_format(self) -> str:
        """"fp8" when every dense matrix the release stores in fp8 is stored so here, else "dequantized"."""
        codecs = {s.codec for name, s in self.sources.items() if param_specs.is_fp8_dense(name)}
        return "fp8" if codecs == {"fp8"} else "dequantized"

    @property
    def nbytes(self) -> int:
        """Bytes of the text model's tensors as stored."""
        return sum(s.weight.end - s.weight.start + (s.scale.end - s.scale.start if s.scale else 0)
                   for s in self.sources.values())

    def read(self, name: str, *, dtype: str = "float32",
             experts: Sequence[int] | slice | None = None) -> np.ndarray:
        """One tensor by **model name**, dequantised to ``dtype`` ("float32" or "bfloat16").

        For a stacked routed-expert tensor, ``experts`` picks which experts (default all): the result is
        ``[len(experts), out, in]``. With dtype "bfloat16" the parameters the model keeps in f32 (§B.1:
        ``hc_*``, ``attn_sink``, ``gate.bias``, ``compressor.*``) are still returned as float32.
        A packed expert name (``layers.L.ffn.experts.wN.codes`` / ``.scales``) gives the stored bytes as uint8
        (``dtype`` does not apply), stacked the same way.
        """
        packed = _packed(name)
        if packed is not None:
            return self._read_packed(*packed, experts)
        if param_specs.is_engram_table(name):
            return self.read_table(name)
        if self._as_stored_fp8(name):
            return self._read_fp8(name)
        out_dtype = _out_dtype(name, dtype)
        if name == "head.weight" and self.cfg.tie_word_embeddings:
            name = "embed.weight"
        layer, proj = _stacked(name)
        if layer is None:
            if name not in self.sources:
                raise KeyError(f"{name} is not a tensor of this model")
            return self._decode(self.sources[name], out_dtype)
        ids = range(param_specs.n_experts(self.cfg, layer))
        ids = ids[experts] if isinstance(experts, slice) else (ids if experts is None else list(experts))
        first = self.sources[_expert(layer, 0, proj)]
        shape = _logical_shape(first)
        out = np.empty((len(ids), *shape), dtype=out_dtype)
        for i, e in enumerate(ids):
            out[i] = self._decode(self.sources[_expert(layer, e, proj)], out_dtype)
        return out

    def read_window(self, name: str, index: tuple[slice, ...], *, dtype: str = "float32") -> np.ndarray:
        """``read(name, dtype=dtype)[index]`` for a tensor that is not a stacked routed expert, reading only the
        stored entries ``index`` covers (one step-1 slice per axis; a rank's rows of a split tensor).

        Plain tensors are sliced in their memory map; fp8 ones decode only the 32×32 scale blocks the window
        touches (§E.1) and crop them, so the whole tensor never exists on the host.
        """
        out_dtype = _out_dtype(name, dtype)
        if name == "head.weight" and self.cfg.tie_word_embeddings:
            name = "embed.weight"
        if _packed(name) is not None or _stacked(name)[0] is not None:
            raise ValueError(f"{name} is a stacked routed-expert tensor: read it with read(name, experts=...)")
        if self._as_stored_fp8(name):
            return self._read_fp8(name, index)
        if name not in self.sources:
            raise KeyError(f"{name} is not a tensor of this model")
        src = self.sources[name]
        shape = _logical_shape(src)
        bounds = []
        for axis, n in enumerate(shape):
            s = index[axis] if axis < len(index) else slice(None)
            lo, hi, step = s.indices(n)
            if step != 1:
                raise ValueError(f"read_window takes step-1 slices, not {s}")
            bounds.append((lo, max(lo, hi)))
        if src.codec == "fp8":
            return self._fp8_window(src, bounds, out_dtype)
        if src.codec == "fp4":  # only routed experts are fp4 in the release: decode whole, then cut
            return self._decode(src, out_dtype)[tuple(slice(lo, hi) for lo, hi in bounds)]
        return np.asarray(self._files.array(src.weight)[tuple(slice(lo, hi) for lo, hi in bounds)], dtype=out_dtype)

    def _fp8_window(self, src: Source, bounds: list[tuple[int, int]], out_dtype) -> np.ndarray:
        """The window ``bounds`` of an fp8 tensor: its covering 32×32 blocks decoded, then cropped."""
        block = formats.BLOCK
        lead = tuple(slice(lo, hi) for lo, hi in bounds[:-2])
        wide, crop, scale_window = [], [], []
        for (lo, hi), n in zip(bounds[-2:], src.weight.shape[-2:]):
            start, stop = lo - lo % block, min(-(-hi // block) * block, n)
            wide.append(slice(start, stop))
            crop.append(slice(lo - start, hi - start))
            scale_window.append(slice(start // block, -(-stop // block)))
        codes = self._files.array(src.weight)[(*lead, *wide)]
        scale = self._files.array(src.scale)[(*lead, *scale_window)]
        return formats.fp8_dequantize(codes, scale, dtype=out_dtype)[(..., *crop)]
    def _as_stored_fp8(self, name: str) -> bool:
        """True for an fp8 dense matrix's codes or ``.scale`` read as stored (``dense_format="fp8"``)."""
        return self.dense_format == "fp8" and param_specs.is_fp8_dense(name)

    def _read_fp8(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """The e4m3 codes (``….weight``) or ue8m0 scale bytes uint8 (``….scale``) of an fp8 dense matrix as stored,
        ``index`` (basic slices) of them."""
        src = self.sources[name.removesuffix(".scale") + ".weight" if name.endswith(".scale") else name]
        if src.codec != "fp8":
            raise CheckpointError(f"tensor {src.weight.name} is stored as {src.weight.dtype}, not fp8: it cannot be "
                                  f"held as fp8 dense weights")
        if name.endswith(".weight"):
            return np.asarray(self._files.array(src.weight)[index])
        raw = self._files.array(src.scale)[index]
        return raw.view(np.uint8) if raw.dtype.itemsize == 1 else _ue8m0_bytes(raw, src.scale.name)

    def read_table(self, name: str, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """An engram table as stored (``…engram.embed.weight``: e4m3 ``[rows, d]``; ``…engram.embed.scale``:
        ue8m0 bytes uint8 ``[rows, d/32]``), memory-mapped: ``rows`` picks rows without reading the rest."""
        src = self.sources[name.removesuffix(".scale") + ".weight" if name.endswith(".scale") else name]
        if name.endswith(".scale"):
            raw = self._files.array(src.scale)
            raw = raw if rows is None else raw[rows]
            return raw.view(np.uint8) if raw.dtype.itemsize == 1 else _ue8m0_bytes(raw, src.scale.name)
        raw = self._files.array(src.weight)
        return np.asarray(raw if rows is None else raw[rows])

    def _read_packed(self, layer: int | str, proj: str, part: str, experts) -> np.ndarray:
        """Stacked fp4 codes or ue8m0 scale bytes of the chosen experts, uint8 ``[len(experts), out, ·]``."""
        ids = range(param_specs.n_experts(self.cfg, layer))
        ids = ids[experts] if isinstance(experts, slice) else (ids if experts is None else list(experts))
        parts = []
        for e in ids:
            src = self.sources[_expert(layer, e, proj)]
            if src.codec != "fp4":
                raise CheckpointError(f"tensor {src.weight.name} is stored as {src.weight.dtype}, not packed fp4: "
                                      f"it cannot be held as fp4 experts")
            raw = self._files.array(src.weight if part == "codes" else src.scale)
            parts.append(raw.view(np.uint8) if raw.dtype.itemsize == 1 else _ue8m0_bytes(raw, src.scale.name))
        shape = param_specs.packed_expert_shapes((0, *_logical_shape(
            self.sources[_expert(layer, 0, proj)])))[part][1:]
        out = np.empty((len(parts), *shape), np.uint8)
        for i, p in enumerate(parts):
            out[i] = p
        return out

    def iter_tensors(self, *, dtype: str = "float32", progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(model name, array)`` for every model tensor, one at a time, in inventory order."""
        names = list(self.model_shapes)
        show = progress and self.nbytes >= PROGRESS_BYTES
        if not show:
            for name in names:
                yield name, self.read(name, dtype=dtype)
            return

        columns = (TextColumn("loading {task.fields[what]}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeRemainingColumn())
        with Progress(*columns, transient=True) as bar:
            task = bar.add_task("load", total=len(names), what=self.path.name)
            for name in names:
                yield name, self.read(name, dtype=dtype)
                bar.update(task, advance=1)

    def _decode(self, src: Source, out_dtype) -> np.ndarray:
        w = self._files.array(src.weight)
        if src.codec == "plain":
            return np.asarray(w, dtype=out_dtype)
        s = self._files.array(src.scale)
        if src.codec == "fp8":
            return formats.fp8_dequantize(w, s, dtype=out_dtype)
        return formats.fp4_dequantize(w, s, dtype=out_dtype)


def _out_dtype(name: str, dtype: str):
    if dtype == "float32":
        return np.float32
    if dtype == "bfloat16":
        return np.float32 if param_specs.model_dtype_kind(name) == "f32" else ml_dtypes.bfloat16
    raise ValueError(f"dtype must be 'float32' or 'bfloat16', not {dtype!r}")


def _packed(name: str) -> tuple[int | str, str, str] | None:
    """``layers.L.ffn.experts.wN.codes|scales`` → (L, "wN", part) (a DSpark stage: ("mtp.s", ...)); None for any
    other name."""
    parts = name.split(".")
    if (len(parts) == 6 and parts[0] in ("layers", "mtp") and parts[2:4] == ["ffn", "experts"]
            and parts[4] in ("w1", "w2", "w3") and parts[5] in param_specs.PACKED_PARTS):
        return _owner(parts), parts[4], parts[5]
    return None


def _owner(parts: list[str]) -> int | str:
    """A layer index, or a DSpark stage as ``"mtp.s"`` (`param_specs.expert_name`'s first item)."""
    return int(parts[1]) if parts[0] == "layers" else f"mtp.{parts[1]}"


def _expert(layer: int | str, e: int, proj: str) -> str:
    """The official name of routed expert ``e``'s ``proj`` in ``layer`` (or stage ``"mtp.s"``)."""
    owner = layer if isinstance(layer, str) else f"layers.{layer}"
    return f"{owner}.ffn.experts.{e}.{proj}.weight"


def _ue8m0_bytes(scale: np.ndarray, name: str) -> np.ndarray:
    """Float scales (powers of two, §G.12) → ue8m0 bytes; refuses a scale that is not a power of two."""
    try:
        return formats.ue8m0_from_scales(scale)
    except ValueError as e:
        raise CheckpointError(f"tensor {name}: fp4 {e}") from None


def _stacked(name: str) -> tuple[int | str | None, str | None]:
    parts = name.split(".")
    if (len(parts) == 6 and parts[0] in ("layers", "mtp") and parts[2:4] == ["ffn", "experts"]
            and parts[4] in ("w1", "w2", "w3")):
        return _owner(parts), parts[4]
    return None, None


def _logical_shape(src: Source) -> tuple[int, ...]:
    if src.codec == "fp4":
        *lead, out, half = src.weight.shape
        return (*lead, out, 2 * half)
    return src.weight.shape


# ------------------------------------------------------------------------------------------------- opening
def open_checkpoint(path: str | Path, cfg: ModelConfig | None = None, *,
                    expert_format: str = "dequantized", vision: bool = False, engram: bool = True,
                    dspark: bool = False, dense_format: str = "dequantized") -> Checkpoint:
    """Validate the directory against the inventory of ``cfg`` (default: its ``config.json``).

    ``expert_format="fp4"``: routed experts are read packed; every one must be stored as fp4 (refused by name).
    ``dense_format="fp8"``: the fp8 dense matrices are read as stored; every one must be stored as fp8 (refused by
    name).
    ``vision=True``: the image path's tensors (docs/VISION.md §V.F) are part of the inventory (missing or mis-shaped
    ones refused by name) instead of skipped; the config must have a ``vision_config``.
    ``engram=False``: the engram layers' tensors are skipped (the output is then not the model's).
    ``dspark=True``: the DSpark stages' ``mtp.*`` tensors are part of the inventory (the config must have stages).
    """
    if expert_format not in param_specs.EXPERT_FORMATS:
        raise CheckpointError(f"expert format {expert_format!r} is not one of {param_specs.EXPERT_FORMATS}")
    if dense_format not in param_specs.DENSE_FORMATS:
        raise CheckpointError(f"dense format {dense_format!r} is not one of {param_specs.DENSE_FORMATS}")
    path = checkpoint_dir(path)
    if cfg is None:
        cfg = _read_config(path)
    if vision and cfg.vision is None:
        raise CheckpointError(f"{path / 'config.json'} has no vision_config: this checkpoint cannot read images")
    stored = _stored_tensors(path)
    dspark = dspark and cfg.num_nextn_predict_layers > 0
    specs = {s.name: s for s in param_specs.release_tensors(cfg, vision=vision, engram=engram, dspark=dspark)}
    skipped: dict[str, list[str]] = {}
    for name, t in stored.items():
        if name in specs or name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in specs:
            continue
        reason = param_specs.skip_reason(name)
        if reason is not None:
            skipped.setdefault(reason, []).append(name)
        elif not (name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in specs):
            raise CheckpointError(f"unexpected tensor {name} in {t.file.name}: not part of the DeepSeek-V4.1 "
                                  f"text model for this config")
    sources = {name: _source(spec, stored) for name, spec in specs.items()}
    lines = [_skipped_line(reason, len(names), cfg) for reason, names in skipped.items()]
    lines += [f"not run by this engine yet: {feature}" for feature in cfg.unsupported_features()
              if (engram or not feature.startswith("engram")) and not (dspark and feature.startswith("DSpark"))]
    if expert_format == "fp4":
        for name, src in sources.items():
            if param_specs.expert_name(name) is not None and src.codec != "fp4":
                raise CheckpointError(f"expert format fp4 needs routed experts stored as packed fp4; tensor {name} "
                                      f"in {src.weight.file.name} is {src.weight.dtype}")
    if dense_format == "fp8":
        for name, src in sources.items():
            if param_specs.is_fp8_dense(name) and src.codec != "fp8":
                raise CheckpointError(f"dense format fp8 needs the dense matrices stored as fp8; tensor {name} in "
                                      f"{src.weight.file.name} is {src.weight.dtype}")
    return Checkpoint(path, cfg, sources, lines, expert_format, vision, engram, dspark, dense_format)


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a checkpoint directory, or a CheckpointError saying it is missing or a file."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"checkpoint {path} is a file, not a directory: give the directory that holds "
                              f"config.json and the safetensors shards")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    return path


def _skipped_line(reason: str, count: int, cfg: ModelConfig) -> str:
    """The note for tensors of the checkpoint this run leaves out (``param_specs.skip_reason``'s ``reason``): parts
    it does not use, never parts it cannot run."""
    line = f"skipped {count} tensors not used by this run: {reason}"
    if cfg.vision is None and ("image" in reason or "vision" in reason):
        line += " (the config has no vision_config: a text-only checkpoint)"
    return line


def _read_config(path: Path) -> ModelConfig:
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        return ModelConfig.from_json(path / "config.json")
    except ConfigError as e:  # names the file
        raise CheckpointError(str(e)) from None


def _stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of the directory, from the index (or the single file) and the shard headers."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(read_text(index, "safetensors index"))["weight_map"]
        except TextFileError as e:
            raise CheckpointError(str(e)) from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    elif (path / SINGLE_FILE).is_file():
        weight_map = {name: SINGLE_FILE for name in read_header(path / SINGLE_FILE)}
    else:
        raise CheckpointError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    headers: dict[str, dict[str, StoredTensor]] = {}
    out = {}
    for name, file in weight_map.items():
        if file not in headers:
            if not (path / file).is_file():
                raise CheckpointError(f"{INDEX_FILE} lists {name} in {file}, which does not exist")
            headers[file] = read_header(path / file)
        if name not in headers[file]:
            raise CheckpointError(f"{INDEX_FILE} lists {name} in {file}, but that file does not hold it")
        out[name] = headers[file][name]
    return out


def _source(spec: param_specs.TensorSpec, stored: dict[str, StoredTensor]) -> Source:
    """Check one logical tensor's stored form (plain, fp8 or fp4) and shapes; name it in any refusal."""
    name, shape = spec.name, spec.shape
    if name not in stored:
        raise CheckpointError(f"missing tensor {name} (expected shape {list(shape)})")
    w = stored[name]
    scale_name = name.removesuffix(".weight") + ".scale"
    scale = stored.get(scale_name) if name.endswith(".weight") else None
    if spec.stored == param_specs.TABLE_KIND:  # engram table: held as stored, so only e4m3 rows are accepted
        if w.dtype != "F8_E4M3":
            raise CheckpointError(f"engram table {name} in {w.file.name} has dtype {w.dtype}; expected F8_E4M3 "
                                  f"rows with a ue8m0 {scale_name} (docs/MODEL.md §B.12)")
        codec, want_w, want_s = param_specs.TABLE_KIND, shape, param_specs.fp4_scale_shape(shape)
    elif w.dtype in _FLOAT_DTYPES:
        codec, want_w, want_s = "plain", shape, None
    elif w.dtype == "F8_E4M3" and spec.stored in param_specs.QUANT_KINDS:
        codec, want_w, want_s = "fp8", shape, param_specs.fp8_scale_shape(shape)
    elif w.dtype == "I8" and spec.stored == "fp4":
        codec, want_w, want_s = "fp4", param_specs.fp4_packed_shape(shape), param_specs.fp4_scale_shape(shape)
    else:
        allowed = "a float" + (", F8_E4M3" if spec.stored in param_specs.QUANT_KINDS else "") + (
            " or I8 (packed fp4)" if spec.stored == "fp4" else "")
        raise CheckpointError(f"tensor {name} in {w.file.name} has dtype {w.dtype}; expected {allowed}")
    if w.shape != want_w:
        raise CheckpointError(f"tensor {name} in {w.file.name} has shape {list(w.shape)}; expected "
                              f"{list(want_w)}" + ("" if codec == "plain" else f" ({codec})"))
    if want_s is None:
        if scale is not None:
            raise CheckpointError(f"tensor {scale_name} in {scale.file.name} scales {name}, which is stored "
                                  f"as plain {w.dtype}")
        return Source(w, None, codec)
    if scale is None:
        raise CheckpointError(f"missing tensor {scale_name} (the {codec} scale of {name})")
    if scale.shape != want_s or scale.dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"tensor {scale_name} in {scale.file.name} is {scale.dtype} {list(scale.shape)}; "
                              f"expected ue8m0 {list(want_s)}")
    return Source(w, scale, codec)


# -------------------------------------------------------------------------------------------------- loading
def iter_tensors(path: str | Path, cfg: ModelConfig | None = None, *, dtype: str = "float32",
                 progress: bool = True, expert_format: str = "dequantized",
                 vision: bool = False, engram: bool = True, dspark: bool = False,
                 dense_format: str = "dequantized") -> Iterator[tuple[str, np.ndarray]]:
    """Validate, then yield ``(model name, array)`` one tensor at a time (see `Checkpoint.read`)."""
    yield from open_checkpoint(path, cfg, expert_format=expert_format, vision=vision, engram=engram,
                               dspark=dspark, dense_format=dense_format).iter_tensors(dtype=dtype, progress=progress)


def load_checkpoint(path: str | Path, cfg: ModelConfig | None = None, *, dtype: str = "float32",
                    progress: bool = True, expert_format: str = "dequantized", vision: bool = False,
                    engram: bool = True, dspark: bool = False, dense_format: str = "dequantized"
                    ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``(cfg, {model name: array})`` for the whole text model, dequantised to ``dtype``.

    ``dtype``: "float32" (default) or "bfloat16" (ml_dtypes; the f32 parameters of §B.1 stay float32). With
    ``progress``, the skipped parts are printed to stderr and large loads show a progress bar.
    ``expert_format="fp4"``: routed experts stay packed (uint8 ``.codes`` / ``.scales``, see `open_checkpoint`).
    ``vision=True``: the image path's tensors are returned too (see `open_checkpoint`).
    ``dense_format="fp8"``: the fp8 dense matrices stay as stored (e4m3 codes, ``.scale`` bytes; `open_checkpoint`).
    """
    ckpt = open_checkpoint(path, cfg, expert_format=expert_format, vision=vision, engram=engram, dspark=dspark,
                           dense_format=dense_format)
    if progress:
        for line in ckpt.skipped:
            print(f"{ckpt.path.name}: {line}", file=sys.stderr)
    flat = dict(ckpt.iter_tensors(dtype=dtype, progress=progress))
    return ckpt.cfg, flat

