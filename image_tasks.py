"""Procedural image-text tasks for early fusion (vision.py): scenes, questions, captions, token rows, accuracy.

Offline image-text data at a size a laptop trains on. Scenes are rendered with numpy (digit glyphs
rasterised once with matplotlib's Agg canvas): counting, colour, left/right relations, more/fewer
comparisons and reading a number (OCR), two one-shape tasks ("what colour is the shape?", "is it on the
left or the right?") and three few-shape tasks (1-3 shapes of different kinds: "what colour is the
circle?" (all shapes of that scene share a colour), "is the circle on the left or the right?", "how many
shapes are there?"). Every scene has a
*caption* that names each shape's colour, kind and side in words ("a red square on the left and a blue
circle on the right."). Deterministic from a seed; train and val are disjoint by content (a hash of the
arrangement and the question decides the split; for the few-shape tasks the arrangement alone, so a
scene's caption and every question about it fall on the same side).

One example as tokens, in one of three forms that share a wrapper:
    image    [IMAGE_START, IMAGE_PAD x n, IMAGE_END] Q: <question> A: <answer> <EOT>
    twin     <caption>                               Q: <question> A: <answer> <EOT>   (the text twin)
    caption  [IMAGE_START, IMAGE_PAD x n, IMAGE_END] <caption> <EOT>
so a twin is its image row with the caption in place of the image tokens, and a caption row teaches
what the twin's text says about the image. supervise="answer" puts the loss on the answer (a caption
row's caption) and the closing EOT; supervise="text" on every text token (as pretraining on interleaved
data does), never on an image token (targets are -1 there). vision.EarlyFusion writes the image tokens
over the IMAGE_PAD rows.

API (train.py; concat_batches and the forms for experiments/fusion_timing.py):
    tasks = VisionTasks(seed=0, encoding=data.get_tokenizer())   # the default encoding
    idx, targets, images = tasks.batch("train", batch_size, block_size, rng_or_seed, form="image")
        idx, targets: [B, T] long (targets -1 where no loss is taken)
        images: list over the B rows of lists of float tensors [3, H, W] in [0, 1], native size,
                in the order their IMAGE_PAD runs appear in the row (text-only rows: [])
        form: "image" | "twin" | "caption", or a tuple of them (each example draws one)
    acc = tasks.evaluate(model, "val", n, form="image")   # exact match of the greedy answer ("image" | "twin")
    idx, targets, images = concat_batches([text_batch, vision_batch])   # a mixed batch
    state, check = pretrain_encoder(model_config, seed)   # the ViT trained on scene attributes (shared by arms)

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
TASKS = ("count", "count_color", "color", "relation", "compare", "ocr", "color_one", "side_one")   # the "all" mix
FEW_TASKS = ("color_few", "side_few", "count_few")   # 1-3 shapes of different kinds, asked for by name
ALL_TASKS = TASKS + FEW_TASKS
FORMS = ("image", "twin", "caption")
SIDES = {"left": "on the left", "right": "on the right", "middle": "in the middle"}
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
    elif task in FEW_TASKS:                 # 1-3 shapes of different kinds, so "the circle" names one shape
        objs = _random_objects(rng, size, int(rng.integers(1, 4)))
        for obj, k in zip(objs, rng.permutation(len(KINDS))):
            obj["kind"] = KINDS[k]
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
    if task in ("count", "count_few"):
        return scene, "How many shapes are there?", str(len(objs))
    if task == "color_few":   # one colour per scene: naming it needs no binding of kind to colour inside an
        for o in objs:        # image token (with mixed colours it stayed at chance in the fusion pilot, 300 steps)
            o["color"] = objs[0]["color"]
        obj = objs[rng.integers(len(objs))]
        return scene, f"What colour is the {obj['kind']}?", obj["color"]
    if task == "side_few":
        sided = [o for o in objs if side_of(o, scene) != "middle"]
        if not sided:
            return None
        obj = sided[rng.integers(len(sided))]
        return scene, f"Is the {obj['kind']} on the left or the right?", side_of(obj, scene)
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
    raise ValueError(f"unknown task {task!r}; expected one of {ALL_TASKS}")


def side_of(obj: dict, scene: dict) -> str:
    """left | right | middle: which half of the picture's cell columns the shape's column is in."""
    cols = scene["size"][1] // CELL
    return "left" if 2 * obj["col"] + 1 < cols else "right" if 2 * obj["col"] + 1 > cols else "middle"


def caption(scene: dict) -> str:
    """The scene in words, as the twin and the caption row write it (with its leading space): each shape's
    colour, kind and side in scene order, " a red square on the left and a blue circle in the middle."."""
    if scene["text"]:
        return f" the number {' '.join(scene['text'])}."
    parts = [f"a {o['color']} {o['kind']} {SIDES[side_of(o, scene)]}" for o in scene["objects"]]
    return " " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]) + "."


def example_key(scene: dict, question: str) -> str:
    """The content of an example, without pixel jitter: two examples with the same key are the same
    question about the same arrangement, so the split is decided by this key."""
    objs = sorted((o["row"], o["col"], o["color"], o["kind"]) for o in scene["objects"])
    return f"{scene['size']}|{objs}|{scene['text']}|{question}"


def split_of(key: str) -> str:
    return "val" if zlib.crc32(key.encode()) % VAL_SHARE == 0 else "train"


def split_key(task: str, scene: dict, question: str) -> str:
    """What decides an example's split: the arrangement and the question, or for the few-shape tasks the
    arrangement alone (their captions and questions then never show a val scene in training)."""
    return example_key(scene, "" if task in FEW_TASKS else question)


def make_example(seed: int, split: str, index: int, tasks=TASKS) -> dict:
    """Example `index` of `split`: a dict with task, scene, question, answer, image [3, H, W] and key.
    Deterministic in (seed, split, index, tasks); rejection-sampled until its content hashes into `split`."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if not tasks or set(tasks) - set(ALL_TASKS):
        raise ValueError(f"tasks={tasks!r}: choose from {ALL_TASKS}")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1, index])
    task = tasks[rng.integers(len(tasks))]
    while True:
        made = _try_example(rng, task)
        if made is None:
            continue
        scene, question, answer = made
        key = example_key(scene, question)
        if split_of(split_key(task, scene, question)) == split:
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
        if set(tasks) - set(ALL_TASKS) or not tasks:
            raise ValueError(f"tasks={tasks!r}: choose from {ALL_TASKS}")
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

    def image_span(self, ex: dict) -> list:
        H, W = ex["scene"]["size"]
        return [IMAGE_START] + [IMAGE_PAD] * image_token_count(H, W, self.patch) + [IMAGE_END]

    def tokens(self, ex: dict, form: str = "image", supervise: str = "answer"):
        """-> (tokens, loss flags, images): one example in `form` (image | twin | caption) as token ids, a
        flag per token that says whether it is a target (supervise: answer | text), and its images."""
        if form not in FORMS or supervise not in ("answer", "text"):
            raise ValueError(f"form={form!r}, supervise={supervise!r}: use form in {FORMS}, supervise answer | text")
        question = self.enc.encode_ordinary(" Q: " + ex["question"] + " A:")
        if form == "image":
            prompt, answer, images = self.image_span(ex) + question, self.enc.encode_ordinary(" " + ex["answer"]), [ex]
        elif form == "twin":      # the image row with the caption in place of the image tokens
            prompt, answer, images = self.enc.encode_ordinary(caption(ex["scene"])) + question, \
                self.enc.encode_ordinary(" " + ex["answer"]), []
        else:                     # the image, then what the twin says in its place
            prompt, answer, images = self.image_span(ex), self.enc.encode_ordinary(caption(ex["scene"])), [ex]
        toks = prompt + answer + [EOT]
        if supervise == "answer":
            flags = [False] * len(prompt) + [True] * (len(answer) + 1)
        else:                     # every text token; image tokens are inputs only
            flags = [t not in (IMAGE_START, IMAGE_PAD, IMAGE_END) for t in toks]
        return toks, flags, [torch.from_numpy(e["image"]) for e in images]

    def batch(self, split: str, batch_size: int, block_size: int, rng_or_seed=None, form="image",
              supervise: str = "answer"):
        """Rows packed with random examples of `split` -> (idx [B, T], targets [B, T], images).

        targets[t] = idx[t + 1] where that token is flagged (tokens), else -1 (no loss on images, prompts
        under supervise="answer", or padding). form: one of FORMS, or a tuple of them from which each
        example draws its own. Examples are never cut; the row's tail is EOT padding."""
        rng = rng_or_seed if isinstance(rng_or_seed, np.random.Generator) else np.random.default_rng(rng_or_seed)
        forms = (form,) if isinstance(form, str) else tuple(form)
        if not forms or set(forms) - set(FORMS):
            raise ValueError(f"form={form!r}: use one of {FORMS} or a tuple of them")
        idx = torch.full((batch_size, block_size), EOT, dtype=torch.long)
        targets = torch.full((batch_size, block_size), -1, dtype=torch.long)
        images = []
        for b in range(batch_size):
            toks, flags, row_images = [], [], []
            while True:
                ex = self.example(split, int(rng.integers(2**31)))
                # one form: no draw, so the default stream is what it always was
                f = forms[0] if len(forms) == 1 else forms[int(rng.integers(len(forms)))]
                t, fl, im = self.tokens(ex, f, supervise)
                if len(t) > block_size + 1:
                    raise ValueError(f"block_size={block_size} is too small for a {len(t)}-token example")
                if len(toks) + len(t) > block_size + 1:
                    break
                toks, flags, row_images = toks + t, flags + fl, row_images + im
            n = len(toks)
            idx[b, : min(n, block_size)] = torch.tensor(toks[:block_size])
            tgt = torch.tensor(toks[1:]).masked_fill(~torch.tensor(flags[1:]), -1)
            targets[b, : n - 1] = tgt
            images.append(row_images)
        return idx, targets, images

    def report(self, model, split: str = "val", n: int = 200) -> dict:
        """{"vision_acc": image questions} for train.py's log."""
        return {"vision_acc": self.evaluate(model, split, n)}

    def majority_baseline(self, split: str = "val", n: int = 200, n_train: int = 3000) -> float:
        """Chance level, honestly measured: accuracy on split's first n examples of always giving
        each task's most common training answer."""
        common = {}
        for ex in (self.example("train", i) for i in range(n_train)):
            common.setdefault(ex["task"], Counter())[ex["answer"]] += 1
        exs = [self.example(split, i) for i in range(n)]
        return sum(ex["answer"] == common[ex["task"]].most_common(1)[0][0] for ex in exs if ex["task"] in common) / n

    def evaluate(self, model, split: str = "val", n: int = 200, form: str = "image", batch_size: int = 25) -> float:
        """Exact-match accuracy on the first n examples of `split`, asked as images or as text twins."""
        hits = self.hits(model, split, n, form, batch_size)
        return sum(hits) / max(1, len(hits))

    @torch.no_grad()
    def hits(self, model, split: str = "val", n: int = 200, form: str = "image", batch_size: int = 25) -> list:
        """[bool] per example of the first n of `split`: whether the model's greedy answer is exact.

        One forward pass per batch: the answer counts as correct when the argmax at every answer
        position (the answer tokens and the closing EOT) is the right token, which is exactly
        when greedy decoding from the prompt would print the answer and stop."""
        if form not in ("image", "twin"):
            raise ValueError(f"form={form!r}: questions are asked as image or twin")
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        examples = [self.example(split, i) for i in range(n)]
        out = []
        for start in range(0, len(examples), batch_size):
            rows = [self.tokens(e, form) for e in examples[start: start + batch_size]]
            T = max(len(t) for t, _, _ in rows) - 1
            idx = torch.full((len(rows), T), EOT, dtype=torch.long)
            targets = torch.full((len(rows), T), -1, dtype=torch.long)
            for b, (t, f, _) in enumerate(rows):
                idx[b, : len(t) - 1] = torch.tensor(t[:-1])
                targets[b, : len(t) - 1] = torch.tensor(t[1:]).masked_fill(~torch.tensor(f[1:]), -1)
            images = None if form == "twin" else [im for _, _, im in rows]
            logits, _ = model(idx.to(device), images=images)
            if logits.shape[1] != T:
                raise ValueError(f"evaluate needs logits at every position; the model returned {tuple(logits.shape)}")
            hit = (logits.argmax(-1).cpu() == targets) | (targets == -1)
            out += hit.all(dim=1).tolist()
        model.train(was_training)
        return out


