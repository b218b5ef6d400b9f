"""Train the model on the bundled corpus, nanoGPT-style.

    python train.py                                  # the mission's model: GPU if present, else CPU (~4 min)
    python train.py --pattern=A --residual=standard --vision_ratio=0   # the plain attention baseline
    python train.py --data=my_text.txt --max_iters 2000                # --key=value and --key value both work
    python train.py --resume                         # continue the newest run (out/latest) exactly
    python train.py --help                           # every key, its default and what it means
    torchrun --standalone --nproc_per_node=2 train.py   # DDP (NCCL on GPU, gloo on CPU)

Every TrainConfig field below and every model.Config field is a flag. Each run writes its own folder,
out/run-<date>-<time>/ (or --out_dir), and out/latest points at the newest: ckpt.pt, log.jsonl,
loss.png, max_logit.png, sample.txt. No run touches another run's folder: an --out_dir that holds a
run stops with a one-line error unless --resume (continue it) or --overwrite (replace it) is given.
--resume takes the whole configuration from the checkpoint; only the flags in runs.SAFE_ON_RESUME may
change with it. A second train.py writing the same folder at once is refused (an flock). Ctrl-C, SIGTERM
(preemption) and SIGHUP stop at the end of the current step and write its checkpoint.

This file is the configuration and the loop. The plumbing that makes runs trustworthy (flags and their
checks, run folders and resume rules, atomic checkpoints, fault injection, signals, progress lines,
plots) is in runs.py.
"""
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

import data
import runs
import sample
from kernels.launch import peak_flops
from model import GPT, Config
from runs import TrainingDiverged


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = ""                  # this run's folder; empty = a new out/run-<date>-<time>/
    overwrite: bool = False            # replace the run in --out_dir instead of refusing to touch it
    data: str = "all"                  # shakespeare | kjv | all (both, ~2.3M tokens) | path to a .txt file or folder
    resume: bool = False               # continue the run in --out_dir (default: out/latest) exactly
    ckpt_interval: int = 250           # steps between checkpoints (one is also written at the end)
    log_interval: int = 10             # steps between progress lines
    eval_interval: int = 100           # steps between evaluations (text val loss, image accuracy)
    eval_iters: int = 20               # batches per split in a text-loss evaluation
    sample_tokens: int = 200           # tokens sampled into sample.txt at the end (0 = none)
    seed: int = 1337                   # model init, data order and image rows
    # batch: tokens per optimizer step = batch_size * block_size * grad_accum
    batch_size: int = 16               # per micro-step, per process
    grad_accum: int = 2                # micro-steps per optimizer step, summed over processes
    # optimizer
    optimizer: str = "muonclip"        # muonclip | muon (no clip) | adamw
    lr: float = 3e-3                   # peak learning rate (Muon's update is scaled to AdamW's RMS, so one lr serves both)
    min_lr_ratio: float = 0.1          # final lr = lr * min_lr_ratio
    weight_decay: float = 0.1          # decoupled, on matrices and embeddings (not gains, biases, KDA gates)
    beta1: float = 0.9                 # AdamW's betas (also MuonClip's AdamW part)
    beta2: float = 0.95                # (second beta)
    grad_clip: float = 1.0             # 0 disables
    qk_clip_tau: float = 100.0         # QK-Clip threshold (muonclip only)
    schedule: str = "cosine"           # cosine | wsd (warmup, stable, linear decay over the last 20%)
    warmup_iters: int = 50             # linear warmup steps
    max_iters: int = 300               # length of the schedule: 300 x 16,384 tokens = 4.9M = 2.2 epochs of `all`
    stop_iter: int = 0                 # stop early at this step (0 = max_iters); resume continues
    # system
    device: str = "auto"               # auto | cuda | cpu
    threads: int = 0                   # CPU threads for torch; 0 = auto (up to 4 per process: small models gain little beyond)
    compile: bool = False              # torch.compile the model
    peak_tflops: float = 0.0           # the device's dense bf16 peak for MFU; 0 = look the GPU up in kernels.launch.PEAK_TFLOPS
    # vision (vision.py): share of rows that are image-text, from which fraction of the run, which tasks
    vision_ratio: float = 0.125        # K2.5's early fusion: a modest share from step 0 (2 of 16 rows)
    vision_start: float = 0.0          # fraction of max_iters before the first image row (0 = early fusion)
    vision_tasks: str = "all"          # comma-separated image_tasks.TASKS, or all
    vision_eval_n: int = 200           # held-out image questions per eval
    # model: see model.Config; these are the GPU defaults: Kimi Linear's 3:1 hybrid, block AttnRes, image tokens
    model: Config = field(default_factory=lambda: Config(
        block_size=512, n_layer=8, n_head=8, n_embd=512, pattern="KKKA", residual="attnres_block",
        attnres_block_size=2, vision=True, vision_patch_size=4, vision_n_embd=128, vision_n_layer=2))


