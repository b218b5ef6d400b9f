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
--resume takes the whole configuration from the checkpoint; only the flags in SAFE_ON_RESUME may
change with it. Ctrl-C stops at the end of the current step and writes its checkpoint.
"""
import argparse
import contextlib
import inspect
import io
import json
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np
import torch
import torch.distributed as dist

import data
from kernels.launch import peak_flops
from model import GPT, Config

RUNS_DIR = "out"                  # where runs get their folders when --out_dir is not given
CHECKPOINT_FORMAT = 2             # bump when the checkpoint's layout changes; older ones are refused
# flags that may differ from the checkpoint's run when resuming: they change when and what is
# reported or where it runs, never the optimisation itself
SAFE_ON_RESUME = ("resume", "out_dir", "stop_iter", "log_interval", "eval_interval", "eval_iters", "ckpt_interval",
                  "sample_tokens", "device", "threads", "compile", "peak_tflops", "vision_eval_n")
ALIASES = {"steps": "max_iters"}  # the step count has one name across the project's scripts: --steps


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = ""                  # this run's folder; empty = a new out/run-<date>-<time>/
    overwrite: bool = False            # replace the run in --out_dir instead of refusing to touch it
    data: str = "all"                  # shakespeare | kjv | all (both, ~2.3M tokens) | path to a .txt file or folder
    resume: bool = False               # continue the run in --out_dir (default: out/latest) exactly
    ckpt_interval: int = 250           # steps between checkpoints (one is also written at the end)
    log_interval: int = 10             # steps between progress lines
    eval_interval: int = 100           # steps between evaluations (text val loss, image and twin accuracy)
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
    peak_tflops: float = 0.0           # the device's dense bf16 peak for MFU; 0 = look the GPU up in PEAK_TFLOPS
    # vision (vision.py): share of rows that are image-text, from which fraction of the run, which tasks
    vision_ratio: float = 0.125        # K2.5's early fusion: a modest share from step 0 (2 of 16 rows)
    vision_start: float = 0.0          # fraction of max_iters before the first image row (0 = early fusion)
    vision_tasks: str = "all"          # comma-separated image_tasks.TASKS, or all
    vision_eval_n: int = 200           # held-out image questions per eval (and their text twins)
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



class TrainingDiverged(RuntimeError):
    pass


# ----------------------------------------------------------------------------- configuration

def _field_types() -> dict:
    """{flag: python type} for every TrainConfig field (but model) and every model.Config field."""
    names = {"int": int, "float": float, "bool": bool, "str": str}
    out = {}
    for cls in (TrainConfig, Config):
        for f in fields(cls):
            if f.name != "model":
                out[f.name] = names.get(f.type, f.type) if isinstance(f.type, str) else f.type
    return out


def _field_help(cls) -> dict:
    """{field: the comment written after it in the class}: the config's comments are --help's text."""
    helps = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^#]*#\s*(.*)$", line)
        if m:
            helps[m.group(1)] = m.group(2)
    return helps


def add_flags(parser: argparse.ArgumentParser, **defaults):
    """Add train.py's flags (TrainConfig and model.Config fields) to an experiment's parser with the
    experiment's own defaults and train.py's help text: one name and one meaning per knob across scripts."""
    helps = {**_field_help(TrainConfig), **_field_help(Config)}
    for key, default in defaults.items():
        parser.add_argument(f"--{key}", type=type(default), default=default, help=helps[key].replace("%", "%%"))


def _parse_value(name: str, kind, value):
    """A flag's value (text from the command line, or a Python value) as its field's type."""
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        try:
            if kind is bool:
                if text.lower() not in ("1", "true", "yes", "", "0", "false", "no"):
                    raise ValueError
                value = text.lower() in ("1", "true", "yes", "")
            else:
                value = kind(text)
        except ValueError:
            raise SystemExit(f"error: --{name}={value!r} is not a valid {kind.__name__}") from None
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SystemExit(f"error: --{name}={value!r} is not a valid {kind.__name__}")
    if kind is float and not math.isfinite(value):
        raise SystemExit(f"error: --{name}={value}: must be a finite number")
    return value


def typed_overrides(overrides: dict) -> dict:
    """Flags (strings from the command line or Python values) -> {key: typed value}; unknown keys stop."""
    types = _field_types()
    overrides = {ALIASES.get(k, k): v for k, v in overrides.items()}
    unknown = sorted(set(overrides) - set(types))
    if unknown:
        raise SystemExit(f"error: unknown config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(types))}"
                         " (python train.py --help explains each)")
    return {k: _parse_value(k, types[k], v) for k, v in overrides.items()}


def make_config(overrides: dict, cuda: bool) -> TrainConfig:
    """TrainConfig from the defaults (+ CPU_DEFAULTS without a GPU) and overrides (values or strings)."""
    values = {} if cuda else dict(CPU_DEFAULTS)
    values.update(typed_overrides(overrides))
    model_keys = {f.name for f in fields(Config)}
    cfg = TrainConfig(**{k: v for k, v in values.items() if k not in model_keys})
    try:
        cfg.model = replace(cfg.model, **{k: v for k, v in values.items() if k in model_keys})
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    check_config(cfg)
    # the encoder exists exactly when image rows are trained, so the text-only baseline has no ViT
    cfg.model = replace(cfg.model, vision=cfg.vision_ratio > 0)
    return cfg


def need(ok: bool, message: str):
    """Stop with a one-line error unless ok."""
    if not ok:
        raise SystemExit(f"error: {message}")


def check_config(cfg: TrainConfig):
    """Values of the right type but out of range stop here, with the flag's name, before any work."""
    need(cfg.optimizer in ("adamw", "muon", "muonclip"), f"--optimizer={cfg.optimizer}: use adamw | muon | muonclip")
    need(cfg.schedule in ("cosine", "wsd"), f"--schedule={cfg.schedule}: use cosine | wsd")
    need(cfg.device in ("auto", "cuda", "cpu"), f"--device={cfg.device}: use auto | cuda | cpu")
    need(min(cfg.batch_size, cfg.grad_accum, cfg.max_iters, cfg.log_interval, cfg.eval_interval, cfg.eval_iters,
             cfg.ckpt_interval, cfg.vision_eval_n) >= 1,
         "batch_size, grad_accum, max_iters, log_interval, eval_interval, eval_iters, ckpt_interval and "
         "vision_eval_n must be >= 1")
    need(0 <= cfg.stop_iter <= cfg.max_iters, f"--stop_iter={cfg.stop_iter} must be in [0, max_iters={cfg.max_iters}]")
    need(min(cfg.warmup_iters, cfg.sample_tokens, cfg.threads, cfg.seed) >= 0,
         "warmup_iters, sample_tokens, threads and seed must be >= 0")
    need(cfg.lr > 0 and cfg.qk_clip_tau > 0, "--lr and --qk_clip_tau must be positive")
    need(cfg.weight_decay >= 0 and cfg.grad_clip >= 0 and cfg.peak_tflops >= 0,
         "--weight_decay, --grad_clip and --peak_tflops must be >= 0")
    need(0 <= cfg.min_lr_ratio <= 1, f"--min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1]")
    need(0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1, "--beta1 and --beta2 must be in [0, 1)")
    need(0 <= cfg.vision_ratio <= 1 and 0 <= cfg.vision_start <= 1, "--vision_ratio and --vision_start are fractions in [0, 1]")
    need(cfg.model.rope_theta > 0 and cfg.model.norm_eps > 0, "--rope_theta and --norm_eps must be positive")
    if cfg.vision_ratio > 0:
        import image_tasks
        import vision
        need(cfg.model.vocab_size > vision.IMAGE_PAD, f"--vocab_size={cfg.model.vocab_size}: image rows use token ids "
             f"up to {vision.IMAGE_PAD} (GPT-2's vocabulary and three image tokens)")
        names = vision_task_names(cfg)
        bad = sorted(set(names) - set(image_tasks.TASKS))
        need(not bad and bool(names), f"--vision_tasks={cfg.vision_tasks}: unknown {bad}; use all or a comma list of "
             f"{', '.join(image_tasks.TASKS)}")
        need(round(cfg.vision_ratio * cfg.batch_size) >= 1, f"--vision_ratio={cfg.vision_ratio} of --batch_size="
             f"{cfg.batch_size} rows rounds to no image row; raise one of them (or set --vision_ratio=0)")


