"""Agent Swarm and Parallel-Agent RL (PARL), in miniature: the orchestrator is a language model.

Kimi K2.5 (arXiv 2602.02276, section 3): one trained orchestrator, frozen sub-agents, two tools
(create_subagent, assign_task); cost in critical steps = sum over stages of (orchestrator steps +
slowest sub-agent's steps). Here a `model.GPT` (2 layers, width 64) writes its calls as tokens:

    <bos> <task> FAMILY W |    prompt: lookup (wide) | chain (deep), items 0..W-1
    <create> ROLE M            M sub-agents of ROLE (researcher | fact-checker | coder), named a0, a1, ...
    <assign> aK N, <self> N    aK (or the orchestrator, a step per tool call) takes the next N open items
    <wait>                     gather the stage; reply [<res> aK N ... @ T]: facts per launch, the clock
    <answer>                   submit ([<end>]: budget or context ran out, [<err>]: malformed; both score 0)

SFT on scripted traces (19 in 20 a single agent, 1 in 20 a decomposition blind to the task), then PARL,
100 updates of 8 tasks x K = 8 samples, MuonClip:

    r = lambda1 r_parallel + lambda2 r_finish + r_perf,   lambda_i(u) = lambda_i0 (1 - u / U): 0 at the end
    r_parallel = min(n_created, 16) / 16,   r_finish = n_finished / (n_assigned + n_idle)
    r_perf = mean over B in 10..40 of item-F1(facts arrived by critical step B)
    A = (r - group mean) / group std,   loss = -sum_e A_e sum_t log p / n_orchestrator_tokens - 0.01 H

Run:   python swarm.py                                 five arms, one seed: a table
       python swarm.py --demo                          one episode of the trained orchestrator
       python experiments/swarm_parl.py --seeds 0 1 2  the multi-seed experiment, tables and figures
Test:  python -m pytest tests/test_swarm.py -q
Bench: python bench.py swarm
"""
import argparse
import copy
import math
import os
import random
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from model import GPT, Config
from muonclip import MuonClip
from swarm_env import EnvConfig, Session, decompose_calls, f1_within, make_task, sample_tasks, serial_calls, summarize
from swarm_protocol import MAX_NUM, PAD, TOK, VOCAB, CallParser, ProtocolError, encode_calls, num_tok, render

# --- 1. An episode: tokens in, calls executed by a swarm_env.Session, its replies out as tokens -----


class Episode:
    """One task played through the protocol: step(token) returns the environment's reply tokens."""

    def __init__(self, task: dict, cfg: EnvConfig = EnvConfig(), executor="inline", step_delay: float = 0.0,
                 max_len: int = 240, solo: bool = False):
        self.env, self.cfg, self.max_len = Session(task, cfg, executor, step_delay), cfg, max_len
        self.parser = CallParser(task["width"], 0 if solo else cfg.max_agents)   # solo: no sub-agent tools
        self.tokens = [TOK["<bos>"], TOK["<task>"], TOK[task["family"]], num_tok(task["width"]), TOK["|"]]
        self.is_action = [False] * len(self.tokens)
        self.legal_sets, self.calls = [], []     # per orchestrator token: the legal ids when it was chosen
        self.done, self.error = False, None

    def step(self, t: int) -> list:
        if self.done:
            raise RuntimeError("episode is over")
        self.legal_sets.append(self.parser.legal())
        self.tokens.append(t)
        self.is_action.append(True)
        try:
            call = self.parser.feed(t)
        except ProtocolError as exc:        # a malformed call costs the whole episode
            self.error, self.done = str(exc), True
            self.env.finish(submit=False)
            return self._emit(["<err>"])
        words, env = [], self.env
        if call is not None:
            self.calls.append(call)
            kind = call[0]
            if kind == "create":
                for _ in range(call[2]):
                    env.create(call[1])
            elif kind == "assign" and not env.assign(*call[1:]):
                words = None                # no step left to launch it
            elif kind == "wait":
                words = [w for k, n in env.wait() for w in ("<res>", f"a{k}", str(n))]
            elif kind == "self":
                words = ["<res>", "me", str(env.work(*call[1:]))]
            elif kind == "answer":
                self.done = True
                env.finish(submit=True)
                return []
            self.parser.open = len(env.open_items())     # items that did not come back are open again
        if words:
            words += ["@", str(min(env.t, MAX_NUM))]      # the clock: critical steps so far
        # the budget, or the context (while it can still hold the longest reply: 3 per agent + clock),
        # runs out before <answer>: like a sub-agent stopped at its step cap, the episode submits nothing
        room = 3 * self.cfg.max_agents + 8
        if words is None or env.t >= self.cfg.critical_budget or len(self.tokens) + len(words) + room > self.max_len:
            words, self.done = (words or []) + ["<end>"], True
            env.finish(submit=False)
        return self._emit(words)

    def _emit(self, words: list) -> list:
        ids = [TOK[w] for w in words]
        self.tokens += ids
        self.is_action += [False] * len(ids)
        return ids

    def result(self) -> dict:
        return {**self.env.result(), "error": self.error, "tokens": list(self.tokens),
                "is_action": list(self.is_action), "legal": list(self.legal_sets), "calls": list(self.calls),
                "answered": bool(self.calls) and self.calls[-1] == ("answer",) and self.error is None}