# Without a GPU: the same ideas (KKKA, block AttnRes, image rows from step 0, MuonClip) at a size two
# CPU cores train in about four minutes. Image rows use the two one-shape tasks, which a model this small
# learns within the run (measured: lr 4e-3 reaches 0.97 image accuracy at step 200, 8e-3 only 0.67).
CPU_DEFAULTS = dict(data="shakespeare", batch_size=10, grad_accum=1, max_iters=200, warmup_iters=20,
                    eval_interval=50, eval_iters=5, ckpt_interval=100, lr=4e-3, sample_tokens=100,
                    vision_ratio=0.2, vision_tasks="color_one,side_one",
                    block_size=128, n_layer=4, n_head=4, n_embd=128, tie_embeddings=True,
                    vision_patch_size=8, vision_n_embd=64, vision_n_layer=1, vision_n_head=4)


# ----------------------------------------------------------------------------- configuration (checks: runs.py)

def make_config(overrides: dict, cuda: bool) -> TrainConfig:
    """TrainConfig from the defaults (+ CPU_DEFAULTS without a GPU) and overrides (values or strings)."""
    return runs.make_config(TrainConfig, CPU_DEFAULTS, overrides, cuda)


def parse_args(argv: list[str]) -> dict:
    """The command line -> {key: text}: --key=value and --key value both work; a bare boolean flag means true."""
    return runs.parse_args(TrainConfig, CPU_DEFAULTS, argv, description=__doc__.split("\n\n")[0])


def add_flags(parser, **defaults):
    """train.py's flags, with an experiment's own defaults and train.py's help text (one name per knob)."""
    runs.add_flags(parser, TrainConfig, **defaults)


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


# ----------------------------------------------------------------------------- data, optimizer, evaluation

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


@torch.no_grad()
def evaluate(model: GPT, cfg: TrainConfig, splits: dict, device: str, autocast, vision_tasks=None,
             blind: float | None = None) -> dict:
    """Text loss on the same eval_iters batches of each split every time, and, in a vision run,
    exact-match accuracy on the first vision_eval_n held-out image questions (with their number and the
    best image-blind accuracy, `blind`, beside them). The text twins are not asked: the default mix has no
    caption or twin rows, so they would score 0 by construction (experiments/fusion_timing.py measures
    transfer where it is learnable)."""
    was_training = model.training
    model.eval()
    out, T = {}, cfg.model.block_size
    for split, tokens in splits.items():
        gen = torch.Generator().manual_seed(1234)
        losses = []
        for _ in range(cfg.eval_iters):
            x, y = data.get_batch(tokens, torch.randint(0, len(tokens) - T - 1, (cfg.batch_size,), generator=gen), T)
            with autocast:
                losses.append(model(x.to(device), y.to(device))[1].item())
        out["eval_train_loss" if split == "train" else "val_loss"] = float(np.mean(losses))
    if vision_tasks is not None:
        with autocast:
            out.update(vision_tasks.report(model, "val", n=cfg.vision_eval_n))
        out.update(vision_n=cfg.vision_eval_n, vision_blind=blind)
    model.train(was_training)
    return out


# ----------------------------------------------------------------------------- training

