"""Agent Swarm and Parallel-Agent RL (PARL), in miniature.

Kimi K2.5 (arXiv 2602.02276, section 3) trains one orchestrator that may call two extra tools,
`create_subagent(name, system_prompt)` and `assign_task(agent, task)`. Sub-agents are frozen (fixed
earlier checkpoints), run in parallel, and each returns one message; only the orchestrator learns.
Cost is counted in critical steps, the length of the longest path through the episode:

    CriticalSteps = sum over stages t of ( S_main(t) + max_i S_sub,i(t) )

next to total steps (all work done) and wall time. The orchestrator is trained on

    r = lambda1 * r_parallel + lambda2 * r_finish + r_perf,    lambda1, lambda2 annealed to 0.

r_parallel fights *serial collapse* (never delegating), r_finish fights *spurious parallelism*
(spawning many sub-agents that do nothing useful). The report gives neither closed form nor schedule.
This file's choices (all are arguments of `parl_reward` and `lambda_schedule`):

    r_perf     = item-F1 of the answer (or exact success, `perf="success"`)
    r_parallel = min(n_created, n_cap) / n_cap                  (n_cap = 16)
    r_finish   = n_finished / n_assigned, 0 when nothing was assigned; a sub-agent counts as
                 finished only if it answered within its step budget with a non-empty message
    lambda_i(u) = lambda_i0 * max(0, 1 - u / (anneal_frac * U))  (linear, zero from anneal_frac*U on;
                 anneal_frac=None keeps lambda_i0 fixed; kind="cosine" uses a half cosine instead)
    defaults: lambda1_0 = 0.2, lambda2_0 = 0.4 (lambda2 > lambda1, else spawning n_cap agents for a
    2-item task ties with spawning 2), anneal_frac = 0.6. Critical steps stay a budget (episode limit),
    not a reward term, as in the report; a stage's orchestrator cost is 1 + n // 8 (reading results).

The pieces, top to bottom:
  1. Runtime: `SwarmRuntime` with create_subagent / assign_task / main_step / gather / answer; sub-agents
     are generators that yield once per step, driven under a step budget on a thread pool (default),
     a process pool, or inline; every episode leaves a `Trace`.
  2. Environment: offline generated tasks. "lookup" (wide: collect the attribute of K entities, each
     hidden among distractor documents) and "chain" (deep: follow a relation L hops; a hop needs the
     previous answer, so splitting does not help). Frozen scripted sub-agents, whose role comes from
     the system prompt (researcher, fact-checker, ...). Scored by item-F1 and exact success.
  3. Policy and PARL: a linear softmax policy over a one-hot of the task state (family, items left,
     stage) picks how many sub-agents to spawn this stage (0 = finish the work alone); the remaining
     items are split evenly among them. Trained with a group-relative policy gradient (K samples per
     task, group-mean baseline, no std normalisation; K2.5's log-ratio masking and squared log-ratio
     penalty are left out because every update is on-policy here).
  4. Experiment: five arms (single agent, outcome only, outcome + fixed r_parallel, PARL without
     annealing, PARL annealed) with plots and a markdown table under out/swarm/.

Run:  python swarm.py            (trains the five arms on CPU in a few minutes)
      python swarm.py --bench    (runtime overhead per step: 100 sub-agents, 1,500 steps)
      python swarm.py --demo     (one traced episode with roles, on the thread pool)
"""
import argparse
import concurrent.futures as cf
import math
import os
import pickle
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------
# 1. Runtime
# ---------------------------------------------------------------------------------------------------


@dataclass
class SubagentRun:
    agent: str
    system_prompt: str
    task: Any
    steps: int = 0
    finished: bool = False      # returned its message within its step budget
    message: Any = None         # the one message it returns (None when cut off or crashed)
    error: str | None = None
    t_start: float = 0.0
    t_end: float = 0.0


@dataclass
class Stage:
    main_steps: int = 0
    runs: list = field(default_factory=list)    # SubagentRun, one per assign_task in this stage

    @property
    def critical_steps(self) -> int:
        # a stage lasts as long as its longest sub-agent
        return self.main_steps + max((r.steps for r in self.runs), default=0)


def _stage_parts(stage):
    if isinstance(stage, Stage):
        return stage.main_steps, [r.steps for r in stage.runs]
    main, subs = stage
    return int(main), [int(s) for s in subs]


def critical_steps(stages) -> int:
    """sum_t (S_main(t) + max_i S_sub,i(t)); stages are `Stage`s or (main_steps, [sub steps]) pairs."""
    total = 0
    for stage in stages:
        main, subs = _stage_parts(stage)
        total += main + max(subs, default=0)
    return total


def total_steps(stages) -> int:
    """All work done: orchestrator steps plus every sub-agent's steps."""
    total = 0
    for stage in stages:
        main, subs = _stage_parts(stage)
        total += main + sum(subs)
    return total


@dataclass
class Trace:
    stages: list = field(default_factory=list)
    answer: Any = None
    wall_s: float = 0.0

    @property
    def critical_steps(self) -> int:
        return critical_steps(self.stages)

    @property
    def total_steps(self) -> int:
        return total_steps(self.stages)

    def summary(self) -> str:
        lines = [f"critical steps {self.critical_steps}, total steps {self.total_steps}, "
                 f"wall {self.wall_s * 1e3:.1f} ms"]
        for t, st in enumerate(self.stages):
            lines.append(f"stage {t}: main {st.main_steps}, sub-agents {len(st.runs)}, cost {st.critical_steps}")
            for r in st.runs[:6]:
                msg = repr(r.message)
                lines.append(f"   {r.agent:<10} [{r.system_prompt[:28]}...] steps {r.steps:>3} "
                             f"finished {r.finished!s:<5} -> {msg[:60]}")
            if len(st.runs) > 6:
                lines.append(f"   ... {len(st.runs) - 6} more")
        return "\n".join(lines)


