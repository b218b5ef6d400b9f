"""Tests for the Agent Swarm: the runtime (swarm_runtime.py), the environment (swarm_env.py), and the LM
orchestrator with its token protocol and PARL (swarm.py). CPU only; well under a minute in all."""
import concurrent.futures as cf
import json
import math
import os
import random
import time

import pytest
import torch

import swarm
from model import GPT
from swarm import lambda_schedule, parl_reward, play
from swarm_helpers import action_logprobs, from_text, parse_calls, serial_trace, sleepy_worker
from swarm_protocol import MAX_NUM, ROLE_TOKENS, TOK, VOCAB, ProtocolError, encode_call, render, tok_num
from swarm_env import ROLES, EnvConfig, item_f1, make_task, sample_tasks, scripted_worker, subtask
from swarm_runtime import Stage, SubagentRun, SwarmRuntime, Trace, run_subagent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _counting_worker(system_prompt, task):
    for _ in range(task["steps"]):
        yield
    return {"done": task["steps"]}


def _stream(calls):
    return [t for call in calls for t in encode_call(call)]


def _tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(swarm.orchestrator_config(**overrides))


# --- runtime: critical steps vs total steps, budgets, real concurrency --------------------------------

def _trace(*stages):
    """(main steps, [sub-agent steps]) per stage -> a Trace."""
    return Trace([Stage(main, [SubagentRun(f"a{i}", "", None, steps=n) for i, n in enumerate(subs)])
                  for main, subs in stages])


def test_critical_and_total_steps_on_hand_built_stages():
    trace = _trace((1, [3, 5]), (1, [2]))
    assert trace.critical_steps == (1 + 5) + (1 + 2) == 9
    assert trace.total_steps == 1 + 3 + 5 + 1 + 2 == 12
    trace = _trace((2, []), (1, [1, 1, 7, 1]), (3, [4]))
    assert trace.critical_steps == 2 + 8 + 7
    assert trace.total_steps == 2 + 1 + 10 + 3 + 4
    trace = _trace((1, [3, 5]), (2, []))
    assert trace.critical_steps == 8 and trace.stages[0].critical_steps == 6 and trace.total_steps == 11


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


def test_subagents_overlap_in_time_on_the_thread_pool():
    # each worker waits ~0.8 s (serially 8x that): long enough that all 8 start before one ends even
    # when a loaded machine delays thread start-up
    n, steps, sleep = 8, 4, 0.2
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


def test_subagents_overlap_in_time_on_a_shared_process_pool():
    with cf.ProcessPoolExecutor(2) as pool:            # an Executor passed in, as bench.py does
        rt = SwarmRuntime(sleepy_worker, executor=pool)
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


def test_runtime_rejects_bad_input_with_clear_errors():
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


# --- environment -------------------------------------------------------------------------------------

def test_scripted_subagents_are_frozen_and_follow_their_role():
    task = make_task(random.Random(5), "lookup", 4)
    sub = subtask(task, range(4))
    steps, finished, msg, _, _, _ = run_subagent(scripted_worker, ROLES["researcher"], sub, budget=100)
    assert finished and msg == task["gold"] and 2 * 4 <= steps <= 4 * 4
    for role in ("coder", "fact-checker"):              # roles that fit neither task bring nothing back
        steps, finished, msg, _, _, _ = run_subagent(scripted_worker, ROLES[role], sub, budget=100)
        assert (steps, finished, msg) == (1, True, {})
    # a chain: a range that does not start at the known frontier cannot begin
    chain = make_task(random.Random(6), "chain", 5)
    _, _, msg, _, _, _ = run_subagent(scripted_worker, ROLES["researcher"], subtask(chain, [2, 3, 4], None), 100)
    assert msg == {}
    _, _, msg, _, _, _ = run_subagent(scripted_worker, ROLES["researcher"], subtask(chain, range(5), chain["start"]), 100)
    assert msg == chain["gold"]
    with pytest.raises(ValueError, match="consecutive"):
        subtask(chain, [0, 2])


