"""One long request through the server (issue 41's done-when: a 131,072-token request served;
issue 56's: its time to first token and decode speed).

    python -m bench.long_request --model random:qwen3.6-35b-a3b --prompt-tokens 131072 \\
        --max-tokens 256 --repeat --out bench/results/long-request-hybrid-h100.json -- \\
        --kv-cache-dtype fp8_e4m3 --max-model-len 131328 --max-num-seqs 4 --warmup off

Starts ``python -m jfp8kv.serve`` on a free loopback port (flags after ``--``), waits for
/health, sends one streamed greedy /v1/completions whose prompt is ``--prompt-tokens`` token
ids (seeded, below ``--vocab-limit``), and records: start-up seconds, status, time to the first
streamed token (prefill, compiles included when warm-up is off), total seconds, the tokens
returned, the decode speed (``decode_tok_s``: the usage's completion tokens after the first
over the time from the first streamed chunk to the last; exact when the first chunk holds
the prefill's token alone, a chunk of several later tokens counts them all) and the server's
/metrics lines about the KV cache. Then the same request once more when ``--repeat``
(compiled shapes: the second TTFT is the prefill alone, its decode speed the warm one).
``summary`` holds the last request's TTFT and decode speed (the warm ones with
``--repeat``). Stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from types import SimpleNamespace

import httpx

from bench.common import command_line, machine_info, reserve_check, write_result
from bench.soak import start_server


def stream_once(url: str, body: dict, timeout: float) -> dict:
    """POST one streamed completion; (status, ttft_s, last_s: the last text chunk, total_s,
    text, chunks, usage, decode_tok_s[, error]: the server's in-stream error event, which
    ends the stream)."""
    t0 = time.perf_counter()
    ttft, last, text, chunks, usage, error = None, None, "", 0, None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout,
                      trust_env=False) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": r.read().decode()[:2000],
                    "total_s": time.perf_counter() - t0}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if msg.get("error"):  # the server's in-stream error event (status stays 200)
                error = msg["error"]
                break
            if msg.get("choices") and msg["choices"][0].get("text"):
                last = time.perf_counter() - t0
                ttft = last if ttft is None else ttft
                text += msg["choices"][0]["text"]
                chunks += 1
            usage = msg.get("usage") or usage
    return {"status": 200, "ttft_s": ttft, "last_s": last, "total_s": time.perf_counter() - t0,
            "text": text, "text_chunks": chunks, "usage": usage,
            "decode_tok_s": decode_speed(usage, ttft, last),
            **({"error": error} if error else {})}


def decode_speed(usage: dict | None, ttft: float | None, last: float | None) -> float | None:
    """Tokens per second after the first: (completion tokens - 1) / (last - first streamed
    token); None without usage or with fewer than two tokens."""
    n = (usage or {}).get("completion_tokens") or 0
    if n < 2 or ttft is None or last is None or last <= ttft:
        return None
    return (n - 1) / (last - ttft)


def kv_metrics(url: str) -> list[str]:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return [ln for ln in text.splitlines()
            if ln and not ln.startswith("#")
            and any(w in ln for w in ("cache", "page", "memory"))]


def memory_check(metrics: list[str]) -> dict:
    """``common.reserve_check`` of the plan and device counts the server's /metrics export."""
    plan, device = {}, {}
    for ln in metrics:
        for name, into, prefix in (("jfp8kv_memory_plan_bytes", plan, ""),
                                   ("jfp8kv_device_memory_bytes", device, "device_")):
            if ln.startswith(name + "{"):
                into[prefix + ln.split('"')[1]] = float(ln.rsplit(" ", 1)[1])
    return reserve_check(plan, device)


def _unwind(signum, frame):
    raise SystemExit(128 + signum)


def startup_summary(path: str) -> dict | None:
    """The server's start-up profile (``jfp8kv.engine.startup_profile``: executables by
    phase and source, trace/lower and XLA seconds; its rows stay in ``path``), or None when
    the server wrote none (``--warmup off``)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return {"path": os.path.basename(path), "phases": doc["phases"], "slowest": doc["slowest"]}


def summarize(doc: dict) -> dict:
    """``doc`` with ``served`` (every request answered 200 with the whole prompt counted) and
    ``summary``: the last request's TTFT and decode speed (``warm``: it was the repeat)."""
    doc["served"] = bool(doc["requests"]) and all(
        r["status"] == 200 and (r.get("usage") or {}).get("prompt_tokens")
        == doc["prompt_tokens"] for r in doc["requests"])
    last = doc["requests"][-1] if doc["requests"] else {}
    doc["summary"] = dict(ttft_s=last.get("ttft_s"), decode_tok_s=last.get("decode_tok_s"),
                          warm=len(doc["requests"]) > 1)
    return doc


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.long_request", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", type=int, default=131072)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--vocab-limit", type=int, default=1000, help="prompt ids drawn below this")
    p.add_argument("--repeat", action="store_true", help="send the request a second time")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=1200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--out", required=True)
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: server flags")
    args = p.parse_args(argv)
    server_args = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    ids = random.Random(args.seed).choices(range(1, args.vocab_limit), k=args.prompt_tokens)
    body = {"model": args.model, "prompt": ids, "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    profile = os.path.splitext(args.out)[0] + "-startup-profile.json"
    proc, url, server_cmd = start_server(
        SimpleNamespace(log_dir=args.log_dir, model=args.model, api_key=None,
                        startup_timeout=args.startup_timeout, startup_profile=profile),
        server_args)
    doc = {"machine": machine_info(), "command": command_line("bench.long_request", list(argv)) if argv else command_line(),
           "server_command": server_cmd, "startup_s": time.perf_counter() - t0,
           "startup_profile": startup_summary(profile),
           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "requests": []}
    signal.signal(signal.SIGTERM, _unwind)  # a stage's time limit: still stop the server
    try:
        for _ in range(2 if args.repeat else 1):
            doc["requests"].append(stream_once(url, body, args.request_timeout))
            print(json.dumps({k: v for k, v in doc["requests"][-1].items() if k != "text"}),
                  flush=True)
            write_result(args.out, summarize(doc))  # a run cut short keeps what it measured
        doc["metrics"] = kv_metrics(url)
        doc["memory"] = memory_check(doc["metrics"])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except Exception:
            proc.kill()
    write_result(args.out, summarize(doc))
    print(f"served={doc['served']} startup={doc['startup_s']:.1f}s summary={doc['summary']} "
          f"-> {args.out}")
    return doc


if __name__ == "__main__":
    main()
