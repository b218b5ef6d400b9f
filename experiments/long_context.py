"""Long context in miniature, judged by the protocol (experiments/protocol.py): Palindrome and MQAR sized
to a small recurrent state.

The claims (Kimi Linear, arXiv 2510.26692, §5.1): KDA's per-channel forget gate beats Gated DeltaNet's
one gate per head on Palindrome and multi-query associative recall (MQAR), more so with length; and the
3:1 hybrid keeps the exact recall a fixed-size state loses (its hybrid-ratio ablation).

Tasks (numpy, generated on the fly):
  Palindrome  L = T/2 random symbols, a separator, then the symbols reversed (teacher-forced); the targets
              are the L answer tokens. T in {32, 64, 128}: L = 16-64, 1-4x what a 16-dim head stores.
  MQAR        Zoology's layout: n key-value pairs, then queries: every later token is a key of the context
              and its target is that key's value, which is never restated. 256 keys, 16 values; n in
              {2, 4, 8, 16, 32, 48} at T = 128, and a distractor variant at T = 256: 16 pairs, then 64-128 random filler tokens the
              state must not let overwrite the pairs, then the queries.
Experiments (each trains on a round-robin of its conditions, equal tokens per step, AdamW, cosine):
  palindrome  arms K (KDA, channel gate) and K-head (Gated DeltaNet's head gate), KDA head dim 16; the
              control: attention with learned absolute positions (A-abs), which finds the mirror position
              2L-1-p that RoPE or NoPE attention would first have to compute.
  mqar        arms K, K-head, KKKA (3:1 hybrid, NoPE attention) and A (RoPE attention, the control), KDA
              head dim 8 so pure KDA saturates; parameters matched to K's through the MLP width. The
              control gates: A >= 0.9 at 8 pairs (gate rows), at 48 pairs (hybrid rows). On a 2-core CPU
              A plateaus far below (the README's pilots): a GPU-sized experiment.
Each arm trains to a plateau (stop once the mean held-out accuracy has gained < 0.01 over the last 20% of
the steps so far, at least 40% of --steps in, or every condition is >= 0.99), at its best lr of --lrs on the
tuning seed, then once per judging seed (same data order across arms).

    nice python experiments/long_context.py --exps palindrome --jobs 2   # the README's table (71 CPU-min)
    nice python experiments/long_context.py --exps mqar --arms A --lrs 1e-3 --pilot   # one arm, tuning seed only
    python experiments/long_context.py --quick                       # seconds (CI)

Writes long_context_<exp>.{md,png} and long_context.json under --out_dir.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import protocol  # noqa: E402
from hybrid import matched_mlp_hidden  # noqa: E402
from model import GPT, Config  # noqa: E402
from runs import bounded_list  # noqa: E402

OUT = os.path.join(ROOT, "out", "long_context")
ARMS = {  # name -> (Config fields, label)
    "K": (dict(pattern="K", kda_gate="channel"), "KDA (channel gate)"),
    "K-head": (dict(pattern="K", kda_gate="head"), "Gated DeltaNet (head gate)"),
    "KKKA": (dict(pattern="KKKA"), "hybrid 3:1 (NoPE attention)"),
    "A": (dict(pattern="A"), "attention (RoPE)"),
    "A-abs": (dict(pattern="A", rope="nope", pos_emb="learned"), "attention, learned positions"),
}
N_SYMBOLS, N_KEYS, N_VALUES, N_FILLER = 16, 256, 16, 64
LAYERS = {"palindrome": 2, "mqar": 4}   # 4 for the 3:1 hybrid; KDA's reference costs ~0.1 s per layer-step on one thread
TOKENS_PER_STEP = 1024


# ----------------------------------------------------------------------------------------------------- tasks
# each returns inputs [B, T] and targets [B, T] (int64; -1 where no loss is taken)

def palindrome_batch(rng, B, T, n_symbols):
    """Vocabulary: 0 separator, 1..n_symbols symbols. s_1..s_L, the separator, then s_L..s_2 as inputs; the
    targets at the separator and the answer tokens are s_L..s_1. An odd T ends in one extra separator."""
    L = T // 2
    if L < 1:
        raise ValueError(f"palindrome: T must be >= 2, got {T}")
    inputs = np.zeros((B, T), dtype=np.int64)
    targets = np.full((B, T), -1, dtype=np.int64)
    symbols = rng.integers(1, n_symbols + 1, size=(B, L))
    reverse = symbols[:, ::-1]                                            # s_L .. s_1
    inputs[:, :L] = symbols
    inputs[:, L + 1:2 * L] = reverse[:, :L - 1]                           # position L is the separator (0)
    targets[:, L:2 * L] = reverse
    return inputs, targets


def mqar_batch(rng, B, T, n_pairs, n_keys, n_values, gap=(0, 0), n_filler=0):
    """Zoology's layout. Vocabulary: 0 unused, 1..n_keys keys, then n_values values, then n_filler filler.
    A row: k_1 v_1 .. k_n v_n, a gap of gap[0]..gap[1] filler tokens (drawn per row), then queries to the
    end: keys of the context (each once before any repeats), the target at each its value."""
    if n_pairs > n_keys or 2 * n_pairs + gap[1] >= T or gap[0] > gap[1] or (gap[1] and not n_filler):
        raise ValueError(f"mqar: {n_pairs} pairs and a gap of {gap} need n_keys >= pairs, T > 2·pairs + gap and "
                         f"filler tokens for a gap; got n_keys={n_keys}, T={T}, n_filler={n_filler}")
    inputs = np.zeros((B, T), dtype=np.int64)
    targets = np.full((B, T), -1, dtype=np.int64)
    for b in range(B):
        keys = rng.choice(n_keys, size=n_pairs, replace=False) + 1
        values = rng.integers(0, n_values, size=n_pairs) + 1 + n_keys
        inputs[b, 0:2 * n_pairs:2], inputs[b, 1:2 * n_pairs:2] = keys, values
        start = 2 * n_pairs + int(rng.integers(gap[0], gap[1] + 1))
        inputs[b, 2 * n_pairs:start] = rng.integers(0, n_filler, size=start - 2 * n_pairs) + 1 + n_keys + n_values
        n_queries = T - start
        order = np.concatenate([rng.permutation(n_pairs), rng.integers(0, n_pairs, size=max(0, n_queries - n_pairs))])
        inputs[b, start:], targets[b, start:] = keys[order[:n_queries]], values[order[:n_queries]]
    return inputs, targets


def conditions(exp: str, quick: bool) -> dict:
    """{name: (T, batch(rng, B) -> (inputs, targets))}: what an experiment trains on and reports."""
    if exp == "palindrome":
        return {f"T={T}": (T, lambda rng, B, T=T: palindrome_batch(rng, B, T, N_SYMBOLS))
                for T in ((16, 32) if quick else (32, 64, 128))}
    T, gap_T = (64, 64) if quick else (128, 256)
    out = {f"{n} pairs": (T, lambda rng, B, n=n: mqar_batch(rng, B, T, n, N_KEYS, N_VALUES))
           for n in ((2, 8, 16) if quick else (2, 4, 8, 16, 32, 48))}
    gap = (8, 16) if quick else (64, 128)
    n_gap = 4 if quick else 16
    out[f"{n_gap} pairs, gap {gap[0]}-{gap[1]}"] = (gap_T, lambda rng, B: mqar_batch(rng, B, gap_T, n_gap, N_KEYS, N_VALUES,
                                                                                      gap, N_FILLER))
    return out


def train_batch(exp, conds, rng, step, tokens):
    """Round-robin: palindrome one length per step; MQAR the T=128 pair counts together, then the gap rows."""
    items = list(conds.values())
    if exp == "palindrome":
        T, fn = items[(step - 1) % len(items)]
        return fn(rng, max(1, tokens // T))
    if step % 2:
        T = items[0][0]
        per = max(1, tokens // T // (len(items) - 1))
        parts = [fn(rng, per) for _, fn in items[:-1]]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    T, fn = items[-1]
    return fn(rng, max(1, tokens // T))


# ------------------------------------------------------------------------------------------------ training

def model_config(exp: str, arm: str, quick: bool) -> Config:
    fields, _ = ARMS[arm]
    width, layers = (32, 2) if quick else (64, LAYERS[exp])
    vocab = 1 + N_SYMBOLS if exp == "palindrome" else 1 + N_KEYS + N_VALUES + N_FILLER
    base = dict(vocab_size=vocab, block_size=max(T for T, _ in conditions(exp, quick).values()), n_layer=layers,
                n_head=4, n_embd=width, kda_head_dim=16 if exp == "palindrome" else 8, backend="auto",
                tie_embeddings=exp == "mqar")     # MQAR's answer is a copy of a context token: tied, it starts closer
    if exp == "mqar" and arm != "K":          # parameters matched to pure KDA's through the SwiGLU width
        every_field = {**asdict(Config(**base, **fields)), "vision_ratio": 0.0}      # train.py's defaults differ
        base["mlp_hidden"] = matched_mlp_hidden(every_field, GPT(Config(**base, pattern="K")).num_params(), cuda=False)
    return Config(**base, **fields)


@torch.no_grad()
def evaluate(model, evalset: dict) -> dict:
    """{condition: (accuracy over target tokens, [accuracy at each target index within a row])}."""
    model.eval()
    out = {}
    for name, (inputs, targets) in evalset.items():
        logits, _ = model(torch.from_numpy(inputs))                       # [N, T, vocab]
        y = torch.from_numpy(targets)
        right = (logits.argmax(-1) == y) & (y >= 0)                       # [N, T]
        where = (y >= 0).float()
        per_pos = right.float().sum(0)[where.sum(0) > 0] / where.sum(0)[where.sum(0) > 0]
        out[name] = (right.sum().item() / where.sum().item(), per_pos.tolist())
    model.train()
    return out


def plateaued(curve: list, cap: int) -> bool:
    """Every condition solved, or (from 40% of the cap on) the mean accuracy gained < 0.01 over the last 20%
    of the steps so far."""
    step, mean = curve[-1]["step"], curve[-1]["mean"]
    if min(curve[-1]["acc"].values()) >= 0.99:
        return True
    earlier = [c["mean"] for c in curve if c["step"] <= 0.8 * step]
    return step >= 0.4 * cap and bool(earlier) and mean - earlier[-1] < 0.01


def run(exp: str, arm: str, seed: int, lr: float, steps: int, eval_every: int, out_root: str, quick: bool,
        reuse: bool = False) -> dict:
    """One arm on one seed at one lr, to a plateau or `steps` -> its accuracy curve and final accuracies."""
    saved = os.path.join(out_root, exp, arm, f"seed{seed}_lr{lr:g}_steps{steps}", "result.json")
    if reuse and os.path.exists(saved):
        with open(saved) as f:
            print(f"[{exp} {arm} seed {seed} lr {lr:g}] reused {saved}", flush=True)
            return json.load(f)
    t0 = time.time()
    conds, cfg = conditions(exp, quick), model_config(exp, arm, quick)
    eval_rng = np.random.default_rng([12345, len(exp)])                   # the same held-out rows for every run
    evalset = {name: fn(eval_rng, 8 if quick else 32) for name, (T, fn) in conds.items()}
    torch.manual_seed(seed)
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]               # no decay on gains, biases, A_log, dt_bias
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.01), dict(params=no_decay, weight_decay=0.0)],
                            lr=lr, betas=(0.9, 0.98))
    rng, warmup, tokens = np.random.default_rng([seed, 1]), max(1, steps // 20), 256 if quick else TOKENS_PER_STEP
    curve = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:                                    # warmup, then cosine to 0.1 lr
            group["lr"] = lr * (step / warmup if step <= warmup else
                                0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))
        inputs, targets = train_batch(exp, conds, rng, step, tokens)
        _, loss = model(torch.from_numpy(inputs), torch.from_numpy(targets), loss_only=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0 or step == steps:
            result = evaluate(model, evalset)
            acc = {name: a for name, (a, _) in result.items()}
            curve.append(dict(step=step, loss=loss.item(), acc=acc, mean=statistics.fmean(acc.values())))
            print(f"[{exp} {arm} seed {seed} lr {lr:g}] step {step} loss {loss.item():.3f} " +
                  " ".join(f"{k}: {a:.3f}" for k, a in acc.items()) + f" ({time.time() - t0:.0f}s)", flush=True)
            if plateaued(curve, steps):
                break
    out = dict(exp=exp, arm=arm, seed=seed, lr=lr, cap=steps, steps=curve[-1]["step"], curve=curve,
               final=curve[-1]["acc"], mean=curve[-1]["mean"], per_position={k: p for k, (_, p) in result.items()},
               n_params=model.num_params(), mlp_hidden=cfg.mlp_hidden, seconds=time.time() - t0)
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    with open(saved, "w") as f:
        json.dump(out, f)
    return out


def area_under_curve(r: dict, eval_every: int) -> float:
    """Mean accuracy (over conditions) along the eval grid up to the cap, the last value carried past a stop."""
    means = [c["mean"] for c in r["curve"]]
    return statistics.fmean(means + [means[-1]] * max(0, r["cap"] // eval_every - len(means)))


def steps_to(r: dict, cond: str, level: float = 0.5):
    return next((c["step"] for c in r["curve"] if c["acc"][cond] >= level), None)


# --------------------------------------------------------------------------------------------------- verdicts

def judge(exp: str, judged: list, names: list, eval_every: int) -> list:
    """The claims of one experiment, each a row: (claim, Paired, verdict, where it holds)."""
    by = {}
    for r in judged:
        by.setdefault(r["arm"], {})[r["seed"]] = r

    def acc(arm, cond):
        return {s: r["final"][cond] for s, r in by[arm].items()}

    def mean_of(arm, conds):
        return {s: statistics.fmean(r["final"][c] for c in conds) for s, r in by[arm].items()}

    rows = []

    def row(claim, p, sign, passed):
        rows.append((claim, p, protocol.verdict(p, sign, passed), f"{p.holds(sign)}/{len(p.seeds)} seeds"))

    def control(arm, cond):
        level = statistics.fmean(acc(arm, cond).values())
        passed = level >= 0.9
        rows.append((f"control: {arm} reaches 0.9 at {cond} (mean {level:.3f})", protocol.paired(acc(arm, cond), {s: 0.9 for s in acc(arm, cond)}),
                     "passed" if passed else "FAILED", f"{sum(a >= 0.9 for a in acc(arm, cond).values())}/{len(acc(arm, cond))} seeds"))
        return passed

    if exp == "palindrome":
        passed = control("A-abs", names[0])
        row("KDA's channel gate beats the head gate (K - K-head, mean over lengths)",
            protocol.paired(mean_of("K", names), mean_of("K-head", names)), +1, passed)
        for cond in names:
            row(f"... at {cond}", protocol.paired(acc("K", cond), acc("K-head", cond)), +1, passed)
        def gap(cond):                                                    # K - K-head, seed by seed
            return {s: by["K"][s]["final"][cond] - by["K-head"][s]["final"][cond] for s in by["K"]}
        row(f"the gap grows with length (gap at {names[-1]} - gap at {names[0]})",
            protocol.paired(gap(names[-1]), gap(names[0])), +1, passed)
        return rows
    distract, over = names[-1], names[-2]                                 # the gap rows; the most pairs
    recall = [c for c in names[:-2] if int(c.split()[0]) >= 8]             # 8, 16, 32 pairs: the range
    passed = control("A", "8 pairs")
    row(f"KDA's channel gate beats the head gate (K - K-head, mean over {', '.join(recall)})",
        protocol.paired(mean_of("K", recall), mean_of("K-head", recall)), +1, passed)
    auc = {arm: {s: area_under_curve(r, eval_every) for s, r in by[arm].items()} for arm in ("K", "K-head")}
    row("... in area under the accuracy curve (mean over conditions)", protocol.paired(auc["K"], auc["K-head"]), +1, passed)
    row(f"... with distractors ({distract})", protocol.paired(acc("K", distract), acc("K-head", distract)), +1,
        control("A", distract))
    gate = control("A", over)
    row(f"the 3:1 hybrid beats pure KDA over capacity (KKKA - K at {over})", protocol.paired(acc("KKKA", over), acc("K", over)), +1, gate)
    row(f"... at {recall[-1]}", protocol.paired(acc("KKKA", recall[-1]), acc("K", recall[-1])), +1, gate)
    return rows


def report(args, exp, names, tuned, best, judged, claims):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = list(best)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    hardest = names[-1] if exp == "palindrome" else names[-2]
    for i, arm in enumerate(arms):
        rs = sorted((r for r in judged if r["arm"] == arm), key=lambda r: r["seed"])
        label = f"{arm}: {ARMS[arm][1]}, lr {best[arm]:g}"
        for r in rs:
            axes[0].plot(range(len(names)), [r["final"][c] for c in names], color=f"C{i}", alpha=0.3, lw=1)
            axes[1].plot([c["step"] for c in r["curve"]], [c["acc"][hardest] for c in r["curve"]], color=f"C{i}",
                         alpha=0.6, lw=1, label=label if r is rs[0] else None)
        axes[0].plot(range(len(names)), [statistics.fmean(r["final"][c] for r in rs) for c in names], marker="o",
                     color=f"C{i}", label=label)
        pos = np.mean([r["per_position"][hardest] for r in rs], axis=0)
        axes[2].plot(range(len(pos)), pos, color=f"C{i}", label=arm)
    axes[0].set_xticks(range(len(names)), names, fontsize=7)
    axes[0].set_title(f"{exp}: plateau accuracy (mean line, seeds faint)", fontsize=9)
    axes[1].set_title(f"{exp}: accuracy at {hardest} vs step, each judging seed", fontsize=9)
    axes[1].set_xlabel("step")
    axes[2].set_title(f"{exp}: accuracy by target index at {hardest}, mean of seeds", fontsize=9)
    axes[2].set_xlabel("target index (palindrome: 0 = the last symbol before the separator)", fontsize=8)
    for ax in axes:
        ax.set_ylim(-0.02, 1.02), ax.grid(alpha=0.3)
        ax.axhline(1 / (N_SYMBOLS if exp == "palindrome" else N_VALUES), color="gray", ls="--", lw=1)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    png = os.path.join(args.out_dir, f"long_context_{exp}.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)

    cfg = model_config(exp, "K", args.quick)
    lines = [f"{exp}: CPU, one thread per run, {args.jobs} side by side; {cfg.n_layer} layers, width {cfg.n_embd}, "
             f"{cfg.n_head} heads, KDA head dim {cfg.kda_head_dim}; AdamW, cosine, cap {args.steps} steps of {TOKENS_PER_STEP} "
             f"tokens, stopped at a plateau; lr grid {', '.join(f'{x:g}' for x in args.lrs)} on tuning seed "
             f"{args.seed}; judging seeds {', '.join(map(str, args.seeds))}; "
             f"{sum(r['seconds'] for r in tuned + judged) / 60:.0f} CPU-minutes in the runs.", "",
             "| arm | params (non-emb.) | lr (tuning seed: mean acc per lr) | " + " | ".join(names) +
             " | steps run | steps to 0.5 at " + hardest + " |", "|---|---|---|" + "---|" * (len(names) + 2)]
    for arm in arms:
        rs = sorted((r for r in judged if r["arm"] == arm), key=lambda r: r["seed"])
        grid = ", ".join(f"{r['lr']:g}: {r['mean']:.3f}" for r in sorted(tuned, key=lambda r: r["lr"]) if r["arm"] == arm)
        cells = [f"{statistics.fmean(r['final'][c] for r in rs):.3f} (" + " / ".join(f"{r['final'][c]:.2f}" for r in rs) + ")"
                 for c in names]
        reach = [steps_to(r, hardest) for r in rs]
        lines.append(f"| {arm} | {rs[0]['n_params']:,} | **{best[arm]:g}** ({grid}) | " + " | ".join(cells) +
                     f" | {' / '.join(str(r['steps']) for r in rs)} | {' / '.join(str(x) if x else 'never' for x in reach)} |")
    lines += ["", "| claim | paired difference (mean ± SE) | holds in | verdict |", "|---|---|---|---|"]
    for claim, p, v, holds in claims:
        lines.append(f"| {claim} | {p} | {holds} | **{v}** |")
    with open(os.path.join(args.out_dir, f"long_context_{exp}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return png


def pilot_table(args, exp, names, tuned):
    """long_context_<exp>_pilot.md: each tuning run's final accuracies, steps run and seconds."""
    lines = [f"{exp} pilot: tuning seed {args.seed}, cap {args.steps} steps of {TOKENS_PER_STEP} tokens, one thread", "",
             "| arm | lr | " + " | ".join(names) + " | steps run | seconds |", "|---|---|" + "---|" * (len(names) + 2)]
    lines += [f"| {r['arm']} | {r['lr']:g} | " + " | ".join(f"{r['final'][c]:.3f}" for c in names) +
              f" | {r['steps']} | {r['seconds']:.0f} |" for r in tuned]
    with open(os.path.join(args.out_dir, f"long_context_{exp}_pilot.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description="Palindrome and MQAR: KDA's channel gate vs the head gate, the 3:1 hybrid "
                                 "vs pure KDA over capacity, each arm at its best lr, judged on seeds apart",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    protocol.add_flags(ap, OUT, steps=1500, eval_every=50)
    ap.set_defaults(seeds=[101, 102, 103, 104, 105])    # 5 judging seeds: a Palindrome arm-seed takes <= 5 min
    ap.add_argument("--exps", default="palindrome,mqar", help="experiments (comma list): palindrome, mqar")
    ap.add_argument("--lrs", type=bounded_list(float, 1e-12, 1e3), default="1e-3,3e-3,1e-2", help="each arm's lr grid, tried on --seed")
    ap.add_argument("--arms", default="", help="a subset of the experiment's arms (comma list; default all)")
    ap.add_argument("--pilot", action="store_true", help="only the tuning seed's runs and a table of them: no verdicts")
    ap.add_argument("--reuse", action="store_true", help="read finished runs from their result.json")
    args = ap.parse_args()
    protocol.check_seeds(args)
    args.exps = [e for e in args.exps.split(",") if e]
    if not args.exps or set(args.exps) - {"palindrome", "mqar"}:
        raise SystemExit(f"error: --exps={','.join(args.exps)}: use palindrome and/or mqar (comma list)")
    if args.quick:
        args.steps, args.eval_every, args.lrs, args.seeds, args.jobs = 4, 2, args.lrs[:2], args.seeds[:2], 1
    torch.set_num_threads(1)
    os.makedirs(args.out_dir, exist_ok=True)
    everything = {}
    for exp in args.exps:
        arms = ["A-abs", "K", "K-head"] if exp == "palindrome" else ["A", "K", "K-head", "KKKA"]
        if args.arms:
            if set(args.arms.split(",")) - set(arms):
                raise SystemExit(f"error: --arms={args.arms}: {exp}'s arms are {', '.join(arms)}")
            arms = [a for a in arms if a in args.arms.split(",")]
        names = list(conditions(exp, args.quick))

        def jobs(lr_of, seeds):
            return [dict(exp=exp, arm=a, seed=s, lr=lr, steps=args.steps, eval_every=args.eval_every,
                         out_root=args.out_dir, quick=args.quick, reuse=args.reuse)
                    for s in seeds for a in arms for lr in lr_of[a]]

        tuned = protocol.run_jobs(run, jobs({a: args.lrs for a in arms}, [args.seed]), args.jobs)
        best = {a: protocol.best_lr({r["lr"]: [r["mean"]] for r in tuned if r["arm"] == a}, lower_is_better=False)
                for a in arms}
        if args.pilot:
            pilot_table(args, exp, names, tuned)
            continue
        judged = protocol.run_jobs(run, jobs({a: [best[a]] for a in arms}, args.seeds), args.jobs)
        claims = judge(exp, judged, names, args.eval_every)
        report(args, exp, names, tuned, best, judged, claims)
        everything[exp] = dict(tuned=tuned, best=best, judged=judged,
                               claims=[dict(claim=c, paired=vars(p), verdict=v, holds=h) for c, p, v, h in claims])
    if everything:
        with open(os.path.join(args.out_dir, "long_context.json"), "w") as f:
            json.dump(everything, f)


if __name__ == "__main__":
    main()
