"""Agent Swarm and Parallel-Agent RL (PARL), in miniature: the orchestrator is a language model.

Kimi K2.5 (arXiv 2602.02276, section 3) trains one orchestrator that may call two extra tools,
create_subagent(name, system_prompt) and assign_task(agent, task). It writes those calls in its own
output, reads the sub-agents' messages back into its context, and writes the answer. Sub-agents are
frozen; only the orchestrator learns, with

    r = lambda1 * r_parallel + lambda2 * r_finish + r_perf,      lambda1, lambda2 annealed to 0,

and cost is counted in critical steps, sum over stages of (orchestrator steps + slowest sub-agent).
Here the orchestrator is a `model.GPT` (2 attention layers, width 64, 118k parameters; pattern="KA"
gives the project's KDA + attention hybrid), decoding tool calls as tokens through its own KV cache.

1. Token protocol. A vocabulary of 84 tokens: specials, 16 agent names a0..a15, numbers 0..48.

       prompt     <bos> <task> FAMILY W |            FAMILY = lookup | chain; items are 0..W-1
       calls      <create> ROLE                      ROLE = researcher | fact-checker | coder
                  <assign> aK LO HI                  launch agent aK on items LO..HI (a range, inclusive)
                  <self> LO HI                       do items LO..HI yourself, one tool call per step
                  <wait>                             gather every launch of this stage (closes it)
                  <answer>                           submit what the results brought back; ends
       environment (appended by the runtime, read by the model, never trained on)
                  <res> aK N   after <wait>, one per launch: aK brought back N facts (0: cut off/none)
                  <res> me N   after <self>: N facts found before a miss or the budget ran out
                  @ T          closes every reply: the clock, critical steps used so far (capped at 48)
                  <end>        the critical-step budget (or the context) ran out before <answer>: the
                               episode ends with no answer (as a sub-agent cut off sends nothing)
                  <err>        a malformed call (only possible without the grammar mask): episode lost

   One rendered episode (a wide lookup of 9 items, environment tokens in [brackets]):

       <bos> <task> lookup 9 |
       <create> researcher <create> researcher <create> researcher
       <assign> a0 0 2 <assign> a1 3 5 <assign> a2 6 8 <wait> [<res> a0 3 <res> a1 3 <res> a2 3 @ 10]
       <answer>

   The facts themselves (entity names, cities) are not in the vocabulary: the runtime keeps what each
   result brought back and `<answer>` submits it; the model reads how many facts each call returned.
   Decoding is constrained by a grammar mask (`CallParser.legal`): only tokens that continue a
   well-formed call are allowed (agents that exist and are free, LO within the task, HI >= LO, ...).
   The same parser rejects a malformed stream with a `ProtocolError` that ends that episode with
   reward 0 (the process goes on).

2. Batched episodes. `rollout` plays B tasks at once: each decoding step feeds every row its sampled
   token followed by the environment's reply (prefill after the cache), rows padded to the longest
   chunk with a valid mask (model.GPT.forward(valid=...): attention masks pad keys, KDA sets beta = 0,
   g = 0 on pads), so a row decodes exactly as it would alone (tested). Finished rows leave the batch.

3. Training in two stages. (a) SFT: traces of a single agent doing the work itself (`<self>` on
   chunks of items, then `<answer>` before the clock runs out), mixed with a share (format_frac = 15%)
   of tool-format examples (random agent counts and roles, items cut into near-equal ranges: the
   syntax of a split, not when or how much to split); cross-entropy on the orchestrator's tokens only.
   The targets are smoothed over the grammar's legal tokens (weight 1 - serial_prior), so the serial
   prior is strong but not absolute: delegation has to be discovered, as in K2.5, which starts from a
   serial model.
   (b) PARL: K sampled episodes per task, parl_reward, group-relative advantages A = r - mean(r of the
   task's group) (no std normalisation), loss = -sum_e A_e * sum_{action tokens t} log p(token_t) / E,
   with prompt and environment tokens masked out; MuonClip (muonclip.py) as the optimizer.

   Reward closed forms (the report gives none; these are this project's choices, all arguments):
       r_perf     = item-F1 of the answer
       r_parallel = min(n_created, n_cap) / n_cap            (n_cap = 16)
       r_finish   = n_finished / (n_assigned + n_idle) (0 when nothing was assigned); finished = returned
                    a non-empty message within its step budget; n_idle = agents created but never assigned
       lambda_i(u) = lambda_i0 * max(0, 1 - u / (anneal_frac * U)); lambda1_0 = 0.2, lambda2_0 = 0.4

4. The five arms (single agent = the SFT model; outcome only; outcome + fixed r_parallel; PARL without
   annealing; PARL annealed), greedy evaluation on held-out tasks, plots and a table in out/swarm/.

Support modules: swarm_runtime.py (SwarmRuntime, critical steps), swarm_env.py (tasks, frozen scripted
sub-agents, item-F1). The decoder is model.GPT.

Run:  python swarm.py                 trains all arms for seed 0 on CPU (~50 s of CPU time), writes out/swarm/
      python swarm.py --seeds 0 1 2   more seeds, one table
      python swarm.py --demo          one episode as the trained orchestrator wrote it, with its timeline
      python bench.py swarm           runtime overhead with 100 concurrent sub-agents
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.nn.functional as F

from model import GPT, Config
from muonclip import MuonClip
from swarm_env import ROLES, EnvConfig, item_f1, make_task, sample_tasks, scripted_worker, subtask, task_kind
from swarm_runtime import SwarmRuntime, run_subagent

# ---------------------------------------------------------------------------------------------------
# 1. Token protocol
# ---------------------------------------------------------------------------------------------------

MAX_AGENTS, MAX_NUM = 16, 48
SPECIALS = ["<pad>", "<bos>", "<task>", "lookup", "chain", "|", "<create>", "researcher", "fact-checker", "coder",
            "<assign>", "<self>", "<wait>", "<answer>", "<res>", "me", "@", "<end>", "<err>"]
VOCAB = SPECIALS + [f"a{i}" for i in range(MAX_AGENTS)] + [str(n) for n in range(MAX_NUM + 1)]
TOK = {s: i for i, s in enumerate(VOCAB)}
PAD = TOK["<pad>"]
CALLS = ("<create>", "<assign>", "<self>", "<wait>", "<answer>")
ROLE_TOKENS = ("researcher", "fact-checker", "coder")
ENV_ONLY = ("<bos>", "<task>", "lookup", "chain", "|", "<res>", "me", "@", "<end>", "<err>", "<pad>")


def agent_tok(k: int) -> int:
    return TOK[f"a{k}"]


def num_tok(n: int) -> int:
    if not 0 <= n <= MAX_NUM:
        raise ValueError(f"number {n} outside the protocol's 0..{MAX_NUM}")
    return TOK[str(n)]


def tok_num(t: int) -> int | None:
    """The number a token stands for, or None."""
    s = VOCAB[t]
    return int(s) if s.isdigit() else None


def tok_agent(t: int) -> int | None:
    s = VOCAB[t]
    return int(s[1:]) if s[0] == "a" and s[1:].isdigit() else None


PROMPT_SHAPE = ("<bos>", "<task>", "FAMILY", "W", "|")


def prompt_tokens(task: dict) -> list:
    return [TOK["<bos>"], TOK["<task>"], TOK[task["family"]], num_tok(task["width"]), TOK["|"]]


def encode_call(call: tuple) -> list:
    """("create", role) | ("assign", k, lo, hi) | ("self", lo, hi) | ("wait",) | ("answer",) -> token ids."""
    kind = call[0]
    if kind == "create":
        return [TOK["<create>"], TOK[call[1]]]
    if kind == "assign":
        return [TOK["<assign>"], agent_tok(call[1]), num_tok(call[2]), num_tok(call[3])]
    if kind == "self":
        return [TOK["<self>"], num_tok(call[1]), num_tok(call[2])]
    if kind in ("wait", "answer"):
        return [TOK[f"<{kind}>"]]
    raise ValueError(f"unknown call {call!r}")


def render(ids, is_action=None) -> str:
    """Token ids as text, a line per call. With is_action, each run of environment tokens after the
    prompt is shown in [brackets] on the line of the call it answers."""
    lines, env_open = [], False
    for i, t in enumerate(ids):
        s = VOCAB[t]
        env = is_action is not None and not is_action[i] and i >= len(PROMPT_SHAPE)
        if env_open and not env:
            lines[-1][-1] += "]"
        if s in CALLS and not env or not lines:
            lines.append([])
        if env and not env_open:
            s = "[" + s
        env_open = env
        lines[-1].append(s)
    if env_open:
        lines[-1][-1] += "]"
    return "\n".join(" ".join(words) for words in lines)


def from_text(text: str) -> list:
    """Inverse of render (brackets and line breaks ignored)."""
    ids = []
    for word in text.replace("[", " ").replace("]", " ").split():
        if word not in TOK:
            raise ValueError(f"unknown token {word!r}")
        ids.append(TOK[word])
    return ids


class ProtocolError(ValueError):
    """A malformed call. It ends the episode (reward 0), not the process."""


class CallParser:
    """Reads the orchestrator's tokens one at a time; returns each call when its last token arrives.

    Knows what the runtime knows (task width, agents created, who is busy in the open stage), so it can
    both reject a malformed call and list the legal next tokens for constrained decoding (`legal`).
    """

    def __init__(self, width: int, max_agents: int = MAX_AGENTS):
        self.width, self.max_agents = width, max_agents
        self.n_created, self.busy, self.stage_open = 0, set(), False
        self.partial: list = []

    def legal(self) -> list:
        """Token ids that may come next."""
        p = self.partial
        if not p:
            ok = ["<answer>"]
            if self.n_created < self.max_agents:
                ok.append("<create>")
            if len(self.busy) < self.n_created:
                ok.append("<assign>")
            ok.append("<wait>" if self.stage_open else "<self>")
            return [TOK[s] for s in ok]
        head = VOCAB[p[0]]
        if head == "<create>":
            return [TOK[r] for r in ROLE_TOKENS]
        if head == "<assign>" and len(p) == 1:
            return [agent_tok(k) for k in range(self.n_created) if k not in self.busy]
        lo_at = 2 if head == "<assign>" else 1
        if len(p) == lo_at:
            return [num_tok(n) for n in range(self.width)]
        return [num_tok(n) for n in range(tok_num(p[lo_at]), self.width)]

    def feed(self, t: int):
        """Add one token; returns the finished call tuple, or None while the call is incomplete."""
        if not 0 <= t < len(VOCAB):
            raise ProtocolError(f"token id {t} is not in the vocabulary")
        s, p = VOCAB[t], self.partial
        if s in ENV_ONLY:
            raise ProtocolError(f"{s} is written by the environment, not by the orchestrator")
        if t not in self.legal():
            raise ProtocolError(self._why(t))
        p.append(t)
        head = VOCAB[p[0]]
        call = None
        if head in ("<wait>", "<answer>"):
            call = (head[1:-1],)
            if head == "<wait>":
                self.busy, self.stage_open = set(), False
        elif head == "<create>" and len(p) == 2:
            call = ("create", s)
            self.n_created += 1
        elif head == "<assign>" and len(p) == 4:
            call = ("assign", tok_agent(p[1]), tok_num(p[2]), tok_num(p[3]))
            self.busy.add(call[1])
            self.stage_open = True
        elif head == "<self>" and len(p) == 3:
            call = ("self", tok_num(p[1]), tok_num(p[2]))
        if call is not None:
            self.partial = []
        return call

    def _why(self, t: int) -> str:
        s, p = VOCAB[t], self.partial
        if not p:
            if s == "<assign>":
                return "<assign> with no free agent: <create> one first (or <wait> to free them)"
            if s == "<self>":
                return "<self> while sub-agents are running: <wait> for them first"
            if s == "<wait>":
                return "<wait> with nothing assigned"
            if s == "<create>":
                return f"<create>: already {self.max_agents} agents"
            return f"expected a call ({', '.join(CALLS)}), got {s!r}"
        head = VOCAB[p[0]]
        where = " ".join(VOCAB[x] for x in p)
        if head == "<create>":
            return f"{where} {s}: expected a role ({', '.join(ROLE_TOKENS)})"
        if head == "<assign>" and len(p) == 1:
            k = tok_agent(t)
            if k is None:
                return f"{where} {s}: expected an agent name"
            if k >= self.n_created:
                return f"{where} {s}: unknown agent a{k} (created: {self.n_created})"
            return f"{where} {s}: a{k} is already busy in this stage"
        n = tok_num(t)
        if n is None:
            return f"{where} {s}: expected an item number"
        return f"{where} {s}: item {n} outside the task's items 0..{self.width - 1} or before the range start"


def parse_calls(ids, width: int) -> list:
    """A whole stream of orchestrator tokens -> calls (strict: raises ProtocolError)."""
    parser, calls = CallParser(width), []
    for t in ids:
        call = parser.feed(t)
        if call is not None:
            calls.append(call)
    if parser.partial:
        raise ProtocolError(f"stream ends inside a call: {' '.join(VOCAB[x] for x in parser.partial)}")
    return calls


# ---------------------------------------------------------------------------------------------------
# 2. An episode: the runtime executes each call, the environment's reply goes back as tokens
# ---------------------------------------------------------------------------------------------------


class Episode:
    """One task played through the protocol on a SwarmRuntime.

    step(token) takes one orchestrator token and returns the environment tokens to append (often none).
    The stream, which tokens the orchestrator wrote, and the legal set at each of them are kept for
    training. Items that come back carry the critical step at which they arrived (`arrived`).
    """

    def __init__(self, task: dict, cfg: EnvConfig = EnvConfig(), executor="inline", step_delay: float = 0.0,
                 worker=scripted_worker, max_len: int = 240):
        self.task, self.cfg, self.worker, self.max_len = task, cfg, worker, max_len
        self.rt = SwarmRuntime(worker, sub_step_budget=cfg.sub_step_budget, main_step_budget=cfg.critical_budget * 4,
                               executor=executor, step_delay=step_delay, max_subagents=cfg.max_agents)
        self.parser = CallParser(task["width"], cfg.max_agents)
        self.tokens = prompt_tokens(task)
        self.is_action = [False] * len(self.tokens)
        self.legal_sets: list = []          # per orchestrator token: the legal ids when it was chosen
        self.calls: list = []
        self.open_runs: list = []           # (agent index, SubagentRun) launched in the open stage
        self.answer, self.arrived = {}, {}
        self.t = 0                          # critical steps so far
        self.frontier, self.current = 0, task.get("start")   # chain: first unsolved hop, entity reached
        self.n_assigned = self.n_finished = 0
        self.done, self.error = False, None

    def legal(self) -> list:
        return self.parser.legal()

    def step(self, t: int) -> list:
        if self.done:
            raise RuntimeError("episode is over")
        legal = self.parser.legal()
        self.tokens.append(t)
        self.is_action.append(True)
        self.legal_sets.append(legal)
        try:
            call = self.parser.feed(t)
        except ProtocolError as exc:
            self.error = str(exc)
            self.answer, self.arrived = {}, {}        # a malformed call costs the whole episode
            return self._finish(["<err>"])
        if call is None:
            return self._reply([])
        self.calls.append(call)
        return self._reply(self._execute(call))

    def _execute(self, call) -> list:
        kind, task, cfg = call[0], self.task, self.cfg
        if kind == "create":
            self.rt.create_subagent(f"a{len(self.rt.agents)}", ROLES[call[1]])
            return []
        if kind == "assign":
            k, lo, hi = call[1:]
            start = self.current if lo == self.frontier else None   # chain: only the frontier is known
            budget = cfg.critical_budget - self.t - 1
            if budget < 1:                   # no step left to launch it: the budget has run out
                return ["<end>"]
            run = self.rt.assign_task(f"a{k}", subtask(task, lo, hi, start), budget=budget)
            self.open_runs.append((k, run))
            return []
        if kind == "wait":
            overhead = len(self.open_runs) // cfg.agents_per_main_step     # reading the results back
            if overhead and self.rt.main_steps_used + overhead <= self.rt.main_step_budget:
                self.rt.main_step(overhead)
            self.rt.gather()
            stage = self.rt.trace.stages[-1]
            self.t += stage.critical_steps
            reply = []
            for k, run in self.open_runs:
                self.n_assigned += 1
                got = run.message if run.finished and run.message else {}
                self.n_finished += bool(got)
                self._record(got)
                reply += ["<res>", f"a{k}", str(len(got))]
            self.open_runs = []
            return reply
        if kind == "self":
            lo, hi = call[1:]
            found = 0
            for i in range(lo, hi + 1):      # one item at a time, as a single agent works
                left = cfg.critical_budget - self.t
                if left < 1:
                    break
                start = self.current if i == self.frontier else None
                steps, _, msg, _, _, _ = run_subagent(self.worker, ROLES["researcher"], subtask(task, i, i, start), left)
                if steps:
                    self.rt.main_step(steps)
                self.t += steps
                if not msg:
                    break
                self._record(msg)
                found += len(msg)
            return ["<res>", "me", str(found)]
        # answer
        return self._finish([])

    def _record(self, facts: dict):
        for key, value in facts.items():
            if key not in self.answer:
                self.answer[key], self.arrived[key] = value, self.t
        if self.task["family"] == "chain":
            items = self.task["items"]
            while self.frontier < len(items) and items[self.frontier] in self.answer:
                self.current = self.answer[items[self.frontier]]
                self.frontier += 1

    def _reply(self, words: list) -> list:
        ended = "<end>" in words
        words = [w for w in words if w != "<end>"]
        if words and not self.done:
            words = words + ["@", str(min(self.t, MAX_NUM))]      # the clock: critical steps so far
        if ended:
            words.append("<end>")
        # the context ends the episode while it can still hold the longest reply (3 per agent + clock)
        room = 3 * self.cfg.max_agents + 8
        if not self.done and not ended and (self.t >= self.cfg.critical_budget
                                            or len(self.tokens) + len(words) + room > self.max_len):
            words = words + ["<end>"]
        if "<end>" in words and not self.done:
            # cut off before <answer>: like a sub-agent stopped at its step limit, it submits nothing
            self.answer, self.arrived = {}, {}
            self._finish([])
        ids = [TOK[w] for w in words]
        self.tokens += ids
        self.is_action += [False] * len(ids)
        return ids

    def _finish(self, words: list) -> list:
        self.done = True
        if self.open_runs:
            # answered (or cut off) with launches not yet read: they still run and cost their stage,
            # but their results never reach the answer
            self.rt.gather()
            self.t += self.rt.trace.stages[-1].critical_steps
            self.n_assigned += len(self.open_runs)
            self.n_finished += sum(bool(run.finished and run.message) for _, run in self.open_runs)
            self.open_runs = []
        self.rt.answer(dict(self.answer))
        if words:
            ids = [TOK[w] for w in words]
            self.tokens += ids
            self.is_action += [False] * len(ids)
            return ids
        return []

    def result(self) -> dict:
        trace = self.rt.trace
        gold = self.task["gold"]
        return {"task": self.task, "trace": trace, "answer": self.answer, "arrived": self.arrived,
                "f1": item_f1(self.answer, gold), "success": float(self.answer == gold),
                "critical": trace.critical_steps, "total": trace.total_steps, "wall_s": trace.wall_s,
                "n_created": len(self.rt.agents), "n_assigned": self.n_assigned, "n_finished": self.n_finished,
                "n_idle": len(self.rt.agents) - len({r.agent for st in trace.stages for r in st.runs}),
                "error": self.error, "tokens": list(self.tokens), "is_action": list(self.is_action),
                "legal": list(self.legal_sets), "calls": list(self.calls), "clock": self.t,
                "answered": bool(self.calls) and self.calls[-1] == ("answer",) and self.error is None}


def play(task: dict, ids, cfg: EnvConfig = EnvConfig(), **kw) -> dict:
    """Drive one episode with a fixed stream of orchestrator tokens (scripted, tests, SFT traces)."""
    ep = Episode(task, cfg, **kw)
    for t in ids:
        if ep.done:
            break
        ep.step(t)
    if not ep.done:
        ep._finish([])
    return ep.result()


def f1_at_budget(episode: dict, budget: int) -> float:
    """Item-F1 of the answer had the episode been stopped after `budget` critical steps."""
    answered = {k: v for k, v in episode["answer"].items() if episode["arrived"][k] <= budget}
    return item_f1(answered, episode["task"]["gold"])


# ---------------------------------------------------------------------------------------------------
# 3. The orchestrator model and batched rollouts through its cache
# ---------------------------------------------------------------------------------------------------


def orchestrator_config(**overrides) -> Config:
    """2 attention layers (RoPE), width 64, 4 heads, a context of 320 tokens. pattern="KA" gives the
    project's hybrid (a KDA layer, then NoPE attention); its CPU reference path trains ~6x slower."""
    base = dict(vocab_size=len(VOCAB), block_size=320, n_layer=2, n_head=4, n_embd=64, pattern="A",
                tie_embeddings=False)
    base.update(overrides)
    return Config(**base)


