"""The foundation: data, tokenizer, the decoder, the trainer, checkpoints and DDP."""
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import data
import runs
import train
from model import GPT, Config

# the plain baseline at a tiny size; tests of the default feature set say so explicitly
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, grad_accum=2, eval_iters=2,
            eval_interval=1000, log_interval=1, sample_tokens=0, warmup_iters=2, lr=3e-3, device="cpu",
            pattern="A", residual="standard", vision_ratio=0.0, threads=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~60 KB of English from the stdlib (pydoc's topic help), cached in a temporary folder."""
    import pydoc_data.topics as topics
    text = "\n".join(list(topics.topics.values())[:40])[:60000]
    folder = tmp_path_factory.mktemp("corpus")
    path = folder / "tiny.txt"
    path.write_text(text)
    os.environ["KIMI_DATA_CACHE"] = str(folder / "cache")  # for spawned DDP workers
    data.CACHE_DIR = str(folder / "cache")
    return str(path)


def test_tokenizer_is_gpt2_and_round_trips():
    enc = data.get_tokenizer()
    assert enc.n_vocab == 50257
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's ids
    text = "To be, or not to be: that is the question.\n  Whether 'tis nobler…"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_prepare_writes_uint16_memmaps_that_decode_to_the_text(corpus):
    folder = data.prepare(corpus)
    train_ids, val_ids = data.load_split(folder, "train"), data.load_split(folder, "val")
    assert train_ids.dtype == np.uint16 and len(val_ids) > 0
    assert 0.08 < len(val_ids) / (len(train_ids) + len(val_ids)) < 0.12
    enc = data.get_tokenizer()
    full = enc.decode(train_ids.tolist() + val_ids.tolist())
    assert full.replace("<|endoftext|>", "") == open(corpus).read()
    assert data.prepare(corpus) == folder  # cached, not rebuilt
    x, y = data.get_batch(train_ids, torch.tensor([0, 5]), 8)
    assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])


def test_bad_data_path_is_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        data.prepare(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt files"):
        data.prepare(str(tmp_path / "empty"))


@pytest.mark.parametrize("kw", [dict(pattern="A"), dict(pattern="A", n_kv_head=1), dict(pattern="A", rope="nope"),
                                dict(pattern="A", tie_embeddings=True), dict(pattern="KA"),
                                dict(pattern="KKKA", n_layer=4, residual="attnres_block", attnres_block_size=2)])
def test_model_forward_backward_shapes(kw):
    cfg = Config(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=16, vocab_size=100), **kw})
    m = GPT(cfg)
    idx = torch.randint(0, 100, (3, 11))
    logits, loss = m(idx, idx)
    assert logits.shape == (3, 11, 100) and loss.ndim == 0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("kw", [dict(pattern="A"), dict(pattern="A", n_kv_head=2), dict(pattern="KA"),
                                dict(pattern="KA", residual="attnres_block", attnres_block_size=2)])
def test_cached_decoding_equals_full_forward(kw):
    # KDA layers decode from their recurrent state and conv window, attention layers from the KV cache
    m = GPT(Config(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=100, **kw)).eval()
    idx = torch.randint(0, 100, (2, 13))
    full, _ = m(idx)
    caches = [dict() for _ in m.blocks]
    prefill, _ = m(idx[:, :5], caches=caches)                     # a prompt, then one token at a time
    steps = [prefill] + [m(idx[:, t:t + 1], caches=caches)[0] for t in range(5, 13)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    caches = [dict() for _ in m.blocks]
    m(idx[:, :5], caches=caches)
    two, _ = m(idx[:, 5:9], caches=caches)                        # a multi-token chunk after a cache
    torch.testing.assert_close(two, full[:, 5:9], atol=1e-5, rtol=1e-5)
    out = m.generate(idx[:, :4], 6, temperature=0)
    assert out.shape == (2, 10) and torch.equal(out[:, :4], idx[:, :4])


def test_max_logit_is_recorded_per_head():
    m = GPT(Config(n_layer=1, n_head=4, n_embd=64, block_size=16, vocab_size=100))
    attn = m.attention_layers()[0]
    attn.record_max_logit = True
    idx = torch.randint(0, 100, (2, 9))
    m(idx)
    x = m.blocks[0].norm1(m.wte(idx))
    q = attn.q_proj(x).view(2, 9, 4, 16).transpose(1, 2)
    k = attn.k_proj(x).view(2, 9, 4, 16).transpose(1, 2)
    from model import apply_rope_at
    q, k = apply_rope_at(q, torch.arange(9), 1e4), apply_rope_at(k, torch.arange(9), 1e4)
    logits = (q @ k.transpose(-1, -2)) / 4.0
    logits = logits.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), -1e9)
    torch.testing.assert_close(attn.max_logit, logits.amax(dim=(0, 2, 3)), atol=1e-5, rtol=1e-5)


