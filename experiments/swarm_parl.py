"""Agent Swarm / PARL experiment: the five arms of swarm.py over several seeds, tables and figures.

The claims (Kimi K2.5, arXiv 2602.02276, section 3): outcome reward alone collapses the orchestrator to
a single agent (serial collapse); a fixed instantiation reward breeds spawning without decomposition
(spurious parallelism); PARL, r = lambda1 r_parallel + lambda2 r_finish + r_perf with the lambdas
annealed to 0, keeps a parallel policy that needs 3-4.5x fewer critical steps at equal quality on wide
tasks. The recipe (SFT warm start, PARL, the arms, the held-out eval) is swarm.py's `train_arms`; this
file runs it per seed and adds what a single run does not need: an ETA, critical steps to reach a wide
item-F1 against a single agent with no budget, a multi-seed table, the figures, and the demo with the
sub-agents' timeline.

    python experiments/swarm_parl.py                   # seed 0: out/swarm_parl/{table.md, training.png, ...}
    python experiments/swarm_parl.py --seeds 0 1 2     # three seeds, one table ("a / b / c" per cell)
    python experiments/swarm_parl.py --seeds 0 1 2 --jobs 2    # the seeds in 2 processes
    python experiments/swarm_parl.py --demo            # one episode of seed 0's PARL-annealed orchestrator
    python experiments/swarm_parl.py --probe --seeds 0 1 2    # the SFT warm start: how often it samples a good split
    python experiments/swarm_parl.py --seeds 6 7 8 9 10 --jobs 2   # the judging seeds: the claims, seed-paired
    python experiments/swarm_parl.py --quick           # seconds: the whole pipeline on a toy budget (CI)
"""
import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import swarm  # noqa: E402
from protocol import DOES_NOT, REPRODUCES, paired, verdict  # noqa: E402
from swarm_env import EnvConfig, f1_within, serial_calls, task_kind  # noqa: E402

OUT = os.path.join("out", "swarm_parl")
TUNING_SEEDS = (0, 1, 2, 3, 4, 5)     # the recipe was found on these (issues 26 and 37): they judge nothing
JUDGING_SEEDS = (6, 7, 8, 9, 10)      # fixed in the README before the first judging run
TARGETS = (0.5, 0.7, 0.9)
SFT_COST = 0.3   # one SFT step costs about 0.3 PARL updates (measured): the ETA weighs them so


class Progress:
    """Progress with an ETA over a run measured in work units (SFT steps and PARL updates)."""

    def __init__(self, total_units: float):
        self.total, self.done, self.t0, self.last = total_units, 0.0, time.time(), 0.0

    def __call__(self, seed: int, what: str, i: int, n: int, value: float):
        self.done += SFT_COST if what == "SFT" else 1
        now = time.time()
        if now - self.last > 10 or i + 1 == n:
            self.last, el = now, now - self.t0
            eta = el / max(self.done, 1e-9) * (self.total - self.done)
            print(f"  [{el:5.0f} s | {100 * self.done / self.total:3.0f}% | ETA {eta:4.0f} s] seed {seed} {what} "
                  f"{i + 1}/{n} {'loss' if what == 'SFT' else 'reward'} {value:.3f}", flush=True)


def budget_to_reach(episodes: list, target: float, max_budget: int = 400):
    """Smallest critical-step budget at which mean item-F1 over `episodes` reaches `target` (Fig. 8 style)."""
    for b in range(1, max_budget + 1):
        if np.mean([f1_within(ep, b) for ep in episodes]) >= target:
            return b
    return None


def run_seed(seed: int, hp: dict, out_dir: str, progress) -> dict:
    """One seed: swarm.train_arms, the reference single agent with no budget, the budgets to reach F1."""
    torch.set_num_threads(1)
    res, sft = swarm.train_arms(seed, **hp, log=lambda *a: progress(seed, *a))
    swarm_ckpt = os.path.join(out_dir, f"orchestrator_seed{seed}.pt")
    torch.save(res["PARL, annealed"]["model"].state_dict(), swarm_ckpt + ".tmp")
    os.replace(swarm_ckpt + ".tmp", swarm_ckpt)
    # the reference for "critical steps to reach an item-F1": a single agent doing every item itself with
    # no budget (the scripted traces the SFT imitates), since the single-agent arm stops at the budget
    long_cfg, rng = EnvConfig(critical_budget=400), random.Random(seed)
    wide = [ep for ep in res["single agent"]["eval"] if task_kind(ep["task"]) == "wide"]
    ref = [swarm.play(ep["task"], swarm.encode_calls(serial_calls(ep["task"], rng, long_cfg)), long_cfg) for ep in wide]
    out = {"serial, no budget": {"need": {x: budget_to_reach(ref, x) for x in TARGETS}, "wide": ref}, "sft": sft}
    for name, r in res.items():
        r.pop("model")
        r["wide"] = [ep for ep in r["eval"] if task_kind(ep["task"]) == "wide"]
        r["need"] = {x: budget_to_reach(r["wide"], x) for x in TARGETS}
        out[name] = r
    with open(os.path.join(out_dir, f"record_seed{seed}.json"), "w") as f:   # readable while other seeds run
        json.dump(record(out), f, indent=1)
    return out


