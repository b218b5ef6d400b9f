"""A trainer a user can trust: one folder per run, a bare --resume that continues the run exactly,
Ctrl-C and SIGKILL at any moment without losing or tearing a checkpoint, one clear line for every bad
input, and conventional command lines across the project's scripts."""
import glob
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import fields

import pytest
import torch

import train
from model import GPT
from test_train import TINY, corpus  # noqa: F401  (corpus is a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every idea at a tiny size: KDA + attention 3:1, block AttnRes, image rows, MuonClip (the default optimizer)
EVERY_IDEA = dict(TINY, n_layer=4, pattern="KKKA", residual="attnres_block", attnres_block_size=2, vision_ratio=0.5,
                  vision_tasks="color_one,side_one", vision_patch_size=8, vision_n_embd=16, vision_n_layer=1,
                  vision_n_head=2, vision_eval_n=8, eval_interval=3)


def _weights(run_dir) -> dict:
    return torch.load(os.path.join(run_dir, "ckpt.pt"), weights_only=True)["model"]


def _assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------ one run, one folder

def test_runs_get_their_own_folders_and_never_touch_another(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kw = dict(TINY, data=corpus, max_iters=2)
    first = train.train(**kw)["out_dir"]
    log_before = open(os.path.join(first, "log.jsonl"), "rb").read()
    ckpt_before = open(os.path.join(first, "ckpt.pt"), "rb").read()
    second = train.train(**kw)["out_dir"]
    assert first != second and os.path.dirname(first) == os.path.dirname(second) == "out"
    assert os.path.realpath("out/latest") == os.path.realpath(second)
    assert open(os.path.join(first, "log.jsonl"), "rb").read() == log_before        # untouched
    # an explicit --out_dir that holds a run: refused with the choices, nothing written
    with pytest.raises(SystemExit, match=r"holds another run.*--resume.*new --out_dir.*--overwrite"):
        train.train(**dict(kw, lr=1e-2), out_dir=first)
    assert open(os.path.join(first, "ckpt.pt"), "rb").read() == ckpt_before
    # a run that diverges speaks only of its own checkpoints: it wrote none, and the others stay
    real_forward = GPT.forward

    def nan_forward(self, *a, **k):
        logits, loss = real_forward(self, *a, **k)
        return logits, loss * float("nan")

    monkeypatch.setattr(GPT, "forward", nan_forward)
    with pytest.raises(train.TrainingDiverged, match="this run wrote no checkpoint yet"):
        train.train(**kw)
    monkeypatch.setattr(GPT, "forward", real_forward)
    assert open(os.path.join(first, "ckpt.pt"), "rb").read() == ckpt_before
    # --overwrite replaces the run in that folder on purpose
    train.train(**dict(kw, lr=1e-2), out_dir=first, overwrite=True)
    assert open(os.path.join(first, "ckpt.pt"), "rb").read() != ckpt_before


# ------------------------------------------------------------------ resume restores the run

def test_bare_resume_continues_every_idea_bit_for_bit(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kw = dict(EVERY_IDEA, data=corpus, max_iters=6, ckpt_interval=3)
    straight = train.train(**kw, out_dir="straight")
    first = train.train(**kw, stop_iter=3)                        # a new folder under out/
    assert first["steps"] == 3
    with pytest.raises(SystemExit, match=r"--lr=0.5 differs from the run being resumed"):
        train.train(resume=True, lr=0.5)
    resumed = train.train(resume=True)                             # nothing but --resume: out/latest, its config
    assert resumed["steps"] == 6 and resumed["out_dir"] == first["out_dir"]
    _assert_same_weights(_weights("straight"), _weights(first["out_dir"]))
    a = [(h["step"], h["batch_loss"]) for h in straight["history"]]
    b = [(h["step"], h["batch_loss"]) for h in resumed["history"]]
    assert a == b                                                 # the log continues as one run
    assert resumed["vision_acc"] == straight["vision_acc"] and resumed["twin_acc"] == straight["twin_acc"]


def test_ctrl_c_stops_after_the_step_and_writes_its_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    kw = dict(TINY, data=corpus, max_iters=6, ckpt_interval=100)
    train.train(**kw, out_dir=str(tmp_path / "straight"))
    real_forward, calls = GPT.forward, {"n": 0}

    def ctrl_c_in_step_3(self, *a, **k):                          # grad_accum 2: the 5th micro-step is in step 3
        if self.training:
            calls["n"] += 1
            if calls["n"] == 5:
                signal.raise_signal(signal.SIGINT)
        return real_forward(self, *a, **k)

    monkeypatch.setattr(GPT, "forward", ctrl_c_in_step_3)
    argv = [f"--{k}={v}" for k, v in kw.items()] + [f"--out_dir={tmp_path / 'split'}"]
    assert train.main(argv) == 130
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("interrupted: stopped at step 3 and wrote its checkpoint; continue with python train.py --resume")
    assert torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)["step"] == 3
    monkeypatch.setattr(GPT, "forward", real_forward)
    train.train(resume=True, out_dir=str(tmp_path / "split"))
    _assert_same_weights(_weights(tmp_path / "straight"), _weights(tmp_path / "split"))


# ------------------------------------------------------------------ faults: SIGKILL before, during, after a write

def _train_cli(args: list[str], env: dict | None = None, wait: bool = True):
    cmd = [sys.executable, os.path.join(ROOT, "train.py")] + args
    env = {**os.environ, **(env or {})}
    if wait:
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.parametrize("point,kept_step", [("before_checkpoint", 2), ("during_checkpoint", 2), ("after_checkpoint", 4)])
def test_a_kill_at_a_checkpoint_write_never_tears_it_and_resume_is_exact(corpus, tmp_path, point, kept_step):
    kw = dict(TINY, data=corpus, max_iters=6, ckpt_interval=2)
    args = [f"--{k}={v}" for k, v in kw.items()]
    train.train(**kw, out_dir=str(tmp_path / "straight"))
    run_dir = tmp_path / "killed"
    proc = _train_cli(args + [f"--out_dir={run_dir}"], {"KIMI_FAULT": f"{point}@4"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert torch.load(run_dir / "ckpt.pt", weights_only=True)["step"] == kept_step   # whole, and the right one
    if point == "during_checkpoint":
        assert (run_dir / "ckpt.pt.tmp").exists()                                  # the torn bytes went elsewhere
    train.train(resume=True, out_dir=str(run_dir))
    _assert_same_weights(_weights(tmp_path / "straight"), _weights(run_dir))


def test_a_timed_kill_then_resume_continues_or_says_there_is_nothing(corpus, tmp_path):
    kw = dict(TINY, data=corpus, max_iters=30, ckpt_interval=4)
    run_dir = tmp_path / "timed"
    proc = _train_cli([f"--{k}={v}" for k, v in kw.items()] + [f"--out_dir={run_dir}"], wait=False)
    log = run_dir / "log.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and (not log.exists() or len(log.read_text().splitlines()) < 9):
        time.sleep(0.05)
    proc.kill()                                                  # mid-step, mid-write: wherever it is
    proc.wait()
    if not (run_dir / "ckpt.pt").exists():
        with pytest.raises(SystemExit, match="no checkpoint"):
            train.train(resume=True, out_dir=str(run_dir))
        return
    train.train(resume=True, out_dir=str(run_dir))
    train.train(**kw, out_dir=str(tmp_path / "straight"))
    _assert_same_weights(_weights(tmp_path / "straight"), _weights(run_dir))


# ------------------------------------------------------------------ every bad input is one line

def _bad_inputs(tmp_path, corpus):
    binary = tmp_path / "program.txt"
    binary.write_bytes(open(sys.executable, "rb").read()[:20000])              # an ELF executable
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    data = f"--data={corpus}"
    return [
        (["--data=/nonexistent/corpus.txt"], "no such file"),
        ([f"--data={empty}"], "too little text"),
        ([f"--data={binary}"], "not text"),
        ([f"--data={latin1}"], "not UTF-8 text"),
        ([data, "--lr=nan"], "finite"),
        ([data, "--lr=inf"], "finite"),
        ([data, "--lr=-1"], "positive"),
        ([data, "--max_iters=0"], ">= 1"),
        ([data, "--stop_iter=999"], "stop_iter"),
        ([data, "--beta2=1.5"], "beta"),
        ([data, "--vision_ratio=2"], "fractions"),
        ([data, "--device=cuda"] if not torch.cuda.is_available() else [data, "--device=tpu"], "cuda|device"),
        ([data, "--n_embd=100", "--n_head=3"], "divisible"),
        ([data, "--vision_n_embd=30"], "vision_n_embd"),
        ([data, "--block_size=8"], "longer --block_size"),
        ([data, "--pattern=KXA"], "pattern"),
        ([data, "--residual=attnres"], "residual"),
        ([data, "--vision_tasks=juggling"], "vision_tasks"),
        ([data, "--n_layyer=3"], "unknown"),
        ([data, "stray_word"], "unknown argument"),
        ([data, "--lr"], "expected one argument"),
        ([data, f"--out_dir={a_file}"], "is a file"),
        ([data, "--out_dir=/proc/kimi-nano-run"], "cannot write"),
        ([data, "--resume", "--out_dir=/nonexistent/run"], "no checkpoint"),
    ]


def test_every_bad_input_is_one_clear_line(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=32", "--max_iters=1", "--threads=1"]
    for argv, expected in _bad_inputs(tmp_path, corpus):
        with pytest.raises(SystemExit) as info:
            train.main(tiny + argv)
        message = str(info.value.code)
        assert message.startswith("error: ") and "\n" not in message, (argv, message)
        assert re.search(expected, message), (argv, message)
    assert not os.path.exists("out/latest")                        # no bad input got as far as writing a run


def test_help_and_both_flag_forms(capsys):
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for key in [f.name for f in fields(train.TrainConfig) if f.name != "model"] + \
               [f.name for f in fields(train.Config)]:
        assert f"--{key}" in text, key
    flat = " ".join(text.split())                                               # argparse wraps lines
    assert "(default 'muonclip')" in flat and "(default 'all', CPU: 'shakespeare')" in flat   # both devices' defaults
    assert train.parse_args(["--max_iters", "30", "--lr=0.01", "--resume"]) == {"max_iters": "30", "lr": "0.01",
                                                                                "resume": "true"}
    assert train.parse_args(["--steps", "7"]) == {"max_iters": "7"}             # the shared step-count name


def test_every_command_line_in_the_readme_parses():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))        # the README's command blocks
    lines = [line.split("#")[0].strip() for line in re.findall(r"^(?:python|torchrun[^\n]*?) train\.py[^\n]*$", blocks, re.M)]
    assert len(lines) >= 8
    for line in lines:
        args = shlex.split(line.split("train.py", 1)[1])
        overrides = train.parse_args(args)
        if "resume" not in overrides:
            train.make_config(overrides, cuda=False)


def _has_main(path):
    return 'if __name__ == "__main__":' in open(path).read()


# Every file a user runs: the ones with a main block (concept files are libraries; `python bench.py <op>`
# times them). The fixed names below keep the list from shrinking to nothing unnoticed.
SCRIPTS = sorted(os.path.relpath(p, ROOT) for pattern in ("*.py", "experiments/*.py", "tests/summarize_run.py")
                 for p in glob.glob(os.path.join(ROOT, pattern)) if _has_main(p))
assert {"train.py", "bench.py", "swarm.py", "model.py", "image_tasks.py", "tests/summarize_run.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_has_help_and_shares_flag_names(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    assert info.value.code in (0, None)
    text = capsys.readouterr().out
    assert "usage:" in text and "--help" in text
    flags = set(re.findall(r"(--[a-z_]+)", text))
    assert not flags & {"--iters", "--out", "--tag", "--output"}, flags        # one name per meaning
    if script.startswith("experiments/"):
        name = os.path.splitext(os.path.basename(script))[0]
        assert {"--seed", "--out_dir"} <= flags, flags
        assert f"out/{name}" in text.replace(os.sep, "/"), "each experiment writes only its own out/<name>/"