def test_item_f1():
    gold = {"a": 1, "b": 2, "c": 3, "d": 4}
    assert item_f1(gold, gold) == 1.0 and item_f1({}, gold) == 0.0
    assert item_f1({"a": 1, "b": 2}, gold) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert item_f1({"a": 1, "b": 0}, gold) == pytest.approx(2 * 0.5 * 0.25 / 0.75)


# --- PARL reward terms -------------------------------------------------------------------------------

def _episode(right=1, of=3, n_created=0, n_assigned=0, n_finished=0):
    """`right` of `of` items answered, all before any budget: r_perf = item-F1 = 2 right / (right + of)."""
    return {"task": {"gold": {i: i for i in range(of)}}, "answer": {i: i for i in range(right)},
            "arrived": {i: 0 for i in range(right)},
            "n_created": n_created, "n_assigned": n_assigned, "n_finished": n_finished}


def test_reward_terms_on_crafted_episodes():
    r = parl_reward(_episode(), 0.2, 0.4)                                 # item-F1 0.5
    assert r["r_finish"] == 0 and r["r_parallel"] == 0 and r["r"] == pytest.approx(0.5)
    r = parl_reward(_episode(n_created=8, n_assigned=8, n_finished=0), 0.2, 0.4)
    assert r["r_finish"] == 0 and r["r_parallel"] == pytest.approx(0.5)
    assert r["r"] == pytest.approx(0.2 * 0.5 + 0.5)
    r = parl_reward(_episode(right=3, n_created=64, n_assigned=64, n_finished=16), 0.2, 0.4)
    assert r["r_parallel"] == 1.0 and r["r_finish"] == pytest.approx(0.25) and r["r_perf"] == pytest.approx(1.0)
    # agents created but never given a task count as unfinished (spawning idle agents does not pay r_finish)
    idle = dict(_episode(n_created=10, n_assigned=2, n_finished=2), n_idle=8)
    assert parl_reward(idle, 0.0, 1.0)["r_finish"] == pytest.approx(0.2)


def test_budgeted_reward_is_item_f1_under_a_random_critical_budget():
    """r_perf = the mean over budgets B = 10..40 of the item-F1 of the facts that had arrived by step B:
    the same answer is worth less the later it arrives."""
    assert (EnvConfig.train_budget_min, EnvConfig.critical_budget) == (10, 40)
    task = make_task(random.Random(4), "lookup", 4)
    gold = task["gold"]
    first_two = dict(list(gold.items())[:2])

    def episode(arrived):
        return {**_episode(), "task": task, "answer": dict(gold), "arrived": arrived}
    at = lambda step: {k: step for k in gold}                              # noqa: E731
    assert parl_reward(episode(at(5)), 0, 0)["r_perf"] == pytest.approx(1.0)      # before every budget
    assert parl_reward(episode(at(10)), 0, 0)["r_perf"] == pytest.approx(1.0)
    assert parl_reward(episode(at(25)), 0, 0)["r_perf"] == pytest.approx(16 / 31)  # B = 25..40 of 10..40
    assert parl_reward(episode(at(40)), 0, 0)["r_perf"] == pytest.approx(1 / 31)
    split = {k: (5 if k in first_two else 30) for k in gold}                  # half at step 5, half at 30
    half = item_f1(first_two, gold)
    assert parl_reward(episode(split), 0, 0)["r_perf"] == pytest.approx((20 * half + 11 * 1.0) / 31)
    every_budget = EnvConfig(train_budget_min=1)                                 # B = 1..40
    assert parl_reward(episode(at(25)), 0, 0, cfg=every_budget)["r_perf"] == pytest.approx(16 / 40)


def _item_cost(task, i):
    """Critical steps a single agent spends on item i (search, then read until the fact)."""
    return run_subagent(scripted_worker, ROLES["researcher"], subtask(task, [i]), 100)[0]


def _best_serial_calls(task):
    """The best a single agent can do: one item per call, in order, while the item still fits the budget
    with a step to spare for the reply (an oracle: it knows each item's cost in advance)."""
    calls, t = [], 0
    for i in range(task["width"]):
        if t + _item_cost(task, i) > EnvConfig.critical_budget - 1:
            break
        t += _item_cost(task, i)
        calls.append(("self", 1))
    return calls + [("answer",)]


