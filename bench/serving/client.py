"""Serving load generator for any OpenAI-compatible streaming ``/v1/completions`` endpoint.

Metrics and JSON field names follow SGLang's ``bench_serving``: TTFT, ITL, TPOT and E2E latency
(mean/median/std/p90/p95/p99 in ms, e.g. ``median_ttft_ms``, ``mean_itl_ms``, ``p99_tpot_ms``),
``completed``, ``duration``, ``total_input_tokens``, ``total_output_tokens``,
``request_throughput``, ``input_throughput``, ``output_throughput``, ``total_throughput``
(alias ``total_token_throughput``, vLLM's name) and ``concurrency`` (sum of latencies /
duration).

Definitions: TTFT = request sent -> first non-empty text chunk. ITL = gaps between successive
non-empty chunks: one sample per streamed chunk, however many tokens it carries, which is how
SGLang's ``bench_serving`` counts ITL for OpenAI-compatible endpoints (vLLM's
``benchmark_serving`` does the same). TPOT = (E2E - TTFT) / (output tokens - 1) per request
with > 1 output token: a per-token figure. Output tokens are the server's
``usage.completion_tokens`` (requested with ``stream_options.include_usage``), or the number of
text chunks when a server sends no usage. ``total_chunks`` counts non-empty text chunks and
``mean_tokens_per_chunk`` = total output tokens / total chunks.

ITL and TPOT differ when chunks carry several tokens: jfp8kv on a GPU runs 8 decode steps per
dispatch (``decode_steps``) and streams each dispatch's text as one chunk, so its ITL is about
8x its TPOT (``mean_tokens_per_chunk`` ~ 8), while a server that streams every token has
ITL ~ TPOT. Compare servers on TPOT; compare ITL only between runs of the same server.

Prompts: random token ids sent as a list (``"prompt": [ids]``), so lengths are exact.
Length convention (as SGLang's random dataset): with ``--random-input-len L`` and
``--random-range-ratio r``, each prompt length is drawn uniformly from the integers
[max(1, int(L * r)), L]; the same for ``--random-output-len`` (sent as ``max_tokens``).
r = 1 (the default here; SGLang's default is 0) gives exactly L. Each request's reported
``usage.prompt_tokens`` is checked against its intended length; mismatches are counted
(``prompt_len_mismatches``) and warned about. With ``--ignore-eos`` every request should
produce exactly its ``max_tokens``; shortfalls are counted in ``output_len_mismatches``.

Shared-prefix workload (``--shared-prefix-groups G --shared-prefix-len L``): G random
L-token "system prompts"; request i belongs to group i % G (the order shuffled with
``--seed``) and sends its group's prefix followed by its own random question of
``--random-input-len`` tokens (``--random-range-ratio`` applies to the question), so G x
(num_prompts / G) requests share G prefixes. Warm-up requests get prompts of the same
length but no shared prefix, so they compile the same shapes without filling the prefix
cache. Each request's ``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field: prompt
tokens served from the server's prefix cache) is recorded: ``total_cached_tokens``,
``prefix_cache_hit_rate`` (cached / input tokens) and TTFT split into requests with a cache
hit (``*_ttft_hit_ms``) and without (``*_ttft_cold_ms``); these are None when the server
reports no cached tokens.

Token ids are drawn from ``--token-id-range LO HI`` (default 1000..30000, inside every common
vocabulary), or, with ``--tokenizer PATH``, from that tokenizer's non-special ids.

Arrivals: ``--request-rate inf`` sends everything at once; a finite rate draws Poisson
arrivals (exponential gaps, ``--seed``). ``--max-concurrency`` caps requests in flight.
``--warmup-requests`` are sent and awaited first, outside the timed window.
``--output-file`` appends one JSON line: the metrics, the arguments and the command line.

Examples::

    python -m bench.serving --port 8000 --num-prompts 200 --random-input-len 1024 \\
        --random-output-len 128 --max-concurrency 32 --ignore-eos --output-file out.jsonl
    # 32 groups x 16 requests sharing a 4096-token prefix, 256-token questions, 256 out
    python -m bench.serving --port 8000 --shared-prefix-groups 32 --shared-prefix-len 4096 \\
        --num-prompts 512 --random-input-len 256 --random-output-len 256 \\
        --max-concurrency 64 --ignore-eos --output-file out.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shlex
import sys
import time

import numpy as np

try:
    import aiohttp
except ImportError:  # httpx is the fallback transport
    aiohttp = None
try:
    import httpx
except ImportError:
    httpx = None


@dataclasses.dataclass
class RequestResult:
    prompt_len: int  # intended
    max_tokens: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    output_len: int = 0
    chunks: int = 0  # non-empty text chunks received
    server_prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    error: str = ""


class Transport:
    """POST a JSON body and iterate the response's lines with aiohttp or httpx."""

    def __init__(self, kind: str, timeout_s: float, max_connections: int):
        if kind == "auto":
            kind = "aiohttp" if aiohttp else "httpx"
        if {"aiohttp": aiohttp, "httpx": httpx}[kind] is None:
            raise SystemExit(f"--transport {kind}: the package is not installed")
        self.name = kind
        if kind == "aiohttp":
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                connector=aiohttp.TCPConnector(limit=max_connections))
        else:
            self._client = httpx.AsyncClient(
                timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections,
                                                       max_keepalive_connections=max_connections))

    async def get_json(self, url: str, headers: dict) -> dict:
        if self.name == "aiohttp":
            async with self._session.get(url, headers=headers) as r:
                r.raise_for_status()
                return await r.json()
        r = await self._client.get(url, headers=headers)
        r.raise_for_status()
        return r.json()

    async def stream_lines(self, url: str, body: dict, headers: dict):
        """Yields (status, None) first, then (None, line) for each line."""
        if self.name == "aiohttp":
            async with self._session.post(url, json=body, headers=headers) as r:
                yield r.status, None
                if r.status != 200:
                    yield None, (await r.text())
                    return
                async for raw in r.content:
                    yield None, raw.decode("utf-8").strip()
            return
        async with self._client.stream("POST", url, json=body, headers=headers) as r:
            yield r.status_code, None
            if r.status_code != 200:
                yield None, (await r.aread()).decode("utf-8", "replace")
                return
            async for line in r.aiter_lines():
                yield None, line.strip()

    async def close(self):
        if self.name == "aiohttp":
            await self._session.close()
        else:
            await self._client.aclose()


