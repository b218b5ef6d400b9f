"""Early vs mid vs late fusion, and cross-modal transfer both ways, judged (Kimi K2.5, arXiv 2602.02276).

The claims. Table 1: at a fixed total of vision and text tokens, vision from the start at a low ratio
(early: 10% from step 0) beats injecting it later at a higher one (mid: 20% from 50%, late: 50% from
80%) on vision tasks, and text does not suffer for it. §2.2: text-only SFT activates visual skills
(zero-vision SFT). Table 2: training on vision tasks improves text tasks.

1. Fusion timing. One ViT per seed is pretrained alone on scene attributes (colour, kind and side of
   each patch's shape, the shape count: image_tasks.pretrain_encoder, K2.5's pretrained MoonViT in
   miniature) and every arm starts from it, bit for bit, with the same language-model init; then ViT and
   LM train jointly, as K2.5 does (a frozen ViT is run per arm as a reported check). The model is
   train.py's CPU default (KKKA + block AttnRes, 4 layers x 128, ViT 1 x 64 at patch 8, MuonClip, its
   weight decay and clipping), 10 rows x 128 tokens per step, on train.py's WSD schedule (Kimi K2's kind:
   the late arm's vision meets the decay from the peak lr, where cosine leaves it <= 0.2x the peak).
   Image rows pack caption rows and question rows (image_tasks' forms) with the loss on every text
   token, so image rows weigh in the loss by about their row share (the measured share is reported).
   Every arm consumes the same text rows and the same image rows, in its own order: equal vision and
   text tokens. Tasks: the few-shape colour, side and count questions (1-3 shapes). Each arm trains at
   the best of --lrs on the tuning seed (final image accuracy, ties by text loss; a winning edge of the
   grid grows by a factor 2, twice at most), then once per judging seed; accuracy on --n_eval held-out
   questions, text val loss on fixed windows of held-out Shakespeare.
   Gate (the positive control): every arm ends >= GATE above the best blind answer on the tuning seed;
   if one does not, the tuned arms run again at 2x, then 3x the steps, and the judged runs use the first
   length that passes (if none does, the row reads "not testable at this scale" with the gate's numbers,
   and the judging seeds are not run unless --judge_failed_gate asks).
   The gate is checked again on the judging seeds: every arm's mean must end >= GATE above their mean blind
   answer, or the row reads "not testable at this scale" (an arm that cannot read the images cannot time them).
   Verdict: reproduces iff both gates passed, mean accuracy early >= mid >= late, early - late > 2 SE and
   positive in every judging seed, and early's text loss not worse than late's by more than 2 SE.
2. Cross-modal transfer. Two models per seed, from the same encoder: the mix "text + image rows (captions
   and colour questions) + twin rows (colour questions, the caption in place of the image)", and the
   same mix without caption rows (their image rows are all colour questions: as many image tokens).
   Side questions appear in neither, in neither modality. Then supervised fine-tunes (loss on the answer):
       zero-vision SFT   side twins only (text)     -> image side questions
       vision -> text    side images only           -> text-twin side questions
   each on both models, against no fine-tune; the same-modality result of the other fine-tune is the
   ceiling that must pass the gate. Each (model, fine-tune) at its best of --sft_lrs on the tuning seed by the
   accuracy in its own modality, among fine-tunes that keep the text val loss within SFT_TEXT_SLACK of the base.
   Verdict per direction: the captioned model beats its no-caption control by > 2 SE, in every seed.

    nice python experiments/fusion_timing.py --pilot        # one run per arm on the tuning seed: time and gate
    nice python experiments/fusion_timing.py --jobs 2      # the README's tables (CPU; see the README for hours)
    nice python experiments/fusion_timing.py --jobs 2 --reuse --part=transfer   # one half, finished runs read back
    python experiments/fusion_timing.py --quick             # seconds (CI)

Writes fusion_timing.{md,json,png} under --out_dir, and each run's result.json (--reuse reads them back).
"""
import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402
import image_tasks  # noqa: E402
import protocol  # noqa: E402
import train  # noqa: E402
from model import GPT  # noqa: E402
from runs import bounded, bounded_list  # noqa: E402
from vision import IMAGE_PAD  # noqa: E402

OUT = os.path.join(ROOT, "out", "fusion_timing")
ARMS = {"early": (0.1, 0.0), "mid": (0.2, 0.5), "late": (0.5, 0.8)}    # vision share of the rows, from which fraction
GATE = 0.2                        # every arm this far above the best blind answer, or the setup cannot see fusion
SEEN, HELD = ("color_few",), ("side_few",)      # transfer: the question type trained, the one held out of both modalities
# per step of --batch_size rows; the rest are text. At 2 image + 1 twin rows the pilot (seed 1337, 300 steps) learnt
# neither colour read-out to build on (twins 0.27, images 0.27 with captions / 0.53 without); at 4 + 3, both 1.00
TRANSFER_ROWS = dict(image=4, twin=3)
SFT_TEXT_SLACK = 1.0                            # nats of text val loss a fine-tune may add to its base model's
QUICK = dict(n_layer=4, n_head=2, n_embd=32, block_size=40, vision_n_embd=16, vision_n_head=2)


# ----------------------------------------------------------------------------- the model, the data, the plan