def play(task: dict, ids, cfg: EnvConfig = EnvConfig()) -> dict:
    """Drive one episode with a fixed stream of orchestrator tokens (scripted, tests, SFT traces)."""
    ep = Episode(task, cfg)
    for t in ids:
        if ep.done:
            break
        ep.step(t)
    if not ep.done:
        ep.env.finish(submit=True)
    return ep.result()


# --- 2. The orchestrator model, batched rollouts through its cache, the losses ---------------------


def orchestrator_config(**overrides) -> Config:
    """2 attention layers (RoPE), width 64, 4 heads, context 320; pattern="KA" is the KDA hybrid."""
    base = dict(vocab_size=len(VOCAB), block_size=320, n_layer=2, n_head=4, n_embd=64, pattern="A",
                tie_embeddings=False)
    return Config(**{**base, **overrides})


@torch.no_grad()
def rollout(model: GPT, tasks: list, cfg: EnvConfig = EnvConfig(), greedy: bool = False,
            generator: torch.Generator | None = None, executor="inline", step_delay: float = 0.0,
            solo: bool = False) -> list:
    """Play the tasks' episodes as one grammar-masked batch; returns their result dicts. Each iteration
    feeds every live row its last token plus the environment's reply through the KV cache, right-padded
    (valid mask). solo: no <create> in the grammar (the single-agent baseline)."""
    was_training = model.training
    model.eval()
    eps = [Episode(t, cfg, executor, step_delay, max_len=model.config.block_size - 8, solo=solo) for t in tasks]
    caches = [dict() for _ in model.blocks]
    live = list(range(len(eps)))                  # episode index of each batch row
    chunks = [ep.tokens[:] for ep in eps]
    while live:
        width = max(len(c) for c in chunks)
        idx = torch.full((len(live), width), PAD, dtype=torch.long)
        valid = torch.zeros(len(live), width, dtype=torch.bool)
        mask = torch.zeros(len(live), len(VOCAB), dtype=torch.bool)
        for r, c in enumerate(chunks):
            idx[r, :len(c)], valid[r, :len(c)] = torch.tensor(c), True
            mask[r, eps[live[r]].parser.legal()] = True
        logits, _ = model(idx, caches=caches, valid=valid)
        last = logits[torch.arange(len(live)), valid.sum(1) - 1].masked_fill(~mask, float("-inf"))   # [B, V]
        if greedy:
            nxt = last.argmax(-1)
        else:
            nxt = torch.multinomial(F.softmax(last, -1), 1, generator=generator).squeeze(1)
        chunks, keep = [], []
        for r, e in enumerate(live):
            reply = eps[e].step(int(nxt[r]))
            if not eps[e].done:
                keep.append(r)
                chunks.append([int(nxt[r])] + reply)
        if len(keep) < len(live):                 # drop finished rows from every layer's cache
            rows = torch.tensor(keep, dtype=torch.long)
            for cache in caches:
                cache.update({k: v[rows] for k, v in cache.items() if torch.is_tensor(v)})
            live = [live[r] for r in keep]
    model.train(was_training)
    return [ep.result() for ep in eps]


