"""The orchestrator's token protocol for swarm.py: an 84-token vocabulary, calls as tokens, the grammar.

    specials   <pad> <bos> <task> lookup chain | <create> researcher fact-checker coder <assign> <self>
               <wait> <answer> <res> me @ <end> <err>
    agents     a0 .. a15            the names create_subagent gives, in order
    numbers    0 .. 48              agent and item counts, task widths, fact counts, the clock

A call is ("create", role, m) | ("assign", k, n) | ("self", n) | ("wait",) | ("answer",). `<create> ROLE m`
makes m sub-agents at once (m create_subagent calls in one step), so how many to spawn is one choice
the orchestrator makes having read the task's width, not a run of tokens it has to count. A count takes
the next n open items (not found, not out in the open stage, in index order), so sub-agents never
overlap. `CallParser` reads tokens one at a time: `legal()` is the decoding mask, `feed()` returns each
finished call or raises ProtocolError with the reason.
"""
MAX_AGENTS, MAX_NUM = 16, 48
SPECIALS = ["<pad>", "<bos>", "<task>", "lookup", "chain", "|", "<create>", "researcher", "fact-checker", "coder",
            "<assign>", "<self>", "<wait>", "<answer>", "<res>", "me", "@", "<end>", "<err>"]
VOCAB = SPECIALS + [f"a{i}" for i in range(MAX_AGENTS)] + [str(n) for n in range(MAX_NUM + 1)]
TOK = {s: i for i, s in enumerate(VOCAB)}
PAD = TOK["<pad>"]
ROLE_TOKENS = ("researcher", "fact-checker", "coder")
ENV_ONLY = ("<bos>", "<task>", "lookup", "chain", "|", "<res>", "me", "@", "<end>", "<err>", "<pad>")
ARGS = {"<create>": ("role", "agents"), "<assign>": ("agent", "count"), "<self>": ("count",), "<wait>": (),
        "<answer>": ()}                         # each call's argument slots
CALLS = tuple(ARGS)
PROMPT_LEN = 5                                  # <bos> <task> FAMILY W |


def num_tok(n: int) -> int:
    if not 0 <= n <= MAX_NUM:
        raise ValueError(f"number {n} outside the protocol's 0..{MAX_NUM}")
    return TOK[str(n)]


def tok_num(t: int) -> int | None:
    """The number a token stands for, or None."""
    return int(VOCAB[t]) if VOCAB[t].isdigit() else None


def tok_agent(t: int) -> int | None:
    s = VOCAB[t]
    return int(s[1:]) if s[0] == "a" and s[1:].isdigit() else None


def encode_call(call: tuple) -> list:
    """("create", role, m) | ("assign", k, n) | ("self", n) | ("wait",) | ("answer",) -> token ids."""
    head = f"<{call[0]}>"
    if head not in ARGS or len(call) != 1 + len(ARGS[head]):
        raise ValueError(f"unknown call {call!r}")
    return [TOK[head]] + [TOK[v] if slot == "role" else TOK[f"a{v}"] if slot == "agent" else num_tok(v)
                          for slot, v in zip(ARGS[head], call[1:])]


def encode_calls(calls) -> list:
    return [t for call in calls for t in encode_call(call)]


def render(ids, is_action=None) -> str:
    """Token ids as text, a line per call. With is_action, each run of environment tokens after the
    prompt is shown in [brackets] on the line of the call it answers."""
    lines, env_open = [], False
    for i, t in enumerate(ids):
        s = VOCAB[t]
        env = is_action is not None and not is_action[i] and i >= PROMPT_LEN
        if env_open and not env:
            lines[-1][-1] += "]"
        if s in CALLS and not env or not lines:
            lines.append([])
        lines[-1].append("[" + s if env and not env_open else s)
        env_open = env
    return "\n".join(" ".join(words) for words in lines) + ("]" if env_open else "")


class ProtocolError(ValueError):
    """A malformed call. It ends the episode (reward 0), not the process."""


