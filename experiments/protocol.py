"""What makes a comparison decide a paper's claim here (DESIGN.md, "Benchmarks and experiments").

    1. a positive control passes first, or the row reads "not testable at this scale" with its numbers;
    2. each arm at its own learning rate, the best of a small grid on tuning seeds   (best_lr);
    3. judging seeds that played no part in tuning, listed apart, the same data order across arms;
    4. the seed-paired difference d_s = a_s - b_s decides, as mean ± SE:            (paired, verdict)
           SE = stdev(d) / sqrt(n);  reproduces  iff  sign · mean(d) > 2 SE  (sign: the paper's direction),
       an equivalence claim ("costs nothing") iff |mean(d)| + 2 SE <= a margin stated in advance, a
       non-inferiority claim ("does not hurt") iff mean(d) + 2 SE <= that margin.
Plus the curve reading the token-ratio claims need: tokens to reach a loss.

Test: python -m pytest tests/test_protocol.py -q
"""
import math
import multiprocessing as mp
import os
import statistics
from dataclasses import dataclass

from runs import bounded, bounded_list

REPRODUCES, DOES_NOT, NOT_TESTABLE = "reproduces", "does not reproduce", "not testable at this scale"


@dataclass
class Paired:
    """Seed-paired comparison of arm a against arm b over the seeds both have."""
    seeds: list
    diffs: list        # a_s - b_s, seed by seed
    mean_a: float
    mean_b: float
    diff: float        # mean of a_s - b_s
    se: float          # standard error of that mean (nan for one seed)

    def holds(self, sign: int) -> int:
        """Seeds whose own difference has the claimed sign (+1: a above b, -1: a below b)."""
        return sum(1 for d in self.diffs if sign * d > 0)

    def __str__(self):
        return f"{self.diff:+.4f} ± {self.se:.4f} (n = {len(self.seeds)})"


def paired(a: dict, b: dict) -> Paired:
    """a, b: {seed: value} -> Paired over the seeds in both (at least one)."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError(f"paired: no seed in common ({sorted(a)} vs {sorted(b)})")
    diffs, n = [a[s] - b[s] for s in seeds], len(seeds)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else math.nan   # nan stays nan
    return Paired(seeds, diffs, sum(a[s] for s in seeds) / n, sum(b[s] for s in seeds) / n, mean, se)


def verdict(p: Paired, sign: int, control_passed: bool = True) -> str:
    """The claim "a - b has sign `sign`" from judging seeds: beyond 2 SE in that direction, or not."""
    if not control_passed:
        return NOT_TESTABLE
    return REPRODUCES if len(p.seeds) > 1 and sign * p.diff > 2 * p.se else DOES_NOT


def equivalence_verdict(p: Paired, margin: float, control_passed: bool = True) -> str:
    """The claim "a costs nothing against b": the 2-SE interval of the difference inside ±margin."""
    if not control_passed:
        return NOT_TESTABLE
    return REPRODUCES if len(p.seeds) > 1 and abs(p.diff) + 2 * p.se <= margin else DOES_NOT


def noninferiority_verdict(p: Paired, margin: float, control_passed: bool = True) -> str:
    """The claim "a is not worse than b" (lower is better): mean(a - b) + 2 SE below a margin stated in advance."""
    if not control_passed:
        return NOT_TESTABLE
    return REPRODUCES if len(p.seeds) > 1 and p.diff + 2 * p.se <= margin else DOES_NOT


def best_lr(results: dict, lower_is_better: bool = True) -> float:
    """{lr: [metric on each tuning seed]} -> the lr with the best mean (ties: the smaller lr)."""
    if not results:
        raise ValueError("best_lr: no results")
    key = (lambda lr: (statistics.fmean(results[lr]), lr)) if lower_is_better else \
        (lambda lr: (-statistics.fmean(results[lr]), lr))
    return min(results, key=key)


def tokens_to_reach(curve: list, target: float):
    """Tokens a run needs to bring its loss down to target: curve [(tokens, loss), ...] in order, linearly
    interpolated between the two evals around the first crossing; None if it never gets there."""
    prev = None
    for x, v in curve:
        if v <= target:
            if prev is None or prev[1] == v:
                return x
            x0, v0 = prev
            return x0 + (x - x0) * (v0 - target) / (v0 - v)
        prev = (x, v)
    return None


def add_flags(ap, out_dir: str, steps: int, eval_every: int):
    """The flags every judged experiment shares: run length, the tuning seed, the judging seeds, side-by-side jobs."""
    ap.add_argument("--steps", type=bounded(int, 1), default=steps, help="training steps per run")
    ap.add_argument("--eval_every", type=bounded(int, 1), default=eval_every, help="steps between val evaluations")
    ap.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=1337,
                    help="the tuning seed: it picks each arm's lr (or the setting) and judges nothing")
    ap.add_argument("--seeds", type=bounded_list(int, 0, 2**63 - 1), default="101,102,103",
                    help="judging seeds (comma list), none of them the tuning seed")
    ap.add_argument("--jobs", type=bounded(int, 1, 64), default=1, help="runs side by side (one per core), one thread each")
    ap.add_argument("--out_dir", default=out_dir, help="output folder (one sub-folder per run)")
    ap.add_argument("--quick", action="store_true", help="a seconds-long smoke run of the whole protocol (CI)")


def check_seeds(args):
    """A judging seed that is also the tuning seed judges its own choice: refused in one line."""
    if args.seed in args.seeds:
        raise SystemExit(f"error: --seed={args.seed} (the tuning seed) is also a judging seed; judge on seeds that chose nothing")


def _one_thread(fn_and_kwargs):
    import torch
    torch.set_num_threads(1)
    fn, kwargs = fn_and_kwargs
    return fn(**kwargs)


def run_jobs(fn, jobs: list, processes: int = 1) -> list:
    """fn(**kwargs) for every kwargs in jobs, in order; processes > 1 runs them side by side, one thread
    each, niced (one arm-seed per core on a shared machine)."""
    if processes <= 1:
        return [fn(**kwargs) for kwargs in jobs]
    with mp.get_context("fork").Pool(processes, initializer=os.nice, initargs=(5,)) as pool:
        return pool.map(_one_thread, [(fn, kwargs) for kwargs in jobs], chunksize=1)
