"""Talk to a trained model, nanoGPT-style: text prompts and image questions from a run's checkpoint.

    python sample.py                                  # out/latest: the first sample is its sample.txt, byte for byte
    python sample.py --prompt="ROMEO:" --num_samples=3 --max_new_tokens=200 --stream
    python sample.py --prompt=FILE:prompt.txt --temperature=1.0 --top_k=50 --seed=7
    python sample.py --scene=3                        # held-out scene 3 of the run's image tasks: truth vs answer
    python sample.py --image=shape.png --question="What colour is the shape?"
    python sample.py --out_dir=out/run-20261206-120000 --device=cpu

The model decodes through its caches (model.GPT.generate): each KDA layer carries a fixed-size state,
each attention layer a KV cache that grows by a key and a value per token. After sampling, one line gives
tokens/s, the prompt's prefill time and the bytes the caches hold (model.decode_cache_bytes), beside what
an all-attention model of the same shape would hold. Past the context (block_size) the KDA layers go on
from their state and the attention layers attend to the last block_size tokens (a sliding window).

An image question goes into the token stream exactly as in training (image_tasks.VisionTasks.tokens):
[IMAGE_START, IMAGE_PAD x n, IMAGE_END] " Q: <question> A:", the image through the run's encoder at its
patch size; the answer is greedy, up to EOT. Samples and answers go to stdout, the other lines to stderr.

train.py writes sample.txt with sample_text() below, so the defaults (prompt "\\n", temperature 0.8,
top_k 200, the run's seed and sample_tokens) reproduce it.
"""
import argparse
import codecs
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch

import data
import runs
from model import GPT, Config, decode_cache_bytes
from vision import EOT, IMAGE_END, IMAGE_PAD, IMAGE_START, image_token_count

PROMPT, TEMPERATURE, TOP_K = "\n", 0.8, 200        # train.py's end-of-run sample (sample.txt)
ANSWER_TOKENS = 16                                  # the longest image answer decoded unless --max_new_tokens
SEPARATOR = "---------------"


# ----------------------------------------------------------------------------- the one sampling path

def decode(model: GPT, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator | None = None,
           temperature: float = TEMPERATURE, top_k: int | None = TOP_K, images=None, autocast=None,
           caches: list | None = None, on_token=None, stats: dict | None = None) -> list[int]:
    """The prompt's ids and the new ones, decoded by model.generate through its caches (prefill, then one
    step per token). on_token(id) sees each new id as it is sampled; returning True stops there. stats (a
    dict) gets prompt, new and seen (tokens through the caches) counts, prefill_s (to the first token) and
    decode_s (first token to last)."""
    device = next(model.parameters()).device
    times, stopped = [], [False]

    def hook(nxt):
        if stats is not None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter())
        stopped[0] = bool(on_token is not None and on_token(int(nxt[0, 0])))
        return stopped[0]

    t0 = time.perf_counter()
    with autocast or contextlib.nullcontext():
        out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens, temperature=temperature,
                             top_k=top_k, images=images, generator=generator, caches=caches,
                             on_token=hook if stats is not None or on_token is not None else None)
    if stats is not None:
        if device.type == "cuda":
            torch.cuda.synchronize()
        new = out.shape[1] - len(prompt_ids)
        first = times[0] if times else time.perf_counter()
        stats.update(prompt=len(prompt_ids), new=new, seen=out.shape[1] - stopped[0], prefill_s=first - t0,
                     decode_s=times[-1] - first if times else 0.0)
    return out[0].tolist()


def sample_text(model: GPT, enc, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator,
                temperature: float = TEMPERATURE, top_k: int | None = TOP_K, autocast=None, on_text=None,
                caches: list | None = None, stats: dict | None = None) -> str:
    """prompt_ids and max_new_tokens sampled tokens as text, ids beyond GPT-2's vocabulary (which only image
    rows use) dropped: train.py's sample.txt and sample.py's samples. on_text(piece) gets the text as it
    comes, prompt first; the pieces add up to the returned text (an incremental UTF-8 decoder holds back a
    character split across tokens)."""
    keep = lambda ids: [t for t in ids if t < enc.n_vocab]                    # noqa: E731
    stream = None
    if on_text is not None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        on_text(decoder.decode(enc.decode_bytes(keep(prompt_ids))))
        stream = lambda t: on_text(decoder.decode(enc.decode_bytes(keep([t])))) and False   # noqa: E731
    ids = decode(model, prompt_ids, max_new_tokens, generator, temperature, top_k, autocast=autocast,
                 caches=caches, on_token=stream, stats=stats)
    if on_text is not None:
        on_text(decoder.decode(b"", final=True))
    return enc.decode(keep(ids))


