"""QK-Clip on/off in a deliberately unstable setting: max attention logits with and without the clip.

The claim (Kimi K2, arXiv 2507.20534): with plain Muon, attention max logits can grow without bound
(past 1000 in K2's mid-scale run); QK-Clip holds every head at or below τ after each step and leaves
the loss trajectory unharmed (Su: even τ = 30 made no difference on small models).

Setting, chosen to make logits run away at CPU scale: Muon with a high learning rate (0.1, 10x the
best Muon lr of muon_vs_adamw.py's sweep), wide heads (2 heads of 64 dims), no QK-norm, no weight decay.
Runs: Muon without clip, MuonClip τ = 100 (K2's value) and τ = 30. Same model, data order, schedule.

What is logged each step is the max logit the forward pass saw, i.e. *before* that step's clip; after
the clip it is at most τ by construction, and one update later it can sit a little above τ again.

    nice python experiments/qk_clip.py                 # writes out/qk_clip/qk_clip.{png,md}
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train  # noqa: E402
from muon_vs_adamw import compact_corpus, model_settings  # noqa: E402

OUT = os.path.join(ROOT, "out", "qk_clip")


def run(name, steps, eval_every, out_root=OUT, **kw):
    t0 = time.time()
    res = train.train(out_dir=os.path.join(out_root, name), overwrite=True, max_iters=steps, warmup_iters=max(1, steps // 20),
                      eval_interval=eval_every, log_interval=1, eval_iters=8, ckpt_interval=10 ** 9, **kw)
    hist = res["history"]
    out = dict(name=name, steps=[h["step"] for h in hist],
               max_logit=[max(h["max_logit"]) for h in hist],              # max over layers and heads
               clipped=[sum(h["clipped_heads"]) for h in hist],
               evals=[(h["step"], h["val_loss"]) for h in hist if "val_loss" in h],
               final=res["final_val_loss"], seconds=time.time() - t0)
    print(f"[{name}] final val {out['final']:.4f}, peak max logit {max(out['max_logit']):.1f} "
          f"in {out['seconds']:.0f}s", flush=True)
    return out


def main():
    torch.set_num_threads(1)  # see muon_vs_adamw.py: 2 threads on the shared 2-core box ran ~7x slower
    ap = argparse.ArgumentParser(description="QK-Clip on/off: max attention logits and val loss with Muon at a "
                                             "deliberately high lr, without and with clipping at each tau",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--eval_every", type=int, default=25, help="steps between val evaluations")
    ap.add_argument("--lr", type=float, default=0.1, help="Muon lr, high enough to make logits run away")
    ap.add_argument("--taus", default="100,30", help="comma-separated QK-Clip thresholds")
    ap.add_argument("--seed", type=int, default=1337, help="init and data order, the same for every run")
    ap.add_argument("--out_dir", default=OUT, help="output folder (one sub-folder per run)")
    args = ap.parse_args()
    settings = model_settings(4096)
    settings.update(n_layer=2, n_head=2, data=compact_corpus(4096), lr=args.lr, weight_decay=0.0, seed=args.seed,
                    out_root=args.out_dir)
    runs = [run("muon_no_clip", args.steps, args.eval_every, optimizer="muon", **settings)]
    taus = [float(t) for t in args.taus.split(",")]
    for tau in taus:
        runs.append(run(f"muonclip_tau{tau:g}", args.steps, args.eval_every, optimizer="muonclip",
                        qk_clip_tau=tau, **settings))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r, color in zip(runs, ("tab:red", "tab:blue", "tab:green", "tab:purple")):
        ax1.plot(r["steps"], r["max_logit"], color=color, lw=1.2, label=r["name"])
        ax2.plot([s for s, _ in r["evals"]], [v for _, v in r["evals"]], "o-", color=color, ms=3, label=r["name"])
    for tau in taus:
        ax1.axhline(tau, color="k", ls=":", lw=0.8)
    ax1.set_yscale("log"), ax1.set_xlabel("step"), ax1.set_ylabel("max attention logit (all layers, heads)")
    ax1.set_title("max logit seen by each step's forward"), ax1.legend(fontsize=8), ax1.grid(alpha=0.3)
    ax2.set_xlabel("step"), ax2.set_ylabel("val loss"), ax2.set_title("val loss"), ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"QK-Clip on/off: Muon lr {args.lr:g}, 2 layers, 2 heads x 64, no QK-norm, wd 0 (CPU)")
    fig.tight_layout()
    png = os.path.join(args.out_dir, "qk_clip.png")
    fig.savefig(png, dpi=120)

    lines = [f"QK-Clip on/off: 2 layers, d=128, 2 heads of 64 dims, T=64, batch 16, vocab 4096 (compact "
             f"Shakespeare), Muon lr {args.lr:g}, wd 0, {args.steps} steps, cosine schedule.", "",
             "| run | peak max logit | max logit, last 50 steps (max) | steps with a clip | final val loss |",
             "|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['name']} | {max(r['max_logit']):.1f} | {max(r['max_logit'][-50:]):.1f} | "
                     f"{sum(c > 0 for c in r['clipped'])} | {r['final']:.4f} |")
    md = os.path.join(args.out_dir, "qk_clip.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out_dir, "qk_clip.json"), "w") as f:
        json.dump(runs, f)
    print("\n".join(lines))
    print(f"wrote {png} and {md}")


if __name__ == "__main__":
    main()