def _legal_mask(legal_ids: list, device="cpu") -> torch.Tensor:
    mask = torch.zeros(len(VOCAB), dtype=torch.bool, device=device)
    mask[legal_ids] = True
    return mask


def _select_rows(caches: list, keep: torch.Tensor):
    """Drop finished rows from every per-layer cache (each tensor there has the batch first)."""
    for cache in caches:
        for key, value in cache.items():
            if torch.is_tensor(value):
                cache[key] = value[keep]


@torch.no_grad()
def rollout(model: GPT, tasks: list, cfg: EnvConfig = EnvConfig(), greedy: bool = False,
            generator: torch.Generator | None = None, constrained: bool = True, executor="inline",
            step_delay: float = 0.0, temperature: float = 1.0) -> list:
    """Play len(tasks) episodes at once with the model as orchestrator; returns their result dicts.

    Each iteration feeds every live row one chunk: its last sampled token followed by the environment's
    reply (prefill after the cache), right-padded to the longest chunk (valid mask). Without
    `constrained`, the model may write any token and a malformed call ends its episode.
    """
    was_training = model.training
    model.eval()
    eps = [Episode(t, cfg, executor=executor, step_delay=step_delay, max_len=model.config.block_size - 8)
           for t in tasks]
    caches = [dict() for _ in model.blocks]
    live = list(range(len(eps)))                  # episode index of each batch row
    chunks = [ep.tokens[:] for ep in eps]
    while live:
        width = max(len(c) for c in chunks)
        idx = torch.full((len(live), width), PAD, dtype=torch.long)
        valid = torch.zeros(len(live), width, dtype=torch.bool)
        for r, c in enumerate(chunks):
            idx[r, :len(c)], valid[r, :len(c)] = torch.tensor(c), True
        logits, _ = model(idx, caches=caches, valid=valid)
        last = logits[torch.arange(len(live)), valid.sum(1) - 1]                     # [B, V]
        if constrained:
            mask = torch.stack([_legal_mask(eps[e].legal()) for e in live])
        else:
            mask = torch.ones_like(last, dtype=torch.bool)
            mask[:, PAD] = False
        last = last.masked_fill(~mask, float("-inf"))
        if greedy:
            nxt = last.argmax(-1)
        else:
            nxt = torch.multinomial(F.softmax(last / temperature, -1), 1, generator=generator).squeeze(1)
        chunks, keep = [], []
        for r, e in enumerate(live):
            reply = eps[e].step(int(nxt[r]))
            if not eps[e].done:
                keep.append(r)
                chunks.append([int(nxt[r])] + reply)
        if len(keep) < len(live):
            _select_rows(caches, torch.tensor(keep, dtype=torch.long))
            live = [live[r] for r in keep]
    model.train(was_training)
    return [ep.result() for ep in eps]


