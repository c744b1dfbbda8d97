"""Load a running `python -m dsv41_jax.serve` (or start one) and print throughput and latency percentiles.

For each concurrency C (default 1, 8, 32): C client streams, each sending ``--rounds`` streaming completions one
after another (prompts of ``--prompt-tokens`` random ids, ``--max-tokens`` new tokens, greedy). Per request:
TTFT = arrival of the first text chunk after sending; ITL = (last chunk − first chunk) / (tokens − 1), the mean
gap between its tokens (chunks carry text, and a token may carry none: per-chunk gaps would be biased). Printed
per C: requests answered / refused (503), generated tokens per second of wall time (all streams together),
TTFT and ITL p50 / p90 / p99, and the p99 / max of the gaps between consecutive text chunks of a stream (a stall
that a mean hides).

Workloads (``--workloads``, default ``plain``): ``plain`` as above; ``long``: the same streams while a long prompt
(``--long-tokens`` random ids, 1 new token) arrives every ``--long-every`` seconds (the long requests' own TTFT
is printed apart: the rows count the short streams only); ``prefix``: every prompt starts with the same
``--prefix-tokens`` ids (a shared system prompt), then its own ``--prompt-tokens``. ``long`` loads the server's
prefill budget (``--max-prefill-tokens``: the streams' gaps while a long prompt prefills), ``prefix`` its prefix
cache: each row also prints the prefix cache's hit rate over the row (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``, in prompt tokens; the cache keeps whole blocks of ``--max-prefill-tokens``,
so a shared prefix shorter than one block is never a hit) and the prompt tokens the server's prefills computed.

  python benchmarks/serve_load.py --url http://127.0.0.1:8000
  python benchmarks/serve_load.py --spawn --workloads plain,long,prefix -- --max-batch 32 --max-context 8192
  python benchmarks/serve_load.py --spawn -- --max-batch 32 --max-context 1024      # start the server too

``--spawn -- ARGS``: runs ``python -m dsv41_jax.serve --port 0 ARGS``, waits for its start-up line, loads it, stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np


def percentiles(values) -> str:
    if not values:
        return "-"
    p = np.percentile(np.asarray(values) * 1e3, [50, 90, 99])
    return " / ".join(f"{v:.1f}" for v in p)


async def one_request(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    gaps = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                first = first or last
    out = {"status": 200, "tokens": tokens, "ttft": (first or time.perf_counter()) - start, "gaps": gaps}
    if first is not None and tokens > 1:
        out["itl"] = (last - first) / (tokens - 1)
    return out


async def load(url: str, concurrency: int, rounds: int, prompt_tokens: int, max_tokens: int, seed: int,
               workload: str = "plain", long_tokens: int = 4000, long_every: float = 3.0,
               prefix_tokens: int = 2000) -> dict:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 500, prefix_tokens).tolist() if workload == "prefix" else []
    results, long_results = [], []
    running = asyncio.Event()

    async def stream(c: int, http):
        for k in range(rounds):
            prompt = prefix + rng.integers(3, 500, prompt_tokens).tolist()
            results.append(await one_request(http, prompt, max_tokens))

    async def long_prompts(http):  # one long prompt every long_every seconds while the streams run
        while not running.is_set():
            prompt = rng.integers(3, 500, long_tokens).tolist()
            long_results.append(await one_request(http, prompt, 1))
            try:
                await asyncio.wait_for(running.wait(), long_every)
            except asyncio.TimeoutError:
                pass

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        longs = asyncio.create_task(long_prompts(http)) if workload == "long" else None
        await asyncio.gather(*(stream(c, http) for c in range(concurrency)))
        wall = time.perf_counter() - start
        running.set()
        if longs is not None:
            await longs
    ok = [r for r in results if r["status"] == 200]
    tokens = sum(r["tokens"] for r in ok)
    gaps = [g for r in ok for g in r["gaps"]]
    return {"workload": workload, "concurrency": concurrency, "requests": len(results), "ok": len(ok),
            "refused": sum(r["status"] == 503 for r in results), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "ttft_ms": percentiles([r["ttft"] for r in ok]),
            "itl_ms": percentiles([r["itl"] for r in ok if "itl" in r]),
            "gap_ms": f"{np.percentile(gaps, 99) * 1e3:.1f} / {max(gaps) * 1e3:.1f}" if gaps else "-",
            "long_requests": len(long_results),
            "long_ttft_ms": percentiles([r["ttft"] for r in long_results if r["status"] == 200])}


def counters(url: str) -> dict[str, float]:
    """The server's prefix cache counters and computed prefill rows (0 where a server lacks them)."""
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "dsv41_prefill_rows_total")
    text = httpx.get(url + "/metrics").text
    return {n: sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((n + " ", n + "{")))
            for n in names}


