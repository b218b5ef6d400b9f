"""Agent Swarm runtime: frozen sub-agents on a thread pool, stages, traces and critical steps.

Support module for swarm.py (K2.5, arXiv 2602.02276, section 3): the two tools create_subagent and
assign_task, each sub-agent running on its own and returning one message. Cost is counted in

    CriticalSteps = sum over stages t of ( S_main(t) + max_i S_sub,i(t) )

(the longest path through the episode) next to total steps (all work done) and wall time.
"""
import concurrent.futures as cf
import time
from dataclasses import dataclass, field
from typing import Any, Callable


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

    @property
    def total_steps(self) -> int:
        return self.main_steps + sum(r.steps for r in self.runs)


@dataclass
class Trace:
    stages: list = field(default_factory=list)
    answer: Any = None
    wall_s: float = 0.0

    @property
    def critical_steps(self) -> int:
        return sum(st.critical_steps for st in self.stages)

    @property
    def total_steps(self) -> int:
        """All work done: orchestrator steps plus every sub-agent's steps."""
        return sum(st.total_steps for st in self.stages)


def run_subagent(worker: Callable, system_prompt: str, task: Any, budget: int, step_delay: float = 0.0):
    """Drive `worker(system_prompt, task)`, a generator: each `yield` is a step (a tool call), its return
    value the one message sent back; asking for step budget+1 cuts it off with nothing sent.
    Module level so a process pool can pickle it. Returns (steps, finished, message, error, t0, t1)."""
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
    """One episode: create_subagent registers a frozen worker with a role, assign_task launches it at once,
    gather() closes the stage, main_step(k) counts the orchestrator's own calls, answer(x) ends it.
    executor: "thread", "inline" (sequential, same trace: fast RL rollouts) or an Executor to share.
    """

    def __init__(self, worker: Callable, *, sub_step_budget: int = 100, main_step_budget: int = 100,
                 executor="thread", max_subagents: int = 100,
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
            self.pool, self._owns_pool = cf.ThreadPoolExecutor(max_subagents), True
        elif executor == "inline":
            self.pool = None
        else:
            raise ValueError(f"executor must be 'thread', 'inline' or an Executor, got {executor!r}")
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