def config_for_resume(saved: dict, overrides: dict, run_dir: str) -> TrainConfig:
    """The checkpoint's own run configuration, with only the SAFE_ON_RESUME flags allowed to change."""
    model = Config(**saved["model"])
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k != "model"}, model=model)
    for key, value in overrides.items():
        current = getattr(cfg.model if hasattr(cfg.model, key) else cfg, key)
        if key not in SAFE_ON_RESUME and value != current:
            raise SystemExit(f"error: --{key}={value} differs from the run being resumed ({key}={current}); --resume "
                             f"continues that run as configured (only {', '.join(SAFE_ON_RESUME[2:])} may change): "
                             "drop the flag, or start a new run without --resume")
    safe = {k: v for k, v in overrides.items() if k in SAFE_ON_RESUME and k not in ("resume", "out_dir")}
    # where the first part stopped is not part of the run: a resume runs to max_iters unless told otherwise
    cfg = replace(cfg, **{"stop_iter": 0, **safe, "resume": True, "out_dir": run_dir, "overwrite": False})
    check_config(cfg)
    return cfg


def vision_task_names(cfg: TrainConfig) -> tuple:
    import image_tasks
    if cfg.vision_tasks == "all":
        return image_tasks.TASKS
    return tuple(t.strip() for t in cfg.vision_tasks.split(",") if t.strip())


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line instead of argparse's usage block
        raise SystemExit(f"error: {message} (python train.py --help lists every key)")


