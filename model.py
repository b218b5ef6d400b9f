"""The decoder: one Config, a layer pattern of KDA and attention layers, three kinds of residual.

    Config(pattern="A")      every layer is causal softmax attention (RoPE)
    Config(pattern="KKKA")   Kimi Linear's hybrid: 3 Kimi Delta Attention layers per attention layer,
                             attention without positional encoding (NoPE), as in arXiv 2510.26692
    Config(residual="attnres_block")   Attention Residuals (attnres.py) instead of x + f(norm(x))

Each layer is two sublayers, a token mixer (attention or KDA) and a SwiGLU MLP, each behind an RMSNorm
(PreNorm). Text tokens are embedded by `wte`; image tokens (vision.py) are spliced into the same
embedding sequence when `Config.vision` is set (early fusion). Every attention layer can report its
per-head maximum logit, which QK-Clip (muonclip.py) needs.

    python model.py          # builds the default configs and prints their parameter counts
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnres import AttnResStream
from kda import KimiDeltaAttention, kda_flops_per_token
from kernels.launch import BACKENDS
from muonclip import softmax_attention
from vision import EarlyFusion, apply_rope, rope_angles


@dataclass
class Config:
    vocab_size: int = 50304          # GPT-2's 50257 padded to a multiple of 64; ids >= 50257 are free
    block_size: int = 256            # training context length
    n_layer: int = 4                 # layers; each is a token mixer (pattern letter) and a SwiGLU MLP
    n_head: int = 4                  # attention heads (and KDA heads unless kda_n_head is set)
    n_kv_head: int = 0               # grouped KV heads for attention; 0 = n_head (plain multi-head)
    n_embd: int = 256                # model width
    pattern: str = "A"               # repeated over the layers: A = softmax attention, K = KDA
    rope: str = "auto"               # auto | rope | nope; auto = RoPE unless the pattern has K layers
    rope_theta: float = 10000.0      # RoPE base
    pos_emb: str = "none"            # none | learned: GPT-2's absolute position table, added to the embedding
    mlp_hidden: int = 0              # SwiGLU width; 0 = 8/3 * n_embd rounded up to a multiple of 64
    tie_embeddings: bool = False     # share the embedding matrix with the output head
    norm_eps: float = 1e-6           # RMSNorm epsilon
    residual: str = "standard"       # standard | attnres_full | attnres_block
    attnres_block_size: int = 4      # sublayers per block for attnres_block (block size 1 = full)
    kda_n_head: int = 0              # 0 = n_head
    kda_head_dim: int = 0            # 0 = n_embd // n_head
    kda_gate: str = "channel"        # channel (KDA: a rate per key channel) | head (Gated DeltaNet) | safe (bounded)
    kda_gate_lower_bound: float = -5.0  # kda_gate=safe: every per-token log decay is > this (< 0)
    backend: str = "auto"            # kernels: auto (Triton on CUDA, reference on CPU) | ref | triton
    vision: bool = False             # early-fusion image tokens (vision.py)
    vision_patch_size: int = 4       # pixels per patch side; 2x2 patches merge into one LM token
    vision_channels: int = 3         # image channels (RGB)
    vision_n_embd: int = 128         # width of the small ViT encoder
    vision_n_layer: int = 2          # 0 = no encoder blocks (Fuyu-style linear patches)
    vision_n_head: int = 4           # ViT heads

    def __post_init__(self):
        for ok, message in (
            (min(self.n_layer, self.n_head, self.n_embd, self.block_size, self.vocab_size) >= 1,
             "n_layer, n_head, n_embd, block_size and vocab_size must be positive"),
            (self.pattern and not set(self.pattern) - set("AK"),
             f"pattern={self.pattern!r}: use letters A (attention) and K (KDA), e.g. 'KKKA'"),
            (self.residual in ("standard", "attnres_full", "attnres_block"),
             f"residual={self.residual!r}: use standard | attnres_full | attnres_block"),
            (self.rope in ("auto", "rope", "nope"), f"rope={self.rope!r}: use auto | rope | nope"),
            (self.pos_emb in ("none", "learned"), f"pos_emb={self.pos_emb!r}: use none | learned"),
            (self.kda_gate in ("channel", "head", "safe"),
             f"kda_gate={self.kda_gate!r}: use channel (KDA) | head (Gated DeltaNet) | safe (bounded channel gate)"),
            (-math.inf < self.kda_gate_lower_bound < 0,
             f"kda_gate_lower_bound={self.kda_gate_lower_bound}: must be a finite number < 0"),
            (self.backend in BACKENDS, f"backend={self.backend!r}: use auto | ref | triton"),
            (self.n_head > 0 and self.n_embd % self.n_head == 0,
             f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}"),
            (not self.n_kv_head or self.n_head % self.n_kv_head == 0,
             f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}"),
            (self.attnres_block_size >= 1, f"attnres_block_size={self.attnres_block_size} must be >= 1"),
            (min(self.n_kv_head, self.mlp_hidden, self.kda_n_head, self.kda_head_dim, self.vision_n_layer) >= 0,
             "n_kv_head, mlp_hidden, kda_n_head, kda_head_dim and vision_n_layer must be >= 0 (0 = the default)"),
            (min(self.vision_patch_size, self.vision_channels, self.vision_n_embd, self.vision_n_head) >= 1,
             "vision_patch_size, vision_channels, vision_n_embd and vision_n_head must be positive"),
        ):
            if not ok:
                raise ValueError(message)

    @property
    def layer_kinds(self) -> str:
        """One letter per layer: the pattern repeated and cut to n_layer."""
        return (self.pattern * self.n_layer)[:self.n_layer]

    @property
    def use_rope(self) -> bool:
        return self.rope == "rope" or (self.rope == "auto" and "K" not in self.pattern)


def config_from_dict(d: dict) -> Config:
    """Config from a (checkpoint) dict, ignoring keys this version does not know."""
    names = {f.name for f in fields(Config)}
    return Config(**{k: v for k, v in d.items() if k in names})


def decode_cache_bytes(config: Config, tokens: int, batch: int = 1, dtype=torch.float32) -> tuple[int, int]:
    """(KDA bytes, attention bytes) that decoding caches hold after `tokens` tokens, activations in dtype:
      attention layer: 2 · B · Hkv · tokens · Dh · bytes(dtype)         (K and V: grows with the tokens)
      KDA layer:       B · H · K · V · 4 + B · 3·H·K · (conv − 1) · bytes(dtype)   (float32 state + conv window)
    The all-attention model of the same shape: decode_cache_bytes(replace(config, pattern="A"), ...).
    Checked against the cache tensors by tests/test_long_context.py."""
    size = torch.tensor([], dtype=dtype).element_size()
    hkv, dh = config.n_kv_head or config.n_head, config.n_embd // config.n_head
    H, K = config.kda_n_head or config.n_head, config.kda_head_dim or config.n_embd // config.n_head
    conv = 4                                                      # KimiDeltaAttention's conv_size (Block's)
    per_attention = 2 * batch * hkv * tokens * dh * size
    per_kda = batch * H * K * K * 4 + batch * 3 * H * K * (conv - 1) * size
    kinds = config.layer_kinds
    return kinds.count("K") * per_kda, kinds.count("A") * per_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # float32 statistics whatever the autocast dtype
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


def apply_rope_at(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """1-D RoPE: rotate pairs (x[..., :d/2], x[..., d/2:]) of x [B, H, T, Dh] by the positions pos [T]
    (every row alike) or [B, T] (a position per row and token: padded decoding); vision.py's rotation."""
    angles = rope_angles(pos, x.shape[-1] // 2, theta).unsqueeze(-3)         # [(B,) 1, T, Dh/2]
    return apply_rope(x, angles.cos(), angles.sin())


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention through SDPA; grouped KV heads; RoPE or NoPE; a KV cache. A training
    forward that records max logits (QK-Clip) on the Triton backend uses the fused attention kernel instead.

    The cache dict holds preallocated buffers "k", "v" [B, Hkv, capacity, Dh] and "len" (tokens held).
    Capacity is cache["max_len"] when the caller sets it before the first call, else block_size; a full
    buffer doubles. So a decoded token writes only its own K and V instead of copying the whole cache.
    cache["window"] (optional, set before the first call): hold at most that many keys, dropping the oldest
    (sliding-window decoding past the context; RoPE positions keep counting, "dropped" says how many went)."""

    def __init__(self, config: Config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head or config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.use_rope, self.rope_theta = config.use_rope, config.rope_theta
        self.block_size, self.backend = config.block_size, config.backend  # backend: the max-logit kernel's
        D, Dh = config.n_embd, self.head_dim
        self.q_proj = nn.Linear(D, self.n_head * Dh, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv_head * Dh, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv_head * Dh, bias=False)
        self.o_proj = nn.Linear(self.n_head * Dh, D, bias=False)
        self.record_max_logit, self.max_logit = False, None  # QK-Clip reads max_logit [n_head] (see forward)

    def forward(self, x: torch.Tensor, cache: dict | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
        if valid is not None:
            return self._forward_padded(x, cache, valid)
        T = x.shape[1]
        q, k, v = self._qkv(x)
        past = cache.get("len", 0) if cache is not None else 0
        if self.use_rope:
            start = past + (cache.get("dropped", 0) if cache is not None else 0)        # a window's dropped keys count
            pos = torch.arange(start, start + T, device=x.device)                        # [T]
            q, k = apply_rope_at(q, pos, self.rope_theta), apply_rope_at(k, pos, self.rope_theta)
        if cache is None:  # a whole sequence (training): QK-Clip's max logit is recorded here
            y = softmax_attention(self, q, k, v, causal=True)                         # [B, H, T, Dh]
            return self.o_proj(y.transpose(1, 2).flatten(2))                          # [B, T, H*Dh]
        k, v = self._cache_append(cache, k, v)                                         # [B, Hkv, past+T, Dh]
        past = k.shape[2] - T                                          # keys before this chunk still held (window)
        if past == 0 or T == 1:  # an empty cache, or a one-token step (a single query may see every cached key)
            return self._attend(q, k, v, is_causal=(past == 0 and T > 1))
        mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=past)  # query t at past + t
        return self._attend(q, k, v, attn_mask=mask)

    def _attend(self, q, k, v, **mask) -> torch.Tensor:
        """SDPA of q [B, H, T, Dh] over k, v [B, Hkv, S, Dh] (grouped heads repeated), then o_proj: [B, T, D]."""
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)             # [B, H, S, Dh]
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, **mask)                           # [B, H, T, Dh]
        return self.o_proj(y.transpose(1, 2).flatten(2))                              # [B, T, H*Dh]

    def _qkv(self, x: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)     # [B, H, T, Dh]
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # [B, Hkv, T, Dh]
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # [B, Hkv, T, Dh]
        return q, k, v

    def _forward_padded(self, x: torch.Tensor, cache: dict, valid: torch.Tensor) -> torch.Tensor:
        """Append a chunk whose rows hold different numbers of real tokens (batched episodes).

        valid [B, T] bool: each row's real tokens first, then pads. Pad keys stay in the cache but are
        masked out for every later query, and RoPE positions count real tokens only, so each row
        decodes exactly as it would alone. Uses its own cache entries (pk, pv, pvalid, n_valid).
        """
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        n_before = cache.get("n_valid", torch.zeros(B, dtype=torch.long, device=x.device))
        if self.use_rope:
            pos = n_before[:, None] + valid.long().cumsum(1) - 1                      # [B, T]
            q, k = apply_rope_at(q, pos, self.rope_theta), apply_rope_at(k, pos, self.rope_theta)
        key_valid = valid
        if "pk" in cache:
            k, v = torch.cat([cache["pk"], k], dim=2), torch.cat([cache["pv"], v], dim=2)
            key_valid = torch.cat([cache["pvalid"], valid], dim=1)                    # [B, S]
        cache["pk"], cache["pv"], cache["pvalid"] = k, v, key_valid
        cache["n_valid"] = n_before + valid.sum(1)
        S = k.shape[2]
        causal = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        own = torch.zeros(T, S, dtype=torch.bool, device=x.device)
        own[:, S - T:] = torch.eye(T, dtype=torch.bool, device=x.device)
        # a pad query sees itself too, so no row of the mask is empty (its output is never read)
        mask = (causal[None] & key_valid[:, None, :]) | own[None]                     # [B, T, S]
        return self._attend(q, k, v, attn_mask=mask[:, None])

    def _cache_append(self, cache: dict, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, Hkv, T, Dh] at positions len..len+T of the cache buffers; return views of all
        cached keys and values [B, Hkv, len+T, Dh]. Doubling on overflow keeps the copies amortised O(1)
        per token (torch.cat would copy the whole cache every token)."""
        B, Hkv, T, Dh = k.shape
        past, need = cache.get("len", 0), cache.get("len", 0) + T
        buf_k, buf_v = cache.get("k"), cache.get("v")
        if buf_k is not None and buf_k.shape[0] != B:
            raise ValueError(f"CausalSelfAttention: cache holds batch {buf_k.shape[0]}, x has batch {B}")
        window = cache.get("window")
        if window and need > window:      # sliding window: the oldest keys make room (copied down, so views stay)
            if T > window:
                raise ValueError(f"CausalSelfAttention: a chunk of {T} tokens is longer than the cache's "
                                 f"window of {window}")
            drop = need - window
            buf_k[:, :, :past - drop] = buf_k[:, :, drop:past].clone()
            buf_v[:, :, :past - drop] = buf_v[:, :, drop:past].clone()
            cache["dropped"] = cache.get("dropped", 0) + drop
            past, need = past - drop, window
        if buf_k is None or buf_k.shape[2] < need:
            cap = max(need, cache.get("max_len", self.block_size)) if buf_k is None else max(need, 2 * buf_k.shape[2])
            new_k, new_v = k.new_empty(B, Hkv, cap, Dh), v.new_empty(B, Hkv, cap, Dh)
            if past:
                new_k[:, :, :past], new_v[:, :, :past] = buf_k[:, :, :past], buf_v[:, :, :past]
            cache["k"], cache["v"] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, past:need], buf_v[:, :, past:need] = k, v
        cache["len"] = need
        return buf_k[:, :, :need], buf_v[:, :, :need]


