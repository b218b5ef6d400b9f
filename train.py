"""Train the model on the bundled corpus, nanoGPT-style.

    python train.py                                  # GPU if present, else a small CPU run (~5 min)
    python train.py --pattern=KKKA --residual=attnres_block --optimizer=muonclip
    python train.py --data=my_text.txt --max_iters=2000
    python train.py --resume                         # continue from out/ckpt.pt exactly
    torchrun --standalone --nproc_per_node=2 train.py   # DDP (NCCL on GPU, gloo on CPU)

Every TrainConfig field below and every model.Config field can be overridden with --key=value.
Outputs go to --out_dir (default out/): ckpt.pt, log.jsonl, loss.png, sample.txt.
"""
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np
import torch
import torch.distributed as dist

import data
from model import GPT, Config


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    data: str = "shakespeare"          # shakespeare | kjv | all | path to a .txt file or folder
    resume: bool = False
    ckpt_interval: int = 250           # also written at the end
    log_interval: int = 10
    eval_interval: int = 250
    eval_iters: int = 20
    sample_tokens: int = 200
    seed: int = 1337
    # batch: tokens per optimizer step = batch_size * block_size * grad_accum
    batch_size: int = 16               # per micro-step, per process
    grad_accum: int = 4                # micro-steps per optimizer step, summed over processes
    # optimizer
    optimizer: str = "muonclip"        # muonclip | muon (no clip) | adamw
    lr: float = 3e-3
    min_lr_ratio: float = 0.1          # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0             # 0 disables
    qk_clip_tau: float = 100.0         # QK-Clip threshold (muonclip only)
    schedule: str = "cosine"           # cosine | wsd (warmup, stable, linear decay over the last 20%)
    warmup_iters: int = 100
    max_iters: int = 2000              # length of the schedule
    stop_iter: int = 0                 # stop early at this step (0 = max_iters); resume continues
    # system
    device: str = "auto"               # auto | cuda | cpu
    compile: bool = False              # torch.compile the model
    # vision (vision.py): share of sequences that are image-text, and when they start (fraction of run)
    vision_ratio: float = 0.0
    vision_start: float = 0.0
    # model: see model.Config; these are the GPU defaults
    model: Config = field(default_factory=lambda: Config(block_size=512, n_layer=8, n_head=8, n_embd=512,
                                                         pattern="KKKA"))


# When no GPU is present: a model and run that finish in about five minutes on two cores.
CPU_DEFAULTS = dict(batch_size=8, grad_accum=1, max_iters=400, warmup_iters=30, eval_interval=100,
                    eval_iters=10, ckpt_interval=200, lr=2e-3, sample_tokens=100,
                    block_size=128, n_layer=4, n_head=4, n_embd=128, pattern="A", tie_embeddings=True)


class TrainingDiverged(RuntimeError):
    pass


# ----------------------------------------------------------------------------- config

def _parse_value(name: str, kind, text: str):
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", ""):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        return kind(text)
    except ValueError:
        raise SystemExit(f"error: --{name}={text!r} is not a valid {kind.__name__}") from None


def make_config(overrides: dict, cuda: bool) -> TrainConfig:
    """TrainConfig from defaults (+ CPU_DEFAULTS without a GPU) and overrides (values or strings)."""
    train_keys = {f.name: f.type for f in fields(TrainConfig) if f.name != "model"}
    model_keys = {f.name: f.type for f in fields(Config)}
    types = {**train_keys, **model_keys}
    types = {k: {"int": int, "float": float, "bool": bool, "str": str}.get(t, t) if isinstance(t, str) else t
             for k, t in types.items()}
    unknown = sorted(set(overrides) - set(types))
    if unknown:
        raise SystemExit(f"error: unknown config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(types))}")
    values = {} if cuda else dict(CPU_DEFAULTS)
    for k, v in overrides.items():
        if isinstance(v, str) and types[k] is not str:
            v = _parse_value(k, types[k], v)
        elif types[k] is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        elif not isinstance(v, types[k]):
            raise SystemExit(f"error: --{k}={v!r} is not a valid {types[k].__name__}")
        values[k] = v
    cfg = TrainConfig(**{k: v for k, v in values.items() if k in train_keys})
    try:
        cfg.model = replace(cfg.model, **{k: v for k, v in values.items() if k in model_keys})
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if cfg.optimizer not in ("adamw", "muon", "muonclip"):
        raise SystemExit(f"error: --optimizer={cfg.optimizer}: use adamw | muon | muonclip")
    if cfg.schedule not in ("cosine", "wsd"):
        raise SystemExit(f"error: --schedule={cfg.schedule}: use cosine | wsd")
    if min(cfg.batch_size, cfg.grad_accum, cfg.max_iters) < 1 or cfg.lr <= 0:
        raise SystemExit("error: batch_size, grad_accum, max_iters and lr must be positive")
    if cfg.vision_ratio > 0:
        cfg.model = replace(cfg.model, vision=True)
    return cfg