def run_subagent(worker: Callable, system_prompt: str, task: Any, budget: int, step_delay: float = 0.0):
    """Drive one frozen sub-agent under its step budget.

    `worker(system_prompt, task)` is a generator: each `yield` is one step (a tool call), its `return`
    value is the single message sent back. A worker that asks for step budget+1 is cut off and sends
    nothing, like an agent stopped at its step limit before writing its report.
    Module level so a process pool can pickle it. Returns (steps, finished, message, error, t0, t1).
    """
    t0 = time.perf_counter()
    steps, finished, message, error = 0, False, None, None
    try:
        gen = worker(system_prompt, task)
        if not hasattr(gen, "__next__"):
            raise TypeError(f"worker must be a generator function, got {type(gen).__name__}")
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                finished, message = True, stop.value
                break
            if steps == budget:      # asks for one step more than allowed
                gen.close()
                break
            steps += 1
            if step_delay:
                time.sleep(step_delay)   # simulated tool latency
    except Exception as exc:  # a crashing worker is an unfinished sub-agent, not a crashed episode
        error = f"{type(exc).__name__}: {exc}"
    return steps, finished, message, error, t0, time.perf_counter()


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class SwarmRuntime:
    """One episode of an orchestrator with sub-agents.

    create_subagent(name, system_prompt) registers a frozen worker with a role; assign_task(agent, task)
    launches it at once on the executor; gather() waits for every launch of the open stage and closes
    it; main_step(k) records the orchestrator's own tool calls; answer(x) ends the episode.
    executor: "thread" (default), "process", "inline" (sequential, same trace: handy for fast RL
    rollouts where cost is counted in steps), or an existing concurrent.futures.Executor to share.
    """

    def __init__(self, worker: Callable, *, sub_step_budget: int = 100, main_step_budget: int = 100,
                 executor="thread", max_workers: int | None = None, max_subagents: int = 100,
                 step_delay: float = 0.0):
        _positive_int("sub_step_budget", sub_step_budget)
        _positive_int("main_step_budget", main_step_budget)
        _positive_int("max_subagents", max_subagents)
        if step_delay < 0:
            raise ValueError(f"step_delay must be >= 0, got {step_delay!r}")
        self.worker, self.sub_step_budget, self.main_step_budget = worker, sub_step_budget, main_step_budget
        self.max_subagents, self.step_delay = max_subagents, step_delay
        self.agents: dict[str, str] = {}   # name -> system prompt
        self._owns_pool = False
        if isinstance(executor, cf.Executor):
            self.pool = executor
        elif executor == "thread":
            self.pool, self._owns_pool = cf.ThreadPoolExecutor(max_workers or max_subagents), True
        elif executor == "process":
            try:   # the pool pickles the worker for every task; fail here, not inside gather()
                pickle.dumps(worker)
            except Exception as exc:
                raise TypeError(f"executor='process' needs a picklable, module-level worker: {exc}") from None
            self.pool, self._owns_pool = cf.ProcessPoolExecutor(max_workers or os.cpu_count()), True
        elif executor == "inline":
            self.pool = None
        else:
            raise ValueError(f"executor must be 'thread', 'process', 'inline' or an Executor, got {executor!r}")
        self.trace = Trace()
        self.main_steps_used = 0
        self.done = False
        self._open: Stage | None = None
        self._pending: list = []     # (SubagentRun, future or result tuple)
        self._t0 = time.perf_counter()

    # the two tools of the report --------------------------------------------------------------------
    def create_subagent(self, name: str, system_prompt: str) -> str:
        self._check_open()
        if not isinstance(name, str) or not name:
            raise ValueError(f"sub-agent name must be a non-empty str, got {name!r}")
        if name in self.agents:
            raise ValueError(f"sub-agent {name!r} already exists")
        if len(self.agents) >= self.max_subagents:
            raise ValueError(f"cannot create {name!r}: max_subagents={self.max_subagents} reached")
        self.agents[name] = str(system_prompt)
        return name

    def assign_task(self, agent: str, task: Any, budget: int | None = None) -> SubagentRun:
        """Launch `agent` on `task` now; it runs concurrently with the other launches of this stage."""
        self._check_open()
        if agent not in self.agents:
            known = ", ".join(sorted(self.agents)[:10]) or "none"
            raise ValueError(f"unknown agent {agent!r}; created so far: {known}")
        budget = self.sub_step_budget if budget is None else min(budget, self.sub_step_budget)
        _positive_int("budget", budget)
        if self._open is None:
            self._open = Stage(main_steps=1)   # the orchestrator turn that launches the group
        run = SubagentRun(agent, self.agents[agent], task)
        args = (self.worker, self.agents[agent], task, budget, self.step_delay)
        job = run_subagent(*args) if self.pool is None else self.pool.submit(run_subagent, *args)
        self._open.runs.append(run)
        self._pending.append((run, job))
        return run

    # orchestrator bookkeeping -----------------------------------------------------------------------
    def main_step(self, k: int = 1):
        """k orchestrator tool calls: their own stage, or overhead of the open stage's group."""
        self._check_open()
        _positive_int("main steps", k)
        if self.main_steps_used + k > self.main_step_budget:
            raise ValueError(f"orchestrator step budget {self.main_step_budget} exceeded "
                             f"({self.main_steps_used} used, {k} more asked)")
        self.main_steps_used += k
        if self.step_delay:
            time.sleep(k * self.step_delay)
        if self._open is not None:
            self._open.main_steps += k
        else:
            self.trace.stages.append(Stage(main_steps=k))

    def gather(self) -> list:
        """Wait for every sub-agent of the open stage; close the stage; return its SubagentRuns."""
        self._check_open()
        if self._open is None:
            return []
        for run, job in self._pending:
            res = job if isinstance(job, tuple) else job.result()
            run.steps, run.finished, run.message, run.error, run.t_start, run.t_end = res
        stage, self._open, self._pending = self._open, None, []
        self.main_steps_used += 1
        self.trace.stages.append(stage)
        return stage.runs

    def answer(self, answer: Any) -> Trace:
        self._check_open()
        self.gather()
        self.trace.answer, self.done = answer, True
        self.trace.wall_s = time.perf_counter() - self._t0
        self.close()
        return self.trace

    def close(self):
        if self._owns_pool:
            self.pool.shutdown(wait=True)
            self._owns_pool = False

    def _check_open(self):
        if self.done:
            raise ValueError("episode already answered: start a new SwarmRuntime for a new task")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------------
