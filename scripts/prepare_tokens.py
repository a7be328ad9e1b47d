#!/usr/bin/env python3
"""Train byte-level BPE vocabularies on the prepared Austen corpus and write its token files, once.

  prepare_tokens.py DATA [VOCAB ...]        (default vocabularies: 8192 and 50257)
  prepare_tokens.py --tokenizer DIR --input TEXT --out OUT [--val-fraction F]
      tokenizes TEXT with a Hugging Face model folder's tokenizer.json (DIR/tokenizer.json, or a tokenizer.json
      path) into OUT/train.bin and OUT/val.bin (the last F of the tokens, default 0.1): llm.c's format, uint16
      tokens (version 1) when every id fits, else uint32 (version 2: Llama 3's and Qwen2's 128k-152k
      vocabularies), the tokenizer's vocabulary in slot 3; tokenizer.json is copied beside them, for
      --generate and scripts/sample.py. A document separator (the tokenizer's eos/bos, if any) is not added.

For each vocabulary size V, DATA/tokens/austen-bpe<V>/ holds:
  tokenizer.json   Hugging Face `tokenizers` byte-level BPE (no normaliser; decoding gives back the bytes)
  train.bin        the first 90% of the corpus's tokens, llm.c's format: a header of 256 little-endian
  val.bin          int32 (magic 20240520, version 1, token count, and in slot 3 the vocabulary size, a
                   memtrain extension llm.c ignores), then the tokens as uint16
  .stamp           what it was made from: the corpus's sha256, V, the tokenizers version, this script's
                   format; a different stamp (another corpus, version or V) makes it again
Files are written to a temporary folder that is renamed at the end: an interrupted run leaves nothing.
"""
import hashlib, os, shutil, sys, tempfile

import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FORMAT = "memtrain-tokens-1"
MAGIC, VERSION = 20240520, 1
VAL_FRACTION = 0.1
END_OF_TEXT = "<|endoftext|>"


def write_llmc(path, tokens, vocab):
    wide = vocab > 65536  # version 2: uint32 tokens
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2], header[3] = MAGIC, 2 if wide else VERSION, len(tokens), vocab
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u4" if wide else "<u2").tobytes())


def train_tokenizer(corpus_path, vocab):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([corpus_path], trainer)
    return tok


def prepare(data, vocab):
    corpus = os.path.join(data, "text", "austen.txt")
    text = open(corpus, "rb").read()
    stamp = f"{FORMAT} corpus={hashlib.sha256(text).hexdigest()} vocab={vocab} tokenizers={tokenizers.__version__}\n"
    out = os.path.join(data, "tokens", f"austen-bpe{vocab}")
    try:
        if open(os.path.join(out, ".stamp")).read() == stamp:
            return
    except OSError:
        pass
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=f".tmp-bpe{vocab}-")
    os.chmod(tmp, 0o755)
    try:
        tok = train_tokenizer(corpus, vocab)
        ids = tok.encode(text.decode("utf-8")).ids
        if tok.decode(ids) != text.decode("utf-8"):
            sys.exit(f"prepare_tokens: byte-level BPE {vocab} does not give the corpus back: refusing to write it")
        if max(ids) >= 65536:
            sys.exit(f"prepare_tokens: token id {max(ids)} does not fit uint16")
        n_val = int(len(ids) * VAL_FRACTION)
        tok.save(os.path.join(tmp, "tokenizer.json"))
        write_llmc(os.path.join(tmp, "train.bin"), ids[: len(ids) - n_val], vocab)
        write_llmc(os.path.join(tmp, "val.bin"), ids[len(ids) - n_val:], vocab)
        with open(os.path.join(tmp, ".stamp"), "w") as f:
            f.write(stamp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"prepared {out}: {len(ids)} tokens ({len(ids) - n_val} train, {n_val} validation), "
          f"{tok.get_vocab_size()} learned of {vocab}")


def with_tokenizer(argv):
    import argparse
    ap = argparse.ArgumentParser(prog="prepare_tokens.py --tokenizer")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--val-fraction", type=float, default=VAL_FRACTION)
    a = ap.parse_args(argv)
    path = os.path.join(a.tokenizer, "tokenizer.json") if os.path.isdir(a.tokenizer) else a.tokenizer
    if not os.path.isfile(path):
        sys.exit(f"prepare_tokens: no tokenizer.json at {path} (a Hugging Face model folder holds one)")
    if not 0 <= a.val_fraction < 1:
        sys.exit(f"prepare_tokens: --val-fraction {a.val_fraction} is not in [0, 1)")
    tok = Tokenizer.from_file(path)
    text = open(a.input, encoding="utf-8").read()
    ids = tok.encode(text, add_special_tokens=False).ids
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if ids and max(ids) >= vocab:
        sys.exit(f"prepare_tokens: id {max(ids)} is outside the tokenizer's vocabulary of {vocab}")
    n_val = int(len(ids) * a.val_fraction)
    os.makedirs(a.out, exist_ok=True)
    write_llmc(os.path.join(a.out, "train.bin.tmp"), ids[: len(ids) - n_val], vocab)
    write_llmc(os.path.join(a.out, "val.bin.tmp"), ids[len(ids) - n_val:], vocab)
    os.replace(os.path.join(a.out, "train.bin.tmp"), os.path.join(a.out, "train.bin"))
    os.replace(os.path.join(a.out, "val.bin.tmp"), os.path.join(a.out, "val.bin"))
    if os.path.abspath(path) != os.path.abspath(os.path.join(a.out, "tokenizer.json")):
        shutil.copyfile(path, os.path.join(a.out, "tokenizer.json"))
    print(f"tokenized {a.input} with {path}: {len(ids)} tokens ({len(ids) - n_val} train, {n_val} validation), "
          f"vocabulary {vocab}, {'uint32' if vocab > 65536 else 'uint16'} ids, in {a.out}")


def main():
    if "--tokenizer" in sys.argv[1:]:
        return with_tokenizer(sys.argv[1:])
    data = sys.argv[1]
    for v in [int(a) for a in sys.argv[2:]] or [8192, 50257]:
        prepare(data, v)


if __name__ == "__main__":
    main()
