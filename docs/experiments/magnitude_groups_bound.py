"""EXPERIMENT: what coding change positions by K magnitude groups instead of 32 exponent
classes would cost in bytes, as entropy bounds (issue 25; docs/design/fast-data-plane.md §13).

For every part of 2^22 elements of a codec-bench cache pair (`codec-bench --cache-dir DIR`
writes them), it sums n*H(k/n) over the part's classes: all 256 exponents, the 32 classes of
`exp-class-gaps` (`docs/format.md`), a single class (plain gaps), and the best partition of the
32 classes into K contiguous groups (dynamic programming), for K = 2..8.

    python3 magnitude_groups_bound.py /var/tmp/codec-cache/100m-lr4e-7-seed7.pair

Needs numpy. Prints bytes per change of the position bound, and each as a multiple of c32.
"""
import numpy as np, sys, struct
def H(k, n):
    k = np.asarray(k, float); n = np.asarray(n, float)
    out = np.zeros_like(k)
    m = (k > 0) & (k < n)
    p = k[m] / n[m]
    out[m] = -n[m] * (p*np.log2(p) + (1-p)*np.log2(1-p))
    return out.sum()
def best_partition(n, k, K):
    # contiguous groups over exponent bins with n>0; DP minimising total entropy
    idx = np.nonzero(n)[0]; n = n[idx]; k = k[idx]; m = len(n)
    cn = np.concatenate([[0], np.cumsum(n)]); ck = np.concatenate([[0], np.cumsum(k)])
    def cost(a, b):
        return H([ck[b]-ck[a]], [cn[b]-cn[a]])
    INF = 1e300
    dp = np.full((K+1, m+1), INF); dp[0][0] = 0
    for g in range(1, K+1):
        for b in range(1, m+1):
            dp[g][b] = min(dp[g-1][a] + cost(a, b) for a in range(0, b))
    return min(dp[g][m] for g in range(1, K+1))
path = sys.argv[1]
b = open(path, 'rb').read(); off = 0
PART = 1 << 22
tot = {}
nchg = 0
while off < len(b):
    L = struct.unpack_from('<Q', b, off)[0]; off += 8
    name = b[off:off+L].decode(); off += L
    n = struct.unpack_from('<Q', b, off)[0]; off += 8
    o = np.frombuffer(b, '<u2', n, off); off += 2*n
    w = np.frombuffer(b, '<u2', n, off); off += 2*n
    for s in range(0, n, PART):
        oo = o[s:s+PART]; ww = w[s:s+PART]
        ch = oo != ww
        e = (oo >> 7) & 0xFF
        ne = np.bincount(e, minlength=256).astype(float)
        ke = np.bincount(e[ch], minlength=256).astype(float)
        nchg += ch.sum()
        c32 = np.clip(np.arange(256), 100, 131)
        n32 = np.bincount(c32, weights=ne, minlength=256); k32 = np.bincount(c32, weights=ke, minlength=256)
        r = {'all256': H(ke, ne), 'c32': H(k32, n32), 'plain': H([ke.sum()], [ne.sum()])}
        for K in (2, 3, 4, 5, 6, 8):
            r['K%d' % K] = best_partition(n32, k32, K) if ke.sum() > 0 else 0.0
        for key, v in r.items(): tot[key] = tot.get(key, 0) + v
print(path.split('/')[-1], 'changes', nchg)
for key, v in tot.items():
    print(f"  {key:7s} {v/8/nchg:.4f} bytes/change  x{v/tot['c32']:.3f} of c32")