# 2. Environment: offline wide (lookup) and deep (chain) tasks, frozen scripted sub-agents
# ---------------------------------------------------------------------------------------------------

_SYLLABLES = ["ka", "ri", "mo", "ten", "sa", "lo", "vi", "dar", "nu", "pe", "zo", "ul", "fen", "qi", "bra", "tor"]
_ATTRIBUTES = {"home city": ["Osaka", "Lyon", "Quito", "Perth", "Tartu", "Accra", "Hanoi", "Bergen"],
               "favourite colour": ["teal", "amber", "crimson", "olive", "indigo", "ivory"],
               "birth year": [str(y) for y in range(1901, 1999)]}
ROLES = {"researcher": "You are a researcher. Search the corpus and report exactly what was asked.",
         "fact-checker": "You are a fact-checker. Verify each claim against the corpus.",
         "coder": "You are a coder. Write and run code for the request."}


def _entity_names(rng, n):
    names = set()
    while len(names) < n:
        names.add("".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize())
    return sorted(names, key=lambda _: rng.random())


def make_task(rng: random.Random, family: str, width: int) -> dict:
    """One offline task with its own small corpus. family: "lookup" (wide) or "chain" (deep).

    Each entity's fact sits in one document among 0-2 distractor documents that only mention it; a
    worker searches (1 step) then reads documents in search order (1 step each): 2-4 steps per item.
    """
    if family not in ("lookup", "chain"):
        raise ValueError(f"family must be 'lookup' or 'chain', got {family!r}")
    _positive_int("width", width)
    docs, index = [], {}
    names = _entity_names(rng, width + 1)

    def add_docs(entity, fact):
        hits = []
        for _ in range(rng.randint(0, 2)):
            hits.append(len(docs))
            docs.append(f"{entity} was seen in {rng.choice(_ATTRIBUTES['home city'])} with {rng.choice(names)}.")
        hits.insert(rng.randint(0, len(hits)), len(docs))   # where the fact lands sets the item's cost
        docs.append(f"Archive note. {fact} Filed by {rng.choice(names)}.")
        index[entity] = hits

    if family == "lookup":
        attr = rng.choice(list(_ATTRIBUTES))
        gold = {e: rng.choice(_ATTRIBUTES[attr]) for e in names[:width]}
        for e, v in gold.items():
            add_docs(e, f"The {attr} of {e} is {v}.")
        question = f"List the {attr} of each of: {', '.join(gold)}."
        meta = {"attribute": attr}
    else:
        gold = {h: names[h] for h in range(1, width + 1)}   # hop h -> the h-th mentor along the chain
        for h in range(width):
            add_docs(names[h], f"The mentor of {names[h]} is {names[h + 1]}.")
        question = f"Start at {names[0]} and follow 'mentor' {width} times; name every mentor on the way."
        meta = {"start": names[0]}
    return {"family": family, "width": width, "question": question, "gold": gold,
            "corpus": {"docs": docs, "index": index}, **meta}


def role_of(system_prompt: str) -> str:
    text = system_prompt.lower()
    for role in ROLES:
        if role in text:
            return role
    return "unknown"


