#!/usr/bin/env python3
"""Run AF (issue 20): is the prepared cold load slower than the unprepared one, or noise?

Rounds, each: the cold sequential-read ceiling (1 thread, 16 MiB, buffered), the cold O_DIRECT
ceiling in the loader's own pattern (8 threads, 4 MiB, O_DIRECT), then the three loader variants
of cold2_child.py (A unprepared, B prepared as bench_load, C prepared after the drop) in an order
that cycles through all 6 permutations, each in a fresh process, page cache dropped before every
measurement. Two more sequential-read ceilings at the end. Stops starting rounds at --deadline.

  python3 bench/cold_rounds/cold2.py --rank-file F --ceilings build-gpu/tools/bench/reshard_bench_ceilings \
      --rounds 18 --deadline EPOCH --out $OUT
"""
import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "bench"))
from bench_load import RESULT_TAG, RuntimeKeeper  # noqa: E402
from common import drop_caches  # noqa: E402

PROBE = r"""
import sys, json, torch
sys.path.insert(0, %r)
from bench_load import runtime_files
from reshard import _C
torch.empty(1, device="cuda"); torch.cuda.synchronize()
print(json.dumps(runtime_files()))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank-file", required=True)
    ap.add_argument("--ceilings", required=True)
    ap.add_argument("--rounds", type=int, default=18)
    ap.add_argument("--deadline", type=float, required=True, help="epoch seconds: no round starts that would end after it")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="ABC", help="three of A, B, C, E (cold2_child.py)")
    ap.add_argument("--dio8-every", type=int, default=1, help="the O_DIRECT ceiling in every N-th round")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jl = open(out / "cold2.jsonl", "w")
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    def record(rec):
        jl.write(json.dumps(rec) + "\n")
        jl.flush()

    # keep the children's runtime libraries mapped across drops (as bench_load does)
    p = subprocess.run([sys.executable, "-c", PROBE % str(HERE.parent / "bench")], capture_output=True, text=True)
    keeper = RuntimeKeeper([Path(a.rank_file).parent, out])
    try:
        keeper.add(json.loads(p.stdout.strip().splitlines()[-1]))
        log(f"keeper: {len(keeper.maps)} files, {keeper.bytes / 1e9:.2f} GB mapped")
    except Exception as e:  # noqa: BLE001
        log(f"keeper failed: {e}; {p.stderr[-500:]}")

    from cold2_child import blockstat

    def tool(name, argv, rnd):
        why = drop_caches()
        if why:
            raise SystemExit(why)
        t = time.time()
        b0 = blockstat(a.rank_file)
        r = subprocess.run([a.ceilings, "read", "--file", a.rank_file, *argv], capture_output=True, text=True)
        b1 = blockstat(a.rank_file)
        try:
            j = json.loads(r.stdout.strip().splitlines()[-1])
        except Exception:  # noqa: BLE001
            j = {"error": (r.stderr or r.stdout)[-500:]}
        rec = {"round": rnd, "what": name, "gbps": j.get("gbps"), "seconds": j.get("seconds"),
               "resident_before": j.get("resident_fraction_before"), "wall": round(time.time() - t, 2),
               "t": round(t - t_start, 1), "error": j.get("error")}
        if b0 and b1:
            d = {k: b1[k] - b0[k] for k in b0 if k != "inflight"}
            d["avg_read_kib"] = d["sectors"] * 512 / 1024 / d["reads"] if d["reads"] else 0
            d["ms_per_read"] = d["read_ms"] / d["reads"] if d["reads"] else 0
            rec["block"] = d
        record(rec)
        bk = rec.get("block") or {}
        log(f"  {name:6s} {rec['gbps'] or 0:6.3f} GB/s  disk reads {bk.get('reads')} avg {bk.get('avg_read_kib', 0):.0f} KiB "
            f"{bk.get('ms_per_read', 0):.2f} ms/read")
        return rec

    def child(v, rnd, pos):
        spec = {"variant": v, "rank_file": a.rank_file, "threads": 16, "verify": True, "io": "auto"}
        t = time.time()
        r = subprocess.run([sys.executable, str(HERE / "cold2_child.py"), json.dumps(spec)],
                           capture_output=True, text=True)
        res = None
        for line in reversed(r.stdout.splitlines()):
            if line.startswith(RESULT_TAG):
                res = json.loads(line[len(RESULT_TAG):])
                break
        if res is None:
            res = {"variant": v, "ok": False, "error": (r.stderr + r.stdout)[-800:]}
        res.update(round=rnd, pos=pos, what=v, wall=round(time.time() - t, 2), t=round(t - t_start, 1))
        record(res)
        if res.get("ok"):
            rp, bk = res["report"], res.get("block") or {}
            thp = ",".join(f"{m['mib']:.0f}M:{m.get('AnonHugePages', 0) // 1024}M" for m in res.get("staging_maps", []))
            log(f"  {v}      {res['gbps']:6.3f} GB/s  read/lane {rp['read_seconds'] * 1e3:6.1f} ms  "
                f"direct {rp['direct_io']} lanes {rp['threads']} alloc {rp['staging_alloc_seconds'] * 1e3:.1f} ms  "
                f"reads {bk.get('reads')} avg {bk.get('avg_read_kib', 0):.0f} KiB {bk.get('ms_per_read', 0):.2f} ms/read  thp {thp}")
        else:
            log(f"  {v} FAILED: {res.get('error', '')[:600]}")
        return res

    perms = list(itertools.permutations(a.variants))
    rounds_done, last = 0, None
    for rnd in range(a.rounds):
        if last is not None and time.time() + 1.1 * last + 12 > a.deadline:
            log(f"deadline: stopping after {rnd} rounds (one takes ~{last:.0f} s)")
            break
        t_r = time.time()
        order = perms[rnd % len(perms)]
        log(f"round {rnd + 1}: seq, dio8, {' '.join(order)}")
        tool("seq", ["--threads", "1", "--request", "16MiB"], rnd)
        if rnd % a.dio8_every == 0:
            tool("dio8", ["--threads", "8", "--request", "4MiB", "--direct"], rnd)
        for pos, v in enumerate(order):
            child(v, rnd, pos)
        rounds_done += 1
        last = time.time() - t_r
    log("end: two more sequential-read ceilings and the O_DIRECT one")
    tool("seq", ["--threads", "1", "--request", "16MiB"], -1)
    tool("dio8", ["--threads", "8", "--request", "4MiB", "--direct"], -1)
    tool("seq", ["--threads", "1", "--request", "16MiB"], -1)
    jl.close()
    text = summarize(out / "cold2.jsonl")
    (out / "cold2-summary.txt").write_text(text)
    print(text)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(path):
    recs = [json.loads(l) for l in open(path)]
    L = []
    ok = [r for r in recs if r.get("gbps") and (r.get("ok", True))]
    seqs = [r["gbps"] for r in ok if r["what"] == "seq"]
    seq_med = med(seqs)
    rounds = sorted({r["round"] for r in ok if r["round"] >= 0})
    V = "".join(w for w in "ABCE" if any(r["what"] == w for r in ok))
    pairs = [(y, x) for i, x in enumerate(V) for y in V[i + 1:]]  # (later, earlier): B/A, C/A, ...
    by = {(r["round"], r["what"]): r for r in ok}
    L.append("per round (GB/s; cold, page cache dropped before each):")
    L.append(f"{'rnd':>3s} {'order':>5s} {'seq':>6s} {'dio8':>6s} " + " ".join(f"{w:>6s}" for w in V) + " " +
             " ".join(f"{y + '/' + x:>6s}" for y, x in pairs) + f"   {'/'.join(V)} read ms per lane; avg KiB per disk read; staging THP MiB")
    paired = {p: [] for p in pairs}
    for rn in rounds:
        g = {w: by.get((rn, w)) for w in ("seq", "dio8", *V)}
        order = "".join(sorted((w for w in V if g[w]), key=lambda w: g[w]["pos"]))
        f = lambda w: f"{g[w]['gbps']:6.3f}" if g[w] else "     -"  # noqa: E731
        rs = []
        for y, x in pairs:
            r_ = g[y]["gbps"] / g[x]["gbps"] if g[y] and g[x] else None
            if r_:
                paired[(y, x)].append(r_)
            rs.append(f"{r_:6.3f}" if r_ else "     -")
        det = " ".join(f"{g[w]['report']['read_seconds'] * 1e3:.0f}" if g[w] else "-" for w in V)
        kib = " ".join(f"{(g[w].get('block') or {}).get('avg_read_kib', 0):.0f}" if g[w] else "-" for w in V)
        thp = " ".join(",".join(f"{m['mib']:.0f}:{m.get('AnonHugePages', 0) // 1024}" for m in g[w].get("staging_maps", [])
                                if m.get("AnonHugePages")) or "0" if g[w] else "-" for w in V)
        L.append(f"{rn + 1:3d} {order:>5s} {f('seq')} {f('dio8')} " + " ".join(f(w) for w in V) + " " + " ".join(rs) +
                 f"   {det}; {kib}; {thp}")
    L.append("")
    L.append(f"seq-read ceiling, all {len(seqs)} in the run: median {seq_med:.3f} [{min(seqs):.3f}-{max(seqs):.3f}]; "
             f"in order {' '.join(f'{x:.2f}' for x in seqs)}")
    names = {"seq": "seq-read ceiling (1 thread, 16 MiB)", "dio8": "O_DIRECT 8 threads x 4 MiB ceiling",
             "A": "A reshard-t16 (not prepared)", "B": "B reshard-t16-prepared (prepare before drop)",
             "C": "C prepared after the drop", "E": "E prepared, 64 MiB pool"}
    for w in ("seq", "dio8", *V):
        xs = [r["gbps"] for r in ok if r["what"] == w]
        if not xs:
            continue
        per_round = [by[(rn, w)]["gbps"] / by[(rn, "seq")]["gbps"] for rn in rounds if (rn, w) in by and (rn, "seq") in by]
        bk = [r["block"] for r in ok if r["what"] == w and r.get("block")]
        L.append(f"{names[w]:46s} n={len(xs):2d} median {med(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]  "
                 f"/ run's seq median {med(xs) / seq_med:.3f}x  median of per-round ratios {med(per_round):.3f}x"
                 + (f"  disk: {med([b['reads'] for b in bk]):.0f} reads, {med([b['avg_read_kib'] for b in bk]):.0f} KiB avg, "
                    f"{med([b['ms_per_read'] for b in bk]):.2f} ms/read" if bk else ""))

    def sign(xs):
        n, k = len(xs), sum(1 for x in xs if x < 1)
        m = min(k, n - k)
        p = min(1.0, 2 * sum(math.comb(n, i) for i in range(m + 1)) / 2 ** n) if n else float("nan")
        if not xs:
            return "-"
        lg = [math.log(x) for x in xs]
        gm = math.exp(statistics.mean(lg))
        sd = statistics.stdev(lg) if len(lg) > 1 else 0
        return (f"median {med(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}], geo-mean {gm:.3f} (+-2se {math.exp(-2 * sd / math.sqrt(n)) * gm:.3f}-"
                f"{math.exp(2 * sd / math.sqrt(n)) * gm:.3f}), {k}/{n} below 1, sign test p={p:.3f}")
    L.append("")
    for (y, x), xs in paired.items():
        L.append(f"paired {y}/{x} (same round): {sign(xs)}")
    L.append("")
    L.append("by position in the round (0 = first after the ceilings), medians GB/s:")
    for w in V:
        L.append(f"  {w}: " + "  ".join(f"pos{p} {med([r['gbps'] for r in ok if r['what'] == w and r.get('pos') == p]):.3f}"
                                         f" (n={len([r for r in ok if r['what'] == w and r.get('pos') == p])})" for p in range(len(V))))
    L.append("")
    L.append("loader report medians (ms) per variant: seconds, read/lane, wait, first_copy, lane_start, reads_done, sync, "
             "staging_alloc, staging MiB; disk: reads, avg KiB, ms/read (read_ms/reads); io_ms")
    for w in V:
        rs = [r for r in ok if r["what"] == w]
        g = lambda k: med([r["report"].get(k, 0) for r in rs]) * 1e3  # noqa: E731
        bk = lambda k: med([(r.get("block") or {}).get(k, 0) for r in rs])  # noqa: E731
        L.append(f"  {w}: {g('seconds'):7.1f} {g('read_seconds'):7.1f} {g('wait_seconds'):6.2f} {g('first_copy_seconds'):6.2f} "
                 f"{g('lane_start_seconds'):6.2f} {g('reads_done_seconds'):7.1f} {g('sync_seconds'):5.2f} {g('staging_alloc_seconds'):5.2f} "
                 f"{g('staging_bytes') / 1e3 / 2**20:4.0f};"
                 f" disk {bk('reads'):.0f} reads, {bk('avg_read_kib'):.0f} KiB, {bk('ms_per_read'):.2f} ms/read, io_ms {bk('io_ms'):.0f};"
                 f" direct {sorted({r['report']['direct_io'] for r in rs})} lanes {sorted({r['report']['threads'] for r in rs})}")
    errs = [r for r in recs if not r.get("ok", True) or r.get("error")]
    if errs:
        L.append(f"errors: {len(errs)}: " + "; ".join(str(r.get('error'))[:200] for r in errs[:3]))
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--summarize":
        print(summarize(sys.argv[2]))
    else:
        main()