def train_config(common: dict, lr: float, steps: int, weight_decay: float = 0.1, schedule: str = ""):
    """train.py's CPU default (the mission's model, MuonClip, its weight decay and clipping) at this lr, length and
    schedule (train.py's cosine or wsd: warmup, flat, linear decay over the last 20%)."""
    return train.make_config(dict(common["model"], lr=lr, max_iters=steps, warmup_iters=max(1, steps // 10),
                                  weight_decay=weight_decay, schedule=schedule or common["schedule"]), cuda=False)


def vision_rows(arm: str, step: int, steps: int, batch_size: int) -> int:
    """Image rows at this step of this arm: its share of the batch once its start fraction is reached."""
    ratio, start = ARMS[arm]
    return round(ratio * batch_size) if step >= round(start * steps) else 0


def vision_plan(steps: int, batch_size: int) -> dict:
    """{arm: image rows over the run}; main refuses a length at which they differ."""
    return {arm: sum(vision_rows(arm, s, steps, batch_size) for s in range(steps)) for arm in ARMS}


class Rows:
    """Every row a run can draw, by index, so runs that differ only in timing draw the same rows:
    text row j is a window of the training text at an offset fixed by (seed, j); image row i of a pool
    is packed from examples fixed by (seed, pool, i)."""

    def __init__(self, seed: int, common: dict, tasks):
        self.seed, self.T, self.tasks = seed, common["model"]["block_size"], tasks
        folder = data.prepare(common["data"])
        self.train, self.val = data.load_split(folder, "train"), data.load_split(folder, "val")
        gen = torch.Generator().manual_seed(1234)     # the same held-out windows for every run
        B = common["batch_size"]
        self.val_batches = [data.get_batch(self.val, torch.randint(0, len(self.val) - self.T - 1, (B,), generator=gen), self.T)
                            for _ in range(common["eval_iters"])]

    def text(self, start: int, n: int):
        offsets = torch.tensor([int(np.random.default_rng([self.seed, 0, j]).integers(len(self.train) - self.T - 1))
                                for j in range(start, start + n)], dtype=torch.long)
        x, y = data.get_batch(self.train, offsets, self.T)
        return x, y, None

    def vision(self, pool: int, start: int, n: int, form, supervise: str = "text", tasks=None):
        rows = [(tasks or self.tasks).batch("train", 1, self.T, np.random.default_rng([self.seed, pool, i]), form, supervise)
                for i in range(start, start + n)]
        return image_tasks.concat_batches(rows) if rows else None


@torch.no_grad()
def text_val_loss(model, rows: Rows) -> float:
    was = model.training
    model.eval()
    loss = statistics.fmean(model(x, y)[1].item() for x, y in rows.val_batches)
    model.train(was)
    return loss


def digest(state: dict) -> str:
    """sha256 of a state dict's tensors in key order: equal iff bit-identical."""
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def new_model(common: dict, seed: int, encoder_path: str) -> GPT:
    """The language model of every run on this seed: the same init (torch seed), the seed's pretrained ViT."""
    cfg = train_config(common, 1e-3, 1).model
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.vision.load_encoder(torch.load(encoder_path, map_location="cpu", weights_only=True)["state"])
    return model


def task_sets(common: dict, seed: int) -> dict:
    enc, patch = data.get_tokenizer(), common["model"]["vision_patch_size"]
    return {name: image_tasks.VisionTasks(seed=seed, encoding=enc, patch=patch, tasks=tasks)
            for name, tasks in (("fusion", tuple(common["tasks"])), ("seen", SEEN), ("held", HELD))}


def without_sft(common: dict) -> dict:
    """The settings a fusion run or a transfer pretraining depends on: all but the fine-tunes' (a new
    --sft_steps reuses them)."""
    return {k: v for k, v in common.items() if not k.startswith("sft_")}


def saved_result(path: str, signature: dict, reuse: bool):
    """A finished run's result.json when --reuse is given and the run was made with the same settings."""
    if reuse and os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        if result.get("signature") == signature:
            print(f"reused {path}", flush=True)
            return result
    return None


def write_result(path: str, result: dict):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------- the shared encoder

def encoder(seed: int, common: dict, out_root: str, reuse: bool) -> dict:
    """Pretrain (or read back) this seed's ViT: out_root/encoder/seed<s>.pt holds its state dict."""
    path = os.path.join(out_root, "encoder", f"seed{seed}.pt")
    signature = dict(model=common["model"], tasks=common["tasks"], steps=common["encoder_steps"])
    if reuse and os.path.exists(path):
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("signature") == json.dumps(signature, sort_keys=True):
            print(f"reused {path}", flush=True)
            return dict(seed=seed, path=path, check=json.loads(saved["check"]), digest=digest(saved["state"]))
    t0, cpu0 = time.time(), time.process_time()
    cfg = train_config(common, 1e-3, 1).model
    state, check = image_tasks.pretrain_encoder(cfg, seed, steps=common["encoder_steps"], tasks=tuple(common["tasks"]))
    check["cpu_s"] = time.process_time() - cpu0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(state=state, check=json.dumps(check), signature=json.dumps(signature, sort_keys=True)), path + ".tmp")
    os.replace(path + ".tmp", path)
    print(f"[encoder seed {seed}] colour {check['colour']:.3f} kind {check['kind']:.3f} side {check['side']:.3f} "
          f"count {check['count']:.3f} on val scenes, {time.time() - t0:.0f}s", flush=True)
    return dict(seed=seed, path=path, check=check, digest=digest(state))


# ----------------------------------------------------------------------------- 1. fusion timing