def scripted_worker(system_prompt: str, task: dict):
    """A frozen sub-agent: a fixed program, never trained. Its role comes from the system prompt.

    Sub-tasks: {"kind": "lookup", "entities", "attribute"}, {"kind": "follow", "start", "first_hop",
    "hops"} (start None = the start is not known yet), {"kind": "verify", "claims": {entity: value}}.
    A role that does not fit the sub-task, or an empty sub-task, spends one step and returns {}.
    """
    role, corpus = role_of(system_prompt), task.get("corpus", {"docs": [], "index": {}})
    docs, index = corpus["docs"], corpus["index"]
    kind = task.get("kind")
    found = {}
    if role == "researcher" and kind == "lookup" and task["entities"]:
        for entity in task["entities"]:
            yield ("search", entity)
            for doc_id in index.get(entity, []):
                yield ("read", doc_id)
                m = re.search(rf"The {task['attribute']} of {entity} is (\w+)\.", docs[doc_id])
                if m:
                    found[entity] = m.group(1)
                    break
        return found
    if role == "researcher" and kind == "follow" and task["start"] is not None and task["hops"] > 0:
        current = task["start"]
        for hop in range(task["first_hop"], task["first_hop"] + task["hops"]):
            yield ("search", current)
            nxt = None
            for doc_id in index.get(current, []):
                yield ("read", doc_id)
                m = re.search(rf"The mentor of {current} is (\w+)\.", docs[doc_id])
                if m:
                    nxt = m.group(1)
                    break
            if nxt is None:
                break
            found[hop] = current = nxt
        return found
    if role == "fact-checker" and kind == "verify" and task["claims"]:
        for entity, value in task["claims"].items():
            yield ("search", entity)
            for doc_id in index.get(entity, []):
                yield ("read", doc_id)
                if f"of {entity} is" in docs[doc_id]:
                    found[entity] = f"of {entity} is {value}." in docs[doc_id]
                    break
        return found
    yield ("think", None)
    return {}


def sleepy_worker(system_prompt: str, task: dict):
    """A worker whose steps just wait (stands in for tool latency); used to check real overlap."""
    for _ in range(task["steps"]):
        yield
        time.sleep(task.get("sleep", 0.0))
    return system_prompt


def item_f1(answer: dict, gold: dict) -> float:
    if not answer and not gold:
        return 1.0
    correct = sum(1 for k, v in answer.items() if gold.get(k) == v)
    if correct == 0:
        return 0.0
    precision, recall = correct / len(answer), correct / len(gold)
    return 2 * precision * recall / (precision + recall)


N_CHOICES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)   # sub-agents per stage; 0 = finish alone


@dataclass
class EnvConfig:
    critical_budget: int = 40     # episode limit in critical steps (K2.5 constrains by these, not total)
    sub_step_budget: int = 16     # each sub-agent's step cap
    max_stages: int = 4           # orchestrator turns that may delegate
    agents_per_main_step: int = 8  # reading back results: +1 orchestrator step per 8 sub-agents
    max_width: int = 48


WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)   # items left, bucketed on a log scale (upper edges)


def state_features(task: dict, left: int, stage: int, cfg: EnvConfig) -> list:
    """What the orchestrator policy reads: a one-hot of (task family, work left in log buckets, stage).
    One cell per state, so what is learned on wide tasks cannot leak into narrow ones through shared
    weights (with a shared bias, the large wide-task advantages dragged narrow tasks to 16 agents)."""
    bucket = next(i for i, edge in enumerate(WIDTH_BUCKETS) if left <= edge or edge == WIDTH_BUCKETS[-1])
    family = 0 if task["family"] == "lookup" else 1
    cell = (family * len(WIDTH_BUCKETS) + bucket) * cfg.max_stages + min(stage, cfg.max_stages - 1)
    feats = [0.0] * (2 * len(WIDTH_BUCKETS) * cfg.max_stages)
    feats[cell] = 1.0
    return feats


N_FEATURES = 2 * len(WIDTH_BUCKETS) * EnvConfig.max_stages


