"""Procedural image-text tasks for early fusion (vision.py): scenes, questions, token rows, accuracy.

Offline image-text data at a size a laptop trains on. Scenes are rendered with numpy (digit glyphs
rasterised once with matplotlib's Agg canvas): counting, colour, left/right relations, more/fewer
comparisons and reading a number (OCR), plus two one-shape tasks ("what colour is the shape?", "is it
on the left or the right?"). Every example has a *text twin* that states the same scene in words and
asks the same question. Deterministic from a seed; train and val are disjoint by content (a hash of
the arrangement and the question decides the split).

One example as tokens: `[IMAGE_START, IMAGE_PAD x n, IMAGE_END] Q: <question> A: <answer> <EOT>`, or
as its text twin `<scene in words> Q: <question> A: <answer> <EOT>`; only the answer tokens and the
closing EOT carry a loss (targets are -1 elsewhere). vision.EarlyFusion writes the image tokens over
the IMAGE_PAD rows.

API (train.py; concat_batches for experiments/fusion_timing.py):
    tasks = VisionTasks(seed=0, encoding=data.get_tokenizer())   # the default encoding
    idx, targets, images = tasks.batch("train", batch_size, block_size, rng_or_seed, text_twin=False)
        idx, targets: [B, T] long (targets -1 on image, prompt and padding positions)
        images: list over the B rows of lists of float tensors [3, H, W] in [0, 1], native size,
                in the order their IMAGE_PAD runs appear in the row (text-only rows: [])
    acc = tasks.evaluate(model, "val", n, text_twin=False)  # exact match of the greedy answer
    idx, targets, images = concat_batches([text_batch, vision_batch])   # a mixed batch

    python image_tasks.py      # draws out/vision/vision_samples.png and prints each image size's token cost
"""
import argparse
import os
import sys
import zlib
from collections import Counter
from functools import lru_cache

import numpy as np
import torch

import data
from vision import EOT, IMAGE_END, IMAGE_PAD, IMAGE_START, image_token_count, patch_grid


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

def concat_batches(batches):
    """[(idx, targets, images or None), ...] with equal T -> one batch; text-only rows get []."""
    idx = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    images = [row for b in batches for row in (b[2] if b[2] is not None else [[] for _ in range(len(b[0]))])]
    return idx, targets, images


class VisionTasks:
    """The image-text task mix, tokenised for a GPT-2-vocab language model (the rows the module docstring
    describes), with a cache of generated examples."""

    def __init__(self, seed: int = 0, encoding=None, patch: int = 4, tasks=TASKS):
        if set(tasks) - set(TASKS) or not tasks:
            raise ValueError(f"tasks={tasks!r}: choose from {TASKS}")
        self.seed, self.patch, self.tasks = seed, patch, tuple(tasks)
        self.enc = encoding if encoding is not None else data.get_tokenizer()
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
    parser = argparse.ArgumentParser(description="Draw samples of the procedural image-text tasks and print what "
                                                 "each image size costs in language-model tokens.")
    parser.add_argument("--seed", type=int, default=0, help="task generator seed (>= 0)")
    parser.add_argument("--out_dir", default="out/vision", help="where vision_samples.png goes")
    args = parser.parse_args()
    if not 0 <= args.seed < 2**63:
        parser.error(f"--seed={args.seed} must be in [0, 2^63)")   # argparse's usage line and exit code 2
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
