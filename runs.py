"""The plumbing that makes train.py trustworthy, kept out of the way of the loop.

    flags and checks      every TrainConfig / model.Config field is a --key=value flag; wrong keys, types
                          and ranges stop with one line (parse_args, make_config, check_config)
    run folders, resume   each run claims its own folder and never writes over another run's files;
                          out/latest names the newest; --resume takes the whole configuration from the
                          checkpoint and restores weights, optimizer, data order, RNGs and the log
    checkpoints           written to a temporary file, fsynced, renamed: a crash leaves the old or the
                          new one; loaded with weights_only=True and a format number
    faults, Ctrl-C        KIMI_FAULT=<point>@<step> kills the process there (the reliability tests);
                          Ctrl-C stops after the current step and writes its checkpoint
    progress, plots       the throughput window (without eval and checkpoint time), MFU, ETA, the
                          QK-Clip peaks between lines, the JSONL log, the run's header and its plots

train.py owns the configuration (TrainConfig, CPU_DEFAULTS) and passes its class in where a function
needs it, so this file imports nothing of train.py.
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
from dataclasses import asdict, fields, replace

import torch

import data
from model import Config

RUNS_DIR = "out"                  # where runs get their folders when --out_dir is not given
CHECKPOINT_FORMAT = 2             # bump when the checkpoint's layout changes; older ones are refused
# flags that may differ from the checkpoint's run when resuming: they change when and what is
# reported or where it runs, never the optimisation itself
SAFE_ON_RESUME = ("resume", "out_dir", "stop_iter", "log_interval", "eval_interval", "eval_iters", "ckpt_interval",
                  "sample_tokens", "device", "threads", "compile", "peak_tflops", "vision_eval_n")
ALIASES = {"steps": "max_iters"}  # the step count has one name across the project's scripts: --steps
RUN_FILES = ("ckpt.pt", "ckpt.pt.tmp", "log.jsonl", "loss.png", "max_logit.png", "sample.txt")


class TrainingDiverged(RuntimeError):
    pass


# ----------------------------------------------------------------------------- flags and checks

def field_types(train_cls) -> dict:
    """{flag: python type} for every field of train_cls (TrainConfig, but model) and of model.Config."""
    names = {"int": int, "float": float, "bool": bool, "str": str}
    out = {}
    for cls in (train_cls, Config):
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


def add_flags(parser: argparse.ArgumentParser, train_cls, **defaults):
    """Add train.py's flags (TrainConfig and model.Config fields) to an experiment's parser with the
    experiment's own defaults and train.py's help text: one name and one meaning per knob across scripts."""
    helps = {**_field_help(train_cls), **_field_help(Config)}
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


def typed_overrides(train_cls, overrides: dict) -> dict:
    """Flags (strings from the command line or Python values) -> {key: typed value}; unknown keys stop."""
    types = field_types(train_cls)
    overrides = {ALIASES.get(k, k): v for k, v in overrides.items()}
    unknown = sorted(set(overrides) - set(types))
    if unknown:
        raise SystemExit(f"error: unknown config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(types))}"
                         " (python train.py --help explains each)")
    return {k: _parse_value(k, types[k], v) for k, v in overrides.items()}


def make_config(train_cls, cpu_defaults: dict, overrides: dict, cuda: bool):
    """train_cls from its defaults (+ cpu_defaults without a GPU) and overrides (values or strings)."""
    values = {} if cuda else dict(cpu_defaults)
    values.update(typed_overrides(train_cls, overrides))
    model_keys = {f.name for f in fields(Config)}
    cfg = train_cls(**{k: v for k, v in values.items() if k not in model_keys})
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


def check_config(cfg):
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


def config_for_resume(train_cls, saved: dict, overrides: dict, run_dir: str):
    """The checkpoint's own run configuration, with only the SAFE_ON_RESUME flags allowed to change."""
    model = Config(**saved["model"])
    cfg = train_cls(**{k: v for k, v in saved.items() if k != "model"}, model=model)
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


def vision_task_names(cfg) -> tuple:
    import image_tasks
    if cfg.vision_tasks == "all":
        return image_tasks.TASKS
    return tuple(t.strip() for t in cfg.vision_tasks.split(",") if t.strip())


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line instead of argparse's usage block
        raise SystemExit(f"error: {message} (python train.py --help lists every key)")