def _masked_logp(model: GPT, episodes: list):
    """Episodes stacked: grammar-masked log-probs [E, T, V], targets, orchestrator-target mask [E, T],
    legal masks [E, T, V] (all True off the actions: keeps log_softmax finite)."""
    T, E, V = max(len(ep["tokens"]) for ep in episodes) - 1, len(episodes), len(VOCAB)
    x, y = torch.full((E, T), PAD, dtype=torch.long), torch.full((E, T), PAD, dtype=torch.long)
    act, legal = torch.zeros(E, T, dtype=torch.bool), torch.ones(E, T, V, dtype=torch.bool)
    for e, ep in enumerate(episodes):
        toks, n = torch.tensor(ep["tokens"]), len(ep["tokens"]) - 1
        x[e, :n], y[e, :n], act[e, :n] = toks[:-1], toks[1:], torch.tensor(ep["is_action"][1:])
        for p, ids in zip(act[e].nonzero().squeeze(1).tolist(), ep["legal"]):
            legal[e, p] = False
            legal[e, p, ids] = True
    logits, _ = model(x)                                                           # [E, T, V]
    return F.log_softmax(logits.masked_fill(~legal, float("-inf")), -1), y, act, legal


def parl_loss(model: GPT, episodes: list, advantages: torch.Tensor, entropy_coef: float = 0.0) -> torch.Tensor:
    """-sum_e A_e sum_t log p / (orchestrator tokens in the batch), minus entropy_coef x the masked policy's
    mean entropy (keeps it trying other splits). Prompt and environment tokens carry no loss."""
    logp, y, act, legal = _masked_logp(model, episodes)
    lp = torch.where(act, logp.gather(2, y[..., None]).squeeze(2), torch.zeros(act.shape))    # [E, T]
    n_tokens = max(int(act.sum()), 1)
    loss = -(advantages * lp.sum(1)).sum() / n_tokens
    if entropy_coef:
        entropy = -(logp.exp() * torch.where(legal, logp, torch.zeros_like(logp))).sum(-1)   # [E, T]
        loss = loss - entropy_coef * entropy[act].mean()
    return loss


def sft_loss(model: GPT, episodes: list, serial_prior: float = 0.97, arg_prior: float = 0.98) -> torch.Tensor:
    """Cross-entropy on the orchestrator's tokens, the target smoothed over the legal set: serial_prior on
    the trace's call (keeps mass on other calls), arg_prior on an argument (a 16-way split has 48)."""
    logp, y, act, legal = _masked_logp(model, episodes)
    logp = torch.where(legal, logp, torch.zeros_like(logp))
    prior = torch.where(legal[..., TOK["<answer>"]], serial_prior, arg_prior)[..., None]   # <answer>: a call head
    target = (1 - prior) * legal.float() / legal.sum(-1, keepdim=True).float()
    target.scatter_add_(2, y[..., None], prior.expand_as(target[..., :1]).contiguous())
    return -(target * logp).sum(-1)[act].mean()


# --- 3. PARL: reward, lambda schedule, group-relative advantages, the two training stages ----------


def lambda_schedule(update: int, total_updates: int, init: float, anneal_frac: float | None = 1.0) -> float:
    """lambda(u) = init * max(0, 1 - u / (anneal_frac * U)); anneal_frac None = constant init."""
    if anneal_frac is None:
        return init
    if anneal_frac <= 0:
        raise ValueError(f"anneal_frac must be > 0 or None, got {anneal_frac!r}")
    return init * (1.0 - min(1.0, update / (anneal_frac * total_updates)))


N_CAP = 16      # r_parallel saturates at this many sub-agents


def parl_reward(episode: dict, lambda1: float, lambda2: float, cfg: EnvConfig = EnvConfig()) -> dict:
    """r and its terms, the closed forms of the module docstring (budgets B from cfg)."""
    budgets = range(cfg.train_budget_min, cfg.critical_budget + 1)
    r_perf = sum(f1_within(episode, b) for b in budgets) / len(budgets)
    r_parallel = min(episode["n_created"], N_CAP) / N_CAP
    assigned = episode["n_assigned"] + episode.get("n_idle", 0)     # an agent never given a task did not finish
    r_finish = episode["n_finished"] / assigned if assigned else 0.0
    return {"r": lambda1 * r_parallel + lambda2 * r_finish + r_perf,
            "r_perf": r_perf, "r_parallel": r_parallel, "r_finish": r_finish}


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - mean) / std over the K samples of each task (GRPO); equal rewards give 0."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)                     # [tasks, K]
    a = r - r.mean(dim=1, keepdim=True)
    a = a / (r.std(dim=1, keepdim=True) + 1e-3)     # a task's scale does not set its weight
    return a.view(-1)


class Arm(NamedTuple):
    parl: bool                          # trained with PARL; False: the SFT model, evaluated solo
    lambda1: float = 0.0                # initial weights of r_parallel, r_finish
    lambda2: float = 0.0
    anneal_frac: float | None = None    # None: the lambdas stay constant


