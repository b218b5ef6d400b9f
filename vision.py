"""Early-fusion vision: images become tokens in the language model's own stream.

Kimi K2.5 (arXiv 2602.02276, §2.1 and Table 1) trains vision and text together from the start
("early fusion") with a small constant vision share, instead of bolting an encoder onto a finished
language model, and finds that 10% vision from step 0 beats 20% from mid-training or 50% from 80%
of training at the same total budget; late injection makes text quality dip before it recovers.
This file holds what the language model needs to see pictures, at a size a laptop trains (the
procedural image-text tasks it learns from are in image_tasks.py):

1. Encoder and projector. The image is cut into p x p patches at its native resolution (padded up
   to a multiple of 2p, never resized), embedded linearly, mixed by a small bidirectional ViT whose
   attention carries 2-D RoPE, merged 2x2 (pixel shuffle: 4 neighbouring patches -> one vector of
   4x width) and mapped by a two-layer MLP into the language model's width (Kimi-VL/K2.5 style).
2. Fusion. A sequence holds [IMAGE_START, IMAGE_PAD x n, IMAGE_END] followed by text; the model
   embeds every token as usual and `EarlyFusion` overwrites the IMAGE_PAD rows, in order, with the
   projected image tokens. The loss is on text (answer) tokens only: targets are -1 elsewhere.

Why a small ViT with 2-D RoPE rather than Fuyu's bare linear patch embedding: the language models
in this project are often NoPE (the KDA hybrids) or use 1-D RoPE, so a raster of patches loses the
row structure (is patch 5 below patch 1 or to its right?). Two-dimensional rotary positions give
every patch its (row, column) inside the encoder, at any image size, with no learned table to
interpolate; a linear map of each patch's normalised (row, col) adds where it sits in the picture.
`vision_n_layer=0` turns the encoder blocks off and leaves the Fuyu-style path (linear patch
embedding -> merge -> MLP), for comparison.

The math. Patch (r, c) of an image x is x[:, r p:(r+1) p, c p:(c+1) p] flattened; with head
dimension d, 2-D RoPE rotates the pairs (q_i, q_{i+d/2}) by angle r w_i for i < d/4 and c w_{i-d/4}
for d/4 <= i < d/2 (w_j = base^(-j/(d/4))), so q . k depends on (r_q - r_k, c_q - c_k) only. The
language model's 1-D RoPE (model.py) is the same rotation with one position and d/2 frequencies. An
image of H x W pixels costs ceil(H / 2p) * ceil(W / 2p) tokens in the language model.

Run: `python image_tasks.py` writes out/vision/vision_samples.png (a grid of task samples with
questions and answers) and prints how many image tokens each resolution costs.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

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
    """[G, C, H, W] -> patches [G, rows*cols, C*p*p] in raster order, plus (rows, cols).

    The bottom and right edges are zero-padded up to the patch grid; nothing is resized."""
    G, C, H, W = images.shape
    rows, cols = patch_grid(H, W, patch)
    x = F.pad(images, (0, cols * patch - W, 0, rows * patch - H))
    x = x.view(G, C, rows, patch, cols, patch)                    # [G, C, rows, p, cols, p]
    x = x.permute(0, 2, 4, 1, 3, 5)                               # [G, rows, cols, C, p, p]
    return x.reshape(G, rows * cols, C * patch * patch), (rows, cols)


def unpatchify(patches: torch.Tensor, grid: tuple[int, int], patch: int, size: tuple[int, int]) -> torch.Tensor:
    """Inverse of patchify: [G, rows*cols, C*p*p] -> [G, C, H, W], cropping the padding."""
    G, N, K = patches.shape
    rows, cols = grid
    C = K // (patch * patch)
    x = patches.view(G, rows, cols, C, patch, patch).permute(0, 3, 1, 4, 2, 5)  # [G, C, rows, p, cols, p]
    x = x.reshape(G, C, rows * patch, cols * patch)
    return x[:, :, : size[0], : size[1]]


def patch_positions(rows: int, cols: int, device=None) -> torch.Tensor:
    """[rows*cols, 2] long: the (row, column) of each patch in raster order."""
    r = torch.arange(rows, device=device).repeat_interleave(cols)
    c = torch.arange(cols, device=device).repeat(rows)
    return torch.stack([r, c], dim=1)


def merge_2x2(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Pixel shuffle: [G, rows*cols, D] -> [G, rows/2 * cols/2, 4D]; each output token is the
    concatenation of a 2x2 block of patches (top-left, top-right, bottom-left, bottom-right)."""
    G, N, D = x.shape
    x = x.view(G, rows // 2, 2, cols // 2, 2, D)                  # [G, R, 2, Cc, 2, D]
    x = x.permute(0, 1, 3, 2, 4, 5)                               # [G, R, Cc, 2, 2, D]
    return x.reshape(G, (rows // 2) * (cols // 2), 4 * D)


def unmerge_2x2(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of merge_2x2: [G, rows/2 * cols/2, 4D] -> [G, rows*cols, D]."""
    G, M, D4 = x.shape
    x = x.view(G, rows // 2, cols // 2, 2, 2, D4 // 4).permute(0, 1, 3, 2, 4, 5)  # [G, R, 2, Cc, 2, D]
    return x.reshape(G, rows * cols, D4 // 4)


# -----------------------------------------------------------------------------
# Rotary positions: one rotation for the language model's 1-D RoPE (model.py) and the ViT's 2-D RoPE

def rope_angles(pos: torch.Tensor, n_pairs: int, base: float) -> torch.Tensor:
    """Angles pos * base^(-j / n_pairs) for j < n_pairs: positions [...] -> [..., n_pairs] float32."""
    freqs = base ** (-torch.arange(n_pairs, dtype=torch.float32, device=pos.device) / n_pairs)
    return pos.float()[..., None] * freqs


def rope_2d(positions: torch.Tensor, head_dim: int, base: float = 100.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [N, head_dim/2] for (row, col) positions [N, 2]: the first quarter of the
    head's rotation pairs turn with the row index, the second quarter with the column index."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dim divisible by 4, got {head_dim}")
    angles = torch.cat([rope_angles(positions[:, 0], head_dim // 4, base),
                        rope_angles(positions[:, 1], head_dim // 4, base)], dim=-1)  # [N, head_dim/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x_i, x_{i+d/2}) of x [..., N, d] by the angles behind cos/sin [..., N, d/2]
    (broadcast against x's leading dims), in float32; returns x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


# -----------------------------------------------------------------------------
# Encoder, projector and the fusion hook

class _EncoderBlock(nn.Module):
    """Pre-norm ViT block: bidirectional attention with 2-D RoPE, then a GELU MLP.

    Like the language model's attention, it records its per-head max logit (over every pair of
    patches: the attention is bidirectional) for QK-Clip, which scales the q and k row blocks of the
    fused qkv projection."""

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
        y = None
        if self.record_max_logit and self.training:
            from muonclip import attention_max_logit, fused_attention, max_logit
            if fused_attention(self.backend, q):    # attention and max logit from one Triton kernel
                y, new = attention_max_logit(q, k, v, self.head_dim ** -0.5, causal=False)    # [G, H, N, Dh], [G, H]
            else:
                new = max_logit(q.detach(), k.detach(), self.head_dim ** -0.5, self.backend, causal=False)
            new = new.amax(dim=0)
            self.max_logit = new if self.max_logit is None else torch.maximum(self.max_logit, new)
        if y is None:
            y = F.scaled_dot_product_attention(q, k, v)                    # every patch sees the whole image
        x = x + self.proj(y.transpose(1, 2).reshape(G, N, D))
        return x + self.fc_out(F.gelu(self.fc(self.norm2(x))))


class EarlyFusion(nn.Module):
    """Patch encoder + 2x2 merge + MLP projector, and the hook that puts image tokens into the
    language model's embedded sequence.

    Config fields read (getattr defaults): n_embd; vision_patch_size=4, vision_channels=3,
    vision_n_embd=128, vision_n_layer=2, vision_n_head=4 (vision_n_layer=0: Fuyu-style linear
    patch embedding only)."""

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

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images of one size [G, C, H, W] -> image tokens [G, n, n_embd] in raster order of the merged grid."""
        patches, (rows, cols) = patchify(images, self.patch)              # [G, rows*cols, C*p*p]
        pos = patch_positions(rows, cols, images.device)                  # [rows*cols, 2]
        where = (pos.float() + 0.5) / torch.tensor([rows, cols], device=images.device) * 2 - 1
        x = self.patch_embed(patches) + self.pos_embed(where.to(patches.dtype))  # [G, rows*cols, dim]
        if len(self.blocks):
            cos, sin = rope_2d(pos, x.shape[-1] // self.n_head)
            for block in self.blocks:
                x = block(x, cos, sin)
        x = merge_2x2(self.norm(x), rows, cols)                           # [G, rows/2 * cols/2, 4*dim]
        return self.projector(x)

    def flops_per_image(self, height: int, width: int) -> int:
        """Forward FLOPs of encoding one image (for MFU): the patch and position embeddings, each
        block's projections and its bidirectional scores and weighted sum over all N patches
        (4·N²·dim), and the projector on the N/4 merged tokens."""
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
        """x [B, T, D] token embeddings of idx [B, T]; images: list over B of lists of [C, H, W].
        Returns x with the IMAGE_PAD rows replaced by the images' tokens, in order."""
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
