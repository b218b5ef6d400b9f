"""The plumbing that makes train.py trustworthy, kept out of the way of the loop.

    flags and checks      every TrainConfig / model.Config field is a --key=value flag; wrong keys, types
                          and ranges stop with one line (parse_args, make_config, check_config), and so
                          does a run too large for the memory (check_memory); bounded() does the same
                          for the other scripts' argparse flags
    run folders, resume   each run claims (flocks) its own folder once every check has passed, and never
                          writes over another run's files; out/latest names the newest; --resume takes
                          the whole configuration from the checkpoint and restores weights, optimizer,
                          data order, RNGs and the log
    checkpoints           written to a fresh temporary file, fsynced, renamed: a crash leaves the old or
                          the new one, a full disk one line; loaded with weights_only=True and a format number
    faults, signals       KIMI_FAULT=<point>@<step> kills the process there (the reliability tests);
                          Ctrl-C, SIGTERM and SIGHUP stop after the current step and write its checkpoint
    progress, plots       the throughput window (without eval and checkpoint time), MFU, ETA, the
                          QK-Clip peaks between lines, the JSONL log, the run's header and its plots

train.py owns the configuration (TrainConfig, CPU_DEFAULTS) and passes its class in where a function
needs it, so this file imports nothing of train.py.
"""
import argparse
import contextlib
import fcntl
import glob
import inspect
import io
import itertools
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
DIVERGED = "diverged.txt"         # written by a run that stopped on a non-finite loss
RUN_FILES = ("ckpt.pt", "log.jsonl", "loss.png", "max_logit.png", "sample.txt", DIVERGED)
LOCK_FILE = ".lock"               # flocked by the process that writes the run (lock_run_dir)


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
    for key, default in defaults.items():   # every int field is >= 0; floats finite (the config checks the rest)
        kind = {int: bounded(int, 0, 2**63 - 1), float: bounded(float, -1e30, 1e30)}.get(type(default), type(default))
        parser.add_argument(f"--{key}", type=kind, default=default, help=helps[key].replace("%", "%%"))


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
    if kind in (int, float) and abs(value) > (2**63 - 1 if kind is int else 1e30):   # C longs, float32 math
        raise SystemExit(f"error: --{name}={value!r}: too large (at most {'2**63 - 1' if kind is int else '1e30'})")
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


def bounded(kind=int, low=None, high=None):
    """An argparse type= for the scripts' own flags: a finite `kind` in [low, high], else argparse's one
    error line (never a traceback later)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is outside [{'-inf' if low is None else low}, "
                                             f"{'inf' if high is None else high}]")
        return value
    return parse


def bounded_list(kind=int, low=None, high=None):
    """An argparse type= for a comma-separated list of bounded values (`--seeds=101,102,103`), at least one."""
    one = bounded(kind, low, high)

    def parse(text: str) -> list:
        values = [one(t.strip()) for t in text.split(",") if t.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: give one or more comma-separated values")
        return values
    return parse


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
    need(cfg.threads <= (os.cpu_count() or 1), f"--threads={cfg.threads}: this machine has {os.cpu_count()} CPUs")
    need(cfg.model.backend != "triton" or cuda_for(cfg.device) or os.environ.get("TRITON_INTERPRET") == "1",
         "--backend=triton needs a CUDA device (or TRITON_INTERPRET=1, the interpreter); use --backend=auto")
    if cfg.vision_ratio > 0:
        need(cfg.model.vision_channels == 3, f"--vision_channels={cfg.model.vision_channels}: the image tasks draw "
             "RGB images; use 3")
        import image_tasks
        import vision
        need(cfg.model.vocab_size > vision.IMAGE_PAD, f"--vocab_size={cfg.model.vocab_size}: image rows use token ids "
             f"up to {vision.IMAGE_PAD} (GPT-2's vocabulary and three image tokens)")
        names = vision_task_names(cfg)
        bad = sorted(set(names) - set(image_tasks.ALL_TASKS))
        need(not bad and bool(names), f"--vision_tasks={cfg.vision_tasks}: unknown {bad}; use all or a comma list of "
             f"{', '.join(image_tasks.ALL_TASKS)}")
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

def resolve_dir(path: str) -> str:
    """A folder with its symlinks resolved, so --out_dir=out/latest names the newest run itself; relative
    when inside the working directory."""
    real = os.path.realpath(path)
    rel = os.path.relpath(real)
    return real if rel.startswith(os.pardir) else rel


_locks = {}   # run folder -> the open lock file of this process's claim on it


def lock_run_dir(run_dir: str):
    """This process's exclusive claim on run_dir: an flock on run_dir/.lock, which the kernel drops when the
    process ends, however it ends (a PID file breaks under PID reuse and on shared filesystems). Readers
    (sample.py, summarize_run) take none."""
    fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(f"error: {run_dir} is in use by another train.py that is still running (it holds "
                         f"{os.path.join(run_dir, LOCK_FILE)}); wait for it to end, or pick another --out_dir") from None
    except OSError as e:     # a filesystem without locks: run unguarded rather than not at all
        print(f"note: cannot lock {run_dir} ({e.strerror}); nothing stops a second run from writing there")
    _locks[run_dir] = fd


def release_run_dirs():
    """End this process's claims (train() does when it returns or fails; the kernel would at exit)."""
    while _locks:
        os.close(_locks.popitem()[1])


