"""Summarise a training run's log.jsonl as a markdown table, and say whether text val loss was still
falling at the end (the check tests/gpu.sh makes on the default GPU run: no overfitting at <= 5 epochs).

    python tests/summarize_run.py out/log.jsonl [--require_falling]

Exit status 1 with --require_falling when the last eval's val loss is not below the one before it.
"""
import argparse
import json
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="a log.jsonl written by train.py")
    p.add_argument("--require_falling", action="store_true", help="exit 1 unless val loss fell at the last eval")
    args = p.parse_args()
    try:
        rows = [json.loads(line) for line in open(args.log)]
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: cannot read {args.log}: {e}", file=sys.stderr)
        return 2
    evals = [r for r in rows if "val_loss" in r]
    if not evals:
        print(f"error: {args.log} has no eval lines", file=sys.stderr)
        return 2
    vision = "vision_acc" in evals[-1]
    print("| step | tokens | text val loss | " + ("image acc | " if vision else "") + "tok/s |")
    print("|---|---|---|" + ("---|" if vision else "") + "---|")
    for r in evals:
        acc = f"{r['vision_acc']:.3f} | " if vision else ""
        print(f"| {r['step']} | {r['tokens'] / 1e6:.2f}M | {r['val_loss']:.4f} | {acc}{r['tokens_per_s']:,.0f} |")
    if vision:
        print(f"\nimage accuracy on {evals[-1]['vision_n']} held-out questions; best blind answer {evals[-1]['vision_blind']:.3f}")
    falling = len(evals) >= 2 and evals[-1]["val_loss"] < evals[-2]["val_loss"]
    verdict = "still falling" if falling else "NOT falling"
    print(f"text val loss at the end: {verdict}" + (f" ({evals[-2]['val_loss']:.4f} -> {evals[-1]['val_loss']:.4f})"
                                                   if len(evals) >= 2 else " (only one eval)"))
    return 1 if args.require_falling and not falling else 0


if __name__ == "__main__":
    sys.exit(main())