def _batch(episodes: list):
    """Stack episodes into inputs, targets, which targets are the orchestrator's, and legal masks."""
    T = max(len(ep["tokens"]) for ep in episodes) - 1
    E, V = len(episodes), len(VOCAB)
    x = torch.full((E, T), PAD, dtype=torch.long)
    y = torch.full((E, T), PAD, dtype=torch.long)
    act = torch.zeros(E, T, dtype=torch.bool)
    legal = torch.ones(E, T, V, dtype=torch.bool)          # all True where no action: keeps log_softmax finite
    for e, ep in enumerate(episodes):
        toks = torch.tensor(ep["tokens"])
        n = len(toks) - 1
        x[e, :n], y[e, :n] = toks[:-1], toks[1:]
        a = torch.tensor(ep["is_action"][1:])
        act[e, :n] = a
        pos = a.nonzero().squeeze(1)
        for p, ids in zip(pos.tolist(), ep["legal"]):
            legal[e, p] = False
            legal[e, p, ids] = True
    return x, y, act, legal


def action_logprobs(model: GPT, episodes: list) -> torch.Tensor:
    """[E, T] log p of each target token under the grammar-masked policy; 0 at non-action tokens."""
    x, y, act, legal = _batch(episodes)
    logits, _ = model(x)                                                           # [E, T, V]
    logp = F.log_softmax(logits.masked_fill(~legal, float("-inf")), -1)
    chosen = logp.gather(2, y[..., None]).squeeze(2)                               # [E, T]
    return torch.where(act, chosen, torch.zeros_like(chosen))