def _new_run_dir() -> str:
    """A fresh out/run-<date>-<time>[-n]; mkdir fails on a name that exists, so two runs started in the
    same second get two folders."""
    os.makedirs(RUNS_DIR, exist_ok=True)
    stamp = time.strftime("run-%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        run_dir = os.path.join(RUNS_DIR, stamp if n == 1 else f"{stamp}-{n}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(run_dir)
            return run_dir


def claim_run_dir(cfg) -> str:
    """The folder this run writes, claimed (lock_run_dir) before anything is written to it: the resumed
    run's own, --out_dir, or a fresh out/run-<date>-<time>. A folder holding another run's files is never
    written over unless --overwrite says so (then those files go); stale temporaries of a killed run go."""
    run_dir = cfg.out_dir
    try:
        if not run_dir:
            run_dir = _new_run_dir()
        elif os.path.exists(run_dir) and not os.path.isdir(run_dir):
            raise SystemExit(f"error: --out_dir={run_dir} is a file, not a folder")
        os.makedirs(run_dir, exist_ok=True)
        lock_run_dir(run_dir)
        taken = [] if cfg.resume else [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))]
        if taken and not cfg.overwrite:
            release_run_dirs()
            raise SystemExit(f"error: {run_dir} holds another run ({', '.join(taken)}); continue it with --resume "
                             f"--out_dir={run_dir}, pick a new --out_dir, or pass --overwrite to replace it")
        stale = [f for f in os.listdir(run_dir) if f.endswith(".tmp") or (cfg.resume and f == DIVERGED)]
        for f in taken + stale:
            os.remove(os.path.join(run_dir, f))
    except OSError as e:
        release_run_dirs()
        raise SystemExit(f"error: cannot write to {run_dir or RUNS_DIR}: {e.strerror}") from None
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
    """out/latest -> this run's folder, a symlink replaced atomically, so a bare --resume finds it. Only runs
    inside out/ compete for it; a real file or folder named out/latest is left alone."""
    if os.path.dirname(os.path.realpath(run_dir)) != os.path.realpath(RUNS_DIR):
        return
    link, tmp = os.path.join(RUNS_DIR, "latest"), os.path.join(RUNS_DIR, f"latest.{os.getpid()}.tmp")
    if os.path.lexists(link) and not os.path.islink(link):
        print(f"note: {link} is not a symlink, so it is left as it is and does not name this run")
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        os.symlink(os.path.basename(os.path.realpath(run_dir)), tmp)
        os.replace(tmp, link)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        print(f"note: cannot point {link} at {run_dir} ({e.strerror})")


