"""Tests for swarm.py: critical-step accounting, PARL reward terms, real concurrency, the policy-gradient
step, the environment, and clear errors at the API boundary. CPU only, a few seconds in all."""
import random
import time

import pytest
import torch

import swarm
from swarm import (N_CHOICES, ROLES, EnvConfig, Stage, SubagentRun, SwarmRuntime, critical_steps, item_f1,
                   lambda_schedule, make_task, parl_reward, run_episode, run_subagent, scripted_worker,
                   sleepy_worker, total_steps)


def _counting_worker(system_prompt, task):
    for _ in range(task["steps"]):
        yield
    return {"done": task["steps"]}


# --- critical steps vs total steps -------------------------------------------------------------------

def test_critical_and_total_steps_on_hand_built_stages():
    stages = [(1, [3, 5]), (1, [2])]
    assert critical_steps(stages) == (1 + 5) + (1 + 2) == 9
    assert total_steps(stages) == 1 + 3 + 5 + 1 + 2 == 12
    # a stage without sub-agents costs its main steps only; the longest sub-agent sets a stage's cost
    stages = [(2, []), (1, [1, 1, 7, 1]), (3, [4])]
    assert critical_steps(stages) == 2 + 8 + 7
    assert total_steps(stages) == 2 + 1 + 10 + 3 + 4
    objs = [Stage(1, [SubagentRun("a", "", None, steps=3), SubagentRun("b", "", None, steps=5)]), Stage(2)]
    assert critical_steps(objs) == 8 and objs[0].critical_steps == 6 and total_steps(objs) == 11


def test_runtime_trace_counts_the_longest_subagent():
    rt = SwarmRuntime(_counting_worker, executor="inline")
    for name, steps in [("a", 3), ("b", 9), ("c", 1)]:
        rt.create_subagent(name, ROLES["researcher"])
        rt.assign_task(name, {"steps": steps})
    rt.main_step(2)          # overhead inside the open stage
    runs = rt.gather()
    rt.main_step(4)          # a direct tool call: its own stage
    trace = rt.answer("x")
    assert [r.steps for r in runs] == [3, 9, 1] and all(r.finished for r in runs)
    assert [s.main_steps for s in trace.stages] == [3, 4]
    assert trace.critical_steps == (3 + 9) + 4
    assert trace.total_steps == 3 + 13 + 4


def test_step_budget_cuts_a_subagent_off_without_a_message():
    steps, finished, message, error, _, _ = run_subagent(_counting_worker, "p", {"steps": 5}, budget=5)
    assert (steps, finished, message, error) == (5, True, {"done": 5}, None)
    steps, finished, message, error, _, _ = run_subagent(_counting_worker, "p", {"steps": 6}, budget=5)
    assert (steps, finished, message) == (5, False, None)
    rt = SwarmRuntime(_counting_worker, sub_step_budget=4, executor="inline")
    rt.create_subagent("a", "p")
    run = rt.assign_task("a", {"steps": 10})
    rt.gather()
    assert run.steps == 4 and not run.finished and run.message is None


def test_crashing_worker_is_an_unfinished_subagent():
    def broken(system_prompt, task):
        yield
        raise RuntimeError("tool failed")
    steps, finished, message, error, _, _ = run_subagent(broken, "p", {}, budget=3)
    assert steps == 1 and not finished and message is None and "tool failed" in error


# --- PARL reward terms -------------------------------------------------------------------------------

def _episode(f1=0.5, success=0.0, n_created=0, n_assigned=0, n_finished=0):
    return {"f1": f1, "success": success, "n_created": n_created, "n_assigned": n_assigned, "n_finished": n_finished}