def test_config_errors_are_one_line_and_list_valid_keys():
    with pytest.raises(SystemExit, match="unknown config key.*valid keys:.*n_layer"):
        train.make_config({"n_layyer": "3"}, cuda=False)
    with pytest.raises(SystemExit, match="not a valid int"):
        train.make_config({"n_layer": "three"}, cuda=False)
    with pytest.raises(SystemExit, match="pattern"):
        train.make_config({"pattern": "KXA"}, cuda=False)
    cfg = train.make_config({"n_layer": "3", "lr": "0.01", "resume": ""}, cuda=False)
    assert cfg.model.n_layer == 3 and cfg.lr == 0.01 and cfg.resume is True


def test_lr_schedules():
    cfg = train.make_config({"lr": 1.0, "warmup_iters": 10, "max_iters": 100, "min_lr_ratio": 0.1}, cuda=False)
    assert train.lr_at(0, cfg) == pytest.approx(0.1) and train.lr_at(9, cfg) == pytest.approx(1.0)
    assert train.lr_at(100, cfg) == pytest.approx(0.1)
    wsd = train.make_config({"lr": 1.0, "warmup_iters": 10, "max_iters": 100, "schedule": "wsd"}, cuda=False)
    assert train.lr_at(50, wsd) == 1.0 and train.lr_at(90, wsd) == pytest.approx(0.55)


def test_training_loss_falls_and_writes_outputs(corpus, tmp_path):
    out = train.train(**dict(TINY, data=corpus, max_iters=40, out_dir=str(tmp_path), eval_interval=40, lr=1e-2))
    losses = [h["batch_loss"] for h in out["history"]]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 2.0
    assert out["final_val_loss"] < np.log(50304) - 2.0  # ln(V) is the loss of a uniform guess
    for name in ("ckpt.pt", "log.jsonl", "loss.png"):
        assert (tmp_path / name).exists()


def test_muonclip_is_the_default_and_logs_max_logits_and_clips(corpus, tmp_path):
    # a tiny tau forces clipping, so the log must show clipped heads and a max-logit plot is written
    out = train.train(**dict(TINY, data=corpus, max_iters=6, out_dir=str(tmp_path), qk_clip_tau=0.05))
    rows = out["history"]
    assert train.make_config({}, cuda=False).optimizer == "muonclip"
    assert all(len(h["max_logit"]) == 2 and len(h["clipped_heads"]) == 2 for h in rows)
    assert sum(sum(h["clipped_heads_since_last"]) for h in rows) > 0
    assert all(p >= m for h in rows for p, m in zip(h["max_logit_peak"], h["max_logit"]))
    assert (tmp_path / "max_logit.png").exists()
    adamw = train.train(**dict(TINY, data=corpus, max_iters=2, out_dir=str(tmp_path / "adamw"), optimizer="adamw"))
    assert "max_logit" not in adamw["history"][-1]


def test_hybrid_attnres_model_trains_through_train_py(corpus, tmp_path):
    out = train.train(**dict(TINY, data=corpus, max_iters=30, out_dir=str(tmp_path), lr=1e-2, n_layer=4,
                             pattern="KKKA", residual="attnres_block", attnres_block_size=2))
    losses = [h["batch_loss"] for h in out["history"]]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    assert len(out["history"][-1]["max_logit"]) == 1          # one attention layer in KKKA