def parse_args(train_cls, cpu_defaults: dict, argv: list[str], description: str) -> dict:
    """The command line -> {key: text}. --key=value and --key value both work; a bare boolean flag
    (--resume) means true. Values are converted and checked by make_config."""
    cpu = make_config(train_cls, cpu_defaults, {}, cuda=False)
    gpu = make_config(train_cls, cpu_defaults, {}, cuda=True)
    parser = _Parser(prog="train.py", description=description, allow_abbrev=False,
                     epilog="Defaults are the GPU run's; where the CPU run (no GPU found) differs, both are shown. "
                            "Model keys are model.Config's fields.")
    types = field_types(train_cls)
    for title, cls in (("training", train_cls), ("model (model.Config)", Config)):
        group = parser.add_argument_group(title)
        helps = _field_help(cls)
        for f in fields(cls):
            if f.name == "model":
                continue
            owner_gpu, owner_cpu = (gpu, cpu) if cls is train_cls else (gpu.model, cpu.model)
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


def cuda_for(device: str) -> bool:
    """Whether --device (auto | cuda | cpu) means CUDA here; --device=cuda without one stops."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device=cuda but torch sees no CUDA device; use --device=cpu (or auto)")
    return device in ("auto", "cuda") and torch.cuda.is_available()


# ----------------------------------------------------------------------------- run folders, resume, checkpoints

def claim_run_dir(cfg) -> str:
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


def claim_run_dir_everywhere(cfg, rank: int, ddp: bool) -> str:
    """Rank 0 claims the folder (claim_run_dir); under DDP every process gets the same one, or the same error."""
    claimed = [None]
    if rank == 0:
        try:
            claimed = [claim_run_dir(cfg)]
        except SystemExit as e:
            claimed = [e]
    if ddp:
        torch.distributed.broadcast_object_list(claimed, src=0)
    if isinstance(claimed[0], SystemExit):
        raise claimed[0]
    return claimed[0]


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


def checkpoint_state(cfg, model, optimizer, step: int, data_gen: torch.Generator) -> dict:
    state = {"format": CHECKPOINT_FORMAT, "run_config": asdict(cfg), "step": step, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "data_rng": data_gen.get_state(), "cpu_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        state["cuda_rng"] = torch.cuda.get_rng_state()
    return state


def load_text(cfg, rank: int, ddp: bool) -> tuple:
    """The tokenised corpus of --data -> (folder, train tokens, val tokens); rank 0 tokenizes once, and
    a corpus too short for the context or with ids beyond the vocabulary stops here."""
    try:
        if rank == 0:
            data.prepare(cfg.data)
        if ddp:
            torch.distributed.barrier()           # the others wait for rank 0, then read
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
    return folder, train_tokens, val_tokens


def restore(run, ckpt: dict):
    """--resume: the weights, optimizer state, data order, RNGs and the log up to the checkpoint's step."""
    try:
        run.raw_model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise SystemExit(f"error: the checkpoint in {run.cfg.out_dir} does not fit this version's model "
                         f"({(str(e).splitlines() or [''])[0][:160]}); start a new run") from None
    run.start_step = ckpt["step"]
    run.data_gen.set_state(ckpt["data_rng"])
    torch.set_rng_state(ckpt["cpu_rng"])
    if run.device.startswith("cuda") and "cuda_rng" in ckpt:
        torch.cuda.set_rng_state(ckpt["cuda_rng"])
    run.history = _log_until(os.path.join(run.cfg.out_dir, "log.jsonl"), run.start_step, run.rank == 0)


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


# ----------------------------------------------------------------------------- progress lines, the header, plots

class Progress:
    """Rank 0's bookkeeping between progress lines: the throughput window (steps, tokens and this process's
    FLOPs since the last line, timed without evaluations and checkpoint writes), QK-Clip's per-module peak
    max logit and clipped-head count, and the JSONL log."""

    def __init__(self, run, stop: int, tokens_per_step: int, peak: float | None, t_start: float):
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


def format_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def describe_run(run, tokens_per_step: int, peak_note: str) -> str:
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