def find_run_to_resume(out_dir: str) -> tuple[str, dict]:
    """(run folder, checkpoint) for --resume: --out_dir, else out/latest's run if it can continue (if not,
    the error names the newest run that can)."""
    if out_dir:
        return out_dir, load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    link = os.path.join(RUNS_DIR, "latest")
    if not os.path.exists(link):
        raise SystemExit(f"error: --resume: no run to continue ({link} does not exist); train without --resume first")
    run_dir = resolve_dir(link)
    why = _cannot_continue(run_dir)
    if why:
        other = next((d for d in _runs_newest_first() if d != run_dir and not _cannot_continue(d)), None)
        hint = (f"the newest run that can continue is {other}: python train.py --resume --out_dir={other}" if other
                else f"no run under {RUNS_DIR}/ can continue; train without --resume")
        raise SystemExit(f"error: --resume: {link} ({run_dir}) {why}; {hint}")
    return run_dir, load_checkpoint(os.path.join(run_dir, "ckpt.pt"))


def _cannot_continue(run_dir: str) -> str:
    """Why a bare --resume must not pick run_dir, or '' if it may."""
    if os.path.exists(os.path.join(run_dir, DIVERGED)):
        return "diverged (resuming would repeat it exactly: same data, same seeds)"
    return "" if os.path.exists(os.path.join(run_dir, "ckpt.pt")) else "wrote no checkpoint"


def _runs_newest_first() -> list[str]:
    found = glob.glob(os.path.join(glob.escape(RUNS_DIR), "*", "ckpt.pt"))
    return [os.path.dirname(p) for p in sorted(found, key=os.path.getmtime, reverse=True)
            if not os.path.islink(os.path.dirname(p))]


def stop_diverged(cfg, step: int, loss: float, last_ckpt: int | None, master: bool):
    """A non-finite loss: note it in the run's folder (a bare --resume then names a run that can continue
    instead) and stop."""
    kept = (f"this run's last good checkpoint (step {last_ckpt}) is kept in {os.path.join(cfg.out_dir, 'ckpt.pt')}"
            if last_ckpt is not None else "this run wrote no checkpoint yet")
    message = f"loss is {loss} at step {step}; stopping ({kept})"
    if master:
        with contextlib.suppress(OSError), open(os.path.join(cfg.out_dir, DIVERGED), "w") as f:
            f.write(message + "\n")
    raise TrainingDiverged(message)


def _fault(point: str, step: int):
    """Fault injection for the tests: KIMI_FAULT=<point>@<step> kills the process there (SIGKILL, no cleanup)."""
    if os.environ.get("KIMI_FAULT") == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def write_atomically(path: str, write):
    """write(file) into a fresh temporary file beside path, fsync, rename over path: a crash at any moment
    leaves the old file or the new one. The temporary is created exclusively (O_EXCL: never through a
    symlink planted at its name); those of a killed process go first (the run's lock says no one else
    writes here). An OSError (a full disk, a file-size limit) is one line, the old file intact."""
    folder, name = os.path.split(path)
    for f in os.listdir(folder or "."):
        if f.startswith(name + ".") and f.endswith(".tmp"):
            os.remove(os.path.join(folder, f))
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise SystemExit(f"error: cannot write {path}: {e.strerror or e} (a full disk or a file-size limit?); "
                         f"the previous {name}, if any, is unchanged") from None


