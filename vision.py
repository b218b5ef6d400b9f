"""Early-fusion vision (Kimi K2.5, arXiv 2602.02276 §2.1): image tokens join the LM's stream from step 0.

Encoder: p x p patches at native resolution (padded to a multiple of 2p, never resized), embedded
linearly plus a linear map of each patch's normalised (row, col), mixed by a small bidirectional ViT
with 2-D RoPE (vision_n_layer=0: none, Fuyu's path), merged 2x2 (4 neighbours -> one 4x-wide vector)
and projected by a 2-layer MLP to the LM's width: an H x W image costs ceil(H/2p)·ceil(W/2p) tokens.
Fusion: EarlyFusion writes them over a row's IMAGE_PAD embeddings ([IMAGE_START, IMAGE_PAD x n, IMAGE_END]).
2-D RoPE (head dim d): pair (q_i, q_{i+d/2}) turns by r·w_i for i < d/4 and by c·w_{i-d/4} up to d/2,
w_j = base^(-j/(d/4)), so q·k depends on (Δrow, Δcol) only.

Run:   python train.py; python image_tasks.py (draws task samples, prints token costs)
Test:  python -m pytest tests/test_vision.py -q
Bench: python experiments/fusion_timing.py
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from muonclip import softmax_attention

# Special token ids inside the GPT-2 padded vocabulary (tiktoken's GPT-2 uses 0..50256; the model
# pads the embedding table to 50304, so these rows exist and are otherwise never used).
EOT = 50256          # <|endoftext|>: ends every answer and separates packed examples
IMAGE_START = 50257
IMAGE_END = 50258
IMAGE_PAD = 50259    # one per image token; EarlyFusion overwrites these embedding rows


# -----------------------------------------------------------------------------
# Patches at native resolution

def patch_grid(height: int, width: int, patch: int) -> tuple[int, int]:
    """Patch rows and columns of an image, rounded up to even counts so the 2x2 merge tiles it."""
    return 2 * math.ceil(height / (2 * patch)), 2 * math.ceil(width / (2 * patch))


def image_token_count(height: int, width: int, patch: int = 4) -> int:
    """How many language-model tokens (IMAGE_PAD slots) one H x W image costs after the 2x2 merge."""
    rows, cols = patch_grid(height, width, patch)
    return (rows // 2) * (cols // 2)


def patchify(images: torch.Tensor, patch: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """[G, C, H, W] -> patches [G, rows*cols, C*p*p] in raster order (bottom/right zero-padded), (rows, cols)."""
    G, C, H, W = images.shape
    rows, cols = patch_grid(H, W, patch)
    x = F.pad(images, (0, cols * patch - W, 0, rows * patch - H))
    x = x.view(G, C, rows, patch, cols, patch)                    # [G, C, rows, p, cols, p]
    x = x.permute(0, 2, 4, 1, 3, 5)                               # [G, rows, cols, C, p, p]
    return x.reshape(G, rows * cols, C * patch * patch), (rows, cols)


def patch_positions(rows: int, cols: int, device=None) -> torch.Tensor:
    """[rows*cols, 2] long: the (row, column) of each patch in raster order."""
    r = torch.arange(rows, device=device).repeat_interleave(cols)
    c = torch.arange(cols, device=device).repeat(rows)
    return torch.stack([r, c], dim=1)


def merge_2x2(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Pixel shuffle [G, rows*cols, D] -> [G, rows/2 * cols/2, 4D]: a 2x2 block (TL, TR, BL, BR) per token."""
    G, N, D = x.shape
    x = x.view(G, rows // 2, 2, cols // 2, 2, D)                  # [G, R, 2, Cc, 2, D]
    x = x.permute(0, 1, 3, 2, 4, 5)                               # [G, R, Cc, 2, 2, D]
    return x.reshape(G, (rows // 2) * (cols // 2), 4 * D)


# -----------------------------------------------------------------------------
# Rotary positions: one rotation for the language model's 1-D RoPE (model.py) and the ViT's 2-D RoPE

def rope_angles(pos: torch.Tensor, n_pairs: int, base: float) -> torch.Tensor:
    """Angles pos * base^(-j / n_pairs) for j < n_pairs: positions [...] -> [..., n_pairs] float32."""
    freqs = base ** (-torch.arange(n_pairs, dtype=torch.float32, device=pos.device) / n_pairs)
    return pos.float()[..., None] * freqs


def rope_2d(positions: torch.Tensor, head_dim: int, base: float = 100.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim/2] for (row, col) positions [N, 2]: pairs turn by row, then by column."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dim divisible by 4, got {head_dim}")
    angles = torch.cat([rope_angles(positions[:, 0], head_dim // 4, base),
                        rope_angles(positions[:, 1], head_dim // 4, base)], dim=-1)  # [N, head_dim/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x_i, x_{i+d/2}) of x [..., N, d] by cos/sin [..., N, d/2], in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


# -----------------------------------------------------------------------------
# Encoder, projector and the fusion hook

class _EncoderBlock(nn.Module):
    """Pre-norm ViT block: bidirectional attention with 2-D RoPE (max logit recorded for QK-Clip), GELU MLP."""

    def __init__(self, dim: int, n_head: int, backend: str = "auto"):
        super().__init__()
        self.n_head = self.n_kv_head = n_head
        self.head_dim = dim // n_head
        self.backend = backend
        self.record_max_logit = False   # set by MuonClip.from_model
        self.max_logit = None           # [n_head] float32, max over images and micro-steps until read
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.fc_out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        G, N, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(G, N, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)           # [G, H, N, Dh]
        y = softmax_attention(self, q, k, v, causal=False)                # every patch sees the whole image
        x = x + self.proj(y.transpose(1, 2).reshape(G, N, D))
        return x + self.fc_out(F.gelu(self.fc(self.norm2(x))))


class EarlyFusion(nn.Module):
    """Patch encoder, 2x2 merge, MLP projector; forward writes the image tokens into the LM's embeddings."""

    def __init__(self, config):
        super().__init__()
        self.patch = getattr(config, "vision_patch_size", 4)
        self.channels = getattr(config, "vision_channels", 3)
        dim = getattr(config, "vision_n_embd", 128)
        n_layer = getattr(config, "vision_n_layer", 2)
        self.n_head = getattr(config, "vision_n_head", 4)
        if n_layer and (dim % self.n_head or (dim // self.n_head) % 4):
            raise ValueError(f"vision_n_embd={dim} must split into vision_n_head={self.n_head} heads of a size divisible by 4")
        self.patch_embed = nn.Linear(self.channels * self.patch ** 2, dim)
        # RoPE only tells attention how far apart two patches are; "is it on the left?" needs where a
        # patch is in the picture, so each patch also gets a linear map of its (row, col) scaled to
        # [-1, 1], which works at every resolution (MoonViT likewise keeps an absolute embedding)
        self.pos_embed = nn.Linear(2, dim, bias=False)
        backend = getattr(config, "backend", "auto")
        self.blocks = nn.ModuleList(_EncoderBlock(dim, self.n_head, backend) for _ in range(n_layer))
        self.norm = nn.LayerNorm(dim)
        # the projector: 4 merged patches -> the language model's width
        self.projector = nn.Sequential(nn.LayerNorm(4 * dim), nn.Linear(4 * dim, config.n_embd),
                                       nn.GELU(), nn.Linear(config.n_embd, config.n_embd))
        # GPT-2-style init: image tokens start at the scale of the 0.02-std text embeddings
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def features(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images of one size [G, C, H, W] -> the ViT's patch features [G, rows*cols, dim] (normed), (rows, cols).
        The encoder proper: what image_tasks.pretrain_encoder trains before the projector exists."""
        patches, (rows, cols) = patchify(images, self.patch)              # [G, rows*cols, C*p*p]
        pos = patch_positions(rows, cols, images.device)                  # [rows*cols, 2]
        where = (pos.float() + 0.5) / torch.tensor([rows, cols], device=images.device) * 2 - 1
        x = self.patch_embed(patches) + self.pos_embed(where.to(patches.dtype))  # [G, rows*cols, dim]
        if len(self.blocks):
            cos, sin = rope_2d(pos, x.shape[-1] // self.n_head)
            for block in self.blocks:
                x = block(x, cos, sin)
        return self.norm(x), (rows, cols)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images of one size [G, C, H, W] -> image tokens [G, n, n_embd] in raster order of the merged grid."""
        x, (rows, cols) = self.features(images)                           # [G, rows*cols, dim]
        return self.projector(merge_2x2(x, rows, cols))                   # [G, rows/2 * cols/2, n_embd]

    def encoder_state(self) -> dict:
        """The encoder's weights (everything but the projector), detached copies: what a pretrained
        encoder hands to each model that starts from it (load_encoder)."""
        return {k: v.detach().clone() for k, v in self.state_dict().items() if not k.startswith("projector.")}

    def load_encoder(self, state: dict):
        """Copy a pretrained encoder (encoder_state) in; the projector keeps its own init. A state of another
        shape or with other keys stops with a one-line ValueError."""
        mine = {k: v for k, v in self.state_dict().items() if not k.startswith("projector.")}
        if set(state) != set(mine) or any(tuple(state[k].shape) != tuple(v.shape) for k, v in mine.items()):
            raise ValueError("the pretrained encoder does not fit this model's ViT (other keys or shapes: "
                             "vision_n_embd, vision_n_layer and vision_patch_size must match)")
        with torch.no_grad():
            for k, v in mine.items():
                v.copy_(state[k])

    def flops_per_image(self, height: int, width: int) -> int:
        """Forward FLOPs of encoding one image (MFU): embeddings, blocks (4·N²·dim attention), projector."""
        rows, cols = patch_grid(height, width, self.patch)
        N = rows * cols
        dim = self.patch_embed.out_features
        flops = 2 * N * (self.patch_embed.in_features * dim + 2 * dim)
        for block in self.blocks:
            flops += 2 * N * sum(m.in_features * m.out_features for m in (block.qkv, block.proj, block.fc, block.fc_out))
            flops += 4 * N * N * dim
        linears = [m for m in self.projector if isinstance(m, nn.Linear)]
        return flops + 2 * (N // 4) * sum(m.in_features * m.out_features for m in linears)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, images) -> torch.Tensor:
        """x [B, T, D] with idx's IMAGE_PAD rows replaced by the tokens of images (B lists of [C, H, W])."""
        B, T = idx.shape
        if not isinstance(images, (list, tuple)) or len(images) != B:
            raise ValueError(f"images must be a list of {B} lists (one per batch row), got {type(images).__name__}"
                             + (f" of length {len(images)}" if isinstance(images, (list, tuple)) else ""))
        slots = (idx == IMAGE_PAD).sum(dim=1).tolist()
        flat = []
        for b, row in enumerate(images):
            if not isinstance(row, (list, tuple)):
                raise ValueError(f"images[{b}] must be a list of [C, H, W] tensors, got {type(row).__name__}")
            for img in row:
                if not torch.is_tensor(img) or img.dim() != 3 or img.shape[0] != self.channels or not img.is_floating_point():
                    raise ValueError(f"images[{b}] holds {getattr(img, 'shape', type(img).__name__)}; expected a float tensor [{self.channels}, H, W]")
            need = sum(image_token_count(img.shape[1], img.shape[2], self.patch) for img in row)
            if need != slots[b]:
                raise ValueError(f"row {b}: its images need {need} IMAGE_PAD tokens but idx has {slots[b]}")
            flat.extend(row)
        if not flat:
            return x
        # encode images of equal size together, then put the tokens back in sequence order
        by_size: dict[tuple, list[int]] = {}
        for i, img in enumerate(flat):
            by_size.setdefault(tuple(img.shape), []).append(i)
        per_image: list = [None] * len(flat)
        for ids in by_size.values():
            batch = torch.stack([flat[i] for i in ids]).to(device=x.device, dtype=self.patch_embed.weight.dtype)
            out = self.encode(batch)                                       # [G, n, D]
            for j, i in enumerate(ids):
                per_image[i] = out[j]
        tokens = torch.cat(per_image).to(x.dtype)                          # [total slots, D]
        # masked_scatter fills the True positions in row-major order: row 0's slots first, and
        # within a row left to right, which is exactly the order of `flat`
        return x.masked_scatter((idx == IMAGE_PAD).unsqueeze(-1), tokens)
