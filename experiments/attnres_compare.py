"""Standard residual vs Block Attention Residuals at depth, judged by the protocol (experiments/protocol.py).

The claim (arXiv 2603.15031): replacing the residual sum by a learned softmax over earlier outputs lowers
the loss at equal tokens (Table 4, 436M model: PreNorm 1.766, Block AttnRes 1.746, Full 1.737), and Block
AttnRes matches a baseline trained with 1.25x more compute. Depth dilution is the mechanism, so the gap
should grow with depth.

Setup: pattern A (RoPE attention), width 64, 4 heads, context 128, batch 8, Shakespeare re-indexed to its
4095 commonest GPT-2 tokens (muon_vs_adamw.compact_corpus, so the 50k head does not dominate), MuonClip,
cosine schedule, depths 4 and 16 layers (8 and 32 sublayers) with 2 and 4 sublayers per block (4 and 8
blocks; the paper finds ~8 enough). Each (depth, arm) trains at the best lr of --lrs on the tuning seed,
then once per judging seed. The standard residual also trains for 2x the steps (its own schedule, its
tuned lr): the positive control (2x tokens must lower its loss by > 2 SE, or the setup cannot see a
compute difference) and the compute ratio: the tokens the standard residual needs to reach block's
final loss, log-linear between its 1x and 2x final losses (a lower bound of 2 if block beats even 2x).

    nice python experiments/attnres_compare.py --jobs 2     # the README's table (~2 h on 2 cores)
    nice python experiments/attnres_compare.py --jobs 2 --full --reuse   # + full AttnRes at 16 layers (~75 CPU-min)
    python experiments/attnres_compare.py --quick           # seconds (CI)

Writes attnres_compare.{md,json,png} and heatmap_depth<D>.png (the paper's Fig. 8) under --out_dir.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402
import model  # noqa: E402
import protocol  # noqa: E402
import train  # noqa: E402
from runs import bounded_list  # noqa: E402
from muon_vs_adamw import compact_corpus  # noqa: E402

OUT = os.path.join(ROOT, "out", "attnres_compare")
BLOCK_SIZE = {4: 2, 16: 4}      # sublayers per block at each depth: 4 and 8 blocks


def run(depth: int, arm: str, steps: int, seed: int, lr: float, common: dict, eval_every: int, out_root: str,
        reuse: bool = False) -> dict:
    """One (depth, arm) on one seed at one lr -> its val curve, final val loss and (AttnRes) depth weights."""
    out_dir = os.path.join(out_root, f"depth{depth}", arm, f"steps{steps}_seed{seed}_lr{lr:g}")
    saved = os.path.join(out_dir, "result.json")
    if reuse and os.path.exists(saved):
        with open(saved) as f:
            print(f"[depth {depth} {arm} {steps} steps seed {seed} lr {lr:g}] reused {saved}", flush=True)
            return json.load(f)
    t0 = time.time()
    res = train.train(out_dir=out_dir, overwrite=True, n_layer=depth, residual=arm, seed=seed, lr=lr,
                      attnres_block_size=BLOCK_SIZE.get(depth, 2), max_iters=steps, warmup_iters=max(1, steps // 20),
                      eval_interval=eval_every, log_interval=eval_every, ckpt_interval=10 ** 9, **common)
    weights = depth_weights(out_dir, common["data"]) if arm != "standard" else None
    result = dict(depth=depth, arm=arm, steps=steps, seed=seed, lr=lr, final=res["final_val_loss"],
                  evals=[(h["step"], h["tokens"], h["val_loss"]) for h in res["history"] if "val_loss" in h],
                  unigram=res["unigram_val_loss"], weights=weights, seconds=time.time() - t0,
                  tokens_per_s=statistics.median(h["tokens_per_s"] for h in res["history"]))
    print(f"[depth {depth} {arm} {steps} steps seed {seed} lr {lr:g}] final val {result['final']:.4f}, "
          f"{result['seconds']:.0f}s", flush=True)
    with open(saved, "w") as f:
        json.dump(result, f)
    return result


@torch.no_grad()
def depth_weights(out_dir: str, data_path: str, batch_size: int = 8) -> list:
    """Token-averaged depth-attention weights of a trained checkpoint on 8 fixed validation windows:
    row l = reading sublayer l (last row: the output head's read), column i = source i (0: the embedding)."""
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=True)
    cfg = model.config_from_dict(ckpt["run_config"]["model"])
    net = model.GPT(cfg)
    net.load_state_dict(ckpt["model"])
    net.eval()
    val = data.load_split(data.prepare(data_path), "val")
    offsets = torch.randint(0, len(val) - cfg.block_size - 1, (batch_size,), generator=torch.Generator().manual_seed(0))
    x, _ = data.get_batch(val, offsets, cfg.block_size)
    _, _, weights = net(x, return_weights=True)
    return [w.float().tolist() for w in weights]


