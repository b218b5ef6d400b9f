"""Long context in miniature: synthetic recall tasks that stress a finite recurrent state.

The claims (Kimi Linear, arXiv 2510.26692, §5.1 "synthetic tests"): on Palindrome, multi-query
associative recall (MQAR) and Stack at lengths 256-2048, KDA's per-channel forget gate beats Gated
DeltaNet's one gate per head, and the gap grows with length; a 3:1 hybrid with full attention keeps the
exact recall that a fixed-size state loses.

Tasks (numpy, generated on the fly, no downloads):
  MQAR   n key-value pairs "k1 v1 k2 v2 ...", then the rest of the sequence repeats random pairs, and
         the target at every repeated key is its value. n = T · pairs_frac, so longer sequences hold more
         pairs than a small state (H heads of K×K per layer) can store exactly.
  Stack  a stream of PUSH(symbol) and POP tokens (push with probability push_prob, so the stack deepens
         with length); the target at a POP is the symbol it removes.
  Palindrome  T/2 random symbols, a separator, then the same symbols in reverse order (teacher-forced):
         the target at the separator and at every answer token is the next symbol of the reversed
         sequence, so the whole first half must be held and read back last-in-first-out.
Each model trains on a round-robin mix of the lengths (equal tokens per step) and is evaluated on a fixed
held-out set at every length: accuracy = fraction of target positions predicted exactly.

Arms (model.py, same depth, width, heads, data order and steps; parameter counts in the table):
  K        pure KDA (per-channel gate)         K-head   pure KDA with gate="head" (Gated DeltaNet)
  K-safe   pure KDA with gate="safe" (the per-channel gate bounded below at -5, as Kimi K3 and fla's
           chunk_kda safe gate)
  A        full attention (RoPE)               KKKA     Kimi Linear's 3:1 hybrid (NoPE attention)

    python experiments/long_context.py --quick                 # seconds: tiny shapes (the test runs this)
    nice python experiments/long_context.py                    # 600 steps × 1024 tokens, the README run:
                                                               # 3 tasks × 5 arms, measured on a 2-core CPU,
                                                               # 2026-12-04: wall 42.5 min (CPU 78.5 min);
                                                               # 2 tasks × 4 arms took 14.2-26.8 min before
    nice python experiments/long_context.py --arms=K,K-head --n_seeds=3 --tasks=mqar
Writes out/long_context/long_context.{png,md,json}; state-size knobs: --head_dim, --n_head, --n_embd.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model import GPT, Config  # noqa: E402

ARMS = {  # name -> (pattern, kda_gate, label)
    "K": ("K", "channel", "KDA (channel gate)"),
    "K-head": ("K", "head", "head gate (Gated DeltaNet)"),
    "K-safe": ("K", "safe", "KDA, safe gate (bound -5)"),
    "A": ("A", "channel", "full attention (RoPE)"),
    "KKKA": ("KKKA", "channel", "hybrid 3:1 KKKA (NoPE attn)"),
}
TASKS = ("mqar", "stack", "palindrome")


# -----------------------------------------------------------------------------------------------------
# Tasks: each returns inputs [B, T] int64 and targets [B, T] int64 (-1 where no loss is taken)

def mqar_batch(rng, B, T, n_pairs, n_keys, n_values):
    """Multi-query associative recall. Vocabulary: 0 filler, 1..n_keys keys, then n_values values.

    A sequence is T/2 "key value" slots: the first n_pairs slots state every pair once (the context), every
    later slot repeats a random one of the pairs, and the target at each repeated key is its value. So
    every token after the context is a query (dense supervision: it learns in hundreds of CPU steps,
    where one query per pair at random filler positions, as in Zoology, needs thousands)."""
    slots = T // 2
    if n_pairs > n_keys or n_pairs >= slots:
        raise ValueError(f"mqar: {n_pairs} pairs need n_keys >= {n_pairs} and T > {2 * n_pairs}, got "
                         f"n_keys={n_keys}, T={T}")
    inputs = np.zeros((B, T), dtype=np.int64)                          # an odd T leaves one filler at the end
    targets = np.full((B, T), -1, dtype=np.int64)
    for b in range(B):
        keys = rng.choice(n_keys, size=n_pairs, replace=False) + 1
        values = rng.integers(0, n_values, size=n_pairs) + 1 + n_keys
        order = np.concatenate([rng.permutation(n_pairs), rng.integers(0, n_pairs, size=slots - n_pairs)])
        inputs[b, 0:2 * slots:2], inputs[b, 1:2 * slots:2] = keys[order], values[order]
        # predict the value at its key's position, for every slot after the context
        targets[b, 2 * n_pairs:2 * slots:2] = values[order[n_pairs:]]
    return inputs, targets


def stack_batch(rng, B, T, n_symbols, push_prob):
    """Stack. Vocabulary: 0 POP, 1..n_symbols PUSH(symbol). An empty stack always pushes."""
    inputs = np.zeros((B, T), dtype=np.int64)
    targets = np.full((B, T), -1, dtype=np.int64)
    pushes = rng.random((B, T)) < push_prob
    symbols = rng.integers(1, n_symbols + 1, size=(B, T))
    for b in range(B):
        stack = []
        for t in range(T):
            if pushes[b, t] or not stack:
                stack.append(symbols[b, t])
                inputs[b, t] = symbols[b, t]
            else:
                targets[b, t] = stack.pop()          # input stays 0 = POP
    return inputs, targets


def palindrome_batch(rng, B, T, n_symbols):
    """Palindrome. Vocabulary: 0 separator, 1..n_symbols symbols. A sequence is L = T // 2 random symbols
    s_1..s_L, the separator, then s_L..s_2 (the answer so far, teacher-forced); the target at the separator
    is s_L and at each answer token the next one down to s_1. An odd T ends in one extra separator."""
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


def make_task(name, args):
    """(vocab size, batch(rng, B, T) -> (inputs, targets))."""
    if name == "mqar":
        def batch(rng, B, T):
            return mqar_batch(rng, B, T, max(1, int(T * args.pairs_frac)), args.n_keys, args.n_values)
        return 1 + args.n_keys + args.n_values, batch
    if name == "stack":
        return 1 + args.n_symbols, lambda rng, B, T: stack_batch(rng, B, T, args.n_symbols, args.push_prob)
    if name == "palindrome":
        return 1 + args.n_symbols, lambda rng, B, T: palindrome_batch(rng, B, T, args.n_symbols)
    raise SystemExit(f"error: unknown task {name!r}; use {', '.join(TASKS)}")


# -----------------------------------------------------------------------------------------------------
# Training and evaluation

def build(arm, vocab, args):
    pattern, gate, _ = ARMS[arm]
    cfg = Config(vocab_size=vocab, block_size=max(args.lengths), n_layer=args.n_layer, n_head=args.n_head,
                 n_embd=args.n_embd, pattern=pattern, kda_gate=gate, kda_n_head=args.n_head,
                 kda_head_dim=args.head_dim, backend="auto")
    return GPT(cfg)


@torch.no_grad()
def accuracy(model, evalset, batch_size):
    """Fraction of target positions whose argmax is the target, per length."""
    model.eval()
    out = {}
    for T, (inputs, targets) in evalset.items():
        hits = total = 0
        for i in range(0, len(inputs), batch_size):
            x, y = torch.from_numpy(inputs[i:i + batch_size]), torch.from_numpy(targets[i:i + batch_size])
            logits, _ = model(x)                                             # [b, T, vocab]
            mask = y >= 0
            hits += (logits.argmax(-1)[mask] == y[mask]).sum().item()
            total += mask.sum().item()
        out[T] = hits / total
    model.train()
    return out


def train_arm(arm, task, vocab, batch_fn, evalset, seed, args):
    torch.manual_seed(seed)
    model = build(arm, vocab, args)
    # no weight decay on gains, biases and KDA's A_log / dt_bias (1-D parameters)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=args.weight_decay),
                             dict(params=no_decay, weight_decay=0.0)], lr=args.lr, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 20)
    rng = np.random.default_rng([seed, 1])        # the same data order for every arm of this seed
    curve, t0 = [], time.time()
    for step in range(1, args.steps + 1):
        lr = args.lr * (step / warmup if step <= warmup else
                        0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup))))
        for group in opt.param_groups:
            group["lr"] = lr
        T = args.lengths[(step - 1) % len(args.lengths)]                  # round-robin over lengths
        inputs, targets = batch_fn(rng, max(1, args.tokens_per_step // T), T)
        _, loss = model(torch.from_numpy(inputs), torch.from_numpy(targets))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            acc = accuracy(model, evalset, args.eval_batch)
            curve.append(dict(step=step, loss=loss.item(), acc=acc, seconds=time.time() - t0))
            print(f"[{task} {arm} seed {seed}] step {step:4d} loss {loss.item():.3f} acc " +
                  " ".join(f"T{T}={a:.3f}" for T, a in acc.items()) + f" ({time.time() - t0:.0f}s)", flush=True)
    return dict(arm=arm, task=task, seed=seed, n_params=model.num_params(), curve=curve,
                final=curve[-1]["acc"], seconds=time.time() - t0)


# -----------------------------------------------------------------------------------------------------
# Report

def summarise(runs, tasks, arms, lengths):
    """(task, arm) -> dict(mean {T: acc}, per-seed list, params, seconds)."""
    table = {}
    for task in tasks:
        for arm in arms:
            rs = [r for r in runs if r["task"] == task and r["arm"] == arm]
            if not rs:                         # --report_only before every run has finished
                continue
            table[task, arm] = dict(
                mean={T: float(np.mean([r["final"][T] for r in rs])) for T in lengths},
                seeds=[r["final"] for r in rs], params=rs[0]["n_params"],
                seconds=float(np.mean([r["seconds"] for r in rs])))
    return table


def write_report(runs, args, out_dir, device, wall):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    table = summarise(runs, args.tasks, args.arms, args.lengths)
    fig, axes = plt.subplots(len(args.tasks), 2, figsize=(11, 3.8 * len(args.tasks)), squeeze=False)
    longest = max(args.lengths)
    for row, task in enumerate(args.tasks):
        ax, bx = axes[row]
        for i, arm in enumerate(args.arms):
            color, label = f"C{i}", ARMS[arm][2]
            rs = [r for r in runs if r["task"] == task and r["arm"] == arm]
            if not rs:
                continue
            for r in rs:                                                      # one faint line per seed
                ax.plot(args.lengths, [r["final"][T] for T in args.lengths], color=color, alpha=0.25, lw=1)
                bx.plot([c["step"] for c in r["curve"]], [c["acc"][longest] for c in r["curve"]],
                        color=color, alpha=0.25 if len(rs) > 1 else 1, lw=1)
            ax.plot(args.lengths, [table[task, arm]["mean"][T] for T in args.lengths], marker="o", color=color,
                    label=label)
            if len(rs) > 1:
                steps = [c["step"] for c in rs[0]["curve"]]
                mean = np.mean([[c["acc"][longest] for c in r["curve"]] for r in rs], axis=0)
                bx.plot(steps, mean, color=color, lw=2, label=label)
            else:
                bx.lines[-1].set_label(label)
        extra = {"mqar": f", pairs = {args.pairs_frac:g}·T", "stack": f", push p = {args.push_prob:g}",
                 "palindrome": f", T/2 symbols of {args.n_symbols}"}[task]
        ax.set_xscale("log", base=2), ax.set_xticks(args.lengths, [str(T) for T in args.lengths])
        ax.set_xlabel("sequence length T" + extra), ax.set_ylabel("accuracy")
        ax.set_title(f"{task.upper()}: accuracy vs length after {args.steps} steps")
        bx.set_xlabel("training step"), bx.set_ylabel(f"accuracy at T = {longest}")
        bx.set_title(f"{task.upper()}: accuracy vs steps")
        chance = 1 / (args.n_values if task == "mqar" else args.n_symbols)
        for a in (ax, bx):
            a.axhline(chance, color="gray", ls="--", lw=1, label="chance" if a is ax else None)
            a.set_ylim(-0.02, 1.02), a.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{args.n_layer} layers, d={args.n_embd}, {args.n_head} heads × head dim {args.head_dim} "
                 f"({device}); {len(set(r['seed'] for r in runs))} seed(s)", fontsize=10)
    fig.tight_layout()
    png = os.path.join(out_dir, "long_context.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)

    n_seeds = len(set(r["seed"] for r in runs))
    wall_label = "Sum of the runs' times" if args.report_only else "Total wall time"
    lines = [f"Long-context synthetic tasks on {device}: {args.n_layer} layers, d={args.n_embd}, {args.n_head} "
             f"heads, head dim {args.head_dim} (KDA state {args.n_head}×{args.head_dim}×{args.head_dim} per layer), "
             f"{args.steps} steps × {args.tokens_per_step} tokens (lengths {', '.join(map(str, args.lengths))} "
             f"round-robin), AdamW lr {args.lr:g}, {n_seeds} seed(s) from {args.seed}; accuracy on "
             f"{args.eval_samples} held-out sequences per length, mean over seeds (per-seed values in brackets "
             f"when several). {wall_label} {wall / 60:.1f} min.", ""]
    for task in args.tasks:
        desc = {"mqar": f"MQAR: {args.pairs_frac:g}·T key-value pairs ({', '.join(str(max(1, int(T * args.pairs_frac))) for T in args.lengths)}), "
                        f"{args.n_keys} keys, {args.n_values} values",
                "stack": f"Stack: {args.n_symbols} symbols, push probability {args.push_prob:g}",
                "palindrome": f"Palindrome: T/2 random symbols of {args.n_symbols}, then reversed (chance "
                              f"{1 / args.n_symbols:.4f})"}[task]
        lines += [f"**{desc}**", "",
                  "| arm | non-embedding params | " + " | ".join(f"acc T={T}" for T in args.lengths) + " | wall s per run |",
                  "|---|---|" + "---|" * len(args.lengths) + "---|"]
        for arm in args.arms:
            if (task, arm) not in table:
                lines.append(f"| {ARMS[arm][2]} `{arm}` | – | " + " | ".join("not run" for _ in args.lengths) + " | – |")
                continue
            row = table[task, arm]
            cells = []
            for T in args.lengths:
                cell = f"{row['mean'][T]:.3f}"
                if n_seeds > 1:
                    cell += " [" + ", ".join(f"{s[T]:.2f}" for s in row["seeds"]) + "]"
                cells.append(cell)
            lines.append(f"| {ARMS[arm][2]} `{arm}` | {row['params']:,} | " + " | ".join(cells) +
                         f" | {row['seconds']:.0f} |")
        if task == "stack":
            base = last_push_baseline(make_evalset("stack", args))
            lines.append("| memoryless guess: the last pushed symbol | – | " +
                         " | ".join(f"{base[T]:.3f}" for T in args.lengths) + " | – |")
        lines.append("")
    md = os.path.join(out_dir, "long_context.md")
    with open(md, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out_dir, "long_context.json"), "w") as f:
        json.dump(dict(args=vars(args), device=device, wall_s=wall,
                       runs=[{**r, "final": {str(T): a for T, a in r["final"].items()},
                              "curve": [{**c, "acc": {str(T): a for T, a in c["acc"].items()}} for c in r["curve"]]}
                             for r in runs]), f)
    print("\n".join(lines))
    print(f"wrote {png} and {md}")
    return png, md


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="MQAR, Stack and Palindrome vs length: KDA (channel, head and "
                                             "safe gates), full attention, 3:1 hybrid",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes and a few steps (seconds), for the test")
    # defaults sized for a 2-core CPU: in a probe (K, MQAR, 1 seed) MQAR took off only after ~250 steps
    # and reached 0.86 / 0.62 / 0.38 at T = 128 / 256 / 512 by step 600 (at lr 6e-3 it never left chance)
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps per arm (equal for every arm)")
    ap.add_argument("--seed", type=int, default=0, help="first seed (model init and data order)")
    ap.add_argument("--n_seeds", type=int, default=1, help="seeds seed, seed+1, ... per arm")
    ap.add_argument("--out_dir", default=os.path.join(ROOT, "out", "long_context"), help="where outputs go")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for torch, per process")
    ap.add_argument("--report_only", action="store_true",
                    help="write the figure and table from the runs already saved under out_dir/runs")
    ap.add_argument("--jobs", type=int, default=2, help="runs trained in parallel processes (one per core)")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated from " + ", ".join(TASKS))
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated from " + ", ".join(ARMS))
    ap.add_argument("--lengths", default="128,256,512", help="sequence lengths, trained round-robin")
    ap.add_argument("--tokens_per_step", type=int, default=1024, help="batch size = this // T")
    ap.add_argument("--eval_every", type=int, default=50, help="steps between held-out evaluations")
    ap.add_argument("--eval_samples", type=int, default=32, help="held-out sequences per length")
    ap.add_argument("--eval_batch", type=int, default=32, help="sequences per evaluation forward")
    # state-size knobs: KDA's state is n_head × head_dim × head_dim per layer
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=64)
    ap.add_argument("--n_head", type=int, default=4, help="heads of KDA and attention")
    ap.add_argument("--head_dim", type=int, default=16, help="KDA head dim (attention's is n_embd // n_head)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight_decay", type=float, default=0.01)
    # task knobs
    # T/16 pairs: 8, 16, 32 at T = 128, 256, 512, i.e. half, once and twice the 16 keys a head of dim 16 can
    # hold orthogonal (T/8 stayed at chance in the 300-step run of 2026-12-03)
    ap.add_argument("--pairs_frac", type=float, default=0.0625, help="MQAR key-value pairs per token of length")
    ap.add_argument("--n_keys", type=int, default=64, help="MQAR key vocabulary (>= the most pairs)")
    ap.add_argument("--n_values", type=int, default=16, help="MQAR value vocabulary (chance = 1/n_values)")
    ap.add_argument("--n_symbols", type=int, default=16, help="Stack and Palindrome alphabet")
    ap.add_argument("--push_prob", type=float, default=0.6, help="Stack: > 0.5 deepens the stack with length")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.lengths, args.tokens_per_step = min(args.steps, 6), "32,64", 256
        args.eval_every, args.eval_samples, args.n_embd, args.head_dim = 3, 8, 32, 8
        args.n_keys = args.n_values = 16
        args.jobs = 1
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.arms = [a for a in args.arms.split(",") if a]
    args.lengths = sorted(int(T) for T in args.lengths.split(","))
    for arm in args.arms:
        if arm not in ARMS:
            raise SystemExit(f"error: unknown arm {arm!r}; use {', '.join(ARMS)}")
    for task in args.tasks:
        if task not in TASKS:
            raise SystemExit(f"error: unknown task {task!r}; use {', '.join(TASKS)}")
    return args


def make_evalset(task, args):
    """{T: (inputs, targets)}: the held-out sequences, from their own random stream."""
    _, batch_fn = make_task(task, args)
    eval_rng = np.random.default_rng([12345, ord(task[0])])
    return {T: batch_fn(eval_rng, args.eval_samples, T) for T in args.lengths}


def last_push_baseline(evalset):
    """Stack accuracy of a memoryless guess, the most recently pushed symbol (right whenever a POP follows
    a PUSH): what a model must beat to show that it tracks the stack."""
    out = {}
    for T, (inputs, targets) in evalset.items():
        last = np.maximum.accumulate(np.where(inputs > 0, np.arange(T), 0), axis=1)   # index of the last push
        guess = np.take_along_axis(inputs, last, axis=1)
        mask = targets >= 0
        out[T] = float((guess[mask] == targets[mask]).mean())
    return out


def unit_path(args, task, arm, seed):
    return os.path.join(args.out_dir, "runs", f"{task}_{arm}_seed{seed}.json")


def run_unit(task, arm, seed, args):
    """One (task, arm, seed) training run; self-contained so that worker processes can run it. Each
    finished run is saved at once, so --report_only can write the report from whatever has finished."""
    torch.set_num_threads(args.threads)
    vocab, batch_fn = make_task(task, args)
    run = train_arm(arm, task, vocab, batch_fn, make_evalset(task, args), seed, args)
    os.makedirs(os.path.dirname(unit_path(args, task, arm, seed)), exist_ok=True)
    with open(unit_path(args, task, arm, seed), "w") as f:
        json.dump(run, f)
    return run


def load_unit(path):
    """A saved run, with its length keys back to ints (JSON keys are strings)."""
    with open(path) as f:
        run = json.load(f)
    run["final"] = {int(T): a for T, a in run["final"].items()}
    for c in run["curve"]:
        c["acc"] = {int(T): a for T, a in c["acc"].items()}
    return run


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    device = f"CPU, {args.jobs} process(es) × {args.threads} thread(s)"
    t0 = time.time()
    if args.report_only:
        # the runs saved so far; arms and tasks with no finished run are left out of the report
        runs = [load_unit(unit_path(args, task, arm, seed)) for task in args.tasks for arm in args.arms
                for seed in range(args.seed, args.seed + args.n_seeds)
                if os.path.exists(unit_path(args, task, arm, seed))]
        if not runs:
            raise SystemExit(f"error: no saved runs under {os.path.join(args.out_dir, 'runs')}")
        args.tasks = [t for t in args.tasks if any(r["task"] == t for r in runs)]
        args.arms = [a for a in args.arms if any(r["arm"] == a for r in runs)]
        return write_report(runs, args, args.out_dir, device, sum(r["seconds"] for r in runs))
    units = [(task, arm, seed) for task in args.tasks for seed in range(args.seed, args.seed + args.n_seeds)
             for arm in args.arms]
    if args.jobs > 1:
        # the runs are independent: one process per core beats torch's threads on these tiny matmuls
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs = list(pool.map(run_unit, *zip(*units), [args] * len(units)))
    else:
        runs = [run_unit(task, arm, seed, args) for task, arm, seed in units]
    return write_report(runs, args, args.out_dir, device, time.time() - t0)


if __name__ == "__main__":
    main()