class SwiGLU(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        hidden = config.mlp_hidden or 64 * math.ceil(8 * config.n_embd / 3 / 64)
        self.gate_proj = nn.Linear(config.n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(config.n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One layer = two sublayers: mixer(norm1(h)) and mlp(norm2(h))."""

    def __init__(self, config: Config, kind: str):
        super().__init__()
        self.kind = kind
        self.norm1 = RMSNorm(config.n_embd, config.norm_eps)
        if kind == "A":
            self.mixer = CausalSelfAttention(config)
        else:
            self.mixer = KimiDeltaAttention(
                d_model=config.n_embd, n_heads=config.kda_n_head or config.n_head,
                head_dim=config.kda_head_dim or config.n_embd // config.n_head, backend=config.backend,
                gate=config.kda_gate, gate_lower_bound=config.kda_gate_lower_bound)
        self.norm2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = SwiGLU(config)

    def sublayers(self, cache: dict | None, valid: torch.Tensor | None = None):
        """The two sublayer functions, in order, each applying its own PreNorm (valid: see GPT.forward)."""
        return [lambda h: self.mixer(self.norm1(h), cache, valid=valid), lambda h: self.mlp(self.norm2(h))]


class GPT(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        if config.pos_emb == "learned":
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.layer_kinds)
        if config.residual != "standard":
            block = None if config.residual == "attnres_full" else config.attnres_block_size
            self.attnres = AttnResStream(2 * config.n_layer, config.n_embd, block_size=block,
                                         eps=config.norm_eps, backend=config.backend)
        if config.vision:
            self.vision = EarlyFusion(config)
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def _init_weights(self):
        # GPT-2's scheme for the parts defined here; KDA, AttnRes and vision initialise their own
        std = 0.02
        nn.init.normal_(self.wte.weight, std=std)
        if self.config.pos_emb == "learned":
            nn.init.normal_(self.wpe.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for b in self.blocks:
            attention = [b.mixer.q_proj, b.mixer.k_proj, b.mixer.v_proj] if b.kind == "A" else []
            for m in [b.mlp.gate_proj, b.mlp.up_proj] + attention:
                nn.init.normal_(m.weight, std=std)
            # residual-branch outputs (KDA's o_proj too) scaled down with depth: the stream's variance stays bounded
            for m in (b.mlp.down_proj, b.mixer.o_proj):
                nn.init.normal_(m.weight, std=std / math.sqrt(2 * self.config.n_layer))

    def num_params(self, exclude_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if exclude_embedding else n

    def attention_layers(self) -> list[CausalSelfAttention]:
        return [b.mixer for b in self.blocks if b.kind == "A"]

    def forward(self, idx, targets=None, images=None, caches=None, return_weights=False, loss_only=False,
                valid=None):
        """idx [B, T] token ids -> (logits [B, T, V], loss or None) (+ depth weights if asked).

        targets [B, T] with -1 where no loss is taken (image tokens, prompts, padding).
        images: the image batch vision.EarlyFusion expects (requires Config.vision).
        caches: a list of one dict per layer for incremental decoding (see generate()).
        loss_only: training's fast path: the output head (the largest matmul of a small model with
        GPT-2's vocabulary) runs only where targets != -1, and (None, loss) comes back.
        valid [B, T] bool, with fresh caches: rows of different lengths decoded together (swarm.py),
        each row's real tokens first, then pads, which attention masks out and KDA passes unchanged
        (beta = 0, g = 0), so a row's logits equal those of decoding it alone.
        """
        B, T = idx.shape
        if valid is not None and (caches is None or valid.shape != idx.shape or valid.dtype != torch.bool):
            raise ValueError(f"valid= (padded chunks) needs caches (a list of one dict per layer) and a bool tensor "
                             f"of idx's shape {tuple(idx.shape)}; got {valid.dtype} {tuple(valid.shape)}")
        if caches is None and T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.wte(idx)                                                  # [B, T, D]
        if images is not None:
            if not self.config.vision:
                raise ValueError("images were given but the model was built with vision=False")
            x = self.vision(x, idx, images)
        if self.config.pos_emb == "learned":
            x = x + self.wpe(self._positions(T, caches, valid, idx.device))
        sublayers = []
        for i, block in enumerate(self.blocks):
            sublayers += block.sublayers(caches[i] if caches is not None else None, valid)
        weights = None
        if self.config.residual == "standard":
            for f in sublayers:
                x = x + f(x)
        elif return_weights:
            x, weights = self.attnres(x, sublayers, return_weights=True)
        else:
            x = self.attnres(x, sublayers, two_phase=caches is not None)
        x = self.norm_f(x)
        if loss_only and targets is not None and not return_weights:
            keep = targets != -1                                           # [B, T]
            logits = self.lm_head(x[keep]).float()                         # [n, V], n = positions with a loss
            return None, F.cross_entropy(logits, targets[keep])
        logits = self.lm_head(x).float()                                   # [B, T, V]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return (logits, loss, weights) if return_weights else (logits, loss)

    def _positions(self, T, caches, valid, device) -> torch.Tensor:
        """[T] absolute positions of these tokens: 0.. in training, continuing the count when decoding."""
        if caches is not None and valid is not None:
            raise ValueError("pos_emb='learned' cannot decode padded chunks (valid=): rows would need their own positions")
        start = caches[0].get("wpe_next", 0) if caches is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"pos_emb='learned' has {self.config.block_size} positions; token {start + T} has none")
        if caches is not None:
            caches[0]["wpe_next"] = start + T
        return torch.arange(start, start + T, device=device)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 images=None, generator: torch.Generator | None = None, caches: list | None = None,
                 on_token=None):
        """Sample max_new_tokens after the prompt idx [B, T0] using per-layer caches.

        Attention layers keep a KV cache, KDA layers a constant-size recurrent state, so each new token
        costs one forward step of length 1. temperature 0 means greedy. caches: the per-layer dicts to
        fill (default: fresh ones); pass them to preset an attention "max_len" or "window"
        (CausalSelfAttention) or to read what they hold afterwards (decode_cache_bytes says how much).
        on_token(nxt [B, 1]) sees each token as it is sampled (streaming); returning True stops there.
        """
        was_training = self.training
        self.eval()
        caches = [dict() for _ in self.blocks] if caches is None else caches
        logits, _ = self(idx, images=images, caches=caches)               # prefill
        out = idx
        for _ in range(max_new_tokens):
            logits = logits[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            out = torch.cat([out, nxt], dim=1)
            if on_token is not None and on_token(nxt):
                break
            logits, _ = self(nxt, caches=caches)
        self.train(was_training)
        return out

    def flops_per_token(self, T: int) -> int:
        """FLOPs of one training step (forward + backward = 3 x forward) per token, rows of T tokens: every
        nn.Linear of the language model (a tied head too; the embedding lookup is no matmul), attention's
        scores and weighted sum over all T keys (4·T·H·Dh per layer, the causal half not discounted, as in
        PaLM's MFU), KDA's chunked delta rule (kda.kda_flops_per_token), the short convolutions and
        AttnRes's depth attention. Images add 3 x EarlyFusion.flops_per_image each (training_flops)."""
        fwd = 0
        for name, m in self.named_modules():
            if name.startswith("vision"):
                continue
            if isinstance(m, nn.Linear):
                fwd += 2 * m.in_features * m.out_features
            elif isinstance(m, nn.Conv1d):
                fwd += 2 * m.weight.numel()                 # [out, in/groups, k]: per output position
        for block in self.blocks:
            if block.kind == "A":
                fwd += 4 * T * block.mixer.n_head * block.mixer.head_dim
            else:
                fwd += kda_flops_per_token(block.mixer.n_heads, block.mixer.head_dim, block.mixer.head_dim)
        if self.config.residual != "standard":
            fwd += self.attnres.flops_per_token()
        return 3 * fwd

    def training_flops(self, n_rows: int, T: int, image_sizes=(), head_positions: int | None = None) -> int:
        """FLOPs of one forward + backward over n_rows rows of T tokens holding images of the given
        (height, width) sizes; head_positions: how many positions ran the output head (forward with
        loss_only=True), default all n_rows * T."""
        flops = n_rows * T * self.flops_per_token(T)
        if head_positions is not None:
            head = 2 * self.lm_head.in_features * self.lm_head.out_features
            flops -= 3 * head * (n_rows * T - head_positions)
        if image_sizes:
            flops += 3 * sum(self.vision.flops_per_image(h, w) for h, w in image_sizes)
        return flops


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description="Build a few model.Config variants and print their parameter counts "
                                        "(train.py's --help lists every Config field)").parse_args()
    for cfg in (Config(), Config(pattern="KKKA"), Config(residual="attnres_block")):
        n = GPT(cfg).num_params()
        print(f"pattern={cfg.layer_kinds} residual={cfg.residual}: {n / 1e6:.2f}M non-embedding params")
