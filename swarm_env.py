"""Agent Swarm environment: offline wide and deep tasks, frozen scripted sub-agents, item-F1.

Support module for swarm.py. Two task families, each with its own small generated corpus:

    lookup (wide)  collect one attribute of W entities, each fact among 0-2 distractor documents;
                   items are independent, so W items split over n sub-agents finish ~n times sooner
    chain  (deep)  follow 'mentor' W hops from a start entity; hop h needs hop h-1's answer, so
                   splitting buys nothing

Sub-agents (`scripted_worker`) are frozen programs; search and read cost a step each (2-4 per item).
`Session` plays one task through the orchestrator's tools on a SwarmRuntime.
"""
import random
import re
from dataclasses import dataclass

import numpy as np

from swarm_runtime import SwarmRuntime, _positive_int, run_subagent

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
    """One offline task, family "lookup" (wide) or "chain" (deep), with its own corpus: each entity's
    fact sits in one document among 0-2 distractors that only mention it."""
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
    # items in index order: what the protocol's counts hand out (entities, or hop numbers)
    return {"family": family, "width": width, "question": question, "gold": gold, "items": list(gold),
            "corpus": {"docs": docs, "index": index}, **meta}


def role_of(system_prompt: str) -> str:
    text = system_prompt.lower()
    for role in ROLES:
        if role in text:
            return role
    return "unknown"


def scripted_worker(system_prompt: str, task: dict):
    """A frozen sub-agent whose role comes from the system prompt. Sub-tasks: {"kind": "lookup", "entities",
    "attribute"} or {"kind": "follow", "start", "first_hop", "hops"} (start None: not known yet). Only a
    researcher fits them: any other role, or an empty sub-task, spends one step and returns {}."""
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
    yield ("think", None)
    return {}


def item_f1(answer: dict, gold: dict) -> float:
    if not answer and not gold:
        return 1.0
    correct = sum(1 for k, v in answer.items() if gold.get(k) == v)
    if correct == 0:
        return 0.0
    precision, recall = correct / len(answer), correct / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_within(episode: dict, budget: int) -> float:
    """Item-F1 of the answer had the episode been stopped after `budget` critical steps (each fact
    counts from the step it arrived)."""
    answered = {k: v for k, v in episode["answer"].items() if episode["arrived"][k] <= budget}
    return item_f1(answered, episode["task"]["gold"])


@dataclass
class EnvConfig:
    critical_budget: int = 40      # episode limit in critical steps (K2.5 constrains by these, not total)
    train_budget_min: int = 10     # PARL's r_perf: item-F1 within a budget drawn from 10..critical_budget
    sub_step_budget: int = 24      # each sub-agent's step cap: 6-12 items, so wide tasks must be split
    agents_per_main_step: int = 8  # reading back results: +1 orchestrator step per 8 sub-agents of a stage
    max_width: int = 48            # items per task at most (the protocol has number tokens up to this)
    max_agents: int = 16           # sub-agents per episode at most (agent-name tokens a0..a15)


def subtask(task: dict, idx: list, start: str | None = None) -> dict:
    """The sub-task for items `idx`: a lookup's entities, or a chain's consecutive hops from `start`, the
    entity reached before idx[0] (None while earlier hops are unsolved: the worker cannot begin)."""
    corpus, idx = task["corpus"], list(idx)
    if task["family"] == "lookup":
        return {"kind": "lookup", "entities": [task["items"][i] for i in idx], "attribute": task["attribute"],
                "corpus": corpus}
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ValueError(f"a chain's hops must be consecutive, got {idx}")
    return {"kind": "follow", "start": start, "first_hop": task["items"][idx[0]], "hops": len(idx), "corpus": corpus}


def sample_tasks(rng: random.Random, n: int, mix=(0.35, 0.45, 0.2), cfg: EnvConfig = EnvConfig()) -> list:
    """narrow lookups (1-4 items), wide lookups (12-max_width items), deep chains (3-10 hops)."""
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