def test_vision_mix_trains_through_train_py(corpus, tmp_path):
    out = train.train(**dict(TINY, data=corpus, max_iters=3, out_dir=str(tmp_path), block_size=96,
                             vision_ratio=0.5, eval_interval=3, vision_n_embd=32, vision_n_layer=1,
                             vision_n_head=2))
    last = out["history"][-1]
    assert 0.0 <= last["vision_acc"] <= 1.0 and "twin_acc" not in last     # twins: 0 by construction here, not asked
    with pytest.raises(SystemExit, match="longer --block_size"):
        train.train(**dict(TINY, data=corpus, max_iters=1, out_dir=str(tmp_path / "short"), vision_ratio=0.5,
                                block_size=16))


def test_resume_reproduces_uninterrupted_run(corpus, tmp_path):
    kw = dict(TINY, data=corpus, max_iters=12, ckpt_interval=3)
    train.train(**kw, out_dir=str(tmp_path / "straight"))
    train.train(**kw, out_dir=str(tmp_path / "split"), stop_iter=6)
    train.train(**kw, out_dir=str(tmp_path / "split"), resume=True)
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 12
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


def test_bad_checkpoints_are_rejected(corpus, tmp_path):
    kw = dict(TINY, data=corpus, max_iters=2, out_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="no checkpoint"):
        train.train(**kw, resume=True)
    train.train(**kw, stop_iter=1)                              # unfinished: a resume loads its weights
    with pytest.raises(SystemExit, match="n_embd=64 differs from the run being resumed"):
        train.train(**dict(kw, n_embd=64, resume=True, max_iters=4))
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    ckpt["format"] = 1                                          # a checkpoint of an older train.py
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with pytest.raises(SystemExit, match="another version of train.py"):
        train.train(out_dir=str(tmp_path), resume=True)
    ckpt["format"] = runs.CHECKPOINT_FORMAT
    ckpt["model"].pop("wte.weight")                             # weights that do not fit the model
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with pytest.raises(SystemExit, match="does not fit this version's model"):
        train.train(out_dir=str(tmp_path), resume=True)
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match="corrupt"):
        train.train(out_dir=str(tmp_path), resume=True)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    kw = dict(TINY, data=corpus, max_iters=10, ckpt_interval=4, out_dir=str(tmp_path))
    calls = {"n": 0}
    real_forward = GPT.forward

    def poisoned(self, *a, **k):  # from the 13th micro-step (step 7) on, the loss is NaN
        logits, loss = real_forward(self, *a, **k)
        if self.training:
            calls["n"] += 1
            if calls["n"] > 12:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(train.TrainingDiverged, match=r"step 6.*this run's last good checkpoint \(step 4\)"):
        train.train(**kw)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 4 and all(torch.isfinite(v).all() for v in ckpt["model"].values())