def record(res: dict) -> dict:
    """What the claims read from one seed's run, JSON-ready: each arm's eval summary and budgets to reach F1."""
    return {name: {"summary": r.get("summary", {}), "need": {str(x): r["need"][x] for x in TARGETS}}
            for name, r in res.items() if isinstance(r, dict) and "need" in r}


def claims(records: dict) -> list:
    """K2.5's four swarm claims, each a seed-paired comparison over the seeds of `records` ({seed: record}):
    (claim, what is compared, Paired, sign, verdict). An arm that never reaches wide F1 0.7 within the
    eval budget counts as needing budget + 1 critical steps. The saving reproduces only if both of its
    differences lie beyond 2 SE and the mean ratio is at least 3x (the low end of the paper's 3-4.5x)."""
    def metric(arm, get):
        return {s: get(r[arm]) for s, r in records.items()}
    never = EnvConfig.critical_budget + 1
    need = lambda a: a["need"]["0.7"] if a["need"]["0.7"] is not None else never  # noqa: E731
    parl, single, serial = "PARL, annealed", "single agent", "serial, no budget"
    saving = paired(metric(parl, need), metric(serial, need))
    quality = paired(metric(parl, lambda a: a["summary"]["wide_f1"]), metric(single, lambda a: a["summary"]["wide_f1"]))
    ratio = statistics.fmean(records[s][serial]["need"]["0.7"] / need(records[s][parl]) for s in records)
    ok = verdict(saving, -1) == REPRODUCES and verdict(quality, +1) == REPRODUCES and ratio >= 3
    rows = [("PARL keeps a parallel policy with 3-4.5x fewer critical steps",
             f"critical steps to wide F1 0.7, {parl} - a single agent with no budget (mean {ratio:.1f}x fewer)",
             saving, -1, REPRODUCES if ok else DOES_NOT),
            ("", f"wide item-F1, {parl} - {single}", quality, +1, REPRODUCES if ok else DOES_NOT)]
    idle = lambda a: a["summary"].get("narrow_idle", math.nan)  # noqa: E731  (no narrow task: no verdict)
    for claim, what, arm_a, arm_b, get, sign in (
            ("outcome reward alone collapses to a single agent", "sub-agents per wide task",
             "outcome only", parl, lambda a: a["summary"]["wide_agents"], -1),
            ("a fixed instantiation reward breeds spurious parallelism", "idle sub-agents per narrow task",
             "outcome + fixed r_parallel", "outcome only", idle, +1),
            ("PARL avoids spurious parallelism", "idle sub-agents per narrow task",
             parl, "outcome + fixed r_parallel", idle, -1)):
        p = paired(metric(arm_a, get), metric(arm_b, get))
        rows.append((claim, f"{what}, {arm_a} - {arm_b}", p, sign, verdict(p, sign)))
    return rows


def claims_table(records: dict) -> str:
    seeds = sorted(records)
    tuned = sorted(set(seeds) & set(TUNING_SEEDS))
    head = (f"Seeds {', '.join(map(str, seeds))}" + (f" (tuning seeds {tuned}: these rows chose the recipe and judge "
                                                       "nothing)" if tuned else " (judging seeds)") + "\n\n")
    lines = ["| claim | seed-paired difference | per seed | mean ± SE | holds | verdict |", "|---" * 6 + "|"]
    for claim, what, p, sign, v in claims(records):
        per_seed = " / ".join(f"{d:+.2f}" for d in p.diffs)
        lines.append(f"| {claim} | {what} | {per_seed} | {p.diff:+.2f} ± {p.se:.2f} | {p.holds(sign)}/{len(p.seeds)} "
                     f"| **{v}** |")
    return head + "\n".join(lines)


