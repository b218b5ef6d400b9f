"""A trainer a user can trust: one folder per run (two launches into one folder: one refuses), a bare
--resume that continues the run exactly, Ctrl-C, SIGTERM, SIGHUP and SIGKILL at any moment without losing
or tearing a checkpoint, a full disk or a torn log in one line, a data cache that follows its files, one
clear line for every bad input, and conventional command lines across the project's scripts."""
import concurrent.futures
import fcntl
import glob
import json
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import fields

import numpy as np
import pytest
import torch

import data
import runs
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


def _cli(args: list[str], shell_prefix: str = "") -> subprocess.Popen:
    """train.py in its own process, its output captured (a shell prefix such as `ulimit -f N;` applies to it)."""
    cmd = shlex.join([sys.executable, os.path.join(ROOT, "train.py")] + args)
    return subprocess.Popen(["bash", "-c", f"{shell_prefix}exec {cmd}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_launches_into_one_folder_one_trains_and_the_other_refuses(corpus, tmp_path):
    """Issue 34's race: the same command twice at once, seeds 1 and 2. The folder's flock lets one train;
    the other stops in one line (in use, or, had the first finished already, holds another run)."""
    run_dir = tmp_path / "twin"
    args = [f"--{k}={v}" for k, v in dict(TINY, data=corpus, max_iters=8).items()] + [f"--out_dir={run_dir}"]
    procs = [_cli(args + [f"--seed={seed}"]) for seed in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 1], (codes, [err[-2000:] for _, err in outs])
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    message = outs[loser][1].strip()
    assert re.fullmatch(r"error: .*(is in use by another train\.py|holds another run).*", message), message
    assert torch.load(run_dir / "ckpt.pt", weights_only=True)["run_config"]["seed"] == winner + 1
    steps = [json.loads(line)["step"] for line in open(run_dir / "log.jsonl")]
    assert steps == list(range(1, 9))                                            # one run's log, not two interleaved


def test_a_claimed_folder_is_refused_for_new_runs_and_resumes(corpus, tmp_path):
    kw = dict(TINY, data=corpus, max_iters=2)
    run_dir = tmp_path / "held"
    train.train(**kw, out_dir=str(run_dir), stop_iter=1)
    fd = os.open(run_dir / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)                     # another process writing it (its own open file description)
    try:
        for extra in (dict(resume=True), dict(overwrite=True)):
            with pytest.raises(SystemExit, match=r"held is in use by another train.py that is still running"):
                train.train(**kw, out_dir=str(run_dir), **extra)
        assert torch.load(run_dir / "ckpt.pt", weights_only=True)["step"] == 1
    finally:
        os.close(fd)                                    # that process ended: the kernel dropped its lock
    assert train.train(resume=True, out_dir=str(run_dir))["steps"] == 2


def test_out_latest_names_the_newest_run_in_every_command(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kw = dict(TINY, data=corpus, max_iters=4, ckpt_interval=2)
    first = train.train(**kw)["out_dir"]
    second = train.train(**kw, stop_iter=2)["out_dir"]
    resumed = train.train(resume=True, out_dir="out/latest")                    # the natural name of the newest run
    assert resumed["out_dir"] == second and resumed["steps"] == 4
    assert os.readlink("out/latest") == os.path.basename(second)                # not a link to itself
    assert train.train(resume=True)["finished_before"]                           # and a bare --resume still finds it
    train.train(**dict(kw, lr=1e-2), out_dir="out/latest", overwrite=True)      # replaces the newest run in place
    assert os.readlink("out/latest") == os.path.basename(second)
    assert sorted(os.listdir("out")) == sorted(["latest", os.path.basename(first), os.path.basename(second)])
    os.remove("out/latest")
    os.mkdir("out/latest")                                                       # a real folder of that name
    train.train(**kw)
    assert os.path.isdir("out/latest") and not os.path.islink("out/latest") and not glob.glob("out/latest.*")


def test_a_bare_resume_names_the_run_that_can_continue_and_a_finished_run_says_so(corpus, tmp_path, monkeypatch,
                                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    kw = dict(TINY, data=corpus, max_iters=4, ckpt_interval=2)
    good = train.train(**kw, stop_iter=2)["out_dir"]
    real_forward = GPT.forward
    monkeypatch.setattr(GPT, "forward", lambda self, *a, **k: (None, real_forward(self, *a, **k)[1] * float("nan")))
    with pytest.raises(train.TrainingDiverged):
        train.train(**kw)                                                        # the newest run: diverged at step 1
    monkeypatch.setattr(GPT, "forward", real_forward)
    with pytest.raises(SystemExit, match=rf"out/latest \(out/run-[-\d]+\) diverged .*the newest run that can continue "
                                         rf"is {good}: python train.py --resume --out_dir={good}$"):
        train.train(resume=True)
    assert train.main([f"--out_dir={good}", "--resume"]) == 0                   # continues it to the end
    capsys.readouterr()
    assert train.main([f"--out_dir={good}", "--resume"]) == 0                   # finished: nothing to do, said
    assert capsys.readouterr().out.strip() == (f"nothing to do: {good} already finished (step 4 = its max_iters); "
                                               "to train longer, start a new run with a larger --max_iters")


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
    assert resumed["vision_acc"] == straight["vision_acc"]


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
    assert last.startswith("interrupted by SIGINT: stopped at step 3 and wrote its checkpoint; continue with "
                           "python train.py --resume")
    assert torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)["step"] == 3
    monkeypatch.setattr(GPT, "forward", real_forward)
    train.train(resume=True, out_dir=str(tmp_path / "split"))
    _assert_same_weights(_weights(tmp_path / "straight"), _weights(tmp_path / "split"))


def test_sigterm_stops_after_the_step_writes_its_checkpoint_and_resume_is_exact(corpus, tmp_path):
    """Preemption (Slurm, docker stop, timeout) sends SIGTERM: handled like Ctrl-C, exit 143."""
    kw = dict(TINY, data=corpus, max_iters=12, ckpt_interval=100)
    run_dir = tmp_path / "preempted"
    proc = _cli([f"--{k}={v}" for k, v in kw.items()] + [f"--out_dir={run_dir}"])
    log = run_dir / "log.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and (not log.exists() or len(log.read_text().splitlines()) < 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    m = re.fullmatch(r"interrupted by SIGTERM: stopped at step (\d+) and wrote its checkpoint; continue with "
                     rf"python train.py --resume --out_dir={run_dir}", out.strip().splitlines()[-1])
    assert m and "Traceback" not in err, (out[-500:], err[-2000:])
    assert torch.load(run_dir / "ckpt.pt", weights_only=True)["step"] == int(m.group(1)) < 12
    train.train(resume=True, out_dir=str(run_dir))
    train.train(**kw, out_dir=str(tmp_path / "straight"))
    _assert_same_weights(_weights(tmp_path / "straight"), _weights(run_dir))


def test_sighup_saves_and_a_second_signal_or_one_while_tokenising_stops_at_once(corpus, tmp_path, monkeypatch,
                                                                                capsys):
    kw = dict(TINY, data=corpus, max_iters=6, ckpt_interval=2)
    argv = [f"--{k}={v}" for k, v in kw.items()]
    real_forward, calls = GPT.forward, {"n": 0}

    def signals_in_step_3(*signums):
        def forward(self, *a, **k):                                    # grad_accum 2: the 5th micro-step is in step 3
            if self.training:
                calls["n"] += 1
                if calls["n"] == 5:
                    for s in signums:
                        signal.raise_signal(s)
            return real_forward(self, *a, **k)
        return forward

    calls["n"] = 0
    monkeypatch.setattr(GPT, "forward", signals_in_step_3(signal.SIGHUP))       # a closed terminal
    assert train.main(argv + [f"--out_dir={tmp_path / 'hup'}"]) == 128 + signal.SIGHUP
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("interrupted by SIGHUP: stopped at step 3")
    assert torch.load(tmp_path / "hup" / "ckpt.pt", weights_only=True)["step"] == 3
    calls["n"] = 0
    monkeypatch.setattr(GPT, "forward", signals_in_step_3(signal.SIGTERM, signal.SIGTERM))
    assert train.main(argv + [f"--out_dir={tmp_path / 'twice'}"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == (f"interrupted by SIGTERM: stopped at once; its checkpoint (step 2) is "
                                               f"kept; continue with python train.py --resume --out_dir={tmp_path / 'twice'}")
    assert torch.load(tmp_path / "twice" / "ckpt.pt", weights_only=True)["step"] == 2
    monkeypatch.setattr(GPT, "forward", real_forward)
    monkeypatch.setattr(data, "prepare", lambda *a, **k: signal.raise_signal(signal.SIGINT))   # Ctrl-C while tokenising
    assert train.main(argv + [f"--out_dir={tmp_path / 'early'}"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted by SIGINT: stopped at once; nothing was written"
    assert not (tmp_path / "early").exists()


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
        assert glob.glob(str(run_dir / "ckpt.pt.*.tmp"))                          # the torn bytes went elsewhere
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


def test_a_full_disk_is_one_line_and_keeps_the_old_checkpoint(corpus, tmp_path):
    """`ulimit -f` below a checkpoint's size: the write fails (SIGXFSZ is ignored, so as EFBIG), one line."""
    kw = dict(TINY, data=corpus, max_iters=4, ckpt_interval=2)
    run_dir = tmp_path / "full"
    train.train(**kw, out_dir=str(run_dir), stop_iter=2)
    before = (run_dir / "ckpt.pt").read_bytes()
    proc = _cli(["--resume", f"--out_dir={run_dir}"], shell_prefix=f"ulimit -f {len(before) // 2048}; ")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-2000:]
    assert re.fullmatch(rf"error: cannot write {run_dir}/ckpt.pt: File too large .*is unchanged", err.strip()), err[-2000:]
    assert (run_dir / "ckpt.pt").read_bytes() == before and not glob.glob(str(run_dir / "*.tmp"))


def test_writes_never_follow_planted_symlinks_and_a_torn_log_line_is_dropped(corpus, tmp_path, capsys):
    kw = dict(TINY, data=corpus, max_iters=4, ckpt_interval=2)
    run_dir = tmp_path / "run"
    train.train(**kw, out_dir=str(run_dir), stop_iter=2)
    victim = tmp_path / "victim.txt"
    victim.write_text("a file outside the run folder")
    for name in ("ckpt.pt.tmp", f"ckpt.pt.{os.getpid()}.tmp", f"log.jsonl.{os.getpid()}.tmp"):
        os.symlink(victim, run_dir / name)                 # this process's own temporary names included
    with open(run_dir / "log.jsonl", "a") as f:
        f.write('{"step": 3, "batch_lo')                   # what a full disk or a kill mid-write leaves
    capsys.readouterr()
    train.train(resume=True, out_dir=str(run_dir))
    assert "note: dropped 1 torn line(s)" in capsys.readouterr().out
    assert victim.read_text() == "a file outside the run folder" and not glob.glob(str(run_dir / "*.tmp"))
    assert [json.loads(line)["step"] for line in open(run_dir / "log.jsonl")] == [1, 2, 3, 4]
    assert torch.load(run_dir / "ckpt.pt", weights_only=True)["step"] == 4


# ------------------------------------------------------------------ the data cache

def test_the_data_cache_follows_every_file_and_the_tokenisation(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("The first file of a folder corpus. " * 20)
    (folder / "sub" / "b.txt").write_text("The second file, one folder down. " * 20)
    size = lambda f: len(data.load_split(f, "train")) + len(data.load_split(f, "val"))  # noqa: E731
    first = data.prepare(str(folder))
    with open(folder / "sub" / "b.txt", "a") as f:         # neither folder's size nor its mtime changes
        f.write(" appended words" * 500)
    second = data.prepare(str(folder))
    assert second != first and size(second) > size(first) + 500
    monkeypatch.setattr(data, "TOKENIZE_VERSION", data.TOKENIZE_VERSION + 1)
    assert data.prepare(str(folder)) != second and data._cache_name("shakespeare").endswith(f"-t{data.TOKENIZE_VERSION}")
    plain, bom = tmp_path / "plain.txt", tmp_path / "bom.txt"           # a BOM is an editor's mark, not text
    plain.write_text("Text saved by an editor that marks UTF-8. " * 10)
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    same = [np.array(data.load_split(data.prepare(str(p)), "train")) for p in (plain, bom)]
    assert np.array_equal(*same)
    # two jobs tokenising one corpus at once each publish a whole cache, never a half-written one
    race = tmp_path / "race.txt"
    race.write_text("Two experiments side by side tokenise this file at the same moment. " * 200)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(data.prepare, [str(race)] * 2))
    assert folders[0] == folders[1] and size(folders[0]) == len(data.get_tokenizer().encode_ordinary(race.read_text())) + 1
    assert not glob.glob(str(tmp_path / "cache" / "*" / "*.tmp"))


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
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)                                                             # reading it would block forever
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
        # values no check bounded before (issue 34): each used to end in a traceback or train on silently
        ([data, "--seed=1180591620717411303424"], "too large"),
        ([data, "--lr=1e300"], "too large"),
        ([data, "--mlp_hidden=-5"], ">= 0"),
        ([data, "--n_kv_head=-2", "--pattern=A"], ">= 0"),
        ([data, "--n_kv_head=-2", "--pattern=K"], ">= 0"),                    # no attention layer to use it
        ([data, "--vision_n_layer=-1"], ">= 0"),
        ([data, "--vision_patch_size=0"], "positive"),
        ([data, "--vision_channels=1"], "RGB"),
        ([data, "--vision_patch_size=5"], "longer --block_size"),             # the longest example, not the first
        ([data, "--backend=triton"], "needs a CUDA device"),                 # (the test runs without the interpreter)
        ([data, "--threads=100000"], "CPUs"),
        ([data, "--block_size=100000"], "needs about .* GiB"),
        ([data, "--batch_size=100000"], "needs about .* GiB"),
        ([data, "--vocab_size=100", "--vision_ratio=0"], "beyond --vocab_size"),   # found by reading the data
        (["--data=/dev/null"], "not a regular file"),
        ([f"--data={fifo}"], "not a regular file"),
    ]


def test_every_bad_input_is_one_clear_line(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tiny = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=32", "--max_iters=1", "--threads=1"]
    for argv, expected in _bad_inputs(tmp_path, corpus):
        with pytest.raises(SystemExit) as info:
            train.main(tiny + argv)
        message = str(info.value.code)
        assert message.startswith("error: ") and "\n" not in message, (argv, message)
        assert re.search(expected, message), (argv, message)
    assert not os.path.exists("out")                               # no bad input got as far as writing a run folder


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
        if "resume" not in overrides:   # and none is refused by the memory check with 16 GiB free or an 80 GB GPU
            assert runs.memory_estimate(train.make_config(overrides, cuda=False), cuda=False) < 16 * 2**30, line
            assert runs.memory_estimate(train.make_config(overrides, cuda=True), cuda=True) < 80e9, line


def test_the_memory_estimate_is_within_2x_of_the_cpu_default_s_peak():
    """The CPU default's peak RSS, measured with /usr/bin/time -v (python train.py --max_iters=20
    --eval_interval=10: its steps, two evaluations with 200 image questions, the sample): 1,641,080 kB =
    1603 MiB. The estimate must not be below it (it would let through runs that cannot fit) nor 2x above
    (it would refuse runs that can)."""
    estimate = runs.memory_estimate(train.make_config({}, cuda=False), cuda=False) / 2**20
    assert 1603 <= estimate <= 2 * 1603, estimate


def _has_main(path):
    return 'if __name__ == "__main__":' in open(path).read()


# Every file a user runs: the ones with a main block (concept files are libraries; `python bench.py <op>`
# times them). The fixed names below keep the list from shrinking to nothing unnoticed.
SCRIPTS = sorted(os.path.relpath(p, ROOT) for pattern in ("*.py", "experiments/*.py", "tests/summarize_run.py")
                 for p in glob.glob(os.path.join(ROOT, pattern)) if _has_main(p))
assert {"train.py", "sample.py", "bench.py", "swarm.py", "model.py", "image_tasks.py",
        "tests/summarize_run.py"} <= set(SCRIPTS)


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


@pytest.mark.parametrize("script,argv,expected", [
    ("bench.py", ["--threads=-1", "attnres"], "argument --threads: -1 is outside"),
    ("image_tasks.py", ["--seed=-1"], "--seed=-1 must be in [0, 2^63)"),
    ("experiments/decode_cost.py", ["--contexts=abc"], "argument --contexts: 'abc' is not a valid int"),
    ("experiments/fusion_timing.py", ["--batch_size=0"], "argument --batch_size: 0 is outside"),
    ("experiments/epoch_proxy.py", ["--epochs=-1"], "argument --epochs: -1 is outside"),
    ("experiments/attnres_compare.py", ["--lrs=1e-3,abc"], "argument --lrs: 'abc' is not a valid float"),
    ("experiments/hybrid.py", ["--seeds=101,-2"], "argument --seeds: -2 is outside"),
    ("experiments/muon_vs_adamw.py", ["--steps=0"], "argument --steps: 0 is outside"),
    ("experiments/qk_clip.py", ["--taus=100,abc"], "argument --taus: 'abc' is not a valid float"),
    ("experiments/hybrid.py", ["--lrs=,"], "argument --lrs: ',': give one or more comma-separated values"),
])
def test_other_entry_points_check_their_flags_in_one_line(script, argv, expected, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script] + argv)
    with pytest.raises(SystemExit) as info:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    assert info.value.code == 2
    assert expected in capsys.readouterr().err.strip().splitlines()[-1]


def test_decode_cost_quick_keeps_flags_given_and_swarm_demo_refuses_a_bad_file(tmp_path, monkeypatch, capsys):
    decode_cost = runpy.run_path(os.path.join(ROOT, "experiments", "decode_cost.py"), run_name="decode_cost")
    args = decode_cost["parse_args"](["--quick", "--contexts=32,16"])
    assert args.contexts == [16, 32] and args.n_embd == 32                     # --quick's defaults, the flag given
    path = tmp_path / "orchestrator_seed0.pt"
    for content in (b"", b"not a checkpoint"):
        path.write_bytes(content)
        monkeypatch.setattr(sys, "argv", ["swarm.py", "--demo", f"--out_dir={tmp_path}"])
        with pytest.raises(SystemExit, match=r"^error: .*orchestrator_seed0.pt is not a trained orchestrator"):
            runpy.run_path(os.path.join(ROOT, "swarm.py"), run_name="__main__")