# ----------------------------------------------------------------------------- a run's model

@dataclass
class Loaded:
    model: GPT
    config: Config
    run: dict              # the run's TrainConfig as saved (seed, vision_tasks, sample_tokens, ...)
    folder: str
    step: int
    device: str
    autocast: object
    enc: object


def load_run(out_dir: str, device: str = "auto", threads: int = 0) -> Loaded:
    """The model of the run in out_dir (default out/latest) from its ckpt.pt (weights_only=True) and saved
    configuration, on device, with train.py's thread count (unless threads) and autocast, so its numbers
    match the run's."""
    folder = out_dir or os.path.join(runs.RUNS_DIR, "latest")
    if not os.path.exists(folder):
        raise SystemExit(f"error: no run at {folder}; train one first (python train.py) or give "
                         "--out_dir=<a run's folder>")
    if not os.path.isdir(folder):
        raise SystemExit(f"error: --out_dir={folder} is a file; give the run's folder (the one holding ckpt.pt)")
    cuda = runs.cuda_for(device)
    path = os.path.join(folder, "ckpt.pt")
    ckpt = runs.load_checkpoint(path, caller="sample.py")
    saved = ckpt["run_config"]
    try:
        config = Config(**saved["model"])
        model = GPT(config)
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise SystemExit(f"error: checkpoint {path} does not fit this version's model "
                         f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}); "
                         f"{runs.CHECKPOINT_FIXES['sample.py'][1]}") from None
    if not cuda:    # as train.py: the same threads give the same float sums, so sample.txt comes out again
        torch.set_num_threads(threads or saved.get("threads") or min(4, os.cpu_count() or 1))
    device = "cuda" if cuda else "cpu"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    return Loaded(model.to(device).eval(), config, saved, folder, int(ckpt["step"]), device, autocast,
                  data.get_tokenizer())


def fresh_caches(loaded: Loaded, tokens: int) -> list[dict]:
    """Per-layer caches for `tokens` tokens: attention buffers of exactly the tokens they will hold, and
    past the context a sliding window of block_size keys (KDA layers need neither: their state is fixed)."""
    window = loaded.config.block_size
    return [dict(max_len=min(tokens, window), window=window) if b.kind == "A" else dict() for b in loaded.model.blocks]


def context_note(config: Config, prompt_len: int, new: int) -> str | None:
    """What happens past the context, in one line (None when prompt + new tokens fit)."""
    W, kinds = config.block_size, config.layer_kinds
    if prompt_len + new <= W:
        return None
    nk, na = kinds.count("K"), kinds.count("A")
    what = [f"the {nk} KDA layer{'s' * (nk != 1)} carr{'y' if nk != 1 else 'ies'} {'their' if nk != 1 else 'its'} "
            "fixed-size state on" + ("" if na else " (no window needed)")] if nk else []
    what += [f"the {na} attention layer{'s' * (na != 1)} attend{'s' * (na == 1)} to the last {W} tokens (a sliding "
             "window)"] if na else []
    return f"note: {prompt_len} + {new} tokens pass the {W}-token context: {' and '.join(what)}"


