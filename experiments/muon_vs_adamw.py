"""Muon vs AdamW at equal model and tokens: tokens to reach a target val loss, each at its best lr.

The claim (Moonlight, arXiv 2502.16982): Muon with the 0.2·sqrt(max(A, B)) update scaling reaches a
given loss with about half the compute of a tuned AdamW at 0.4-1.5B; modded-nanogpt saw ~1.35x fewer
tokens at 124M; Wen et al. (arXiv 2509.02046) 1.4x at 0.1B, shrinking with scale.

Protocol: the same model, data order and schedule for both optimizers; a small lr sweep for each; the
target is the best AdamW run's final val loss; for the best Muon run, the tokens at which its val
curve first reaches the target (linear interpolation between evals). ratio = AdamW tokens / Muon tokens.

CPU budget: train.py's CPU model with GPT-2's 50k vocabulary spends most of its time in the
embedding and output head, and a head-dominated model hides what Muon does to the hidden matrices. So
the corpus is Shakespeare re-indexed to its 4095 most frequent GPT-2 tokens plus one UNK id (94% of
tokens kept); see compact_corpus(). That and the tiny scale are the caveats of the numbers.

    nice python experiments/muon_vs_adamw.py              # writes out/muon_vs_adamw/muon_vs_adamw.{png,md}
    nice python experiments/muon_vs_adamw.py --steps=100  # quicker, noisier
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import data  # noqa: E402
import train  # noqa: E402

OUT = os.path.join(ROOT, "out", "muon_vs_adamw")


def compact_corpus(vocab: int = 4096, source: str = "shakespeare") -> str:
    """A --data path whose token cache holds `source` re-indexed to its vocab-1 commonest tokens + UNK.

    data.prepare() keys its cache on the path, size and mtime of a user text file; we write a small
    stub file and fill its cache folder ourselves with the re-indexed ids, so train.py reads them as is.
    """
    os.makedirs(data.CACHE_DIR, exist_ok=True)   # the data cache, shared by the experiments that use it
    stub = os.path.join(data.CACHE_DIR, f"{source}_top{vocab}.txt")
    if not os.path.exists(stub):
        with open(stub, "w") as f:
            f.write(f"Placeholder: the token cache of this file holds the '{source}' corpus re-indexed to its "
                    f"{vocab - 1} most frequent GPT-2 tokens, all others mapped to id {vocab - 1} (UNK). "
                    "Written by experiments/muon_vs_adamw.py.\n")
    folder = os.path.join(data.CACHE_DIR, data._cache_name(stub))
    if os.path.exists(os.path.join(folder, "val.bin")):
        return stub
    src = data.prepare(source)
    train_ids, val_ids = data.load_split(src, "train"), data.load_split(src, "val")
    counts = np.bincount(train_ids, minlength=65536)
    keep = np.argsort(-counts, kind="stable")[:vocab - 1]           # ranked by train frequency only
    remap = np.full(65536, vocab - 1, dtype=np.uint16)
    remap[keep] = np.arange(vocab - 1, dtype=np.uint16)
    os.makedirs(folder, exist_ok=True)
    for split, ids in (("train", train_ids), ("val", val_ids)):
        tmp = os.path.join(folder, f"{split}.bin.tmp")
        remap[np.asarray(ids)].tofile(tmp)
        os.replace(tmp, os.path.join(folder, f"{split}.bin"))
    return stub


def model_settings(vocab: int) -> dict:
    # the plain attention model, stated in full so train.py's defaults (the hybrid with image rows) do not apply
    return dict(vocab_size=vocab, n_layer=4, n_embd=128, n_head=4, block_size=64, pattern="A", residual="standard",
                vision_ratio=0.0, tie_embeddings=False, batch_size=16, grad_accum=1, sample_tokens=0)


def run(name: str, steps: int, eval_every: int, reuse: bool = False, out_root: str = OUT, **kw) -> dict:
    out_dir = os.path.join(out_root, name)
    log = os.path.join(out_dir, "log.jsonl")
    if reuse and os.path.exists(log):  # a finished run of the same name: read its log instead of retraining
        history = [json.loads(line) for line in open(log)]
        if history and history[-1]["step"] == steps and "val_loss" in history[-1]:
            evals = [(h["tokens"], h["val_loss"]) for h in history if "val_loss" in h]
            print(f"[{name}] reused {log}: final val {evals[-1][1]:.4f}", flush=True)
            return dict(name=name, evals=evals, final=evals[-1][1], seconds=None, **kw)
    t0 = time.time()
    res = train.train(out_dir=out_dir, overwrite=True, max_iters=steps, warmup_iters=max(1, steps // 20),
                      eval_interval=eval_every, log_interval=eval_every, eval_iters=8, ckpt_interval=10 ** 9, **kw)
    evals = [(h["tokens"], h["val_loss"]) for h in res["history"] if "val_loss" in h]
    print(f"[{name}] final val {res['final_val_loss']:.4f} in {time.time() - t0:.0f}s", flush=True)
    return dict(name=name, evals=evals, final=res["final_val_loss"], seconds=time.time() - t0, **kw)


def tokens_to_reach(evals, target):
    """First token count where the val curve reaches target, linearly interpolated; None if never."""
    prev = None
    for tokens, loss in evals:
        if loss <= target:
            if prev is None:
                return tokens
            (t0, l0) = prev
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        prev = (tokens, loss)
    return None


def main():
    # one thread: on a shared 2-core machine, torch's default 2 OpenMP threads ran ~7x slower here
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description="Muon vs AdamW at equal steps: an lr sweep for each, tokens to reach "
                                             "AdamW's best loss (Moonlight's ~2x claim in miniature)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--eval_every", type=int, default=25, help="steps between val evaluations")
    ap.add_argument("--adamw_lrs", default="1e-3,3e-3,1e-2", help="AdamW learning rates to sweep")
    ap.add_argument("--muon_lrs", default="1e-3,3e-3,1e-2,3e-2", help="Muon learning rates to sweep")
    ap.add_argument("--vocab", type=int, default=4096, help="compact vocabulary (Shakespeare re-indexed)")
    ap.add_argument("--seed", type=int, default=1337, help="init and data order, the same for every run")
    ap.add_argument("--out_dir", default=OUT, help="output folder (one sub-folder per run)")
    ap.add_argument("--reuse", action="store_true", help="read finished runs from their logs instead of retraining")
    args = ap.parse_args()
    corpus = compact_corpus(args.vocab)
    common = dict(data=corpus, seed=args.seed, out_root=args.out_dir, **model_settings(args.vocab))
    runs = []
    for opt, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
        for lr in [float(x) for x in lrs.split(",")]:
            runs.append(run(f"{opt}_lr{lr:g}", args.steps, args.eval_every, args.reuse, optimizer=opt, lr=lr,
                            **common))
            runs[-1].pop("out_root")
    best = {opt: min((r for r in runs if r["optimizer"] == opt), key=lambda r: r["final"]) for opt in ("adamw", "muon")}
    target = best["adamw"]["final"]
    t_adamw = tokens_to_reach(best["adamw"]["evals"], target)
    t_muon = tokens_to_reach(best["muon"]["evals"], target)
    ratio = (t_adamw / t_muon) if t_muon else None

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        is_best = r is best[r["optimizer"]]
        ax.plot([t for t, _ in r["evals"]], [v for _, v in r["evals"]], "-" if r["optimizer"] == "muon" else "--",
                lw=2.2 if is_best else 0.9, alpha=1.0 if is_best else 0.5, label=f"{r['optimizer']} lr={r['lr']:g}")
    ax.axhline(target, color="k", lw=0.8, ls=":", label=f"target {target:.3f}")
    ax.set_xlabel("training tokens"), ax.set_ylabel("val loss (nats/token)")
    ax.set_ylim(top=min(max(v for r in runs for _, v in r["evals"]), target + 2.5))
    ax.set_title("Muon vs AdamW, same model and tokens (CPU, 4-layer d=128)")
    ax.legend(fontsize=8), ax.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.join(args.out_dir, "muon_vs_adamw.png")
    fig.savefig(png, dpi=120)

    lines = [f"Muon vs AdamW: 4 layers, d=128, 4 heads, T=64, batch 16, vocab {args.vocab} (compact Shakespeare), "
             f"{args.steps} steps x {16 * 64} tokens, cosine schedule, wd 0.1, grad clip 1.0.", "",
             "| optimizer | lr | final val loss | tokens to reach target |", "|---|---|---|---|"]
    for r in runs:
        tt = tokens_to_reach(r["evals"], target)
        lines.append(f"| {r['optimizer']} | {r['lr']:g} | {r['final']:.4f} | {f'{tt:,.0f}' if tt else 'not reached'} |")
    lines += ["", f"Target = best AdamW final val loss = {target:.4f}. "
              f"Best AdamW lr {best['adamw']['lr']:g}, best Muon lr {best['muon']['lr']:g}. "
              + (f"Token ratio AdamW/Muon to reach the target: **{ratio:.2f}x**." if ratio else
                 "The best Muon run never reached the target.")]
    md = os.path.join(args.out_dir, "muon_vs_adamw.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out_dir, "muon_vs_adamw.json"), "w") as f:
        json.dump(dict(runs=runs, target=target, ratio=ratio), f)
    print("\n".join(lines))
    print(f"wrote {png} and {md}")


if __name__ == "__main__":
    main()
