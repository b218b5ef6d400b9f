"""Test-only helpers for tests/test_swarm.py: what the swarm programs themselves never call."""
import random
import time

import torch

import swarm
from swarm_env import EnvConfig, serial_calls
from swarm_protocol import TOK, VOCAB, CallParser, ProtocolError, encode_calls


def sleepy_worker(system_prompt: str, task: dict):
    """A worker whose steps just wait (stands in for tool latency): real overlap shows in wall time.
    Module level so a process pool can pickle it."""
    for _ in range(task["steps"]):
        yield
        time.sleep(task.get("sleep", 0.0))
    return system_prompt


def serial_trace(task: dict, rng: random.Random, cfg: EnvConfig = EnvConfig()) -> dict:
    """A single agent doing the work itself (swarm_env.serial_calls), as an episode."""
    return swarm.play(task, encode_calls(serial_calls(task, rng, cfg)), cfg)


def action_logprobs(model, episodes: list) -> torch.Tensor:
    """[E, T] log p of each target token under the grammar-masked policy; 0 at non-action tokens."""
    logp, y, act, _ = swarm._masked_logp(model, episodes)
    chosen = logp.gather(2, y[..., None]).squeeze(2)                               # [E, T]
    return torch.where(act, chosen, torch.zeros_like(chosen))


def from_text(text: str) -> list:
    """Inverse of swarm_protocol.render (brackets and line breaks ignored)."""
    words = text.replace("[", " ").replace("]", " ").split()
    if any(w not in TOK for w in words):
        raise ValueError(f"unknown token {next(w for w in words if w not in TOK)!r}")
    return [TOK[w] for w in words]


def parse_calls(ids, width: int) -> list:
    """A whole stream of orchestrator tokens -> calls (strict: raises ProtocolError). Without an
    environment it assumes every item handed out comes back (nothing is put back on `open`)."""
    parser = CallParser(width)
    calls = [c for c in map(parser.feed, ids) if c is not None]
    if parser.partial:
        raise ProtocolError(f"stream ends inside a call: {' '.join(VOCAB[x] for x in parser.partial)}")
    return calls