def cost_line(loaded: Loaded, all_stats: list[dict]) -> tuple[str, dict]:
    """The decode-cost line over the samples' stats (decode's): tokens/s, the prefill, and the caches' bytes
    at the tokens held (KDA fixed + attention growing) beside an all-attention model of the same shape, at
    this length and asymptotically."""
    config, W, stats = loaded.config, loaded.config.block_size, all_stats[-1]
    dtype = torch.bfloat16 if loaded.device == "cuda" else torch.float32
    held = stats["seen"] if "A" not in config.layer_kinds else min(stats["seen"], W)
    kda, attention = decode_cache_bytes(config, held, dtype=dtype)
    full = sum(decode_cache_bytes(replace(config, pattern="A"), min(stats["seen"], W), dtype=dtype))
    per_token = decode_cache_bytes(config, 1, dtype=dtype)[1]
    steps, seconds = sum(s["new"] - 1 for s in all_stats), sum(s["decode_s"] for s in all_stats)
    rate = steps / seconds if steps > 0 and seconds > 0 else float("nan")
    prefill = sum(s["prefill_s"] for s in all_stats) / len(all_stats)
    kinds = config.layer_kinds
    asymptotic = 1 - kinds.count("A") / len(kinds)
    kib = lambda b: f"{b / 1024:,.1f} KiB"                                    # noqa: E731
    layers = lambda n: f"{n} layer{'s' if n != 1 else ''}"                    # noqa: E731
    saved = 1 - (kda + attention) / full
    here = f"{saved * 100:.0f}% less here" if saved >= 0 else f"{-saved * 100:.0f}% more here"
    speed = f"{rate:,.1f} tokens/s" if math.isfinite(rate) else "no decode step timed"
    line = (f"decode {stats['new']} tokens x {len(all_stats)} sample(s): {speed}; prefill "
            f"{stats['prompt']} token(s) in {prefill * 1e3:,.1f} ms | cache at {held} tokens: KDA state {kib(kda)} "
            f"({layers(kinds.count('K'))}, fixed) + attention KV {kib(attention)} ({layers(kinds.count('A'))}, "
            f"+{per_token:,} B/token) = {kib(kda + attention)}; an all-attention model of this shape holds "
            f"{kib(full)}: {here}, {asymptotic * 100:.0f}% less as tokens grow")
    return line, dict(tokens_per_s=rate, prefill_s=prefill, held_tokens=held, kda_bytes=kda,
                      attention_bytes=attention, all_attention_bytes=full)


# ----------------------------------------------------------------------------- image questions

def load_image(path: str) -> torch.Tensor:
    """A PNG (or any format matplotlib reads) -> float32 [3, H, W] in [0, 1]: alpha flattened onto black
    (the training scenes' background), greyscale replicated to RGB."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: --image={path}: no such file")
    import matplotlib.image
    try:
        a = np.asarray(matplotlib.image.imread(path))
    except Exception as e:  # a text file, a truncated PNG, an unknown format
        raise SystemExit(f"error: --image={path} is not an image matplotlib can read ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:120]})") from None
    if a.dtype.kind in "ui":
        a = a / np.iinfo(a.dtype).max
    a = a.astype(np.float32)
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[2] not in (1, 2, 3, 4) or min(a.shape[:2]) < 1:
        raise SystemExit(f"error: --image={path}: an image of shape {a.shape} is not greyscale, RGB or RGBA")
    if a.shape[2] in (2, 4):                                    # alpha: composite onto black
        a = a[..., :-1] * a[..., -1:]
    if a.shape[2] == 1:
        a = np.repeat(a, 3, axis=2)
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


def question_ids(enc, patch: int, height: int, width: int, question: str) -> list[int]:
    """The prompt of an image question, as image_tasks.VisionTasks.tokens builds it for training."""
    n = image_token_count(height, width, patch)
    return [IMAGE_START] + [IMAGE_PAD] * n + [IMAGE_END] + enc.encode_ordinary(" Q: " + question + " A:")


def check_fits(config: Config, ids: list[int], height: int, width: int, what: str):
    """An image question longer than the context stops here, with the pixel limit beside this question."""
    W, p = config.block_size, config.vision_patch_size
    n = image_token_count(height, width, p)
    if len(ids) <= W:
        return
    room = W - (len(ids) - n)                     # image tokens that fit beside this question
    if room < 1:
        raise SystemExit(f"error: the question alone is {len(ids) - n} tokens with the image markers, over the "
                         f"model's {W}-token context; shorten --question")
    side = 2 * p * math.isqrt(room)
    raise SystemExit(f"error: {what} is {width}x{height} pixels (width x height) = {n} image tokens ({p}-px "
                     f"patches merged 2x2); with the question that is {len(ids)} tokens, over the model's {W}-token "
                     f"context: beside this question at most {room} image tokens fit (ceil(width/{2 * p})·"
                     f"ceil(height/{2 * p}) <= {room}, e.g. {side}x{side} pixels)")


def answer(loaded: Loaded, image: torch.Tensor, ids: list[int], max_new_tokens: int,
           stats: dict | None = None) -> list[int]:
    """The model's greedy answer ids to an image question, up to and with EOT (when it came)."""
    out = decode(loaded.model, ids, max_new_tokens, temperature=0, images=[[image]], autocast=loaded.autocast,
                 caches=fresh_caches(loaded, len(ids) + max_new_tokens), on_token=lambda t: t == EOT, stats=stats)
    return out[len(ids):]