def _subtasks(task, remaining, current, n):
    """Split the remaining work evenly into n sub-tasks (some empty when n > items left)."""
    corpus = task["corpus"]
    if task["family"] == "lookup":
        return [{"kind": "lookup", "entities": remaining[i::n], "attribute": task["attribute"], "corpus": corpus}
                for i in range(n)]
    # a chain: contiguous hop ranges; only the first knows where to start
    sizes = [len(remaining) // n + (1 if i < len(remaining) % n else 0) for i in range(n)]
    subs, first = [], remaining[0] if remaining else 0
    for i, size in enumerate(sizes):
        subs.append({"kind": "follow", "start": current if i == 0 else None, "first_hop": first,
                     "hops": size, "corpus": corpus})
        first += size
    return subs


def run_episode(task: dict, choose_n: Callable, cfg: EnvConfig = EnvConfig(), executor="inline",
                step_delay: float = 0.0, worker: Callable = scripted_worker) -> dict:
    """Play one task: at each stage the orchestrator picks n sub-agents (0 = do the rest alone).

    choose_n(features) -> index into N_CHOICES. Items answered carry the critical step at which they
    arrived, so F1 under any smaller critical budget can be read off afterwards (`f1_at_budget`).
    """
    rt = SwarmRuntime(worker, sub_step_budget=cfg.sub_step_budget, main_step_budget=cfg.critical_budget * 4,
                      executor=executor, step_delay=step_delay)
    gold, chain = task["gold"], task["family"] == "chain"
    remaining = list(gold)                       # lookup: entities; chain: hop numbers
    current = task.get("start")                  # chain: the last entity reached
    answer, arrived, t = {}, {}, 0
    decisions, n_assigned, n_finished = [], 0, 0
    stage = 0
    while remaining and t < cfg.critical_budget:
        choice = 0                               # out of delegating turns: finish alone
        if stage < cfg.max_stages:
            feats = state_features(task, len(remaining), stage, cfg)
            choice = choose_n(feats)
            decisions.append((feats, choice))    # only the policy's own choices enter the gradient
        n = N_CHOICES[choice]
        if n == 0:
            # the orchestrator works alone: every tool call is one main (and critical) step
            for item in list(remaining):
                sub = _subtasks(task, [item], current, 1)[0]
                steps, _, msg, _, _, _ = run_subagent(worker, ROLES["researcher"], sub, cfg.critical_budget - t)
                if steps:
                    rt.main_step(steps)
                t += steps
                if not msg:
                    break
                for k, v in msg.items():
                    answer[k], arrived[k] = v, t
                remaining.remove(item)
                current = msg[item] if chain else current
            break
        for i in range(len(rt.agents), n):       # reuse agents made in earlier stages
            rt.create_subagent(f"agent{i}", ROLES["researcher"])
        overhead = n // cfg.agents_per_main_step
        budget = cfg.critical_budget - t - 1 - overhead
        if budget <= 0:
            break
        runs = [rt.assign_task(f"agent{i}", sub, budget=budget)
                for i, sub in enumerate(_subtasks(task, remaining, current, n))]
        if overhead:
            rt.main_step(overhead)
        rt.gather()
        t += 1 + overhead + max(r.steps for r in runs)
        n_assigned += len(runs)
        for r in runs:
            if r.finished and r.message:
                n_finished += 1
                for k, v in r.message.items():
                    answer[k], arrived[k] = v, t
                    if k in remaining:
                        remaining.remove(k)
        if chain and answer:
            current = answer[max(answer)]
        stage += 1
    trace = rt.answer(answer)
    return {"task": task, "trace": trace, "answer": answer, "arrived": arrived,
            "f1": item_f1(answer, gold), "success": float(answer == gold),
            "critical": trace.critical_steps, "total": trace.total_steps, "wall_s": trace.wall_s,
            "n_created": len(rt.agents), "n_assigned": n_assigned, "n_finished": n_finished,
            "decisions": decisions}


def f1_at_budget(episode: dict, budget: int) -> float:
    answered = {k: v for k, v in episode["answer"].items() if episode["arrived"][k] <= budget}
    return item_f1(answered, episode["task"]["gold"])


# ---------------------------------------------------------------------------------------------------
# 3. PARL reward, lambda schedule, orchestrator policy, group-relative policy gradient
# ---------------------------------------------------------------------------------------------------


def lambda_schedule(update: int, total_updates: int, init: float, anneal_frac: float | None = 0.6,
                    kind: str = "linear") -> float:
    """lambda(u) = init * max(0, 1 - u / (anneal_frac * U)); anneal_frac None = constant init."""
    if anneal_frac is None:
        return init
    if anneal_frac <= 0:
        raise ValueError(f"anneal_frac must be > 0 or None, got {anneal_frac!r}")
    x = min(1.0, update / (anneal_frac * total_updates))
    if kind == "linear":
        return init * (1.0 - x)
    if kind == "cosine":
        return init * 0.5 * (1.0 + math.cos(math.pi * x))
    raise ValueError(f"kind must be 'linear' or 'cosine', got {kind!r}")


def parl_reward(episode: dict, lambda1: float, lambda2: float, n_cap: int = 16, perf: str = "f1") -> dict:
    """r = lambda1 * r_parallel + lambda2 * r_finish + r_perf, with this file's closed forms (docstring)."""
    if perf not in ("f1", "success"):
        raise ValueError(f"perf must be 'f1' or 'success', got {perf!r}")
    r_perf = episode[perf]
    r_parallel = min(episode["n_created"], n_cap) / n_cap
    r_finish = episode["n_finished"] / episode["n_assigned"] if episode["n_assigned"] else 0.0
    return {"r": lambda1 * r_parallel + lambda2 * r_finish + r_perf,
            "r_perf": r_perf, "r_parallel": r_parallel, "r_finish": r_finish}


class OrchestratorPolicy(nn.Module):
    """Reads the task state (one-hot features), outputs logits over N_CHOICES: a linear softmax policy,
    the smallest torch model that can condition on the task. `serial_prior` starts it mostly working
    alone, as a pretrained single agent would: delegation has to be discovered."""

    def __init__(self, n_features: int = N_FEATURES, n_actions: int = len(N_CHOICES), serial_prior: float = 0.5):
        super().__init__()
        if not 0 < serial_prior < 1:
            raise ValueError(f"serial_prior must be in (0, 1), got {serial_prior!r}")
        self.linear = nn.Linear(n_features, n_actions, bias=False)
        with torch.no_grad():
            self.linear.weight.zero_()
            # p(alone) = serial_prior in every state at init, the other choices uniform
            self.linear.weight[0] = math.log(serial_prior * (n_actions - 1) / (1 - serial_prior))

    def forward(self, feats):
        return self.linear(feats)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """r - mean over the K samples of the same task (K2.5's baseline; no std normalisation)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)                     # [tasks, K]
    return (r - r.mean(dim=1, keepdim=True)).view(-1)


def policy_gradient_step(policy: nn.Module, optimizer, feats: torch.Tensor, actions: torch.Tensor,
                         episode_of: torch.Tensor, rewards: torch.Tensor, group_size: int,
                         entropy_coef: float = 1e-3) -> float:
    """One REINFORCE step with a group-mean baseline.

    feats [M, F] and actions [M] list every decision; episode_of [M] maps each to its episode, whose
    reward sits in rewards [E] (E = tasks * group_size, grouped contiguously).
    """
    adv = group_advantages(rewards, group_size)          # [E]
    logp = F.log_softmax(policy(feats), dim=-1)          # [M, A]
    chosen = logp.gather(1, actions[:, None]).squeeze(1)  # [M]
    entropy = -(logp.exp() * logp).sum(-1).mean()
    loss = -(adv[episode_of] * chosen).sum() / rewards.numel() - entropy_coef * entropy
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


# ---------------------------------------------------------------------------------------------------
# 4. The experiment: five arms
# ---------------------------------------------------------------------------------------------------

def make_arms(lambda1: float = 0.2, lambda2: float = 0.4, anneal_frac: float = 0.6) -> dict:
    """The five arms: name -> (trained, lambda1_init, lambda2_init, anneal_frac or None)."""
    return {"single agent": (False, 0.0, 0.0, None),
            "outcome only": (True, 0.0, 0.0, None),
            "outcome + fixed r_parallel": (True, lambda1, 0.0, None),
            "PARL, no annealing": (True, lambda1, lambda2, None),
            "PARL, annealed": (True, lambda1, lambda2, anneal_frac)}


ARMS = make_arms()


def sample_tasks(rng, n, mix=(0.35, 0.45, 0.2), cfg: EnvConfig = EnvConfig()):
    """narrow lookups (1-4 items), wide lookups (12-48 items), deep chains (3-10 hops)."""
    tasks = []
    for _ in range(n):
        u = rng.random()
        if u < mix[0]:
            tasks.append(make_task(rng, "lookup", rng.randint(1, 4)))
        elif u < mix[0] + mix[1]:
            tasks.append(make_task(rng, "lookup", rng.randint(12, cfg.max_width)))
        else:
            tasks.append(make_task(rng, "chain", rng.randint(3, 10)))
    return tasks


def task_kind(task):
    return "deep" if task["family"] == "chain" else ("wide" if task["width"] >= 12 else "narrow")


def sampler(policy, gen, greedy=False):
    cache = {}

    def choose(feats):
        key = tuple(feats)
        if key not in cache:
            with torch.no_grad():
                cache[key] = torch.softmax(policy(torch.tensor(feats)), -1).numpy().astype(np.float64)
        p = cache[key]
        return int(p.argmax()) if greedy else int(gen.choice(len(p), p=p / p.sum()))
    return choose


def train_arm(name, train_tasks, updates, tasks_per_update, group_size, cfg, seed, lr=0.2, serial_prior=0.5,
              n_cap=16, entropy_coef=1e-2, log_every=5, arms=ARMS):
    """Train one arm's orchestrator with PARL rewards; returns (policy, history of logged rollout stats)."""
    trained, lam1_0, lam2_0, anneal = arms[name]
    torch.manual_seed(seed)
    policy = OrchestratorPolicy(serial_prior=serial_prior)
    if not trained:
        return policy, []
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    rng, gen, history = random.Random(seed), np.random.default_rng(seed), []
    for u in range(updates):
        lam1 = lambda_schedule(u, updates, lam1_0, anneal)
        lam2 = lambda_schedule(u, updates, lam2_0, anneal)
        choose = sampler(policy, gen)
        episodes = [run_episode(task, choose, cfg) for task in rng.sample(train_tasks, tasks_per_update)
                    for _ in range(group_size)]
        rewards = [parl_reward(ep, lam1, lam2, n_cap)["r"] for ep in episodes]
        feats, actions, episode_of = [], [], []
        for e, ep in enumerate(episodes):
            for f, a in ep["decisions"]:
                feats.append(f), actions.append(a), episode_of.append(e)
        policy_gradient_step(policy, opt, torch.tensor(feats), torch.tensor(actions), torch.tensor(episode_of),
                             torch.tensor(rewards, dtype=torch.float32), group_size, entropy_coef)
        if u % log_every == 0 or u == updates - 1:
            row = {"update": u, "lambda1": lam1, "lambda2": lam2, "reward": float(np.mean(rewards))}
            row.update(summarize(episodes))
            history.append(row)
    return policy, history


def summarize(episodes) -> dict:
    out = {}
    for kind in ("narrow", "wide", "deep"):
        eps = [ep for ep in episodes if task_kind(ep["task"]) == kind]
        if not eps:
            continue
        assigned = sum(ep["n_assigned"] for ep in eps)
        out.update({f"{kind}_f1": np.mean([ep["f1"] for ep in eps]),
                    f"{kind}_success": np.mean([ep["success"] for ep in eps]),
                    f"{kind}_critical": np.mean([ep["critical"] for ep in eps]),
                    f"{kind}_total": np.mean([ep["total"] for ep in eps]),
                    f"{kind}_agents": np.mean([ep["n_created"] for ep in eps]),
                    f"{kind}_finish": sum(ep["n_finished"] for ep in eps) / assigned if assigned else float("nan")})
    return out


def evaluate(name, policy, tasks, cfg, executor="inline", step_delay=0.0):
    trained = name != "single agent"
    choose = sampler(policy, None, greedy=True) if trained else (lambda feats: 0)
    return [run_episode(task, choose, cfg, executor=executor, step_delay=step_delay) for task in tasks]


def budget_to_reach(episodes, target, max_budget):
    """Smallest critical-step budget at which mean item-F1 over `episodes` reaches `target` (Fig. 8 style)."""
    for b in range(1, max_budget + 1):
        if np.mean([f1_at_budget(ep, b) for ep in episodes]) >= target:
            return b
    return None


def run_experiment(out_dir="out/swarm", updates=100, tasks_per_update=16, group_size=8, seed=0, n_eval=150,
                   lr=0.2, serial_prior=0.5, n_wall=16, step_delay=0.002, lambda1=0.2, lambda2=0.4,
                   anneal_frac=0.6):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    cfg = EnvConfig()
    train_tasks = sample_tasks(random.Random(seed), 600, cfg=cfg)
    eval_tasks = sample_tasks(random.Random(seed + 1), n_eval, mix=(1 / 3, 1 / 3, 1 / 3), cfg=cfg)
    wide_eval = [t for t in eval_tasks if task_kind(t) == "wide"]
    long_cfg = EnvConfig(critical_budget=4 * cfg.max_width + 8)   # room for the single agent to finish
    results, histories, t_start = {}, {}, time.time()
    arms = make_arms(lambda1, lambda2, anneal_frac)
    for name in arms:
        t0 = time.time()
        policy, hist = train_arm(name, train_tasks, updates, tasks_per_update, group_size, cfg, seed, lr=lr,
                                 serial_prior=serial_prior, arms=arms)
        eps = evaluate(name, policy, eval_tasks, cfg)
        long_eps = evaluate(name, policy, wide_eval, long_cfg)
        # wall clock on the real thread pool, each tool call made to take step_delay (simulated latency)
        wall_eps = evaluate(name, policy, wide_eval[:n_wall], cfg, executor="thread", step_delay=step_delay)
        wall_ms = 1e3 * float(np.mean([ep["wall_s"] for ep in wall_eps]))
        results[name] = {"eval": eps, "long": long_eps, "summary": summarize(eps), "train_s": time.time() - t0,
                         "wall_ms": wall_ms}
        histories[name] = hist
        s = results[name]["summary"]
        print(f"{name:<28} wide F1 {s['wide_f1']:.3f} crit {s['wide_critical']:.1f} agents {s['wide_agents']:.1f} | "
              f"narrow agents {s['narrow_agents']:.1f} finish {s['narrow_finish']:.2f} | deep F1 {s['deep_f1']:.3f} "
              f"agents {s['deep_agents']:.1f} "
              f"| {time.time() - t0:.0f} s", flush=True)

    # Fig. 8 analogue: critical steps needed to reach a target item-F1 on wide tasks, vs the single agent
    targets = (0.3, 0.5, 0.7, 0.9)
    need = {name: [budget_to_reach(r["long"], x, long_cfg.critical_budget) for x in targets]
            for name, r in results.items()}
    lines = ["| arm | wide F1 | wide success | wide crit. steps | wide total steps | wide wall (ms) "
             "| sub-agents narrow / wide / deep "
             "| finish rate (all) | narrow F1 | deep F1 | deep crit. steps | "
             + " | ".join(f"crit. steps to F1 {x} (x fewer than single)" for x in targets) + " |",
             "|" + "---|" * (11 + len(targets))]
    for name, r in results.items():
        s, eps = r["summary"], r["eval"]
        assigned = sum(ep["n_assigned"] for ep in eps)
        finish = f"{sum(ep['n_finished'] for ep in eps) / assigned:.2f}" if assigned else "-"
        speed = []
        for b, b_single in zip(need[name], need["single agent"]):
            speed.append("-" if b is None else f"{b}" + ("" if b_single is None else f" ({b_single / b:.1f}x)"))
        lines.append(f"| {name} | {s['wide_f1']:.3f} | {s['wide_success']:.2f} | {s['wide_critical']:.1f} | "
                     f"{s['wide_total']:.1f} | {r['wall_ms']:.0f} | "
                     f"{s['narrow_agents']:.1f} / {s['wide_agents']:.1f} / {s['deep_agents']:.1f} | {finish} | "
                     f"{s['narrow_f1']:.3f} | {s['deep_f1']:.3f} | {s['deep_critical']:.1f} | "
                     + " | ".join(speed) + " |")
    table = "\n".join(lines)
    header = (f"PARL arms: {updates} updates x {tasks_per_update} tasks x {group_size} samples, seed {seed}, lr {lr}, "
              f"serial prior {serial_prior}, lambda1_0 {lambda1}, lambda2_0 {lambda2}, anneal_frac {anneal_frac}; "
              f"greedy eval on {len(eval_tasks)} held-out tasks (critical budget {cfg.critical_budget}, "
              f"sub-agent cap {cfg.sub_step_budget}); 'crit. steps to F1' uses budget {long_cfg.critical_budget} "
              f"on the {len(wide_eval)} wide tasks; wall time on the thread pool with {step_delay * 1e3:.0f} ms "
              f"per step, first {min(n_wall, len(wide_eval))} wide tasks. Total {time.time() - t_start:.0f} s.\n\n")
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(header + table + "\n")
    print(header + table)

    # training curves
    colors = dict(zip(ARMS, ["k", "tab:blue", "tab:orange", "tab:green", "tab:red"]))
    keys = [("reward", "reward r (sampled)"), ("wide_f1", "item-F1 (wide)"), ("wide_critical", "critical steps (wide)"),
            ("deep_critical", "critical steps (deep)"), ("narrow_agents", "sub-agents / task (narrow)"),
            ("wide_agents", "sub-agents / task (wide)"), ("deep_agents", "sub-agents / task (deep)"),
            ("narrow_finish", "finish rate (narrow)")]
    fig, axes = plt.subplots(2, 4, figsize=(18, 7))
    for ax, (key, title) in zip(axes.flat, keys):
        for name, hist in histories.items():
            if hist:
                ax.plot([h["update"] for h in hist], [h.get(key, np.nan) for h in hist], color=colors[name], label=name)
            elif key != "reward":
                ax.axhline(results[name]["summary"].get(key, np.nan), color="k", ls="--", lw=1, label=name)
        ax.set_title(title)
        ax.set_xlabel("update")
    axes.flat[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "training.png"), dpi=110)

    # policy vs width, and item-F1 vs critical-step budget (Fig. 8 analogue)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        lookups = sorted((ep["task"]["width"], ep["n_created"]) for ep in r["eval"] if ep["task"]["family"] == "lookup")
        ax1.plot([w for w, _ in lookups], [n for _, n in lookups], "o-", ms=3, color=colors[name], label=name)
        budgets = range(1, 101)
        ax2.plot(list(budgets), [np.mean([f1_at_budget(ep, b) for ep in r["long"]]) for b in budgets],
                 color=colors[name], label=name)
    ax1.set(xlabel="task width (items)", ylabel="sub-agents created", title="sub-agents per task vs width (eval)")
    ax2.set(xlabel="critical-step budget", ylabel="item-F1", title="wide tasks: item-F1 vs critical steps")
    ax1.legend(fontsize=7)
    ax2.axvline(cfg.critical_budget, color="gray", ls=":", lw=1)   # the training budget
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "policy.png"), dpi=110)
    return results, histories, table