def parse_args(argv: list[str]) -> dict:
    out = {}
    for arg in argv:
        if not arg.startswith("--"):
            raise SystemExit(f"error: expected --key=value, got {arg!r}")
        key, _, value = arg[2:].partition("=")
        out[key] = value
    return out


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine to lr*min_lr_ratio, or WSD: flat, then linear decay in the last 20%."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    lo = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        decay_start = int(0.8 * cfg.max_iters)
        if step < decay_start:
            return cfg.lr
        frac = (step - decay_start) / max(1, cfg.max_iters - decay_start)
        return cfg.lr - (cfg.lr - lo) * min(frac, 1.0)
    frac = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * frac))


def build_optimizer(model: GPT, cfg: TrainConfig):
    if cfg.optimizer == "adamw":
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    from muonclip import MuonClip
    tau = cfg.qk_clip_tau if cfg.optimizer == "muonclip" else None
    return MuonClip.from_model(model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                               adamw_betas=(cfg.beta1, cfg.beta2), qk_clip_tau=tau)


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(path: str, state: dict):
    """Write to a temporary file, then rename: a crash mid-write never leaves a torn checkpoint."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, cfg: TrainConfig) -> dict:
    if not os.path.exists(path):
        raise SystemExit(f"error: --resume: no checkpoint at {path}; train without --resume first")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torn file, not a checkpoint, or unsafe pickle content
        raise SystemExit(f"error: checkpoint {path} is corrupt or not a checkpoint ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200]})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        raise SystemExit(f"error: checkpoint {path} is missing its model or config entries")
    if ckpt["model_config"] != asdict(cfg.model):
        diff = {k: (v, asdict(cfg.model).get(k)) for k, v in ckpt["model_config"].items()
                if asdict(cfg.model).get(k) != v}
        raise SystemExit(f"error: checkpoint {path} was trained with a different model config "
                         f"(checkpoint vs now: {diff}); pass the same model settings to resume")
    if ckpt.get("optimizer_name") != cfg.optimizer:
        raise SystemExit(f"error: checkpoint {path} used --optimizer={ckpt.get('optimizer_name')}, now {cfg.optimizer}")
    return ckpt


# ----------------------------------------------------------------------------- training

def train(**overrides) -> dict:
    """Run training with overrides of TrainConfig / model.Config fields; return a summary dict."""
    ddp = int(os.environ.get("RANK", -1)) != -1
    want_cuda = overrides.get("device", "auto") in ("auto", "cuda") and torch.cuda.is_available()
    cfg = make_config(overrides, cuda=want_cuda)
    if ddp:
        backend = "nccl" if want_cuda else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = f"cuda:{local_rank}" if want_cuda else "cpu"
        if want_cuda:
            torch.cuda.set_device(device)
        if cfg.grad_accum % world:
            raise SystemExit(f"error: grad_accum={cfg.grad_accum} must be a multiple of the {world} processes")
    else:
        rank, world = 0, 1
        device = "cuda" if want_cuda else "cpu"
    master = rank == 0
    accum = cfg.grad_accum // world               # micro-steps on this process
    try:
        result = _train(cfg, device, rank, world, accum, master, ddp)
        if ddp:
            dist.barrier()   # tear down together: a gloo group whose peer already left can abort the process
        return result
    finally:
        if ddp:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, device: str, rank: int, world: int, accum: int, master: bool, ddp: bool) -> dict:
    torch.manual_seed(cfg.seed)
    is_cuda = device.startswith("cuda")
    if is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if is_cuda else torch.autocast("cpu", enabled=False)

    if master:
        folder = data.prepare(cfg.data)
    if ddp:
        dist.barrier()                            # rank 0 tokenizes once; the others wait, then read
    folder = data.prepare(cfg.data)
    train_tokens, val_tokens = data.load_split(folder, "train"), data.load_split(folder, "val")
    T = cfg.model.block_size
    if len(val_tokens) <= T + 1 or len(train_tokens) <= T + 1:
        raise SystemExit(f"error: data {cfg.data!r} has too few tokens for block_size={T} "
                         f"(train {len(train_tokens)}, val {len(val_tokens)})")

    model = GPT(cfg.model).to(device)
    optimizer = build_optimizer(model, cfg)
    # the data sampler: one generator, identical on every process; each process takes its slice of
    # the step's offsets, so N processes see exactly the batch one process would see with N x accum
    data_gen = torch.Generator().manual_seed(cfg.seed)
    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    start_step, history = 0, []
    if cfg.resume:
        ckpt = load_checkpoint(ckpt_path, cfg)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_step = ckpt["step"]
        data_gen.set_state(ckpt["data_rng"])
        torch.set_rng_state(ckpt["cpu_rng"])
        if is_cuda and "cuda_rng" in ckpt:
            torch.cuda.set_rng_state(ckpt["cuda_rng"])
        history = [json.loads(line) for line in open(log_path)] if os.path.exists(log_path) else []
        history = [h for h in history if h["step"] <= start_step]
        if master:  # drop log lines written after the checkpoint, so the log matches the resumed run
            with open(log_path, "w") as f:
                f.writelines(json.dumps(h) + "\n" for h in history)
        if master:
            print(f"resumed from {ckpt_path} at step {start_step}")
    elif master and os.path.exists(log_path):
        os.remove(log_path)
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[int(device.split(":")[1])] if is_cuda else None)

    vision_tasks = None
    if cfg.vision_ratio > 0:
        import vision
        vision_tasks = vision.VisionTasks(seed=cfg.seed, encoding=data.get_tokenizer(),
                                          patch=cfg.model.vision_patch_size)
        try:  # fail at the boundary, not at the first vision step
            vision_tasks.batch("train", 1, T, 0)
        except ValueError as e:
            raise SystemExit(f"error: --vision_ratio needs a longer --block_size: {e}") from None

    def sample_offsets(tokens, n, gen):
        return torch.randint(0, len(tokens) - T - 1, (n,), generator=gen)

    @torch.no_grad()
    def evaluate() -> dict:
        model.eval()
        out = {}
        for split, tokens in (("train", train_tokens), ("val", val_tokens)):
            gen = torch.Generator().manual_seed(1234)   # the same eval batches every time
            losses = []
            for _ in range(cfg.eval_iters):
                x, y = data.get_batch(tokens, sample_offsets(tokens, cfg.batch_size, gen), T)
                with autocast:
                    _, loss = raw_model(x.to(device), y.to(device))
                losses.append(loss.item())
            out[f"{split}_loss"] = float(np.mean(losses))
        if vision_tasks is not None:
            out.update(vision_tasks.report(raw_model, "val", n=64))
        model.train()
        return out

    def checkpoint_state(step: int) -> dict:
        state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                 "model_config": asdict(cfg.model), "optimizer_name": cfg.optimizer,
                 "data_rng": data_gen.get_state(), "cpu_rng": torch.get_rng_state()}
        if is_cuda:
            state["cuda_rng"] = torch.cuda.get_rng_state()
        return state

    n_params = raw_model.num_params()
    tokens_per_step = cfg.batch_size * T * accum * world
    stop = cfg.stop_iter or cfg.max_iters
    if master:
        print(f"device {device} x{world} | {n_params / 1e6:.2f}M params (non-embedding) | layers "
              f"{cfg.model.layer_kinds} | residual {cfg.model.residual} | optimizer {cfg.optimizer} | "
              f"{tokens_per_step} tokens/step | data {folder}")
    attn_layers = raw_model.attention_layers()
    log_file = open(log_path, "a") if master else None
    t_last, step = time.time(), start_step
    peak, clipped = None, None        # per attention layer, since the last log line
    last_eval = {}
    model.train()
    while step < stop:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        offsets = sample_offsets(train_tokens, cfg.batch_size * cfg.grad_accum, data_gen)
        n_vision = 0
        if vision_tasks is not None and step >= cfg.vision_start * cfg.max_iters:
            n_vision = int(round(cfg.vision_ratio * cfg.batch_size))
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            chunk = offsets[(micro * world + rank) * cfg.batch_size:(micro * world + rank + 1) * cfg.batch_size]
            x, y = data.get_batch(train_tokens, chunk, T)
            images = None
            if n_vision:
                vx, vy, images = vision_tasks.batch("train", n_vision, T,
                                                    int(torch.randint(0, 2**31 - 1, (1,), generator=data_gen)))
                x, y = torch.cat([vx, x[n_vision:]]), torch.cat([vy, y[n_vision:]])
                images = images + [[] for _ in range(len(x) - n_vision)]    # text rows carry no image
            x, y = x.to(device), y.to(device)
            sync = micro == accum - 1
            ctx = model.no_sync() if ddp and not sync else torch.enable_grad()
            with ctx, autocast:
                _, loss = model(x, y, images=images)
                (loss / accum).backward()
            loss_sum += loss.detach() / accum
        if ddp:
            dist.all_reduce(loss_sum)              # gloo has no AVG: sum, then divide
            loss_sum /= world
        train_loss = loss_sum.item()
        if not math.isfinite(train_loss):
            kept = f"the last good checkpoint {ckpt_path} is kept" if os.path.exists(ckpt_path) else "no checkpoint was written yet"
            raise TrainingDiverged(f"loss is {train_loss} at step {step}; stopping ({kept})")
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        stats = getattr(optimizer, "last_clip_stats", None)
        if stats:  # QK-Clip acts every step: keep each layer's peak and the clipped-head count between log lines
            peak = [max(a, b) for a, b in zip(peak, stats["max_logit"])] if peak else list(stats["max_logit"])
            clipped = [a + b for a, b in zip(clipped, stats["clipped_heads"])] if clipped else list(stats["clipped_heads"])

        if master and (step % cfg.log_interval == 0 or step == stop or step % cfg.eval_interval == 0):
            dt = time.time() - t_last
            t_last = time.time()
            n_steps = cfg.log_interval if step % cfg.log_interval == 0 else 1
            rec = {"step": step, "train_loss": train_loss, "lr": lr,
                   "tokens": step * tokens_per_step, "tokens_per_s": n_steps * tokens_per_step / max(dt, 1e-9)}
            if is_cuda:  # model FLOPs utilisation against the H100/H200 dense bf16 peak
                rec["mfu"] = raw_model.flops_per_token(T) * rec["tokens_per_s"] / world / 989e12
            if stats:  # this step's per-layer max logits, plus the peak and clip count since the last line
                rec.update({"attn_layers": stats["layers"], "max_logit": stats["max_logit"],
                            "clipped_heads": stats["clipped_heads"], "max_logit_peak": peak,
                            "clipped_heads_since_last": clipped})
                peak, clipped = None, None
            if step % cfg.eval_interval == 0 or step == stop:
                last_eval = evaluate()
                rec.update(last_eval)
            history.append(rec)
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()
            extra = f" | val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
            if "vision_acc" in rec:
                extra += f" | image acc {rec['vision_acc']:.2f} | twin acc {rec['twin_acc']:.2f}"
            mfu = f" | mfu {rec['mfu'] * 100:.1f}%" if "mfu" in rec else ""
            print(f"step {step:5d} | loss {train_loss:.4f}{extra} | lr {lr:.2e} | "
                  f"{rec['tokens_per_s']:.0f} tok/s{mfu}")
        if master and (step % cfg.ckpt_interval == 0 or step == stop):
            save_checkpoint(ckpt_path, checkpoint_state(step))

    result = {"history": history, "final_val_loss": last_eval.get("val_loss"), "out_dir": cfg.out_dir,
              "steps": step, "n_params": n_params}
    if master:
        log_file.close()
        result["unigram_val_loss"] = data.unigram_loss(folder)
        plot_losses(history, os.path.join(cfg.out_dir, "loss.png"))
        if attn_layers and any("max_logit" in h for h in history):
            plot_max_logits(history, os.path.join(cfg.out_dir, "max_logit.png"),
                            cfg.qk_clip_tau if cfg.optimizer == "muonclip" else None)
        if cfg.sample_tokens > 0:
            enc = data.get_tokenizer()
            prompt = torch.tensor([enc.encode_ordinary("\n")], device=device)
            with autocast:
                out = raw_model.generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=200,
                                         generator=torch.Generator(device=device).manual_seed(cfg.seed))
            text = enc.decode([t for t in out[0].tolist() if t < enc.n_vocab])
            with open(os.path.join(cfg.out_dir, "sample.txt"), "w") as f:
                f.write(text)
            result["sample"] = text
    return result


def plot_losses(history: list[dict], path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([h["step"] for h in history], [h["train_loss"] for h in history], label="train (batch)")
    ev = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in ev], [h["val_loss"] for h in ev], "o-", label="val")
    ax.set_xlabel("step"), ax.set_ylabel("loss (nats/token)"), ax.legend(), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_max_logits(history: list[dict], path: str, tau: float):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [h for h in history if "max_logit" in h]
    fig, ax = plt.subplots(figsize=(6, 4))
    names = rows[0].get("attn_layers") or [f"attention layer {i}" for i in range(len(rows[0]["max_logit"]))]
    for i, name in enumerate(names):
        key = "max_logit_peak" if rows[0].get("max_logit_peak") else "max_logit"
        ax.plot([h["step"] for h in rows], [h[key][i] for h in rows], label=name)
    if tau:
        ax.axhline(tau, color="k", ls="--", lw=1, label=f"tau = {tau:g}")
    ax.set_xlabel("step"), ax.set_ylabel("max attention logit (over heads, since last log)")
    ax.legend(fontsize=7), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    try:
        result = train(**parse_args(argv))
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result.get("final_val_loss") is not None:
        print(f"final val loss {result['final_val_loss']:.4f} (unigram baseline {result['unigram_val_loss']:.4f})")
    if "sample" in result:
        print("---- sample ----\n" + result["sample"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