# ----------------------------------------------------------------------------- the command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line instead of argparse's usage block
        raise SystemExit(f"error: {message} (python sample.py --help lists every flag)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = _Parser(prog="sample.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                 epilog="--key=value and --key value both work. Defaults are train.py's end-of-run sample, so "
                        "a bare `python sample.py` prints the run's sample.txt again.")
    add = ap.add_argument
    add("--out_dir", default="", metavar="DIR", help="the run's folder, holding ckpt.pt (default: out/latest)")
    add("--prompt", default=PROMPT, metavar="TEXT", help="the text to continue, or FILE:path.txt to read it from a "
        "file (default: a newline, as train.py's sample.txt)")
    add("--num_samples", type=int, default=1, metavar="INT", help="samples to draw, from one generator seeded once "
        "(default 1)")
    add("--max_new_tokens", type=int, default=None, metavar="INT", help="tokens to sample per sample (default: the "
        f"run's sample_tokens, or 200 if it sampled none; an image answer: up to {ANSWER_TOKENS})")
    add("--temperature", type=float, default=TEMPERATURE, metavar="FLOAT", help="softmax temperature; 0 = greedy "
        f"(default {TEMPERATURE}; image answers are always greedy)")
    add("--top_k", type=int, default=TOP_K, metavar="INT", help=f"sample among the k likeliest tokens (default {TOP_K})")
    add("--seed", type=int, default=None, metavar="INT", help="the sampling generator's seed (default: the run's seed)")
    add("--device", default="auto", metavar="DEVICE", help="auto | cpu | cuda (default auto: CUDA if present)")
    add("--threads", type=int, default=0, metavar="INT", help="CPU threads for torch (default 0: the run's own, as "
        "train.py set them, so its sample.txt comes out again bit for bit; 1 is faster on a busy machine)")
    add("--stream", action="store_true", help="print the text token by token as it is sampled")
    add("--image", default=None, metavar="PNG", help="a PNG (RGB, RGBA or greyscale) to ask --question about")
    add("--question", default=None, metavar="TEXT", help="the question about --image, e.g. \"What colour is the "
        "shape?\"")
    add("--scene", type=int, default=None, metavar="N", help="ask held-out (val) scene N of the run's image tasks; "
        "prints its description, the true answer and the model's")
    args = ap.parse_args(argv)
    need = runs.need
    need(args.num_samples >= 1, f"--num_samples={args.num_samples} must be >= 1")
    need(args.max_new_tokens is None or args.max_new_tokens >= 0, f"--max_new_tokens={args.max_new_tokens} must be >= 0")
    need(math.isfinite(args.temperature) and args.temperature >= 0,
         f"--temperature={args.temperature} must be a finite number >= 0")
    need(args.top_k >= 1, f"--top_k={args.top_k} must be >= 1")
    need(args.seed is None or 0 <= args.seed < 2 ** 63, f"--seed={args.seed} must be in [0, 2**63)")
    need(args.device in ("auto", "cpu", "cuda"), f"--device={args.device}: use auto | cpu | cuda")
    need(args.threads >= 0, f"--threads={args.threads} must be >= 0 (0 = the run's own)")
    need(args.scene is None or args.scene >= 0, f"--scene={args.scene} must be >= 0")
    need(args.scene is None or args.image is None, "--scene and --image are two ways to ask one question: give one")
    need((args.image is None) == (args.question is None), "--image and --question go together: --image=path.png "
         "--question=\"...\" (or --scene=N for one of the run's own scenes)")
    need(args.prompt == PROMPT or (args.image is None and args.scene is None),
         "--prompt is for text sampling; an image question takes --question")
    return args


