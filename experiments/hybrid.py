"""Kimi Linear in miniature: the 3:1 KDA/attention hybrid vs full attention vs pure KDA.

The claim (Kimi Linear, arXiv 2510.26692, Table 1): at equal parameters and tokens, 3 KDA layers per
full (NoPE) attention layer beat pure attention, valid PPL 5.65 vs 5.77 (1.3B-scale ablation), and
pure linear attention is worse than either on recall-heavy tasks.

Protocol: three arms with the same depth, width, data order, schedule and token count; pattern "A"
(attention with RoPE), "KKKA" (NoPE attention, model.py's rule for patterns with K) and "K". KDA layers
carry extra small matrices (short conv, low-rank gates), so each arm's SwiGLU width is set so that its
non-embedding parameter count matches the hybrid's (within one multiple of 8 of the MLP width).
Reported: final val loss, val curves vs tokens, and training tokens/s.

CPU caveats: the KDA layers run the PyTorch chunk reference (`backend="auto"` on CPU), so tokens/s says
nothing about the Triton path's speed; the model is tiny, the run short, and the corpus is Shakespeare
re-indexed to its 4095 most frequent GPT-2 tokens (experiments/muon_vs_adamw.py, compact_corpus) so
that the output head does not dominate the time.

    nice python experiments/hybrid.py                 # ~8 min on 2 busy CPU cores; out/hybrid/hybrid.{png,md}
    nice python experiments/hybrid.py --steps=400 --eval_every=50 --out_dir=out/hybrid_400     # ~18 min
    nice python experiments/hybrid.py --arms=KKKA:rope,A:nope --out_dir=out/hybrid_diag        # position-encoding controls
    nice python experiments/hybrid.py --arms=KKKA,K --kda_gate=safe --out_dir=out/hybrid_safe  # Kimi K3's bounded gate
    python experiments/hybrid.py --gpu --steps=2000   # CUDA: larger model, Triton KDA (not yet run on a GPU)
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
from model import GPT  # noqa: E402
from muon_vs_adamw import compact_corpus  # noqa: E402

OUT = os.path.join(ROOT, "out", "hybrid")
ARM_NAMES = {"A": "full attention", "KKKA": "hybrid 3:1", "K": "pure KDA"}


def parse_arm(spec: str) -> tuple[str, str, str]:
    """'KKKA' or 'KKKA:rope' -> (name, pattern, rope). rope 'auto' is model.py's rule: RoPE for pure
    attention, NoPE (no positional encoding in attention) as soon as the pattern has KDA layers."""
    pattern, _, rope = spec.partition(":")
    rope = rope or "auto"
    if not pattern or set(pattern) - set("AK") or rope not in ("auto", "rope", "nope"):
        raise SystemExit(f"error: --arms entry {spec!r}: use a pattern of A/K, optionally ':rope' or ':nope'")
    uses_rope = rope == "rope" or (rope == "auto" and "K" not in pattern)
    kind = ("RoPE" if uses_rope else "NoPE") + " attention" if "A" in pattern else "no attention"
    return f"{ARM_NAMES.get(pattern, pattern)} {pattern} ({kind})", pattern, rope


def non_embedding_params(settings: dict, cuda: bool) -> int:
    cfg = train.make_config(settings, cuda=cuda)
    return GPT(cfg.model).num_params()


def matched_mlp_hidden(settings: dict, target: int, cuda: bool) -> int:
    """SwiGLU width (a multiple of 8) whose model has the non-embedding parameter count nearest target.
    The count is linear in the width (3 matrices of n_embd × width per layer), so two probes suffice."""
    p1 = non_embedding_params({**settings, "mlp_hidden": 256}, cuda)
    p2 = non_embedding_params({**settings, "mlp_hidden": 512}, cuda)
    per_unit = (p2 - p1) / 256
    return max(8, int(round((256 + (target - p1) / per_unit) / 8)) * 8)


def run(name: str, pattern: str, rope: str, common: dict, steps: int, eval_every: int, out_root: str) -> dict:
    out_dir = os.path.join(out_root, pattern + ("" if rope == "auto" else "_" + rope))
    t0 = time.time()
    res = train.train(out_dir=out_dir, overwrite=True, pattern=pattern, rope=rope, max_iters=steps, warmup_iters=max(1, steps // 20),
                      eval_interval=eval_every, log_interval=eval_every, ckpt_interval=10 ** 9, **common)
    evals = [(h["tokens"], h["val_loss"]) for h in res["history"] if "val_loss" in h]
    # tokens/s over the logged windows, skipping the first (warm-up: allocator, kernel compilation)
    speeds = [h["tokens_per_s"] for h in res["history"]][1:] or [h["tokens_per_s"] for h in res["history"]]
    seconds = time.time() - t0
    print(f"[{name}] final val {res['final_val_loss']:.4f}, {sum(speeds) / len(speeds):.0f} tok/s, "
          f"{res['n_params']:,} params, {seconds:.0f}s", flush=True)
    label = pattern if rope == "auto" else f"{pattern}:{rope}"
    return dict(name=name, pattern=pattern, rope=rope, label=label, evals=evals, final=res["final_val_loss"],
                n_params=res["n_params"], tokens_per_s=sum(speeds) / len(speeds), seconds=seconds,
                mlp_hidden=common["mlp_hidden"])


def main():
    ap = argparse.ArgumentParser(description="hybrid 3:1 vs full attention vs pure KDA", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=120, help="training steps per arm")
    ap.add_argument("--eval_every", type=int, default=20, help="steps between val evaluations")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads (1: on a shared 2-core machine torch's 2 threads ran several times slower)")
    ap.add_argument("--gpu", action="store_true", help="use CUDA and a larger model (if available)")
    ap.add_argument("--optimizer", default="muonclip", help="muonclip | muon | adamw (train.py's choices)")
    ap.add_argument("--seed", type=int, default=1337, help="one seed (init and data order) for every arm")
    ap.add_argument("--out_dir", default=OUT, help="output folder (one sub-folder per arm)")
    ap.add_argument("--arms", default="A,KKKA,K", help="comma-separated patterns, each optionally :rope or :nope")
    train.add_flags(ap, kda_gate="channel", kda_gate_lower_bound=-5.0)
    args = ap.parse_args()
    cuda = args.gpu and torch.cuda.is_available()
    if args.gpu and not cuda:
        raise SystemExit("error: --gpu given but no CUDA device is available")
    if not cuda:
        torch.set_num_threads(args.threads)
    vocab = 4096
    size = (dict(n_layer=8, n_embd=512, n_head=8, block_size=512, batch_size=32) if cuda else
            dict(n_layer=4, n_embd=128, n_head=4, block_size=128, batch_size=8))
    # standard residual, text only: the arms differ in the token mixer and nothing else
    common = dict(data=compact_corpus(vocab), vocab_size=vocab, tie_embeddings=False, grad_accum=1,
                  residual="standard", vision_ratio=0.0,
                  eval_iters=8, sample_tokens=0, seed=args.seed, optimizer=args.optimizer,
                  kda_gate=args.kda_gate, kda_gate_lower_bound=args.kda_gate_lower_bound,
                  threads=0 if cuda else args.threads,   # train.train sets torch's threads again itself
                  device="cuda" if cuda else "cpu", **size)

    target = non_embedding_params({**common, "pattern": "KKKA"}, cuda)
    runs = []
    for name, pattern, rope in [parse_arm(spec) for spec in args.arms.split(",")]:
        mlp = matched_mlp_hidden({**common, "pattern": pattern}, target, cuda)
        runs.append(run(name, pattern, rope, {**common, "mlp_hidden": mlp}, args.steps, args.eval_every, args.out_dir))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw=dict(width_ratios=[2, 1]))
    for r in runs:
        ax.plot([t for t, _ in r["evals"]], [v for _, v in r["evals"]], marker="o", ms=3, label=r["name"])
    ax.set_xlabel("training tokens"), ax.set_ylabel("val loss (nats/token)")
    highest = max(v for r in runs for _, v in r["evals"][1:] or r["evals"])   # skip the first, steep evals
    ax.set_ylim(top=min(highest, min(r["final"] for r in runs) + 2))
    ax.set_title("val loss, matched parameters and tokens"), ax.grid(alpha=0.3), ax.legend(fontsize=8)
    bx.bar([r["label"] for r in runs], [r["tokens_per_s"] for r in runs], color=[f"C{i}" for i in range(len(runs))])
    bx.set_title("training tokens/s" + ("\n(CPU; KDA runs the PyTorch reference)" if not cuda else ""))
    bx.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    png = os.path.join(args.out_dir, "hybrid.png")
    fig.savefig(png, dpi=120)

    device = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} thread(s)"
    s = size
    lines = [f"Hybrid vs full attention vs pure KDA on {device}: {s['n_layer']} layers, d={s['n_embd']}, "
             f"{s['n_head']} heads (KDA head dim {s['n_embd'] // s['n_head']}), T={s['block_size']}, "
             f"batch {s['batch_size']}, "
             f"vocab {vocab} (compact Shakespeare), {args.steps} steps × {s['batch_size'] * s['block_size']} tokens, "
             f"{args.optimizer}, seed {args.seed}, cosine schedule, KDA gate {args.kda_gate}"
             + (f" (lower bound {args.kda_gate_lower_bound:g})" if args.kda_gate == "safe" else "") + ". "
             "SwiGLU width per arm chosen to match the hybrid's non-embedding parameters.", "",
             "| arm | pattern | non-embedding params | MLP width | final val loss | val PPL | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['label']} | {r['n_params']:,} | {r['mlp_hidden']} | {r['final']:.4f} | "
                     f"{torch.tensor(r['final']).exp().item():.1f} | {r['tokens_per_s']:,.0f} |")
    lines += ["", "Paper (Kimi Linear Table 1, 1.3B scale): valid PPL 5.65 (3:1) vs 5.77 (pure MLA)."]
    md = os.path.join(args.out_dir, "hybrid.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out_dir, "hybrid.json"), "w") as f:
        json.dump(dict(runs=runs, steps=args.steps, size=size, device=device, kda_gate=args.kda_gate), f)
    print("\n".join(lines))
    print(f"wrote {png} and {md}")


if __name__ == "__main__":
    main()
