"""Standard residual vs Block AttnRes vs Full AttnRes: same model, same tokens, same initial weights.

The paper (arXiv 2603.15031, Table 4, a 436M model on 87.9B tokens) reports val loss 1.766 for the
PreNorm baseline, 1.746 for Block AttnRes (block size 4) and 1.737 for Full AttnRes, and a 1.25x
compute advantage across its scaling runs. This script runs the three variants in miniature through
train.train() with one seed (so the data order and every shared weight are identical; the AttnRes
queries start at zero, the key gains at one), then reports:

  - final val loss (same eval batches for every variant) and its difference to the baseline;
  - training throughput: the median tokens/s from the training log, and a controlled measurement
    (forward + backward of the same batch, the variants interleaved, median over repeats);
  - the depth-attention heatmaps of the trained AttnRes models (paper Fig. 8) and the loss curves.

    python experiments/attnres_compare.py                      # CPU-sized default (minutes)
    python experiments/attnres_compare.py --steps=2000 --n_layer=8 --n_embd=512 --block_size=512
                                                                # a GPU-sized run

Outputs under --out_dir (default out/attnres_compare/): results.md, results.json, loss.png,
heatmap_attnres_block.png, heatmap_attnres_full.png, and one training folder per variant.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import data  # noqa: E402
import model  # noqa: E402
import train  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description="standard vs block vs full AttnRes", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="training steps per variant")
    train.add_flags(p, n_layer=4, n_embd=64, n_head=4, block_size=64, batch_size=8, attnres_block_size=2, lr=3e-3,
                    eval_iters=8, pattern="A")
    p.add_argument("--timing_reps", type=int, default=5)
    p.add_argument("--optimizer", default="muonclip", help="muonclip | muon | adamw (train.py's choices)")
    p.add_argument("--seed", type=int, default=1337, help="one seed for all three variants")
    p.add_argument("--out_dir", default=os.path.join(ROOT, "out", "attnres_compare"), help="output folder")
    return p.parse_args()


def controlled_step_times(configs: dict, batch_size: int, reps: int, device: str) -> dict:
    """Median seconds of one forward+backward per variant, on one fixed batch, variants interleaved
    so that background load hits all of them alike."""
    torch.manual_seed(0)
    models = {name: model.GPT(cfg).to(device) for name, cfg in configs.items()}
    T, V = next(iter(configs.values())).block_size, 50257
    x = torch.randint(0, V, (batch_size, T), device=device)
    y = torch.randint(0, V, (batch_size, T), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = {name: [] for name in models}
    for rep in range(reps + 1):
        for name, net in models.items():
            sync()
            t0 = time.perf_counter()
            _, loss = net(x, y)
            loss.backward()
            sync()
            if rep > 0:  # the first round is a warm-up
                times[name].append(time.perf_counter() - t0)
            net.zero_grad(set_to_none=True)
    return {name: statistics.median(ts) for name, ts in times.items()}


@torch.no_grad()
def depth_weights(out_dir: str, batch_size: int, device: str):
    """Token-averaged depth-attention weights of a trained checkpoint on validation text."""
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location=device, weights_only=True)
    cfg = model.config_from_dict(ckpt["run_config"]["model"])
    net = model.GPT(cfg).to(device)
    net.load_state_dict(ckpt["model"])
    net.eval()
    val = data.load_split(data.prepare("shakespeare"), "val")
    gen = torch.Generator().manual_seed(0)
    offsets = torch.randint(0, len(val) - cfg.block_size - 1, (batch_size,), generator=gen)
    x, _ = data.get_batch(val, offsets, cfg.block_size)
    _, _, weights = net(x.to(device), return_weights=True)
    return [w.cpu() for w in weights], cfg


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


def plot_curves(results: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in results.items():
        h = r["history"]
        axes[0].plot([e["step"] for e in h], [e["batch_loss"] for e in h], label=name)
        ev = [e for e in h if "val_loss" in e]
        axes[1].plot([e["step"] for e in ev], [e["val_loss"] for e in ev], "o-", label=name)
    for ax, title in zip(axes, ("train loss (batch)", "val loss")):
        ax.set_xlabel("step"), ax.set_ylabel("loss (nats/token)"), ax.set_title(title)
        ax.grid(alpha=0.3), ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    args = parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = dict(max_iters=args.steps, warmup_iters=max(1, args.steps // 10),
                  eval_interval=max(1, args.steps // 3), eval_iters=args.eval_iters, log_interval=10,
                  ckpt_interval=args.steps, sample_tokens=0, seed=args.seed, optimizer=args.optimizer, lr=args.lr,
                  batch_size=args.batch_size, grad_accum=1, n_layer=args.n_layer, n_embd=args.n_embd,
                  n_head=args.n_head, block_size=args.block_size, pattern=args.pattern, vision_ratio=0.0)
    variants = {"standard": {}, "attnres_block": {"attnres_block_size": args.attnres_block_size},
                "attnres_full": {}}
    results, wall = {}, {}
    for name, extra in variants.items():
        t0 = time.time()
        results[name] = train.train(residual=name, out_dir=os.path.join(args.out_dir, name), overwrite=True,
                                    **common, **extra)
        wall[name] = time.time() - t0

    configs = {name: train.make_config({"residual": name, **common, **extra}, device == "cuda").model
               for name, extra in variants.items()}
    step_s = controlled_step_times(configs, args.batch_size, args.timing_reps, device)

    heatmaps = {}
    for name in ("attnres_block", "attnres_full"):
        weights, cfg = depth_weights(os.path.join(args.out_dir, name), args.batch_size, device)
        names = [f"{l // 2}{'.mix' if l % 2 == 0 else '.mlp'}" for l in range(2 * cfg.n_layer)]
        kind = (f"Block AttnRes (block size {cfg.attnres_block_size}; columns = block sums)"
                if name == "attnres_block" else "Full AttnRes (columns = sublayer outputs)")
        heatmaps[name] = plot_depth_attention(
            weights, os.path.join(args.out_dir, f"heatmap_{name}.png"),
            title=f"{kind}\nafter {args.steps} steps, val text average", sublayer_names=names)
    plot_curves(results, os.path.join(args.out_dir, "loss.png"))

    base = results["standard"]["final_val_loss"]
    lines = [f"device: {device}; {args.n_layer} layers ({2 * args.n_layer} sublayers), d={args.n_embd}, "
             f"context {args.block_size}, batch {args.batch_size}, {args.steps} steps "
             f"({args.steps * args.batch_size * args.block_size} tokens), pattern {args.pattern}, "
             f"{args.optimizer}, seed {args.seed}", "",
             "| variant | final val loss | vs standard | train tok/s (median of log) | fwd+bwd step (controlled) "
             "| step overhead | wall s |",
             "|---|---|---|---|---|---|---|"]
    summary = {}
    for name, r in results.items():
        tps = statistics.median(h["tokens_per_s"] for h in r["history"])
        over = 100 * (step_s[name] / step_s["standard"] - 1)
        summary[name] = dict(final_val_loss=r["final_val_loss"], delta=r["final_val_loss"] - base,
                             median_tokens_per_s=tps, step_s=step_s[name], step_overhead_pct=over,
                             wall_s=wall[name])
        lines.append(f"| {name} | {r['final_val_loss']:.4f} | {r['final_val_loss'] - base:+.4f} | {tps:.0f} | "
                     f"{1e3 * step_s[name]:.1f} ms | {over:+.1f}% | {wall[name]:.0f} |")
    text = "\n".join(lines)
    print("\n" + text)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "summary": summary,
                   "history": {k: r["history"] for k, r in results.items()}}, f, indent=1)
    print("wrote", ", ".join([os.path.join(args.out_dir, n) for n in ("results.md", "loss.png")] + list(heatmaps.values())))


if __name__ == "__main__":
    main()
