"""QK-Clip on/off in a deliberately unstable setting: max attention logits with and without the clip.

The claim (Kimi K2, arXiv 2507.20534): with plain Muon, attention max logits can grow without bound
(past 1000 in K2's mid-scale run); QK-Clip holds every head at or below τ after each step and leaves
the loss trajectory unharmed (Su: even τ = 30 made no difference on small models).

Setting, chosen to make logits run away at CPU scale: Muon with a high learning rate (0.1, 10x the
best Muon lr of muon_vs_adamw.py's sweep), wide heads (2 heads of 64 dims), no QK-norm, no weight decay.
Runs: Muon without clip, MuonClip τ = 100 (K2's value) and τ = 30. Same model, data order, schedule.

What is logged each step is the max logit the forward pass saw, i.e. *before* that step's clip; after
the clip it is at most τ by construction, and one update later it can sit a little above τ again.

Judged (experiments/protocol.py) on seeds other than the one the setting was chosen on: the max-logit
claim in every seed, the loss claim as a non-inferiority margin stated in advance (MARGIN).

    nice python experiments/qk_clip.py --jobs 2       # writes out/qk_clip/qk_clip.{png,md}
    python experiments/qk_clip.py --quick              # seconds (CI)
"""
import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import protocol  # noqa: E402
import train  # noqa: E402
from runs import bounded, bounded_list  # noqa: E402
from muon_vs_adamw import compact_corpus, model_settings  # noqa: E402

OUT = os.path.join(ROOT, "out", "qk_clip")