def make_arms(lambda1: float = 0.2, lambda2: float = 1.0, anneal_frac: float = 1.0) -> dict:
    return {"single agent": Arm(False),
            "outcome only": Arm(True),
            "outcome + fixed r_parallel": Arm(True, lambda1),
            "PARL, no annealing": Arm(True, lambda1, lambda2),
            "PARL, annealed": Arm(True, lambda1, lambda2, anneal_frac)}


ARMS = make_arms()


def _step(opt, loss: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def train_sft(model: GPT, tasks: list, steps: int, batch: int = 32, lr: float = 3e-3, serial_prior: float = 0.97,
              decomp_frac: float = 0.05, seed: int = 0, log=None) -> list:
    """Stage (a): SFT on single-agent traces, decomp_frac of them decompositions; the loss per step."""
    rng = random.Random(seed)
    traces = [play(t, encode_calls(decompose_calls(t, rng) if rng.random() < decomp_frac else serial_calls(t, rng)))
              for t in tasks]
    opt = MuonClip.from_model(model, lr=lr, weight_decay=0.0, qk_clip_tau=100.0)
    model.train()
    losses = []
    for s in range(steps):
        losses.append(_step(opt, sft_loss(model, rng.sample(traces, batch), serial_prior)))
        if log:
            log(s, steps, losses[-1])
    return losses


def train_parl(model: GPT, tasks: list, updates: int, arm: Arm, tasks_per_update: int = 8, group_size: int = 8,
               lr: float = 1e-3, seed: int = 0, entropy_coef: float = 0.0, cfg: EnvConfig = EnvConfig(),
               log=None) -> list:
    """Stage (b): PARL. Returns rollout statistics every 5 updates and at the last."""
    opt = MuonClip.from_model(model, lr=lr, weight_decay=0.0, qk_clip_tau=100.0)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    history = []
    for u in range(updates):
        lam1 = lambda_schedule(u, updates, arm.lambda1, arm.anneal_frac)
        lam2 = lambda_schedule(u, updates, arm.lambda2, arm.anneal_frac)
        episodes = rollout(model, [t for t in rng.sample(tasks, tasks_per_update) for _ in range(group_size)], cfg,
                           generator=gen)
        rewards = torch.tensor([parl_reward(ep, lam1, lam2, cfg)["r"] for ep in episodes])
        model.train()
        _step(opt, parl_loss(model, episodes, group_advantages(rewards, group_size), entropy_coef))
        if u % 5 == 0 or u == updates - 1:
            history.append({"update": u, "lambda1": lam1, "lambda2": lam2, "reward": rewards.mean().item(),
                            "tokens": float(np.mean([len(ep["tokens"]) for ep in episodes])), **summarize(episodes)})
        if log:
            log(u, updates, rewards.mean().item())
    return history


# --- 4. One seed of the experiment: the five arms from one shared SFT warm start; the demo ----------


def warm_start(seed: int = 0, sft_steps: int = 250, sft_lr: float = 3e-3, serial_prior: float = 0.97,
               decomp_frac: float = 0.05, n_eval: int = 60, cfg: EnvConfig = EnvConfig(), log=None) -> tuple:
    """A seed's SFT model, losses, 600 train tasks and n_eval held-out ones (1/3 narrow, wide, deep)."""
    torch.manual_seed(seed)
    train_tasks = sample_tasks(random.Random(seed), 600, cfg=cfg)
    eval_tasks = sample_tasks(random.Random(10_000 + seed), n_eval, mix=(1 / 3, 1 / 3, 1 / 3), cfg=cfg)
    model = GPT(orchestrator_config())
    sft = train_sft(model, train_tasks, sft_steps, lr=sft_lr, serial_prior=serial_prior, decomp_frac=decomp_frac,
                    seed=seed, log=log)
    return model, sft, train_tasks, eval_tasks


def train_arms(seed: int = 0, sft_steps: int = 250, steps: int = 100, tasks_per_update: int = 8, group_size: int = 8,
               lr: float = 3e-3, sft_lr: float = 3e-3, serial_prior: float = 0.97, decomp_frac: float = 0.05,
               entropy_coef: float = 0.01, arms: dict = ARMS, n_eval: int = 60, cfg: EnvConfig = EnvConfig(),
               log=None) -> tuple:
    """SFT once, PARL per arm from it, greedy eval: ({arm: {model, eval, summary, history}}, SFT losses)."""
    log = log or (lambda what, i, n, value: None)
    base, sft, train_tasks, eval_tasks = warm_start(seed, sft_steps, sft_lr, serial_prior, decomp_frac, n_eval, cfg,
                                                    log=lambda s, n, loss: log("SFT", s, n, loss))
    results = {}
    for name, arm in arms.items():
        model = copy.deepcopy(base)
        hist = train_parl(model, train_tasks, steps, arm, tasks_per_update, group_size, lr=lr, seed=seed,
                          entropy_coef=entropy_coef, cfg=cfg,
                          log=lambda u, n, r: log(name, u, n, r)) if arm.parl else []
        eps = rollout(model, eval_tasks, cfg, greedy=True, solo=not arm.parl)   # the single agent: no tools
        results[name] = {"model": model, "eval": eps, "summary": summarize(eps), "history": hist}
    return results, sft


COLUMNS = [("wide item-F1", "wide_f1", "{:.3f}"), ("wide crit. steps", "wide_critical", "{:.1f}"),
           ("sub-agents narrow", "narrow_agents", "{:.1f}"), ("sub-agents wide", "wide_agents", "{:.1f}"),
           ("sub-agents deep", "deep_agents", "{:.1f}"), ("sub-agent finish rate", "all_finish", "{:.2f}"),
           ("finish rate narrow", "narrow_finish", "{:.2f}"),
           ("episodes answered", "all_answered", "{:.2f}"), ("deep item-F1", "deep_f1", "{:.3f}")]


def cells(summary: dict) -> list:
    """One arm's table cells in COLUMNS order ("-" where a rate has no cases)."""
    values = [summary.get(key, float("nan")) for _, key, _ in COLUMNS]
    return ["-" if math.isnan(v) else fmt.format(v) for v, (_, _, fmt) in zip(values, COLUMNS)]


def demo(path: str) -> dict:
    """One greedy episode of a trained orchestrator on a 20-item lookup, printed as it was written."""
    if not os.path.exists(path):
        raise SystemExit(f"no trained orchestrator at {path}: train one first (python swarm.py, same --seed)")
    model = GPT(orchestrator_config())
    try:   # an empty, torn or foreign file is one line (weights_only: a pickle's payload never runs)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as e:
        raise SystemExit(f"error: {path} is not a trained orchestrator ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:160]}); train one again (python swarm.py, same --seed)") from None
    task = make_task(random.Random(3), "lookup", 20)
    print(f"loaded {path}\ntask: {task['question'][:110]}...\n")
    ep = rollout(model, [task], greedy=True, executor="thread", step_delay=0.002)[0]
    print("the episode as the orchestrator wrote it ([environment tokens] were appended by the runtime):\n")
    print(render(ep["tokens"], ep["is_action"]))
    print(f"\nitem-F1 {ep['f1']:.3f}, sub-agents {ep['n_created']}, finished {ep['n_finished']}/{ep['n_assigned']}, "
          f"critical steps {ep['critical']} (budget {EnvConfig.critical_budget})")
    return ep


def _log(seed: int):
    def log(what, i, n, value):
        if (i + 1) % 10 == 0 or i + 1 == n:
            print(f"seed {seed} {what}: {i + 1}/{n}, {'loss' if what == 'SFT' else 'mean reward'} {value:.3f}",
                  flush=True)
    return log


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", action="store_true", help="print one episode written by the trained orchestrator")
    parser.add_argument("--seed", type=int, default=0, help="seed (for --demo: whose orchestrator to load)")
    parser.add_argument("--out_dir", default="out/swarm", help="where the PARL-annealed orchestrator is written")
    args = parser.parse_args()
    ckpt = os.path.join(args.out_dir, f"orchestrator_seed{args.seed}.pt")
    if args.demo:
        demo(ckpt)
    else:
        torch.set_num_threads(1)
        res, _ = train_arms(args.seed, log=_log(args.seed))
        os.makedirs(args.out_dir, exist_ok=True)
        torch.save(res["PARL, annealed"]["model"].state_dict(), ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)                 # a checkpoint is whole or absent
        print(f"\nseed {args.seed}, greedy on the held-out tasks; the PARL-annealed orchestrator is in {ckpt}\n")
        print("| arm | " + " | ".join(c[0] for c in COLUMNS) + " |\n" + "|---" * (len(COLUMNS) + 1) + "|")
        for name, r in res.items():
            print(f"| {name} | " + " | ".join(cells(r["summary"])) + " |")