def _split_calls(task, n, role="researcher"):
    """n sub-agents of one role, the items cut into n near-equal counts, one wait, answer."""
    W = task["width"]
    k = min(n, W)
    return [("create", role, k)] + [("assign", i, W // k + (i < W % k)) for i in range(k)] + [("wait",), ("answer",)]


def test_a_hand_written_parallel_episode_beats_the_best_serial_one_under_the_budgets():
    """Under the 40-step critical budget and the 24-step sub-agent cap, 16 researchers on near-equal
    ranges answer every wide task in full in a third of the critical steps, while the best single agent
    runs out of budget: the environment lets a decomposition pay, so PARL has something to find."""
    tasks = [make_task(random.Random(100 + i), "lookup", w) for i, w in enumerate(range(12, 49, 3))]
    par, ser = [], []
    for task in tasks:
        p, s = play(task, _stream(_split_calls(task, 16))), play(task, _stream(_best_serial_calls(task)))
        assert p["answered"] and s["answered"] and p["n_finished"] == p["n_assigned"] == min(16, task["width"])
        assert p["f1"] == 1.0 and p["critical"] <= 15 and s["critical"] <= EnvConfig.critical_budget
        for lam in ((0.0, 0.0), (0.2, 0.4)):                          # outcome only, and PARL's initial weights
            assert parl_reward(p, *lam)["r"] >= parl_reward(s, *lam)["r"]
        margin = parl_reward(p, 0, 0)["r"] - parl_reward(s, 0, 0)["r"]     # a single agent cannot finish these
        assert margin >= (0.3 if task["width"] >= 30 else 0.15 if task["width"] >= 21 else 0.0), (task["width"], s["f1"])
        par.append(p)
        ser.append(s)
    mean = lambda eps, k: sum(ep[k] for ep in eps) / len(eps)             # noqa: E731
    assert mean(par, "f1") - mean(ser, "f1") >= 0.2
    assert mean(par, "critical") * 3 <= mean(ser, "critical")
    # the budgets bind: one more item than the oracle's loses the serial answer, and 4 agents with 12
    # items each (up to 48 steps of work) are cut off at their 24-step cap and bring nothing back
    task = make_task(random.Random(7), "lookup", 48)
    one_more = _best_serial_calls(task)[:-1]
    one_more.append(("self", 1))
    assert play(task, _stream(one_more + [("answer",)]))["f1"] == 0.0
    few = play(task, _stream(_split_calls(task, 4)))
    assert few["n_finished"] < 4 and few["f1"] < 1.0


def test_lambdas_anneal_to_zero_then_only_the_outcome_pays():
    total, frac = 100, 0.6
    assert lambda_schedule(0, total, 0.3, frac) == pytest.approx(0.3)
    assert lambda_schedule(30, total, 0.3, frac) == pytest.approx(0.15)
    for u in (60, 61, 99):
        assert lambda_schedule(u, total, 0.3, frac) == 0.0
    assert lambda_schedule(99, total, 0.3, None) == 0.3
    with pytest.raises(ValueError, match="anneal_frac"):
        lambda_schedule(1, 10, 0.1, 0.0)


def test_group_advantages_are_centred_and_scaled_per_task():
    r = torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0, 1.0, 0.3, 0.3, 0.3])
    centred = (r.view(3, 3) - r.view(3, 3).mean(1, keepdim=True)).view(-1)
    assert torch.allclose(centred, torch.tensor([0.0, -1.0, 1.0, -0.667, 2.333, -1.667, 0, 0, 0]), atol=1e-3)
    adv = swarm.group_advantages(r, 3)                 # divided by each group's (sample) std
    assert torch.allclose(adv[:3], torch.tensor([0.0, -1.0, 1.0]) / (1.0 + 1e-3), atol=1e-5)
    assert torch.allclose(adv[3:6], centred[3:6] / (torch.tensor([2.0, 5.0, 1.0]).std() + 1e-3), atol=1e-5)
    assert torch.equal(adv[6:], torch.zeros(3))       # all equal: nothing to prefer
    # a task whose rewards are 10x smaller weighs the same once scaled
    assert torch.allclose(swarm.group_advantages(r[:3] / 10, 3), adv[:3], atol=1e-2)
    with pytest.raises(ValueError, match="groups of 4"):
        swarm.group_advantages(torch.zeros(6), 4)