def parse_args(argv: list[str]) -> dict:
    """The command line -> {key: text}. --key=value and --key value both work; a bare boolean flag
    (--resume) means true. Values are converted and checked by make_config."""
    cpu = make_config({}, cuda=False)
    gpu = make_config({}, cuda=True)
    parser = _Parser(prog="train.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                     epilog="Defaults are the GPU run's; where the CPU run (no GPU found) differs, both are shown. "
                            "Model keys are model.Config's fields.")
    types = _field_types()
    for title, cls in (("training", TrainConfig), ("model (model.Config)", Config)):
        group = parser.add_argument_group(title)
        helps = _field_help(cls)
        for f in fields(cls):
            if f.name == "model":
                continue
            owner_gpu, owner_cpu = (gpu, cpu) if cls is TrainConfig else (gpu.model, cpu.model)
            d_gpu, d_cpu = getattr(owner_gpu, f.name), getattr(owner_cpu, f.name)
            default = f"{d_gpu!r}" + (f", CPU: {d_cpu!r}" if d_cpu != d_gpu else "")
            kind = types[f.name]
            group.add_argument(f"--{f.name}", metavar=kind.__name__.upper(), default=argparse.SUPPRESS,
                               nargs="?" if kind is bool else None, const="true" if kind is bool else None,
                               help=f"{helps.get(f.name, '')} (default {default})".replace("%", "%%"))
    parser.add_argument("--steps", dest="max_iters", metavar="INT", default=argparse.SUPPRESS,
                        help="the same as --max_iters (the project's scripts share --steps)")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        import difflib
        names = [a.lstrip("-").split("=")[0] for a in unknown]
        close = [m for n in names for m in difflib.get_close_matches(n, list(types) + list(ALIASES), n=1)]
        hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
        raise SystemExit(f"error: unknown argument(s) {' '.join(unknown)}{hint}; python train.py --help lists every key")
    return vars(args)


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


