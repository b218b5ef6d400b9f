"""Tests for the long-context pieces: the synthetic tasks of experiments/long_context.py, the preallocated
attention KV cache in model.py (bytes equal the formula; growth past its capacity keeps decoding exact),
and both experiment scripts' --quick runs (seconds)."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, assert_close

sys.path.insert(0, os.path.join(ROOT, "experiments"))
import decode_cost  # noqa: E402
import long_context  # noqa: E402
from model import GPT, Config  # noqa: E402


def test_mqar_targets_are_the_values_of_the_queried_keys():
    rng = np.random.default_rng(0)
    inputs, targets = long_context.mqar_batch(rng, 4, 97, n_pairs=12, n_keys=20, n_values=30)
    for x, y in zip(inputs, targets):
        keys, values = x[0:24:2], x[1:24:2]                          # the context: every pair once
        assert len(set(keys)) == 12 and keys.min() >= 1 and keys.max() <= 20
        assert values.min() >= 21 and values.max() <= 50
        assert (y[:24] == -1).all() and (y[1::2] == -1).all()       # no loss in the context or at values
        lookup = dict(zip(keys, values))
        where = np.flatnonzero(y >= 0)
        assert list(where) == list(range(24, 96, 2))                # every later key is a query
        assert all(y[p] == lookup[x[p]] and x[p + 1] == lookup[x[p]] for p in where)
        assert x[96] == 0                                            # odd T: one filler at the end
    with pytest.raises(ValueError, match="pairs need"):
        long_context.mqar_batch(rng, 1, 24, n_pairs=12, n_keys=20, n_values=30)


@pytest.mark.parametrize("T", [2, 9, 64])
def test_palindrome_targets_are_the_reversed_sequence(T):
    rng = np.random.default_rng(2)
    inputs, targets = long_context.palindrome_batch(rng, 5, T, n_symbols=7)
    L = T // 2
    assert inputs.shape == targets.shape == (5, T)
    for x, y in zip(inputs, targets):
        first = list(x[:L])
        assert min(first) >= 1 and max(first) <= 7 and x[L] == 0      # the symbols, then the separator
        assert list(y[L:2 * L]) == first[::-1]                        # the answer: the first half reversed
        assert (y[:L] == -1).all() and (y[2 * L:] == -1).all()        # no loss on the question (or a filler)
        assert list(x[L + 1:2 * L]) == list(y[L:2 * L - 1])           # teacher forcing: input = previous target
        assert T % 2 == 0 or x[-1] == 0
    with pytest.raises(ValueError, match="T must be >= 2"):
        long_context.palindrome_batch(rng, 1, 1, n_symbols=7)


class _Oracle(torch.nn.Module):
    """Predicts `guess` (one-hot logits) for the rows it is shown, in order: what the scorer under test sees."""

    def __init__(self, guess, vocab):
        super().__init__()
        self.guess, self.vocab, self.row = torch.from_numpy(guess), vocab, 0

    def forward(self, x):
        rows = self.guess[self.row:self.row + len(x)]
        self.row += len(x)
        return torch.nn.functional.one_hot(rows, self.vocab).float(), None


def test_palindrome_accuracy_counts_only_the_answer_tokens():
    inputs, targets = long_context.palindrome_batch(np.random.default_rng(3), 4, 41, n_symbols=5)
    guess = np.where(targets >= 0, targets, 0)                       # right on every answer token ...
    answer = np.flatnonzero(targets[0] >= 0)                          # positions 20..39
    guess[:, answer[:5]] = (targets[:, answer[:5]] % 5) + 1           # ... except the first 5 of 20: wrong
    assert (guess[:, answer[:5]] != targets[:, answer[:5]]).all()
    guess[:, :20] = 3                                                 # the question part: never scored
    acc = long_context.accuracy(_Oracle(guess, 6), {41: (inputs, targets)}, batch_size=3)
    assert acc[41] == pytest.approx(15 / 20)


def test_stack_targets_are_last_in_first_out():
    rng = np.random.default_rng(1)
    inputs, targets = long_context.stack_batch(rng, 3, 200, n_symbols=5, push_prob=0.6)
    for x, y in zip(inputs, targets):
        stack = []
        for token, target in zip(x, y):
            if token > 0:
                assert target == -1
                stack.append(token)
            else:
                assert target == stack.pop()                         # a POP never hits an empty stack
        assert (y >= 0).sum() > 20


@pytest.mark.parametrize("pattern,n_kv_head", [("A", 0), ("KKKA", 2), ("K", 0)])
def test_cache_bytes_match_the_formula(pattern, n_kv_head):
    cfg = Config(vocab_size=50, block_size=32, n_layer=4, n_head=4, n_kv_head=n_kv_head, n_embd=32, pattern=pattern)
    m = GPT(cfg).eval()
    caches = [dict(max_len=21) for _ in m.blocks]
    with torch.no_grad():
        m(torch.randint(0, 50, (3, 17)), caches=caches)
        for _ in range(4):
            m(torch.randint(0, 50, (3, 1)), caches=caches)
    expected = decode_cost.cache_bytes_formula(cfg, 3, 21, torch.float32)
    assert decode_cost.cache_bytes(caches) == expected
    # by hand for the attention layers: K and V of 21 tokens, Hkv heads of dim 8, 4 bytes each
    hkv = n_kv_head or 4
    per_attention = 2 * 3 * hkv * 21 * 8 * 4
    per_kda = 3 * 4 * 8 * 8 * 4 + 3 * 3 * 32 * 3 * 4
    assert expected == pattern.count("A") * (4 // len(pattern)) * per_attention + \
        cfg.layer_kinds.count("K") * per_kda


def test_attention_cache_grows_past_its_capacity_and_stays_exact():
    torch.manual_seed(0)
    cfg = Config(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, pattern="A")
    m = GPT(cfg).eval()
    idx = torch.randint(0, 50, (2, 30))
    caches = [dict(max_len=4) for _ in m.blocks]                    # too small: must double 4 -> 8 -> 16 -> 32
    with torch.no_grad():
        full, _ = m(idx)
        parts = [m(idx[:, :3], caches=caches)[0]]
        parts += [m(idx[:, t:t + 1], caches=caches)[0] for t in range(3, 20)]
        parts.append(m(idx[:, 20:], caches=caches)[0])              # a multi-token chunk after the cache
    assert_close(full, torch.cat(parts, dim=1), 1e-5, "decoded logits")
    assert caches[0]["len"] == 30 and caches[0]["k"].shape == (2, 2, 32, 8)
    with pytest.raises(ValueError, match="cache holds batch 2"):
        m(idx[:1, :1], caches=caches)


def test_long_context_quick_run_writes_figure_and_table(tmp_path):
    long_context.main(["--quick", "--threads", "1", "--out_dir", str(tmp_path)])
    assert (tmp_path / "long_context.png").stat().st_size > 10_000
    table = (tmp_path / "long_context.md").read_text()
    arms = ("K", "K-head", "K-safe", "A", "KKKA")
    for arm in arms:
        assert table.count(f"`{arm}`") == 3                           # one row per task
    assert "**Palindrome" in table
    runs = json.loads((tmp_path / "long_context.json").read_text())["runs"]
    assert {(r["task"], r["arm"]) for r in runs} == {(t, a) for t in ("mqar", "stack", "palindrome") for a in arms}
    params = {r["arm"]: r["n_params"] for r in runs if r["task"] == "mqar"}
    assert params["K"] > params["K-head"]                          # the channel gate's larger projection
    assert params["K"] == params["K-safe"]                         # the safe gate: same shapes, other function
    assert all(0 <= a <= 1 for r in runs for a in r["final"].values())


def test_decode_cost_quick_run_measures_every_pattern(tmp_path):
    rows = decode_cost.main(["--quick", "--threads", "1", "--cpu", "--out_dir", str(tmp_path)])
    assert (tmp_path / "decode_cost.png").stat().st_size > 10_000
    by = {(r["pattern"], r["context"]): r for r in rows}
    assert by["K", 64]["cache_bytes"] == by["K", 256]["cache_bytes"]          # constant-size state
    assert by["A", 256]["cache_bytes"] > 3 * by["A", 64]["cache_bytes"]      # grows with the context
    assert by["KKKA", 256]["cache_bytes"] < by["A", 256]["cache_bytes"] / 2
    assert all(r["ms_median"] > 0 for r in rows)


def test_last_push_baseline_misses_pops_below_the_top():
    inputs = np.array([[3, 0, 5, 7, 0, 0]])                # push 3, pop, push 5, push 7, pop, pop
    targets = np.array([[-1, 3, -1, -1, 7, 5]])
    assert long_context.last_push_baseline({6: (inputs, targets)})[6] == pytest.approx(2 / 3)