def plot_depth_attention(weights, path, title="AttnRes depth attention (token average)", sublayer_names=None):
    """weights: the list from stream(..., return_weights=True) (row l = sublayer l, last row = final read;
    column i = source i: the embedding, then sublayer outputs or block sums). Writes a PNG; returns path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [w.detach().float().cpu().numpy() for w in weights]
    n_cols = max(len(r) for r in rows)
    grid = np.full((len(rows), n_cols), np.nan)                              # [sublayers + 1, sources]
    for l, r in enumerate(rows):
        grid[l, :len(r)] = r
    names = list(sublayer_names or [str(l) for l in range(len(rows) - 1)]) + ["out"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.4 * n_cols), max(3.5, 1.2 + 0.3 * len(rows))))
    im = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(n_cols))
    ax.set_xticklabels(["emb"] + [str(i) for i in range(1, n_cols)], fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("source (0 = embedding)")
    ax.set_ylabel("reading sublayer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def embedding_share(weights: list) -> list:
    """The weight each reading sublayer (and the head) puts on the embedding: a shortcut if it stays high.
    Reads with the embedding as their only source (weight 1 by construction) are left out."""
    return [row[0] for row in weights if len(row) > 1]


def compute_ratio(l1: float, l2: float, target: float) -> float:
    """Tokens (as a multiple of the 1x run's) at which the standard residual's final loss reaches target,
    log-linear between its final losses at 1x (l1) and 2x (l2) tokens; clipped to [1, 2] (bounds)."""
    if target >= l1:
        return 1.0
    if target <= l2 or l1 <= l2:
        return 2.0
    return 2 ** ((l1 - target) / (l1 - l2))


def judge(judged: list, depths: list) -> list:
    """The claims, each a row: (claim, Paired, verdict, where it holds)."""
    final = {}
    for r in judged:
        final.setdefault((r["depth"], r["arm"], r["steps"]), {})[r["seed"]] = r
    rows, gaps = [], {}
    for d in depths:
        steps = min(s for (dd, a, s) in final if dd == d)
        std, blk, std2 = final[(d, "standard", steps)], final[(d, "attnres_block", steps)], final[(d, "standard", 2 * steps)]
        control = protocol.paired({s: r["final"] for s, r in std2.items()}, {s: r["final"] for s, r in std.items()})
        passed = protocol.verdict(control, -1) == protocol.REPRODUCES
        rows.append((f"control: 2x tokens lower the standard residual's loss ({d} layers)", control,
                     "passed" if passed else "FAILED", f"{control.holds(-1)}/{len(control.seeds)} seeds"))
        gap = protocol.paired({s: r["final"] for s, r in blk.items()}, {s: r["final"] for s, r in std.items()})
        gaps[d] = gap
        rows.append((f"block AttnRes beats the standard residual ({d} layers)", gap,
                     protocol.verdict(gap, -1, passed), f"{gap.holds(-1)}/{len(gap.seeds)} seeds"))
        second = [k for k, (step, _, _) in enumerate(next(iter(std.values()))["evals"]) if step > steps // 2]
        per_eval = [protocol.paired({s: r["evals"][k][2] for s, r in blk.items()},
                                    {s: r["evals"][k][2] for s, r in std.items()}) for k in second]
        held = sum(protocol.verdict(p, -1) == protocol.REPRODUCES for p in per_eval)
        worst = max(per_eval, key=lambda p: p.diff + 2 * p.se)
        rows.append((f"the gap holds over the second half ({d} layers; worst of {len(per_eval)} evals shown)", worst,
                     protocol.REPRODUCES if held == len(per_eval) and passed else protocol.DOES_NOT,
                     f"{held}/{len(per_eval)} evals beyond 2 SE"))
        if (d, "attnres_full", steps) in final:      # the paper's ablation: 1.737 (full) vs 1.746 (block)
            full = protocol.paired({s: r["final"] for s, r in final[(d, "attnres_full", steps)].items()},
                                   {s: r["final"] for s, r in blk.items()})
            rows.append((f"full AttnRes beats block AttnRes ({d} layers)", full, protocol.verdict(full, -1, passed),
                         f"{full.holds(-1)}/{len(full.seeds)} seeds"))
        ratios = {s: compute_ratio(std[s]["final"], std2[s]["final"], blk[s]["final"]) for s in blk}
        ratio = protocol.paired(ratios, {s: 1.0 for s in ratios})
        rows.append((f"block saves compute: the standard residual needs x{ratio.mean_a:.3f} the tokens ({d} layers; "
                     "shown: ratio - 1)", ratio, protocol.verdict(ratio, +1, passed), f"{ratio.holds(+1)}/{len(ratio.seeds)} seeds"))
        size = protocol.paired(ratios, {s: 1.25 for s in ratios})
        rows.append((f"the saving is the paper's x1.25 ({d} layers: 1.25 inside mean ± 2 SE; shown: ratio - 1.25)", size,
                     protocol.REPRODUCES if passed and abs(size.diff) <= 2 * size.se else protocol.DOES_NOT,
                     f"{sum(r >= 1.25 for r in ratios.values())}/{len(ratios)} seeds at or above 1.25"))
    if len(depths) == 2:
        lo, hi = depths
        grow = protocol.paired({s: gaps[hi].diffs[i] for i, s in enumerate(gaps[hi].seeds)},
                               {s: gaps[lo].diffs[i] for i, s in enumerate(gaps[lo].seeds)})
        rows.append((f"the gap grows with depth ({hi} vs {lo} layers: gap{hi} - gap{lo})", grow,
                     protocol.verdict(grow, -1), f"{grow.holds(-1)}/{len(grow.seeds)} seeds"))
    return rows


def main():
    ap = argparse.ArgumentParser(description="standard residual vs Block AttnRes at depths 4 and 16: each arm at its "
                                 "best lr on a tuning seed, judged on other seeds", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    protocol.add_flags(ap, OUT, steps=1500, eval_every=100)
    ap.add_argument("--depths", type=bounded_list(int, 1, 256), default="4,16", help="layers (comma list); blocks of 2 sublayers at 4, 4 at 16")
    ap.add_argument("--lrs", type=bounded_list(float, 1e-12, 1e3), default="4e-3,8e-3,1.6e-2", help="each arm's lr grid, tried on --seed")
    ap.add_argument("--full", action="store_true", help="also full AttnRes (every sublayer a source) at the deepest depth")
    ap.add_argument("--reuse", action="store_true", help="read finished runs from their result.json")
    args = ap.parse_args()
    lrs, seeds, depths = args.lrs, args.seeds, args.depths
    protocol.check_seeds(args)
    if args.quick:
        args.steps, args.eval_every, lrs, seeds, args.jobs, depths = 4, 2, lrs[:2], seeds[:2], 1, [2, 4]
    args.lrs, args.seeds, args.depths = lrs, seeds, depths
    torch.set_num_threads(1)
    vocab = 4096
    common = dict(data=compact_corpus(vocab), vocab_size=vocab, tie_embeddings=False, pattern="A", n_head=4,
                  n_embd=32 if args.quick else 64, block_size=32 if args.quick else 128, batch_size=2 if args.quick else 8,
                  grad_accum=1, vision_ratio=0.0, eval_iters=2 if args.quick else 16, sample_tokens=0,
                  optimizer="muonclip", threads=1, device="cpu")
    arms = ["standard", "attnres_block"] + ["attnres_full"] * args.full
    tried = [(d, a) for d in depths for a in arms if a != "attnres_full" or d == max(depths)]

    def jobs(lr_of: dict, run_seeds: list, steps: int) -> list:   # longest runs first: two workers pack better
        return [dict(depth=d, arm=a, steps=steps, seed=s, lr=lr, common=common, eval_every=args.eval_every,
                     out_root=args.out_dir, reuse=args.reuse)
                for d in sorted(depths, reverse=True) for a in arms if (d, a) in lr_of for s in run_seeds
                for lr in lr_of[(d, a)]]

    t0 = time.time()
    tuned = protocol.run_jobs(run, jobs({k: lrs for k in tried}, [args.seed], args.steps), args.jobs)
    best = {(d, a): protocol.best_lr({r["lr"]: [r["final"]] for r in tuned if (r["depth"], r["arm"]) == (d, a)})
            for d, a in tried}
    # a best lr on the grid's edge: one factor-2 step beyond it
    edge = {k: [v * (2 if v == max(lrs) else 0.5)] for k, v in best.items() if v in (min(lrs), max(lrs)) and not args.quick}
    tuned += protocol.run_jobs(run, jobs(edge, [args.seed], args.steps), args.jobs)
    best = {(d, a): protocol.best_lr({r["lr"]: [r["final"]] for r in tuned if (r["depth"], r["arm"]) == (d, a)})
            for d, a in tried}
    control = {(d, "standard"): [best[(d, "standard")]] for d in depths}
    judged = protocol.run_jobs(run, jobs(control, seeds, 2 * args.steps) +
                               jobs({k: [v] for k, v in best.items()}, seeds, args.steps), args.jobs)
    report(args, common, tuned, best, judged, judge(judged, depths), time.time() - t0)


def arms_at(depth: int, best: dict) -> list:
    """(arm, step multiple) of the judged runs at one depth: the three of every depth, then full AttnRes if run."""
    return [("standard", 1), ("attnres_block", 1), ("standard", 2)] + [("attnres_full", 1)] * ((depth, "attnres_full") in best)


def report(args, common, tuned, best, judged, claims, seconds):
    """attnres_compare.md (tables, verdicts), .json, .png (mean val curves per depth) and the heatmaps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, len(args.depths), figsize=(5.5 * len(args.depths), 4), squeeze=False)
    for ax, d in zip(axes[0], args.depths):
        for i, (arm, mult) in enumerate(arms_at(d, best)):
            curves = [r["evals"] for r in judged if (r["depth"], r["arm"], r["steps"]) == (d, arm, mult * args.steps)]
            tokens = [t for _, t, _ in curves[0]]
            mean = [statistics.fmean(c[k][2] for c in curves) for k in range(len(tokens))]
            ax.plot(tokens, mean, marker="o", ms=2, color=f"C{i}", ls="--" if mult == 2 else "-",
                    label=f"{arm}{' (2x steps)' if mult == 2 else ''}, lr {best[(d, arm)]:g}")
        ax.set_ylim(top=min(r["final"] for r in judged if r["depth"] == d) + 1.0)
        ax.set_title(f"{d} layers ({2 * d} sublayers), mean of {len(args.seeds)} judging seeds", fontsize=9)
        ax.set_xlabel("training tokens"), ax.set_ylabel("val loss"), ax.grid(alpha=0.3), ax.legend(fontsize=7)
    fig.tight_layout()
    png = os.path.join(args.out_dir, "attnres_compare.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)

    lines = [f"Standard residual vs Block AttnRes, CPU, one thread per run, {args.jobs} side by side: pattern A, "
             f"width {common['n_embd']}, {common['n_head']} heads, T={common['block_size']}, batch {common['batch_size']}, "
             f"vocab {common['vocab_size']} (compact Shakespeare), MuonClip, cosine, {args.steps} steps "
             f"({args.steps * common['batch_size'] * common['block_size']:,} tokens; the control 2x). lr grid "
             f"{', '.join(f'{x:g}' for x in args.lrs)} (+1 factor-2 step past a winning edge) on tuning seed {args.seed}; "
             f"judging seeds {', '.join(map(str, args.seeds))}; {sum(r['seconds'] for r in tuned + judged) / 60:.0f} "
             f"CPU-minutes in the runs, {seconds / 60:.1f} min this call.", "",
             "| depth | arm | lr (tuning seed: final val per lr) | " + " | ".join(f"seed {s}" for s in args.seeds) +
             " | mean | embedding's weight (mean, min-max over reads) | tok/s |", "|---|---|---|" + "---|" * (len(args.seeds) + 3)]
    for d in args.depths:
        for arm, mult in arms_at(d, best):
            rs = sorted((r for r in judged if (r["depth"], r["arm"], r["steps"]) == (d, arm, mult * args.steps)),
                        key=lambda r: r["seed"])
            grid = ", ".join(f"{r['lr']:g}: {r['final']:.4f}" for r in sorted(tuned, key=lambda r: r["lr"])
                             if (r["depth"], r["arm"]) == (d, arm))
            share = [x for r in rs if r["weights"] for x in embedding_share(r["weights"])]
            share_text = f"{statistics.fmean(share):.2f} ({min(share):.2f}-{max(share):.2f})" if share else "–"
            lines.append(f"| {d} | {arm}{' (2x steps)' if mult == 2 else ''} | **{best[(d, arm)]:g}**" +
                         (f" ({grid})" if mult == 1 else "") + " | " + " | ".join(f"{r['final']:.4f}" for r in rs) +
                         f" | {statistics.fmean(r['final'] for r in rs):.4f} | {share_text} | "
                         f"{statistics.fmean(r['tokens_per_s'] for r in rs):.0f} |")
    lines += ["", "| claim | paired difference (mean ± SE) | holds in | verdict |", "|---|---|---|---|"]
    for claim, p, v, holds in claims:
        lines.append(f"| {claim} | {p} | {holds} | **{v}** |")
    worst, unigram = max(r["final"] for r in judged), judged[0]["unigram"]
    lines += ["", f"Learning check: the worst final val loss {worst:.4f} is " + ("below" if worst < unigram else
              "NOT below") + f" the unigram baseline {unigram:.4f}."]
    for d in args.depths:
        r = min((r for r in judged if (r["depth"], r["arm"]) == (d, "attnres_block")), key=lambda r: r["seed"])
        names = [f"{l // 2}{'.attn' if l % 2 == 0 else '.mlp'}" for l in range(2 * d)]
        path = plot_depth_attention([torch.tensor(w) for w in r["weights"]], os.path.join(args.out_dir, f"heatmap_depth{d}.png"),
                                    title=f"Block AttnRes, {d} layers, blocks of {BLOCK_SIZE.get(d, 2)} sublayers,\n"
                                    f"seed {r['seed']} (columns: embedding, block sums)", sublayer_names=names)
        lines.append(f"Heatmap: {path}")
    md = os.path.join(args.out_dir, "attnres_compare.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out_dir, "attnres_compare.json"), "w") as f:
        json.dump(dict(tuned=tuned, best={f"{d}:{a}": v for (d, a), v in best.items()}, judged=judged,
                       claims=[dict(claim=c, paired=vars(p), verdict=v, holds=h) for c, p, v, h in claims]), f)
    print("\n".join(lines))
    print(f"wrote {png} and {md}")


if __name__ == "__main__":
    main()