def task_kind(task: dict) -> str:
    return "deep" if task["family"] == "chain" else ("wide" if task["width"] >= 12 else "narrow")


def summarize(results: list) -> dict:
    """Means per task kind (narrow / wide / deep) and over all: item-F1, critical steps, sub-agents, ..."""
    out = {}
    for kind in ("narrow", "wide", "deep", "all"):
        rs = [r for r in results if kind == "all" or task_kind(r["task"]) == kind]
        assigned = sum(r["n_assigned"] + r["n_idle"] for r in rs)
        for key, name in (("f1", "f1"), ("success", "success"), ("critical", "critical"), ("total", "total"),
                          ("n_created", "agents"), ("n_idle", "idle"), ("answered", "answered")):
            if rs and key in rs[0]:
                out[f"{kind}_{name}"] = float(np.mean([r[key] for r in rs]))
        if rs:
            out[f"{kind}_finish"] = sum(r["n_finished"] for r in rs) / assigned if assigned else float("nan")
    return out


class Session:
    """One task played through the orchestrator's tools on a SwarmRuntime, on the critical-step clock.

    Items go out by count from the open ones (not found, not out in the open stage, in index order):
    create(role) adds a0, a1, ...; assign(k, n) launches ak on the next n (False: no step left);
    wait() gathers the stage, (k, facts) per launch; work(n) does the next n alone, a step per tool
    call; finish(submit). swarm_protocol checks legality; this only executes. Facts keep their
    arrival step (`arrived`).
    """

    def __init__(self, task: dict, cfg: EnvConfig = EnvConfig(), executor="inline", step_delay: float = 0.0):
        self.task, self.cfg = task, cfg
        self.rt = SwarmRuntime(scripted_worker, sub_step_budget=cfg.sub_step_budget,
                               main_step_budget=cfg.critical_budget * 4,
                               executor=executor, step_delay=step_delay, max_subagents=cfg.max_agents)
        self.open_runs: list = []           # (agent index, SubagentRun) launched in the open stage
        self.out: set = set()               # item indices out with the open stage's sub-agents
        self.answer, self.arrived = {}, {}
        self.t = 0                          # critical steps so far
        self.frontier, self.current = 0, task.get("start")   # chain: first unsolved hop, entity reached
        self.n_assigned = self.n_finished = 0

    def create(self, role: str):
        self.rt.create_subagent(f"a{len(self.rt.agents)}", ROLES[role])

    def open_items(self) -> list:
        return [i for i, item in enumerate(self.task["items"]) if item not in self.answer and i not in self.out]

    def assign(self, k: int, n: int) -> bool:
        open_now = self.open_items()
        if not 1 <= n <= len(open_now):
            raise ValueError(f"assign needs a count of 1..{len(open_now)} (the open items), got {n}")
        idx = open_now[:n]
        start = self.current if idx[0] == self.frontier else None   # chain: only the frontier's entity is known
        budget = self.cfg.critical_budget - self.t - 1
        if budget < 1:                       # no step left to launch it: the budget has run out
            return False
        self.open_runs.append((k, self.rt.assign_task(f"a{k}", subtask(self.task, idx, start), budget=budget)))
        self.out.update(idx)
        return True

    def wait(self) -> list:
        overhead = len(self.open_runs) // self.cfg.agents_per_main_step     # reading the results back
        if overhead and self.rt.main_steps_used + overhead <= self.rt.main_step_budget:
            self.rt.main_step(overhead)
        got = self._gather()
        for _, facts in got:
            self._record(facts)
        return [(k, len(facts)) for k, facts in got]

    def work(self, n: int) -> int:
        found = 0
        for i in self.open_items()[:n]:      # one item at a time, as a single agent works
            left = self.cfg.critical_budget - self.t
            if left < 1:
                break
            start = self.current if i == self.frontier else None
            sub = subtask(self.task, [i], start)
            steps, _, msg, _, _, _ = run_subagent(scripted_worker, ROLES["researcher"], sub, left)
            if steps:
                self.rt.main_step(steps)
            self.t += steps
            if not msg:
                break
            self._record(msg)
            found += len(msg)
        return found

    def finish(self, submit: bool):
        if not submit:
            self.answer, self.arrived = {}, {}
        if self.open_runs:
            # launches not yet read still run and cost their stage, but never reach the answer
            self._gather()
        self.rt.answer(dict(self.answer))

    def _gather(self) -> list:
        self.rt.gather()
        self.t += self.rt.trace.stages[-1].critical_steps
        got = [(k, run.message if run.finished and run.message else {}) for k, run in self.open_runs]
        self.n_assigned += len(got)
        self.n_finished += sum(bool(facts) for _, facts in got)
        self.open_runs, self.out = [], set()
        return got

    def _record(self, facts: dict):
        for key, value in facts.items():
            if key not in self.answer:
                self.answer[key], self.arrived[key] = value, self.t
        items = self.task["items"]
        while self.task["family"] == "chain" and self.frontier < len(items) and items[self.frontier] in self.answer:
            self.current = self.answer[items[self.frontier]]
            self.frontier += 1

    def result(self) -> dict:
        trace, gold = self.rt.trace, self.task["gold"]
        return {"task": self.task, "trace": trace, "answer": self.answer, "arrived": self.arrived,
                "f1": item_f1(self.answer, gold), "success": float(self.answer == gold),
                "critical": trace.critical_steps, "total": trace.total_steps, "wall_s": trace.wall_s,
                "n_created": len(self.rt.agents), "n_assigned": self.n_assigned, "n_finished": self.n_finished,
                "n_idle": len(self.rt.agents) - len({r.agent for st in trace.stages for r in st.runs}),
                "clock": self.t}