# --- the token protocol ------------------------------------------------------------------------------

def test_protocol_round_trips_render_and_parse():
    rng = random.Random(0)
    for _ in range(50):
        width = rng.randint(1, 48)
        calls, n, busy, left = [], 0, set(), width      # left: open items (parse_calls: all come back)
        for _ in range(rng.randint(1, 12)):
            kind = rng.choice(["create", "assign", "self", "wait"])
            if kind == "create" and n < 16:
                calls.append(("create", rng.choice(ROLE_TOKENS), rng.randint(1, 16 - n)))
                n += calls[-1][2]
            elif kind == "assign" and len(busy) < n and left:
                k = rng.choice([i for i in range(n) if i not in busy])
                calls.append(("assign", k, rng.randint(1, left)))
                left -= calls[-1][2]
                busy.add(k)
            elif kind == "wait" and busy:
                calls.append(("wait",))
                busy = set()
            elif kind == "self" and not busy and left:
                calls.append(("self", rng.randint(1, left)))
                left -= calls[-1][1]
        calls.append(("answer",))
        ids = _stream(calls)
        assert from_text(render(ids)) == ids
        assert parse_calls(ids, width) == calls
    assert render(_stream([("assign", 3, 11)])) == "<assign> a3 11"


@pytest.mark.parametrize("text, message", [
    ("<assign> a0 1", "no free agent"),
    ("<create> researcher 1 <assign> a1 1", "unknown agent a1"),
    ("<create> researcher 1 <assign> a0 1 <assign> a0 2", "no free agent"),
    ("<create> coder 2 <assign> a0 1 <assign> a0", "a0 is already busy"),
    ("<self> 0", "a count must be 1..5"),
    ("<self> 9", "got 9"),
    ("<create> coder 1 <create> coder 1 <assign> a0 3 <assign> a1 3", "a count must be 1..2"),
    ("<create> coder 2 <assign> a0 5 <assign>", "<assign> with no open item"),
    ("<self> 5 <self>", "<self> with no open item"),
    ("<create> 7", "expected a role"),
    ("<create> coder 12 <create> coder 5", "a number of agents must be 1..4, got 5"),
    ("<create> coder 16 <create>", "already 16 agents"),
    ("<create> coder <assign>", "expected a number of agents"),
    ("<wait>", "nothing assigned"),
    ("<create> researcher 1 <assign> a0 1 <self> 2", "<wait> for them first"),
    ("3 <answer>", "expected a call"),
    ("<res> me 2", "written by the environment"),
])
def test_malformed_calls_cost_the_episode_not_the_process(text, message):
    ids = from_text(text)
    with pytest.raises(ProtocolError, match=message):
        parse_calls(ids, width=5)
    task = make_task(random.Random(0), "lookup", 5)
    ep = play(task, ids)                           # the same stream played: the episode ends, no exception
    assert message in ep["error"] and ep["tokens"][-1] == TOK["<err>"]
    assert ep["f1"] == 0.0 and ep["answer"] == {} and not ep["answered"]
    with pytest.raises(ProtocolError, match="ends inside a call"):
        parse_calls(from_text("<create> researcher 2 <assign> a0"), width=5)