def table(per_seed: list, arms) -> str:
    """Every arm a row, every cell the seeds' values separated by ' / '."""
    header = [c[0] for c in swarm.COLUMNS] + [f"crit. steps to wide F1 {x} (x fewer than single)" for x in TARGETS]
    lines = ["| arm | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for name in arms:
        cols = list(zip(*[swarm.cells(r[name]["summary"]) for r in per_seed]))
        for x in TARGETS:
            col = []
            for r in per_seed:
                b, b1 = r[name]["need"][x], r["serial, no budget"]["need"][x]
                col.append("-" if b is None else f"{b}" + ("" if b1 is None else f" ({b1 / b:.1f}x)"))
            cols.append(col)
        lines.append(f"| {name} | " + " | ".join(" / ".join(c) for c in cols) + " |")
    return "\n".join(lines)


def plots(per_seed: list, arms, seeds, out_dir: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(arms, ["k", "tab:blue", "tab:orange", "tab:green", "tab:red"]))
    keys = [("reward", "reward r (sampled)"), ("wide_f1", "item-F1 (wide, sampled)"),
            ("wide_critical", "critical steps (wide)"), ("narrow_agents", "sub-agents / task (narrow)"),
            ("wide_agents", "sub-agents / task (wide)"), ("deep_agents", "sub-agents / task (deep)"),
            ("narrow_finish", "sub-agent finish rate (narrow)"), ("tokens", "episode length (tokens)")]
    fig, axes = plt.subplots(2, 4, figsize=(18, 7))
    for ax, (key, title) in zip(axes.flat, keys):
        for s_i, res in enumerate(per_seed):
            for name in arms:
                h = res[name]["history"]
                if h:
                    ax.plot([r["update"] for r in h], [r.get(key, np.nan) for r in h], color=colors[name],
                            alpha=1.0 if s_i == 0 else 0.4, label=name if s_i == 0 else None)
                elif key not in ("reward", "tokens") and s_i == 0:
                    ax.axhline(res[name]["summary"].get(key, np.nan), color="k", ls="--", lw=1, label=name + " (SFT)")
        ax.set_title(title)
        ax.set_xlabel("PARL update")
    axes.flat[1].legend(fontsize=7)
    fig.suptitle(f"LM orchestrator, PARL arms (seeds {', '.join(map(str, seeds))}; faint = later seeds)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "training.png"), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    budgets = range(1, 121)
    for name in list(arms) + ["serial, no budget"]:
        wide = per_seed[0][name]["wide"]
        ax.plot(list(budgets), [np.mean([f1_within(ep, b) for ep in wide]) for b in budgets],
                color=colors.get(name, "gray"), ls="-" if name in arms else ":", label=name)
    ax.set(xlabel="critical-step budget", ylabel="item-F1", title=f"wide tasks: item-F1 vs critical steps (seed {seeds[0]})")
    ax.axvline(EnvConfig.critical_budget, color="gray", ls=":", lw=1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "f1_vs_critical_steps.png"), dpi=100)
    plt.close(fig)


def probe_warm_start(seed: int, hp: dict, samples: int = 8) -> dict:
    """Can the SFT warm start sample a good parallel episode at all (issue 26)? On the seed's wide eval
    tasks, `samples` sampled episodes each: the share that creates >= 2 sub-agents and hands them every
    item ("good parallel"), and r_perf (budgeted item-F1) of those against the episodes that stay alone
    and the other ones (sub-agents, but not every item handed out)."""
    torch.set_num_threads(1)
    model, _, _, eval_tasks = swarm.warm_start(seed, hp["sft_steps"], hp["sft_lr"], hp["serial_prior"],
                                               hp["decomp_frac"], hp["n_eval"])
    wide = [t for t in eval_tasks if task_kind(t) == "wide"]
    eps = swarm.rollout(model, [t for t in wide for _ in range(samples)], generator=torch.Generator().manual_seed(seed))

    def delegated(ep):
        return {e for st in ep["trace"].stages for r in st.runs for e in (r.task.get("entities") or [])}
    good = [ep for ep in eps if ep["n_created"] >= 2 and len(delegated(ep)) == ep["task"]["width"]]
    alone = [ep for ep in eps if ep["n_created"] == 0]
    other = [ep for ep in eps if ep["n_created"] and ep not in good]       # sub-agents, but not a full split
    perf = lambda group: float(np.mean([swarm.parl_reward(ep, 0, 0)["r_perf"] for ep in group])) if group else None  # noqa: E731
    return {"seed": seed, "episodes": len(eps), "good parallel": len(good), "alone": len(alone),
            "other": len(other), "r_perf good parallel": perf(good), "r_perf alone": perf(alone),
            "r_perf other": perf(other),
            "item-F1 good parallel": float(np.mean([ep["f1"] for ep in good])) if good else None,
            "item-F1 alone": float(np.mean([ep["f1"] for ep in alone])) if alone else None}


def _seed_job(job):
    seed, hp, out_dir, total = job
    return run_seed(seed, hp, out_dir, Progress(total))


def run_experiment(seeds, hp: dict, out_dir: str = OUT, jobs: int = 1, figure: bool = False):
    os.makedirs(out_dir, exist_ok=True)
    arms = hp.get("arms", swarm.ARMS)
    n_trained = sum(a.parl for a in arms.values())
    per_seed_units = SFT_COST * hp["sft_steps"] + n_trained * hp["steps"]
    t0 = time.time()
    if jobs > 1:
        with mp.get_context("fork").Pool(jobs) as pool:
            per_seed = pool.map(_seed_job, [(s, hp, out_dir, per_seed_units) for s in seeds])
    else:
        progress = Progress(len(seeds) * per_seed_units)
        per_seed = [run_seed(s, hp, out_dir, progress) for s in seeds]
    oc, lam = swarm.orchestrator_config(), arms.get("PARL, annealed", swarm.Arm(True, None, None, None))
    n_params = sum(p.numel() for p in swarm.GPT(oc).parameters())
    refs = " / ".join(", ".join(str(r["serial, no budget"]["need"][x]) for x in TARGETS) for r in per_seed)
    note = (f"LM orchestrator ({n_params / 1e3:.0f}k params, pattern {oc.pattern}, {oc.n_layer} layers, width "
            f"{oc.n_embd}); recipe: {', '.join(f'{k} {v}' for k, v in hp.items() if k != 'arms')}; PARL lambda1 "
            f"{lam.lambda1}, lambda2 {lam.lambda2}, annealed to 0 at {lam.anneal_frac} of the updates; r_perf = "
            f"item-F1 within a budget drawn from {EnvConfig.train_budget_min}..{EnvConfig.critical_budget}; "
            f"greedy eval on {hp['n_eval']} held-out tasks per seed (critical budget {EnvConfig.critical_budget}). "
            f"'crit. steps to wide F1 x': the smallest budget at which the arm's mean item-F1 on the wide eval "
            f"tasks reaches x (from the steps at which items arrived), in brackets how many times fewer than a "
            f"single agent doing every item itself with no budget needs ({refs} for F1 "
            f"{', '.join(map(str, TARGETS))}). Total {time.time() - t0:.0f} s wall.\n\n")
    text = note + table(per_seed, arms)
    records = {s: record(r) for s, r in zip(seeds, per_seed)}
    with open(os.path.join(out_dir, "records.json"), "w") as f:
        json.dump({"hp": {k: v for k, v in hp.items() if k != "arms"}, "seeds": records}, f, indent=1)
    if {"single agent", "outcome only", "outcome + fixed r_parallel", "PARL, annealed"} <= set(arms) and len(seeds) > 1:
        text += "\n\n" + claims_table(records)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    plots(per_seed, arms, list(seeds), out_dir)
    if figure:
        for name in ("training", "f1_vs_critical_steps"):
            shutil.copy(os.path.join(out_dir, f"{name}.png"), os.path.join(ROOT, "figures", f"swarm_{name}.png"))
    return per_seed


def timeline(episode: dict, width: int = 50) -> str:
    """The sub-agents' parallel timeline, stage by stage, in critical steps (one column per step).
    Consecutive stages in which the orchestrator worked alone are shown as one line."""
    lines, t = [], 0
    stages = episode["trace"].stages
    t0 = min((r.t_start for st in stages for r in st.runs), default=0.0)   # wall clock: the runs really overlap
    alone = None                                                           # [first stage, steps] of solo stages
    for i, st in enumerate(stages):
        cost = st.critical_steps
        if not st.runs:
            alone = alone or [i, t]
            t += cost
            continue
        if alone:
            lines.append(f"stages {alone[0]}-{i - 1}: the orchestrator alone, critical steps {alone[1]} -> {t}")
            alone = None
        lines.append(f"stage {i}: orchestrator {st.main_steps} step(s), {len(st.runs)} sub-agent(s), "
                     f"critical steps {t} -> {t + cost}")
        for r in st.runs:
            items = r.task.get("entities") or []
            what = f"{len(items)} items" if r.task.get("kind") == "lookup" else f"{r.task.get('hops')} hops"
            bar = " " * min(t + st.main_steps, width) + "#" * min(r.steps, width)
            wall = f"{(r.t_start - t0) * 1e3:4.0f}-{(r.t_end - t0) * 1e3:4.0f} ms"
            lines.append(f"   {r.agent:<4} {what:<9} {r.steps:>3} steps {'done' if r.finished and r.message else 'none'} "
                         f"{wall} |{bar}")
        t += cost
    if alone:
        lines.append(f"stages {alone[0]}-{len(stages) - 1}: the orchestrator alone, critical steps {alone[1]} -> {t}")
    lines.append(f"critical steps {episode['critical']} (trace), total steps {episode['total']}, "
                 f"episode wall time {episode['wall_s'] * 1e3:.0f} ms (decoding included)")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n")[-1])
    ap.add_argument("--demo", action="store_true", help="one episode of the PARL-annealed orchestrator, with its timeline")
    ap.add_argument("--probe", action="store_true", help="only the SFT warm start: how often it samples a good split")
    ap.add_argument("--seed", type=int, default=0, help="one seed (for --demo: whose orchestrator to load)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="several seeds, one table (overrides --seed)")
    ap.add_argument("--jobs", type=int, default=1, help="processes running seeds side by side")
    ap.add_argument("--out_dir", default=OUT, help=f"output folder (default {OUT})")
    ap.add_argument("--figure", action="store_true", help="also copy the two figures to figures/swarm_*.png")
    ap.add_argument("--steps", type=int, default=100, help="PARL updates per trained arm")
    ap.add_argument("--sft_steps", type=int, default=250, help="SFT steps (shared by the arms of a seed)")
    ap.add_argument("--tasks_per_update", type=int, default=8)
    ap.add_argument("--group_size", type=int, default=8, help="samples per task (group baseline)")
    ap.add_argument("--lr", type=float, default=3e-3, help="PARL learning rate (MuonClip)")
    ap.add_argument("--sft_lr", type=float, default=3e-3)
    ap.add_argument("--serial_prior", type=float, default=0.97, help="SFT target weight on the trace's call")
    ap.add_argument("--decomp_frac", type=float, default=0.05, help="share of decomposition traces in SFT")
    ap.add_argument("--entropy_coef", type=float, default=0.01, help="weight of the policy-entropy bonus in PARL")
    ap.add_argument("--lambda1", type=float, default=0.2, help="initial weight of r_parallel")
    ap.add_argument("--lambda2", type=float, default=1.0, help="initial weight of r_finish")
    ap.add_argument("--anneal_frac", type=float, default=1.0, help="lambdas reach 0 at this fraction of updates")
    ap.add_argument("--n_eval", type=int, default=150, help="held-out tasks per seed (~50 of them wide)")
    ap.add_argument("--quick", action="store_true", help="a seconds-long smoke run of the whole pipeline, two seeds (CI)")
    args = ap.parse_args()
    if args.quick:
        args.sft_steps, args.steps, args.tasks_per_update, args.group_size, args.n_eval = 5, 2, 2, 2, 9
        args.seeds = args.seeds or [6, 7]
    if args.demo:
        torch.set_num_threads(1)
        print(timeline(swarm.demo(os.path.join(args.out_dir, f"orchestrator_seed{args.seed}.pt"))))
    else:
        hp = {k: getattr(args, k) for k in ("sft_steps", "steps", "tasks_per_update", "group_size", "lr", "sft_lr",
                                            "serial_prior", "decomp_frac", "entropy_coef", "n_eval")}
        hp["arms"] = swarm.make_arms(args.lambda1, args.lambda2, args.anneal_frac)
        if args.probe:
            for seed in args.seeds or [args.seed]:
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in probe_warm_start(seed, hp).items()},
                      flush=True)
            sys.exit(0)
        run_experiment(tuple(args.seeds or [args.seed]), hp, args.out_dir, args.jobs, args.figure)