def train(**overrides) -> dict:
    """Run training with overrides of TrainConfig / model.Config fields (values or command-line text);
    return a summary dict. Under torchrun (RANK set) it runs one DDP process."""
    typed = runs.typed_overrides(TrainConfig, overrides)
    if typed.get("out_dir"):  # resolved: --out_dir=out/latest names the newest run itself
        typed["out_dir"] = runs.resolve_dir(typed["out_dir"])
    ckpt = None
    if typed.get("resume"):   # the whole configuration comes from the checkpoint (runs.SAFE_ON_RESUME may change)
        run_dir, ckpt = runs.find_run_to_resume(typed.get("out_dir", ""))
        cfg = runs.config_for_resume(TrainConfig, ckpt["run_config"], typed, run_dir)
        if ckpt["step"] >= cfg.max_iters:   # nothing left to train: said, not redone (a requeued job exits 0)
            return {"out_dir": run_dir, "steps": ckpt["step"], "finished_before": True, "interrupted": False}
    else:
        cfg = make_config(typed, cuda=runs.cuda_for(typed.get("device", "auto")))
    want_cuda = runs.cuda_for(cfg.device)
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world, device = 0, 1, "cuda" if want_cuda else "cpu"
    if ddp:
        dist.init_process_group("nccl" if want_cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if want_cuda:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
    try:
        if cfg.grad_accum % world:
            raise SystemExit(f"error: grad_accum={cfg.grad_accum} must be a multiple of the {world} processes")
        if not want_cuda:  # small models: a few threads per process do the work, more only add overhead
            per_process = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
            torch.set_num_threads(cfg.threads or min(4, per_process))
        runs.check_memory(cfg, device, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        with runs.StopOnSignal() as signals:   # SIGINT, SIGTERM, SIGHUP: stop after the step, with a checkpoint
            result = run_training(cfg, ckpt, device, rank, world, ddp, signals)
        result["signal"] = signals.signum
        if ddp:
            dist.barrier()   # tear down together: a gloo group whose peer already left can abort the process
        return result
    finally:
        runs.release_run_dirs()
        if ddp:
            dist.destroy_process_group()


@dataclass
class Run:
    """What one training run holds while it trains."""
    cfg: TrainConfig
    device: str
    rank: int
    world: int
    ddp: bool
    raw_model: GPT                  # the module whose weights are saved, evaluated and sampled
    optimizer: torch.optim.Optimizer
    data_gen: torch.Generator       # the data order, the same on every process
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    folder: str                     # the tokenised data
    autocast: object
    model: torch.nn.Module = None   # what the loop calls: raw_model, or it wrapped by DDP or torch.compile
    vision_tasks: object = None
    blind: float | None = None      # the best image-blind accuracy on the eval questions
    history: list = field(default_factory=list)
    start_step: int = 0

    def __post_init__(self):
        if self.model is None:
            self.model = self.raw_model

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_run(cfg: TrainConfig, ckpt: dict | None, device: str, rank: int, world: int, ddp: bool) -> Run:
    """Data, model, optimizer and image tasks of a run, restored from ckpt when resuming."""
    torch.manual_seed(cfg.seed)
    is_cuda = device.startswith("cuda")
    if is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    folder, train_tokens, val_tokens = runs.load_text(cfg, rank, ddp)
    T = cfg.model.block_size
    try:
        model = GPT(cfg.model).to(device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    optimizer = build_optimizer(model, cfg)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if is_cuda else torch.autocast("cpu", enabled=False)
    run = Run(cfg=cfg, device=device, rank=rank, world=world, ddp=ddp, raw_model=model,
              optimizer=optimizer, data_gen=data_gen, train_tokens=train_tokens, val_tokens=val_tokens,
              folder=folder, autocast=autocast)
    if ckpt is not None:
        runs.restore(run, ckpt)   # weights, optimizer, data order, RNGs, the log up to the checkpoint
    if cfg.compile:
        run.model = torch.compile(model)
    if ddp:
        run.model = torch.nn.parallel.DistributedDataParallel(run.model, device_ids=[int(device.split(":")[1])] if is_cuda else None)
    if cfg.vision_ratio > 0:
        import image_tasks
        run.vision_tasks = image_tasks.VisionTasks(seed=cfg.seed, encoding=data.get_tokenizer(),
                                              patch=cfg.model.vision_patch_size, tasks=runs.vision_task_names(cfg))
        # fail at the boundary, not at a later step: the longest of many examples must fit in a row
        longest = max(len(run.vision_tasks.tokens(run.vision_tasks.example("train", i))[0]) for i in range(300))
        if longest > T + 1:
            raise SystemExit(f"error: --vision_ratio needs a longer --block_size: block_size={T} is too small for a "
                             f"{longest}-token example")
        if rank == 0:  # what an image-blind model scores: each task's most common training answer
            run.blind = run.vision_tasks.majority_baseline("val", cfg.vision_eval_n)
    return run


def train_step(run: Run, step: int) -> tuple[torch.Tensor, int]:
    """One optimizer step over grad_accum micro-batches (this process's share) -> (mean loss, this process's FLOPs)."""
    cfg, T = run.cfg, run.cfg.model.block_size
    accum = cfg.grad_accum // run.world
    offsets = torch.randint(0, len(run.train_tokens) - T - 1, (cfg.batch_size * cfg.grad_accum,), generator=run.data_gen)
    rows_vision, vision_seed = 0, None
    if run.vision_tasks is not None and step >= cfg.vision_start * cfg.max_iters:
        rows_vision = int(round(cfg.vision_ratio * cfg.batch_size))
        vision_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=run.data_gen))  # one per step, every process
    loss_sum, flops = torch.zeros((), device=run.device), 0
    for micro in range(accum):
        j = micro * run.world + run.rank                 # this micro-batch's index in the global step
        x, y, images = micro_batch(run.train_tokens, offsets, j, cfg.batch_size, T, run.vision_tasks, rows_vision,
                                   vision_seed)
        sizes = [tuple(im.shape[1:]) for row in images or [] for im in row]
        flops += run.raw_model.training_flops(len(x), T, sizes, head_positions=int((y != -1).sum()))
        x, y = x.to(run.device), y.to(run.device)
        sync = micro == accum - 1
        ctx = run.model.no_sync() if run.ddp and not sync else contextlib.nullcontext()
        with ctx, run.autocast:
            _, loss = run.model(x, y, images=images, loss_only=True)
            (loss / accum).backward()
        loss_sum += loss.detach() / accum
    return loss_sum, flops


def run_training(cfg: TrainConfig, ckpt: dict | None, device: str, rank: int, world: int, ddp: bool,
                 signals: runs.StopOnSignal) -> dict:
    # ---- setup: data, model, optimizer, image tasks (restored from ckpt when resuming), the header
    t_start = time.time()
    run = setup_run(cfg, ckpt, device, rank, world, ddp)
    # every check passed: only now is the run's folder claimed (locked) and written
    cfg = run.cfg = replace(cfg, out_dir=runs.claim_run_dir_everywhere(cfg, rank, ddp))
    stop, ckpt_path = cfg.stop_iter or cfg.max_iters, os.path.join(cfg.out_dir, "ckpt.pt")
    tokens_per_step = cfg.batch_size * cfg.model.block_size * cfg.grad_accum
    peak, peak_note = peak_flops(device, cfg.peak_tflops)
    progress = None
    if run.master:
        runs.mark_latest(cfg.out_dir)
        print(runs.describe_run(run, tokens_per_step, peak_note))
        print(f"setup    {time.time() - t_start:.1f} s; writing {cfg.out_dir}/"
              + (f" (resumed at step {run.start_step})" if cfg.resume else ""), flush=True)
        progress = runs.Progress(run, stop, tokens_per_step, peak, t_start)
    step, last_eval, last_ckpt, interrupted = run.start_step, {}, run.start_step if cfg.resume else None, False
    signals.run_dir, signals.ckpt_step = cfg.out_dir, last_ckpt
    run.model.train()
    with signals.loop():
        while step < stop and not interrupted:
            # ---- one optimizer step: the scheduled lr, grad_accum micro-batches, the mean loss over processes
            lr = lr_at(step, cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            loss_sum, step_flops = train_step(run, step)
            flag = torch.stack([loss_sum, torch.tensor(float(signals.requested), device=device)])
            if ddp:
                dist.all_reduce(flag)              # the mean loss, and whether any process was interrupted
                flag[0] /= world
            batch_loss, interrupted = flag[0].item(), flag[1].item() > 0
            if not math.isfinite(batch_loss):
                runs.stop_diverged(cfg, step, batch_loss, last_ckpt, run.master)   # raises TrainingDiverged
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), cfg.grad_clip)
            run.optimizer.step()                   # MuonClip: Muon/AdamW updates, then QK-Clip
            run.optimizer.zero_grad(set_to_none=True)
            step += 1
            if not run.master:
                continue
            # ---- rank 0: the progress line and log record, an evaluation, a checkpoint
            progress.add_step(step_flops, getattr(run.optimizer, "last_clip_stats", None))
            is_log = step % cfg.log_interval == 0 or step % cfg.eval_interval == 0 or step == stop or interrupted
            if is_log:
                rec = progress.line(step, batch_loss, lr)
                if step % cfg.eval_interval == 0 or step == stop:
                    t_eval = time.time()
                    last_eval = evaluate(run.raw_model, cfg, {"train": run.train_tokens, "val": run.val_tokens},
                                         device, run.autocast, run.vision_tasks, run.blind)
                    rec.update(last_eval)
                    runs.print_eval(last_eval, step, stop, time.time() - t_eval)
                    if not math.isfinite(last_eval["val_loss"]):   # the last update broke the weights
                        runs.stop_diverged(cfg, step, last_eval["val_loss"], last_ckpt, run.master)
                progress.write(rec)
            if step % cfg.ckpt_interval == 0 or step == stop or interrupted:
                with progress.paused():
                    runs.save_checkpoint(ckpt_path, runs.checkpoint_state(cfg, run.raw_model, run.optimizer, step, run.data_gen))
                last_ckpt = signals.ckpt_step = step
            if is_log:
                progress.new_window()
            else:
                progress.bar(step)
    train_s = progress.close() if progress else 0.0
    return finish_run(run, step, last_eval, interrupted, time.time() - t_start, train_s)