def test_a_scripted_token_stream_drives_the_runtime_to_the_same_trace_as_the_api():
    task = make_task(random.Random(11), "lookup", 14)
    calls = ([("create", "researcher", 3), ("create", "coder", 1)]
             + [("assign", 0, 5), ("assign", 1, 5), ("assign", 3, 4), ("wait",)]       # the coder's 4 come back open
             + [("assign", 2, 2), ("wait",), ("self", 2), ("answer",)])
    ep = play(task, _stream(calls))
    # the same episode written against the runtime's Python API
    rt = SwarmRuntime(scripted_worker, sub_step_budget=EnvConfig.sub_step_budget, executor="inline")
    for role in ["researcher"] * 3 + ["coder"]:
        rt.create_subagent(f"a{len(rt.agents)}", ROLES[role])
    for name, idx in zip(["a0", "a1", "a3"], [range(0, 5), range(5, 10), range(10, 14)]):
        rt.assign_task(name, subtask(task, idx), budget=EnvConfig.critical_budget - 1)
    first = rt.gather()
    t = rt.trace.critical_steps
    rt.assign_task("a2", subtask(task, [10, 11]), budget=EnvConfig.critical_budget - t - 1)
    rt.gather()
    for i in (12, 13):                              # <self> 2: one item per call, each step a main step
        steps = run_subagent(scripted_worker, ROLES["researcher"], subtask(task, [i]), 100)[0]
        rt.main_step(steps)
    trace = rt.answer(None)

    def shape(tr):
        return [(s.main_steps, [(r.agent, r.steps, r.finished, r.message) for r in s.runs]) for s in tr.stages]
    assert shape(ep["trace"]) == shape(trace)
    assert ep["critical"] == trace.critical_steps and ep["total"] == trace.total_steps
    assert ep["f1"] == 1.0 and ep["answered"]
    assert first[2].message == {}                   # the coder's role does not fit: it brings nothing back
    assert ep["n_assigned"] == 4 and ep["n_finished"] == 3
    # the results came back as environment tokens, which the orchestrator did not write
    text = render(ep["tokens"], ep["is_action"])
    assert "<wait> [<res> a0 5 <res> a1 5 <res> a3 0 @" in text
    assert sum(ep["is_action"]) == len(_stream(calls))


def test_budget_run_out_before_answer_loses_the_answer():
    task = make_task(random.Random(2), "lookup", 30)
    ep = play(task, _stream([("self", 30), ("answer",)]))   # a single agent cannot do 30 items in 40 steps
    assert ep["tokens"][-1] == TOK["<end>"] and not ep["answered"] and ep["f1"] == 0.0
    assert ep["critical"] == ep["clock"] >= EnvConfig.critical_budget - 3
    trace = serial_trace(task, random.Random(0))         # the SFT traces answer before the clock runs out
    assert trace["answered"] and 0.4 < trace["f1"] < 1 and trace["n_created"] == 0
    assert all(VOCAB[t] != "<create>" for t in trace["tokens"])


# --- the orchestrator model ------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", ["A", "KA"])
def test_padded_chunks_decode_each_row_as_if_alone(pattern):
    """model.GPT.forward(valid=...): rows of different lengths through one cache equal each row alone."""
    model = _tiny_model(pattern=pattern).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [(5, 1, 3, 1), (2, 4, 1, 1), (1, 1, 6, 2)]
    seqs = [[torch.randint(0, len(VOCAB), (n,), generator=g) for n in row] for row in lengths]
    caches = [dict() for _ in model.blocks]
    got = [[] for _ in seqs]
    with torch.no_grad():
        for c in range(4):
            T = max(len(s[c]) for s in seqs)
            idx = torch.zeros(len(seqs), T, dtype=torch.long)
            valid = torch.zeros(len(seqs), T, dtype=torch.bool)
            for r, s in enumerate(seqs):
                idx[r, :len(s[c])], valid[r, :len(s[c])] = s[c], True
            logits, _ = model(idx, caches=caches, valid=valid)
            for r, s in enumerate(seqs):
                got[r].append(logits[r, :len(s[c])])
        for r, s in enumerate(seqs):
            alone, _ = model(torch.cat(s)[None])
            assert torch.allclose(torch.cat(got[r]), alone[0], atol=1e-5), f"row {r} differs"
    with pytest.raises(ValueError, match="needs caches"):
        model(idx, valid=valid)


