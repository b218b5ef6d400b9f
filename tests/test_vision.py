"""Tests for vision.py and image_tasks.py: procedural data, captions and the wrapper twins share with image rows,
patches and 2-D positions, the fusion hook, loss masks, mixed batches, evaluation, the pretrained encoder, and a
tiny model.GPT that learns to answer visual questions."""
import re

import numpy as np
import pytest
import torch

import image_tasks
import vision
from vision import IMAGE_END, IMAGE_PAD, IMAGE_START, EOT

PALETTE = {"red": (1.0, 0.15, 0.15), "green": (0.15, 0.85, 0.2), "blue": (0.2, 0.35, 1.0), "yellow": (1.0, 0.9, 0.1)}


@pytest.fixture(scope="module")
def tasks():
    return image_tasks.VisionTasks(seed=0)


# ----------------------------------------------------------------------------- data

def test_generator_is_deterministic():
    for i in range(12):
        a, b = image_tasks.make_example(0, "train", i), image_tasks.make_example(0, "train", i)
        assert a["question"] == b["question"] and a["answer"] == b["answer"] and a["key"] == b["key"]
        assert np.array_equal(a["image"], b["image"])
    other = [image_tasks.make_example(1, "train", i)["key"] for i in range(12)]
    assert other != [image_tasks.make_example(0, "train", i)["key"] for i in range(12)], "the seed changes nothing"
    r1, r2 = image_tasks.VisionTasks(seed=0).batch("train", 3, 96, 7), image_tasks.VisionTasks(seed=0).batch("train", 3, 96, 7)
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
    assert all(torch.equal(x, y) for a, b in zip(r1[2], r2[2]) for x, y in zip(a, b))


def _components(mask):
    """4-connected components of a boolean [H, W] mask, as lists of (y, x); written here, not in vision.py."""
    seen = np.zeros_like(mask)
    comps = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        stack, comp = [(y0, x0)], []
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            comp.append((y, x))
            for dy, dx in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                v, u = y + dy, x + dx
                if 0 <= v < mask.shape[0] and 0 <= u < mask.shape[1] and mask[v, u] and not seen[v, u]:
                    seen[v, u] = True
                    stack.append((v, u))
        comps.append(comp)
    return comps