# ---------------------------------------------------------------------------------------------------
# benchmark and demo
# ---------------------------------------------------------------------------------------------------


def _noop_worker(system_prompt, task):
    for _ in range(task["steps"]):
        yield
    return task["steps"]


def bench(n_agents=100, steps_each=15, sleep_s=0.001, repeats=3):
    """Runtime overhead at K2.5's scale: n_agents concurrent sub-agents, n_agents * steps_each steps."""
    print(f"# swarm runtime: {n_agents} concurrent sub-agents x {steps_each} steps = {n_agents * steps_each} steps "
          f"in one episode ({os.cpu_count()} CPUs, torch {torch.__version__})")
    print("No Triton path here: the runtime is plain Python (concurrent.futures); nothing to compare against.\n")
    print("| executor | step cost | wall (ms) | ideal (ms) | overhead / step (us) |")
    print("|---|---|---|---|---|")
    for step_cost in (0.0, sleep_s):
        for kind in ("inline", "thread", "process"):
            pool, width = None, 1
            if kind == "thread":
                pool, width = cf.ThreadPoolExecutor(n_agents), n_agents
            elif kind == "process":
                width = min(8, os.cpu_count() or 1)
                pool = cf.ProcessPoolExecutor(width)
            walls = []
            for _ in range(repeats + 1):     # the first warms the pool up
                rt = SwarmRuntime(_noop_worker, executor=pool or "inline", max_subagents=n_agents,
                                  sub_step_budget=steps_each, step_delay=step_cost)
                t0 = time.perf_counter()
                for i in range(n_agents):
                    rt.assign_task(rt.create_subagent(f"a{i}", ROLES["researcher"]), {"steps": steps_each})
                trace = rt.answer(None)
                walls.append(time.perf_counter() - t0)
                assert trace.total_steps == n_agents * steps_each + 1 and trace.critical_steps == steps_each + 1
            if pool:
                pool.shutdown()
            wall = min(walls[1:])
            ideal = steps_each * step_cost * math.ceil(n_agents / width)   # waves of `width` at a time
            print(f"| {kind} ({width} at once) | {step_cost * 1e3:.0f} ms | {wall * 1e3:.1f} | {ideal * 1e3:.1f} | "
                  f"{(wall - ideal) / (n_agents * steps_each) * 1e6:.1f} |")