async def send_request(transport: Transport, url: str, model: str, ids: list[int],
                       max_tokens: int, args, headers: dict) -> RequestResult:
    res = RequestResult(prompt_len=len(ids), max_tokens=max_tokens)
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens,
            "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    n_chunks = 0
    start = last = time.perf_counter()
    try:
        async with contextlib.aclosing(transport.stream_lines(url, body, headers)) as lines:
            status = (await lines.__anext__())[0]
            async for _, line in lines:
                if status != 200:
                    res.error = f"HTTP {status}: {line[:300]}"
                    return res
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    res.output_len = usage.get("completion_tokens", 0)
                    res.server_prompt_tokens = usage.get("prompt_tokens")
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens")
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    if n_chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    n_chunks += 1
        res.latency = time.perf_counter() - start
        res.chunks = n_chunks
        if res.server_prompt_tokens is None:  # no usage from this server: count chunks
            res.output_len = n_chunks
        res.success = n_chunks > 0 or res.output_len > 0
        if not res.success:
            res.error = "no output"
    except Exception as e:  # one failed request is reported, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


def sample_lengths(rng, n: int, length: int, ratio: float) -> np.ndarray:
    """Uniform integers in [max(1, int(length * ratio)), length] (SGLang's convention)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {ratio}")
    lo = max(1, int(length * ratio))
    return rng.integers(lo, length + 1, size=n)


def token_pool(args) -> np.ndarray:
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        special = set(tok.all_special_ids)
        return np.array([i for i in range(len(tok)) if i not in special], np.int64)
    lo, hi = args.token_id_range
    return np.arange(lo, hi, dtype=np.int64)


def make_requests(args, rng) -> list[tuple[list[int], int]]:
    """The warm-up requests, then the timed ones: (prompt ids, max_tokens) pairs."""
    pool = token_pool(args)
    n = args.num_prompts + args.warmup_requests
    in_lens = sample_lengths(rng, n, args.random_input_len, args.random_range_ratio)
    out_lens = sample_lengths(rng, n, args.random_output_len, args.random_range_ratio)
    if not args.shared_prefix_groups:
        return [(rng.choice(pool, int(i)).tolist(), int(o)) for i, o in zip(in_lens, out_lens)]
    plen = args.shared_prefix_len
    prefixes = [rng.choice(pool, plen).tolist() for _ in range(args.shared_prefix_groups)]
    groups = np.arange(args.num_prompts) % args.shared_prefix_groups
    rng.shuffle(groups)
    heads = [rng.choice(pool, plen).tolist() for _ in range(args.warmup_requests)]
    heads += [prefixes[g] for g in groups]
    return [(h + rng.choice(pool, int(i)).tolist(), int(o))
            for h, i, o in zip(heads, in_lens, out_lens)]


def _stats(name: str, values_s: list[float], empty=0.0) -> dict:
    """Mean, median, std and percentiles in ms; ``empty`` for each when there are no values."""
    v = np.asarray(values_s, np.float64) * 1000.0
    if v.size == 0:
        if empty is None:
            return {f"{s}_{name}_ms": None for s in ("mean", "median", "std", "p90", "p95",
                                                     "p99")}
        v = np.full(1, empty)
    return {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
            f"std_{name}_ms": float(v.std()), f"p90_{name}_ms": float(np.percentile(v, 90)),
            f"p95_{name}_ms": float(np.percentile(v, 95)), f"p99_{name}_ms": float(np.percentile(v, 99))}


def compute_metrics(results: list[RequestResult], duration: float, ignore_eos: bool) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.server_prompt_tokens if r.server_prompt_tokens is not None else r.prompt_len
                   for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    m = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(r.latency for r in ok) / duration,
        "prompt_len_mismatches": sum(r.server_prompt_tokens not in (None, r.prompt_len) for r in ok),
        "output_len_mismatches": sum(r.output_len != r.max_tokens for r in ok) if ignore_eos else None,
    }
    m["total_token_throughput"] = m["total_throughput"]
    m["total_chunks"] = sum(r.chunks for r in ok)
    m["mean_tokens_per_chunk"] = total_out / m["total_chunks"] if m["total_chunks"] else None
    m.update(_stats("ttft", [r.ttft for r in ok]))
    m.update(_stats("itl", [x for r in ok for x in r.itl]))
    m.update(_stats("tpot", tpots))
    m.update(_stats("e2e_latency", [r.latency for r in ok]))
    m.update(_cache_metrics(ok, total_in))
    return m


def _cache_metrics(ok: list[RequestResult], total_in: int) -> dict:
    """Prompt tokens served from the server's prefix cache, and TTFT of requests with and
    without a cache hit (None where the server reports no cached tokens)."""
    known = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in known) if known else None
    m = {"total_cached_tokens": cached,
         "prefix_cache_hit_rate": cached / total_in if known and total_in else None,
         "num_cache_hit_requests": sum(r.cached_tokens > 0 for r in known) if known else None}
    m.update(_stats("ttft_hit", [r.ttft for r in known if r.cached_tokens > 0], None))
    m.update(_stats("ttft_cold", [r.ttft for r in known if r.cached_tokens == 0], None))
    return m


async def run(args) -> dict:
    base = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get(
        "OPENAI_API_KEY") else {}
    rng = np.random.default_rng(args.seed)
    requests = make_requests(args, rng)
    max_conn = args.max_concurrency or args.num_prompts
    transport = Transport(args.transport, args.timeout, max(1, max_conn) + 1)
    try:
        model = args.model or (await transport.get_json(base + "/v1/models", headers))["data"][0]["id"]
        url = base + "/v1/completions"
        warm = await asyncio.gather(*(send_request(transport, url, model, ids, o, args, headers)
                                      for ids, o in requests[:args.warmup_requests]))
        if any(not r.success for r in warm):
            raise SystemExit(f"warm-up failed: {[r.error for r in warm if not r.success]}")
        timed = requests[args.warmup_requests:]
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = None
        if not args.disable_tqdm:
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(timed), desc="requests")
            except ImportError:
                pass

        async def one(ids, out_len):
            if sem is not None:
                async with sem:
                    r = await send_request(transport, url, model, ids, out_len, args, headers)
            else:
                r = await send_request(transport, url, model, ids, out_len, args, headers)
            if bar is not None:
                bar.update(1)
            return r

        start = time.perf_counter()
        tasks = []
        for ids, out_len in timed:
            tasks.append(asyncio.create_task(one(ids, out_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    finally:
        await transport.close()
    metrics = compute_metrics(results, duration, args.ignore_eos)
    errors = [r.error for r in results if not r.success]
    if metrics["prompt_len_mismatches"]:
        print(f"WARNING: {metrics['prompt_len_mismatches']} requests: the server's prompt_tokens "
              "differs from the intended prompt length (does it add a BOS token?)", file=sys.stderr)
    if errors:
        print(f"WARNING: {len(errors)} requests failed, e.g. {errors[0]}", file=sys.stderr)
    return {"backend": f"openai-completions ({transport.name})", "base_url": base, "model": model,
            "dataset_name": "shared-prefix" if args.shared_prefix_groups else "random",
            "shared_prefix_groups": args.shared_prefix_groups,
            "shared_prefix_len": args.shared_prefix_len if args.shared_prefix_groups else 0,
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
            "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio, "ignore_eos": args.ignore_eos,
            "warmup_requests": args.warmup_requests, **metrics,
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_len for r in results],
            "cached_tokens": [r.cached_tokens for r in results],
            "ttfts": [r.ttft for r in results], "errors": errors[:20]}


def print_report(m: dict) -> None:
    rows = [("Backend", m["backend"]), ("Traffic request rate", m["request_rate"]),
            ("Max request concurrency", m["max_concurrency"]),
            ("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", m["duration"]),
            ("Total input tokens", m["total_input_tokens"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"]),
            ("Input token throughput (tok/s)", m["input_throughput"]),
            ("Output token throughput (tok/s)", m["output_throughput"]),
            ("Total token throughput (tok/s)", m["total_throughput"]),
            ("Concurrency", m["concurrency"]),
            ("Mean tokens per streamed chunk", m["mean_tokens_per_chunk"])]
    if m["total_cached_tokens"] is not None:
        rows += [("Prefix-cached input tokens", m["total_cached_tokens"]),
                 ("Prefix cache hit rate (tokens)", m["prefix_cache_hit_rate"]),
                 ("Requests with a cache hit", m["num_cache_hit_requests"])]
    print("{:=^60}".format(" Serving Benchmark Result "))
    for k, v in rows:
        print(f"{k + ':':<42} {v:.2f}" if isinstance(v, float) else f"{k + ':':<42} {v}")
    for title, key, short in [("End-to-End Latency", "e2e_latency", "E2E Latency"),
                              ("Time to First Token", "ttft", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                              ("Inter-token Latency", "itl", "ITL")]:
        print("{:-^60}".format(title))
        for stat in ("mean", "median", "p99"):
            label = f"{'P99' if stat == 'p99' else stat.capitalize()} {short} (ms):"
            print(f"{label:<42} {m[f'{stat}_{key}_ms']:.2f}")
    if m["num_cache_hit_requests"]:
        for kind in ("hit", "cold"):
            v = m[f"median_ttft_{kind}_ms"]
            label = f"Median TTFT, {'cache hit' if kind == 'hit' else 'no hit'} (ms):"
            print(f"{label:<42} {'-' if v is None else f'{v:.2f}'}")
    print("=" * 60)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides host/port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--shared-prefix-groups", type=int, default=0,
                   help="G > 0: requests share G random prefixes (round-robin, shuffled); "
                        "--random-input-len is then each request's own question length")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="tokens of each shared prefix (with --shared-prefix-groups)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s with Poisson arrivals; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--token-id-range", type=int, nargs=2, default=(1000, 30000), metavar=("LO", "HI"))
    p.add_argument("--tokenizer", default=None, help="draw ids from this tokenizer's vocabulary")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=6 * 3600, help="per-request timeout, seconds")
    p.add_argument("--output-file", default=None, help="append one JSON line with the results")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--transport", default="auto", choices=("auto", "aiohttp", "httpx"),
                   help="HTTP client (auto: aiohttp if installed, else httpx)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        p.error("--num-prompts and --random-*-len must be >= 1")
    if args.shared_prefix_groups < 0 or (args.shared_prefix_groups > 0) != (
            args.shared_prefix_len > 0):
        p.error("--shared-prefix-groups and --shared-prefix-len go together, both >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf for all at once)")
    return args


def _json_safe(x):
    """Strict JSON: non-finite floats (``--request-rate inf``) become strings."""
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print_report(result)
    if args.output_file:
        record = {**result, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
                  "args": vars(args)}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(_json_safe(record), allow_nan=False) + "\n")
    return result


if __name__ == "__main__":
    main()