def save_checkpoint(path: str, state: dict):
    """The checkpoint, written atomically (write_atomically): a crash leaves the previous one or this one."""
    step = state["step"]
    _fault("before_checkpoint", step)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()

    def write(f):
        if os.environ.get("KIMI_FAULT") == f"during_checkpoint@{step}":
            f.write(payload[: len(payload) // 2])   # half a file on disk, then the process dies
            f.flush()
            _fault("during_checkpoint", step)
        f.write(payload)

    write_atomically(path, write)
    _fault("after_checkpoint", step)


# what each caller of load_checkpoint tells the user: (where there is no checkpoint, where it is unusable)
CHECKPOINT_FIXES = {"--resume": ("train without --resume first", "start a new run"),
                    "sample.py": ("train a run first (python train.py) or give --out_dir=<a run's folder>",
                                  "train a new run to sample from")}


def load_checkpoint(path: str, caller: str = "--resume") -> dict:
    """The checkpoint at path, checked (format, keys); caller (a key of CHECKPOINT_FIXES) words the errors."""
    missing_fix, unusable_fix = CHECKPOINT_FIXES[caller]
    if not os.path.exists(path):
        raise SystemExit(f"error: {caller}: no checkpoint at {path}; {missing_fix}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torn file, not a checkpoint, or unsafe pickle content
        raise SystemExit(f"error: checkpoint {path} is corrupt or not a checkpoint ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]}); {unusable_fix}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        found = ckpt.get("format", "none") if isinstance(ckpt, dict) else "none"
        raise SystemExit(f"error: checkpoint {path} was written by another version of train.py (format {found}, this "
                         f"version reads {CHECKPOINT_FORMAT}); {unusable_fix}")
    missing = {"model", "optimizer", "step", "run_config", "data_rng", "cpu_rng"} - set(ckpt)
    if missing:
        raise SystemExit(f"error: checkpoint {path} is missing {', '.join(sorted(missing))}; {unusable_fix}")
    return ckpt


def checkpoint_state(cfg, model, optimizer, step: int, data_gen: torch.Generator) -> dict:
    state = {"format": CHECKPOINT_FORMAT, "run_config": asdict(cfg), "step": step, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "data_rng": data_gen.get_state(), "cpu_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        state["cuda_rng"] = torch.cuda.get_rng_state()
    return state


def memory_estimate(cfg, cuda: bool) -> int:
    """A conservative bound (bytes) on one process's peak memory: the interpreter and torch, the weights
    with their gradients and optimizer state (4 copies), and a step's activations per token: the logits
    three times (logits, log-softmax, gradient), each layer's tensors, one attention layer's T x T scores.
    1.1-1.4x the measured peak of the CPU default and of variants (README, Reliability)."""
    m = cfg.model
    B, T, V, D, L = cfg.batch_size, m.block_size, m.vocab_size, m.n_embd, m.n_layer
    hidden = m.mlp_hidden or 64 * math.ceil(8 * D / 3 / 64)                   # model.py's SwiGLU width
    wide = max(D, hidden, (m.kda_n_head or m.n_head) * (m.kda_head_dim or D // m.n_head))
    params = V * D * (1 if m.tie_embeddings else 2) + L * 12 * D * wide
    if cfg.vision_ratio > 0:
        E = m.vision_n_embd
        params += m.vision_n_layer * 12 * E * E + (m.vision_channels * m.vision_patch_size ** 2 + D) * 4 * E
    # SDPA keeps no T x T scores for backward; QK-Clip's max-logit pass builds one layer's at a time
    per_token = 3 * V + L * 48 * wide + (3 * m.n_head * T if "A" in m.layer_kinds else 0)
    base, act_bytes = (2**30, 2) if cuda else (500 * 2**20, 4)            # CUDA: bf16 activations, its workspaces
    return base + 16 * params + act_bytes * B * T * per_token


def available_memory(device: str) -> tuple[int, str]:
    """(bytes free for this process, where): the GPU's free memory, or RAM: MemAvailable (Linux; counts the
    reclaimable cache), else the free pages, capped by a cgroup (container) limit."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(device)[0], device
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                free = min(free, int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return free, "this machine"


def check_memory(cfg, device: str, processes: int):
    """Refuse, before allocating anything, a run that cannot fit: processes share the machine's RAM on CPU."""
    needed = memory_estimate(cfg, device.startswith("cuda")) * (1 if device.startswith("cuda") else processes)
    free, where = available_memory(device)
    need(needed <= free, f"this run needs about {needed / 2**30:.1f} GiB (batch_size {cfg.batch_size} x block_size "
         f"{cfg.model.block_size}) but {where} has {free / 2**30:.1f} GiB free; lower --batch_size (raise "
         "--grad_accum to keep the tokens per step) or --block_size")


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
    run.history = _log_until(os.path.join(run.cfg.out_dir, "log.jsonl"), run.start_step, run.master)


def _log_until(log_path: str, step: int, say: bool) -> list[dict]:
    """The log's records up to `step` (a resumed run continues from its checkpoint, not from its last line).
    A torn line (a crash or a full disk mid-write) is dropped, and said; Progress rewrites the log."""
    if not os.path.exists(log_path):
        return []
    history, torn = [], 0
    with open(log_path, errors="replace") as f:
        for line in f:
            try:
                h = json.loads(line)
            except ValueError:
                h = None
            if isinstance(h, dict) and isinstance(h.get("step"), int):
                history.append(h)
            elif line.strip():
                torn += 1
    if torn and say:
        print(f"note: dropped {torn} torn line(s) of {log_path} (a crash or a full disk mid-write)")
    return [h for h in history if h["step"] <= step]


class Interrupted(KeyboardInterrupt):
    """Stop at once: a second signal, or one outside the loop. `kept` says what the run keeps."""

    def __init__(self, signum: int, kept: str):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.kept = signum, kept


class StopOnSignal:
    """Ctrl-C (SIGINT), preemption (SIGTERM: Slurm, docker stop, timeout) and a closed terminal (SIGHUP)
    ask the loop to stop after the current step, which then writes its checkpoint; a second signal, or one
    outside the loop (tokenising, the final plots), stops at once (Interrupted). SIGXFSZ is ignored, so a
    file-size limit fails the write (OSError, one line) instead of killing the process. Only the main
    thread can own signal handlers; elsewhere this does nothing."""
    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.signum, self.in_loop, self.run_dir, self.ckpt_step = None, False, None, None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def kept(self) -> str:
        if self.ckpt_step is not None:
            return (f"its checkpoint (step {self.ckpt_step}) is kept; continue with python train.py --resume "
                    f"--out_dir={self.run_dir}")
        return f"it wrote no checkpoint ({self.run_dir} holds its log)" if self.run_dir else "nothing was written"

    @contextlib.contextmanager
    def loop(self):
        """Inside, a first signal only asks the loop to stop after its step."""
        self.in_loop = True
        try:
            yield
        finally:
            self.in_loop = False

    def __enter__(self):
        self.active = threading.current_thread() is threading.main_thread()
        if self.active:
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
            self.previous[signal.SIGXFSZ] = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        return self

    def _handle(self, signum, frame):
        first, self.signum = self.signum is None, self.signum or signum
        if not (first and self.in_loop):
            raise Interrupted(signum, self.kept())

    def __exit__(self, *exc):
        if self.active:
            for s, handler in self.previous.items():
                signal.signal(s, handler)


# ----------------------------------------------------------------------------- progress lines, the header, plots

class Progress:
    """Rank 0's bookkeeping between progress lines: the throughput window (steps, tokens and this process's
    FLOPs since the last line, timed without evaluations and checkpoint writes), QK-Clip's per-module peak
    max logit and clipped-head count, and the JSONL log."""

    def __init__(self, run, stop: int, tokens_per_step: int, peak: float | None, t_start: float):
        self.run, self.stop, self.tokens_per_step, self.peak, self.t_start = run, stop, tokens_per_step, peak, t_start
        self.t_loop, self.train_time = time.time(), 0.0
        self.logit_peak = self.clipped = self.stats = None
        log_path = os.path.join(run.cfg.out_dir, "log.jsonl")   # a resumed run's: up to its checkpoint
        write_atomically(log_path, lambda f: f.writelines((json.dumps(h) + "\n").encode() for h in run.history))
        self.log_file = open(log_path, "a")
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
        try:
            self.log_file.write(json.dumps(rec) + "\n")
            self.log_file.flush()
        except OSError as e:
            raise SystemExit(f"error: cannot write {self.log_file.name}: {e.strerror} (a full disk or a file-size "
                             "limit?); its checkpoint, if any, is unchanged") from None

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
        line += f" | image acc {ev['vision_acc']:.3f} on {ev['vision_n']} questions (blind {ev['vision_blind']:.3f})"
    print(line + f" | {seconds:.1f} s", flush=True)


def plot_losses(history: list[dict], path: str):
    """Left: the batch loss of logged steps and the eval losses; right (vision runs): image accuracy."""
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
