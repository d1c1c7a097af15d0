"""Benchmark: what the stall layers cost the collector's derivation, per paired request.

For every request seen at both boundaries, derivation finds the engine core's and the HTTP
server's gap over the two tokens that bound the client's largest gap
(:func:`collector.pipeline.stalls.stall_layers`). Synthetic pairs of 64 token events, 70% of them with
the engine core's generation times and 70% with the server's body-chunk times (as vLLM with the
plugin sends them): prints microseconds per pair with the arrays, and without them (the same
pairs, nothing to look up), from one run.

Run: ``.venv/bin/python benchmarks/stall_layers.py [--pairs 5000] [--tokens 64]``
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from collector.pipeline.stalls import stall_layers


def pairs(n: int, tokens: int, rng: np.random.Generator, with_arrays: bool):
    """Arguments of stall_layers for ``n`` (client, engine) pairs of ``tokens`` events each."""
    offs, toks, submit, counts = [], [], [], []
    gen: list = [None] * (2 * n)
    chunks: list = [None] * (2 * n)
    for p in range(n):
        for _ in range(2):
            gaps = rng.exponential(5e6, tokens).astype(np.int64)
            gaps[rng.integers(0, tokens)] += 300_000_000  # one stall
            offs.append(np.cumsum(gaps))
            toks.append(np.ones(tokens, np.int64))
            counts.append(tokens)
        s_e = 1_800_000_000_000_000_000 + p * 10**9
        submit += [s_e - 10**6, s_e]
        eo = offs[-1]
        if with_arrays and rng.random() < 0.7:
            gen[2 * p + 1] = (s_e + eo - rng.integers(0, 10**6, tokens), None)
        if with_arrays and rng.random() < 0.7:
            chunks[2 * p + 1] = np.sort(s_e + eo + rng.integers(0, 10**6, tokens))
    st = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return (
        np.arange(0, 2 * n, 2),
        np.arange(1, 2 * n, 2),
        np.array(submit, np.int64),
        st,
        np.concatenate(offs),
        np.concatenate(toks),
        gen,
        chunks,
    )


def best_of(fn, args, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5000)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    full, bare = pairs(a.pairs, a.tokens, rng, True), pairs(a.pairs, a.tokens, rng, False)
    core, server = stall_layers(*full)
    t_full, t_bare = best_of(stall_layers, full), best_of(stall_layers, bare)
    print(
        f"{a.pairs} pairs x {a.tokens} token events; core gap known for {int(np.isfinite(core).sum())}, "
        f"server gap for {int(np.isfinite(server).sum())}"
    )
    print(
        f"stall layers with the arrays: {t_full / a.pairs * 1e6:.2f} us per pair "
        f"({t_full / (a.pairs * a.tokens * 2) * 1e9:.0f} ns per token event)"
    )
    print(f"without them: {t_bare / a.pairs * 1e6:.2f} us per pair; with / without: {t_full / t_bare:.2f}")


if __name__ == "__main__":
    main()