def demo():
    rng = random.Random(3)
    task = make_task(rng, "lookup", 12)
    rt = SwarmRuntime(scripted_worker, sub_step_budget=24, executor="thread", step_delay=0.002)
    print(task["question"])
    for i in range(3):
        rt.create_subagent(f"researcher{i}", ROLES["researcher"])
    for i in range(2):
        rt.create_subagent(f"checker{i}", ROLES["fact-checker"])
    subs = _subtasks(task, list(task["gold"]), None, 3)
    for i, sub in enumerate(subs):
        rt.assign_task(f"researcher{i}", sub)
    found = {}
    for run in rt.gather():
        found.update(run.message or {})
    claims = list(found.items())
    for i in range(2):   # a second stage: two fact-checkers split the claims
        rt.assign_task(f"checker{i}", {"kind": "verify", "claims": dict(claims[i::2]), "corpus": task["corpus"]})
    checked = {}
    for run in rt.gather():
        checked.update(run.message or {})
    trace = rt.answer(found)
    print(trace.summary())
    print(f"item-F1 {item_f1(found, task['gold']):.3f}; fact-checker confirmed {sum(checked.values())}/{len(checked)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--demo", action="store_true")
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--tasks_per_update", type=int, default=16)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--serial_prior", type=float, default=0.5, help="p(work alone) of the untrained policy")
    parser.add_argument("--lambda1", type=float, default=0.2, help="initial weight of r_parallel")
    parser.add_argument("--lambda2", type=float, default=0.4, help="initial weight of r_finish")
    parser.add_argument("--anneal_frac", type=float, default=0.6, help="lambdas reach 0 at this fraction of updates")
    parser.add_argument("--out_dir", default="out/swarm")
    args = parser.parse_args()
    if args.bench:
        bench()
    elif args.demo:
        demo()
    else:
        run_experiment(args.out_dir, args.updates, args.tasks_per_update, args.group_size, args.seed,
                       lr=args.lr, serial_prior=args.serial_prior, lambda1=args.lambda1, lambda2=args.lambda2,
                       anneal_frac=args.anneal_frac)