def test_reward_terms_on_crafted_episodes():
    # nothing assigned: no finish reward, no instantiation reward
    r = parl_reward(_episode(), 0.2, 0.4)
    assert r["r_finish"] == 0 and r["r_parallel"] == 0 and r["r"] == pytest.approx(0.5)
    # 8 sub-agents, none finished (all empty or cut off): parallel pays, finish does not
    r = parl_reward(_episode(n_created=8, n_assigned=8, n_finished=0), 0.2, 0.4, n_cap=16)
    assert r["r_finish"] == 0 and r["r_parallel"] == pytest.approx(0.5)
    assert r["r"] == pytest.approx(0.2 * 0.5 + 0.5)
    # instantiation saturates at n_cap; finish is the finished fraction
    r = parl_reward(_episode(f1=1.0, n_created=64, n_assigned=64, n_finished=16), 0.2, 0.4, n_cap=16)
    assert r["r_parallel"] == 1.0 and r["r_finish"] == pytest.approx(0.25)
    assert r["r"] == pytest.approx(0.2 + 0.4 * 0.25 + 1.0)
    # success as the outcome
    assert parl_reward(_episode(f1=0.9, success=1.0), 0, 0, perf="success")["r"] == 1.0


def test_empty_and_unfinished_subagents_earn_no_finish_reward_in_a_real_episode():
    task = make_task(random.Random(1), "lookup", 3)
    ep = run_episode(task, lambda feats: N_CHOICES.index(8))      # 8 sub-agents for 3 items: 5 empty
    assert ep["f1"] == 1.0 and ep["n_assigned"] == 8 and ep["n_finished"] == 3
    assert parl_reward(ep, 0.0, 1.0)["r_finish"] == pytest.approx(3 / 8)
    # one sub-agent for 40 items blows its step cap: it returns nothing, so it is unfinished
    wide = make_task(random.Random(2), "lookup", 40)
    ep = run_episode(wide, lambda feats: 0 if feats[4] > 0 else N_CHOICES.index(1))
    assert ep["trace"].stages[0].runs[0].message is None
    assert parl_reward(ep, 0.0, 1.0)["r_finish"] == 0.0


def test_lambdas_anneal_to_zero_then_only_the_outcome_pays():
    total, frac = 100, 0.6
    assert lambda_schedule(0, total, 0.3, frac) == pytest.approx(0.3)
    assert lambda_schedule(30, total, 0.3, frac) == pytest.approx(0.15)
    for u in (60, 61, 99):
        assert lambda_schedule(u, total, 0.3, frac) == 0.0
        assert lambda_schedule(u, total, 0.3, frac, kind="cosine") == pytest.approx(0.0, abs=1e-12)
    assert lambda_schedule(99, total, 0.3, None) == 0.3          # no annealing: constant
    ep = _episode(f1=0.7, n_created=12, n_assigned=12, n_finished=12)
    lam1, lam2 = lambda_schedule(60, total, 0.2, frac), lambda_schedule(60, total, 0.4, frac)
    assert parl_reward(ep, lam1, lam2)["r"] == pytest.approx(0.7)
    assert parl_reward(ep, 0.2, 0.4)["r"] > 0.7


# --- real concurrency --------------------------------------------------------------------------------

def test_subagents_overlap_in_time_on_the_thread_pool():
    n, steps, sleep = 8, 4, 0.03                  # each worker waits ~0.12 s; serially 8x that
    rt = SwarmRuntime(sleepy_worker, executor="thread")
    t0 = time.perf_counter()
    for i in range(n):
        rt.assign_task(rt.create_subagent(f"w{i}", f"worker {i}"), {"steps": steps, "sleep": sleep})
    runs = rt.gather()
    wall = time.perf_counter() - t0
    rt.answer(None)
    assert all(r.finished and r.steps == steps for r in runs)
    assert max(r.t_start for r in runs) < min(r.t_end for r in runs), "some worker ended before another began"
    assert wall < 0.5 * n * steps * sleep, f"wall {wall:.3f} s is not far below serial {n * steps * sleep:.2f} s"


def test_subagents_overlap_in_time_on_the_process_pool():
    rt = SwarmRuntime(sleepy_worker, executor="process", max_workers=2)
    for i in range(2):
        rt.assign_task(rt.create_subagent(f"w{i}", f"worker {i}"), {"steps": 3, "sleep": 0.1})
    runs = rt.gather()
    rt.answer(None)
    assert [r.message for r in runs] == ["worker 0", "worker 1"]
    assert max(r.t_start for r in runs) < min(r.t_end for r in runs)