def _objects_from_pixels(image):
    """Shapes seen in a rendered image [3, H, W]: colour by nearest palette entry, kind by outline,
    cell from the centre of the bounding box."""
    objs = []
    for comp in _components(image.max(axis=0) > 0.05):
        ys, xs = np.array([p[0] for p in comp]), np.array([p[1] for p in comp])
        rgb = image[:, ys, xs].mean(axis=1)
        color = min(PALETTE, key=lambda c: np.sum((np.array(PALETTE[c]) - rgb) ** 2))
        top, bottom = (ys == ys.min()).sum(), (ys == ys.max()).sum()
        width = xs.max() - xs.min() + 1
        if len(comp) == width * (ys.max() - ys.min() + 1):
            kind = "square"
        elif top < bottom:
            kind = "triangle"
        else:
            assert top == bottom, "a shape that is neither square, circle nor triangle"
            kind = "circle"
        objs.append({"color": color, "kind": kind, "col": int((xs.min() + xs.max()) / 2) // 8})
    return objs


def _read_number(image):
    """Digits in an image by template matching each ink segment against the glyph atlas."""
    ink = image.max(axis=0)
    cols = np.nonzero(ink.max(axis=0) > 0)[0]
    segments, start = [], cols[0]
    for a, b in zip(cols[:-1], cols[1:]):
        if b != a + 1:
            segments.append((start, a))
            start = b
    segments.append((start, cols[-1]))
    digits = []
    for x0, x1 in segments:
        crop = ink[:, x0: x1 + 1]
        rows = np.nonzero(crop.max(axis=1) > 0)[0]
        crop = crop[rows[0]: rows[-1] + 1]
        best = min((np.abs(g - crop).sum() if g.shape == crop.shape else np.inf, d) for d, g in image_tasks.digit_glyphs().items())
        assert best[0] < 1e-4, "an ink segment matches no glyph"
        digits.append(best[1])
    return " ".join(digits)


def _solve(question, objs, image):
    """Answer a question from the objects seen in the pixels, parsing only the question text."""
    colors = [o["color"] for o in objs]
    if question == "What number is written?":
        return _read_number(image)
    if question == "How many shapes are there?":
        return str(len(objs))
    if question == "What colour is the shape?":
        return colors[0]
    if question == "Is the shape on the left or the right?":
        return "left" if 2 * objs[0]["col"] + 1 < image.shape[2] // 8 else "right"
    if m := re.fullmatch(r"Is the (\w+) on the left or the right\?", question):
        (o,) = [o for o in objs if o["kind"] == m[1]]
        return "left" if 2 * o["col"] + 1 < image.shape[2] // 8 else "right"
    if m := re.fullmatch(r"How many (\w+) shapes are there\?", question):
        return str(colors.count(m[1]))
    if m := re.fullmatch(r"What colour is the (\w+)\?", question):
        (o,) = [o for o in objs if o["kind"] == m[1]]
        return o["color"]
    if m := re.fullmatch(r"Are there more (\w+) or (\w+) shapes\?", question):
        assert colors.count(m[1]) != colors.count(m[2])
        return m[1] if colors.count(m[1]) > colors.count(m[2]) else m[2]
    if m := re.fullmatch(r"Is the (\w+) (\w+) left or right of the (\w+) (\w+)\?", question):
        (a,) = [o for o in objs if (o["color"], o["kind"]) == (m[1], m[2])]
        (b,) = [o for o in objs if (o["color"], o["kind"]) == (m[3], m[4])]
        return "left" if a["col"] < b["col"] else "right"
    raise AssertionError(f"unparsed question {question!r}")


def test_answers_rederived_from_pixels():
    seen_tasks = set()
    for split in ("train", "val"):
        for i in range(80):
            ex = image_tasks.make_example(3, split, i)
            seen_tasks.add(ex["task"])
            objs = _objects_from_pixels(ex["image"]) if ex["task"] != "ocr" else []
            if ex["task"] != "ocr":
                assert len(objs) == len(ex["scene"]["objects"])
            assert _solve(ex["question"], objs, ex["image"]) == ex["answer"], (ex["task"], ex["question"])
    assert seen_tasks == set(image_tasks.TASKS)
    for i in range(60):                                       # the few-shape tasks: 1-3 shapes of different kinds
        ex = image_tasks.make_example(3, "train", i, image_tasks.FEW_TASKS)
        objs = _objects_from_pixels(ex["image"])
        assert len(objs) == len(ex["scene"]["objects"]) <= 3 and len({o["kind"] for o in objs}) == len(objs)
        assert _solve(ex["question"], objs, ex["image"]) == ex["answer"], (ex["task"], ex["question"])
    sizes = {image_tasks.make_example(3, "train", i)["image"].shape[1:] for i in range(60)}
    assert len(sizes) >= 4, "images should come in several sizes"


def test_caption_rows_and_twins_share_the_image_rows_wrapper():
    """Token level: an image row is [image] Q: .. A: answer EOT, its twin the same tokens with the caption in
    place of the image, and the caption row [image] caption EOT: the caption tokens are the same in both."""
    tasks = image_tasks.VisionTasks(seed=0, patch=8, tasks=image_tasks.ALL_TASKS)
    seen = set()
    for i in range(60):
        ex = tasks.example("train", i)
        seen.add(ex["task"])
        image, image_flags, image_images = tasks.tokens(ex, "image")
        twin, twin_flags, twin_images = tasks.tokens(ex, "twin")
        cap, cap_flags, cap_images = tasks.tokens(ex, "caption")
        span = tasks.image_span(ex)
        n = len(span)
        assert span[0] == IMAGE_START and span[-1] == IMAGE_END and set(span[1:-1]) == {IMAGE_PAD}
        assert image[:n] == cap[:n] == span and cap[-1] == image[-1] == twin[-1] == EOT
        words = cap[n:-1]                                          # the caption, as the caption row writes it
        assert twin == words + image[n:], "the twin is its image row with the caption in place of the image"
        assert twin_flags == [False] * len(words) + image_flags[n:]   # the same answer span carries the loss
        assert cap_flags == [False] * n + [True] * (len(words) + 1)   # a caption row's "answer" is its caption
        assert twin_images == [] and len(image_images) == len(cap_images) == 1
        assert torch.equal(image_images[0], cap_images[0])
        text = tasks.enc.decode(words)
        assert text == image_tasks.caption(ex["scene"])
        for o in ex["scene"]["objects"]:                           # colour, kind and side in words
            side = image_tasks.side_of(o, ex["scene"])
            assert f"a {o['color']} {o['kind']} {image_tasks.SIDES[side]}" in text
        if ex["scene"]["text"]:
            assert " ".join(ex["scene"]["text"]) in text
        # supervise="text": every text token is a target, no image token ever is
        toks, flags, _ = tasks.tokens(ex, "caption", supervise="text")
        assert flags == [t not in (IMAGE_START, IMAGE_PAD, IMAGE_END) for t in toks]
    assert seen == set(image_tasks.ALL_TASKS)
    assert image_tasks.caption({"size": (24, 24), "text": "", "objects": [
        {"color": "red", "kind": "square", "row": 0, "col": 0}, {"color": "blue", "kind": "circle", "row": 1, "col": 1},
        {"color": "green", "kind": "triangle", "row": 2, "col": 2}]}) == \
        " a red square on the left, a blue circle in the middle and a green triangle on the right."


def test_a_mixed_form_batch_draws_a_form_per_example(tasks):
    idx, targets, images = tasks.batch("train", 4, 128, 1, form=("caption", "image"), supervise="text")
    n_images = sum(len(row) for row in images)
    assert n_images == int((idx == IMAGE_START).sum()) and 0 < int((idx == IMAGE_START).sum())
    text = " ".join(tasks.enc.decode([t for t in row.tolist() if t < EOT]) for row in idx)
    assert " Q: " in text and " on the " in text                   # both forms occur
    assert (targets[torch.isin(idx, torch.tensor([IMAGE_START, IMAGE_PAD]))] == -1).all()
    with pytest.raises(ValueError, match="form"):
        tasks.batch("train", 1, 96, 0, form="audio")


def test_splits_are_disjoint():
    train = {image_tasks.make_example(0, "train", i)["key"] for i in range(400)}
    val = {image_tasks.make_example(0, "val", i)["key"] for i in range(400)}
    assert not train & val
    assert all(image_tasks.split_of(k) == "train" for k in train) and all(image_tasks.split_of(k) == "val" for k in val)
    assert len(val) > 300, "val examples should be mostly distinct"
    # few-shape tasks split by the arrangement alone: no val scene is captioned or asked about in training
    def arrangement(ex):
        return image_tasks.example_key(ex["scene"], "")
    few = image_tasks.FEW_TASKS
    train = {arrangement(image_tasks.make_example(0, "train", i, few)) for i in range(2000)}
    val = [arrangement(image_tasks.make_example(0, "val", i, few)) for i in range(400)]
    assert not train & set(val) and len(set(val)) >= 300


# ----------------------------------------------------------------------------- patches and positions

def unpatchify(patches, grid, patch, size):
    """Inverse of vision.patchify: [G, rows*cols, C*p*p] -> [G, C, H, W], cropping the padding."""
    G, _, K = patches.shape
    rows, cols = grid
    C = K // (patch * patch)
    x = patches.view(G, rows, cols, C, patch, patch).permute(0, 3, 1, 4, 2, 5)  # [G, C, rows, p, cols, p]
    return x.reshape(G, C, rows * patch, cols * patch)[:, :, :size[0], :size[1]]


def unmerge_2x2(x, rows, cols):
    """Inverse of vision.merge_2x2: [G, rows/2 * cols/2, 4D] -> [G, rows*cols, D]."""
    G, _, D4 = x.shape
    x = x.view(G, rows // 2, cols // 2, 2, 2, D4 // 4).permute(0, 1, 3, 2, 4, 5)  # [G, R, 2, Cc, 2, D]
    return x.reshape(G, rows * cols, D4 // 4)


@pytest.mark.parametrize("H,W", [(1, 1), (5, 7), (28, 36), (33, 17), (24, 40)])
def test_patchify_unpatchify_odd_sizes(H, W):
    p = 4
    img = torch.rand(2, 3, H, W)
    patches, (rows, cols) = vision.patchify(img, p)
    assert rows % 2 == 0 and cols % 2 == 0 and rows * p >= H and cols * p >= W and (rows - 2) * p < H and (cols - 2) * p < W
    assert patches.shape == (2, rows * cols, 3 * p * p)
    assert torch.equal(unpatchify(patches, (rows, cols), p, (H, W)), img)
    # patch k sits at (row, col) = positions[k] and holds exactly that crop of the (zero-padded) image
    padded = torch.zeros(2, 3, rows * p, cols * p)
    padded[:, :, :H, :W] = img
    pos = vision.patch_positions(rows, cols)
    for k in (0, cols - 1, cols, rows * cols - 1):
        r, c = pos[k].tolist()
        assert torch.equal(patches[:, k], padded[:, :, r * p:(r + 1) * p, c * p:(c + 1) * p].reshape(2, -1))
    # the 2x2 merge: token j concatenates the patches (2R, 2C), (2R, 2C+1), (2R+1, 2C), (2R+1, 2C+1)
    merged = vision.merge_2x2(patches, rows, cols)
    assert merged.shape == (2, vision.image_token_count(H, W, p), 4 * 3 * p * p)
    j = merged.shape[1] - 1
    R, C = divmod(j, cols // 2)
    want = torch.cat([patches[:, (2 * R + dr) * cols + 2 * C + dc] for dr in (0, 1) for dc in (0, 1)], dim=1)
    assert torch.equal(merged[:, j], want)
    assert torch.equal(unmerge_2x2(merged, rows, cols), patches)


def test_patch_positions_are_2d():
    pos = vision.patch_positions(3, 5)
    assert pos.shape == (15, 2)
    assert pos[7].tolist() == [1, 2] and pos[14].tolist() == [2, 4] and pos[5].tolist() == [1, 0]


def test_rope_2d_scores_depend_on_2d_offset_only():
    head_dim = 16
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(pq, pk):
        cos, sin = vision.rope_2d(torch.tensor([pq, pk]), head_dim)
        qr = vision.apply_rope(q.expand(2, -1), cos, sin)[0]
        kr = vision.apply_rope(k.expand(2, -1), cos, sin)[1]
        return (qr * kr).sum().item()

    base = score((1, 2), (3, 0))
    assert score((4, 6), (6, 4)) == pytest.approx(base, abs=1e-5)        # the same (dr, dc) = (-2, 2)
    assert abs(score((1, 2), (1, 4)) - score((1, 2), (3, 2))) > 1e-3    # a row step is not a column step
    assert abs(score((0, 0), (0, 1)) - score((0, 0), (0, 0))) > 1e-3
    with pytest.raises(ValueError):
        vision.rope_2d(torch.zeros(1, 2, dtype=torch.long), 6)


# ----------------------------------------------------------------------------- the fusion hook

class _Cfg:
    n_embd = 24
    vision_n_embd = 16
    vision_n_layer = 1
    vision_n_head = 2


def _row(images, text=(5, 6)):
    ids = []
    for img in images:
        ids += [IMAGE_START] + [IMAGE_PAD] * vision.image_token_count(img.shape[1], img.shape[2]) + [IMAGE_END]
    return ids + list(text)


@pytest.mark.parametrize("n_layer", [0, 1])
def test_early_fusion_replaces_pad_rows_in_order(n_layer):
    cfg = _Cfg()
    cfg.vision_n_layer = n_layer
    fusion = vision.EarlyFusion(cfg)
    a, b, c = torch.rand(3, 28, 36), torch.rand(3, 8, 8), torch.rand(3, 13, 5)
    rows = [_row([a, b]), _row([]), _row([c])]
    T = max(map(len, rows))
    idx = torch.tensor([r + [EOT] * (T - len(r)) for r in rows])
    x = torch.randn(3, T, cfg.n_embd, requires_grad=True)
    out = fusion(x, idx, [[a, b], [], [c]])
    keep = idx != IMAGE_PAD
    assert torch.equal(out[keep], x[keep])
    ta, tb, tc = (fusion.encode(im[None])[0] for im in (a, b, c))
    assert torch.allclose(out[0][idx[0] == IMAGE_PAD], torch.cat([ta, tb]), atol=1e-6)
    assert torch.allclose(out[2][idx[2] == IMAGE_PAD], tc, atol=1e-6)
    out.sum().backward()
    assert fusion.patch_embed.weight.grad.abs().sum() > 0 and x.grad[keep].eq(1).all() and x.grad[~keep].eq(0).all()


def test_early_fusion_rejects_bad_inputs():
    fusion = vision.EarlyFusion(_Cfg())
    img = torch.rand(3, 8, 8)
    idx = torch.tensor([_row([img])])
    x = torch.zeros(1, idx.shape[1], 24)
    with pytest.raises(ValueError, match="IMAGE_PAD"):
        fusion(x, idx, [[img, img]])
    with pytest.raises(ValueError, match="one per batch row"):
        fusion(x, idx, [[img], []])
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        fusion(x, idx, [[torch.rand(1, 8, 8)]])
    with pytest.raises(ValueError, match="heads"):
        cfg = _Cfg()
        cfg.vision_n_embd = 20
        vision.EarlyFusion(cfg)


# ----------------------------------------------------------------------------- batches, loss mask, GPT

def test_batch_loss_mask(tasks):
    idx, targets, images = tasks.batch("train", 4, 128, 0)
    assert idx.shape == targets.shape == (4, 128) and idx.dtype == targets.dtype == torch.long
    image_ids = torch.tensor([IMAGE_START, IMAGE_PAD, IMAGE_END])
    assert (targets[torch.isin(idx, image_ids)] == -1).all(), "loss on an image position"
    assert not torch.isin(targets, image_ids).any()
    for b in range(4):
        n_slots = int((idx[b] == IMAGE_PAD).sum())
        assert n_slots == sum(vision.image_token_count(*im.shape[1:]) for im in images[b]) > 0
        t = torch.nonzero(targets[b] != -1)[:, 0]
        assert torch.equal(targets[b, t[t < 127]], idx[b, t[t < 127] + 1])
        # the supervised tokens are exactly the answers and their closing EOTs
        answers = tasks.enc.decode([v for v in targets[b][targets[b] != -1].tolist() if v != EOT])
        assert answers.strip() and (targets[b] == EOT).sum() == (idx[b] == IMAGE_START).sum()
    twin = tasks.batch("train", 2, 128, 0, form="twin")
    assert twin[2] == [[], []] and not torch.isin(twin[0], image_ids).any()


def _tiny_gpt(patch=4, **kw):
    import model
    cfg = model.Config(block_size=128, n_layer=1, n_head=2, n_embd=32, vision=True, tie_embeddings=True, **kw)
    cfg.vision_n_embd, cfg.vision_n_layer, cfg.vision_n_head, cfg.vision_patch_size = 32, 1, 2, patch
    return model.GPT(cfg)


def test_mixed_batch_through_gpt(tasks):
    gpt = _tiny_gpt()
    text_idx = torch.randint(0, 50257, (2, 96))
    text = (text_idx, torch.roll(text_idx, -1, 1), None)
    vis = tasks.batch("train", 2, 96, 1)
    idx, targets, images = image_tasks.concat_batches([text, vis])
    assert idx.shape == (4, 96) and images[:2] == [[], []] and len(images[2]) > 0
    logits, loss = gpt(idx, targets, images=images)
    assert torch.isfinite(loss)
    # text rows are untouched by the image rows next to them
    alone, _ = gpt(text_idx)
    assert torch.allclose(logits[:2], alone, atol=1e-5)
    loss.backward()
    assert gpt.vision.projector[-1].weight.grad.abs().sum() > 0, "no gradient reaches the image projector"


class _Oracle(torch.nn.Module):
    """Reads the answer off its own input: evaluate() feeds each example without its last token (the
    closing EOT) and pads shorter rows with EOT, so "the next input token, and EOT after the last one"
    is exactly the right prediction at every position (wrong=True shifts it to a wrong token)."""

    def __init__(self, wrong=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.wrong = wrong

    def forward(self, idx, targets=None, images=None):
        nxt = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], vision.EOT)], dim=1) + (1 if self.wrong else 0)
        return torch.zeros(*idx.shape, 50304).scatter(2, nxt[..., None], 1.0), None


def test_evaluate_is_exact_match(tasks):
    assert tasks.evaluate(_Oracle(), "val", 20) == 1.0
    assert tasks.evaluate(_Oracle(), "val", 20, form="twin") == 1.0
    assert tasks.hits(_Oracle(wrong=True), "val", 5) == [False] * 5
    assert tasks.evaluate(_Oracle(wrong=True), "val", 20) == 0.0
    assert 0.0 <= tasks.majority_baseline("val", 100, n_train=600) < 0.5


def test_tiny_gpt_learns_a_visual_task():
    """A 1-layer, 32-wide model.GPT trained 160 steps with MuonClip on "What colour is the shape?"
    must beat the best image-blind answer by a wide margin. The blind baseline is the best constant
    answer on these very val examples (0.42: the first 100 val scenes are 42% red), stronger than the
    train-majority baseline (0.22). Measured on a 2-core CPU, 2026-12-02: accuracy 1.00 after 160
    steps in ~40 s. With AdamW (lr 1e-2 or 3e-3, 300 steps) the same model never reads the image: its
    one attention layer collapses onto the "A:" tokens and it answers the prior (0.42 / 0.22)."""
    from collections import Counter
    from muonclip import MuonClip
    torch.manual_seed(0)
    tasks = image_tasks.VisionTasks(seed=0, tasks=("color_one",), patch=8)
    gpt = _tiny_gpt(patch=8)
    opt = MuonClip.from_model(gpt, lr=1e-2, weight_decay=0.0, qk_clip_tau=10.0)
    rng = np.random.default_rng(0)
    for step in range(160):
        idx, targets, images = tasks.batch("train", 8, 40, rng)
        _, loss = gpt(idx, targets, images=images)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    answers = Counter(tasks.example("val", i)["answer"] for i in range(100))
    blind = max(answers.values()) / 100
    acc = tasks.evaluate(gpt, "val", 100)
    print(f"tiny GPT visual accuracy {acc:.2f} vs best blind answer {blind:.2f}")
    assert acc > blind + 0.3, f"accuracy {acc:.2f} is not clearly above the best blind answer {blind:.2f}"


def test_pretrained_encoder_reads_scene_attributes_and_loads_into_a_model():
    """image_tasks.pretrain_encoder trains the ViT alone (no projector) on patch colour, kind, side and the
    scene count; its state loads into a fresh model's EarlyFusion bit for bit, and one of another shape is refused."""
    import model
    cfg = model.Config(block_size=64, n_layer=1, n_head=2, n_embd=32, vision=True, vision_patch_size=8,
                       vision_n_embd=16, vision_n_layer=1, vision_n_head=2)
    state, check = image_tasks.pretrain_encoder(cfg, seed=0, steps=60, batch_size=16, n_check=60)
    assert not any(k.startswith("projector.") for k in state) and "patch_embed.weight" in state
    assert check["colour"] > 0.6 and check["count"] > 0.5, check        # chance: 0.25 and 1/3 (0.75, 0.82 measured)
    again, _ = image_tasks.pretrain_encoder(cfg, seed=0, steps=60, batch_size=16, n_check=0)
    assert all(torch.equal(state[k], again[k]) for k in state), "the same seed pretrains the same encoder"
    gpt = model.GPT(cfg)
    gpt.vision.load_encoder(state)
    assert all(torch.equal(v, state[k]) for k, v in gpt.vision.encoder_state().items())
    with pytest.raises(ValueError, match="does not fit"):
        model.GPT(model.Config(**{**cfg.__dict__, "vision_n_embd": 32})).vision.load_encoder(state)