class CallParser:
    """Reads tokens one at a time, knowing what the runtime knows (width, agents, who is busy, `open`
    items); a count takes items off `open`, and Episode.step puts back those that did not come back."""

    def __init__(self, width: int, max_agents: int = MAX_AGENTS):
        self.width, self.max_agents = width, max_agents
        self.n_created, self.busy, self.stage_open = 0, set(), False
        self.open = width
        self.partial: list = []

    def legal(self) -> list:
        """Token ids that may come next."""
        p = self.partial
        if not p:
            ok = ["<answer>"] + ["<create>"] * (self.n_created < self.max_agents) \
                + ["<assign>"] * (len(self.busy) < self.n_created and self.open > 0) \
                + (["<wait>"] if self.stage_open else ["<self>"] * (self.open > 0))
            return [TOK[s] for s in ok]
        slot = ARGS[VOCAB[p[0]]][len(p) - 1]
        if slot == "role":
            return [TOK[r] for r in ROLE_TOKENS]
        if slot == "agent":
            return [TOK[f"a{k}"] for k in range(self.n_created) if k not in self.busy]
        if slot == "agents":
            return [num_tok(m) for m in range(1, self.max_agents - self.n_created + 1)]   # up to the cap
        return [num_tok(n) for n in range(1, min(self.open, MAX_NUM) + 1)]      # a count of open items

    def feed(self, t: int):
        """Add one token; returns the finished call tuple, or None while the call is incomplete."""
        if not 0 <= t < len(VOCAB):
            raise ProtocolError(f"token id {t} is not in the vocabulary")
        if VOCAB[t] in ENV_ONLY:
            raise ProtocolError(f"{VOCAB[t]} is written by the environment, not by the orchestrator")
        if t not in self.legal():
            raise ProtocolError(self._why(t))
        p = self.partial
        p.append(t)
        if len(p) <= len(ARGS[VOCAB[p[0]]]):
            return None
        kind, self.partial = VOCAB[p[0]][1:-1], []
        call = (kind,) + tuple(VOCAB[x] if VOCAB[x] in ROLE_TOKENS else int(VOCAB[x].lstrip("a")) for x in p[1:])
        if kind == "create":
            self.n_created += call[2]
        elif kind == "assign":
            self.busy.add(call[1])
            self.open -= call[2]
            self.stage_open = True
        elif kind == "self":
            self.open -= call[1]
        elif kind == "wait":
            self.busy, self.stage_open = set(), False
        return call

    def _why(self, t: int) -> str:
        s, p = VOCAB[t], self.partial
        if not p:
            if s in ("<assign>", "<self>") and self.open == 0:
                return f"{s} with no open item: every item is found or already out (<wait> or <answer>)"
            return {"<assign>": "<assign> with no free agent: <create> one first (or <wait> to free them)",
                    "<self>": "<self> while sub-agents are running: <wait> for them first",
                    "<wait>": "<wait> with nothing assigned",
                    "<create>": f"<create>: already {self.max_agents} agents"}.get(
                        s, f"expected a call ({', '.join(CALLS)}), got {s!r}")
        slot, where = ARGS[VOCAB[p[0]]][len(p) - 1], " ".join(VOCAB[x] for x in p + [t])
        k, n = tok_agent(t), tok_num(t)
        if slot == "role":
            return f"{where}: expected a role ({', '.join(ROLE_TOKENS)})"
        if slot == "agent" and k is None:
            return f"{where}: expected an agent name"
        if slot == "agent":
            return f"{where}: " + (f"unknown agent a{k} (created: {self.n_created})" if k >= self.n_created
                                   else f"a{k} is already busy in this stage")
        if slot == "agents":
            return f"{where}: " + ("expected a number of agents" if n is None else
                                   f"a number of agents must be 1..{self.max_agents - self.n_created}, got {n}")
        if n is None:
            return f"{where}: expected an item count"
        return f"{where}: a count must be 1..{self.open} (the items open), got {n}"
