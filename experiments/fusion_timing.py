"""Early vs late fusion in miniature (Kimi K2.5, arXiv 2602.02276, Table 1 / Fig. 9 / Table 2 / §2.2).

Three questions, one tiny model.GPT with the vision.py encoder, one optimizer, one token stream:

1. Fusion timing. Same steps, same batch, same number of image-text rows in total:
       early: 10% of each batch is image-text from step 0
       mid:   20% from 50% of training
       late:  50% from 80% of training
   We log text validation loss over training (K2.5 sees text dip when vision arrives late) and
   report final visual-question accuracy (exact match) and text-twin accuracy.
2. Does training on visual tasks alone improve the text twins? From the early model: fine-tune on
   image questions only, and as the control the same number of extra text-only steps; compare the
   text-twin accuracy before and after.
3. Zero-vision SFT: fine-tune the early model on text twins only and measure the accuracy on the
   image versions of the same questions, before and after (against the same text-only control).

Image-text rows replace the first rows of a text batch (as train.py does), so the text tokens per
step drop while vision is on; the loss is on answer tokens in image-text rows and on every token in
text rows. The loop is written out here rather than calling train.train() because experiments 2 and
3 fine-tune on data train.py does not serve (vision-only, twins-only) and all three share weights; its
optimizer and learning-rate schedule are train.py's (build_optimizer, lr_at: warmup over the first 5%,
then cosine to 10% of the peak, no weight decay).

    python experiments/fusion_timing.py                      # CPU default: 7 min on 2 cores
    python experiments/fusion_timing.py --steps=3000 --n_embd=256 --n_layer=4 --block_size=128

Writes out/fusion_timing/{fusion_timing.png, results.md, results.json}.
"""
import argparse
import copy
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import image_tasks  # noqa: E402
import train  # noqa: E402
from model import GPT, Config  # noqa: E402
from runs import bounded  # noqa: E402