def test_batched_episodes_equal_per_episode_decoding():
    model = _tiny_model(seed=1)
    tasks = [make_task(random.Random(i), fam, w) for i, (fam, w) in
             enumerate([("lookup", 2), ("lookup", 17), ("chain", 5), ("lookup", 40), ("chain", 3)])]
    batched = swarm.rollout(model, tasks, greedy=True)
    for task, b in zip(tasks, batched):
        alone = swarm.rollout(model, [task], greedy=True)[0]
        assert alone["tokens"] == b["tokens"]
    assert len({len(b["tokens"]) for b in batched}) > 1          # the episodes really had different lengths
    # sampling: the per-token log-probs the training loss sees match a row decoded alone (same tokens fed)
    eps = swarm.rollout(model, tasks, generator=torch.Generator().manual_seed(0))
    lp_batch = action_logprobs(model, eps)
    for e, ep in enumerate(eps):
        lp_alone = action_logprobs(model, [ep])
        n = lp_alone.shape[1]
        assert torch.allclose(lp_batch[e, :n], lp_alone[0], atol=1e-5)


def test_parl_loss_masks_prompt_and_environment_tokens():
    model = _tiny_model()
    task = make_task(random.Random(4), "lookup", 6)
    calls = [("create", "researcher", 2), ("assign", 0, 3), ("assign", 1, 3),
             ("wait",), ("answer",)]
    ep = play(task, _stream(calls))
    env = [i for i, a in enumerate(ep["is_action"]) if not a]
    assert [VOCAB[ep["tokens"][i]] for i in env[5:]] == ["<res>", "a0", "3", "<res>", "a1", "3", "@", str(ep["clock"])]
    lp = action_logprobs(model, [ep])[0]                   # position i predicts token i + 1
    for i in env[1:]:
        assert lp[i - 1] == 0.0, f"environment token {VOCAB[ep['tokens'][i]]} at {i} carries loss"
    # the loss is -A * (sum of the orchestrator tokens' log-probs under the grammar mask), computed by hand
    x = torch.tensor(ep["tokens"])[None]
    logits, _ = model(x[:, :-1])
    manual, entropy = 0.0, 0.0
    actions = [i for i, a in enumerate(ep["is_action"]) if a]
    for i, legal in zip(actions, ep["legal"]):
        masked = torch.full_like(logits[0, i - 1], float("-inf"))
        masked[legal] = logits[0, i - 1, legal]
        manual = manual + torch.log_softmax(masked, -1)[ep["tokens"][i]]
        p = torch.softmax(logits[0, i - 1, legal], -1)
        entropy = entropy - (p * p.log()).sum()
    loss = swarm.parl_loss(model, [ep], torch.tensor([0.7]))         # per orchestrator token
    assert loss.item() == pytest.approx(-0.7 * manual.item() / len(actions), rel=1e-5)
    # the entropy bonus: the mean entropy of the grammar-masked policy over the orchestrator's tokens
    with_bonus = swarm.parl_loss(model, [ep], torch.tensor([0.7]), entropy_coef=0.1)
    assert with_bonus.item() == pytest.approx(loss.item() - 0.1 * entropy.item() / len(actions), rel=1e-5)
    # two episodes: each token weighs 1 / (all orchestrator tokens), however long its episode
    short = play(task, _stream([("self", 2), ("answer",)]))
    both = swarm.parl_loss(model, [ep, short], torch.tensor([0.7, -0.4]))
    lp_short = action_logprobs(model, [short])[0].sum()
    n = len(actions) + sum(short["is_action"])
    assert both.item() == pytest.approx(-(0.7 * manual.item() - 0.4 * lp_short.item()) / n, rel=1e-4)
    # changing what the environment said changes no loss term of its own: only the orchestrator's tokens count
    assert int((lp != 0).sum()) <= len(actions)


def test_critical_steps_of_an_lm_driven_episode_match_the_trace():
    model = _tiny_model(seed=2)
    tasks = sample_tasks(random.Random(3), 24)
    # a few steps on decomposition traces only, so that sampled episodes delegate often
    swarm.train_sft(model, tasks, steps=15, batch=16, lr=1e-2, decomp_frac=1.0)
    eps = swarm.rollout(model, tasks, generator=torch.Generator().manual_seed(0))
    delegated = 0
    for ep in eps:
        stages = ep["trace"].stages
        by_hand = sum(s.main_steps + max((r.steps for r in s.runs), default=0) for s in stages)
        assert ep["critical"] == by_hand == ep["clock"]
        clocks = [ep["tokens"][i + 1] for i, t in enumerate(ep["tokens"][:-1]) if t == TOK["@"]]
        if clocks and not ep["trace"].stages[-1].runs:
            assert tok_num(clocks[-1]) == min(ep["clock"], MAX_NUM) or not ep["answered"]
        delegated += any(len(s.runs) >= 2 for s in stages)
        assert ep["error"] is None
    assert delegated >= 3, "too few delegating episodes for the check to mean anything"