def spawn(server_args: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dsv41_jax.serve", "--port", "0", *server_args]
    print("starting:", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print("  server:", line.rstrip(), file=sys.stderr, flush=True)
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            threading.Thread(target=lambda: [print("  server:", x.rstrip(), file=sys.stderr) for x in proc.stdout],
                             daemon=True).start()
            return proc, match.group(1)
    raise SystemExit(f"the server exited ({proc.wait()}) before listening")


def main() -> int:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--spawn", action="store_true", help="start the server (its flags after --)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts (default 1,8,32)")
    p.add_argument("--rounds", type=int, default=4, help="requests per stream (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workloads", default="plain", help="comma-separated: plain, long, prefix (default plain)")
    p.add_argument("--long-tokens", type=int, default=4000, help="the long prompt of 'long' (default 4000)")
    p.add_argument("--long-every", type=float, default=3.0, help="seconds between long prompts (default 3)")
    p.add_argument("--prefix-tokens", type=int, default=2000, help="the shared prefix of 'prefix' (default 2000)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    a = p.parse_args(argv)
    unknown = set(a.workloads.split(",")) - {"plain", "long", "prefix"}
    if unknown:
        p.error(f"--workloads: unknown {', '.join(sorted(unknown))} (plain, long, prefix)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still stops the spawned server (finally)
    proc = None
    url = a.url
    if a.spawn:
        proc, url = spawn(server_args)
    try:
        asyncio.run(load(url, 1, 1, a.prompt_tokens, 4, 99))  # warm-up
        rows = []
        print(f"{'workload':>8} {'streams':>7} {'requests':>8} {'ok':>4} {'503':>4} {'tokens':>7} {'wall s':>7} "
              f"{'tok/s':>8} {'TTFT ms p50/p90/p99':>22} {'ITL ms p50/p90/p99':>22} {'gap ms p99/max':>15} "
              f"{'prefix hit':>10} {'prefilled':>9}")
        for w, workload in enumerate(a.workloads.split(",")):
            for c in (int(x) for x in a.concurrency.split(",")):
                before = counters(url)
                seed = 1000 * (w + 1) + c  # rows share no prompts (a prefix hit across rows would flatter one)
                row = asyncio.run(load(url, c, a.rounds, a.prompt_tokens, a.max_tokens, seed, workload,
                                       a.long_tokens, a.long_every, a.prefix_tokens))
                after = counters(url)
                queries, hits, prefilled = (after[n] - before[n] for n in after)
                row["prefix_hit"] = f"{hits / queries:.1%}" if queries else "-"
                row["prefilled_tokens"] = int(prefilled)
                rows.append(row)
                print(f"{workload:>8} {c:>7} {row['requests']:>8} {row['ok']:>4} {row['refused']:>4} "
                      f"{row['tokens']:>7} {row['wall_s']:>7.2f} {row['tok_s']:>8.1f} {row['ttft_ms']:>22} "
                      f"{row['itl_ms']:>22} {row['gap_ms']:>15} {row['prefix_hit']:>10} {row['prefilled_tokens']:>9}",
                      flush=True)
                if workload == "long":
                    print(f"{'':>8} {row['long_requests']} long prompts of {a.long_tokens} tokens beside them, "
                          f"TTFT ms p50/p90/p99 {row['long_ttft_ms']}", flush=True)
        print(httpx.get(url + "/metrics").text.count("\n"), "metric lines; server healthy:",
              httpx.get(url + "/health").json())
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