def read_prompt(prompt: str) -> str:
    if not prompt.startswith("FILE:"):
        return prompt
    path = prompt[len("FILE:"):]
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise SystemExit(f"error: --prompt=FILE:{path}: no such file") from None
    except IsADirectoryError:
        raise SystemExit(f"error: --prompt=FILE:{path} is a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise SystemExit(f"error: --prompt=FILE:{path} is not UTF-8 text (invalid byte at position {e.start})") from None
    except OSError as e:
        raise SystemExit(f"error: --prompt=FILE:{path}: cannot read it ({e.strerror})") from None


def info(line: str):
    """A line about the run (not the model's words): to stderr, after what stdout holds so far."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def run(argv: list[str]) -> dict:
    """sample.py's work: prints samples or answers (stdout) and the cost line (stderr); returns what it printed
    as data: {"samples": [...]} or {"question", "answer", "truth", "correct", ...}, and "cost"."""
    args = parse_args(argv)
    loaded = load_run(args.out_dir, args.device, args.threads)
    config, enc = loaded.config, loaded.enc
    seed = loaded.run.get("seed", 1337) if args.seed is None else args.seed
    info(f"{loaded.folder}: step {loaded.step}, {config.n_layer} layers {config.layer_kinds}, width {config.n_embd}, "
         f"context {config.block_size}, {loaded.model.num_params() / 1e6:.2f}M params; {loaded.device}; seed {seed}")
    if args.image is not None or args.scene is not None:
        return ask(loaded, args)
    text = read_prompt(args.prompt)
    ids = enc.encode_ordinary(text)
    runs.need(len(ids) >= 1, "--prompt is empty: give at least one character")
    runs.need("A" not in config.layer_kinds or len(ids) <= config.block_size,
              f"--prompt is {len(ids)} tokens, longer than the model's {config.block_size}-token context that its "
              "attention layers were trained on; shorten it")
    n = args.max_new_tokens if args.max_new_tokens is not None else (loaded.run.get("sample_tokens") or 200)
    if note := context_note(config, len(ids), n):
        info(note)
    generator = torch.Generator(device=loaded.device).manual_seed(seed)
    samples, all_stats, caches = [], [], None
    for _ in range(args.num_samples):
        caches, stats = fresh_caches(loaded, len(ids) + n), {}
        piece = (lambda s: print(s, end="", flush=True)) if args.stream else None
        samples.append(sample_text(loaded.model, enc, ids, n, generator, args.temperature, args.top_k,
                                   autocast=loaded.autocast, on_text=piece, caches=caches, stats=stats))
        all_stats.append(stats)
        print(("" if args.stream else samples[-1]) + "\n" + SEPARATOR, flush=True)
    line, cost = cost_line(loaded, all_stats)
    cost["measured_bytes"] = sum(v.numel() * v.element_size() for c in caches for v in c.values() if torch.is_tensor(v))
    info(line)
    return dict(samples=samples, cost=cost, seed=seed)


def ask(loaded: Loaded, args) -> dict:
    """--scene=N or --image + --question: one greedy answer, printed with the question (and the truth)."""
    config, enc = loaded.config, loaded.enc
    if not config.vision:
        raise SystemExit(f"error: the run in {loaded.folder} was trained without image rows (vision_ratio=0): its "
                         "model has no image encoder; --image and --scene need a run trained with --vision_ratio > 0")
    n = args.max_new_tokens if args.max_new_tokens is not None else ANSWER_TOKENS
    truth = None
    if args.scene is not None:
        import image_tasks
        names = runs.vision_task_names(SimpleNamespace(vision_tasks=loaded.run.get("vision_tasks", "all")))
        tasks = image_tasks.VisionTasks(seed=loaded.run.get("seed", 1337), encoding=enc,
                                        patch=config.vision_patch_size, tasks=names)
        ex = tasks.example("val", args.scene)
        toks, is_answer, images = tasks.tokens(ex)                 # the row training and evaluation see
        ids, image, question, truth = toks[:is_answer.index(True)], images[0], ex["question"], ex["answer"]
        print(f"scene {args.scene} (val, task {ex['task']}, {ex['scene']['size'][1]}x{ex['scene']['size'][0]} "
              f"pixels):{image_tasks.caption(ex['scene'])}")
    else:
        image, question = load_image(args.image), args.question
        ids = question_ids(enc, config.vision_patch_size, image.shape[1], image.shape[2], question)
    check_fits(config, ids, image.shape[1], image.shape[2], f"--image={args.image}" if args.image else "the scene")
    stats = {}
    out = answer(loaded, image, ids, n, stats)
    said = enc.decode([t for t in out if t < enc.n_vocab and t != EOT]).strip()
    stopped = "" if out[-1:] == [EOT] else f" (no EOT within {n} tokens)"
    result = dict(question=question, answer=said, answer_ids=out, prompt_ids=ids)
    if truth is not None:
        right = out == enc.encode_ordinary(" " + truth) + [EOT]     # exactly VisionTasks.evaluate's exact match
        result.update(truth=truth, correct=right)
        print(f"Q: {question}\ntrue answer: {truth} | model: {said}{stopped} ({'correct' if right else 'wrong'})",
              flush=True)
    else:
        print(f"Q: {question}\nA: {said}{stopped}", flush=True)
    if note := context_note(config, len(ids), stats["seen"] - len(ids)):   # only if the answer ran past it
        info(note)
    line, result["cost"] = cost_line(loaded, [stats])
    info(line)
    return result


def main(argv: list[str]) -> int:
    try:
        run(argv)
    except BrokenPipeError:      # `python sample.py | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