def parl_loss(model: GPT, episodes: list, advantages: torch.Tensor) -> torch.Tensor:
    """-sum_e A_e * sum_{orchestrator tokens} log p / E: prompt and environment tokens carry no loss."""
    return -(advantages * action_logprobs(model, episodes).sum(1)).sum() / len(episodes)


def sft_loss(model: GPT, episodes: list, serial_prior: float = 0.8) -> torch.Tensor:
    """Cross-entropy on the orchestrator's tokens, targets smoothed over the legal tokens.

    The target puts serial_prior on the trace's token and 1 - serial_prior spread evenly over the whole
    legal set, so the warm-started model keeps some probability on calls the traces never show."""
    x, y, act, legal = _batch(episodes)
    logits, _ = model(x)
    logp = F.log_softmax(logits.masked_fill(~legal, float("-inf")), -1)
    logp = torch.where(legal, logp, torch.zeros_like(logp))
    n_legal = legal.sum(-1, keepdim=True).float()
    target = (1 - serial_prior) * legal.float() / n_legal
    target.scatter_add_(2, y[..., None], torch.full_like(target[..., :1], serial_prior))
    per_token = -(target * logp).sum(-1)                                           # [E, T]
    return per_token[act].mean()


def serial_trace(task: dict, rng: random.Random, cfg: EnvConfig = EnvConfig()) -> dict:
    """A single agent doing the work itself: <self> on chunks of 1-6 items, then <answer> once the
    items are done or the clock leaves too little for another item (an item costs at most 4 steps)."""
    ep, lo = Episode(task, cfg), 0
    while not ep.done and lo < task["width"]:
        size = min(rng.randint(1, 6), (cfg.critical_budget - ep.t - 1) // 4)
        if size < 1:
            break
        hi = min(task["width"] - 1, lo + size - 1)
        for t in encode_call(("self", lo, hi)):
            if not ep.done:
                ep.step(t)
        lo = hi + 1
    if not ep.done:
        ep.step(TOK["<answer>"])
    return ep.result()


def format_trace(task: dict, rng: random.Random, cfg: EnvConfig = EnvConfig()) -> dict:
    """A tool-format example: 1-16 sub-agents of one random role, the items cut into that many near-equal
    contiguous ranges (agents beyond the item count stay idle), one <wait>, then <answer>. It shows the
    syntax of splitting and what results look like; whether to delegate at all, how many agents, which
    role, and when to answer are not in it: the counts and roles are random, RL has to find which pay."""
    ep, W = Episode(task, cfg), task["width"]
    n, role = rng.randint(1, cfg.max_agents), rng.choice(ROLE_TOKENS)
    calls = [("create", role) for _ in range(n)]
    k = min(n, W)
    bounds = [i * W // k for i in range(k + 1)]
    calls += [("assign", i, bounds[i], bounds[i + 1] - 1) for i in range(k)]
    calls += [("wait",), ("answer",)]
    for call in calls:
        for t in encode_call(call):
            if not ep.done:
                ep.step(t)
    return ep.result()


# ---------------------------------------------------------------------------------------------------
# 4. PARL: reward, lambda schedule, group-relative advantages, the training loop
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
    assigned = episode["n_assigned"] + episode.get("n_idle", 0)     # an agent never given a task did not finish
    r_finish = episode["n_finished"] / assigned if assigned else 0.0
    return {"r": lambda1 * r_parallel + lambda2 * r_finish + r_perf,
            "r_perf": r_perf, "r_parallel": r_parallel, "r_finish": r_finish}


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """r - mean over the K samples of the same task (K2.5's baseline; no std normalisation)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)                     # [tasks, K]
    return (r - r.mean(dim=1, keepdim=True)).view(-1)


def make_arms(lambda1: float = 0.2, lambda2: float = 0.4, anneal_frac: float = 0.6) -> dict:
    """The five arms: name -> (trained with PARL, lambda1_init, lambda2_init, anneal_frac or None)."""
    return {"single agent": (False, 0.0, 0.0, None),
            "outcome only": (True, 0.0, 0.0, None),
            "outcome + fixed r_parallel": (True, lambda1, 0.0, None),
            "PARL, no annealing": (True, lambda1, lambda2, None),
            "PARL, annealed": (True, lambda1, lambda2, anneal_frac)}


ARMS = make_arms()


def summarize(episodes: list) -> dict:
    out = {}
    for kind in ("narrow", "wide", "deep"):
        eps = [ep for ep in episodes if task_kind(ep["task"]) == kind]
        if not eps:
            continue
        assigned = sum(ep["n_assigned"] + ep["n_idle"] for ep in eps)
        out.update({f"{kind}_f1": np.mean([ep["f1"] for ep in eps]),
                    f"{kind}_success": np.mean([ep["success"] for ep in eps]),
                    f"{kind}_critical": np.mean([ep["critical"] for ep in eps]),
                    f"{kind}_total": np.mean([ep["total"] for ep in eps]),
                    f"{kind}_agents": np.mean([ep["n_created"] for ep in eps]),
                    f"{kind}_finish": sum(ep["n_finished"] for ep in eps) / assigned if assigned else float("nan")})
    return out


def train_sft(model: GPT, tasks: list, steps: int, batch: int = 32, lr: float = 3e-3, serial_prior: float = 0.8,
              format_frac: float = 0.15, seed: int = 0, log=None) -> list:
    """Stage (a): warm start on single-agent traces, plus a share format_frac of tool-format examples
    (`format_trace`). Returns the loss per step."""
    rng = random.Random(seed)
    traces = [format_trace(t, rng) if rng.random() < format_frac else serial_trace(t, rng) for t in tasks]
    opt = MuonClip.from_model(model, lr=lr, weight_decay=0.0, qk_clip_tau=100.0)
    model.train()
    losses = []
    for s in range(steps):
        loss = sft_loss(model, rng.sample(traces, batch), serial_prior)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log:
            log(s, steps, loss.item())
    return losses


def train_parl(model: GPT, tasks: list, updates: int, arm=(True, 0.2, 0.4, 0.6), tasks_per_update: int = 8,
               group_size: int = 8, lr: float = 1e-3, seed: int = 0, log_every: int = 5, n_cap: int = 16,
               cfg: EnvConfig = EnvConfig(), log=None) -> list:
    """Stage (b): PARL. Returns a history of logged rollout statistics."""
    _, lam1_0, lam2_0, anneal = arm
    opt = MuonClip.from_model(model, lr=lr, weight_decay=0.0, qk_clip_tau=100.0)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    history = []
    for u in range(updates):
        lam1 = lambda_schedule(u, updates, lam1_0, anneal)
        lam2 = lambda_schedule(u, updates, lam2_0, anneal)
        group = [t for t in rng.sample(tasks, tasks_per_update) for _ in range(group_size)]
        episodes = rollout(model, group, cfg, generator=gen)
        rewards = torch.tensor([parl_reward(ep, lam1, lam2, n_cap)["r"] for ep in episodes])
        adv = group_advantages(rewards, group_size)
        model.train()
        loss = parl_loss(model, episodes, adv)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if u % log_every == 0 or u == updates - 1:
            row = {"update": u, "lambda1": lam1, "lambda2": lam2, "reward": rewards.mean().item(),
                   "tokens": float(np.mean([len(ep["tokens"]) for ep in episodes]))}
            row.update(summarize(episodes))
            history.append(row)
        if log:
            log(u, updates, rewards.mean().item())
    return history


def budget_to_reach(episodes: list, target: float, max_budget: int):
    """Smallest critical-step budget at which mean item-F1 over `episodes` reaches `target` (Fig. 8 style)."""
    for b in range(1, max_budget + 1):
        if np.mean([f1_at_budget(ep, b) for ep in episodes]) >= target:
            return b
    return None


# ---------------------------------------------------------------------------------------------------
# 5. The experiment: five arms, one shared SFT warm start per seed
# ---------------------------------------------------------------------------------------------------

SFT_COST = 0.3   # one SFT step costs about 0.3 PARL updates (measured): the ETA weighs them so


class Progress:
    """Progress with an ETA over a run measured in work units (SFT steps and PARL updates)."""

    def __init__(self, total_units: float):
        self.total, self.done, self.t0, self.last = total_units, 0.0, time.time(), 0.0

    def tick(self, units: float, label: str, force: bool = False):
        self.done += units
        now = time.time()
        if force or now - self.last > 10:
            self.last = now
            el = now - self.t0
            eta = el / max(self.done, 1e-9) * (self.total - self.done)
            print(f"  [{el:5.0f} s | {100 * self.done / self.total:3.0f}% | ETA {eta:4.0f} s] {label}", flush=True)


def run_seed(seed: int, out_dir: str, steps: int, sft_steps: int, tasks_per_update: int, group_size: int,
             lr: float, sft_lr: float, serial_prior: float, arms: dict, n_eval: int, progress: Progress,
             format_frac: float = 0.15, cfg: EnvConfig = EnvConfig()):
    torch.manual_seed(seed)
    train_tasks = sample_tasks(random.Random(seed), 600, cfg=cfg)
    eval_tasks = sample_tasks(random.Random(10_000 + seed), n_eval, mix=(1 / 3, 1 / 3, 1 / 3), cfg=cfg)
    wide_eval = [t for t in eval_tasks if task_kind(t) == "wide"]
    base = GPT(orchestrator_config())
    t0 = time.time()
    sft = train_sft(base, train_tasks, sft_steps, lr=sft_lr, serial_prior=serial_prior, format_frac=format_frac,
                    seed=seed,
                    log=lambda s, n, loss: progress.tick(SFT_COST, f"seed {seed} SFT step {s + 1}/{n} loss {loss:.3f}"))
    print(f"seed {seed}: SFT {sft_steps} steps, loss {sft[0]:.3f} -> {sft[-1]:.3f}, {time.time() - t0:.0f} s", flush=True)
    state0 = {k: v.clone() for k, v in base.state_dict().items()}
    results, histories = {}, {}
    for name, arm in arms.items():
        t0 = time.time()
        model = GPT(orchestrator_config())
        model.load_state_dict(state0)
        hist = []
        if arm[0]:
            hist = train_parl(model, train_tasks, steps, arm, tasks_per_update, group_size, lr=lr, seed=seed, cfg=cfg,
                              log=lambda u, n, r: progress.tick(1, f"seed {seed} {name}: update {u + 1}/{n} "
                                                                   f"reward {r:.3f}"))
        eps = rollout(model, eval_tasks, cfg, greedy=True)
        s = summarize(eps)
        results[name] = {"eval": eps, "wide": [ep for ep in eps if task_kind(ep["task"]) == "wide"], "summary": s,
                         "train_s": time.time() - t0}
        histories[name] = hist
        if name == "PARL, annealed":
            save_checkpoint(model, os.path.join(out_dir, f"orchestrator_seed{seed}.pt"), seed, steps)
        print(f"seed {seed} {name:<28} wide F1 {s['wide_f1']:.3f} crit {s['wide_critical']:.1f} agents "
              f"{s['wide_agents']:.1f} | narrow agents {s['narrow_agents']:.1f} | deep F1 {s['deep_f1']:.3f} agents "
              f"{s['deep_agents']:.1f} | {time.time() - t0:.0f} s", flush=True)
    # the reference for "critical steps to reach an item-F1": a single agent doing every item itself with
    # no budget (the scripted traces the SFT imitates), since the single-agent arm stops at the budget
    long_cfg = EnvConfig(critical_budget=400)
    rng = random.Random(seed)
    results["serial, no budget"] = {"wide": [serial_trace(t, rng, long_cfg) for t in wide_eval]}
    return results, histories, sft


def save_checkpoint(model: GPT, path: str, seed: int, steps: int):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "config": vars(model.config), "seed": seed, "steps": steps}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str) -> GPT:
    from model import config_from_dict
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = GPT(config_from_dict(ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return model


TARGETS = (0.5, 0.7, 0.9)


def _arm_row(name: str, per_seed: list, single: list) -> str:
    """One table row; every cell lists the seeds' values separated by ' / '."""
    def cells(fn, fmt):
        return " / ".join(fmt(fn(r, i)) for i, r in enumerate(per_seed))

    def finish(r, _):
        eps = r["eval"]
        a = sum(ep["n_assigned"] + ep["n_idle"] for ep in eps)
        return sum(ep["n_finished"] for ep in eps) / a if a else None

    def speed(x):
        def f(r, i):
            b, b1 = r["need"][x], single[i]["need"][x]
            if b is None:
                return "-"
            return f"{b}" + ("" if b1 is None else f" ({b1 / b:.1f}x)")
        return f

    def fmt_or_dash(v):
        return "-" if v is None else f"{v:.2f}"

    row = [name, cells(lambda r, _: r["summary"]["wide_f1"], "{:.3f}".format),
           cells(lambda r, _: r["summary"]["wide_critical"], "{:.1f}".format),
           cells(lambda r, _: r["summary"]["narrow_agents"], "{:.1f}".format),
           cells(lambda r, _: r["summary"]["wide_agents"], "{:.1f}".format),
           cells(lambda r, _: r["summary"]["deep_agents"], "{:.1f}".format),
           cells(finish, fmt_or_dash),
           cells(lambda r, _: np.mean([ep["answered"] for ep in r["eval"]]),
                 "{:.2f}".format),
           cells(lambda r, _: r["summary"]["deep_f1"], "{:.3f}".format)]
    row += [cells(speed(x), str) for x in TARGETS]
    return "| " + " | ".join(row) + " |"


def run_experiment(out_dir: str = "out/swarm", seeds=(0,), steps: int = 25, sft_steps: int = 80,
                   tasks_per_update: int = 6, group_size: int = 6, lr: float = 3e-3, sft_lr: float = 3e-3,
                   serial_prior: float = 0.8, lambda1: float = 0.2, lambda2: float = 0.4, anneal_frac: float = 0.6,
                   n_eval: int = 60, format_frac: float = 0.15):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    arms = make_arms(lambda1, lambda2, anneal_frac)
    n_trained = sum(a[0] for a in arms.values())
    progress = Progress(len(seeds) * (SFT_COST * sft_steps + n_trained * steps))
    t_start = time.time()
    all_results, all_hist, sft_curves = [], [], []
    for seed in seeds:
        res, hist, sft = run_seed(seed, out_dir, steps, sft_steps, tasks_per_update, group_size, lr, sft_lr,
                                  serial_prior, arms, n_eval, progress, format_frac)
        for r in res.values():
            r["need"] = {x: budget_to_reach(r["wide"], x, 400) for x in TARGETS}
        all_results.append(res)
        all_hist.append(hist)
        sft_curves.append(sft)
    total_s = time.time() - t_start

    header = ("| arm (seeds " + " / ".join(map(str, seeds)) + ") | wide item-F1 | wide crit. steps "
              "| sub-agents narrow | sub-agents wide | sub-agents deep | sub-agent finish rate | episode finish rate "
              "| deep item-F1 | " + " | ".join(f"crit. steps to wide F1 {x} (x fewer than single)" for x in TARGETS) + " |")
    lines = [header, "|" + "---|" * (9 + len(TARGETS))]
    for name in arms:
        lines.append(_arm_row(name, [r[name] for r in all_results], [r["serial, no budget"] for r in all_results]))
    table = "\n".join(lines)
    oc = orchestrator_config()
    note = (f"LM orchestrator ({sum(p.numel() for p in GPT(oc).parameters()) / 1e3:.0f}k params, "
            f"pattern {oc.pattern}, {oc.n_layer} layers, width {oc.n_embd}): SFT {sft_steps} steps (serial prior {serial_prior}, "
            f"{format_frac:.0%} tool-format examples), then PARL {steps} updates x "
            f"{tasks_per_update} tasks x {group_size} samples, lr {lr}, lambda1_0 {lambda1}, lambda2_0 {lambda2}, "
            f"anneal_frac {anneal_frac}; greedy eval on {n_eval} held-out tasks per seed (critical budget "
            f"{EnvConfig.critical_budget}). 'crit. steps to wide F1 x': the smallest budget at which the arm's mean "
            f"item-F1 on the wide eval tasks reaches x (from the steps at which items arrived), and in brackets "
            f"how many times fewer than a single agent doing every item itself with no budget needs (it needs "
            + " / ".join(", ".join(str(r["serial, no budget"]["need"][x]) for x in TARGETS) for r in all_results)
            + f" for F1 {', '.join(map(str, TARGETS))}). Total {total_s:.0f} s.\n\n")
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(note + table + "\n")
    print(note + table, flush=True)

    colors = dict(zip(arms, ["k", "tab:blue", "tab:orange", "tab:green", "tab:red"]))
    keys = [("reward", "reward r (sampled)"), ("wide_f1", "item-F1 (wide, sampled)"),
            ("wide_critical", "critical steps (wide)"), ("narrow_agents", "sub-agents / task (narrow)"),
            ("wide_agents", "sub-agents / task (wide)"), ("deep_agents", "sub-agents / task (deep)"),
            ("narrow_finish", "sub-agent finish rate (narrow)"), ("tokens", "episode length (tokens)")]
    fig, axes = plt.subplots(2, 4, figsize=(18, 7))
    for ax, (key, title) in zip(axes.flat, keys):
        for s_i, hist in enumerate(all_hist):
            for name, h in hist.items():
                if h:
                    ax.plot([r["update"] for r in h], [r.get(key, np.nan) for r in h], color=colors[name],
                            alpha=1.0 if s_i == 0 else 0.4, label=name if s_i == 0 else None)
                elif key not in ("reward", "tokens") and s_i == 0:
                    ax.axhline(all_results[0][name]["summary"].get(key, np.nan), color="k", ls="--", lw=1,
                               label=name + " (SFT)")
        ax.set_title(title)
        ax.set_xlabel("PARL update")
    axes.flat[1].legend(fontsize=7)
    fig.suptitle(f"LM orchestrator, PARL arms (seeds {', '.join(map(str, seeds))}; faint = later seeds)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "training.png"), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name in list(arms) + ["serial, no budget"]:
        r = all_results[0][name]
        budgets = range(1, 121)
        ax.plot(list(budgets), [np.mean([f1_at_budget(ep, b) for ep in r["wide"]]) for b in budgets],
                color=colors.get(name, "gray"), ls="-" if name in arms else ":", label=name)
    ax.set(xlabel="critical-step budget", ylabel="item-F1", title=f"wide tasks: item-F1 vs critical steps (seed {seeds[0]})")
    ax.axvline(EnvConfig.critical_budget, color="gray", ls=":", lw=1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "f1_vs_critical_steps.png"), dpi=100)
    plt.close(fig)
    return all_results, all_hist, table


# ---------------------------------------------------------------------------------------------------
# demo and benchmark
# ---------------------------------------------------------------------------------------------------


def timeline(episode: dict, width: int = 50) -> str:
    """The sub-agents' parallel timeline, stage by stage, in critical steps (one column per step).
    Consecutive stages in which the orchestrator worked alone are shown as one line."""
    lines, t = [], 0
    runs = [r for st in episode["trace"].stages for r in st.runs]
    t0 = min((r.t_start for r in runs), default=0.0)     # wall clock, to show the runs really overlapped
    alone = None                                         # [first stage, steps] of a run of solo stages
    for i, st in enumerate(episode["trace"].stages):
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
        lines.append(f"stages {alone[0]}-{len(episode['trace'].stages) - 1}: the orchestrator alone, "
                     f"critical steps {alone[1]} -> {t}")
    lines.append(f"critical steps {episode['critical']} (trace), total steps {episode['total']}, "
                 f"episode wall time {episode['wall_s'] * 1e3:.0f} ms (decoding included)")
    return "\n".join(lines)


def demo(out_dir: str = "out/swarm", seed: int = 0):
    path = os.path.join(out_dir, f"orchestrator_seed{seed}.pt")
    quick = os.path.join(out_dir, "orchestrator_quick.pt")
    if os.path.exists(path):
        model = load_checkpoint(path)
        print(f"loaded the trained orchestrator (PARL, annealed, seed {seed}) from {path}")
    elif os.path.exists(quick):
        model = load_checkpoint(quick)
        print(f"loaded the quick demo orchestrator (SFT 60 steps + PARL 20 updates) from {quick}; "
              f"`python swarm.py` trains the full one")
    else:
        print(f"no checkpoint at {path} (run `python swarm.py` first for the full one): training a quick one "
              f"(SFT 60 steps + PARL 20 updates, about 20 s of CPU)")
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        tasks = sample_tasks(random.Random(seed), 300)
        model = GPT(orchestrator_config())
        train_sft(model, tasks, 60, seed=seed)
        train_parl(model, tasks, 20, ARMS["PARL, annealed"], seed=seed)
        save_checkpoint(model, os.path.join(out_dir, "orchestrator_quick.pt"), seed, 20)
    task = make_task(random.Random(3), "lookup", 20)
    print(f"\ntask: {task['question'][:110]}...\n")
    ep = rollout(model, [task], greedy=True, executor="thread", step_delay=0.002)[0]
    print("the episode as the orchestrator wrote it ([environment tokens] were appended by the runtime):\n")
    print(render(ep["tokens"], ep["is_action"]))
    print(f"\nitem-F1 {ep['f1']:.3f}, sub-agents {ep['n_created']}, finished {ep['n_finished']}/{ep['n_assigned']}\n")
    print(timeline(ep))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--demo", action="store_true", help="print one episode written by the trained orchestrator")
    parser.add_argument("--steps", type=int, default=25, help="PARL updates per trained arm")
    parser.add_argument("--sft_steps", type=int, default=80, help="SFT steps (shared by the arms of a seed)")
    parser.add_argument("--seed", type=int, default=0, help="seed (for --demo: whose checkpoint to load)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="several seeds, one table (overrides --seed)")
    parser.add_argument("--tasks_per_update", type=int, default=6)
    parser.add_argument("--group_size", type=int, default=6, help="samples per task (group-mean baseline)")
    parser.add_argument("--lr", type=float, default=3e-3, help="PARL learning rate (MuonClip)")
    parser.add_argument("--sft_lr", type=float, default=3e-3)
    parser.add_argument("--serial_prior", type=float, default=0.8, help="SFT target weight on the trace's token")
    parser.add_argument("--lambda1", type=float, default=0.2, help="initial weight of r_parallel")
    parser.add_argument("--lambda2", type=float, default=0.4, help="initial weight of r_finish")
    parser.add_argument("--anneal_frac", type=float, default=0.6, help="lambdas reach 0 at this fraction of updates")
    parser.add_argument("--n_eval", type=int, default=60, help="held-out tasks per seed")
    parser.add_argument("--format_frac", type=float, default=0.15, help="share of tool-format examples in SFT")
    parser.add_argument("--out_dir", default="out/swarm")
    args = parser.parse_args()
    if args.demo:
        demo(args.out_dir, args.seed)
    else:
        run_experiment(args.out_dir, tuple(args.seeds or [args.seed]), args.steps, args.sft_steps,
                       args.tasks_per_update, args.group_size, args.lr, args.sft_lr, args.serial_prior,
                       args.lambda1, args.lambda2, args.anneal_frac, args.n_eval, args.format_frac)