# -----------------------------------------------------------------------------
# A pretrained encoder: the ViT taught to read scene attributes before any language model sees it

def patch_labels(scene: dict, patch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per patch (raster order of vision.patch_grid): colour (0 none, 1.. COLORS), kind (0 none, 1.. KINDS)
    and side (0 left, 1 middle, 2 right; -1 where no shape) of the shape in the patch's cell. [rows*cols] long each."""
    if CELL % patch:
        raise ValueError(f"patch={patch}: the encoder's labels need a patch size that divides the {CELL}-pixel cell")
    H, W = scene["size"]
    rows, cols = patch_grid(H, W, patch)
    color = torch.zeros(rows, cols, dtype=torch.long)
    kind = torch.zeros(rows, cols, dtype=torch.long)
    side = torch.full((rows, cols), -1, dtype=torch.long)
    per = CELL // patch                                  # patches per cell side
    for o in scene["objects"]:
        cell = (slice(o["row"] * per, (o["row"] + 1) * per), slice(o["col"] * per, (o["col"] + 1) * per))
        color[cell] = 1 + list(COLORS).index(o["color"])
        kind[cell] = 1 + KINDS.index(o["kind"])
        side[cell] = ("left", "middle", "right").index(side_of(o, scene))
    return color.flatten(), kind.flatten(), side.flatten()


def pretrain_encoder(config, seed: int, steps: int = 300, batch_size: int = 32, lr: float = 3e-3,
                     tasks=FEW_TASKS, n_check: int = 200) -> tuple[dict, dict]:
    """The ViT of a vision.EarlyFusion(config), built under torch.manual_seed(seed) and trained alone on
    train scenes of `tasks` to read each patch's colour, kind and side and the scene's shape count (a
    linear head on each patch feature, one on their mean; AdamW). K2.5 starts from a pretrained MoonViT;
    this is that step in miniature, so every fusion arm starts from the same encoder that can already see.
    -> (vision.EarlyFusion.encoder_state(), {"colour", "kind", "side", "count": accuracy on n_check val
    scenes, "steps", "seconds"}). The projector is not trained here: it is the language model's side."""
    import time
    from vision import EarlyFusion
    t0 = time.time()
    torch.manual_seed(seed)
    fusion = EarlyFusion(config)
    dim = fusion.patch_embed.out_features
    heads = torch.nn.ModuleDict(dict(patch=torch.nn.Linear(dim, len(COLORS) + 1 + len(KINDS) + 1 + 3),
                                     count=torch.nn.Linear(dim, 10)))
    params = [p for n, p in fusion.named_parameters() if not n.startswith("projector.")] + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    nc, nk = len(COLORS) + 1, len(KINDS) + 1
    ce = torch.nn.functional.cross_entropy

    def outputs(exs):
        """Per size group: (patch logits [G, N, nc+nk+3], count logits [G, 10], labels)."""
        by_size = {}
        for ex in exs:
            by_size.setdefault(ex["scene"]["size"], []).append(ex)
        for group in by_size.values():
            feats, _ = fusion.features(torch.stack([torch.from_numpy(e["image"]) for e in group]))  # [G, N, dim]
            labels = [patch_labels(e["scene"], fusion.patch) for e in group]
            color, kind, side = (torch.stack([lab[i] for lab in labels]) for i in range(3))          # [G, N] each
            count = torch.tensor([len(e["scene"]["objects"]) for e in group])
            yield heads["patch"](feats), heads["count"](feats.mean(dim=1)), color, kind, side, count

    for step in range(steps):
        exs = [make_example(seed, "train", step * batch_size + b, tasks) for b in range(batch_size)]
        loss = 0.0
        for logits, count_logits, color, kind, side, count in outputs(exs):
            loss = loss + len(count) / batch_size * (
                ce(logits[..., :nc].flatten(0, 1), color.flatten()) + ce(logits[..., nc:nc + nk].flatten(0, 1), kind.flatten())
                + ce(logits[..., nc + nk:].flatten(0, 1), side.flatten(), ignore_index=-1) + ce(count_logits, count))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    right, total = Counter(), Counter()
    with torch.no_grad():
        exs = [make_example(seed, "val", i, tasks) for i in range(n_check)]
        for logits, count_logits, color, kind, side, count in outputs(exs):
            shape = color > 0                                         # the patches that hold a shape
            for name, pred, want in (("colour", logits[..., :nc].argmax(-1), color),
                                     ("kind", logits[..., nc:nc + nk].argmax(-1), kind),
                                     ("side", logits[..., nc + nk:].argmax(-1), side)):
                right[name] += int((pred == want)[shape].sum())
                total[name] += int(shape.sum())
            right["count"] += int((count_logits.argmax(-1) == count).sum())
            total["count"] += len(count)
    check = {k: right[k] / max(1, total[k]) for k in ("colour", "kind", "side", "count")}
    return fusion.encoder_state(), dict(check, steps=steps, seconds=time.time() - t0)


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
    print(f"wrote {path}; caption of the first sample:{caption(examples[0]['scene'])}")


if __name__ == "__main__":
    sys.exit(main())
