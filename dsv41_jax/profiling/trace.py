"""Per-op and per-component time from a ``jax.profiler`` trace (stdlib only: the gzipped Perfetto JSON).

``jax.profiler.trace(dir, create_perfetto_trace=True)`` writes ``plugins/profile/<run>/*.xplane.pb`` (what
XProf / TensorBoard open) and ``perfetto_trace.json.gz`` (Chrome trace events). An event is an XLA op when its
``args.hlo_op`` (GPU kernels) or its name (CPU thunks) is an instruction of the traced program; its
component is the model source file (and line) in that instruction's metadata (``measure.hlo_sources``).
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OpTime:
    """``name``: HLO instruction; ``source``: model file:line; ``seconds``: per traced step; ``count``: launches."""

    name: str
    source: str
    seconds: float
    count: int


def perfetto_file(trace_dir: str | Path) -> Path | None:
    """The newest ``perfetto_trace.json.gz`` (or ``*.trace.json.gz``) under ``trace_dir``."""
    files = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz")) or sorted(Path(trace_dir).rglob("*.trace.json.gz"))
    return max(files, key=lambda p: p.stat().st_mtime) if files else None


def load_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def _device_events(events: list[dict]) -> tuple[int | None, list[dict]]:
    """(the first ``/device:`` process id or None, the complete events with a duration in it — all of them
    when the trace has no device process, as on CPU)."""
    device_pids = sorted((str(e.get("args", {}).get("name", "")), e["pid"]) for e in events
                         if e.get("ph") == "M" and e.get("name") == "process_name"
                         and "/device:" in str(e.get("args", {}).get("name", "")))
    keep_pid = device_pids[0][1] if device_pids else None
    return keep_pid, [e for e in events if e.get("ph") == "X" and "dur" in e
                      and (keep_pid is None or e.get("pid") == keep_pid)]


def _op_name(event: dict) -> str:
    return str(event.get("args", {}).get("hlo_op") or event.get("name", ""))


def _is_activity(event: dict) -> bool:
    """A kernel or a copy the device ran (not a span such as a whole module's execution on another line)."""
    args = event.get("args", {})
    name = str(event.get("name", "")).lower()
    return "kernel_details" in args or "memcpy_details" in args or name.startswith(("memcpy", "memset"))


def op_times(events: list[dict], sources: dict[str, str], steps: int, devices: int = 1) -> list[OpTime]:
    """Complete events of known HLO instructions, summed per instruction, per step and per device; slowest first.

    GPU: each kernel event names its instruction in ``args.hlo_op`` and sits in a ``/device:GPU:N`` process;
    only the first device's process is counted. CPU (simulated devices share one process): all XLA threads are
    counted and the sum divided by ``devices``.
    """
    keep_pid, kept = _device_events(events)
    share = 1 if keep_pid is not None else max(devices, 1)
    return _summed([(_op_name(e), e) for e in kept if _op_name(e) in sources], sources.get, max(steps, 1) * share)


def unattributed_times(events: list[dict], sources: dict[str, str], steps: int) -> list[OpTime]:
    """The first device's events that name no instruction of the program (GPU only; none on CPU), by event name,
    per step, slowest first: device copies (``MemcpyDtoD``; inside a command buffer ``memcpy128``), which the
    per-op table cannot show (e.g. a loop copying weights every step; docs/BENCHMARKS.md "A group scan's loop
    inside a loop")."""
    keep_pid, kept = _device_events(events)
    if keep_pid is None:
        return []
    named = [(str(e.get("name", "")), e) for e in kept if _op_name(e) not in sources and _is_activity(e)]
    return _summed(named, lambda _: "", steps)


def _summed(named: list[tuple[str, dict]], source_of, per: int) -> list[OpTime]:
    """(name, event) pairs summed by name, divided by ``per`` (steps, times devices sharing a process), slowest
    first."""
    totals: dict[str, list[float]] = {}
    for name, e in named:
        slot = totals.setdefault(name, [0.0, 0])
        slot[0] += float(e["dur"]) * 1e-6  # µs -> s
        slot[1] += 1
    per = max(per, 1)
    ops = [OpTime(n, source_of(n), t / per, c // per) for n, (t, c) in totals.items()]
    return sorted(ops, key=lambda o: -o.seconds)


@dataclass(frozen=True)
class Timeline:
    """The first device's work per call, from its activities (kernels and copies): ``busy_s`` inside them (overlaps
    counted once), ``gap_s`` between them within a call (``long_gap_s`` of it in gaps over 5 µs: not the queue's
    own latency), ``between_s`` from one call's last activity to the next call's first (the host's launch of the
    next call when it is late: a profiler slows the host, so under a trace this one grows), ``copy_s`` in copy
    kernels and memcpys, ``activities`` per call."""

    busy_s: float
    gap_s: float
    long_gap_s: float
    copy_s: float
    activities: int
    between_s: float = 0.0


def device_timeline(events: list[dict], calls: int, skip: int = 1) -> Timeline | None:
    """The device's timeline over the last ``calls - skip`` of ``calls`` traced calls of one program (the first
    ``skip`` are warm-up, apart from the rest by a host wait), per call; None without a device process (CPU).
    Meant for traces with XLA's command buffers on, as the program runs: inside a CUDA graph the kernels are
    named by the graph, not by op, but their times and the gaps between them are the step's own.

    The warm-up ends at the trace's longest idle stretch (the host's wait on it; the first chained call then
    waits its whole dispatch, later ones only what the device has not already hidden), and may carry extra
    activities (its arguments' host-to-device copies); the calls after it are alike, so each has 1/counted of
    their activities."""
    keep_pid, kept = _device_events(events)
    if keep_pid is None:
        return None
    acts = sorted((e for e in kept if _is_activity(e)), key=lambda e: float(e["ts"]))
    if skip > 0 and len(acts) > 1:
        idle = _idle_stretches(acts)[1]
        if idle:  # the warm-up ends at the longest idle stretch
            acts = acts[max(idle, key=lambda stretch: stretch[1])[0]:]
    counted = max(calls - skip, 1)
    per = len(acts) // counted
    acts = acts[len(acts) - counted * per:]
    if not acts:
        return None
    busy, idle = _idle_stretches(acts)
    between = sum(us for i, us in idle if i % per == 0)  # before a call's first activity: between two calls
    inside = [us for i, us in idle if i % per]
    copy = sum(float(e["dur"]) for e in acts if str(e.get("name", "")).lower().startswith("memcpy"))
    scale = 1e-6 / counted  # µs a call -> s
    return Timeline(busy * scale, sum(inside) * scale, sum(us for us in inside if us > 5.0) * scale, copy * scale,
                    per, between * 1e-6 / max(counted - 1, 1))  # counted calls have counted - 1 boundaries


def _idle_stretches(acts: list[dict]) -> tuple[float, list[tuple[int, float]]]:
    """(µs with some activity running, [(index of the activity that ends an idle stretch, the stretch's µs)]) of
    activities sorted by start; overlapping activities count once."""
    busy, idle = 0.0, []
    start, end = float(acts[0]["ts"]), float(acts[0]["ts"]) + float(acts[0]["dur"])
    for i in range(1, len(acts)):
        t0, t1 = float(acts[i]["ts"]), float(acts[i]["ts"]) + float(acts[i]["dur"])
        if t0 > end:  # idle until t0: close the merged interval
            busy += end - start
            idle.append((i, t0 - end))
            start, end = t0, t1
        else:
            end = max(end, t1)
    return busy + end - start, idle


def by_component(ops: list[OpTime]) -> list[tuple[str, float]]:
    """Seconds per model source file (attention.py, moe.py, indexer.py, hc.py, ...), largest first."""
    out: dict[str, float] = {}
    for op in ops:
        key = op.source.split(" ")[-1].split(":", 1)[0].split("→", 1)[0] or "other"  # "xla→shape": "xla"
        out[key] = out.get(key, 0.0) + op.seconds
    return sorted(out.items(), key=lambda kv: -kv[1])


# The model's parts, each named by substrings of an op's ``file:function`` label (first match wins: a compressor
# op inside ``Attention._compress`` is the compressor's, not attention's).
PARTS = (
    ("indexer", ("index_topk", "Indexer.", "indexer.py:", "kernel.py:_maxima", "kernel.py:_row_maxima",
                 "kernel.py:_rescore", "kernel.py:best_groups", "kernel.py:top_k_indices", "kernel.py:_picks",
                 "kernel.py:_score_operands", "xla.py:select", "xla.py:scores", "radix_top_k", "block_maxima",
                 "candidate_mask")),
    ("compressor", ("Compressor.", "write_rows", "_take_rows", "Attention._compress")),
    ("hc", ("hc.py:", "comb_pallas", "norms.py:rms_scale")),
    ("moe", ("kernel.py:gate_up", "kernel.py:down", "moe.py:", "grouping.py:", "clamped_swiglu")),
    ("attention", ("sparse_attention", "attention.py:")),
    ("head", ("Head.",)),
    ("embedding", ("Embed.",)),
    ("engram", ("engram",)),
    ("norms", ("norms.py:",)),
)


def part_of(source: str) -> str:
    """The model part (``PARTS``) an op's source label belongs to; "other" when none matches."""
    label = source.split(" ")[-1]
    return next((part for part, keys in PARTS if label and any(k in label for k in keys)), "other")


def by_part(ops: list[OpTime]) -> list[tuple[str, float]]:
    """Seconds per model part (moe, attention, indexer, hc, compressor, head, ...), largest first."""
    out: dict[str, float] = {}
    for op in ops:
        part = part_of(op.source)
        out[part] = out.get(part, 0.0) + op.seconds
    return sorted(out.items(), key=lambda kv: -kv[1])


# --------------------------------------------------------------------------------------- HLO source metadata
_HELPERS = ("norms.py", "quant.py", "rope.py")  # shared helpers: attribute their ops to the caller
_WRAPPERS = ("transformer.py", "prepare.py", "measure.py")


def instruction_sources(hlo_text: str) -> dict[str, str]:
    """Instruction name → ``file:function`` label of the model code that made it ("" when its frames hold no model
    code; ``xla→<shape>`` when it has none: XLA made it).

    The optimised HLO text ends its header with ``FileNames``, ``FunctionNames``, ``FileLocations`` and
    ``StackFrames`` tables; each instruction's ``metadata={... stack_frame_id=N}`` points into them (a printed
    ``parent_frame_id`` P means frame P − 1; 0 = none). An ``op_name`` with a ``layers.N`` / ``layer_N`` scope
    adds the layer to the label, and its sublayer when the op sits in the model's ``attn`` / ``moe`` scope
    (``Transformer`` names ``layer_N/attn`` and ``layer_N/moe``): e.g. ``L3/moe moe.py:_routed``.
    """
    tables = _tables(hlo_text)
    frames = _frames(tables)
    out = {}
    for line in hlo_text.splitlines():
        line = line.strip()
        if not line.startswith(("%", "ROOT %")) or " = " not in line:
            continue
        name = line.removeprefix("ROOT ").split(" ", 1)[0].lstrip("%")
        frame = _int_after(line, "stack_frame_id=")
        label = source_label(frames, frame) if frame else _xla_made(line)
        scope = _layer_scope(line)
        out[name] = f"{scope} {label}".strip() if scope is not None else label
    return out


def _xla_made(line: str) -> str:
    """The label of an instruction without a stack frame (XLA made it, e.g. a concatenation of weights it added):
    ``xla→`` and its result shape, layout dropped (``xla→bf16[1792,5120]``), which is often enough to name it."""
    result = line.split(" = ", 1)[1]
    shape = "tuple" if result.startswith("(") else re.sub(r"\{[^}]*\}", "", result.split(" ", 1)[0])
    return f"xla→{shape}"


def source_label(frames: dict[int, tuple[str, str, int]], frame: int) -> str:
    """``file:function`` of the innermost model frame that is not a shared helper (helpers name their caller)."""
    chain = []
    seen = set()
    while frame and frame in frames and frame not in seen:
        seen.add(frame)
        file, function, parent = frames[frame]
        chain.append((file, function))
        frame = parent
    model = [(f, fn) for f, fn in chain if f.endswith(".py") and not f.endswith(_WRAPPERS)
             and ("/model/" in f or "pallas_kernels" in f or "/sharding/" in f)]
    for file, function in model:
        base = file.rsplit("/", 1)[-1]
        if base not in _HELPERS:
            return f"{base}:{function}"
    if model:
        return f"{model[0][0].rsplit('/', 1)[-1]}:{model[0][1]}"
    heads = [(f, fn) for f, fn in chain if f.endswith("transformer.py")]
    return f"transformer.py:{heads[0][1]}" if heads else ""


def _tables(text: str) -> dict[str, dict[int, str]]:
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines()[:200000]:
        word = line.strip()
        if word in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(word, {})
            continue
        if current is None:
            continue
        head = word.split(" ", 1)
        if len(head) == 2 and head[0].isdigit():
            current[int(head[0])] = head[1]
        elif word.startswith(("ENTRY", "%", "HloModule")) or (word and not head[0].isdigit()):
            current = None
    return tables


def _frames(tables: dict[str, dict[int, str]]) -> dict[int, tuple[str, str, int]]:
    """frame id → (file, function, parent frame id or 0)."""
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations = {k: (_int_after(v, "file_name_id="), _int_after(v, "function_name_id="))
                 for k, v in tables.get("FileLocations", {}).items()}
    out = {}
    for k, v in tables.get("StackFrames", {}).items():
        file_id, function_id = locations.get(_int_after(v, "file_location_id="), (0, 0))
        out[k] = (files.get(file_id, ""), functions.get(function_id, ""),
                  max(_int_after(v, "parent_frame_id=") - 1, 0))
    return out


def _int_after(text: str, key: str) -> int:
    if key not in text:
        return 0
    digits = ""
    for ch in text.split(key, 1)[1]:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else 0


def _layer_scope(line: str) -> str | None:
    """``L<n>`` or ``L<n>/<sublayer>`` (a scanned run: ``L<a>-<b>``, a group scan ``L<a>_<b>_…``) from the
    instruction's ``op_name`` scopes; None outside any layer."""
    if 'op_name="' not in line:
        return None
    parts = line.split('op_name="', 1)[1].split('"', 1)[0].split("/")
    for i, part in enumerate(parts):
        m = re.fullmatch(r"(?:layers\.|layers_|layer_|layer)(\d+)([-_][\d_-]*)?", part)
        if m:
            sub = next((p for p in parts[i + 1:] if p in _SUBLAYERS), None)
            return f"L{int(m[1])}{m[2] or ''}" + (f"/{sub}" if sub else "")
    return None


_SUBLAYERS = ("attn", "moe")


def by_layer(ops: list[OpTime]) -> list[tuple[str, float]]:
    """Seconds per layer scope (``L0/attn``, ``L0/moe``, ``L1/attn``, ...) in layer order, then ``other``
    (embedding, final norm, head, and ops outside any layer scope)."""
    out: dict[str, float] = {}
    for op in ops:
        head = op.source.split(" ", 1)[0]
        key = head if re.fullmatch(r"L\d+(?:-\d+)?(?:/\w+)?", head) else "other"
        out[key] = out.get(key, 0.0) + op.seconds

    def order(kv):
        if kv[0] == "other":
            return (1 << 30, "")
        number, _, sub = kv[0][1:].partition("/")
        return (int(number.split("-")[0]), sub)

    return sorted(out.items(), key=order)