ARMS = (("early", 0.1, 0.0), ("mid", 0.2, 0.5), ("late", 0.5, 0.8))   # (name, vision ratio, start fraction)


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=bounded(int, 1), default=300, help="pre-training steps per arm")
    p.add_argument("--ft_steps", type=bounded(int, 1), default=100, help="steps of each fine-tune (experiments 2 and 3)")
    p.add_argument("--batch_size", type=bounded(int, 1), default=10, help="rows per step; 10 makes 10/20/50%% whole rows")
    p.add_argument("--block_size", type=bounded(int, 72), default=80, help=">= 72: the longest text twin")
    train.add_flags(p, n_layer=2, n_head=2, n_embd=48, vision_n_embd=32, vision_n_layer=1)
    p.add_argument("--vision_patch_size", type=bounded(int, 1), default=8, help="8: a 32 x 32 image is 4 LM tokens")
    p.add_argument("--optimizer", default="muonclip", choices=("muonclip", "adamw"),
                   help="muonclip (tau 100, the project default) or adamw")
    p.add_argument("--tasks", default="color_one,side_one",
                   help="comma-separated image_tasks.TASKS to mix; the two one-shape tasks are what a 2-layer model "
                        "learns in 300 CPU steps (with all eight it stays at chance)")
    p.add_argument("--lr", type=bounded(float, 1e-12, 1e3), default=1e-2)
    p.add_argument("--ft_lr", type=bounded(float, 1e-12, 1e3), default=5e-3)
    p.add_argument("--eval_every", type=bounded(int, 1), default=30)
    p.add_argument("--n_eval", type=bounded(int, 1), default=60, help="val questions per accuracy")
    p.add_argument("--data", default="shakespeare")
    p.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=0, help="init, data order and image rows")
    p.add_argument("--threads", type=bounded(int, 0, os.cpu_count()), default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out_dir", default="out/fusion_timing", help="output folder")
    args = p.parse_args()
    try:   # a bad model flag stops here, in one line
        Config(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
               vision_n_embd=args.vision_n_embd, vision_n_layer=args.vision_n_layer, vision_n_head=2,
               vision_patch_size=args.vision_patch_size)
    except ValueError as e:
        p.error(str(e))
    return args


class Stream:
    """Text rows from the corpus and image-text (or twin) rows from image_tasks.VisionTasks, mixed per step."""

    def __init__(self, args, tasks):
        folder = data.prepare(args.data)
        self.train, self.val = data.load_split(folder, "train"), data.load_split(folder, "val")
        self.tasks, self.T = tasks, args.block_size
        gen = torch.Generator().manual_seed(1234)      # fixed validation batches, the same for every arm
        self.val_batches = [data.get_batch(self.val, torch.randint(0, len(self.val) - self.T - 1, (8,), generator=gen), self.T)
                            for _ in range(3)]

    def text(self, n, gen):
        x, y = data.get_batch(self.train, torch.randint(0, len(self.train) - self.T - 1, (n,), generator=gen), self.T)
        return x, y, None

    def mixed(self, batch_size, n_vision, gen, rng, twin=False):
        """n_vision image-text (or twin) rows, then batch_size - n_vision text rows."""
        parts = []
        if n_vision:
            parts.append(self.tasks.batch("train", n_vision, self.T, rng, text_twin=twin))
        if batch_size > n_vision:
            parts.append(self.text(batch_size - n_vision, gen))
        return image_tasks.concat_batches(parts)


@torch.no_grad()
def text_val_loss(model, stream):
    model.eval()
    losses = [model(x, y)[1].item() for x, y in stream.val_batches]
    model.train()
    return float(np.mean(losses))


def run(model, stream, steps, lr, batch_size, plan, seed, log_every=0, label="", optimizer="muonclip"):
    """Train `steps` steps; plan(step) -> (n_vision rows, twin?). Returns the text-val-loss curve."""
    schedule = train.TrainConfig(optimizer=optimizer, lr=lr, weight_decay=0.0, qk_clip_tau=100.0, schedule="cosine",
                                 warmup_iters=max(1, steps // 20), max_iters=steps, min_lr_ratio=0.1)
    opt = train.build_optimizer(model, schedule)
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    curve = []
    t0 = time.time()
    for step in range(steps):
        if log_every and step % log_every == 0:
            curve.append((step, text_val_loss(model, stream)))
        for g in opt.param_groups:
            g["lr"] = train.lr_at(step, schedule)
        n_vision, twin = plan(step)
        idx, targets, images = stream.mixed(batch_size, n_vision, gen, rng, twin)
        _, loss = model(idx, targets, images=images)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and step % log_every == 0:
            print(f"  {label} step {step:4d} | loss {loss.item():.3f} | text val {curve[-1][1]:.3f} | {time.time() - t0:.0f}s", flush=True)
    if log_every:
        curve.append((steps, text_val_loss(model, stream)))
    return curve


def accuracies(model, tasks, n):
    return {"image_acc": tasks.evaluate(model, "val", n), "twin_acc": tasks.evaluate(model, "val", n, text_twin=True)}


def main():
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    t_start = time.time()
    tasks = image_tasks.VisionTasks(seed=args.seed, encoding=data.get_tokenizer(), patch=args.vision_patch_size,
                               tasks=tuple(args.tasks.split(",")))
    stream = Stream(args, tasks)
    cfg = Config(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                 pattern="A", tie_embeddings=True, vision=True)
    cfg.vision_n_embd, cfg.vision_n_layer, cfg.vision_n_head = args.vision_n_embd, args.vision_n_layer, 2
    cfg.vision_patch_size = args.vision_patch_size
    chance = tasks.majority_baseline("val", args.n_eval)
    print(f"chance (majority answer per task) on {args.n_eval} val questions: {chance:.3f}")
    B = args.batch_size
    results = {"args": vars(args), "chance": chance, "arms": {}}

    # ---- experiment 1: fusion timing at an equal number of image-text rows
    models = {}
    for name, ratio, start in ARMS:
        torch.manual_seed(args.seed)                    # identical initial weights in every arm
        model = GPT(cfg)
        n_rows = round(ratio * B)
        first = round(start * args.steps)
        plan = lambda step, n_rows=n_rows, first=first: (n_rows if step >= first else 0, False)  # noqa: E731
        curve = run(model, stream, args.steps, args.lr, B, plan, args.seed, args.eval_every, name, args.optimizer)
        acc = accuracies(model, tasks, args.n_eval)
        results["arms"][name] = {"vision_ratio": ratio, "vision_start": start, "image_rows": n_rows * (args.steps - first),
                                 "curve": curve, "final_text_val_loss": curve[-1][1], **acc}
        models[name] = model
        print(f"{name}: text val {curve[-1][1]:.3f} | image acc {acc['image_acc']:.3f} | twin acc {acc['twin_acc']:.3f}"
              f" | {time.time() - t_start:.0f}s")

    # ---- experiments 2 and 3: fine-tunes of the early-fused model
    base = models["early"]
    before = {k: results["arms"]["early"][k] for k in ("image_acc", "twin_acc")}
    fts = {"vision only": (B, False), "text twins only": (B, True), "text only (control)": (0, False)}
    results["finetune"] = {"before": before, "steps": args.ft_steps}
    for name, (n_rows, twin) in fts.items():
        model = copy.deepcopy(base)
        run(model, stream, args.ft_steps, args.ft_lr, B, lambda step, n=n_rows, t=twin: (n, t), args.seed + 1,
            optimizer=args.optimizer)
        acc = accuracies(model, tasks, args.n_eval)
        acc["text_val_loss"] = text_val_loss(model, stream)
        results["finetune"][name] = acc
        print(f"fine-tune {name}: image acc {before['image_acc']:.3f} -> {acc['image_acc']:.3f} | "
              f"twin acc {before['twin_acc']:.3f} -> {acc['twin_acc']:.3f} | {time.time() - t_start:.0f}s")
    results["seconds"] = time.time() - t_start
    report(results, args)


def report(results, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (name, ratio, start), color in zip(ARMS, ("C0", "C1", "C3")):
        r = results["arms"][name]
        steps, losses = zip(*r["curve"])
        ax1.plot(steps, losses, color=color, label=f"{name}: {ratio:.0%} vision from {start:.0%}")
        if start > 0:
            ax1.axvline(start * args.steps, color=color, ls=":", lw=1)
    ax1.set_xlabel("step"), ax1.set_ylabel("text val loss"), ax1.set_title("text loss while vision enters")
    ax1.legend()
    lo = min(l for r in results["arms"].values() for _, l in r["curve"][len(r["curve"]) // 3:])
    ax1.set_ylim(lo - 0.2, lo + 1.5)
    labels, img, twin = [], [], []
    for name in ("early", "mid", "late"):
        labels.append(name), img.append(results["arms"][name]["image_acc"]), twin.append(results["arms"][name]["twin_acc"])
    for name in ("vision only", "text twins only", "text only (control)"):
        labels.append("early+FT\n" + name.replace(" (control)", "\n(control)"))
        img.append(results["finetune"][name]["image_acc"]), twin.append(results["finetune"][name]["twin_acc"])
    x = np.arange(len(labels))
    ax2.bar(x - 0.2, img, 0.4, label="image questions"), ax2.bar(x + 0.2, twin, 0.4, label="text twins")
    ax2.axhline(results["chance"], color="k", ls="--", lw=1, label="majority-answer chance")
    ax2.set_xticks(x, labels, fontsize=7), ax2.set_ylabel("exact-match accuracy (val)"), ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "fusion_timing.png"), dpi=120)

    lines = [f"{args.optimizer}, tasks {args.tasks}, lr {args.lr}, steps {args.steps}/arm, "
             f"batch {args.batch_size} x {args.block_size}, model {args.n_layer}L x {args.n_embd}, "
             f"fine-tunes {args.ft_steps} steps, {args.n_eval} val questions, chance {results['chance']:.3f}, "
             f"seed {args.seed}, {results['seconds']:.0f}s", "",
             "| arm | vision share | from | image-text rows | final text val loss | image acc | twin acc |",
             "|---|---|---|---|---|---|---|"]
    for name, ratio, start in ARMS:
        r = results["arms"][name]
        lines.append(f"| {name} | {ratio:.0%} | {start:.0%} | {r['image_rows']} | {r['final_text_val_loss']:.3f} | "
                     f"{r['image_acc']:.3f} | {r['twin_acc']:.3f} |")
    b = results["finetune"]["before"]
    lines += ["", "| early model, then fine-tune on | image acc | twin acc | text val loss |", "|---|---|---|---|",
              f"| (before) | {b['image_acc']:.3f} | {b['twin_acc']:.3f} | {results['arms']['early']['final_text_val_loss']:.3f} |"]
    for name in ("vision only", "text twins only", "text only (control)"):
        r = results["finetune"][name]
        lines.append(f"| {name} | {r['image_acc']:.3f} | {r['twin_acc']:.3f} | {r['text_val_loss']:.3f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out_dir}/fusion_timing.png, results.md, results.json")


if __name__ == "__main__":
    main()