def test_a_short_parl_run_raises_reward_on_a_tiny_task_set():
    model = _tiny_model(seed=0)
    tasks = [make_task(random.Random(i), "lookup", 2 + i % 3) for i in range(6)]
    gen = torch.Generator().manual_seed(123)

    def mean_reward():
        eps = swarm.rollout(model, [t for t in tasks for _ in range(8)], generator=gen)
        return sum(parl_reward(ep, 0.0, 0.0)["r"] for ep in eps) / len(eps)

    before = mean_reward()
    swarm.train_parl(model, tasks, updates=12, arm=swarm.Arm(True), tasks_per_update=6, group_size=8,
                     lr=1e-2, seed=0)
    after = mean_reward()
    assert after > before + 0.15, f"reward {before:.3f} -> {after:.3f}"


def test_sft_warm_start_learns_the_serial_prior():
    model = _tiny_model(seed=0)
    tasks = sample_tasks(random.Random(0), 40)
    losses = swarm.train_sft(model, tasks, steps=25, batch=16, lr=1e-2, decomp_frac=0.0)
    assert losses[-1] < 0.7 * losses[0]
    ep = swarm.rollout(model, [make_task(random.Random(9), "lookup", 3)], greedy=True)[0]
    assert ep["calls"][0][0] == "self" and ep["n_created"] == 0


def test_decomposition_traces_are_legal_varied_and_some_pay():
    """The warm start's decomposition traces: every one a legal episode; 2-16 agents; on wide lookups
    some cover every item and beat a single agent's serial trace, and others do not pay (a cut too
    coarse for the step cap, a wrong role, a range left out)."""
    from swarm_env import decompose_calls, task_kind
    rng = random.Random(0)
    tasks = sample_tasks(random.Random(5), 120)
    wide_better = wide_worse = 0
    for task in tasks:
        calls = decompose_calls(task, rng)
        ep = play(task, _stream(calls))
        assert ep["error"] is None and ep["answered"]
        assert 2 <= ep["n_created"] <= 16 and calls[-1] == ("answer",)
        if task_kind(task) == "wide":
            serial = serial_trace(task, random.Random(1))
            wide_better += ep["f1"] > serial["f1"] + 0.2 and ep["critical"] * 2 < serial["critical"]
            wide_worse += ep["f1"] < serial["f1"]
    assert wide_better >= 5 and wide_worse >= 5, (wide_better, wide_worse)


def test_solo_rollouts_have_no_sub_agent_tools():
    model = _tiny_model(seed=2)
    tasks = sample_tasks(random.Random(3), 12)
    swarm.train_sft(model, tasks, steps=10, batch=8, lr=1e-2, decomp_frac=1.0)   # it would delegate
    eps = swarm.rollout(model, tasks, generator=torch.Generator().manual_seed(0), solo=True)
    assert all(ep["n_created"] == 0 and ep["error"] is None for ep in eps)
    assert all(TOK["<create>"] not in legal for ep in eps for legal in ep["legal"])
    free = swarm.rollout(model, tasks, generator=torch.Generator().manual_seed(0))   # same model, tools on
    assert sum(ep["n_created"] > 0 for ep in free) >= 3


def test_session_hands_out_open_items_by_count_and_rejects_bad_counts():
    """assign(k, n) takes the next n open items: never one already out in this stage or already found."""
    from swarm_env import Session
    task = make_task(random.Random(5), "lookup", 7)
    s = Session(task)
    s.create("researcher")
    s.create("researcher")
    assert s.assign(0, 3) and s.open_items() == [3, 4, 5, 6]
    assert s.assign(1, 4) and s.open_items() == []
    with pytest.raises(ValueError, match="count of 1..0"):
        s.assign(0, 1)
    s.wait()
    assert set(s.answer) == set(task["items"]) and s.open_items() == []
    s2 = Session(task)
    s2.create("researcher")
    with pytest.raises(ValueError, match=r"count of 1\.\.7 .*got 8"):
        s2.assign(0, 8)