def finish_run(run: Run, step: int, last_eval: dict, interrupted: bool, wall_s: float, train_s: float) -> dict:
    """Plots, the sample, and the summary dict train() returns."""
    cfg = run.cfg
    result = {"history": run.history, "final_val_loss": last_eval.get("val_loss"), "out_dir": cfg.out_dir,
              "steps": step, "n_params": run.raw_model.num_params(), "wall_s": wall_s, "train_s": train_s,
              "interrupted": interrupted}
    if "vision_acc" in last_eval:
        result.update(vision_acc=last_eval["vision_acc"], vision_blind=run.blind, vision_n=cfg.vision_eval_n)
    if not run.master or interrupted:
        return result
    result["unigram_val_loss"] = data.unigram_loss(run.folder)
    runs.plot_losses(run.history, os.path.join(cfg.out_dir, "loss.png"))
    if run.raw_model.attention_layers() and any("max_logit" in h for h in run.history):
        runs.plot_max_logits(run.history, os.path.join(cfg.out_dir, "max_logit.png"),
                        cfg.qk_clip_tau if cfg.optimizer == "muonclip" else None)
    if cfg.sample_tokens > 0:
        enc = data.get_tokenizer()          # sample.py's defaults print this text again from the checkpoint
        text = sample.sample_text(run.raw_model, enc, enc.encode_ordinary(sample.PROMPT), cfg.sample_tokens,
                                  torch.Generator(device=run.device).manual_seed(cfg.seed), autocast=run.autocast)
        with open(os.path.join(cfg.out_dir, "sample.txt"), "w") as f:
            f.write(text)
        result["sample"] = text
    return result