# scripted orchestrators: the call sequences the SFT warm start imitates (swarm.py plays them as tokens)

def _work_alone(session: Session, rng: random.Random, cfg: EnvConfig) -> list:
    """("self", n) on chunks of 1-6 open items while the clock leaves room for one (an item costs at most
    4 steps); the calls, executed on `session` as they are chosen."""
    calls = []
    while session.open_items():
        n = min(rng.randint(1, 6), (cfg.critical_budget - session.t - 1) // 4, len(session.open_items()))
        if n < 1:
            break
        calls.append(("self", n))
        if not session.work(n):              # nothing found (a chain cut off): stop
            break
    return calls


def serial_calls(task: dict, rng: random.Random, cfg: EnvConfig = EnvConfig()) -> list:
    """A single agent doing the work itself: ("self", n) on chunks of 1-6 items, then ("answer",) once
    the items are done or the clock leaves too little for another item."""
    return _work_alone(Session(task, cfg), rng, cfg) + [("answer",)]


def decompose_calls(task: dict, rng: random.Random, cfg: EnvConfig = EnvConfig()) -> list:
    """A decomposition blind to the task, good or bad: 2-16 agents of one role (researcher w.p. 0.8), the
    items cut near-equally (3 in 4) or at random, one trace in four leaving the last count out (an idle
    agent); after the wait, the missing items done alone, then answer."""
    W, n = task["width"], rng.randint(2, cfg.max_agents)
    role = "researcher" if rng.random() < 0.8 else rng.choice(list(ROLES))
    k = min(n, W)
    cuts = [i * W // k for i in range(1, k)] if rng.random() < 0.75 else sorted(rng.sample(range(1, W), k - 1))
    bounds = [0] + cuts + [W]
    counts = [bounds[i + 1] - bounds[i] for i in range(k)]
    if k > 1 and rng.random() < 0.25:           # one trace in four leaves the last count out
        counts.pop()
    calls = [("create", role, n)] + [("assign", i, c) for i, c in enumerate(counts)] + [("wait",)]
    session = Session(task, cfg)
    for _ in range(n):
        session.create(role)
    for i, c in enumerate(counts):
        session.assign(i, c)
    session.wait()
    return calls + _work_alone(session, rng, cfg) + [("answer",)]