# --- the multi-seed claims (experiments/swarm_parl.py): seed-paired, on records worked by hand --------

def _record(parl_need, parl_f1, single_f1, outcome_wide, fixed_idle, outcome_idle, parl_idle, serial_need=36):
    arm = lambda need, **summary: {"need": {"0.5": None, "0.7": need, "0.9": None}, "summary": summary}  # noqa: E731
    return {"serial, no budget": arm(serial_need),
            "single agent": arm(None, wide_f1=single_f1, wide_agents=0.0, narrow_idle=0.0),
            "outcome only": arm(36, wide_f1=0.7, wide_agents=outcome_wide, narrow_idle=outcome_idle),
            "outcome + fixed r_parallel": arm(11, wide_f1=1.0, wide_agents=16.0, narrow_idle=fixed_idle),
            "PARL, annealed": arm(parl_need, wide_f1=parl_f1, wide_agents=16.0, narrow_idle=parl_idle)}


def test_swarm_claims_are_seed_paired_comparisons_with_verdicts():
    import sys
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import swarm_parl
    records = {6: _record(12, 1.0, 0.70, 0.0, 15.0, 0.0, 2.0), 7: _record(10, 1.0, 0.65, 0.0, 14.0, 1.0, 1.0),
               8: _record(None, 0.6, 0.68, 2.0, 15.0, 15.0, 15.0)}        # seed 8: PARL never reaches F1 0.7
    rows = [(what.split(",")[0], p, sign, v) for _, what, p, sign, v in swarm_parl.claims(records)]
    assert [r[0] for r in rows] == ["critical steps to wide F1 0.7", "wide item-F1", "sub-agents per wide task",
                                    "idle sub-agents per narrow task", "idle sub-agents per narrow task"]
    (_, saving, s1, v1), (_, quality, s2, v2), (_, collapse, s3, v3), (_, breeds, s4, v4), (_, avoids, s5, v5) = rows
    assert saving.diffs == [12 - 36, 10 - 36, 41 - 36] and saving.holds(s1) == 2   # never reached: budget 40 + 1
    assert saving.diff == pytest.approx(-15) and saving.se == pytest.approx(math.sqrt(301 / 3))
    assert v1 == v2 == "does not reproduce"        # -15 is within 2 SE (20.0); the saving row needs both parts
    assert quality.diffs == pytest.approx([0.30, 0.35, -0.08])
    assert collapse.diffs == [-16.0, -16.0, -14.0] and collapse.holds(s3) == 3 and v3 == "reproduces"
    assert breeds.diffs == [15.0, 13.0, 0.0] and breeds.holds(s4) == 2 and v4 == "does not reproduce"
    assert avoids.diffs == [-13.0, -13.0, 0.0] and avoids.holds(s5) == 2
    table = swarm_parl.claims_table(records)
    assert "(judging seeds)" in table and table.count("**reproduces**") + table.count("**does not reproduce**") == 5
    assert "tuning seeds [3]" in swarm_parl.claims_table({3: records[6], 6: records[7]})


def test_swarm_parl_quick_run_writes_the_claims_table(tmp_path, monkeypatch):
    import runpy
    import sys
    monkeypatch.setattr(sys, "argv", ["swarm_parl.py", "--quick", f"--out_dir={tmp_path}"])
    runpy.run_path(os.path.join(ROOT, "experiments", "swarm_parl.py"), run_name="__main__")
    table = (tmp_path / "table.md").read_text()
    assert table.count("**reproduces**") + table.count("**does not reproduce**") == 5, table
    records = json.loads((tmp_path / "records.json").read_text())
    assert sorted(records["seeds"]) == ["6", "7"] and records["hp"]["n_eval"] == 9
    assert (tmp_path / "training.png").stat().st_size > 0