def run(name, steps, eval_every, out_root=OUT, seed=1337, **kw):
    t0 = time.time()
    res = train.train(out_dir=os.path.join(out_root, f"{name}_seed{seed}"), overwrite=True, max_iters=steps,
                      warmup_iters=max(1, steps // 20), eval_interval=eval_every, log_interval=1, eval_iters=8,
                      ckpt_interval=10 ** 9, seed=seed, **kw)
    hist = res["history"]
    out = dict(name=name, seed=seed, steps=[h["step"] for h in hist],
               max_logit=[max(h["max_logit"]) for h in hist],              # max over layers and heads
               clipped=[sum(h["clipped_heads"]) for h in hist],
               evals=[(h["step"], h["val_loss"]) for h in hist if "val_loss" in h],
               final=res["final_val_loss"], seconds=time.time() - t0)
    print(f"[{name} seed {seed}] final val {out['final']:.4f}, peak max logit {max(out['max_logit']):.1f} "
          f"in {out['seconds']:.0f}s", flush=True)
    return out


def after_first_clip(r) -> float:
    """The largest max logit a forward saw after the run's first clip (nan if it never clipped)."""
    first = next((i for i, c in enumerate(r["clipped"]) if c > 0), None)
    return max(r["max_logit"][first + 1:], default=math.nan) if first is not None else math.nan


MARGIN = 0.02   # "without hurting loss": clip − no clip val loss below +0.02 nats at 2 SE, stated before judging


def main():
    ap = argparse.ArgumentParser(description="QK-Clip on/off: max attention logits and val loss with Muon at a "
                                             "deliberately high lr, without and with clipping at each tau",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    protocol.add_flags(ap, OUT, steps=300, eval_every=25)
    ap.add_argument("--lr", type=bounded(float, 1e-12, 1e3), default=0.1, help="Muon lr, high enough to make logits run away")
    ap.add_argument("--taus", type=bounded_list(float, 1e-6, 1e9), default="100,30", help="comma-separated QK-Clip thresholds; the first is judged")
    args = ap.parse_args()
    seeds, taus = args.seeds, args.taus
    protocol.check_seeds(args)
    settings = model_settings(4096)
    settings.update(n_layer=2, n_head=2, data=compact_corpus(4096), lr=args.lr, weight_decay=0.0, threads=1)
    if args.quick:
        args.steps, args.eval_every, seeds, args.jobs = 4, 2, seeds[:2], 1
        settings.update(n_embd=32, block_size=16, batch_size=2)
    jobs = [dict(name="muon_no_clip", optimizer="muon", seed=seed) for seed in seeds] + \
        [dict(name=f"muonclip_tau{tau:g}", optimizer="muonclip", qk_clip_tau=tau, seed=seed) for seed in seeds for tau in taus]
    runs = protocol.run_jobs(run, [dict(steps=args.steps, eval_every=args.eval_every, out_root=args.out_dir,
                                        **settings, **job) for job in jobs], args.jobs)
    by = {(r["name"], r["seed"]): r for r in runs}
    tau, judged = taus[0], f"muonclip_tau{taus[0]:g}"
    runaway = {s: max(by["muon_no_clip", s]["max_logit"]) for s in seeds}
    held = {s: after_first_clip(by[judged, s]) for s in seeds}
    loss = protocol.paired({s: by[judged, s]["final"] for s in seeds}, {s: by["muon_no_clip", s]["final"] for s in seeds})
    verdicts = (protocol.REPRODUCES if all(v > 10 * tau for v in runaway.values()) else protocol.DOES_NOT,
                protocol.REPRODUCES if all(v <= tau for v in held.values()) else protocol.DOES_NOT,
                protocol.noninferiority_verdict(loss, MARGIN))
    report(args, settings, seeds, taus, runs, by, runaway, held, loss, verdicts)


def report(args, settings, seeds, taus, runs, by, runaway, held, loss, verdicts):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["muon_no_clip"] + [f"muonclip_tau{t:g}" for t in taus]
    for name, color in zip(names, ("tab:red", "tab:blue", "tab:green", "tab:purple")):
        for k, seed in enumerate(seeds):
            r = by[name, seed]
            ax1.plot(r["steps"], r["max_logit"], color=color, lw=1.0, alpha=0.8, label=name if k == 0 else None)
            ax2.plot([s for s, _ in r["evals"]], [v for _, v in r["evals"]], "o-", color=color, ms=2, lw=0.8,
                     alpha=0.8, label=name if k == 0 else None)
    for tau in taus:
        ax1.axhline(tau, color="k", ls=":", lw=0.8)
    ax1.set_yscale("log"), ax1.set_xlabel("step"), ax1.set_ylabel("max attention logit (all layers, heads)")
    ax1.set_title(f"max logit seen by each step's forward, seeds {', '.join(map(str, seeds))}")
    ax1.legend(fontsize=8), ax1.grid(alpha=0.3)
    ax2.set_xlabel("step"), ax2.set_ylabel("val loss"), ax2.set_title("val loss"), ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"QK-Clip on/off: Muon lr {args.lr:g}, {settings['n_layer']} layers, {settings['n_head']} heads x "
                 f"{settings['n_embd'] // settings['n_head']}, no QK-norm, wd 0 (CPU)")
    fig.tight_layout()
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "qk_clip.png")
    fig.savefig(png, dpi=120)

    tau = taus[0]
    d = settings
    lines = [f"QK-Clip on/off: {d['n_layer']} layers, d={d['n_embd']}, {d['n_head']} heads of {d['n_embd'] // d['n_head']} "
             f"dims, T={d['block_size']}, batch {d['batch_size']}, vocab 4096 (compact Shakespeare), Muon lr {args.lr:g}, wd 0, {args.steps} steps, cosine schedule; setting chosen on seed "
             f"{args.seed}, judged on seeds {', '.join(map(str, seeds))}.", "",
             "| run | seed | peak max logit | after the first clip (max) | last 50 steps (max) | steps with a clip | final val loss |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['seed']} | {max(r['max_logit']):.1f} | {after_first_clip(r):.1f} | "
                     f"{max(r['max_logit'][-50:]):.1f} | {sum(c > 0 for c in r['clipped'])} | {r['final']:.4f} |")
    lines += ["", "| claim (K2) | measured | verdict |", "|---|---|---|",
              f"| without a clip the max logit runs away: past 10τ = {10 * tau:g} in every seed | peaks "
              f"{', '.join(f'{v:.1f}' for v in runaway.values())} | **{verdicts[0]}** |",
              f"| with τ = {tau:g} no forward after the first clip sees a logit above τ, in every seed | largest after "
              f"the first clip {', '.join(f'{v:.1f}' for v in held.values())} | **{verdicts[1]}** |",
              f"| the clip does not hurt val loss (clip − no clip below +{MARGIN} at 2 SE) | {loss} | **{verdicts[2]}** |"]
    md = os.path.join(args.out_dir, "qk_clip.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out_dir, "qk_clip.json"), "w") as f:
        json.dump(dict(runs=runs, loss=vars(loss), verdicts=verdicts), f)
    print("\n".join(lines))
    print(f"wrote {png} and {md}")


if __name__ == "__main__":
    main()