def main(argv: list[str]) -> int:
    try:
        result = train(**parse_args(argv))
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except runs.Interrupted as e:   # a second signal, or one outside the loop: stop at once
        print(f"interrupted by {e}: stopped at once; {e.kept}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:       # before the run was set up
        print("interrupted: stopped at once; nothing was written", file=sys.stderr)
        return 130
    except OSError as e:            # a full disk or a vanished folder while writing the final outputs
        print(f"error: {e.filename or 'a write'}: {e.strerror or e}", file=sys.stderr)
        return 1
    if result.get("finished_before"):
        print(f"nothing to do: {result['out_dir']} already finished (step {result['steps']} = its max_iters); "
              "to train longer, start a new run with a larger --max_iters")
        return 0
    if result["interrupted"]:
        signum = result.get("signal") or signal.SIGINT   # under DDP the signal may have reached another process
        print(f"interrupted by {signal.Signals(signum).name}: stopped at step {result['steps']} and wrote its "
              f"checkpoint; continue with python train.py --resume --out_dir={result['out_dir']}")
        return 128 + signum
    if result.get("final_val_loss") is not None:
        print(f"final text val loss {result['final_val_loss']:.4f} (unigram baseline {result['unigram_val_loss']:.4f})")
    if "vision_acc" in result:
        acc, blind, n = result["vision_acc"], result["vision_blind"], result["vision_n"]
        se = math.sqrt(max(blind * (1 - blind), 1e-12) / n)   # the blind answer's sampling noise on n questions
        print(f"final image accuracy {acc:.3f} on {n} held-out questions; best blind answer {blind:.3f} "
              f"(1 s.e. = {se:.3f}): {(acc - blind) / se:+.1f} s.e.")
    print(f"wall time {runs.format_seconds(result['wall_s'])} (training {runs.format_seconds(result['train_s'])}); "
          f"outputs in {result['out_dir']}/")
    if "sample" in result:
        print("---- sample ----\n" + result["sample"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
