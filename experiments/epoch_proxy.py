"""Will the default GPU run overfit? A scaled-down CPU proxy of its data regime.

The GPU default (train.py, `make_config({}, cuda=True)`) trains the 8-layer, 512-wide model on the
bundled corpora (`--data=all`, 2.28M training tokens) for 300 steps of 16,384 tokens: 4.9M tokens,
2.2 epochs, 0.18 tokens per parameter of the layers (the embedding and output head excluded). This
script keeps both ratios and shrinks everything else to the CPU default model: it cuts the start of
Shakespeare to a corpus whose training split the CPU model sees 3.6 times in the same number of tokens
per layer parameter, trains the CPU default on it, evaluates often, and reports whether text
validation loss is still falling at the end. tests/gpu.sh checks the real run the same way when a GPU
is lent (tests/summarize_run.py --require_falling).

    python experiments/epoch_proxy.py              # ~5 min on 2 CPU cores
    python experiments/epoch_proxy.py --epochs=10  # a deliberately overfitting control

Writes out/epoch_proxy/ (the corpus slice, the run's log, loss.png) and prints the eval table.
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import train  # noqa: E402
from model import GPT  # noqa: E402
from runs import bounded  # noqa: E402


def layer_params(model: GPT) -> int:
    """Parameters of the layers: everything but the embedding, the output head and the vision encoder."""
    skip = {id(model.wte.weight), id(model.lm_head.weight)}
    vision = {id(p) for p in model.vision.parameters()} if model.config.vision else set()
    return sum(p.numel() for p in model.parameters() if id(p) not in skip | vision)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=bounded(float, 0), default=0.0, help="epochs of the slice (default: the GPU default's)")
    p.add_argument("--eval_interval", type=bounded(int, 1), default=40, help="steps between evaluations")
    p.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=1337, help="init, data order and image rows")
    p.add_argument("--out_dir", default="out/epoch_proxy", help="output folder")
    args = p.parse_args()

    gpu = train.make_config({}, cuda=True)
    gpu_tokens = gpu.batch_size * gpu.grad_accum * gpu.model.block_size * gpu.max_iters
    gpu_corpus = len(data.load_split(data.prepare(gpu.data), "train"))
    gpu_ratio = gpu_tokens / layer_params(GPT(gpu.model))
    epochs = args.epochs or gpu_tokens / gpu_corpus

    cpu = train.make_config({}, cuda=False)
    tokens = gpu_ratio * layer_params(GPT(cpu.model))                      # same tokens per layer parameter
    tokens_per_step = cpu.batch_size * cpu.grad_accum * cpu.model.block_size
    steps = max(1, round(tokens / tokens_per_step))
    corpus_tokens = int(steps * tokens_per_step / epochs)                   # train split seen `epochs` times
    # a slice of Shakespeare whose 90% training split holds corpus_tokens
    enc = data.get_tokenizer()
    text = "\n".join(data.shakespeare_documents())
    ids = enc.encode_ordinary(text[: 8 * corpus_tokens])[: int(corpus_tokens / (1 - data.VAL_FRACTION))]
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"shakespeare_{len(ids)}_tokens.txt")
    with open(path, "w") as f:
        f.write(enc.decode(ids))
    print(f"GPU default: {gpu_tokens / 1e6:.2f}M tokens = {gpu_tokens / gpu_corpus:.2f} epochs of {gpu.data}, "
          f"{gpu_ratio:.3f} tokens per layer parameter")
    print(f"proxy: CPU default model, {steps} steps x {tokens_per_step} tokens = {steps * tokens_per_step / 1e6:.3f}M "
          f"tokens, {epochs:.2f} epochs of a {len(ids):,}-token slice of Shakespeare ({path})")
    train.train(data=path, max_iters=steps, eval_interval=args.eval_interval, ckpt_interval=steps,
                sample_tokens=0, seed=args.seed, out_dir=args.out_dir, overwrite=True, device="cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.call([sys.executable, os.path.join(here, "..", "tests", "summarize_run.py"),
                            os.path.join(args.out_dir, "log.jsonl")])


if __name__ == "__main__":
    sys.exit(main())
