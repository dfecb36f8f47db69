"""A coding agent's trace through the engine: prefix caching on and off, per cache dtype.

    python -m bench.agent --model random:qwen3.6-35b-a3b --sessions 1,8 \\
        --kv-cache-dtype bfloat16,fp8_e4m3 --cache on,off --off-turns 65536 \\
        --system-tokens 4096 --tool-tokens 512:4096 --answer-tokens 64:512 \\
        --context-tokens 100000 --kv-cache-memory 6e9 --plot
    python -m bench.agent --model random:qwen3.6-tiny --sessions 2 --system-tokens 48 \\
        --first-tokens 8 --tool-tokens 8:24 --answer-tokens 4:12 --context-tokens 200 \\
        --off-turns 150 --out /tmp/agent.json          # CPU smoke test

Trace (seeded: every run of one invocation sees the same token ids): ``--sessions`` S
conversations at once, each starting with a system prompt of ``--system-tokens`` (one for all
sessions, as one agent's are) and a first message of ``--first-tokens``. A turn's answer is
the model's greedy output of a length drawn from ``--answer-tokens LO:HI`` (``ignore_eos``);
when it ends, the session's next turn is submitted at once: the last prompt + the answer + a
tool output of ``--tool-tokens LO:HI`` random ids, until a prompt would pass
``--context-tokens`` (or ``--max-turns``). The engine is driven directly (``LLMEngine.add_
request`` / ``step``), so TTFT is from a turn's submission to the step that returned its
first token (with overlap scheduling, the engine returns a step's tokens one step later, as
the server does).

Modes (``--cache``): ``on`` plays the trace with prefix caching (the model family's: pages,
and state snapshots for hybrid and DeepSeek-V4 models); ``off`` plays it with prefix caching
off, or with ``--off-turns C1,C2,...`` replays only, for each C, every session's turn whose
prompt is the longest at most C tokens: the same prompts the ``on`` run sent (its answers
included), all S at once, on the same engine and pools given a scheduler without a prefix
cache. One engine is built per (S, cache dtype) and warmed up (``--warmup buckets``) first.

Per turn: prompt tokens, the tokens it shares with the session's previous turn (that prompt
and its answer; a later session's first turn shares the system prompt), cached tokens (the
API's ``cached_tokens``) and their share of the shared tokens, TTFT, decode tokens/s, end to
end, the seconds XLA spent compiling meanwhile (``compile_s``: with ``--warmup off`` a turn
that meets a new shape waits for it), and after it the pool (pages in use and cached) and the
state snapshots (held, bytes).
Per run: the summary of those, ``ttft_on_over_off`` for each replayed turn, and at the end
how many sessions the cache still holds (``reusable_tokens`` of each conversation: all of it
up to its last page boundary). Writes ``bench/results/agent-<machine>.json`` (``--out``): machine, versions, the
exact command, the trace settings and one record per run; ``--plot``: TTFT against prompt
tokens beside it as PNG.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import zlib

import numpy as np

from bench import internals
from bench.common import RESULTS, command_line, machine_info, write_result
from bench.offline import machine_slug, parse_bytes, versions


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sessions", default="1", help="comma list of S")
    p.add_argument("--kv-cache-dtype", default="bfloat16,fp8_e4m3", help="comma list")
    p.add_argument("--cache", default="on,off", help="on, off or on,off")
    p.add_argument("--off-turns", default="", help="contexts C1,C2,...: replay (see above)")
    p.add_argument("--system-tokens", type=int, default=4096)
    p.add_argument("--first-tokens", type=int, default=256)
    p.add_argument("--tool-tokens", type=span, default=(512, 4096), metavar="LO:HI")
    p.add_argument("--answer-tokens", type=span, default=(64, 512), metavar="LO:HI")
    p.add_argument("--context-tokens", type=int, default=100_000)
    p.add_argument("--max-turns", type=int, default=None)
    p.add_argument("--vocab-limit", type=int, default=32000, help="token ids below this")
    p.add_argument("--seed", type=int, default=0)
    for flag in ("--kv-cache-memory", "--state-snapshot-memory"):
        p.add_argument(flag, default=None, help="bytes (state snapshots: or a fraction)")
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                 "--decode-steps"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="the engine's (set before JAX starts, as the server does)")
    p.add_argument("--warmup", choices=("buckets", "off"), default="buckets")
    p.add_argument("--out")
    p.add_argument("--plot", action="store_true")
    p.add_argument("--plot-only", metavar="JSON")
    args = p.parse_args(argv)
    if not args.plot_only and not args.model:
        p.error("--model is required")
    return args


class Trace:
    """The seeded token ids: the system prompt, each session's first message, and per
    (session, turn) the answer length and the tool output."""

    def __init__(self, args, vocab: int):
        self.args, self.vocab = args, min(vocab, args.vocab_limit)
        self.system = self._ids(("system",), args.system_tokens)

    def _rng(self, *key):
        return np.random.default_rng([self.args.seed, *(zlib.crc32(str(k).encode())
                                                         for k in key)])

    def _ids(self, key, n: int) -> list[int]:
        return self._rng(*key).integers(3, self.vocab, n).tolist()

    def first(self, s: int) -> list[int]:
        return self.system + self._ids(("first", s), self.args.first_tokens)

    def answer_len(self, s: int, t: int) -> int:
        lo, hi = self.args.answer_tokens
        return int(self._rng("answer", s, t).integers(lo, hi + 1))

    def tool(self, s: int, t: int) -> list[int]:
        lo, hi = self.args.tool_tokens
        return self._ids(("tool", s, t), int(self._rng("toollen", s, t).integers(lo, hi + 1)))


def pool_now(llm) -> dict:
    m = internals.engine(llm).metrics()
    cached = internals.engine(llm).scheduler.prefix_cache_stats().cached_pages
    return dict(pages_used=m["pages_used"], pages_cached=cached,
                snapshots_cached=m["snapshots_cached"], snapshot_bytes=m["snapshot_bytes"])


def drive(llm, trace: Trace, sessions: int, prompts=None) -> dict:
    """Play the trace (``prompts`` None) or replay ``prompts`` {(s, t): ids} all at once.
    Returns {"turns": [...], "conversations": [final tokens per session], "wall_s"}."""
    from jfp8kv import SamplingParams
    from jfp8kv.engine.stats import compile_count

    eng, args = internals.engine(llm), trace.args
    live, turns, convs = {}, [], [None] * sessions
    shared = [len(trace.system) if s and prompts is None else 0 for s in range(sessions)]

    def submit(s: int, t: int, prompt: list[int]):
        rid = f"s{s}t{t}"
        eng.add_request(rid, prompt, SamplingParams(max_tokens=trace.answer_len(s, t),
                                                    temperature=0, ignore_eos=True))
        live[rid] = dict(session=s, turn=t, prompt=prompt, t0=time.perf_counter(), first=None,
                         compiles=compile_count())

    t_start = time.perf_counter()
    first = prompts if prompts is not None else {(s, 0): trace.first(s)
                                                 for s in range(sessions)}
    for (s, t), ids in first.items():
        submit(s, t, list(ids))
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            r = live[o.request_id]
            if r["first"] is None and o.token_ids:
                r["first"] = now
            if o.finish_reason is None:
                continue
            s, t, prompt = r["session"], r["turn"], r["prompt"]
            n = len(o.token_ids)
            turns.append(dict(
                session=s, turn=t, prompt_tokens=len(prompt), shared_tokens=shared[s],
                cached_tokens=o.num_cached_tokens,
                reuse=o.num_cached_tokens / shared[s] if shared[s] else None,
                ttft_s=r["first"] - r["t0"], output_tokens=n, e2e_s=now - r["t0"],
                compile_s=compile_count()[1] - r["compiles"][1],
                decode_tok_s=(n - 1) / (now - r["first"]) if n > 1 and now > r["first"]
                else None, prompt_ids=np.asarray(prompt, np.int32), **pool_now(llm)))
            convs[s] = prompt + o.token_ids
            if prompts is not None:
                continue
            shared[s] = len(convs[s])
            nxt = convs[s] + trace.tool(s, t)
            if (len(nxt) + trace.answer_len(s, t + 1) <= args.context_tokens
                    and (args.max_turns is None or t + 1 < args.max_turns)):
                submit(s, t + 1, nxt)
    return dict(turns=turns, conversations=convs, wall_s=time.perf_counter() - t_start)


def replay_prompts(turns: list[dict], contexts: list[int]) -> list[dict]:
    """Per context C: {(s, t): prompt} of each session's longest prompt of at most C."""
    out = []
    for c in contexts:
        best = {}
        for r in turns:
            if r["prompt_tokens"] <= c and r["prompt_tokens"] > best.get(r["session"], (0,))[0]:
                best[r["session"]] = (r["prompt_tokens"], r["turn"], r["prompt_ids"])
        out.append({(s, t): ids.tolist() for s, (_, t, ids) in sorted(best.items())})
    return out


