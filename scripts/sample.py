#!/usr/bin/env python3
"""Text from a trained memtrain GPT: the prompt is encoded with the run's BPE tokenizer, memtrain samples
the continuation (`memtrain --generate`), and the ids are decoded with the same tokenizer. Run it with the
project venv's python (it has Hugging Face `tokenizers`):

  ~/.cache/memtrain/venv-torch2.11.0-py3.11/bin/python scripts/sample.py \\
      --config examples/configs/gpt_austen_bpe_cpu.ini \\
      --weights runs/gpt_austen_bpe_cpu/checkpoints/model.safetensors --prompt "It is a truth" --tokens 200

Extra arguments go to memtrain (--section.key=value overrides, as in training). The tokenizer is the one
set-up trained for the config's data.tokens (a prepared set such as austen-bpe8192, or the tokenizer.json
beside a token file prepare_tokens.py --tokenizer wrote), the one of model.init_from's folder, or --tokenizer
FILE or DIR (a Hugging Face folder). A byte-level run (no tokenizer anywhere) is decoded as bytes.
"""
import argparse, os, re, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_value(memtrain, config, overrides, section, key):
    text = subprocess.run([memtrain, "--config", config, *overrides, "--print-config"], check=True, capture_output=True,
                          text=True).stdout
    current = None
    for line in text.splitlines():
        if line.startswith("["):
            current = line.strip("[]")
        elif current == section and line.startswith(key + " = "):
            return line[len(key) + 3:]
    return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--prompt", default="\n")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--temperature", default="0.8")
    ap.add_argument("--top-k", default="50")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--build", default=os.environ.get("MEMTRAIN_BUILD", os.path.join(ROOT, "build")))
    args, overrides = ap.parse_known_args()
    memtrain = os.path.join(args.build, "memtrain")
    tokens = config_value(memtrain, args.config, overrides, "data", "tokens")
    init_from = config_value(memtrain, args.config, overrides, "model", "init_from")
    if not args.tokenizer and not tokens and init_from and os.path.isfile(os.path.join(init_from, "tokenizer.json")):
        args.tokenizer = init_from
    if tokens or args.tokenizer:
        from tokenizers import Tokenizer
        path = args.tokenizer
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not path:
            if "/" in tokens or tokens.endswith(".bin"):
                path = os.path.join(os.path.dirname(tokens), "tokenizer.json")
            else:
                data = os.environ.get("MEMTRAIN_DATA", os.path.join(os.path.expanduser("~"), ".cache", "memtrain", "data"))
                path = os.path.join(data, "tokens", tokens, "tokenizer.json")
        tok = Tokenizer.from_file(path)
        encode, decode = (lambda s: tok.encode(s).ids), (lambda ids: tok.decode(ids))
    else:
        encode = lambda s: list(s.encode("utf-8"))
        decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")
    prompt = encode(args.prompt)
    out = subprocess.run([memtrain, "--config", args.config, *overrides, "--generate", str(args.tokens), "--weights",
                          args.weights, "--prompt-ids", ",".join(map(str, prompt)), "--temperature", args.temperature,
                          "--top-k", args.top_k], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr.strip() or out.stdout.strip())
    ids = [int(x) for x in re.search(r"^ids:(.*)$", out.stdout, re.M).group(1).split()]
    print(decode(prompt + ids))


if __name__ == "__main__":
    main()
