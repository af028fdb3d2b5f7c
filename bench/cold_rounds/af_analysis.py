#!/usr/bin/env python3
"""Run AF analysis: paired ratios, a fixed-effects model (log GB/s ~ round + variant + position)
and within-round permutation tests, over cold2.py JSONL files. Needs numpy.
  python3 bench/cold_rounds/af_analysis.py AF1=run1/cold2.jsonl:ABC AF2=run2/cold2.jsonl:ABE"""
import json
import math
import random
import statistics as st
import sys
import numpy as np

TQ = {11: 2.201, 18: 2.101, 20: 2.086, 30: 2.042, 32: 2.037, 34: 2.032, 36: 2.028}


def tq(dof):
    return TQ.get(dof, 2.0)


def perm_p(by, rounds, V, x, y, N=20000):
    obs = st.mean(math.log(by[(n, x)]['gbps'] / by[(n, y)]['gbps']) for n in rounds)
    random.seed(2)
    c = 0
    for _ in range(N):
        s = 0
        for n in rounds:
            p = list(V); random.shuffle(p); inv = {q: w for w, q in zip(V, p)}
            s += math.log(by[(n, inv[x])]['gbps'] / by[(n, inv[y])]['gbps'])
        c += abs(s / len(rounds)) >= abs(obs) - 1e-12
    return c / N


allBA = []
for arg in sys.argv[1:]:
    tag, rest = arg.split('=', 1)
    p, V = rest.rsplit(':', 1)
    ok = [r for r in (json.loads(l) for l in open(p)) if r.get('gbps')]
    by = {(r['round'], r['what']): r for r in ok if r['round'] >= 0}
    rounds = sorted({r['round'] for r in ok if r['round'] >= 0})
    X, y = [], []
    for r in (r for r in ok if r['what'] in V):
        X.append([1.0 if r['round'] == n else 0.0 for n in rounds] +
                 [float(r['what'] == V[1]), float(r['what'] == V[2]), float(r['pos'] == 1), float(r['pos'] == 2)])
        y.append(math.log(r['gbps']))
    X, y = np.array(X), np.array(y)
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    res = y - X @ beta; dof = len(y) - X.shape[1]; s2 = res @ res / dof
    se = np.sqrt(np.diag(s2 * np.linalg.inv(X.T @ X)))
    print(f"{tag}: {len(rounds)} rounds, variants {V}")
    for name, i in ((f'{V[1]} vs A', -4), (f'{V[2]} vs A', -3), ('position 1 vs 0', -2), ('position 2 vs 0', -1)):
        print(f"  model {name}: x{math.exp(beta[i]):.3f}, 95% CI x{math.exp(beta[i] - tq(dof) * se[i]):.3f}-x{math.exp(beta[i] + tq(dof) * se[i]):.3f}, t={beta[i] / se[i]:.2f} (dof {dof})")
    print(f"  model residual sd per measurement: {math.sqrt(s2):.3f} (log)")
    seqs = [r['gbps'] for r in ok if r['what'] == 'seq']
    print(f"  seq-read ceiling: n={len(seqs)} median {st.median(seqs):.3f} [{min(seqs):.3f}-{max(seqs):.3f}]")
    for w in V:
        xs = [by[(n, w)]['gbps'] for n in rounds]
        d = [math.log(by[(n, w)]['gbps'] / by[(n, 'seq')]['gbps']) for n in rounds]
        print(f"  {w}: median {st.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}], / run's seq median {st.median(xs) / st.median(seqs):.3f}x, "
              f"median of per-round ratios {math.exp(st.median(d)):.3f}x")
    for x, yv in ((V[1], 'A'), (V[2], 'A'), (V[2], V[1])):
        d = [math.log(by[(n, x)]['gbps'] / by[(n, yv)]['gbps']) for n in rounds]
        m, s, n = st.mean(d), st.stdev(d), len(d)
        print(f"  paired {x}/{yv}: geo-mean {math.exp(m):.3f}, 95% CI {math.exp(m - tq(n - 1) * s / math.sqrt(n)):.3f}-"
              f"{math.exp(m + tq(n - 1) * s / math.sqrt(n)):.3f}, {sum(v < 0 for v in d)}/{n} below 1, within-round permutation p={perm_p(by, rounds, V, x, yv):.3f}")
        if (x, yv) == ('B', 'A'):
            allBA += d
if allBA:
    m, s, n = st.mean(allBA), st.stdev(allBA), len(allBA)
    print(f"all calls, paired B/A: geo-mean {math.exp(m):.3f}, 95% CI {math.exp(m - tq(n - 1) * s / math.sqrt(n)):.3f}-"
          f"{math.exp(m + tq(n - 1) * s / math.sqrt(n)):.3f}, {sum(v < 0 for v in allBA)}/{n} below 1; sd of one pair's log ratio {s:.3f}")