def test_a_hundred_subagents_and_1500_steps_in_one_episode():
    rt = SwarmRuntime(_counting_worker, executor="thread", sub_step_budget=15)
    for i in range(100):
        rt.assign_task(rt.create_subagent(f"a{i}", ROLES["researcher"]), {"steps": 15})
    trace = rt.answer(None)
    assert len(trace.stages[0].runs) == 100
    assert trace.total_steps == 1 + 1500 and trace.critical_steps == 1 + 15
    rt2 = SwarmRuntime(_counting_worker, executor="inline", max_subagents=1)
    rt2.create_subagent("a", "")
    with pytest.raises(ValueError, match="max_subagents"):
        rt2.create_subagent("b", "")


# --- policy gradient ---------------------------------------------------------------------------------

def test_policy_gradient_step_raises_expected_return_on_a_two_action_task():
    torch.manual_seed(0)
    policy = torch.nn.Linear(1, 2)                # logits for actions 0 (reward 0) and 1 (reward 1)
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    feats = torch.ones(1, 1)

    def expected_return():
        with torch.no_grad():
            return torch.softmax(policy(feats), -1)[0, 1].item()

    before = expected_return()
    for _ in range(3):
        group = 8
        probs = torch.softmax(policy(feats), -1).detach()
        actions = torch.multinomial(probs.expand(group, 2), 1).squeeze(1)
        rewards = actions.float()
        swarm.policy_gradient_step(policy, opt, feats.expand(group, 1), actions, torch.arange(group),
                                   rewards, group, entropy_coef=0.0)
    assert expected_return() > before + 0.05


def test_group_advantages_are_centred_per_task():
    adv = swarm.group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0, 1.0]), 3)
    assert torch.allclose(adv, torch.tensor([0.0, -1.0, 1.0, -0.667, 2.333, -1.667]), atol=1e-3)
    with pytest.raises(ValueError, match="groups of 4"):
        swarm.group_advantages(torch.zeros(6), 4)


def test_policy_starts_with_the_serial_prior_and_training_runs():
    policy = swarm.OrchestratorPolicy(serial_prior=0.5)
    feats = torch.tensor(swarm.state_features(make_task(random.Random(0), "lookup", 20), 20, 0, EnvConfig()))
    assert torch.softmax(policy(feats), -1)[0].item() == pytest.approx(0.5, abs=0.05)
    tasks = swarm.sample_tasks(random.Random(0), 12)
    policy, hist = swarm.train_arm("PARL, annealed", tasks, updates=2, tasks_per_update=3, group_size=4,
                                   cfg=EnvConfig(), seed=0, log_every=1)
    assert len(hist) == 2 and hist[0]["lambda1"] == pytest.approx(0.2) and hist[1]["lambda1"] < 0.2


# --- environment -------------------------------------------------------------------------------------

def test_scripted_subagents_are_frozen_and_follow_their_role():
    task = make_task(random.Random(5), "lookup", 4)
    sub = {"kind": "lookup", "entities": list(task["gold"]), "attribute": task["attribute"], "corpus": task["corpus"]}
    steps, finished, msg, _, _, _ = run_subagent(scripted_worker, ROLES["researcher"], sub, budget=100)
    assert finished and msg == task["gold"] and 2 * 4 <= steps <= 4 * 4
    # the same sub-task under a role that does not fit it: one step, empty report
    steps, finished, msg, _, _, _ = run_subagent(scripted_worker, ROLES["coder"], sub, budget=100)
    assert (steps, finished, msg) == (1, True, {})
    claims = dict(task["gold"])
    wrong = next(iter(claims))
    claims[wrong] = "nonsense"
    _, _, verdict, _, _, _ = run_subagent(scripted_worker, ROLES["fact-checker"],
                                          {"kind": "verify", "claims": claims, "corpus": task["corpus"]}, 100)
    assert verdict[wrong] is False and sum(verdict.values()) == 3


