"""Train the model on the bundled corpus, nanoGPT-style.

    python train.py                                  # the mission's model: GPU if present, else CPU (~4 min)
    python train.py --pattern=A --residual=standard --vision_ratio=0   # the plain attention baseline
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
    data: str = "all"                  # shakespeare | kjv | all (both, ~2.3M tokens) | path to a .txt file or folder
    resume: bool = False
    ckpt_interval: int = 250           # also written at the end
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 20
    sample_tokens: int = 200
    seed: int = 1337
    # batch: tokens per optimizer step = batch_size * block_size * grad_accum
    batch_size: int = 16               # per micro-step, per process
    grad_accum: int = 2                # micro-steps per optimizer step, summed over processes
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
    warmup_iters: int = 50
    max_iters: int = 500               # length of the schedule: 500 x 16,384 tokens = 8.2M = ~3.6 epochs of `all`
    stop_iter: int = 0                 # stop early at this step (0 = max_iters); resume continues
    # system
    device: str = "auto"               # auto | cuda | cpu
    threads: int = 0                   # CPU threads for torch; 0 = auto (up to 4 per process: small models gain little beyond)
    compile: bool = False              # torch.compile the model
    peak_tflops: float = 0.0           # the device's dense bf16 peak for MFU; 0 = look the GPU up in PEAK_TFLOPS
    # vision (vision.py): share of rows that are image-text, from which fraction of the run, which tasks
    vision_ratio: float = 0.125        # K2.5's early fusion: a modest share from step 0 (2 of 16 rows)
    vision_start: float = 0.0
    vision_tasks: str = "all"          # comma-separated vision.TASKS, or all
    vision_eval_n: int = 200           # held-out image questions per eval (and their text twins)
    # model: see model.Config; these are the GPU defaults: Kimi Linear's 3:1 hybrid, block AttnRes, image tokens
    model: Config = field(default_factory=lambda: Config(
        block_size=512, n_layer=8, n_head=8, n_embd=512, pattern="KKKA", residual="attnres_block",
        attnres_block_size=2, vision=True, vision_patch_size=4, vision_n_embd=128, vision_n_layer=2))


# Without a GPU: the same ideas (KKKA, block AttnRes, image rows from step 0, MuonClip) at a size two
# CPU cores train in about four minutes. Image rows use the two tasks a model this small learns in time.
CPU_DEFAULTS = dict(data="shakespeare", batch_size=8, grad_accum=1, max_iters=400, warmup_iters=30,
                    eval_interval=100, eval_iters=10, ckpt_interval=200, lr=2e-3, sample_tokens=100,
                    vision_ratio=0.25, vision_tasks="color_one,side_one",
                    block_size=128, n_layer=4, n_head=4, n_embd=128, tie_embeddings=True,
                    vision_patch_size=8, vision_n_embd=64, vision_n_layer=1, vision_n_head=4)

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) for MFU, matched against the CUDA device
# name; the first match wins, so the more specific names come first. Unknown devices report MFU n/a.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("H800", 989.0),
               ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
               ("L4", 121.0), ("A10", 125.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0))


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
    if not 0.0 <= cfg.vision_ratio <= 1.0 or not 0.0 <= cfg.vision_start <= 1.0:
        raise SystemExit("error: --vision_ratio and --vision_start are fractions in [0, 1]")
    if cfg.vision_ratio > 0:
        import vision
        names = vision_task_names(cfg)
        bad = sorted(set(names) - set(vision.TASKS))
        if bad or not names:
            raise SystemExit(f"error: --vision_tasks={cfg.vision_tasks}: unknown {bad}; use all or a comma list of "
                             f"{', '.join(vision.TASKS)}")
        if round(cfg.vision_ratio * cfg.batch_size) < 1:
            raise SystemExit(f"error: --vision_ratio={cfg.vision_ratio} of --batch_size={cfg.batch_size} rows "
                             "rounds to no image row; raise one of them (or set --vision_ratio=0)")
    # the encoder exists exactly when image rows are trained, so the text-only baseline has no ViT
    cfg.model = replace(cfg.model, vision=cfg.vision_ratio > 0)
    if cfg.threads < 0 or cfg.peak_tflops < 0 or cfg.vision_eval_n < 1:
        raise SystemExit("error: --threads and --peak_tflops must be >= 0 and --vision_eval_n >= 1")
    return cfg


def vision_task_names(cfg: TrainConfig) -> tuple:
    import vision
    if cfg.vision_tasks == "all":
        return vision.TASKS
    return tuple(t.strip() for t in cfg.vision_tasks.split(",") if t.strip())


def peak_flops(device: str, override_tflops: float) -> tuple[float | None, str]:
    """(peak FLOP/s or None, where it came from) for MFU."""
    if override_tflops > 0:
        return override_tflops * 1e12, f"{override_tflops:g} TFLOP/s (--peak_tflops)"
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS:
            if key in name:
                return tflops * 1e12, f"{tflops:g} TFLOP/s ({name}, dense bf16)"
        return None, f"n/a (no peak known for {name}; set --peak_tflops)"
    return None, "n/a on CPU (set --peak_tflops to compute one)"


def format_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


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


def micro_batch(train_tokens, offsets: torch.Tensor, j: int, batch_size: int, T: int,
                vision_tasks=None, rows_vision: int = 0, vision_seed: int | None = None):
    """Micro-batch j of a step: text rows from offsets[j*batch_size : (j+1)*batch_size], the first
    rows_vision of them replaced by image-text rows drawn from (vision_seed, j). j counts micro-batches
    over all processes (micro * world + rank), so every process draws different image rows and N
    processes together see exactly the batch one process sees with N x the accumulation.
    -> (x [B, T], y [B, T] with -1 where no loss is taken, images: list per row, or None)."""
    x, y = data.get_batch(train_tokens, offsets[j * batch_size:(j + 1) * batch_size], T)
    if not rows_vision:
        return x, y, None
    vx, vy, images = vision_tasks.batch("train", rows_vision, T, np.random.default_rng([vision_seed, j]))
    x, y = torch.cat([vx, x[rows_vision:]]), torch.cat([vy, y[rows_vision:]])
    return x, y, images + [[] for _ in range(len(x) - rows_vision)]          # text rows carry no image


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
    if overrides.get("device", "auto") == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device=cuda but torch sees no CUDA device; use --device=cpu (or auto)")
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
    if not want_cuda:  # small models: a few threads per process do the work, more only add overhead
        per_process = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        torch.set_num_threads(cfg.threads or min(4, per_process))
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


def describe_run(cfg: TrainConfig, model: GPT, device: str, world: int, n_train: int, n_val: int,
                 tokens_per_step: int, peak_note: str, optimizer) -> str:
    """The header: everything that defines the run, one topic per line."""
    m = cfg.model
    kinds = m.layer_kinds
    head = "tied to the embedding" if m.tie_embeddings else "untied head"
    attn = "RoPE" if m.use_rope else "NoPE"
    lines = [f"device   {device}" + (f" x {world} processes" if world > 1 else "")
             + (f", {torch.get_num_threads()} threads" if not device.startswith("cuda") else ", bf16 autocast"),
             f"model    {m.n_layer} layers {kinds} (K = Kimi Delta Attention, A = softmax attention, {attn}), "
             f"width {m.n_embd}, {m.n_head} heads, context {m.block_size}",
             f"params   {model.num_params() / 1e6:.2f}M without embeddings, "
             f"{model.num_params(exclude_embedding=False) / 1e6:.2f}M with ({head})"]
    if m.residual == "attnres_block":
        n_blocks = math.ceil(2 * m.n_layer / m.attnres_block_size)
        lines.append(f"residual block Attention Residuals: {2 * m.n_layer} sublayers in {n_blocks} blocks of "
                     f"{m.attnres_block_size}, each sublayer reads the embedding + block summaries")
    else:
        lines.append(f"residual {m.residual}")
    if cfg.vision_ratio > 0:
        n_rows = int(round(cfg.vision_ratio * cfg.batch_size))
        start = f"from step {int(cfg.vision_start * cfg.max_iters)}" if cfg.vision_start else "from step 0 (early fusion)"
        enc = (f"ViT {m.vision_n_layer} layer(s) x {m.vision_n_embd} wide, 2-D RoPE" if m.vision_n_layer
               else "linear patch embedding (no ViT blocks)")
        lines.append(f"vision   {n_rows} of {cfg.batch_size} rows image-text {start}; tasks "
                     f"{', '.join(vision_task_names(cfg))}; {enc}, {m.vision_patch_size}-px patches merged 2x2")
    else:
        lines.append("vision   off (text only)")
    if cfg.optimizer == "adamw":
        lines.append(f"optim    AdamW lr {cfg.lr:g}, {cfg.schedule}, warmup {cfg.warmup_iters}, wd {cfg.weight_decay:g}")
    else:
        watched = ", ".join(n for n, _ in optimizer.attention_modules) or "none"
        clip = f"QK-Clip tau {cfg.qk_clip_tau:g}" if cfg.optimizer == "muonclip" else "no QK-Clip"
        lines.append(f"optim    {'MuonClip' if cfg.optimizer == 'muonclip' else 'Muon'} lr {cfg.lr:g}, {cfg.schedule}, "
                     f"warmup {cfg.warmup_iters}, wd {cfg.weight_decay:g}; {clip} on the softmax attentions: {watched}")
    total = tokens_per_step * cfg.max_iters
    lines.append(f"data     {cfg.data}: {n_train / 1e6:.2f}M train tokens, {n_val / 1e6:.2f}M val")
    lines.append(f"budget   {tokens_per_step:,} tokens/step x {cfg.max_iters} steps = {total / 1e6:.2f}M tokens "
                 f"= {total / n_train:.2f} epochs of the text" + (f" (stopping at step {cfg.stop_iter})" if cfg.stop_iter else "")
                 + (" (image rows included; they are generated, never repeated)" if cfg.vision_ratio > 0 else ""))
    lines.append(f"mfu      {peak_note}")
    return "\n".join(lines)


def _train(cfg: TrainConfig, device: str, rank: int, world: int, accum: int, master: bool, ddp: bool) -> dict:
    torch.manual_seed(cfg.seed)
    is_cuda = device.startswith("cuda")
    if is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if is_cuda else torch.autocast("cpu", enabled=False)
    t_start = time.time()

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

    vision_tasks, n_vision, blind = None, 0, None
    if cfg.vision_ratio > 0:
        import vision
        vision_tasks = vision.VisionTasks(seed=cfg.seed, encoding=data.get_tokenizer(),
                                          patch=cfg.model.vision_patch_size, tasks=vision_task_names(cfg))
        n_vision = int(round(cfg.vision_ratio * cfg.batch_size))       # image-text rows per micro-batch
        try:  # fail at the boundary, not at the first vision step
            vision_tasks.batch("train", 1, T, 0)
        except ValueError as e:
            raise SystemExit(f"error: --vision_ratio needs a longer --block_size: {e}") from None
        if master:  # what an image-blind model scores: each task's most common training answer
            blind = vision_tasks.majority_baseline("val", cfg.vision_eval_n)

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
            out["eval_train_loss" if split == "train" else "val_loss"] = float(np.mean(losses))
        if vision_tasks is not None:
            with autocast:
                out.update(vision_tasks.report(raw_model, "val", n=cfg.vision_eval_n))
            out.update(vision_n=cfg.vision_eval_n, vision_blind=blind)
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
    peak, peak_note = peak_flops(device, cfg.peak_tflops)
    if master:
        print(describe_run(cfg, raw_model, device, world, len(train_tokens), len(val_tokens), tokens_per_step,
                           peak_note, optimizer))
        print(f"setup    {time.time() - t_start:.1f} s (tokenising, model, vision baseline)", flush=True)
    attn_layers = raw_model.attention_layers()
    log_file = open(log_path, "a") if master else None
    step = start_step
    logit_peak, clipped = None, None        # per attention module, since the last log line
    last_eval = {}
    # throughput window: steps, tokens and this process's FLOPs since the last log line; the clock
    # restarts after eval and checkpoint writes, so their time never counts as training time
    window = dict(t0=time.time(), busy=0.0, steps=0, tokens=0, flops=0)
    t_loop, train_time = time.time(), 0.0
    model.train()
    while step < stop:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = sample_offsets(train_tokens, cfg.batch_size * cfg.grad_accum, data_gen)
        rows_vision = n_vision if vision_tasks is not None and step >= cfg.vision_start * cfg.max_iters else 0
        if rows_vision:  # one seed per step, the same on every process; micro-batch j draws its own rows
            vision_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=data_gen))
        loss_sum = torch.zeros((), device=device)
        step_flops = 0
        for micro in range(accum):
            j = micro * world + rank                     # this micro-batch's index in the global step
            x, y, images = micro_batch(train_tokens, offsets, j, cfg.batch_size, T,
                                       vision_tasks if rows_vision else None, rows_vision,
                                       vision_seed if rows_vision else None)
            step_flops += raw_model.training_flops(len(x), T, [tuple(im.shape[1:]) for row in images or [] for im in row],
                                                   head_positions=int((y != -1).sum()))
            x, y = x.to(device), y.to(device)
            sync = micro == accum - 1
            ctx = model.no_sync() if ddp and not sync else torch.enable_grad()
            with ctx, autocast:
                _, loss = model(x, y, images=images, loss_only=True)
                (loss / accum).backward()
            loss_sum += loss.detach() / accum
        if ddp:
            dist.all_reduce(loss_sum)              # gloo has no AVG: sum, then divide
            loss_sum /= world
        batch_loss = loss_sum.item()
        if not math.isfinite(batch_loss):
            kept = f"the last good checkpoint {ckpt_path} is kept" if os.path.exists(ckpt_path) else "no checkpoint was written yet"
            raise TrainingDiverged(f"loss is {batch_loss} at step {step}; stopping ({kept})")
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        window["steps"] += 1
        window["tokens"] += tokens_per_step
        window["flops"] += step_flops
        stats = getattr(optimizer, "last_clip_stats", None)
        if stats:  # QK-Clip acts every step: keep each module's peak and the clipped-head count between log lines
            logit_peak = [max(a, b) for a, b in zip(logit_peak, stats["max_logit"])] if logit_peak else list(stats["max_logit"])
            clipped = [a + b for a, b in zip(clipped, stats["clipped_heads"])] if clipped else list(stats["clipped_heads"])

        is_eval = step % cfg.eval_interval == 0 or step == stop
        if master and (step % cfg.log_interval == 0 or is_eval):
            now = time.time()
            dt = window["busy"] + now - window["t0"]          # training seconds of this window's steps
            train_time += dt
            rec = {"step": step, "batch_loss": batch_loss, "lr": lr, "tokens": step * tokens_per_step,
                   "tokens_per_s": window["tokens"] / max(dt, 1e-9), "window_steps": window["steps"],
                   "mfu": window["flops"] / max(dt, 1e-9) / peak if peak else None,
                   "elapsed_s": now - t_start}
            if stats:  # this step's per-module max logits, plus the peak and clip count since the last line
                rec.update({"attn_layers": stats["layers"], "max_logit": stats["max_logit"],
                            "clipped_heads": stats["clipped_heads"], "max_logit_peak": logit_peak,
                            "clipped_heads_since_last": clipped})
                logit_peak, clipped = None, None
            done = step - start_step
            eta = (now - t_loop) / done * (stop - step)
            mfu = f" | mfu {rec['mfu'] * 100:.1f}%" if rec["mfu"] is not None else ""
            print(f"step {step:>{len(str(stop))}}/{stop} | loss {batch_loss:.4f} | lr {lr:.2e} | "
                  f"{rec['tokens_per_s']:,.0f} tok/s{mfu} | {format_seconds(now - t_start)} elapsed, "
                  f"ETA {format_seconds(eta)}", flush=True)
            if is_eval:
                t_eval = time.time()
                last_eval = evaluate()
                rec.update(last_eval)
                line = f"eval step {step}/{stop} | text val {last_eval['val_loss']:.4f} (train {last_eval['eval_train_loss']:.4f})"
                if "vision_acc" in last_eval:
                    line += (f" | image acc {last_eval['vision_acc']:.3f} on {cfg.vision_eval_n} questions "
                             f"(blind {blind:.3f}) | twin acc {last_eval['twin_acc']:.3f}")
                print(line + f" | {time.time() - t_eval:.1f} s", flush=True)
            history.append(rec)
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()
        if master and (step % cfg.ckpt_interval == 0 or step == stop):
            window["busy"] += time.time() - window["t0"]     # a write between log lines is not training time
            save_checkpoint(ckpt_path, checkpoint_state(step))
            window["t0"] = time.time()
        if master and (step % cfg.log_interval == 0 or is_eval):
            window = dict(t0=time.time(), busy=0.0, steps=0, tokens=0, flops=0)

    result = {"history": history, "final_val_loss": last_eval.get("val_loss"), "out_dir": cfg.out_dir,
              "steps": step, "n_params": n_params, "wall_s": time.time() - t_start, "train_s": train_time}
    if "vision_acc" in last_eval:
        result.update(vision_acc=last_eval["vision_acc"], twin_acc=last_eval["twin_acc"], vision_blind=blind,
                      vision_n=cfg.vision_eval_n)
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
    """Left: the batch loss of logged steps and the eval losses; right (vision runs): image and twin accuracy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ev = [h for h in history if "val_loss" in h]
    vis = [h for h in ev if "vision_acc" in h]
    fig, axes = plt.subplots(1, 2 if vis else 1, figsize=(11 if vis else 6, 4), squeeze=False)
    ax = axes[0, 0]
    ax.plot([h["step"] for h in history], [h["batch_loss"] for h in history], alpha=0.6, label="training batch")
    ax.plot([h["step"] for h in ev], [h["eval_train_loss"] for h in ev], "s-", label="eval: train split")
    ax.plot([h["step"] for h in ev], [h["val_loss"] for h in ev], "o-", label="eval: val split")
    ax.set_xlabel("step"), ax.set_ylabel("text loss (nats/token)"), ax.legend(), ax.grid(alpha=0.3)
    if vis:
        ax = axes[0, 1]
        ax.plot([h["step"] for h in vis], [h["vision_acc"] for h in vis], "o-", label="image questions")
        ax.plot([h["step"] for h in vis], [h["twin_acc"] for h in vis], "s-", label="their text twins")
        ax.axhline(vis[-1]["vision_blind"], color="k", ls="--", lw=1, label="best blind answer")
        ax.set_xlabel("step"), ax.set_ylabel(f"exact-match accuracy ({vis[-1]['vision_n']} held-out)")
        ax.set_ylim(0, 1), ax.legend(), ax.grid(alpha=0.3)
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
        print(f"final text val loss {result['final_val_loss']:.4f} (unigram baseline {result['unigram_val_loss']:.4f})")
    if "vision_acc" in result:
        acc, blind, n = result["vision_acc"], result["vision_blind"], result["vision_n"]
        se = math.sqrt(max(blind * (1 - blind), 1e-12) / n)   # the blind answer's sampling noise on n questions
        print(f"final image accuracy {acc:.3f} on {n} held-out questions; best blind answer {blind:.3f} "
              f"(1 s.e. = {se:.3f}): {(acc - blind) / se:+.1f} s.e.; text twins {result['twin_acc']:.3f}")
    print(f"wall time {format_seconds(result['wall_s'])} (training {format_seconds(result['train_s'])}); "
          f"outputs in {result['out_dir']}/")
    if "sample" in result:
        print("---- sample ----\n" + result["sample"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