def summarize(turns: list[dict]) -> dict:
    later = [r["reuse"] for r in turns  # every turn after a session's first
             if r["turn"] > 0 and r["reuse"] is not None]
    dec = [r["decode_tok_s"] for r in turns if r["decode_tok_s"]]
    return dict(turns=len(turns), prompt_tokens=sum(r["prompt_tokens"] for r in turns),
                cached_tokens=sum(r["cached_tokens"] for r in turns),
                reuse_min=min(later, default=None),
                reuse_mean=statistics.fmean(later) if later else None,
                ttft_median_s=statistics.median(r["ttft_s"] for r in turns) if turns else None,
                decode_tok_s_mean=statistics.fmean(dec) if dec else None)


def build(args, loaded, kv: str, sessions: int):
    from jfp8kv import LLM

    kw = dict(loaded=loaded, dtype=args.dtype, kv_cache_dtype=kv, seed=args.seed,
              kv_cache_memory=parse_bytes(args.kv_cache_memory), warmup=False,
              max_num_seqs=args.max_num_seqs or max(1, sessions),
              max_model_len=args.max_model_len or args.context_tokens + args.answer_tokens[1])
    if args.state_snapshot_memory is not None:
        kw["state_snapshot_memory"] = float(args.state_snapshot_memory)
    for name in ("max_num_batched_tokens", "decode_steps", "gpu_memory_utilization"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    t = time.perf_counter()
    llm = LLM(**kw)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    if args.warmup == "buckets":
        llm.warmup(progress=False)
    return llm, build_s, time.perf_counter() - t


def cache_record(llm) -> dict:
    info = llm.cache_info()
    keep = ("kv_cache_dtype", "kv_scale_mode", "kv_layout", "model_family", "page_size",
            "num_pages", "max_tokens", "bytes_per_token", "pool_bytes", "state_slots",
            "snapshot_slots", "snapshot_bytes", "max_model_len", "max_num_seqs",
            "max_num_batched_tokens", "enable_prefix_caching")
    return {k: info[k] for k in keep if k in info}


def held(llm, conversations) -> dict:
    """How much of each finished conversation the cache would serve now; a session is held
    when that is all of it up to its last page boundary (its next turn would recompute
    only the partial page)."""
    ps = llm.cache_info()["page_size"]
    reusable = [internals.reusable_tokens(llm, c) if c else 0 for c in conversations]
    full = [(len(c) - 1) // ps * ps if c else 0 for c in conversations]
    return dict(reusable_tokens=reusable, conversation_tokens=[len(c or []) for c in
                                                                conversations],
                sessions_held=sum(r == f for r, f in zip(reusable, full) if f))


def run_pair(args, loaded, kv: str, sessions: int, modes: list[str]) -> list[dict]:
    """The runs of one engine: ``on`` (the whole trace), then ``off`` (replayed turns, or the
    whole trace) on the same engine without a prefix cache."""
    trace = Trace(args, loaded.config.vocab_size)
    llm, build_s, warmup_s = build(args, loaded, kv, sessions)
    base = dict(model=args.model, sessions=sessions, kv_cache_dtype=kv,
                cache=cache_record(llm), build_s=build_s, warmup_s=warmup_s)
    recs, on = [], None
    if "on" in modes:
        got = drive(llm, trace, sessions)
        on = dict(base, mode="on", wall_s=got["wall_s"], summary=summarize(got["turns"]),
                  end=held(llm, got["conversations"]), turns=got["turns"])
        recs.append(on)
    if "off" in modes:
        internals.without_prefix_cache(llm)
        contexts = [int(c) for c in args.off_turns.split(",") if c.strip()]
        if contexts and on is not None:
            turns, walls = [], 0.0
            for prompts in replay_prompts(on["turns"], contexts):
                got = drive(llm, trace, sessions, prompts)
                turns += got["turns"]
                walls += got["wall_s"]
            ratio = {(r["session"], r["turn"]): r["ttft_s"] for r in on["turns"]}
            on["ttft_on_over_off"] = [dict(session=r["session"], turn=r["turn"],
                                           prompt_tokens=r["prompt_tokens"],
                                           on_s=ratio[(r["session"], r["turn"])],
                                           off_s=r["ttft_s"],
                                           ratio=ratio[(r["session"], r["turn"])] / r["ttft_s"])
                                      for r in turns]
            recs.append(dict(base, mode="off-replay", wall_s=walls, summary=summarize(turns),
                             turns=turns))
        else:
            got = drive(llm, trace, sessions)
            recs.append(dict(base, mode="off", wall_s=got["wall_s"],
                             summary=summarize(got["turns"]), turns=got["turns"]))
    del llm
    gc.collect()
    for r in recs:
        for t in r["turns"]:
            t.pop("prompt_ids", None)
    return recs


def line(rec: dict) -> str:
    s = rec["summary"]
    reuse = "-" if s["reuse_min"] is None else f"{s['reuse_min']:.3f}"
    out = (f"{rec['model']} S={rec['sessions']} {rec['kv_cache_dtype']} cache {rec['mode']}: "
           f"{s['turns']} turns, cached {s['cached_tokens']}/{s['prompt_tokens']} prompt "
           f"tokens, reuse min {reuse}, median TTFT {s['ttft_median_s']:.3f} s")
    if rec.get("end"):
        out += f", sessions held at the end {rec['end']['sessions_held']}"
    if rec.get("ttft_on_over_off"):
        worst = max(r["ratio"] for r in rec["ttft_on_over_off"])
        out += f", TTFT on/off at the replayed turns <= {worst:.3f}"
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        plot(args.plot_only)
        return 0
    if args.gpu_memory_utilization is not None:  # before JAX starts its GPU backend
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                              f"{args.gpu_memory_utilization:.4g}")
    from jfp8kv.models.loader import load_model

    command = command_line(__spec__.name if __spec__ else "bench.agent", argv)
    machine = machine_info()
    out = args.out or os.path.join(RESULTS, f"agent-{machine_slug(machine)}.json")
    modes = [m.strip() for m in args.cache.split(",")]
    doc = {"machine": machine, "versions": versions(), "command": command,
           "trace": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
           "runs": []}
    loaded = load_model(args.model, args.dtype)
    for sessions in (int(x) for x in args.sessions.split(",")):
        for kv in (k.strip() for k in args.kv_cache_dtype.split(",")):
            for rec in run_pair(args, loaded, kv, sessions, modes):
                doc["runs"].append(rec)
                print(line(rec), flush=True)
                write_result(out, doc)  # after every run: a run cut short keeps the rest
    print(f"wrote {out}")
    if args.plot:
        plot(out)
    return 0


def plot(path: str) -> None:
    """TTFT against prompt tokens, one series per run. Writes PATH with .png for .json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        runs = json.load(f)["runs"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in runs:
        xs = [t["prompt_tokens"] for t in r["turns"]]
        ys = [t["ttft_s"] for t in r["turns"]]
        ax.plot(xs, ys, "o" if r["mode"] != "on" else ".", ms=4,
                label=f"{r['model'].split(':')[-1]} S={r['sessions']} {r['kv_cache_dtype']} "
                      f"{r['mode']}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("agent trace: time to first token per turn")
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