# ----------------------------------------------------------------------------- run folders and checkpoints

RUN_FILES = ("ckpt.pt", "ckpt.pt.tmp", "log.jsonl", "loss.png", "max_logit.png", "sample.txt")


def claim_run_dir(cfg: TrainConfig) -> str:
    """The folder this new run writes: --out_dir, or a fresh out/run-<date>-<time>. A folder holding
    another run's files is never written over unless --overwrite says so (then those files go)."""
    if not cfg.out_dir:
        stamp = time.strftime("run-%Y%m%d-%H%M%S")
        name, n = stamp, 1
        while os.path.exists(os.path.join(RUNS_DIR, name)):
            n += 1
            name = f"{stamp}-{n}"
        run_dir = os.path.join(RUNS_DIR, name)
    else:
        run_dir = cfg.out_dir
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise SystemExit(f"error: --out_dir={run_dir} is a file, not a folder")
    taken = [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))]
    if taken and not cfg.overwrite:
        raise SystemExit(f"error: {run_dir} holds another run ({', '.join(taken)}); continue it with --resume "
                         f"--out_dir={run_dir}, pick a new --out_dir, or pass --overwrite to replace it")
    try:
        os.makedirs(run_dir, exist_ok=True)
        for f in taken:
            os.remove(os.path.join(run_dir, f))
        probe = os.path.join(run_dir, ".write_test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"error: cannot write to {run_dir}: {e.strerror}") from None
    return run_dir


def mark_latest(run_dir: str):
    """out/latest -> this run's folder (a symlink replaced atomically), so a bare --resume finds it."""
    if os.path.dirname(os.path.abspath(run_dir)) != os.path.abspath(RUNS_DIR):
        return                                  # only runs inside out/ compete for "latest"
    link = os.path.join(RUNS_DIR, "latest")
    tmp = link + f".tmp{os.getpid()}"
    os.symlink(os.path.basename(run_dir), tmp)
    os.replace(tmp, link)


def find_run_to_resume(out_dir: str) -> tuple[str, dict]:
    """(run folder, checkpoint) for --resume: --out_dir, else out/latest."""
    run_dir = out_dir or os.path.join(RUNS_DIR, "latest")
    if not out_dir and not os.path.exists(run_dir):
        raise SystemExit(f"error: --resume: no run to continue ({run_dir} does not exist); train without --resume first")
    run_dir = os.path.relpath(os.path.realpath(run_dir)) if not out_dir else run_dir
    return run_dir, load_checkpoint(os.path.join(run_dir, "ckpt.pt"))


def _fault(point: str, step: int):
    """Fault injection for the tests: KIMI_FAULT=<point>@<step> kills the process there (SIGKILL, no cleanup)."""
    if os.environ.get("KIMI_FAULT") == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(path: str, state: dict):
    """Write to a temporary file, flush it to disk, then rename: a crash at any moment leaves either the
    previous checkpoint or the new one, never a torn file."""
    step = state["step"]
    _fault("before_checkpoint", step)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        if os.environ.get("KIMI_FAULT") == f"during_checkpoint@{step}":
            f.write(payload[: len(payload) // 2])   # half a file on disk, then the process dies
            f.flush()
            _fault("during_checkpoint", step)
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fault("after_checkpoint", step)


def load_checkpoint(path: str) -> dict:
    if not os.path.exists(path):
        raise SystemExit(f"error: --resume: no checkpoint at {path}; train without --resume first")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torn file, not a checkpoint, or unsafe pickle content
        raise SystemExit(f"error: checkpoint {path} is corrupt or not a checkpoint ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        found = ckpt.get("format", "none") if isinstance(ckpt, dict) else "none"
        raise SystemExit(f"error: checkpoint {path} was written by another version of train.py (format {found}, this "
                         f"version reads {CHECKPOINT_FORMAT}); start a new run")
    missing = {"model", "optimizer", "step", "run_config", "data_rng", "cpu_rng"} - set(ckpt)
    if missing:
        raise SystemExit(f"error: checkpoint {path} is missing {', '.join(sorted(missing))}")
    return ckpt


def checkpoint_state(cfg: TrainConfig, model: GPT, optimizer, step: int, data_gen: torch.Generator) -> dict:
    state = {"format": CHECKPOINT_FORMAT, "run_config": asdict(cfg), "step": step, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "data_rng": data_gen.get_state(), "cpu_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        state["cuda_rng"] = torch.cuda.get_rng_state()
    return state


class StopOnCtrlC:
    """Ctrl-C asks the loop to stop after the current step (which then writes its checkpoint); a second
    Ctrl-C stops at once. Only the main thread can own a signal handler; elsewhere this does nothing."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self.active = threading.current_thread() is threading.main_thread()
        if self.active:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self.active:
            signal.signal(signal.SIGINT, self.previous)


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
    exact-match accuracy on the first vision_eval_n held-out image questions and on their text twins
    (with their number and the best image-blind accuracy, `blind`, beside them)."""
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

def _cuda_for(device: str) -> bool:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device=cuda but torch sees no CUDA device; use --device=cpu (or auto)")
    return device in ("auto", "cuda") and torch.cuda.is_available()


def train(**overrides) -> dict:
    """Run training with overrides of TrainConfig / model.Config fields (values or command-line text);
    return a summary dict. Under torchrun (RANK set) it runs one DDP process."""
    typed = typed_overrides(overrides)
    ckpt = None
    if typed.get("resume"):
        run_dir, ckpt = find_run_to_resume(typed.get("out_dir", ""))
        cfg = config_for_resume(ckpt["run_config"], typed, run_dir)
    else:
        cfg = make_config(typed, cuda=_cuda_for(typed.get("device", "auto")))
    want_cuda = _cuda_for(cfg.device)
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
        if not cfg.resume:   # rank 0 claims the folder; every process writes (rank 0) or reads the same one
            claimed = [None]
            if rank == 0:
                try:
                    claimed = [claim_run_dir(cfg)]
                except SystemExit as e:
                    claimed = [e]
            if ddp:
                dist.broadcast_object_list(claimed, src=0)
            if isinstance(claimed[0], SystemExit):
                raise claimed[0]
            cfg = replace(cfg, out_dir=claimed[0])
        result = run_training(cfg, ckpt, device, rank, world, ddp)
        if ddp:
            dist.barrier()   # tear down together: a gloo group whose peer already left can abort the process
        return result
    finally:
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
    model: torch.nn.Module          # what the loop calls (DDP- or compile-wrapped)
    raw_model: GPT                  # the module whose weights are saved, evaluated and sampled
    optimizer: torch.optim.Optimizer
    data_gen: torch.Generator       # the data order, the same on every process
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    folder: str                     # the tokenised data
    autocast: object
    vision_tasks: object = None
    blind: float | None = None      # the best image-blind accuracy on the eval questions
    history: list = field(default_factory=list)
    start_step: int = 0

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
    try:
        if rank == 0:
            data.prepare(cfg.data)
        if ddp:
            dist.barrier()                        # rank 0 tokenizes once; the others wait, then read
        folder = data.prepare(cfg.data)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    train_tokens, val_tokens = data.load_split(folder, "train"), data.load_split(folder, "val")
    T = cfg.model.block_size
    if len(val_tokens) <= T + 1 or len(train_tokens) <= T + 1:
        raise SystemExit(f"error: --data={cfg.data} has too few tokens for block_size={T} "
                         f"(train {len(train_tokens)}, val {len(val_tokens)})")
    largest = int(max(train_tokens.max(), val_tokens.max()))
    if largest >= cfg.model.vocab_size:
        raise SystemExit(f"error: --data={cfg.data} holds token id {largest}, beyond --vocab_size={cfg.model.vocab_size}")
    try:
        model = GPT(cfg.model).to(device)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    optimizer = build_optimizer(model, cfg)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    run = Run(cfg, device, rank, world, ddp, model, model, optimizer, data_gen, train_tokens, val_tokens, folder,
              torch.autocast("cuda", dtype=torch.bfloat16) if is_cuda else torch.autocast("cpu", enabled=False))
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise SystemExit(f"error: the checkpoint in {cfg.out_dir} does not fit this version's model "
                             f"({(str(e).splitlines() or [''])[0][:160]}); start a new run") from None
        run.start_step = ckpt["step"]
        data_gen.set_state(ckpt["data_rng"])
        torch.set_rng_state(ckpt["cpu_rng"])
        if is_cuda and "cuda_rng" in ckpt:
            torch.cuda.set_rng_state(ckpt["cuda_rng"])
        run.history = _log_until(os.path.join(cfg.out_dir, "log.jsonl"), run.start_step, rank == 0)
    if cfg.compile:
        run.model = torch.compile(model)
    if ddp:
        run.model = torch.nn.parallel.DistributedDataParallel(run.model, device_ids=[int(device.split(":")[1])] if is_cuda else None)
    if cfg.vision_ratio > 0:
        import image_tasks
        run.vision_tasks = image_tasks.VisionTasks(seed=cfg.seed, encoding=data.get_tokenizer(),
                                              patch=cfg.model.vision_patch_size, tasks=vision_task_names(cfg))
        try:  # fail at the boundary, not at the first vision step
            run.vision_tasks.batch("train", 1, T, 0)
        except ValueError as e:
            raise SystemExit(f"error: --vision_ratio needs a longer --block_size: {e}") from None
        if rank == 0:  # what an image-blind model scores: each task's most common training answer
            run.blind = run.vision_tasks.majority_baseline("val", cfg.vision_eval_n)
    return run


def _log_until(log_path: str, step: int, rewrite: bool) -> list[dict]:
    """The log lines up to `step` (a resumed run continues from its checkpoint, not from its last line)."""
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        history = [h for h in (json.loads(line) for line in f if line.strip()) if h["step"] <= step]
    if rewrite:
        tmp = log_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(h) + "\n" for h in history)
        os.replace(tmp, log_path)
    return history


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
        ctx = run.model.no_sync() if run.ddp and not sync else torch.enable_grad()
        with ctx, run.autocast:
            _, loss = run.model(x, y, images=images, loss_only=True)
            (loss / accum).backward()
        loss_sum += loss.detach() / accum
    return loss_sum, flops


class Progress:
    """Rank 0's bookkeeping between progress lines: the throughput window (steps, tokens and this process's
    FLOPs since the last line, timed without evaluations and checkpoint writes), QK-Clip's per-module peak
    max logit and clipped-head count, and the JSONL log."""

    def __init__(self, run: Run, stop: int, tokens_per_step: int, peak: float | None, t_start: float):
        self.run, self.stop, self.tokens_per_step, self.peak, self.t_start = run, stop, tokens_per_step, peak, t_start
        self.t_loop, self.train_time = time.time(), 0.0
        self.logit_peak = self.clipped = self.stats = None
        self.log_file = open(os.path.join(run.cfg.out_dir, "log.jsonl"), "a")
        self.new_window()

    def new_window(self):
        self.t0, self.busy, self.steps, self.tokens, self.flops = time.time(), 0.0, 0, 0, 0

    def add_step(self, flops: int, stats: dict | None):
        """One more optimizer step: this process's FLOPs, and the optimizer's last_clip_stats (or None)."""
        self.steps, self.tokens, self.flops = self.steps + 1, self.tokens + self.tokens_per_step, self.flops + flops
        self.stats = stats
        if stats:  # QK-Clip acts every step: keep each module's peak and clipped-head count between lines
            self.logit_peak = [max(a, b) for a, b in zip(self.logit_peak or stats["max_logit"], stats["max_logit"])]
            self.clipped = [a + b for a, b in zip(self.clipped or [0] * len(stats["clipped_heads"]),
                                                  stats["clipped_heads"])]

    @contextlib.contextmanager
    def paused(self):
        """A checkpoint write between progress lines is not training time."""
        self.busy += time.time() - self.t0
        yield
        self.t0 = time.time()

    def line(self, step: int, batch_loss: float, lr: float) -> dict:
        """The log record of this step (throughput over the window, the last step's max logits), printed."""
        now = time.time()
        dt = self.busy + now - self.t0                      # training seconds of this window's steps
        self.train_time += dt
        rec = {"step": step, "batch_loss": batch_loss, "lr": lr, "tokens": step * self.tokens_per_step,
               "tokens_per_s": self.tokens / max(dt, 1e-9), "window_steps": self.steps,
               "mfu": self.flops / max(dt, 1e-9) / self.peak if self.peak else None, "elapsed_s": now - self.t_start}
        if self.stats:  # this step's per-module max logits, plus the peak and clip count since the last line
            rec.update({"attn_layers": self.stats["layers"], "max_logit": self.stats["max_logit"],
                        "clipped_heads": self.stats["clipped_heads"], "max_logit_peak": self.logit_peak,
                        "clipped_heads_since_last": self.clipped})
            self.logit_peak = self.clipped = None
        print_progress(rec, self.stop, (now - self.t_loop) / (step - self.run.start_step) * (self.stop - step))
        return rec

    def write(self, rec: dict):
        self.run.history.append(rec)
        self.log_file.write(json.dumps(rec) + "\n")
        self.log_file.flush()

    def close(self) -> float:
        """Close the log; return the training seconds of all the logged windows."""
        self.log_file.close()
        return self.train_time

    def bar(self, step: int):
        """Between progress lines on a terminal, a bar that the next line overwrites."""
        if sys.stdout.isatty():
            filled = int(30 * step / self.stop)
            print(f"\r[{'#' * filled}{'.' * (30 - filled)}] step {step}/{self.stop}", end="", flush=True)


def run_training(cfg: TrainConfig, ckpt: dict | None, device: str, rank: int, world: int, ddp: bool) -> dict:
    # ---- setup: data, model, optimizer, image tasks (restored from ckpt when resuming), the header
    t_start = time.time()
    run = setup_run(cfg, ckpt, device, rank, world, ddp)
    stop, ckpt_path = cfg.stop_iter or cfg.max_iters, os.path.join(cfg.out_dir, "ckpt.pt")
    tokens_per_step = cfg.batch_size * cfg.model.block_size * cfg.grad_accum
    peak, peak_note = peak_flops(device, cfg.peak_tflops)
    progress = None
    if run.master:
        mark_latest(cfg.out_dir)
        print(describe_run(run, tokens_per_step, peak_note))
        print(f"setup    {time.time() - t_start:.1f} s; writing {cfg.out_dir}/"
              + (f" (resumed at step {run.start_step})" if cfg.resume else ""), flush=True)
        progress = Progress(run, stop, tokens_per_step, peak, t_start)
    step, last_eval, last_ckpt, interrupted = run.start_step, {}, run.start_step if cfg.resume else None, False
    run.model.train()
    with StopOnCtrlC() as ctrl_c:
        while step < stop and not interrupted:
            # ---- one optimizer step: the scheduled lr, grad_accum micro-batches, the mean loss over processes
            lr = lr_at(step, cfg)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            loss_sum, step_flops = train_step(run, step)
            flag = torch.stack([loss_sum, torch.tensor(float(ctrl_c.requested), device=device)])
            if ddp:
                dist.all_reduce(flag)              # the mean loss, and whether any process was interrupted
                flag[0] /= world
            batch_loss, interrupted = flag[0].item(), flag[1].item() > 0
            if not math.isfinite(batch_loss):
                kept = (f"this run's last good checkpoint (step {last_ckpt}) is kept in {ckpt_path}" if last_ckpt is not None
                        else "this run wrote no checkpoint yet")
                raise TrainingDiverged(f"loss is {batch_loss} at step {step}; stopping ({kept})")
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
                    print_eval(last_eval, step, stop, time.time() - t_eval)
                progress.write(rec)
            if step % cfg.ckpt_interval == 0 or step == stop or interrupted:
                with progress.paused():
                    save_checkpoint(ckpt_path, checkpoint_state(cfg, run.raw_model, run.optimizer, step, run.data_gen))
                last_ckpt = step
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
        result.update(vision_acc=last_eval["vision_acc"], twin_acc=last_eval["twin_acc"], vision_blind=run.blind,
                      vision_n=cfg.vision_eval_n)
    if not run.master or interrupted:
        return result
    result["unigram_val_loss"] = data.unigram_loss(run.folder)
    plot_losses(run.history, os.path.join(cfg.out_dir, "loss.png"))
    if run.raw_model.attention_layers() and any("max_logit" in h for h in run.history):
        plot_max_logits(run.history, os.path.join(cfg.out_dir, "max_logit.png"),
                        cfg.qk_clip_tau if cfg.optimizer == "muonclip" else None)
    if cfg.sample_tokens > 0:
        enc = data.get_tokenizer()
        prompt = torch.tensor([enc.encode_ordinary("\n")], device=run.device)
        with run.autocast:
            out = run.raw_model.generate(prompt, cfg.sample_tokens, temperature=0.8, top_k=200,
                                         generator=torch.Generator(device=run.device).manual_seed(cfg.seed))
        text = enc.decode([t for t in out[0].tolist() if t < enc.n_vocab])
        with open(os.path.join(cfg.out_dir, "sample.txt"), "w") as f:
            f.write(text)
        result["sample"] = text
    return result


# ----------------------------------------------------------------------------- reporting

def format_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"



def describe_run(run: Run, tokens_per_step: int, peak_note: str) -> str:
    """The header: everything that defines the run, one topic per line."""
    cfg, model, device, world, optimizer = run.cfg, run.raw_model, run.device, run.world, run.optimizer
    n_train, n_val = len(run.train_tokens), len(run.val_tokens)
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


def print_progress(rec: dict, stop: int, eta: float):
    mfu = f" | mfu {rec['mfu'] * 100:.1f}%" if rec["mfu"] is not None else ""
    clear = "\r\033[K" if sys.stdout.isatty() else ""      # erase the progress bar, if one is drawn
    print(f"{clear}step {rec['step']:>{len(str(stop))}}/{stop} | loss {rec['batch_loss']:.4f} | lr {rec['lr']:.2e} | "
          f"{rec['tokens_per_s']:,.0f} tok/s{mfu} | {format_seconds(rec['elapsed_s'])} elapsed, ETA {format_seconds(eta)}",
          flush=True)


def print_eval(ev: dict, step: int, stop: int, seconds: float):
    line = f"eval step {step}/{stop} | text val {ev['val_loss']:.4f} (train {ev['eval_train_loss']:.4f})"
    if "vision_acc" in ev:
        line += (f" | image acc {ev['vision_acc']:.3f} on {ev['vision_n']} questions (blind {ev['vision_blind']:.3f})"
                 f" | twin acc {ev['twin_acc']:.3f}")
    print(line + f" | {seconds:.1f} s", flush=True)


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
    except KeyboardInterrupt:   # a second Ctrl-C: stop at once, keeping the last checkpoint written
        print("interrupted: stopped at once; the run's last checkpoint is kept (continue with --resume)", file=sys.stderr)
        return 130
    if result["interrupted"]:
        print(f"interrupted: stopped at step {result['steps']} and wrote its checkpoint; continue with "
              f"python train.py --resume --out_dir={result['out_dir']}")
        return 130
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
