"""Merge new device outputs into bench/results/serving-h200.json without losing what is there.

    python -m bench.serving.merge OUT/serving-h200-8b.json OUT/peer-hf.json \\
        [--into bench/results/serving-h200.json] [--dry-run]

Each input is a JSON with any of ``runs`` / ``floor`` / ``peer`` lists (``bench/serving/matrix.py``,
``bench/decode_floor.py``, ``bench/peer_hf.py`` outputs). Records are appended to the same lists
of ``--into``; a record equal to one already there in its identity fields (configuration plus
``date``) is not added twice, so merging the same file again changes nothing. Existing records
are never dropped or edited. The target's ``machine`` stays; each input is listed in
``sources`` (file name, machine, versions, command, date, counts) and its command is appended
to ``commands``; ``versions`` gains the inputs' package versions (torch and transformers from
the peer); ``errors`` and ``skipped`` of the inputs are appended, prefixed by the file name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RUN_KEY = ("model_shape", "kv_cache_dtype", "kv_scale_mode", "input_len", "output_len",
           "max_concurrency", "num_prompts", "max_num_batched_tokens", "enable_prefix_caching",
           "shared_prefix_groups", "shared_prefix_len", "date")
FLOOR_KEY = ("model_shape", "kv_cache_dtype", "kv_scale_mode", "batch", "context", "step_ms")
PEER_KEY = ("impl", "model_shape", "batch", "input_len", "output_len", "date",
            "output_throughput")
KEYS = {"runs": RUN_KEY, "floor": FLOOR_KEY, "peer": PEER_KEY}


def identity(rec: dict, key: tuple) -> tuple:
    return tuple(json.dumps(rec.get(k), sort_keys=True) for k in key)


def merge(base: dict, new: dict, name: str) -> dict:
    """Merge ``new`` into ``base`` in place; returns counts added per list."""
    added = {}
    for lst, key in KEYS.items():
        have = {identity(r, key) for r in base.get(lst, [])}
        base.setdefault(lst, [])
        n = 0
        for rec in new.get(lst, []) or []:
            ident = identity(rec, key)
            if ident in have:
                continue
            base[lst].append(rec)
            have.add(ident)
            n += 1
        added[lst] = n
    base.setdefault("versions", dict((base.get("machine") or {}).get("versions", {})))
    base["versions"].update(new.get("versions") or {})
    src = {"file": name, "machine": new.get("machine"), "versions": new.get("versions"),
           "command": new.get("command"), "date": new.get("date"), "added": added}
    sources = base.setdefault("sources", [])
    if not any(s.get("file") == name and s.get("command") == src["command"]
               and s.get("date") == src["date"] for s in sources):
        sources.append(src)
        if new.get("command"):
            base.setdefault("commands", [])
            if new["command"] not in base["commands"]:
                base["commands"].append(new["command"])
        for lst in ("errors", "skipped"):
            for e in new.get(lst, []) or []:
                base.setdefault(lst, []).append(f"{name}: {e}")
    if "machine" not in base and new.get("machine"):
        base["machine"] = new["machine"]
    if "command" not in base and new.get("command"):
        base["command"] = new["command"]
    return added


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+")
    p.add_argument("--into", default="bench/results/serving-h200.json")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    base = {}
    if os.path.exists(args.into):
        with open(args.into) as f:
            base = json.load(f)
    before = {k: len(base.get(k, [])) for k in KEYS}
    for path in args.inputs:
        with open(path) as f:
            new = json.load(f)
        added = merge(base, new, os.path.basename(path))
        print(f"{path}: added {added}")
    after = {k: len(base.get(k, [])) for k in KEYS}
    assert all(after[k] >= before[k] for k in KEYS)
    print(f"{args.into}: {before} -> {after}")
    if not args.dry_run:
        mode = os.stat(args.into).st_mode & 0o777 if os.path.exists(args.into) else None
        tmp = args.into + ".tmp"
        with open(tmp, "w") as f:
            json.dump(base, f, indent=1)
        if mode is not None:  # results files may be kept read-only; keep their mode
            os.chmod(tmp, mode)
        os.replace(tmp, args.into)
    return 0


if __name__ == "__main__":
    sys.exit(main())