def test_episode_accounting_and_the_deep_chain():
    cfg = EnvConfig()
    wide = make_task(random.Random(7), "lookup", 30)
    alone = run_episode(wide, lambda f: 0, cfg)
    assert alone["critical"] == alone["total"] <= cfg.critical_budget and alone["n_created"] == 0
    assert 0 < alone["f1"] < 1                                   # a single agent cannot finish a wide task
    swarm_ep = run_episode(wide, lambda f: N_CHOICES.index(12), cfg)
    assert swarm_ep["f1"] == 1.0 and swarm_ep["critical"] < alone["critical"] < swarm_ep["total"]
    assert max(swarm_ep["arrived"].values()) <= swarm_ep["critical"]
    assert swarm.f1_at_budget(swarm_ep, 0) == 0.0 and swarm.f1_at_budget(swarm_ep, swarm_ep["critical"]) == 1.0
    # a chain: sub-agents past the first do not know where to start, so splitting buys nothing
    deep = make_task(random.Random(8), "chain", 6)
    alone = run_episode(deep, lambda f: 0, cfg)
    split = run_episode(deep, lambda f: N_CHOICES.index(3), cfg)
    assert alone["success"] == 1.0 and split["success"] == 1.0
    assert split["critical"] >= alone["critical"] and split["n_finished"] < split["n_assigned"]


def test_item_f1():
    gold = {"a": 1, "b": 2, "c": 3, "d": 4}
    assert item_f1(gold, gold) == 1.0 and item_f1({}, gold) == 0.0
    assert item_f1({"a": 1, "b": 2}, gold) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert item_f1({"a": 1, "b": 0}, gold) == pytest.approx(2 * 0.5 * 0.25 / 0.75)


# --- errors ------------------------------------------------------------------------------------------

def test_bad_input_raises_clear_errors():
    rt = SwarmRuntime(_counting_worker, executor="inline")
    rt.create_subagent("a", ROLES["researcher"])
    with pytest.raises(ValueError, match="unknown agent 'b'"):
        rt.assign_task("b", {"steps": 1})
    with pytest.raises(ValueError, match="already exists"):
        rt.create_subagent("a", "again")
    with pytest.raises(ValueError, match="budget must be a positive int"):
        rt.assign_task("a", {"steps": 1}, budget=0)
    rt.answer(None)
    with pytest.raises(ValueError, match="already answered"):
        rt.assign_task("a", {"steps": 1})
    with pytest.raises(ValueError, match="already answered"):
        rt.create_subagent("c", "")
    for kwargs in ({"sub_step_budget": 0}, {"main_step_budget": 0}, {"sub_step_budget": 2.5}):
        with pytest.raises(ValueError, match="must be a positive int"):
            SwarmRuntime(_counting_worker, executor="inline", **kwargs)
    with pytest.raises(ValueError, match="executor must be"):
        SwarmRuntime(_counting_worker, executor="gpu")
    rt = SwarmRuntime(_counting_worker, executor="inline", main_step_budget=3)
    rt.main_step(3)
    with pytest.raises(ValueError, match="orchestrator step budget 3 exceeded"):
        rt.main_step(1)
    with pytest.raises(ValueError, match="family"):
        make_task(random.Random(0), "wide", 3)
    with pytest.raises(ValueError, match="anneal_frac"):
        lambda_schedule(1, 10, 0.1, 0.0)
    with pytest.raises(ValueError, match="perf"):
        parl_reward(_episode(), 0, 0, perf="bleu")
    with pytest.raises(ValueError, match="executor must be"):
        SwarmRuntime(_counting_worker, executor=None)

    def local_worker(system_prompt, task):
        yield
    with pytest.raises(TypeError, match="picklable"):
        SwarmRuntime(local_worker, executor="process")
    with pytest.raises(ValueError, match="serial_prior"):
        swarm.OrchestratorPolicy(serial_prior=1.0)


def test_thread_pool_and_inline_runs_leave_the_same_step_accounting():
    task = make_task(random.Random(9), "lookup", 20)
    inline = run_episode(task, lambda f: N_CHOICES.index(6), executor="inline")
    threaded = run_episode(task, lambda f: N_CHOICES.index(6), executor="thread")
    assert inline["answer"] == threaded["answer"] and inline["f1"] == 1.0
    assert (inline["critical"], inline["total"]) == (threaded["critical"], threaded["total"])
    assert [[r.steps for r in s.runs] for s in inline["trace"].stages] == \
        [[r.steps for r in s.runs] for s in threaded["trace"].stages]
