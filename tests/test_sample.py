"""sample.py: a trained run's checkpoint answers text prompts and image questions, decoding through the
hybrid's fixed-size KDA state; it reproduces the run's sample.txt, streams what it samples, answers the
run's scenes exactly as evaluation scores them, reports the caches' bytes, and ends every bad input with
one line."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import image_tasks
import runs
import sample
from model import GPT, Config
from test_reliability import EVERY_IDEA
from test_train import TINY, corpus  # noqa: F401  (corpus is a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def vision_run(corpus, tmp_path_factory):
    """Every idea at a tiny size (KKKA, block AttnRes, image rows, MuonClip), a few steps; sample.txt written."""
    out = str(tmp_path_factory.mktemp("runs") / "vision")
    import train
    train.train(**dict(EVERY_IDEA, data=corpus, max_iters=8, lr=1e-2, eval_interval=1000, vision_eval_n=4,
                       sample_tokens=24, log_interval=100, out_dir=out))
    return out


@pytest.fixture(scope="module")
def text_run(corpus, tmp_path_factory):
    """The plain baseline (attention only, RoPE, no vision), one step: no sample.txt."""
    out = str(tmp_path_factory.mktemp("runs") / "text")
    import train
    train.train(**dict(TINY, data=corpus, max_iters=1, grad_accum=1, eval_iters=1, out_dir=out))
    return out


def _run(argv, capsys):
    """sample.py in-process on the CPU, where the tiny runs trained (their sample.txt is CPU arithmetic)."""
    result = sample.run(argv + ["--device=cpu"])
    captured = capsys.readouterr()
    return result, captured.out, captured.err


# ------------------------------------------------------------------ text: sample.txt again, determinism, streaming

def test_defaults_reproduce_the_runs_sample_txt_and_the_seed_decides(vision_run, capsys):
    expected = open(os.path.join(vision_run, "sample.txt"), "rb").read()
    result, out, err = _run([f"--out_dir={vision_run}"], capsys)
    assert result["samples"][0].encode() == expected                       # byte for byte
    assert out.encode() == expected + f"\n{sample.SEPARATOR}\n".encode()   # stdout holds only the sample
    assert "step 8, 4 layers KKKA" in err and "seed 1337" in err
    again, _, _ = _run([f"--out_dir={vision_run}", "--num_samples=2", "--seed=1337"], capsys)
    assert again["samples"][0] == result["samples"][0] and again["samples"][1] != again["samples"][0]
    other, _, _ = _run([f"--out_dir={vision_run}", "--seed=7"], capsys)
    assert other["samples"][0] != result["samples"][0]


def test_stream_prints_what_the_batch_path_prints(vision_run, capsys):
    argv = [f"--out_dir={vision_run}", "--prompt=The ", "--num_samples=2", "--max_new_tokens=20", "--temperature=1.5"]
    batch, batch_out, _ = _run(argv, capsys)
    streamed, stream_out, _ = _run(argv + ["--stream"], capsys)
    assert stream_out == batch_out and streamed["samples"] == batch["samples"]
    assert all(s.startswith("The ") for s in batch["samples"])


class _Emits(torch.nn.Module):
    """A stand-in model whose generate emits fixed token ids, to test the text path on split characters."""

    def __init__(self, ids):
        super().__init__()
        self.ids, self.w = ids, torch.nn.Parameter(torch.zeros(1))

    def generate(self, idx, n, on_token=None, **kw):
        for t in self.ids[:n]:
            if on_token is not None and on_token(torch.tensor([[t]])):
                break
        return torch.cat([idx, torch.tensor([self.ids[:n]])], dim=1)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_streamed_pieces_add_up_to_the_text_when_tokens_split_a_character():
    import data
    enc = data.get_tokenizer()
    ids = enc.encode_ordinary("héllo ック 🙂") + [enc.encode_single_token(b"\xe3")] + [50300]   # torn byte, image id
    assert sum(not _is_utf8(enc.decode_single_token_bytes(t)) for t in ids[:-1]) >= 3   # tokens that split a character
    pieces = []
    text = sample.sample_text(_Emits(ids), enc, [198], len(ids), None, on_text=pieces.append)
    assert text == enc.decode([198] + ids[:-1]) and "".join(pieces) == text
    assert "\ufffd" in text                                          # the torn byte is replaced, in both paths


# ------------------------------------------------------------------ image questions

def test_scene_answers_count_exactly_what_evaluate_counts(vision_run, capsys):
    loaded = sample.load_run(vision_run, "cpu")
    run_cfg = loaded.run
    tasks = image_tasks.VisionTasks(seed=run_cfg["seed"], patch=loaded.config.vision_patch_size,
                                    tasks=tuple(run_cfg["vision_tasks"].split(",")))
    right = 0
    for n in range(50):
        ex = tasks.example("val", n)
        longest = len(loaded.enc.encode_ordinary(" " + ex["answer"])) + 1         # the answer and its EOT
        result = sample.ask(loaded, sample.parse_args([f"--scene={n}", f"--max_new_tokens={longest + 1}"]))
        assert result["truth"] == ex["answer"]
        right += result["correct"]
    expected = tasks.evaluate(loaded.model, "val", n=50)
    assert right == round(expected * 50), (right, expected)
    assert 0 < right < 50, right                                    # both kinds of answer occur: the count means something
    # the command line prints the scene's words, its truth and the model's answer
    capsys.readouterr()
    result, out, err = _run([f"--out_dir={vision_run}", "--scene=1"], capsys)
    assert out.startswith("scene 1 (val, task ") and f"true answer: {result['truth']} | model: " in out
    assert re.search(r"\((correct|wrong)\)\n$", out) and "cache at" in err


def test_an_image_file_goes_in_as_training_puts_it(vision_run, tmp_path, capsys):
    from PIL import Image
    loaded = sample.load_run(vision_run, "cpu")
    tasks = image_tasks.VisionTasks(seed=loaded.run["seed"], patch=loaded.config.vision_patch_size,
                                    tasks=("color_one",))
    ex = tasks.example("val", 0)
    toks, is_answer, _ = tasks.tokens(ex)
    H, W = ex["image"].shape[1:]
    assert sample.question_ids(loaded.enc, loaded.config.vision_patch_size, H, W, ex["question"]) == \
        toks[:is_answer.index(True)]                                # the same prompt as training's row
    rgb = (ex["image"].transpose(1, 2, 0) * 255).round().astype(np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    Image.fromarray(np.dstack([rgb, np.full((H, W), 255, np.uint8)])).save(tmp_path / "opaque.png")
    Image.fromarray(np.dstack([rgb, np.zeros((H, W), np.uint8)])).save(tmp_path / "clear.png")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "grey.png")
    img = sample.load_image(str(tmp_path / "rgb.png"))
    assert img.shape == (3, H, W) and img.dtype == torch.float32
    assert (img - torch.from_numpy(ex["image"])).abs().max() <= 0.5 / 255 + 1e-6
    assert torch.equal(sample.load_image(str(tmp_path / "opaque.png")), img)   # RGBA: alpha flattened
    assert sample.load_image(str(tmp_path / "clear.png")).abs().max() == 0     # onto black
    grey = sample.load_image(str(tmp_path / "grey.png"))
    assert torch.equal(grey[0], img[0]) and torch.equal(grey[1], grey[0]) and torch.equal(grey[2], grey[0])
    result, out, _ = _run([f"--out_dir={vision_run}", f"--image={tmp_path / 'rgb.png'}",
                           f"--question={ex['question']}"], capsys)
    assert out == f"Q: {ex['question']}\nA: {result['answer']}" + ("" if result["answer_ids"][-1:] == [50256] else
                                                                   " (no EOT within 16 tokens)") + "\n"


# ------------------------------------------------------------------ the decode-cost line, past the context

def test_cache_line_kda_state_fixed_attention_kv_grows(vision_run, capsys):
    costs = []
    for n in (4, 12, 40):                                            # 40: past the 32-token context
        result, _, err = _run([f"--out_dir={vision_run}", f"--max_new_tokens={n}"], capsys)
        c = result["cost"]
        assert c["measured_bytes"] == c["kda_bytes"] + c["attention_bytes"]      # the formula is what the caches hold
        line = err.strip().splitlines()[-1]
        kda, attention = (float(x.replace(",", "")) for x in re.search(r"KDA state ([\d.,]+) KiB.*attention KV "
                                                                        r"([\d.,]+) KiB", line).groups())
        assert abs(kda - c["kda_bytes"] / 1024) < 0.06 and abs(attention - c["attention_bytes"] / 1024) < 0.06
        assert "75% less as tokens grow" in line and "tokens/s" in line and "prefill 1 token(s)" in line
        costs.append(c)
    assert costs[0]["kda_bytes"] == costs[1]["kda_bytes"] == costs[2]["kda_bytes"] > 0
    assert costs[0]["attention_bytes"] < costs[1]["attention_bytes"] < costs[2]["attention_bytes"]
    assert costs[2]["held_tokens"] == 32                             # the window: the last block_size tokens
    for c in costs:   # below the asymptotic 75% at these lengths: the KDA state is a fixed cost
        assert c["kda_bytes"] + c["attention_bytes"] > 0.25 * c["all_attention_bytes"]
    assert "pass the 32-token context: the 3 KDA layers carry their fixed-size state on and the 1 attention " \
           "layer attends to the last 32 tokens" in err


def test_windowed_attention_past_the_context_attends_to_the_last_block_size_tokens():
    # one RoPE attention layer: past the context, a decode step sees exactly the last W tokens, so its logits
    # are those of a plain forward over them (RoPE depends on distances only); within the context, the
    # window changes nothing
    m = GPT(Config(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64, pattern="A")).eval()
    idx = torch.randint(0, 64, (1, 20))
    caches = [dict(window=8)]
    with torch.no_grad():
        m(idx[:, :5], caches=caches)
        steps = [m(idx[:, t:t + 1], caches=caches)[0][:, -1] for t in range(5, 20)]
        for t in range(5, 20):
            ref = m(idx[:, max(0, t - 7):t + 1])[0][:, -1]
            torch.testing.assert_close(steps[t - 5], ref, atol=1e-5, rtol=1e-5)
    assert caches[0]["len"] == 8 and caches[0]["dropped"] == 12
    torch.manual_seed(0)
    a = m.generate(idx[:, :3], 5, temperature=0)
    b = m.generate(idx[:, :3], 5, temperature=0, caches=[dict(window=8)])
    assert torch.equal(a, b)


# ------------------------------------------------------------------ one line for every bad input

def test_every_bad_input_is_one_line(vision_run, text_run, tmp_path):
    (tmp_path / "notes.txt").write_text("not a picture")
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "torn_run").mkdir()
    (tmp_path / "torn_run" / "ckpt.pt").write_bytes(b"\x80\x02 half a checkpoint")
    ckpt = torch.load(os.path.join(vision_run, "ckpt.pt"), weights_only=True)
    for name, change in (("old_run", lambda c: c.update(format=1)),
                         ("other_model", lambda c: c["run_config"]["model"].update(n_embd=64, n_head=4))):
        (tmp_path / name).mkdir()
        bad = {**ckpt, "run_config": {**ckpt["run_config"], "model": dict(ckpt["run_config"]["model"])}}
        change(bad)
        torch.save(bad, tmp_path / name / "ckpt.pt")
    from PIL import Image
    Image.fromarray(np.zeros((200, 120, 3), np.uint8)).save(tmp_path / "big.png")
    v, t = f"--out_dir={vision_run}", f"--out_dir={text_run}"
    cases = [
        (["--out_dir=/nonexistent/run"], "no run at"),
        ([f"--out_dir={tmp_path / 'notes.txt'}"], "is a file"),
        ([f"--out_dir={tmp_path / 'empty_run'}"], "no checkpoint at .*python train.py"),
        ([f"--out_dir={tmp_path / 'torn_run'}"], "corrupt or not a checkpoint"),
        ([f"--out_dir={tmp_path / 'old_run'}"], "another version of train.py.*format 1"),
        ([f"--out_dir={tmp_path / 'other_model'}"], "does not fit this version's model"),
        ([v, f"--image={tmp_path / 'missing.png'}", "--question=what?"], "no such file"),
        ([v, f"--image={tmp_path / 'notes.txt'}", "--question=what?"], "not an image"),
        ([v, f"--image={tmp_path / 'big.png'}", "--question=What colour is the shape?"],
         r"120x200 pixels \(width x height\) = 104 image tokens.*over the model's 32-token context.*at most \d+ "
         r"image tokens fit.*e\.g\. \d+x\d+ pixels"),
        ([v, f"--image={tmp_path / 'big.png'}"], "go together"),
        ([v, "--scene=1", f"--image={tmp_path / 'big.png'}", "--question=q"], "give one"),
        ([v, "--scene=1", "--prompt=hi"], "--question"),
        ([t, "--scene=0"], "without image rows"),
        ([t, "--prompt=" + "word " * 40], "longer than the model's 32-token context"),
        ([v, "--prompt="], "empty"),
        ([v, f"--prompt=FILE:{tmp_path / 'missing.txt'}"], "no such file"),
        ([v, "--num_samples=0"], ">= 1"),
        ([v, "--num_samples=two"], "invalid int"),
        ([v, "--max_new_tokens=-1"], ">= 0"),
        ([v, "--temperature=-1"], ">= 0"),
        ([v, "--temperature=nan"], "finite"),
        ([v, "--top_k=0"], ">= 1"),
        ([v, "--seed=-1"], "seed"),
        ([v, "--scene=-2"], ">= 0"),
        ([v, "--device=tpu"], "auto | cpu | cuda"),
        ([v, "--threads=-1"], ">= 0"),
        ([v, "--temprature=1"], "unrecognized arguments"),
    ]
    if not torch.cuda.is_available():
        cases.append(([v, "--device=cuda"], "no CUDA device"))
    for argv, expected in cases:
        with pytest.raises(SystemExit) as info:
            sample.run(argv)
        message = str(info.value.code)
        assert message.startswith("error: ") and "\n" not in message, (argv, message)
        assert re.search(expected, message), (argv, message)
    # and from the command line: the one line on stderr, no traceback
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), "--out_dir=/nonexistent/run"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error: no run at") and proc.stderr.count("\n") == 1


def test_the_resume_messages_still_speak_of_resume(tmp_path):
    with pytest.raises(SystemExit, match=r"--resume: no checkpoint at .*train without --resume first"):
        runs.load_checkpoint(str(tmp_path / "ckpt.pt"))


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        sample.parse_args(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out_dir", "--prompt", "--num_samples", "--max_new_tokens", "--temperature", "--top_k", "--seed",
                 "--device", "--threads", "--stream", "--image", "--question", "--scene"):
        assert flag in text, flag