def _ddp_worker(rank, world, port, kw, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out = train.train(**kw)
    if rank == 0:
        queue.put([h["batch_loss"] for h in out["history"]])


def test_ddp_two_processes_match_single_process(corpus, tmp_path):
    """A vision run: the two processes draw different image rows (micro-batches 0 and 1 of each step),
    and together train exactly what one process trains with twice the accumulation."""
    kw = dict(TINY, data=corpus, max_iters=5, grad_accum=2, vision_ratio=0.5, vision_tasks="color_one,side_one",
              vision_patch_size=8, vision_n_embd=16, vision_n_layer=1, vision_n_head=2, vision_eval_n=4)
    single = train.train(**kw, out_dir=str(tmp_path / "single"))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_ddp_worker, args=(r, 2, port, dict(kw, out_dir=str(tmp_path / "ddp")), queue))
             for r in range(2)]
    for p in procs:
        p.start()
    ddp_losses = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    np.testing.assert_allclose(ddp_losses, [h["batch_loss"] for h in single["history"]], rtol=1e-4)
    a = torch.load(tmp_path / "single" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)["model"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ the main job (issue 14)

@pytest.mark.parametrize("cuda", [False, True])
def test_default_configs_train_every_idea(cuda):
    cfg = train.make_config({}, cuda=cuda)
    m = cfg.model
    assert m.layer_kinds.count("K") == 3 * m.layer_kinds.count("A") > 0 and m.pattern == "KKKA"   # Kimi Linear's 3:1
    assert not m.use_rope                                                   # NoPE attention in the hybrid
    assert m.residual == "attnres_block"
    assert 2 * m.n_layer / m.attnres_block_size <= 8                        # ~8 block summaries at most
    assert m.vision and 0.1 <= cfg.vision_ratio <= 0.25 and cfg.vision_start == 0.0   # early fusion
    assert cfg.optimizer == "muonclip" and cfg.qk_clip_tau > 0
    model = GPT(m)
    from muonclip import MuonClip
    opt = MuonClip.from_model(model, lr=cfg.lr, qk_clip_tau=cfg.qk_clip_tau)
    names = [n for n, _ in opt.attention_modules]
    # QK-Clip watches every softmax attention the optimizer trains: the LM's and the ViT's
    assert len(names) == m.layer_kinds.count("A") + m.vision_n_layer and any(n.startswith("vision") for n in names)


def test_gpu_default_sees_at_most_five_epochs_of_its_corpus():
    cfg = train.make_config({}, cuda=True)
    assert cfg.data == "all"
    n_train = len(data.load_split(data.prepare("all"), "train"))
    tokens = cfg.batch_size * cfg.grad_accum * cfg.model.block_size * cfg.max_iters
    assert 1.0 <= tokens / n_train <= 5.0, tokens / n_train


def test_flop_count_matches_a_hand_count():
    # 1 layer, width 16, 2 heads, SwiGLU 32, vocabulary 64 (head tied to the embedding), T = 8:
    # forward per token = 2 * (q, k, v, o: 4*16*16 + gate, up: 2*16*32 + down: 32*16 + head: 16*64)
    #                   + attention scores and weighted sum over T keys: 4 * 8 * 16
    m = GPT(Config(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, mlp_hidden=32, pattern="A",
                   tie_embeddings=True))
    fwd = 2 * (4 * 16 * 16 + 3 * 16 * 32 + 16 * 64) + 4 * 8 * 16
    assert fwd == 7680 and m.flops_per_token(8) == 3 * fwd
    assert m.training_flops(2, 8) == 2 * 8 * 3 * fwd
    assert m.training_flops(2, 8, head_positions=5) == 2 * 8 * 3 * fwd - 3 * 2 * 16 * 64 * 11
    # a KDA layer (2 heads of 8): its projections, the depthwise conv over q, k, v (3 * 16 channels x 4 taps)
    # and the chunked delta rule with C = 64: 2 * (4*64*8 + 64*16 + 2*64*8 + 6*8*8) per token
    k = GPT(Config(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, mlp_hidden=32, pattern="K",
                   tie_embeddings=True))
    linears = sum(2 * mod.in_features * mod.out_features for mod in k.modules() if isinstance(mod, torch.nn.Linear))
    assert k.flops_per_token(8) == 3 * (linears + 2 * 3 * 16 * 4 + 2 * (4 * 64 * 8 + 64 * 16 + 2 * 64 * 8 + 6 * 64))


def test_flop_count_of_linear_layers_matches_torch_flop_counter():
    """Every nn.Linear the formula counts (the tied head included) is exactly the matmul work torch's
    FlopCounterMode sees in a forward + backward of an attention model (whose attention runs in SDPA,
    which the counter does not see on CPU; the formula adds it separately)."""
    from torch.utils.flop_counter import FlopCounterMode
    cfg = Config(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, pattern="A", tie_embeddings=True)
    m = GPT(cfg)
    idx = torch.randint(0, 96, (3, 16))
    with FlopCounterMode(display=False) as counter:
        _, loss = m(idx, idx)
        loss.backward()
    attention = 3 * 2 * 4 * 16 * 2 * 16 * 3 * 16                     # 3 x layers x 4*T*H*Dh x tokens
    assert counter.get_total_flops() == m.training_flops(3, 16) - attention


def test_attnres_sources_per_read_match_the_forward():
    from attnres import AttnResStream
    for block in (None, 1, 2, 3):
        stream = AttnResStream(7, 8, block_size=block, backend="ref")
        _, weights = stream(torch.randn(2, 3, 8), [lambda h: torch.tanh(h)] * 7, return_weights=True)
        assert stream.sources_per_read() == [len(w) for w in weights], block


def test_vision_flops_count_the_encoder():
    m = GPT(Config(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16, pattern="A", vision=True,
                   vision_patch_size=8, vision_n_embd=16, vision_n_layer=1, vision_n_head=2))
    # a 32 x 32 image at 8-px patches: 16 patches of 3*8*8 values, one ViT block, 4 merged tokens
    N, d = 16, 16
    hand = 2 * N * (192 * d + 2 * d) + 2 * N * (3 * d * d + d * d + 2 * 4 * d * d) + 4 * N * N * d \
        + 2 * (N // 4) * (4 * d * 16 + 16 * 16)
    assert m.vision.flops_per_image(32, 32) == hand
    assert m.training_flops(1, 32, [(32, 32)]) == m.training_flops(1, 32) + 3 * hand


def test_tokens_per_second_covers_its_window_and_excludes_eval_and_checkpoints(corpus, tmp_path, monkeypatch):
    """A fake clock: every micro-step costs 0.5 s (1 s per optimizer step at grad_accum 2), every eval
    forward 10 s and every checkpoint write 50 s. tokens/s must be exactly tokens_per_step / 1 s on every
    log line, including the off-interval last line, and MFU's window must carry the same steps."""
    clock = {"t": 1000.0}
    monkeypatch.setattr(train.time, "time", lambda: clock["t"])
    real_forward, real_save = GPT.forward, runs.save_checkpoint

    def timed_forward(self, *a, **k):
        clock["t"] += 0.5 if self.training else 10.0
        return real_forward(self, *a, **k)

    def timed_save(*a, **k):
        clock["t"] += 50.0
        return real_save(*a, **k)

    monkeypatch.setattr(GPT, "forward", timed_forward)
    monkeypatch.setattr(runs, "save_checkpoint", timed_save)
    out = train.train(**dict(TINY, data=corpus, max_iters=11, log_interval=4, eval_interval=8, ckpt_interval=3,
                             out_dir=str(tmp_path), peak_tflops=1.0))
    rows = out["history"]
    assert [h["step"] for h in rows] == [4, 8, 11] and [h["window_steps"] for h in rows] == [4, 4, 3]
    tokens_per_step = 4 * 32 * 2
    flops_per_step = GPT(train.make_config(dict(TINY), cuda=False).model).training_flops(8, 32)
    for h in rows:
        assert h["tokens_per_s"] == pytest.approx(tokens_per_step), h
        assert h["mfu"] == pytest.approx(flops_per_step / 1e12), h     # per second of training, over 1 TFLOP/s
    assert "val_loss" in rows[1] and "batch_loss" in rows[1] and "eval_train_loss" in rows[1]


def test_vision_rows_differ_per_micro_batch_and_repeat_for_the_same_seed():
    import image_tasks
    tasks = image_tasks.VisionTasks(seed=0, encoding=data.get_tokenizer(), patch=8, tasks=("color_one", "side_one"))
    tokens = np.arange(5000, dtype=np.uint16) % 50000
    offsets = torch.arange(8) * 100
    rows = [train.micro_batch(tokens, offsets, j, 4, 64, tasks, 2, 7) for j in range(2)]
    (x0, y0, im0), (x1, y1, im1) = rows
    assert not torch.equal(x0[:2], x1[:2])                        # ranks 0 and 1 of a step draw different images
    for j, (x, y, _) in enumerate(rows):                           # the text rows are micro-batch j's own offsets
        for r in (2, 3):
            start = int(offsets[4 * j + r])
            assert torch.equal(x[r], torch.from_numpy(tokens[start:start + 64].astype(np.int64)))
    again = train.micro_batch(tokens, offsets, 0, 4, 64, tasks, 2, 7)
    assert torch.equal(again[0], x0) and all(len(r) == 0 for r in im0[2:]) and len(im0[0]) > 0