def fusion_run(arm: str, seed: int, lr: float, steps: int, common: dict, encoder_path: str, out_root: str,
               reuse: bool = False, frozen: bool = False) -> dict:
    """One arm on one seed at one lr -> curves, final image accuracy (per task) and text val loss, the
    loss share of image tokens, the vision tokens consumed and the encoder's digest at the start."""
    name = f"{arm}{'_frozen' if frozen else ''}"
    out = os.path.join(out_root, "fusion", name, f"seed{seed}_lr{lr:g}_steps{steps}", "result.json")
    signature = dict(without_sft(common), arm=arm, seed=seed, lr=lr, steps=steps, frozen=frozen)
    if (result := saved_result(out, signature, reuse)) is not None:
        return result
    t0, cpu0 = time.time(), time.process_time()
    tc = train_config(common, lr, steps)
    model = new_model(common, seed, encoder_path)
    start_digest = digest(model.vision.encoder_state())
    if frozen:                                       # the check: the pretrained ViT as it is, only the projector learns
        for n, p in model.vision.named_parameters():
            p.requires_grad_(n.startswith("projector."))
    opt = train.build_optimizer(model, tc)
    tasks = task_sets(common, seed)["fusion"]
    rows, B = Rows(seed, common, tasks), common["batch_size"]
    n_text = n_image = 0                             # rows consumed so far: each arm walks the same two sequences
    sup_image = sup_all = sup_image_on = sup_all_on = image_tokens = 0
    curve = []

    def evaluate(step, n):
        curve.append((step, text_val_loss(model, rows), tasks.evaluate(model, "val", n)))

    for step in range(steps):
        if step and step % common["eval_every"] == 0:
            evaluate(step, common["n_curve"])
        for g in opt.param_groups:
            g["lr"] = train.lr_at(step, tc)
        nv = vision_rows(arm, step, steps, B)
        parts = [rows.vision(1, n_image, nv, ("caption", "image"))] if nv else []
        idx, targets, images = image_tasks.concat_batches(parts + [rows.text(n_text, B - nv)])
        n_image, n_text = n_image + nv, n_text + B - nv
        image_tokens += int((idx[:nv] == IMAGE_PAD).sum())
        s_img, s_all = int((targets[:nv] != -1).sum()), int((targets != -1).sum())
        sup_image, sup_all = sup_image + s_img, sup_all + s_all
        if nv:
            sup_image_on, sup_all_on = sup_image_on + s_img, sup_all_on + s_all
        _, loss = model(idx, targets, images=images, loss_only=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
    hits = tasks.hits(model, "val", common["n_eval"])
    curve.append((steps, text_val_loss(model, rows), sum(hits) / len(hits)))
    by_task = {}
    for i, h in enumerate(hits):
        by_task.setdefault(tasks.example("val", i)["task"], []).append(h)
    result = dict(arm=arm, seed=seed, lr=lr, steps=steps, frozen=frozen, signature=signature, curve=curve,
                  acc=curve[-1][2], text=curve[-1][1], acc_by_task={t: statistics.fmean(h) for t, h in by_task.items()},
                  image_rows=n_image, text_rows=n_text, image_tokens=image_tokens,
                  share=sup_image / max(1, sup_all), share_on=sup_image_on / max(1, sup_all_on),
                  encoder_digest=start_digest, seconds=time.time() - t0, cpu_s=time.process_time() - cpu0)
    print(f"[{name} seed {seed} lr {lr:g} {steps} steps] image acc {result['acc']:.3f} text val {result['text']:.4f} "
          f"image-token loss share {result['share']:.3f} ({result['share_on']:.3f} while on) "
          f"{result['seconds']:.0f}s ({result['cpu_s'] / 60:.1f} CPU-min)", flush=True)
    write_result(out, result)
    return result


def best_lr(tuned: list, arm: str) -> float:
    """The arm's lr with the best final image accuracy on the tuning seed; ties (all at 0, say) by text val loss."""
    return max((r for r in tuned if r["arm"] == arm), key=lambda r: (r["acc"], -r["text"]))["lr"]


def gate_passed(runs: list, blind: dict) -> bool:
    return all(r["acc"] >= blind[r["seed"]] + GATE for r in runs)


def judge_fusion(judged: list, blind: dict, gate_ok: bool) -> dict:
    """The fusion claim from the judging runs: paired differences, the ordering, the verdict."""
    acc = {a: {r["seed"]: r["acc"] for r in judged if r["arm"] == a} for a in ARMS}
    text = {a: {r["seed"]: r["text"] for r in judged if r["arm"] == a} for a in ARMS}
    el, em, ml = protocol.paired(acc["early"], acc["late"]), protocol.paired(acc["early"], acc["mid"]), \
        protocol.paired(acc["mid"], acc["late"])
    tl = protocol.paired(text["early"], text["late"])
    means = {a: statistics.fmean(acc[a].values()) for a in ARMS}
    judged_gate = all(means[a] >= statistics.fmean(blind[s] for s in acc[a]) + GATE for a in ARMS)
    control = gate_ok and judged_gate
    order = means["early"] >= means["mid"] >= means["late"]
    holds = protocol.verdict(el, +1, control) == protocol.REPRODUCES and el.holds(+1) == len(el.seeds) and order \
        and not (len(tl.seeds) > 1 and tl.diff > 2 * tl.se)
    v = protocol.NOT_TESTABLE if not control else protocol.REPRODUCES if holds else protocol.DOES_NOT
    return dict(early_late=el, early_mid=em, mid_late=ml, text_early_late=tl, means=means, order=order,
                gate_tuning=gate_ok, gate_judged=judged_gate, verdict=v)


# ----------------------------------------------------------------------------- 2. transfer

def base_name(captions: bool) -> str:
    return "caption" if captions else "nocaption"


def pretrain_run(seed: int, lr: float, steps: int, captions: bool, common: dict, encoder_path: str, out_root: str,
                 reuse: bool = False) -> dict:
    """The transfer experiment's base model: text + image rows (captions and colour questions, or colour
    questions only) + twin rows (colour questions); side questions never. Saves model.pt beside result.json."""
    name = base_name(captions)
    folder = os.path.join(out_root, "transfer", name, f"seed{seed}_lr{lr:g}_steps{steps}")
    out = os.path.join(folder, "result.json")
    signature = dict(without_sft(common), seed=seed, lr=lr, steps=steps, captions=captions, rows=TRANSFER_ROWS)
    if (result := saved_result(out, signature, reuse)) is not None and os.path.exists(result["model"]):
        return result
    t0, cpu0 = time.time(), time.process_time()
    tc = train_config(common, lr, steps)
    model = new_model(common, seed, encoder_path)
    opt = train.build_optimizer(model, tc)
    sets = task_sets(common, seed)
    rows, B = Rows(seed, common, sets["seen"]), common["batch_size"]
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = train.lr_at(step, tc)
        idx, targets, images = pretraining_batch(rows, step, B, captions)
        _, loss = model(idx, targets, images=images, loss_only=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.pt")
    torch.save(model.state_dict(), path + ".tmp")
    os.replace(path + ".tmp", path)
    result = dict(seed=seed, lr=lr, steps=steps, captions=captions, signature=signature, model=path,
                  **transfer_eval(model, sets, rows, common), seconds=time.time() - t0, cpu_s=time.process_time() - cpu0)
    print(f"[pretrain {name} seed {seed}] colour: image {result['color_image']:.3f} twin {result['color_twin']:.3f}; "
          f"side (never trained): image {result['side_image']:.3f} twin {result['side_twin']:.3f}; "
          f"text val {result['text']:.4f}, {result['seconds']:.0f}s", flush=True)
    write_result(out, result)
    return result


def pretraining_batch(rows: Rows, step: int, batch_size: int, captions: bool):
    """Step `step` of the transfer pretraining mix: image rows (captions and colour questions, or colour
    questions only), a twin row (colour questions as text), text rows. The row pools are indexed by step."""
    ni, nt = TRANSFER_ROWS["image"], TRANSFER_ROWS["twin"]
    image = rows.vision(2 if captions else 3, step * ni, ni, ("caption", "image") if captions else "image")
    twin = rows.vision(4, step * nt, nt, "twin")
    return image_tasks.concat_batches([image, twin, rows.text(step * (batch_size - ni - nt), batch_size - ni - nt)])


def transfer_eval(model, sets: dict, rows: Rows, common: dict, colour: bool = True) -> dict:
    """Side questions (never pretrained) as images and as twins, text val loss, and (colour=True) the
    pretrained colour questions both ways."""
    n = common["n_eval"]
    out = dict(side_image=sets["held"].evaluate(model, "val", n, "image"),
               side_twin=sets["held"].evaluate(model, "val", n, "twin"), text=text_val_loss(model, rows))
    if colour:
        out.update(color_image=sets["seen"].evaluate(model, "val", n, "image"),
                   color_twin=sets["seen"].evaluate(model, "val", n, "twin"))
    return out


def sft_run(seed: int, base: dict, kind: str, lr: float, common: dict, encoder_path: str, out_root: str,
            reuse: bool = False) -> dict:
    """Fine-tune a pretrained transfer model on side questions only, as twins (kind "twin": zero-vision
    SFT) or as images (kind "image"), loss on the answer; kind "none" is the base model as pretrained."""
    pre = base_name(base["captions"])
    steps = common["sft_steps"] if kind != "none" else 0
    out = os.path.join(out_root, "transfer", f"{pre}_sft_{kind}", f"seed{seed}_lr{lr:g}_steps{steps}", "result.json")
    signature = dict(common, seed=seed, base=base["signature"], kind=kind, lr=lr)
    if (result := saved_result(out, signature, reuse)) is not None:
        return result
    if kind == "none":                              # no fine-tune: the base model's own evaluation
        return dict(seed=seed, pretrained=pre, kind=kind, lr=lr, steps=0, signature=signature, seconds=0.0, cpu_s=0.0,
                    **{k: base[k] for k in ("side_image", "side_twin", "color_image", "color_twin", "text")})
    t0, cpu0 = time.time(), time.process_time()
    model = new_model(common, seed, encoder_path)
    model.load_state_dict(torch.load(base["model"], map_location="cpu", weights_only=True))
    sets = task_sets(common, seed)
    rows = Rows(seed, common, sets["held"])
    tc = train_config(common, lr, steps, weight_decay=0.0, schedule="cosine")
    opt = train.build_optimizer(model, tc)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = train.lr_at(step, tc)
        idx, targets, images = sets["held"].batch("train", common["sft_batch"], rows.T,
                                                  np.random.default_rng([seed, 5, step]), kind, "answer")
        _, loss = model(idx, targets, images=images if kind == "image" else None, loss_only=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
    result = dict(seed=seed, pretrained=pre, kind=kind, lr=lr, steps=steps, signature=signature,
                  **transfer_eval(model, sets, rows, common, colour=False), seconds=time.time() - t0,
                  cpu_s=time.process_time() - cpu0)
    print(f"[{pre} + SFT {kind} seed {seed} lr {lr:g}] side: image {result['side_image']:.3f} twin "
          f"{result['side_twin']:.3f} | text val {result['text']:.4f}", flush=True)
    write_result(out, result)
    return result


# (claim, fine-tune, metric, ceiling fine-tune): the treated model is the captioned one, its control the
# no-caption one with the same fine-tune; the ceiling is the fine-tune in the evaluated modality
TRANSFER_CLAIMS = [("zero-vision SFT transfers to images (K2.5 §2.2): side twins only, then image side questions",
                    "twin", "side_image", "image"),
                   ("vision-only training improves text (K2.5 Table 2): side images only, then text-twin side questions",
                    "image", "side_twin", "twin")]


def judge_transfer(sfts: list, ceilings: list, blind: dict) -> list:
    """Each direction: treated (captions) vs its no-caption control and vs no fine-tune, seed-paired."""
    def metric(pre, kind, key):
        return {r["seed"]: r[key] for r in sfts if (r["pretrained"], r["kind"]) == (pre, kind)}
    out = []
    for claim, kind, key, ceiling_kind in TRANSFER_CLAIMS:
        treated = metric("caption", kind, key)
        vs_control = protocol.paired(treated, metric("nocaption", kind, key))
        vs_none = protocol.paired(treated, metric("caption", "none", key))
        ceiling = {r["seed"]: r[key] for r in ceilings if r["kind"] == ceiling_kind}
        ceiling_ok = all(v >= blind[s] + GATE for s, v in ceiling.items())
        v = protocol.verdict(vs_control, +1, ceiling_ok)
        if v == protocol.REPRODUCES and vs_control.holds(+1) < len(vs_control.seeds):
            v = protocol.DOES_NOT
        out.append(dict(claim=claim, kind=kind, metric=key, vs_control=vs_control, vs_none=vs_none,
                        ceiling=statistics.fmean(ceiling.values()), ceiling_ok=ceiling_ok, verdict=v))
    return out


# ----------------------------------------------------------------------------- main

def parse(argv=None):
    ap = argparse.ArgumentParser(description="early vs mid vs late fusion from a shared pretrained ViT, and "
                                 "cross-modal transfer both ways, each arm at its best lr on a tuning seed, judged "
                                 "on other seeds", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    protocol.add_flags(ap, OUT, steps=300, eval_every=50)
    ap.set_defaults(seeds="101,102,103,104,105")
    ap.add_argument("--transfer_seeds", type=bounded_list(int, 0, 2**63 - 1), default="101,102,103",
                    help="judging seeds of the transfer experiments, none of them the tuning seed")
    ap.add_argument("--part", default="all", choices=("all", "fusion", "transfer"), help="which experiment(s) to run")
    ap.add_argument("--lrs", type=bounded_list(float, 1e-12, 1e3), default="2e-3,4e-3,8e-3",
                    help="each fusion arm's lr grid, tried on --seed (train.py's CPU default: 4e-3)")
    ap.add_argument("--pretrain_steps", type=bounded(int, 0), default=0, help="steps of each transfer pretraining (0: --steps)")
    ap.add_argument("--pretrain_lr", type=bounded(float, 1e-12, 1e3), default=4e-3,
                    help="lr of both transfer pretraining mixes (the same for both: they differ only in data)")
    ap.add_argument("--schedule", default="wsd", choices=("wsd", "cosine"),
                    help="train.py's lr schedule for the fusion arms and the transfer pretraining (fine-tunes: cosine); "
                    "wsd (Kimi K2's kind) puts the late arm's vision in the decay from the peak lr, cosine at <= 0.2x it")
    ap.add_argument("--sft_lrs", type=bounded_list(float, 1e-12, 1e3), default="1e-3,3e-3,1e-2",
                    help="each fine-tune's lr grid, tried on --seed")
    ap.add_argument("--sft_steps", type=bounded(int, 1), default=300, help="steps of each fine-tune")
    ap.add_argument("--sft_batch", type=bounded(int, 1), default=8, help="rows per fine-tune step")
    ap.add_argument("--batch_size", type=bounded(int, 1), default=10, help="rows per step; a multiple of 10 makes "
                    "the 10/20/50%% shares whole rows")
    ap.add_argument("--tasks", default=",".join(image_tasks.FEW_TASKS), help="image_tasks tasks of the fusion arms")
    ap.add_argument("--encoder_steps", type=bounded(int, 0), default=300, help="steps of the ViT's pretraining per seed")
    ap.add_argument("--n_eval", type=bounded(int, 1), default=500, help="held-out questions per final accuracy (500: "
                    "~440 distinct, the rest the same question on a 1-shape scene again, jittered)")
    ap.add_argument("--n_curve", type=bounded(int, 1), default=100, help="held-out questions per accuracy on the curve")
    ap.add_argument("--eval_iters", type=bounded(int, 1), default=8, help="held-out text windows (batches) per text loss")
    ap.add_argument("--max_gate_mult", type=bounded(int, 1, 3), default=3,
                    help="the gate may grow the steps to this multiple (1: never)")
    ap.add_argument("--pilot", action="store_true", help="only one run per arm on --seed at the middle of --lrs: time "
                    "per arm-seed and the gate's reading, to size --steps before judging (writes fusion_pilot.md)")
    ap.add_argument("--skip_frozen_check", action="store_true", help="skip the frozen-ViT check (one run per arm)")
    ap.add_argument("--judge_failed_gate", action="store_true", help="run the judging seeds even when the gate failed "
                    "(the verdict stays not testable; by default a failed gate ends the fusion part)")
    ap.add_argument("--threads", type=bounded(int, 1, os.cpu_count()), default=1, help="CPU threads per run")
    ap.add_argument("--reuse", action="store_true", help="read finished runs (and encoders) back from their files")
    args = ap.parse_args(argv)
    protocol.check_seeds(args)
    if args.seed in args.transfer_seeds:
        raise SystemExit(f"error: --seed={args.seed} (the tuning seed) is also a transfer judging seed")
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if not tasks or set(tasks) - set(image_tasks.ALL_TASKS):
        raise SystemExit(f"error: --tasks={args.tasks}: use a comma list of {', '.join(image_tasks.ALL_TASKS)}")
    args.tasks = tasks
    if args.quick:
        args.steps, args.eval_every, args.n_eval, args.n_curve, args.eval_iters = 10, 10, 10, 10, 1
        args.lrs, args.sft_lrs = args.lrs[:1], args.sft_lrs[:1]
        args.seeds, args.transfer_seeds = args.seeds[:2], args.transfer_seeds[:2]
        args.pretrain_steps, args.sft_steps, args.encoder_steps, args.max_gate_mult, args.jobs = 2, 2, 2, 1, 1
    if args.batch_size <= sum(TRANSFER_ROWS.values()):
        raise SystemExit(f"error: --batch_size={args.batch_size}: the transfer mix needs more than "
                         f"{sum(TRANSFER_ROWS.values())} rows per step (its image and twin rows, and text)")
    plan = vision_plan(args.steps, args.batch_size)
    if len(set(plan.values())) != 1:
        raise SystemExit(f"error: --steps={args.steps} with --batch_size={args.batch_size} gives the arms unequal image "
                         f"rows ({plan}); use multiples of 10")
    args.pretrain_steps = args.pretrain_steps or args.steps
    return args


def make_common(args) -> dict:
    """What every run shares: train.py's CPU-default model (its fields, from which each run rebuilds it; --quick:
    a smaller one), the data and the evaluation sizes. Part of each run's signature (--reuse)."""
    cfg = train.make_config(dict(QUICK) if args.quick else {}, cuda=False)
    model = {k: getattr(cfg.model, k) for k in ("block_size", "n_layer", "n_head", "n_embd", "pattern", "residual",
                                                 "attnres_block_size", "tie_embeddings", "vision_patch_size",
                                                 "vision_n_embd", "vision_n_layer", "vision_n_head")}
    return dict(model=model, data=cfg.data, tasks=list(args.tasks), batch_size=args.batch_size, eval_every=args.eval_every,
                n_eval=args.n_eval, n_curve=args.n_curve, eval_iters=args.eval_iters, encoder_steps=args.encoder_steps,
                sft_steps=args.sft_steps, sft_batch=args.sft_batch, schedule=args.schedule)


def main():
    args = parse()
    torch.set_num_threads(args.threads)
    common = make_common(args)
    model = common["model"]
    longest = max(len(t.tokens(t.example("train", i), f)[0]) for t in task_sets(common, args.seed).values()
                  for i in range(100) for f in image_tasks.FORMS)
    if longest > model["block_size"] + 1:
        raise SystemExit(f"error: block_size={model['block_size']} is too small for a {longest}-token example")
    t0, seeds = time.time(), sorted({args.seed, *args.seeds, *args.transfer_seeds})
    if args.pilot:
        seeds = [args.seed]
    elif args.part == "fusion":
        seeds = sorted({args.seed, *args.seeds})
    elif args.part == "transfer":
        seeds = sorted({args.seed, *args.transfer_seeds})
    encoders = {e["seed"]: e for e in protocol.run_jobs(encoder, [dict(seed=s, common=common, out_root=args.out_dir,
                                                                      reuse=args.reuse) for s in seeds], args.jobs)}
    # the best blind answer: each task's most common training answer, on the same held-out questions
    blind = {s: {name: t.majority_baseline("val", args.n_eval, n_train=300 if args.quick else 3000)
                 for name, t in task_sets(common, s).items()} for s in seeds}
    distinct = {s: {name: len({t.example("val", i)["key"] for i in range(args.n_eval)})
                    for name, t in task_sets(common, s).items()} for s in seeds}
    results = dict(args={k: v for k, v in vars(args).items()}, common=common, encoders=encoders, blind=blind,
                   distinct=distinct,
                   hardware=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
                   date=time.strftime("%Y-%m-%d"))

    def fusion_jobs(lr_of: dict, run_seeds: list, steps: int, frozen: bool = False) -> list:
        return [dict(arm=a, seed=s, lr=lr, steps=steps, common=common, encoder_path=encoders[s]["path"],
                     out_root=args.out_dir, reuse=args.reuse, frozen=frozen)
                for s in run_seeds for a in lr_of for lr in lr_of[a]]

    if args.pilot:
        lr = args.lrs[len(args.lrs) // 2]
        runs = protocol.run_jobs(fusion_run, fusion_jobs({a: [lr] for a in ARMS}, [args.seed], args.steps), args.jobs)
        pilot(args, results, runs)
        return
    if args.part in ("all", "fusion"):
        fusion_blind = {s: b["fusion"] for s, b in blind.items()}
        tuned = protocol.run_jobs(fusion_run, fusion_jobs({a: args.lrs for a in ARMS}, [args.seed], args.steps), args.jobs)
        for _ in range(0 if args.quick else 2):   # a best lr on the grid's edge: one factor-2 step that way, twice at most
            best = {a: best_lr(tuned, a) for a in ARMS}
            tried = {a: sorted(r["lr"] for r in tuned if r["arm"] == a) for a in ARMS}
            grow = {a: [best[a] * (2 if best[a] == tried[a][-1] else 0.5)] for a in ARMS
                    if len(tried[a]) > 1 and best[a] in (tried[a][0], tried[a][-1])}
            tuned += protocol.run_jobs(fusion_run, fusion_jobs(grow, [args.seed], args.steps), args.jobs)
        best = {a: best_lr(tuned, a) for a in ARMS}
        at_best, steps, grown = [r for r in tuned if r["lr"] == best[r["arm"]]], args.steps, []
        for mult in range(2, args.max_gate_mult + 1):   # the gate: longer runs at the tuned lrs before giving up
            if gate_passed(at_best, fusion_blind):
                break
            steps = mult * args.steps
            at_best = protocol.run_jobs(fusion_run, fusion_jobs({a: [best[a]] for a in ARMS}, [args.seed], steps), args.jobs)
            grown += at_best
        gate_ok = gate_passed(at_best, fusion_blind)
        # a failed gate already decides the row (not testable at this scale): the judging seeds would only
        # compare arms that cannot read the images, so they run only when asked (--judge_failed_gate)
        judge = gate_ok or args.judge_failed_gate
        judged = protocol.run_jobs(fusion_run, fusion_jobs({a: [best[a]] for a in ARMS}, args.seeds, steps), args.jobs) \
            if judge else []
        checked = [] if args.skip_frozen_check or not judge else ["early"] if args.quick else list(ARMS)
        frozen = protocol.run_jobs(fusion_run, fusion_jobs({a: [best[a]] for a in checked}, [args.seed], steps, True), args.jobs)
        claim = judge_fusion(judged, fusion_blind, gate_ok) if judged else dict(
            verdict=protocol.NOT_TESTABLE, gate_tuning=False, means={r["arm"]: r["acc"] for r in at_best})
        results["fusion"] = dict(tuned=tuned, grown=grown, best=best, steps=steps, plan=vision_plan(steps, args.batch_size),
                                 gate_runs=at_best, judged=judged, frozen=frozen, claim=claim)

    if args.part in ("all", "transfer"):
        tseeds = [args.seed] + args.transfer_seeds
        pre = protocol.run_jobs(pretrain_run, [dict(seed=s, lr=args.pretrain_lr, steps=args.pretrain_steps, captions=c,
                                                    common=common, encoder_path=encoders[s]["path"], out_root=args.out_dir,
                                                    reuse=args.reuse) for s in tseeds for c in (True, False)], args.jobs)
        base = {(r["seed"], r["captions"]): r for r in pre}

        def sft_jobs(lr_of: dict, run_seeds: list) -> list:
            return [dict(seed=s, base=base[s, c], kind=k, lr=lr, common=common, encoder_path=encoders[s]["path"],
                         out_root=args.out_dir, reuse=args.reuse)
                    for s in run_seeds for (c, k) in lr_of for lr in lr_of[c, k]]

        combos = [(c, k) for c in (True, False) for k in ("twin", "image")]
        # each fine-tune's lr is the one at which it learns its own task (on the tuning seed); chosen by the transfer
        # itself, a collapsed fine-tune that always answers "left" won with the majority answer
        metric = {"twin": "side_twin", "image": "side_image"}
        sft_tuned = protocol.run_jobs(sft_run, sft_jobs({ck: args.sft_lrs for ck in combos}, [args.seed]), args.jobs)

        def sft_best_lr(c, k):
            # a fine-tune whose text val loss rose more than SFT_TEXT_SLACK above its base model's diverged (at 3e-3
            # and 1e-2 it reached 15-21 nats on the tuning seed): not eligible, however it answers (if every lr
            # diverged, all compete, and the report's text val column shows it)
            runs = [r for r in sft_tuned if (r["pretrained"], r["kind"]) == (base_name(c), k)]
            kept = [r for r in runs if r["text"] <= base[args.seed, c]["text"] + SFT_TEXT_SLACK] or runs
            return protocol.best_lr({r["lr"]: [r[metric[k]]] for r in kept}, lower_is_better=False)

        for _ in range(0 if args.quick else 1):    # a best lr on the grid's edge: one more grid step that way
            grow = {}
            for c, k in combos:
                tried, best = sorted(r["lr"] for r in sft_tuned if (r["pretrained"], r["kind"]) == (base_name(c), k)), \
                    sft_best_lr(c, k)
                if len(tried) > 1 and best in (tried[0], tried[-1]):
                    grow[c, k] = [best * (tried[-1] / tried[-2] if best == tried[-1] else tried[0] / tried[1])]
            sft_tuned += protocol.run_jobs(sft_run, sft_jobs(grow, [args.seed]), args.jobs)
        sft_best = {(c, k): sft_best_lr(c, k) for c, k in combos}
        lr_of = {**{ck: [v] for ck, v in sft_best.items()}, (True, "none"): [0.0], (False, "none"): [0.0]}
        sfts = protocol.run_jobs(sft_run, sft_jobs(lr_of, args.transfer_seeds), args.jobs)
        # the positive controls (ceilings): the captioned model fine-tuned and asked in the same modality
        ceilings = [r for r in sfts if r["pretrained"] == "caption" and r["kind"] in metric]
        ceiling_lr = {k: sft_best[True, k] for k in metric}
        side_blind = {s: blind[s]["held"] for s in tseeds}
        results["transfer"] = dict(pretrain=pre, sft_tuned=sft_tuned, sfts=sfts, ceilings=ceilings, ceiling_lr=ceiling_lr,
                                   claims=judge_transfer(sfts, ceilings, side_blind),
                                   sft_best={f"{base_name(c)}+{k}": v for (c, k), v in sft_best.items()})
    results["seconds"] = time.time() - t0
    report(args, results)


# ----------------------------------------------------------------------------- report

def pilot(args, results: dict, runs: list):
    """fusion_pilot.md and .png: each arm's accuracy (per task), text loss, loss share, time, and the gate's reading."""
    blind = results["blind"][args.seed]["fusion"]
    e = results["encoders"][args.seed]
    lines = [f"Pilot, {results['hardware']}, {args.threads} thread(s), {results['date']}: seed {args.seed}, "
             f"{args.steps} steps x {args.batch_size} rows x {results['common']['model']['block_size']} tokens, "
             f"{args.schedule} schedule, {args.n_eval} held-out questions ({results['distinct'][args.seed]['fusion']} "
             f"distinct), best blind answer {blind:.3f} (gate {blind + GATE:.3f}); encoder "
             f"{args.encoder_steps} steps, {e['check'].get('cpu_s', 0) / 60:.1f} CPU-min, val colour / kind / side / count "
             f"{e['check']['colour']:.3f} / {e['check']['kind']:.3f} / {e['check']['side']:.3f} / {e['check']['count']:.3f}.", "",
             "| arm | lr | image acc | per task | text val | loss share of image tokens (run / while on) | image tokens "
             "| gate | wall | CPU-min |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        tasks = ", ".join(f"{t} {v:.2f}" for t, v in r["acc_by_task"].items())
        lines.append(f"| {r['arm']} | {r['lr']:g} | {r['acc']:.3f} | {tasks} | {r['text']:.4f} | {r['share']:.3f} / "
                     f"{r['share_on']:.3f} | {r['image_tokens']:,} | {'passed' if r['acc'] >= blind + GATE else 'FAILED'} | "
                     f"{r['seconds'] / 60:.1f} min | {r['cpu_s'] / 60:.1f} |")
    lines += ["", "Curves (step, text val, image acc on the first questions): " + "; ".join(
        f"{r['arm']} " + ", ".join(f"({s}, {t:.3f}, {a:.2f})" for s, t, a in r["curve"]) for r in runs)]
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "fusion_pilot.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    plot(args, dict(results, fusion=dict(judged=[], gate_runs=runs, steps=args.steps)), "fusion_pilot.png")
    print("\n".join(lines))


def _pm(p) -> str:
    return f"{p.diff:+.3f} ± {p.se:.3f}"


def _cpu_minutes(results: dict) -> float:
    runs = [e["check"] for e in results["encoders"].values()]
    f, t = results.get("fusion", {}), results.get("transfer", {})
    runs += f.get("tuned", []) + f.get("grown", []) + f.get("judged", []) + f.get("frozen", [])
    runs += t.get("pretrain", []) + t.get("sft_tuned", []) + t.get("sfts", [])
    return sum(r.get("cpu_s", 0.0) for r in runs) / 60


def blind_of(results: dict, seed) -> float:
    return results["blind"][seed]["fusion"]


def fusion_judged_lines(args, results: dict, lines: list, verdict_rows: list):
    """The judged fusion table, the per-task, gate and frozen-check lines and the claim row (appended in place)."""
    f, c = results["fusion"], results["fusion"]["claim"]
    blind = {s: b["fusion"] for s, b in results["blind"].items()}
    distinct = [d["fusion"] for d in results["distinct"].values()]
    lines += [f"**Fusion timing** ({', '.join(results['common']['tasks'])}; {args.n_eval} held-out questions, "
              f"{min(distinct)}-{max(distinct)} distinct per seed; "
              f"judged at {f['steps']} steps, image rows per arm {f['plan']}).", "",
              "| arm | share from | lr (tuning seed: image acc / text val per lr) | " +
              " | ".join(f"seed {s}" for s in args.seeds) + " | mean image acc | mean text val | loss share of image "
              "tokens (run / while on) | image tokens |", "|---|---|---|" + "---|" * (len(args.seeds) + 4)]
    for a, (ratio, start) in ARMS.items():
        rs = sorted((r for r in f["judged"] if r["arm"] == a), key=lambda r: r["seed"])
        grid = ", ".join(f"{r['lr']:g}: {r['acc']:.3f} / {r['text']:.3f}" for r in sorted(f["tuned"], key=lambda r: r["lr"])
                         if r["arm"] == a)
        lines.append(f"| {a} | {ratio:.0%} from {start:.0%} | **{f['best'][a]:g}** ({grid}) | " +
                     " | ".join(f"{r['acc']:.3f}" for r in rs) + f" | {statistics.fmean(r['acc'] for r in rs):.3f} | "
                     f"{statistics.fmean(r['text'] for r in rs):.4f} | {statistics.fmean(r['share'] for r in rs):.3f} / "
                     f"{statistics.fmean(r['share_on'] for r in rs):.3f} | {rs[0]['image_tokens']:,} |")
    per_task = {a: {t: statistics.fmean([r["acc_by_task"][t] for r in f["judged"] if r["arm"] == a and t in r["acc_by_task"]]
                                        or [math.nan]) for t in results["common"]["tasks"]} for a in ARMS}
    gate_runs = f["gate_runs"]
    lines += ["", "Per task (mean of judging seeds): " + "; ".join(
                  f"{a} " + ", ".join(f"{t} {v:.3f}" for t, v in per_task[a].items()) for a in ARMS),
              f"Gate (every arm >= best blind answer + {GATE}): tuning seed {args.seed} at {f['steps']} steps: " +
              ", ".join(f"{r['arm']} {r['acc']:.3f}" for r in gate_runs) + f" vs {blind[args.seed] + GATE:.3f} "
              f"(blind {blind[args.seed]:.3f}) -> {'passed' if c['gate_tuning'] else 'FAILED'}" +
              (f" (grown from {args.steps} steps)" if f["grown"] else "") + "; judging means " +
              ", ".join(f"{a} {v:.3f}" for a, v in c["means"].items()) +
              f" -> {'passed' if c['gate_judged'] else 'FAILED'}."]
    if f["frozen"]:
        lines.append("Frozen-ViT check (tuning seed, best lr; only the projector and the LM learn): " +
                     ", ".join(f"{r['arm']} image {r['acc']:.3f} text {r['text']:.4f}" for r in f["frozen"]) + ".")
    verdict_rows.append(f"| early fusion (10% from step 0) beats mid and late fusion at equal vision tokens (K2.5 "
                        f"Table 1; early >= mid >= late, early - late > 2 SE in every seed, early's text loss not worse "
                        f"by > 2 SE) | image acc early {c['means']['early']:.3f}, mid {c['means']['mid']:.3f}, late "
                        f"{c['means']['late']:.3f}; early - late {_pm(c['early_late'])} ({c['early_late'].holds(+1)}/"
                        f"{len(c['early_late'].seeds)}), early - mid {_pm(c['early_mid'])}, mid - late {_pm(c['mid_late'])}; "
                        f"text val early - late {c['text_early_late'].diff:+.4f} ± {c['text_early_late'].se:.4f} | "
                        f"**{c['verdict']}** |")


def report(args, results: dict):
    """fusion_timing.md (tables, verdict rows), fusion_timing.json and fusion_timing.png."""
    os.makedirs(args.out_dir, exist_ok=True)
    m = results["common"]["model"]
    lines = [f"Fusion timing and transfer, {results['hardware']}, {args.threads} thread(s) per run, {args.jobs} side by "
             f"side, {results['date']}: {m['pattern']} x {m['n_layer']} layers, width {m['n_embd']}, {m['residual']} "
             f"(blocks of {m['attnres_block_size']}), context {m['block_size']}, ViT {m['vision_n_layer']} x "
             f"{m['vision_n_embd']} (patch {m['vision_patch_size']}), MuonClip, {args.schedule} schedule, "
             f"{args.batch_size} rows per step; "
             f"tuning seed {args.seed}; {_cpu_minutes(results):.0f} CPU-minutes in the runs, "
             f"{results['seconds'] / 60:.1f} min this call.", "",
             "Shared encoders (val scenes: per-patch colour, kind, side; scene count): " +
             "; ".join(f"seed {s}: {e['check']['colour']:.2f} / {e['check']['kind']:.2f} / {e['check']['side']:.2f} / "
                       f"{e['check']['count']:.2f}" for s, e in sorted(results["encoders"].items())), ""]
    verdict_rows = []
    if "fusion" in results:
        f, c = results["fusion"], results["fusion"]["claim"]
        if f["judged"]:
            fusion_judged_lines(args, results, lines, verdict_rows)
        else:                                        # the gate failed: its numbers are the row
            g = sorted(f["gate_runs"], key=lambda r: list(ARMS).index(r["arm"]))
            lines += [f"**Fusion timing** ({', '.join(results['common']['tasks'])}; {args.n_eval} held-out questions). "
                      f"The gate failed on tuning seed {args.seed} at {f['steps']} steps"
                      + (f" (grown from {args.steps})" if f["grown"] else "") + ", so the judging seeds did not run.", "",
                      "| arm | share from | lr (tuning seed: image acc / text val per lr) | image acc at the gate | per task | "
                      "text val | loss share of image tokens (run / while on) | image tokens |", "|---|---|---|---|---|---|---|---|"]
            for r in g:
                ratio, start = ARMS[r["arm"]]
                grid = ", ".join(f"{t['lr']:g}: {t['acc']:.3f} / {t['text']:.3f}" for t in sorted(f["tuned"], key=lambda t: t["lr"])
                                 if t["arm"] == r["arm"])
                lines.append(f"| {r['arm']} | {ratio:.0%} from {start:.0%} | **{r['lr']:g}** ({grid}) | {r['acc']:.3f} | "
                             + ", ".join(f"{t} {v:.2f}" for t, v in r["acc_by_task"].items()) + f" | {r['text']:.4f} | "
                             f"{r['share']:.3f} / {r['share_on']:.3f} | {r['image_tokens']:,} |")
            verdict_rows.append(f"| early fusion (10% from step 0) beats mid and late fusion at equal vision tokens (K2.5 "
                                f"Table 1) | gate (every arm >= blind + {GATE}) FAILED on tuning seed {args.seed} at "
                                f"{f['steps']} steps: image acc " + ", ".join(f"{r['arm']} {r['acc']:.3f}" for r in g) +
                                f" vs {blind_of(results, args.seed) + GATE:.3f} (blind {blind_of(results, args.seed):.3f}); "
                                f"judging seeds not run | **{c['verdict']}** |")
        same = all(r["encoder_digest"] == results["encoders"][r["seed"]]["digest"]
                   for r in f["tuned"] + f["grown"] + f["judged"] + f["frozen"])
        prefixes = ", ".join(f"seed {s} {e['digest'][:8]}" for s, e in sorted(results["encoders"].items()))
        lines.append("Encoder at the start of every fusion run: " + ("bit-identical to its seed's pretrained ViT" if same
                     else "NOT the pretrained ViT") + f" (sha256 prefixes: {prefixes}).")
    if "transfer" in results:
        t = results["transfer"]
        side_blind = {s: b["held"] for s, b in results["blind"].items()}
        lines += ["", f"**Transfer** (pretraining: {args.pretrain_steps} steps, lr {args.pretrain_lr:g}, per step "
                  f"{TRANSFER_ROWS['image']} image rows + {TRANSFER_ROWS['twin']} twin rows of {'/'.join(SEEN)}; side "
                  f"questions held out of both; fine-tunes: {args.sft_steps} steps x {args.sft_batch} rows of "
                  f"{'/'.join(HELD)}; {args.n_eval} held-out questions; best blind side answer "
                  f"{statistics.fmean(side_blind[s] for s in args.transfer_seeds):.3f}).", "",
                  "| base model | fine-tune | lr | side acc, images (per seed) | side acc, twins (per seed) | text val |",
                  "|---|---|---|---|---|---|"]
        for pre in ("caption", "nocaption"):
            for kind in ("none", "twin", "image"):
                rs = sorted((r for r in t["sfts"] if (r["pretrained"], r["kind"]) == (pre, kind)), key=lambda r: r["seed"])
                if not rs:
                    continue
                lr = t["sft_best"].get(f"{pre}+{kind}")
                lines.append(f"| {'captions' if pre == 'caption' else 'no captions'} | {kind if kind != 'none' else '-'} | "
                             f"{lr if lr is not None else '-'} | {statistics.fmean(r['side_image'] for r in rs):.3f} ("
                             + ", ".join(f"{r['side_image']:.2f}" for r in rs) + f") | "
                             f"{statistics.fmean(r['side_twin'] for r in rs):.3f} ("
                             + ", ".join(f"{r['side_twin']:.2f}" for r in rs)
                             + f") | {statistics.fmean(r['text'] for r in rs):.4f} |")
        pre_rs = [r for r in t["pretrain"] if r["seed"] in args.transfer_seeds]
        lines.append("Pretrained colour questions (mean of judging seeds), image / twin: " + "; ".join(
            f"{'captions' if c else 'no captions'} "
            f"{statistics.fmean(r['color_image'] for r in pre_rs if r['captions'] == c):.3f} / "
            f"{statistics.fmean(r['color_twin'] for r in pre_rs if r['captions'] == c):.3f}" for c in (True, False)) + ".")
        lines.append("Ceilings (the captioned model fine-tuned and asked in the same modality, at the fine-tune's tuned "
                     "lr; each must pass the gate, blind + " + f"{GATE}): " + "; ".join(
                         f"side {k}s after {k} SFT at lr {t['ceiling_lr'][k]:g}: " + ", ".join(
                             f"{r['side_' + k]:.3f}" for r in sorted(t["ceilings"], key=lambda r: r["seed"]) if r["kind"] == k)
                         for k in ("image", "twin")) + " (seeds " + ", ".join(str(s) for s in args.transfer_seeds) + ").")
        for c in t["claims"]:
            verdict_rows.append(f"| {c['claim']} (captions − no-caption control > 2 SE, every seed) | {c['metric']}: "
                                f"captions − no captions {_pm(c['vs_control'])} ({c['vs_control'].holds(+1)}/"
                                f"{len(c['vs_control'].seeds)}), − no fine-tune {_pm(c['vs_none'])}; ceiling "
                                f"{c['ceiling']:.3f} ({'passed' if c['ceiling_ok'] else 'FAILED'} the gate) | "
                                f"**{c['verdict']}** |")
    lines += ["", "| claim | measured (mean ± paired SE, seeds where it holds) | verdict |", "|---|---|---|"] + verdict_rows
    md = os.path.join(args.out_dir, "fusion_timing.md")
    with open(md, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out_dir, "fusion_timing.json"), "w") as fh:
        json.dump(results, fh, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    png = plot(args, results)
    print("\n".join(lines))
    print(f"wrote {md} and {png}")


def plot(args, results: dict, name: str = "fusion_timing.png") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = 2 * ("fusion" in results) + ("transfer" in results)   # two fusion panels, one transfer panel
    fig, axes = plt.subplots(1, n, figsize=(5.4 * n, 4.4), squeeze=False)
    axes = list(axes[0])
    colors = dict(early="C0", mid="C1", late="C3")
    if "fusion" in results:
        f = results["fusion"]
        shown = f["judged"] or f["gate_runs"]         # the judging seeds, or (gate failed) the tuning seed's gate runs
        seeds = sorted({r["seed"] for r in shown})
        blind = statistics.fmean(results["blind"][s]["fusion"] for s in seeds)
        for a, (ratio, start) in ARMS.items():
            curves = [r["curve"] for r in shown if r["arm"] == a]
            steps = [c[0] for c in curves[0]]
            for ax, k in ((axes[0], 1), (axes[1], 2)):
                ax.plot(steps, [statistics.fmean(c[i][k] for c in curves) for i in range(len(steps))], "o-", ms=3,
                        color=colors[a], label=f"{a}: {ratio:.0%} vision from {start:.0%}")
            if start:
                for ax in axes[:2]:
                    ax.axvline(start * f["steps"], color=colors[a], ls=":", lw=1)
        axes[0].set_ylabel(f"text val loss (mean of {len(seeds)} {'judging' if f['judged'] else 'tuning'} seed(s))")
        axes[0].set_title("text while vision enters")
        top = min(r["text"] for r in shown)
        axes[0].set_ylim(top - 0.2, top + 1.5)
        axes[1].axhline(blind, color="k", ls="--", lw=1, label="best blind answer")
        axes[1].axhline(blind + GATE, color="k", ls=":", lw=1, label=f"gate (blind + {GATE})")
        axes[1].set_ylabel("image accuracy (held-out; last point: all of them)"), axes[1].set_title("image questions")
        axes[1].set_ylim(0, 1)
        for ax in axes[:2]:
            ax.set_xlabel("step"), ax.grid(alpha=0.3), ax.legend(fontsize=7)
    if "transfer" in results:
        t, ax = results["transfer"], axes[-1]
        labels, x = [], 0
        for pre in ("caption", "nocaption"):
            for kind in ("none", "twin", "image"):
                rs = [r for r in t["sfts"] if (r["pretrained"], r["kind"]) == (pre, kind)]
                if not rs:
                    continue
                for off, key, col in ((-0.2, "side_image", "C2"), (0.2, "side_twin", "C4")):
                    vals = [r[key] for r in rs]
                    ax.bar(x + off, statistics.fmean(vals), 0.4, color=col, alpha=0.7,
                           label=("side questions as images" if key == "side_image" else "as text twins") if x == 0 else None)
                    ax.scatter([x + off] * len(vals), vals, color="k", s=8, zorder=3)
                labels.append(f"{'captions' if pre == 'caption' else 'no captions'}\nSFT: {kind}")
                x += 1
        ax.axhline(statistics.fmean(results["blind"][s]["held"] for s in args.transfer_seeds), color="k", ls="--", lw=1,
                   label="best blind answer")
        ax.set_xticks(range(len(labels)), labels, fontsize=7), ax.set_ylim(0, 1), ax.legend(fontsize=7)
        ax.set_ylabel("side accuracy (held-out)"), ax.set_title("transfer: side questions never pretrained")
    fig.tight_layout()
    png = os.path.join(args.out_dir, name)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


if __name__ == "__main__":
    main()
